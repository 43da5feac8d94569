//! `mediaplane bench sfu`: the thesis experiment, side by side for every data plane, in one run.
//! For each participant count N one namespace testbed is built and every (data plane, scenario)
//! runs on it in turn, so the planes share the same machine state.
//!
//! Each (N, scenario) starts with a `kernel-forward` run on the same testbed: no `serve`, so none
//! of mediaplane's programs attached, every copy sent by its publisher straight to its subscriber
//! through the SFU namespace's IP forwarding (see [`conference`]). That run's delay is the floor:
//! every data plane's added delay is its delay minus the floor's, quantile by quantile. The
//! direct path measured inside each plane's own run pays that plane's hooks (XDP on veth copies
//! every packet into a page, TC runs on every packet), so it is reported only as a diagnostic.

use crate::conference::{self, ConferenceResult, ConferenceSpec, Scenario, KERNEL_FORWARD};
use crate::demo::profile_named;
use crate::report;
use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use mediaplane_bench::added_delay::{added_delay, AddedDelayMethod};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::traffic::Profile;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct BenchSfuArgs {
    /// A seconds-long smoke run: N = 2 and 4, one second each.
    #[arg(long)]
    quick: bool,
    /// Data planes to compare (userspace, afxdp, ebpf, ebpf-xdp, ebpf-noxdp: the eBPF plane as it starts
    /// by default, with its XDP pre-filter forced on, off). The kernel-forward floor always
    /// runs first at each N and scenario.
    #[arg(long, value_delimiter = ',', default_value = "userspace,ebpf")]
    dataplanes: Vec<String>,
    /// one-stream, two-streams (voice, video, thesis presets); simulcast, simulcast-plain (the
    /// simulcast preset, where they are the default), simulcast-srtp (the same on SRTP, as
    /// browsers: every copy through the slow path on eBPF); fanout, fanout-srtp-gcm, fanout-srtp-cm
    /// (one publisher to N - 1 subscribers, plain or every participant on SRTP; the encrypted
    /// preset's default).
    #[arg(long, value_delimiter = ',')]
    scenarios: Option<Vec<String>>,
    /// Participant counts (default 2..=12, 16, 32, 64; quick: 2, 4).
    #[arg(long, value_delimiter = ',')]
    sizes: Option<Vec<usize>>,
    /// Traffic preset: voice, video, thesis, simulcast (three VP8 layers per publisher; the
    /// rewrite against plain fan-out of the same copies), or encrypted (video, 1,200 B at 156
    /// packets/s from one publisher: SRTP with AES-GCM and with AES-CM + HMAC against plain RTP).
    #[arg(long, default_value = "voice")]
    preset: String,
    /// Seconds of media per run (default 10; quick: 1).
    #[arg(long)]
    seconds: Option<f64>,
    /// Directory for results.json, results.csv, report.html and plots.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// SFU fan-out: the thesis scenarios for every data plane, side by side.
    Sfu(BenchSfuArgs),
    /// A stranger's flood at twice the forwarding capacity beside established calls.
    Overload(crate::bench_overload::BenchOverloadArgs),
    /// SIP media relay: N concurrent calls over NG through mediaplane (user space, eBPF) and rtpengine.
    Relay(crate::bench_relay::BenchRelayArgs),
    /// RTSP proxy: one camera, 1 to 100 viewers, mediaplane's planes beside gst-rtsp-server restreaming it.
    Rtsp(crate::bench_rtsp::BenchRtspArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Sfu(a) => sfu(a),
        BenchCommand::Overload(a) => crate::bench_overload::run(a),
        BenchCommand::Relay(a) => crate::bench_relay::run(a),
        BenchCommand::Rtsp(a) => crate::bench_rtsp::run(a),
    }
}

fn parse_scenario(s: &str) -> anyhow::Result<Scenario> {
    match s {
        "one-stream" => Ok(Scenario::OneStream),
        "two-streams" => Ok(Scenario::TwoStreams),
        "simulcast" => Ok(Scenario::Simulcast),
        "simulcast-plain" => Ok(Scenario::SimulcastPlain),
        "simulcast-srtp" => Ok(Scenario::SimulcastSrtp),
        "fanout" => Ok(Scenario::Fanout),
        "fanout-srtp-gcm" => Ok(Scenario::FanoutSrtpGcm),
        "fanout-srtp-cm" => Ok(Scenario::FanoutSrtpCm),
        other => bail!(
            "unknown scenario {other:?}: use one-stream, two-streams, simulcast, simulcast-plain, simulcast-srtp, fanout, fanout-srtp-gcm or fanout-srtp-cm"
        ),
    }
}

fn sfu(a: BenchSfuArgs) -> anyhow::Result<()> {
    mediaplane_bench::ensure_root("bench sfu")?;
    let (simulcast, encrypted) = (a.preset == "simulcast", a.preset == "encrypted");
    let profile = if encrypted { Profile { name: "encrypted".into(), ..Profile::video() } } else { profile_named(&a.preset)? };
    let default_scenarios = match (simulcast, encrypted) {
        (true, _) => "simulcast,simulcast-plain",
        (_, true) => "fanout,fanout-srtp-gcm,fanout-srtp-cm",
        _ => "one-stream,two-streams",
    };
    let names = a.scenarios.clone().unwrap_or_else(|| default_scenarios.split(',').map(str::to_string).collect());
    let scenarios: Vec<Scenario> = names.iter().map(|s| parse_scenario(s)).collect::<anyhow::Result<_>>()?;
    if let Some(s) = scenarios.iter().find(|s| s.layered() != simulcast) {
        bail!(
            "scenario {s:?} does not go with preset {:?}: simulcast, simulcast-plain and simulcast-srtp need the simulcast preset, which needs them",
            a.preset
        );
    }
    let sizes = a.sizes.clone().unwrap_or_else(|| if a.quick { vec![2, 4] } else { (2..=12).chain([16, 32, 64]).collect() });
    if sizes.iter().any(|n| !(2..=64).contains(n)) {
        bail!("sizes must be between 2 and 64");
    }
    if a.dataplanes.iter().any(|d| d == KERNEL_FORWARD) {
        bail!("{KERNEL_FORWARD} is the floor and always runs: leave it out of --dataplanes");
    }
    let seconds = a.seconds.unwrap_or(if a.quick { 1.0 } else { 10.0 });
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    // The floor first, then every data plane.
    let planes: Vec<String> = std::iter::once(KERNEL_FORWARD.to_string()).chain(a.dataplanes.iter().cloned()).collect();
    let runs = sizes.len() * scenarios.len() * planes.len();
    let bar = ProgressBar::new(runs as u64);
    bar.set_style(ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}").unwrap().progress_chars("=> "));
    let mut results: Vec<ConferenceResult> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    for &n in &sizes {
        bar.set_message(format!("building testbed N={n}"));
        let tb = Testbed::star(n).with_context(|| format!("testbed N={n}"))?;
        for &scenario in &scenarios {
            // Like the thesis, the default sweep runs two-streams for even N only (halves).
            if scenario == Scenario::TwoStreams && n % 2 == 1 && a.sizes.is_none() {
                bar.inc(planes.len() as u64);
                continue;
            }
            for dp in &planes {
                bar.set_message(format!("N={n} {scenario:?} {dp}"));
                let spec = ConferenceSpec { dataplane: dp.clone(), scenario, profile: profile.clone(), duration: Duration::from_secs_f64(seconds) };
                match conference::run(&tb, &spec, &a.out) {
                    Ok(r) => results.push(r),
                    Err(e) => {
                        bar.println(format!("N={n} {scenario:?} {dp}: failed: {e:#}"));
                        failures.push(format!("N={n} {scenario:?} {dp}: {e:#}"));
                    }
                }
                bar.inc(1);
            }
        }
    }
    bar.finish_with_message("done");
    set_added_delay(&mut results);
    report::print_table(&results);
    let meta = report::RunMeta::collect(&format!("mediaplane bench sfu {}", std::env::args().skip(3).collect::<Vec<_>>().join(" ")), &profile, seconds);
    report::write_all(&a.out, &meta, &results, &failures)?;
    println!("\nresults: {0}/results.json, {0}/results.csv, report: {0}/report.html", a.out.display());
    if !failures.is_empty() {
        bail!("{} run(s) failed:\n{}", failures.len(), failures.join("\n"));
    }
    Ok(())
}

/// Added delay of every data plane run against the `kernel-forward` run at its N and scenario.
fn set_added_delay(results: &mut [ConferenceResult]) {
    let key = |r: &ConferenceResult| (r.participants.len(), r.scenario);
    let floors: Vec<_> = results.iter().filter(|r| r.dataplane == KERNEL_FORWARD && r.copies_received > 0).map(|r| (key(r), r.delay_ns)).collect();
    for r in results.iter_mut().filter(|r| r.dataplane != KERNEL_FORWARD) {
        if let Some((_, floor)) = floors.iter().find(|(k, _)| *k == key(r)) {
            r.floor_delay_ns = Some(*floor);
            r.added_delay_ns = added_delay(&r.delay_ns, floor, AddedDelayMethod::QuantileDifference);
        }
    }
}
