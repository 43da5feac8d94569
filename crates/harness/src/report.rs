//! Benchmark output: the console table (shaped like the thesis tables, plus our columns), raw
//! JSON and CSV, and an HTML report with SVG plots and the thesis's own numbers beside ours.

use crate::conference::{ConferenceResult, Scenario, KERNEL_FORWARD};
use mediaplane_bench::traffic::Profile;
use plotters::prelude::*;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// The thesis's measured SFU processing time, seconds: (N, min, max, avg). Seed
/// 000_e9f84557bdc0755e.txt. Its last table is titled "P4 ... two streams" but follows the
/// server-based tables and has server-based magnitudes: it is the Python SFU's two-stream run.
pub const THESIS_P4_ONE: &[(usize, f64, f64, f64)] = &[
    (2, 0.000505, 0.002907, 0.000778),
    (3, 0.000471, 0.004113, 0.000937),
    (4, 0.000467, 0.007507, 0.001134),
    (5, 0.000458, 0.017137, 0.001675),
    (6, 0.000453, 0.015145, 0.001978),
    (7, 0.000456, 0.030355, 0.003095),
    (8, 0.000462, 0.052992, 0.004736),
    (9, 0.000460, 0.106720, 0.009122),
    (10, 0.000484, 0.328883, 0.031889),
    (11, 0.000514, 0.989098, 0.267746),
    (12, 0.000523, 5.958905, 3.986195),
];
pub const THESIS_P4_TWO: &[(usize, f64, f64, f64)] = &[
    (2, 0.000515, 0.002859, 0.000834),
    (4, 0.000484, 0.014854, 0.001210),
    (6, 0.000476, 0.018257, 0.001987),
    (8, 0.000457, 0.051833, 0.003915),
    (10, 0.000486, 0.141570, 0.015084),
];
pub const THESIS_PYTHON_ONE: &[(usize, f64, f64, f64)] = &[(2, 0.010961, 10.913122, 7.860589), (3, 0.015288, 32.523685, 23.351614)];
pub const THESIS_PYTHON_TWO: &[(usize, f64, f64, f64)] = &[(2, 0.013842, 6.811303, 4.585829), (4, 0.019133, 53.473191, 34.797006)];

#[derive(Debug, Clone, Serialize)]
pub struct RunMeta {
    pub command: String,
    pub date_unix: u64,
    pub kernel: String,
    pub cpu: String,
    pub cores: usize,
    pub memory_gib: f64,
    pub git_commit: String,
    pub profile: Profile,
    pub seconds: f64,
}

impl RunMeta {
    pub fn collect(command: &str, profile: &Profile, seconds: f64) -> RunMeta {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpu = read("/proc/cpuinfo").lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).unwrap_or("?").trim().to_string();
        let mem_kb: f64 = read("/proc/meminfo").lines().next().and_then(|l| l.split_whitespace().nth(1)?.parse().ok()).unwrap_or(0.0);
        let git = std::process::Command::new("git").args(["rev-parse", "--short", "HEAD"]).output().ok().filter(|o| o.status.success());
        RunMeta {
            command: command.trim().to_string(),
            date_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            cpu,
            cores: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            memory_gib: mem_kb / 1024.0 / 1024.0,
            git_commit: git.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_else(|| "unknown".into()),
            profile: profile.clone(),
            seconds,
        }
    }
}

fn scen(s: Scenario) -> &'static str {
    match s {
        Scenario::OneStream => "one-stream",
        Scenario::TwoStreams => "two-streams",
        Scenario::Simulcast => "simulcast",
        Scenario::SimulcastPlain => "simulcast-plain",
        Scenario::SimulcastSrtp => "simulcast-srtp",
        Scenario::Fanout => "fanout",
        Scenario::FanoutSrtpGcm => "fanout-srtp-gcm",
        Scenario::FanoutSrtpCm => "fanout-srtp-cm",
    }
}

fn pct(share: Option<f64>) -> String {
    share.map(|s| format!("{:.2}", s * 100.0)).unwrap_or_default()
}

/// The traffic preset in words: one profile per sender, or the simulcast preset's three layers.
fn preset_text(p: &Profile) -> String {
    if matches!(p.format, mediaplane_bench::traffic::PayloadFormat::Vp8 { .. }) {
        let layers: Vec<String> = (0..3).map(Profile::simulcast_layer).map(|l| format!("{} B at {:.0}/s", l.packet_size, l.packets_per_sec)).collect();
        return format!("Preset simulcast (three VP8 layers per publisher: {})", layers.join(", "));
    }
    format!("Preset {} ({} packets/s per sender, {} B UDP payload)", p.name, p.packets_per_sec, p.packet_size)
}

fn loss_pct(r: &ConferenceResult) -> f64 {
    if r.copies_expected == 0 {
        0.0
    } else {
        100.0 * r.lost as f64 / r.copies_expected as f64
    }
}

const CSV_HEADER: &str = "scenario,n,dataplane,copies_expected,copies_received,bytes_received,lost,loss_pct,duplicates,unexpected,\
delay_min_us,delay_p50_us,delay_mean_us,delay_p99_us,delay_max_us,added_min_us,added_p50_us,added_mean_us,added_p99_us,added_max_us,\
floor_p50_us,floor_p99_us,direct_with_hooks_p50_us,hooks_attached,jitter_us,delay_variation_p99_us,mos_mean,mos_min,cpu_per_copy_ns,bpf_ns_per_copy,serve_cpu_ms,generator_cpu_ms,kernel_share_pct";

fn csv_row(r: &ConferenceResult) -> String {
    let d = &r.delay_ns;
    let a = r.added_delay_ns;
    let af = |f: fn(&mediaplane_bench::added_delay::AddedDelay) -> f64| a.map(|x| format!("{:.2}", f(&x) / 1e3)).unwrap_or_default();
    format!(
        "{},{},{},{},{},{},{},{:.4},{},{},{:.2},{:.2},{:.2},{:.2},{:.2},{},{},{},{},{},{},{},{:.2},{},{:.2},{:.2},{:.3},{:.3},{},{},{:.1},{:.1},{}",
        scen(r.scenario),
        r.participants.len(),
        r.dataplane,
        r.copies_expected,
        r.copies_received,
        r.bytes_received,
        r.lost,
        loss_pct(r),
        r.duplicates,
        r.unexpected,
        d.min / 1e3,
        d.p50 / 1e3,
        d.mean / 1e3,
        d.p99 / 1e3,
        d.max / 1e3,
        af(|x| x.min),
        af(|x| x.p50),
        af(|x| x.mean),
        af(|x| x.p99),
        af(|x| x.max),
        r.floor_delay_ns.map(|f| format!("{:.2}", f.p50 / 1e3)).unwrap_or_default(),
        r.floor_delay_ns.map(|f| format!("{:.2}", f.p99 / 1e3)).unwrap_or_default(),
        r.direct_delay_ns.p50 / 1e3,
        r.hooks_attached.as_ref().map(|h| h.len().to_string()).unwrap_or_default(),
        r.jitter_ns_mean / 1e3,
        r.delay_variation_p99_ns / 1e3,
        r.mos_mean,
        r.mos_min,
        r.cpu_per_copy_ns.map(|c| format!("{c:.0}")).unwrap_or_default(),
        bpf_per_copy(r).map(|c| format!("{c:.0}")).unwrap_or_default(),
        r.serve_cpu_ns as f64 / 1e6,
        r.generator_cpu_ns as f64 / 1e6,
        pct(r.kernel_share),
    )
}

/// One line of the simulcast comparison: the same copies with the rewrite (`simulcast`) and
/// without (`simulcast-plain`), same N, same plane, same invocation.
struct SimulcastRow {
    n: usize,
    plane: String,
    rewrite: Cost,
    plain: Option<Cost>,
    share: Option<f64>,
    /// Packets the BPF program handed to the slow path, and RTCP packets the participants sent.
    slow: Option<u64>,
    rtcp: u64,
    lost: u64,
}

/// What a run cost: BPF ns/copy (eBPF planes), CPU ns/copy (serve + BPF), added delay p50 and
/// p99 µs.
#[derive(Clone, Copy)]
struct Cost {
    bpf: Option<f64>,
    cpu: Option<f64>,
    added_p50_us: Option<f64>,
    added_p99_us: Option<f64>,
}

impl Cost {
    fn of(r: &ConferenceResult) -> Cost {
        Cost {
            bpf: bpf_per_copy(r),
            cpu: r.cpu_per_copy_ns,
            added_p50_us: r.added_delay_ns.map(|a| a.p50 / 1e3),
            added_p99_us: r.added_delay_ns.map(|a| a.p99 / 1e3),
        }
    }
}

/// One row of the encrypted comparison: an SRTP fan-out run beside the plain fan-out of the
/// same plane at the same N.
struct EncryptedRow {
    n: usize,
    plane: String,
    scenario: Scenario,
    srtp: Cost,
    plain: Option<Cost>,
    lost: u64,
}

impl EncryptedRow {
    /// What encrypting cost per copy: the SRTP run's CPU per copy minus the plain run's.
    fn crypto_ns(&self) -> Option<f64> {
        self.srtp.cpu.zip(self.plain.and_then(|p| p.cpu)).map(|(s, p)| s - p)
    }

    fn suite(&self) -> &'static str {
        self.scenario.srtp().map_or("-", |s| s.name())
    }

    fn cells(&self) -> [String; 8] {
        let num = |x: Option<f64>, d: usize| x.map(|x| format!("{x:.d$}")).unwrap_or("-".into());
        let plain = |f: fn(&Cost) -> Option<f64>| self.plain.as_ref().and_then(f);
        [
            self.n.to_string(),
            self.plane.clone(),
            self.suite().to_string(),
            num(self.srtp.cpu, 0),
            num(plain(|c| c.cpu), 0),
            num(self.crypto_ns(), 0),
            format!(
                "{} / {} ; {} / {}",
                num(self.srtp.added_p50_us, 1),
                num(plain(|c| c.added_p50_us), 1),
                num(self.srtp.added_p99_us, 1),
                num(plain(|c| c.added_p99_us), 1)
            ),
            self.lost.to_string(),
        ]
    }
}

const ENCRYPTED_HEADER: [&str; 8] = [
    "N",
    "plane",
    "suite",
    "CPU ns/copy SRTP",
    "CPU ns/copy plain",
    "SRTP - plain ns/copy",
    "added p50 µs SRTP / plain ; p99 SRTP / plain",
    "copies lost (SRTP)",
];

fn encrypted_rows(results: &[ConferenceResult]) -> Vec<EncryptedRow> {
    results
        .iter()
        .filter(|r| r.scenario.srtp().is_some() && r.dataplane != KERNEL_FORWARD)
        .map(|r| {
            let n = r.participants.len();
            EncryptedRow {
                n,
                plane: r.dataplane.clone(),
                scenario: r.scenario,
                srtp: Cost::of(r),
                plain: find(results, &r.dataplane, Scenario::Fanout, n).map(Cost::of),
                lost: r.lost,
            }
        })
        .collect()
}

/// What the encrypted comparison is, in words.
const ENCRYPTED_TEXT: &str = "One publisher (p0) sends 1,200-byte video at 156 packets/s; the other N - 1 participants subscribe to it. `fanout`: plain RTP. `fanout-srtp-gcm`, `fanout-srtp-cm`: every participant speaks SRTP (AEAD_AES_128_GCM; AES_CM_128_HMAC_SHA1_80) with keys given at join (the rooms API's `srtp`, SDES): the SFU unprotects each packet once and protects each copy with its subscriber's key, in user space on every plane (the eBPF plane passes an SRTP stream to its slow path). The publisher protects and the subscribers unprotect in the generator, on the floor too (each copy sent straight to its subscriber under the subscriber's key), so the generator's own crypto is in the floor and not in the added delay. CPU ns/copy = the serve process's CPU (and BPF run time) / copies received; SRTP - plain = what encrypting cost per copy on that plane at that N (the unprotect once per publisher packet shared by its copies, each copy's protect, its bigger send).";

/// The targets for CPU per encrypted copy, ns.
fn encrypted_target_ns(s: Scenario) -> f64 {
    if s == Scenario::FanoutSrtpGcm {
        1500.0
    } else {
        2500.0
    }
}

impl SimulcastRow {
    fn cells(&self) -> [String; 11] {
        let num = |x: Option<f64>, d: usize| x.map(|x| format!("{x:.d$}")).unwrap_or("-".into());
        let plain = |f: fn(&Cost) -> Option<f64>| self.plain.as_ref().and_then(f);
        let ratio =
            |f: fn(&Cost) -> Option<f64>| f(&self.rewrite).zip(plain(f)).filter(|(_, p)| *p > 0.0).map(|(r, p)| format!("{:.2}x", r / p)).unwrap_or("-".into());
        [
            self.n.to_string(),
            self.plane.clone(),
            num(self.rewrite.bpf, 0),
            num(plain(|c| c.bpf), 0),
            ratio(|c| c.bpf),
            num(self.rewrite.cpu, 0),
            num(plain(|c| c.cpu), 0),
            format!("{} / {}", num(self.rewrite.added_p50_us, 1), num(plain(|c| c.added_p50_us), 1)),
            self.share.map(|s| format!("{:.2} %", s * 100.0)).unwrap_or("-".into()),
            format!("{} / {}", self.slow.map_or("-".into(), |s| s.to_string()), self.rtcp),
            self.lost.to_string(),
        ]
    }

    /// Whether only RTCP left the kernel: no more packets went to the slow path than the
    /// participants sent RTCP (which goes there by design), and they sent some (a generator
    /// that sends none makes the share a figure no browser's conference has). None off eBPF.
    fn only_rtcp_left_the_kernel(&self) -> Option<bool> {
        self.slow.map(|slow| self.rtcp > 0 && slow <= self.rtcp)
    }
}

const SIMULCAST_HEADER: [&str; 11] = [
    "N",
    "plane",
    "BPF ns/copy rewrite",
    "BPF ns/copy plain",
    "rewrite / plain",
    "CPU ns/copy rewrite",
    "CPU ns/copy plain",
    "added p50 µs rewrite / plain",
    "handled in the kernel",
    "slow path / RTCP sent",
    "copies lost (both)",
];

fn simulcast_rows(results: &[ConferenceResult]) -> Vec<SimulcastRow> {
    let mut rows: Vec<SimulcastRow> = Vec::new();
    for r in results.iter().filter(|r| r.scenario == Scenario::Simulcast && r.dataplane != KERNEL_FORWARD) {
        let n = r.participants.len();
        let plain = find(results, &r.dataplane, Scenario::SimulcastPlain, n);
        rows.push(SimulcastRow {
            n,
            plane: r.dataplane.clone(),
            rewrite: Cost::of(r),
            plain: plain.map(Cost::of),
            share: r.kernel_share,
            slow: r.slow_path_packets,
            rtcp: r.rtcp_sent,
            lost: r.lost + plain.map_or(0, |p| p.lost),
        });
    }
    rows
}

/// What added delay is measured against, in words (every report says it).
pub const FLOOR_TEXT: &str = "Added delay = one-way delay through the SFU minus the floor, quantile by quantile (min, p50, mean, p99, max), per copy. \
The floor is the `kernel-forward` run at the same N and scenario in the same invocation: no mediaplane process and no BPF program attached \
(hooks_attached = 0), every copy sent by its publisher straight to its subscriber, routed by the SFU namespace's IP forwarding. \
\"direct with hooks\" is the direct path measured inside each plane's own run, with that plane's XDP/TC programs attached: a diagnostic only.";

/// What the simulcast comparison is, in words (markdown and HTML say it).
const SIMULCAST_TEXT: &str = "Every participant publishes one VP8 video as three simulcast layers (≈150 kbit/s, 500 kbit/s, 1.5 Mbit/s; \
30 frames/s, a keyframe a second); participant i receives participant j's layer (i + j) mod 3. `simulcast`: published as one simulcast \
stream, every copy renumbered onto one SSRC per consumer (in the kernel on the eBPF planes). `simulcast-plain`: the same layers published \
as three plain streams, the same copies fanned out without the rewrite. BPF ns/copy = BPF run time (TC and XDP, over every packet the SFU namespace's interfaces see, the direct-path \
diagnostic's included) / copies received; CPU ns/copy adds the serve process's CPU time; \
handled in the kernel = packets the BPF program fanned out itself / (those + packets it handed to the user-space slow path). \
The participants send the RTCP a browser sends, which the eBPF planes hand to the slow path by design: per layer an SR a second, per received stream \
an RR a second, a PLI at a start off a keyframe, NACKs for gaps (no transport-cc or REMB, which browsers send too); \
slow path / RTCP sent = the packets the slow path got against the RTCP sent (only RTCP leaves the kernel when the first is at most the second).";

/// BPF program run time per delivered copy (eBPF plane only).
pub fn bpf_per_copy(r: &ConferenceResult) -> Option<f64> {
    (r.bpf_run_ns > 0 && r.copies_received > 0).then(|| r.bpf_run_ns as f64 / r.copies_received as f64)
}

/// The console table: one row per (scenario, N, data plane).
pub fn print_table(results: &[ConferenceResult]) {
    println!(
        "\n{:<15} {:>3} {:<14} {:>9} {:>8} {:>5} {:>10} {:>10} {:>10} {:>11} {:>11} {:>10} {:>12} {:>9} {:>6} {:>11} {:>11} {:>9}",
        "scenario",
        "N",
        "dataplane",
        "copies",
        "loss %",
        "dup",
        "p50 µs",
        "p99 µs",
        "max µs",
        "added p50",
        "added p99",
        "floor p50",
        "direct+hooks",
        "jitter µs",
        "MOS",
        "cpu/copy ns",
        "bpf ns/copy",
        "kernel %"
    );
    for r in results {
        let (a50, a99) = r.added_delay_ns.map(|a| (format!("{:.1}", a.p50 / 1e3), format!("{:.1}", a.p99 / 1e3))).unwrap_or_default();
        println!(
            "{:<15} {:>3} {:<14} {:>9} {:>8.3} {:>5} {:>10.1} {:>10.1} {:>10.1} {:>11} {:>11} {:>10} {:>12.1} {:>9.1} {:>6.2} {:>11} {:>11} {:>9}",
            scen(r.scenario),
            r.participants.len(),
            r.dataplane,
            r.copies_received,
            loss_pct(r),
            r.duplicates,
            r.delay_ns.p50 / 1e3,
            r.delay_ns.p99 / 1e3,
            r.delay_ns.max / 1e3,
            a50,
            a99,
            r.floor_delay_ns.map(|f| format!("{:.1}", f.p50 / 1e3)).unwrap_or("-".into()),
            r.direct_delay_ns.p50 / 1e3,
            r.jitter_ns_mean / 1e3,
            r.mos_mean,
            r.cpu_per_copy_ns.map(|c| format!("{c:.0}")).unwrap_or("-".into()),
            bpf_per_copy(r).map(|c| format!("{c:.0}")).unwrap_or("-".into()),
            r.kernel_share.map(|s| format!("{:.2}", s * 100.0)).unwrap_or("-".into())
        );
    }
    println!("\n{FLOOR_TEXT}");
}

pub fn write_all(dir: &Path, meta: &RunMeta, results: &[ConferenceResult], failures: &[String]) -> anyhow::Result<()> {
    std::fs::write(dir.join("results.json"), serde_json::to_string_pretty(&serde_json::json!({"meta": meta, "results": results, "failures": failures}))?)?;
    let mut csv = String::from(CSV_HEADER);
    csv.push('\n');
    for r in results {
        csv.push_str(&csv_row(r));
        csv.push('\n');
    }
    std::fs::write(dir.join("results.csv"), csv)?;
    let plots = write_plots(dir, results)?;
    std::fs::write(dir.join("report.html"), html(meta, results, failures, &plots))?;
    std::fs::write(dir.join("results.md"), markdown(meta, results, failures))?;
    Ok(())
}

fn find<'a>(results: &'a [ConferenceResult], plane: &str, scenario: Scenario, n: usize) -> Option<&'a ConferenceResult> {
    results.iter().find(|r| r.dataplane == plane && r.scenario == scenario && r.participants.len() == n)
}

/// The targets of the benchmark issue, checked against this run's numbers.
fn target_checks(results: &[ConferenceResult]) -> Vec<(String, Option<bool>, String)> {
    let mut v = Vec::new();
    let one = Scenario::OneStream;
    let e12 = find(results, "ebpf", one, 12).and_then(|r| r.added_delay_ns);
    let u12 = find(results, "userspace", one, 12).and_then(|r| r.added_delay_ns);
    v.push((
        "eBPF, one-stream, N = 12: added delay p50 <= 5 µs".into(),
        e12.map(|a| a.p50 <= 5_000.0),
        e12.map(|a| format!("{:.1} µs", a.p50 / 1e3)).unwrap_or("not run".into()),
    ));
    v.push((
        "eBPF, one-stream, N = 12: added delay p99 <= 50 µs".into(),
        e12.map(|a| a.p99 <= 50_000.0),
        e12.map(|a| format!("{:.1} µs", a.p99 / 1e3)).unwrap_or("not run".into()),
    ));
    let (met, measured) = e12.zip(u12).map_or((None, "not run".into()), |(e, u)| ratio_check(e.p50, u.p50));
    v.push(("eBPF p50 at least 5x below user space (N = 12, same run)".into(), met, measured));
    let nmax = results.iter().map(|r| r.participants.len()).max().unwrap_or(0);
    let lossy: Vec<String> =
        results.iter().filter(|r| r.lost > 0 || r.duplicates > 0).map(|r| format!("{} {} N={}", r.dataplane, scen(r.scenario), r.participants.len())).collect();
    v.push((
        format!("no loss and no duplicate, every run (floor included), up to N = {nmax}"),
        Some(lossy.is_empty()),
        if lossy.is_empty() { "none".into() } else { lossy.join(", ") },
    ));
    // The thesis scenarios' target; the simulcast comparison has its own table.
    let worst_bpf = results
        .iter()
        .filter(|r| r.dataplane == "ebpf" && matches!(r.scenario, Scenario::OneStream | Scenario::TwoStreams))
        .filter_map(bpf_per_copy)
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
    v.push((
        "eBPF cost per copy (BPF run time) <= 1 µs, thesis scenarios".into(),
        worst_bpf.map(|w| w <= 1000.0),
        worst_bpf.map(|w| format!("worst {w:.0} ns")).unwrap_or("not run".into()),
    ));
    for row in simulcast_rows(results).iter().filter(|r| r.plane.starts_with("ebpf")) {
        v.push((
            format!(
                "{}, simulcast, N = {}: only RTCP leaves the kernel (slow-path packets <= RTCP sent, some sent); share handled in the kernel (Scallop: 96.5 %)",
                row.plane, row.n
            ),
            row.only_rtcp_left_the_kernel(),
            match (row.share, row.slow) {
                (Some(s), Some(slow)) => format!("{:.2} % in the kernel; {slow} packets to the slow path, {} RTCP sent", s * 100.0, row.rtcp),
                _ => "not measured".into(),
            },
        ));
    }
    // Encrypted fan-out: at the largest N of each suite, what encrypting cost per copy on the
    // user-space plane. (On the eBPF planes an SRTP stream also leaves the kernel, so SRTP - plain
    // there is the slow path's whole fan-out, not the crypto: the table shows it.)
    let encrypted = encrypted_rows(results);
    for row in encrypted.iter().filter(|r| r.plane == "userspace") {
        if encrypted.iter().any(|o| o.plane == row.plane && o.scenario == row.scenario && o.n > row.n) {
            continue;
        }
        let target = encrypted_target_ns(row.scenario);
        v.push((
            format!("{}, {}, N = {}: CPU per encrypted copy (SRTP - plain fan-out) <= {:.1} µs", row.plane, row.suite(), row.n, target / 1e3),
            row.crypto_ns().map(|c| c <= target),
            match (row.crypto_ns(), row.srtp.cpu) {
                (Some(c), Some(all)) => format!("{c:.0} ns (all of the copy's CPU: {all:.0} ns)"),
                _ => "not measured (no plain fan-out run beside it)".into(),
            },
        ));
    }
    if !encrypted.is_empty() {
        let lossy: Vec<String> =
            encrypted.iter().filter(|r| r.n <= 32 && r.lost > 0).map(|r| format!("{} {} N={}: {}", r.plane, r.suite(), r.n, r.lost)).collect();
        v.push(("encrypted fan-out: no loss up to N = 32".into(), Some(lossy.is_empty()), if lossy.is_empty() { "none".into() } else { lossy.join(", ") }));
    }
    let (met, measured) = flat_check(results);
    v.push((
        format!(
            "stays flat in N: eBPF mean added delay grows <= {:.1} µs per added participant, one-stream, smallest to largest N \
             (thesis P4/BMv2: 0.4 s per participant, 3.99 s at N = 12; its Python SFU collapsed at N = 3)",
            FLAT_SLOPE_NS / 1e3
        ),
        met,
        measured,
    ));
    v
}

/// Below this, an added-delay p50 is within the run-to-run noise of the floor it is measured
/// against, not a delay: the eBPF plane's added p50 at N = 2 and 3 measured -1.0, 0.1, 0.7 and
/// 1.3 µs in the runs BENCHMARKS.md reports (floor p50 2-5 µs). A ratio against such a number
/// says nothing (against 0.1 µs any user-space plane is "300x" slower).
pub const ADDED_RESOLUTION_NS: f64 = 1_000.0;

/// "eBPF p50 at least 5x below user space": the user-space plane's added p50 over the eBPF
/// plane's. An eBPF p50 under [`ADDED_RESOLUTION_NS`] (zero or negative included) is not
/// divided by: it can only be said to be at most that, so user space must be at least 5x that.
fn ratio_check(ebpf_p50: f64, user_p50: f64) -> (Option<bool>, String) {
    if ebpf_p50 < ADDED_RESOLUTION_NS {
        let bound = 5.0 * ADDED_RESOLUTION_NS;
        return (
            Some(user_p50 >= bound),
            format!(
                "eBPF {:.1} µs is under the {:.1} µs resolution: no ratio; user space {:.1} µs against 5 x {:.1} µs",
                ebpf_p50 / 1e3,
                ADDED_RESOLUTION_NS / 1e3,
                user_p50 / 1e3,
                ADDED_RESOLUTION_NS / 1e3
            ),
        );
    }
    let r = user_p50 / ebpf_p50;
    (Some(r >= 5.0), format!("{r:.1}x ({:.1} vs {:.1} µs)", user_p50 / 1e3, ebpf_p50 / 1e3))
}

/// What "flat in N" allows: the eBPF plane's mean added delay (one-stream) may grow by this much
/// per added participant. Each participant adds one copy of every packet; a copy waits for the
/// copies cloned before it, one `bpf_clone_redirect` + veth transmit each (≈ 0.7 µs measured),
/// so the mean copy waits about half of that more per participant. Measured: 0.54 µs per
/// participant (mean 6.4 µs at N = 2, 11.8 µs at N = 12: `bench sfu --scenarios one-stream
/// --sizes 2,12 --seconds 5`, debug build on a busy 2-core VM); BENCHMARKS.md's p50s, 1.3 µs at
/// N = 2 and 3.4 µs at N = 12 (median of nine runs), make 0.2. 1 µs is every copy paying a
/// whole clone for each added participant: beyond it the fan-out is not flat.
pub const FLAT_SLOPE_NS: f64 = 1_000.0;

/// "Stays flat in N": the eBPF plane's one-stream mean added delay from the smallest N of the
/// run to the largest, per added participant, against [`FLAT_SLOPE_NS`]. Not run with fewer
/// than two sizes.
fn flat_check(results: &[ConferenceResult]) -> (Option<bool>, String) {
    let mut runs: Vec<(usize, f64)> = results
        .iter()
        .filter(|r| r.dataplane == "ebpf" && r.scenario == Scenario::OneStream)
        .filter_map(|r| r.added_delay_ns.map(|a| (r.participants.len(), a.mean)))
        .collect();
    runs.sort_by_key(|r| r.0);
    let (Some(&(n0, m0)), Some(&(n1, m1))) = (runs.first(), runs.last()) else {
        return (None, "not run".into());
    };
    if n1 == n0 {
        return (None, format!("not run (one size: N = {n0})"));
    }
    let slope = (m1 - m0) / (n1 - n0) as f64;
    (
        Some(slope <= FLAT_SLOPE_NS),
        format!("{:.2} µs per participant: eBPF mean added {:.1} µs at N = {n0}, {:.1} µs at N = {n1}", slope / 1e3, m0 / 1e3, m1 / 1e3),
    )
}

/// The run as Markdown: what BENCHMARKS.md is regenerated from.
fn markdown(meta: &RunMeta, results: &[ConferenceResult], failures: &[String]) -> String {
    let mut m = String::new();
    let _ = writeln!(m, "Command: `{}`  ", meta.command);
    let _ = writeln!(
        m,
        "Machine: {} cores, {:.1} GiB, {}, kernel {}; commit {}. {}, {} s per run.\n",
        meta.cores,
        meta.memory_gib,
        meta.cpu,
        meta.kernel,
        meta.git_commit,
        preset_text(&meta.profile),
        meta.seconds
    );
    let _ = writeln!(m, "{FLOOR_TEXT}\n");
    let _ = writeln!(m, "| target | met | measured |\n| --- | --- | --- |");
    for (what, ok, measured) in target_checks(results) {
        let ok = match ok {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "-",
        };
        let _ = writeln!(m, "| {what} | {ok} | {measured} |");
    }
    let (simulcast, encrypted) = (simulcast_rows(results), encrypted_rows(results));
    if !simulcast.is_empty() {
        let _ = writeln!(m, "\n#### simulcast: the rewrite against plain fan-out\n\n{SIMULCAST_TEXT}\n");
        let _ = writeln!(m, "| {} |\n|{}", SIMULCAST_HEADER.join(" | "), "---|".repeat(SIMULCAST_HEADER.len()));
        for row in &simulcast {
            let _ = writeln!(m, "| {} |", row.cells().join(" | "));
        }
    }
    if !encrypted.is_empty() {
        let _ = writeln!(m, "\n#### encrypted: SRTP fan-out against plain fan-out\n\n{ENCRYPTED_TEXT}\n");
        let _ = writeln!(m, "| {} |\n|{}", ENCRYPTED_HEADER.join(" | "), "---|".repeat(ENCRYPTED_HEADER.len()));
        for row in &encrypted {
            let _ = writeln!(m, "| {} |", row.cells().join(" | "));
        }
    }
    for scenario in [
        Scenario::OneStream,
        Scenario::TwoStreams,
        Scenario::Simulcast,
        Scenario::SimulcastPlain,
        Scenario::SimulcastSrtp,
        Scenario::Fanout,
        Scenario::FanoutSrtpGcm,
        Scenario::FanoutSrtpCm,
    ] {
        let rows: Vec<&ConferenceResult> = results.iter().filter(|r| r.scenario == scenario).collect();
        if rows.is_empty() {
            continue;
        }
        let _ = writeln!(m, "\n#### {}\n", scen(scenario));
        let _ = writeln!(
            m,
            "| N | plane | copies received / expected | loss % | dup | one-way p50 / p99 µs | added p50 / p99 / max µs | floor p50 / p99 µs | direct with hooks p50 µs | jitter µs | MOS | CPU ns/copy | BPF ns/copy |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for r in rows {
            let a = r.added_delay_ns.map(|a| format!("{:.1} / {:.1} / {:.1}", a.p50 / 1e3, a.p99 / 1e3, a.max / 1e3)).unwrap_or("-".into());
            let floor = r.floor_delay_ns.map(|f| format!("{:.1} / {:.1}", f.p50 / 1e3, f.p99 / 1e3)).unwrap_or("-".into());
            let _ = writeln!(
                m,
                "| {} | {} | {} / {} | {:.3} | {} | {:.1} / {:.1} | {} | {} | {:.1} | {:.1} | {:.2} | {} | {} |",
                r.participants.len(),
                r.dataplane,
                r.copies_received,
                r.copies_expected,
                loss_pct(r),
                r.duplicates,
                r.delay_ns.p50 / 1e3,
                r.delay_ns.p99 / 1e3,
                a,
                floor,
                r.direct_delay_ns.p50 / 1e3,
                r.jitter_ns_mean / 1e3,
                r.mos_mean,
                r.cpu_per_copy_ns.map(|c| format!("{c:.0}")).unwrap_or("-".into()),
                bpf_per_copy(r).map(|c| format!("{c:.0}")).unwrap_or("-".into()),
            );
        }
    }
    if !failures.is_empty() {
        let _ = writeln!(m, "\nFailed runs:\n");
        for f in failures {
            let _ = writeln!(m, "- {f}");
        }
    }
    m
}

const PALETTE: [RGBColor; 4] = [RGBColor(31, 119, 180), RGBColor(214, 39, 40), RGBColor(44, 160, 44), RGBColor(148, 103, 189)];

fn planes(results: &[ConferenceResult]) -> Vec<String> {
    let mut v: Vec<String> = results.iter().map(|r| r.dataplane.clone()).collect();
    v.dedup();
    v.sort();
    v.dedup();
    v
}

/// One line (with points) per named series; the y axis includes 0. Shared by every report.
pub(crate) fn line_chart(path: &Path, title: &str, xdesc: &str, ydesc: &str, series: &[(String, Vec<(f64, f64)>)]) -> anyhow::Result<()> {
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.1.iter().copied()).collect();
    let xmax = all.iter().map(|p| p.0).fold(1.0, f64::max) * 1.05;
    let ymax = all.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.15;
    let ymin = all.iter().map(|p| p.1).fold(0.0, f64::min).min(0.0);
    let root = SVGBackend::new(path, (640, 400)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(65)
        .build_cartesian_2d(0f64..xmax, ymin..ymax)?;
    chart.configure_mesh().x_desc(xdesc).y_desc(ydesc).draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|p| Circle::new(*p, 3, color.filled())))?;
    }
    chart.configure_series_labels().position(SeriesLabelPosition::UpperLeft).background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

/// An HTML table from a CSV header and CSV rows (values escaped).
pub(crate) fn html_table(header: &str, rows: impl IntoIterator<Item = String>) -> String {
    let mut h = String::from("<table><tr>");
    for c in header.split(',') {
        let _ = write!(h, "<th>{}</th>", esc(c));
    }
    h.push_str("</tr>");
    for row in rows {
        h.push_str("<tr>");
        for c in row.split(',') {
            let _ = write!(h, "<td>{}</td>", esc(c));
        }
        h.push_str("</tr>");
    }
    h.push_str("</table>");
    h
}

/// A line chart of `metric` against N for each data plane, one-stream scenario.
fn plot_vs_n(path: &Path, title: &str, ylabel: &str, results: &[ConferenceResult], metric: &dyn Fn(&ConferenceResult) -> Option<f64>) -> anyhow::Result<()> {
    let series: Vec<(String, Vec<(f64, f64)>)> = planes(results)
        .into_iter()
        .map(|p| {
            let pts = results
                .iter()
                .filter(|r| r.dataplane == p && r.scenario == Scenario::OneStream)
                .filter_map(|r| Some((r.participants.len() as f64, metric(r)?)))
                .collect();
            (p, pts)
        })
        .filter(|(_, pts): &(String, Vec<(f64, f64)>)| !pts.is_empty())
        .collect();
    line_chart(path, title, "participants N", ylabel, &series)
}

/// Delay CDF per data plane at the largest N of the one-stream scenario.
fn plot_cdf(path: &Path, results: &[ConferenceResult]) -> anyhow::Result<Option<usize>> {
    let Some(n) = results.iter().filter(|r| r.scenario == Scenario::OneStream).map(|r| r.participants.len()).max() else {
        return Ok(None);
    };
    let sel: Vec<&ConferenceResult> = results.iter().filter(|r| r.scenario == Scenario::OneStream && r.participants.len() == n).collect();
    let xmax = sel.iter().flat_map(|r| r.delay_cdf.iter().map(|p| p.0 / 1e3)).fold(1.0, f64::max) * 1.05;
    let root = SVGBackend::new(path, (640, 400)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("one-way delay CDF through the SFU, N = {n}"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(50)
        .build_cartesian_2d((1f64..xmax).log_scale(), 0f64..1.0)?;
    chart.configure_mesh().x_desc("one-way delay, µs (log)").y_desc("fraction of packets").draw()?;
    for (i, r) in sel.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let pts: Vec<(f64, f64)> = r.delay_cdf.iter().map(|(d, q)| ((d / 1e3).max(1.0), *q)).collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
            .label(r.dataplane.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart.configure_series_labels().position(SeriesLabelPosition::LowerRight).background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(Some(n))
}

fn write_plots(dir: &Path, results: &[ConferenceResult]) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    if let Some(n) = plot_cdf(&dir.join("delay_cdf.svg"), results)? {
        out.push(("delay_cdf.svg".into(), format!("Delay CDF per data plane at N = {n} (one stream)")));
    }
    plot_vs_n(&dir.join("added_p50.svg"), "added delay p50 per copy (one stream)", "µs", results, &|r| r.added_delay_ns.map(|a| a.p50 / 1e3))?;
    out.push(("added_p50.svg".into(), "Added delay p50 vs N".into()));
    plot_vs_n(&dir.join("added_p99.svg"), "added delay p99 per copy (one stream)", "µs", results, &|r| r.added_delay_ns.map(|a| a.p99 / 1e3))?;
    out.push(("added_p99.svg".into(), "Added delay p99 vs N".into()));
    plot_vs_n(&dir.join("cpu_per_copy.svg"), "cost per copy (one stream): serve CPU + BPF run time", "CPU ns per delivered copy", results, &|r| {
        r.cpu_per_copy_ns
    })?;
    out.push(("cpu_per_copy.svg".into(), "Cost per copy vs N".into()));
    plot_vs_n(&dir.join("loss.svg"), "loss (one stream)", "% of copies", results, &|r| Some(loss_pct(r)))?;
    out.push(("loss.svg".into(), "Loss vs N".into()));
    Ok(out)
}

pub(crate) fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn html(meta: &RunMeta, results: &[ConferenceResult], failures: &[String], plots: &[(String, String)]) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>mediaplane bench sfu</title>\
         <style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}}table{{border-collapse:collapse;font-size:13px}}\
         td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}th{{background:#eee}}img{{margin:6px}}</style></head><body>\
         <h1>mediaplane bench sfu</h1><p><code>{}</code></p>\
         <p>Machine: {} cores, {:.1} GiB, {}; kernel {}; commit {}. {}, {} s per run.</p>",
        esc(&meta.command),
        meta.cores,
        meta.memory_gib,
        esc(&meta.cpu),
        esc(&meta.kernel),
        esc(&meta.git_commit),
        esc(&preset_text(&meta.profile)),
        meta.seconds
    );
    if !failures.is_empty() {
        h.push_str("<h2>Failed runs</h2><ul>");
        for f in failures {
            let _ = write!(h, "<li>{}</li>", esc(f));
        }
        h.push_str("</ul>");
    }
    h.push_str("<h2>Plots</h2>");
    for (file, title) in plots {
        let _ = write!(h, "<figure style=\"display:inline-block\"><img src=\"{file}\" alt=\"{t}\"><figcaption>{t}</figcaption></figure>", t = esc(title));
    }
    h.push_str("<h2>Results</h2><p>Delays are one-way, per copy, in µs. MOS: G.107 E-model as G.711 (Ie = 0, Bpl = 4.3) with the measured mean delay and loss. Cost per copy: CPU of the serve process per delivered copy.</p>");
    let _ = write!(h, "<p>{}</p>", esc(FLOOR_TEXT));
    h.push_str(&html_table(CSV_HEADER, results.iter().map(csv_row)));
    let simulcast = simulcast_rows(results);
    if !simulcast.is_empty() {
        let _ = write!(h, "<h2>Simulcast: the rewrite against plain fan-out</h2><p>{}</p>", esc(SIMULCAST_TEXT));
        // Cells hold no comma; html_table splits on them.
        h.push_str(&html_table(&SIMULCAST_HEADER.join(","), simulcast.iter().map(|r| r.cells().join(","))));
    }
    let encrypted = encrypted_rows(results);
    if !encrypted.is_empty() {
        let _ = write!(h, "<h2>Encrypted: SRTP fan-out against plain fan-out</h2><p>{}</p>", esc(ENCRYPTED_TEXT));
        h.push_str(&html_table(&ENCRYPTED_HEADER.join(","), encrypted.iter().map(|r| r.cells().join(","))));
    }
    h.push_str(
        "<h2>Against the thesis</h2><p>The thesis (P4/BMv2 SFU and a Python/scapy SFU in Mininet) measured the time a packet spent in the SFU; \
         the closest measure here is the added delay. Thesis values in ms; ours in µs (mean added delay per copy).</p>\
         <table><tr><th>scenario</th><th>N</th><th>thesis P4/BMv2 avg ms</th><th>thesis P4 max ms</th><th>thesis Python avg ms</th>",
    );
    let ps: Vec<String> = planes(results).into_iter().filter(|p| p != KERNEL_FORWARD).collect();
    for p in &ps {
        let _ = write!(h, "<th>{p} added mean µs</th><th>{p} added p99 µs</th>");
    }
    h.push_str("</tr>");
    for (scenario, p4, py) in [(Scenario::OneStream, THESIS_P4_ONE, THESIS_PYTHON_ONE), (Scenario::TwoStreams, THESIS_P4_TWO, THESIS_PYTHON_TWO)] {
        for (n, _min, max, avg) in p4 {
            let pyavg = py.iter().find(|x| x.0 == *n).map(|x| format!("{:.1}", x.3 * 1e3)).unwrap_or("collapsed/not run".into());
            let _ = write!(h, "<tr><td>{}</td><td>{n}</td><td>{:.3}</td><td>{:.3}</td><td>{pyavg}</td>", scen(scenario), avg * 1e3, max * 1e3);
            for p in &ps {
                match results.iter().find(|r| r.dataplane == *p && r.scenario == scenario && r.participants.len() == *n).and_then(|r| r.added_delay_ns) {
                    Some(a) => {
                        let _ = write!(h, "<td>{:.1}</td><td>{:.1}</td>", a.mean / 1e3, a.p99 / 1e3);
                    }
                    None => h.push_str("<td>-</td><td>-</td>"),
                }
            }
            h.push_str("</tr>");
        }
    }
    h.push_str("</table></body></html>");
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use mediaplane_bench::added_delay::{AddedDelay, AddedDelayMethod};
    use mediaplane_bench::qos::Summary;

    /// A loss-free run of `plane` at N = `n` whose added delay has this p50 and mean (ns).
    fn run(plane: &str, n: usize, p50: f64, mean: f64) -> ConferenceResult {
        let added =
            AddedDelay { method: AddedDelayMethod::QuantileDifference, count: 1000, direct_count: 1000, min: 0.0, p50, mean, p99: 2.0 * mean, max: 3.0 * mean };
        ConferenceResult {
            dataplane: plane.into(),
            scenario: Scenario::OneStream,
            participants: (0..n)
                .map(|i| crate::conference::ParticipantResult {
                    participant: format!("p{i}"),
                    streams: n - 1,
                    expected: 100,
                    received: 100,
                    lost: 0,
                    duplicates: 0,
                    unexpected: 0,
                    delay_ns: Summary::default(),
                })
                .collect(),
            copies_expected: 100,
            copies_received: 100,
            bytes_received: 0,
            lost: 0,
            duplicates: 0,
            unexpected: 0,
            delay_ns: Summary::default(),
            direct_delay_ns: Summary::default(),
            delay_cdf: Vec::new(),
            floor_delay_ns: Some(Summary::default()),
            added_delay_ns: Some(added),
            added_delay_vs_direct_ns: None,
            hooks_attached: None,
            jitter_ns_mean: 0.0,
            delay_variation_p99_ns: 0.0,
            mos_mean: 4.41,
            mos_min: 4.41,
            serve_cpu_ns: 0,
            bpf_run_ns: 0,
            cpu_per_copy_ns: None,
            daemon_stats: serde_json::Value::Null,
            kernel_handled: None,
            slow_path_packets: None,
            kernel_share: None,
            generator_cpu_ns: 0,
            rtcp_sent: 0,
        }
    }

    fn check(results: &[ConferenceResult], starts: &str) -> (Option<bool>, String) {
        let (_, met, measured) = target_checks(results).into_iter().find(|c| c.0.starts_with(starts)).unwrap_or_else(|| panic!("no check {starts:?}"));
        (met, measured)
    }

    const RATIO: &str = "eBPF p50 at least 5x below user space";
    const FLAT: &str = "stays flat in N";

    #[test]
    fn the_5x_ratio_is_not_met_by_an_ebpf_p50_at_or_under_zero() {
        // The old check divided by max(p50, 1 ns): eBPF at 0 or -1 µs made 3 µs of user space
        // "3000x" below. Under the resolution it is compared with 5 x 1 µs instead.
        for e in [0.0, -1_000.0, 0.4] {
            let (met, measured) = check(&[run("ebpf", 12, e, 0.0), run("userspace", 12, 3_000.0, 3_000.0)], RATIO);
            assert_eq!(met, Some(false), "eBPF p50 {e} ns: {measured}");
            assert!(measured.contains("under the 1.0 µs resolution"), "{measured}");
        }
        // ... and met when user space is beyond 5 µs (what every run measures: 24-51 µs).
        assert_eq!(check(&[run("ebpf", 12, 0.0, 0.0), run("userspace", 12, 30_000.0, 30_000.0)], RATIO).0, Some(true));
        // Above the resolution it is the ratio, in both directions.
        let (met, measured) = check(&[run("ebpf", 12, 3_400.0, 0.0), run("userspace", 12, 30_100.0, 0.0)], RATIO);
        assert_eq!((met, measured.as_str()), (Some(true), "8.9x (30.1 vs 3.4 µs)"));
        assert_eq!(check(&[run("ebpf", 12, 10_000.0, 0.0), run("userspace", 12, 30_000.0, 0.0)], RATIO).0, Some(false));
        assert_eq!(check(&[run("ebpf", 12, 10_000.0, 0.0)], RATIO), (None, "not run".into()));
    }

    #[test]
    fn flat_in_n_is_the_growth_per_participant_not_an_absolute_ceiling() {
        // The old check passed whenever both means were under 100 µs: 1 µs at N = 2 growing to
        // 90 µs at N = 12 (8.9 µs per participant) is not flat.
        let (met, measured) = check(&[run("ebpf", 2, 1_000.0, 1_000.0), run("ebpf", 12, 90_000.0, 90_000.0)], FLAT);
        assert_eq!(met, Some(false), "{measured}");
        assert_eq!(measured, "8.90 µs per participant: eBPF mean added 1.0 µs at N = 2, 90.0 µs at N = 12");
        // What the eBPF plane measures (1.3 -> 3.4 µs) is flat, and a level above 100 µs that
        // does not grow is flat too (the old check failed it): flatness is not a level.
        assert_eq!(check(&[run("ebpf", 2, 1_300.0, 1_300.0), run("ebpf", 12, 3_400.0, 3_400.0)], FLAT).0, Some(true));
        assert_eq!(check(&[run("ebpf", 2, 150_000.0, 150_000.0), run("ebpf", 12, 150_500.0, 150_500.0)], FLAT).0, Some(true));
        // Smallest to largest N of the run, whatever they are; the user-space plane is not it.
        let runs = [run("ebpf", 4, 2_000.0, 2_000.0), run("ebpf", 8, 2_500.0, 2_500.0), run("ebpf", 32, 40_000.0, 40_000.0), run("userspace", 2, 0.0, 0.0)];
        let (met, measured) = check(&runs, FLAT);
        assert_eq!(met, Some(false), "{measured}");
        assert!(measured.contains("at N = 4") && measured.contains("at N = 32"), "{measured}");
        assert_eq!(check(&[run("ebpf", 12, 3_000.0, 3_000.0)], FLAT), (None, "not run (one size: N = 12)".into()));
        assert_eq!(check(&[], FLAT), (None, "not run".into()));
    }
    /// An eBPF simulcast run with this kernel split and RTCP sent.
    fn simulcast(handled: u64, slow: u64, rtcp: u64) -> ConferenceResult {
        let mut r = run("ebpf", 4, 2_000.0, 2_000.0);
        r.scenario = Scenario::Simulcast;
        (r.kernel_handled, r.slow_path_packets, r.rtcp_sent) = (Some(handled), Some(slow), rtcp);
        r.kernel_share = Some(handled as f64 / (handled + slow) as f64);
        r
    }

    #[test]
    fn the_simulcast_kernel_share_counts_rtcp() {
        const SIMULCAST: &str = "ebpf, simulcast, N = 4:";
        // The old check (>= 95 %) was met by a generator that sent no RTCP: 100 % of nothing but
        // media. Without RTCP sent the run says nothing about a browser's conference.
        let (met, measured) = check(&[simulcast(2_952, 0, 0)], SIMULCAST);
        assert_eq!(met, Some(false), "{measured}");
        assert_eq!(measured, "100.00 % in the kernel; 0 packets to the slow path, 0 RTCP sent");
        // With RTCP: met while the slow path got no more than the RTCP, whatever the share ...
        assert_eq!(check(&[simulcast(2_952, 60, 60)], SIMULCAST).0, Some(true));
        assert_eq!(check(&[simulcast(1_000, 100, 120)], SIMULCAST).0, Some(true), "90.9 %: RTCP-heavy, still only RTCP");
        // ... and not when media went up too (96.2 % would have met the old >= 95 %).
        let (met, measured) = check(&[simulcast(2_952, 116, 60)], SIMULCAST);
        assert_eq!(met, Some(false), "{measured}");
        assert!(measured.starts_with("96.22 % in the kernel"), "{measured}");
    }
}
