//! `mediaplane demo`: a real multi-party conference on this machine. Participants live in their
//! own network namespaces around an SFU namespace; `mediaplane serve` forwards real UDP media;
//! the demo prints what each participant received, the added delay and the loss per data plane,
//! and removes everything it created.

use crate::conference::{self, ConferenceResult, ConferenceSpec, Scenario};
use anyhow::{bail, Context};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::traffic::Profile;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Participants (each in its own network namespace).
    #[arg(long, default_value_t = 4)]
    participants: usize,
    /// Seconds of media per data plane.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Data planes to run, side by side.
    #[arg(long, value_delimiter = ',', default_value = "userspace,ebpf")]
    dataplanes: Vec<String>,
    /// Traffic preset: voice (G.711, 50 pkt/s, 172 B), video (1.5 Mbit/s, 1200 B), thesis (25 pkt/s, 18 B raw), simulcast (its top layer: VP8, 1.5 Mbit/s, a keyframe a second).
    #[arg(long, default_value = "voice")]
    preset: String,
    /// Low quality to all plus high quality (its own SFU port) to the upper half.
    #[arg(long)]
    two_streams: bool,
    /// Also write the full results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Browsers in the WebRTC scenario (headless Chromium on the room page, WHIP/WHEP); 0 skips it.
    #[arg(long, default_value_t = 3)]
    webrtc_participants: usize,
}

pub fn profile_named(name: &str) -> anyhow::Result<Profile> {
    Ok(match name {
        "voice" => Profile::voice(),
        "video" => Profile::video(),
        "thesis" => Profile::thesis(),
        // The top layer names the run; every layer has its own profile (conference.rs).
        "simulcast" => Profile::simulcast_layer(2),
        other => bail!("unknown preset {other:?}: use voice, video, thesis or simulcast"),
    })
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    mediaplane_bench::ensure_root("the demo")?;
    if !(2..=64).contains(&args.participants) {
        bail!("--participants must be between 2 and 64");
    }
    if !(0.5..=60.0).contains(&args.seconds) {
        bail!("--seconds must be between 0.5 and 60");
    }
    // Asked for browsers and none to run: an error, not a quiet skip (a demo that exits 0 would
    // claim a WebRTC scenario that never ran). `--webrtc-participants 0` skips it on purpose.
    let chromium = match args.webrtc_participants {
        0 => None,
        _ => Some(mediaplane_bench::browser::find_chromium().ok_or_else(|| {
            anyhow::anyhow!("the WebRTC scenario needs chromium (`make deps` installs it); `--webrtc-participants 0` runs the demo without it")
        })?),
    };
    let profile = profile_named(&args.preset)?;
    let scenario = if args.two_streams { Scenario::TwoStreams } else { Scenario::OneStream };
    let tb = Testbed::star(args.participants).context("building the namespace testbed")?;
    let workdir = std::env::temp_dir();
    println!(
        "mediaplane demo: {} participants in network namespaces around SFU namespace {}; {} preset ({} pkt/s, {} B); {:?}; {} s per data plane",
        args.participants, tb.sfu_ns, profile.name, profile.packets_per_sec, profile.packet_size, scenario, args.seconds
    );
    let mut results: Vec<ConferenceResult> = Vec::new();
    let mut failures = Vec::new();
    for dp in &args.dataplanes {
        let spec = ConferenceSpec { dataplane: dp.clone(), scenario, profile: profile.clone(), duration: Duration::from_secs_f64(args.seconds) };
        match conference::run(&tb, &spec, &workdir) {
            Ok(r) => {
                print_participants(&r);
                results.push(r);
            }
            Err(e) => {
                println!("\n[{dp}] could not run: {e:#}");
                failures.push(dp.clone());
            }
        }
    }
    print_side_by_side(&results);
    let mut webrtc_failed = Vec::new();
    if let Some(chromium) = &chromium {
        let n = args.webrtc_participants.min(args.participants);
        for dp in &args.dataplanes {
            match crate::webrtc_demo::run(&tb, dp, n, args.seconds, chromium, &workdir.join(format!("mediaplane-demo-{}", tb.prefix))) {
                Ok(r) => {
                    crate::webrtc_demo::print(&r);
                    if !r.all_decoded {
                        webrtc_failed.push(dp.clone());
                    }
                }
                Err(e) => {
                    println!("\n[{dp}] WebRTC scenario could not run: {e:#}");
                    webrtc_failed.push(dp.clone());
                }
            }
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)?;
        println!("results written to {}", path.display());
    }
    drop(tb);
    let lossy: Vec<_> = results.iter().filter(|r| r.lost > 0 || r.duplicates > 0 || r.unexpected > 0).map(|r| r.dataplane.clone()).collect();
    if !failures.is_empty() {
        bail!("data plane(s) failed to run: {}", failures.join(", "));
    }
    if !lossy.is_empty() {
        bail!("loss, duplicates or unexpected copies with: {}", lossy.join(", "));
    }
    if !webrtc_failed.is_empty() {
        bail!("WebRTC scenario: not every browser decoded every other one with: {}", webrtc_failed.join(", "));
    }
    Ok(())
}

fn us(ns: f64) -> String {
    format!("{:.1}", ns / 1000.0)
}

fn print_participants(r: &ConferenceResult) {
    println!("\n[{}] what each participant received", r.dataplane);
    println!(
        "  {:<12} {:>7} {:>9} {:>9} {:>6} {:>5} {:>10} {:>14} {:>14}",
        "participant", "streams", "expected", "received", "lost", "dup", "unexpected", "delay p50 µs", "delay p99 µs"
    );
    for p in &r.participants {
        println!(
            "  {:<12} {:>7} {:>9} {:>9} {:>6} {:>5} {:>10} {:>14} {:>14}",
            p.participant,
            p.streams,
            p.expected,
            p.received,
            p.lost,
            p.duplicates,
            p.unexpected,
            us(p.delay_ns.p50),
            us(p.delay_ns.p99)
        );
    }
}

fn print_side_by_side(results: &[ConferenceResult]) {
    if results.is_empty() {
        return;
    }
    println!("\nside by side (added delay = through the SFU minus the direct path, same run; per copy;");
    println!("cpu/copy = serve process CPU + BPF program run time, per delivered copy; bpf ns/copy = the BPF part: XDP pre-filter + TC)");
    println!(
        "  {:<10} {:>9} {:>9} {:>7} {:>5} {:>16} {:>16} {:>15} {:>14} {:>13}",
        "dataplane", "copies", "expected", "loss %", "dup", "added p50 µs", "added p99 µs", "direct p50 µs", "cpu/copy ns", "bpf ns/copy"
    );
    for r in results {
        let loss = if r.copies_expected > 0 { 100.0 * r.lost as f64 / r.copies_expected as f64 } else { 0.0 };
        let (a50, a99) = r.added_delay_vs_direct_ns.map(|a| (us(a.p50), us(a.p99))).unwrap_or(("-".into(), "-".into()));
        let bpf = if r.bpf_run_ns > 0 && r.copies_received > 0 { format!("{:.0}", r.bpf_run_ns as f64 / r.copies_received as f64) } else { "-".into() };
        println!(
            "  {:<10} {:>9} {:>9} {:>7.3} {:>5} {:>16} {:>16} {:>15} {:>14} {:>13}",
            r.dataplane,
            r.copies_received,
            r.copies_expected,
            loss,
            r.duplicates,
            a50,
            a99,
            us(r.direct_delay_ns.p50),
            r.cpu_per_copy_ns.map(|c| format!("{c:.0}")).unwrap_or("-".into()),
            bpf
        );
    }
    if results.len() >= 2 {
        let base = &results[0];
        for r in &results[1..] {
            if let (Some(a), Some(b)) = (base.added_delay_vs_direct_ns, r.added_delay_vs_direct_ns) {
                if b.p50 > 0.0 {
                    println!("  added delay p50 ratio {} / {}: {:.1}x", base.dataplane, r.dataplane, a.p50 / b.p50);
                }
            }
        }
    }
}
