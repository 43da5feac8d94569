//! `mediaplane bench overload`: an SFU is an amplifier and a relay is an open port, so measure
//! what a flood does. Per data plane: calibrate the forwarding capacity, then flood an SFU
//! address from a stranger at twice that rate beside an established conference, while a probe
//! times the API. Reported: API latency, the established calls' loss, what was dropped where.

use crate::conference::{api, process_cpu_ns, setup_room, wait_ready, Scenario, ServeProcess, MEDIA_PORT, SFU_PORT};
use anyhow::{bail, Context};
use mediaplane_bench::flood::{flood, FloodReport};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::qos::Summary;
use mediaplane_bench::traffic::{self, Profile, TrafficPlan};
use serde::Serialize;
use serde_json::Value;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct BenchOverloadArgs {
    /// Data planes to compare: userspace, ebpf (its default: no XDP pre-filter on veth),
    /// ebpf-xdp (the pre-filter on, as for a flood), ebpf-noxdp (off).
    #[arg(long, value_delimiter = ',', default_value = "userspace,ebpf-xdp")]
    dataplanes: Vec<String>,
    /// Conference participants with established media (voice preset).
    #[arg(long, default_value_t = 4)]
    participants: usize,
    /// Seconds of flood beside the established calls.
    #[arg(long, default_value_t = 30.0)]
    seconds: f64,
    /// Flood rate as a multiple of the calibrated forwarding capacity.
    #[arg(long, default_value_t = 2.0)]
    factor: f64,
    /// Publish the RTP streams without SSRC (any SSRC on their address) instead of narrowed to
    /// their SSRC (the XDP pre-filter drops the flood either way: every stream on an address
    /// has the participant's one source).
    #[arg(long)]
    wildcard_streams: bool,
    /// A seconds-long smoke run.
    #[arg(long)]
    quick: bool,
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct OverloadResult {
    pub dataplane: String,
    /// "ssrc" (streams narrowed to their SSRC) or "wildcard".
    pub streams: &'static str,
    /// Packets/s of one registered sender the data plane accepted and forwarded (each to
    /// participants-1 subscribers), measured by the daemon's counters during a 2 s flood.
    pub capacity_pps: f64,
    pub flood_target_pps: f64,
    pub flood: FloodReport,
    /// Stranger drops counted by the daemon (XDP pre-filter and TC/user space) during the flood.
    pub stranger_drops: u64,
    pub copies_to_strangers: u64,
    pub established_expected: u64,
    pub established_received: u64,
    pub established_loss_percent: f64,
    pub established_delay_ns: Summary,
    pub api_requests: u64,
    pub api_errors: u64,
    pub api_latency_ms: Summary,
    pub serve_cpu_ns: u64,
    /// Kernel BPF run time during the flood (kernel.bpf_stats): the TC program and, when
    /// attached, the XDP pre-filter (0 when absent, e.g. the user-space plane).
    pub tc_run_time_ns: u64,
    pub xdp_run_time_ns: u64,
    /// Strangers the XDP pre-filter dropped (part of `stranger_drops`).
    pub xdp_drops: u64,
    pub serve_alive: bool,
}

/// (TC run time ns, XDP run time ns, XDP stranger drops) as the daemon reports them.
fn kernel_cost(stats: &Value) -> (u64, u64, u64) {
    let g = |k: &str| stats["extra"][k].as_u64().unwrap_or(0);
    (g("bpf_run_time_ns"), g("xdp_run_time_ns"), g("xdp_drop_stranger"))
}

/// Every plane's total includes the XDP pre-filter's drops.
fn stranger_drops(stats: &Value) -> u64 {
    stats["total"]["drop_stranger"].as_u64().unwrap_or(0)
}

pub fn run(a: BenchOverloadArgs) -> anyhow::Result<()> {
    mediaplane_bench::ensure_root("bench overload")?;
    if !(2..=16).contains(&a.participants) {
        bail!("--participants must be between 2 and 16");
    }
    let seconds = if a.quick { 2.0 } else { a.seconds.clamp(1.0, 300.0) };
    std::fs::create_dir_all(&a.out)?;
    let mut results = Vec::new();
    for dp in &a.dataplanes {
        let r = one_plane(dp, a.participants, seconds, a.factor, a.wildcard_streams, &a.out).with_context(|| format!("overload with {dp}"))?;
        results.push(r);
    }
    println!(
        "\n{:<10} {:>8} {:>12} {:>12} {:>12} {:>14} {:>10} {:>10} {:>12} {:>11} {:>11} {:>11} {:>12} {:>10} {:>10} {:>6}",
        "dataplane",
        "streams",
        "capacity pps",
        "flood pps",
        "flood sent",
        "stranger drops",
        "xdp drops",
        "leaked",
        "est. loss %",
        "API p50 ms",
        "API p99 ms",
        "API max ms",
        "serve CPU ms",
        "TC ms",
        "XDP ms",
        "alive"
    );
    for r in &results {
        println!(
            "{:<10} {:>8} {:>12.0} {:>12.0} {:>12} {:>14} {:>10} {:>10} {:>12.3} {:>11.2} {:>11.2} {:>11.2} {:>12.1} {:>10.1} {:>10.1} {:>6}",
            r.dataplane,
            r.streams,
            r.capacity_pps,
            r.flood.rate_pps,
            r.flood.sent,
            r.stranger_drops,
            r.xdp_drops,
            r.copies_to_strangers,
            r.established_loss_percent,
            r.api_latency_ms.p50,
            r.api_latency_ms.p99,
            r.api_latency_ms.max,
            r.serve_cpu_ns as f64 / 1e6,
            r.tc_run_time_ns as f64 / 1e6,
            r.xdp_run_time_ns as f64 / 1e6,
            r.serve_alive
        );
    }
    let path = a.out.join("overload.json");
    std::fs::write(&path, serde_json::to_string_pretty(&results)?)?;
    println!("results: {}", path.display());
    Ok(())
}

fn one_plane(dp: &str, n: usize, seconds: f64, factor: f64, wildcard: bool, out: &std::path::Path) -> anyhow::Result<OverloadResult> {
    // Peers 0..n are the conference; peer n is the attacker's namespace.
    let tb = Testbed::star(n + 1)?;
    let store = out.join(format!("{}-overload-{dp}.db", tb.prefix));
    let log = out.join(format!("{}-overload-{dp}.log", tb.prefix));
    let mut serve = ServeProcess::start(&tb, dp, &store, log.clone())?;
    wait_ready(&tb, &mut serve)?;
    setup_room(&tb, n, Scenario::OneStream, true, !wildcard)?;
    let sfu0 = SocketAddr::new(tb.peers[0].sfu_ip, SFU_PORT);
    let rtp = mediaplane_core::rtp::build_rtp(0, 1, 0, crate::conference::flow_main(0), &[0; 160]);

    // Calibration: the registered sender p0 floods its own stream; the daemon's counters say
    // how many packets per second it accepted and fanned out.
    let p0 = tb.udp_socket(&tb.peers[0].ns, SocketAddr::new(tb.peers[0].ip, MEDIA_PORT))?;
    let rx0 = api(&tb, "GET", "/v1/stats", None)?["total"]["rx_packets"].as_u64().unwrap_or(0);
    let cal = flood(&p0, sfu0, &rtp, Duration::from_secs(2), None);
    std::thread::sleep(Duration::from_millis(200));
    let rx1 = api(&tb, "GET", "/v1/stats", None)?["total"]["rx_packets"].as_u64().unwrap_or(0);
    let capacity_pps = (rx1 - rx0) as f64 / cal.seconds;
    drop(p0);
    std::thread::sleep(Duration::from_millis(500)); // let queues drain

    // The established conference (sockets bound after calibration: nothing stale queued).
    let mut plan = TrafficPlan::new(Duration::from_secs_f64(seconds));
    for (i, p) in tb.peers.iter().take(n).enumerate() {
        let sock = tb.udp_socket(&p.ns, SocketAddr::new(p.ip, MEDIA_PORT))?;
        plan = plan.sender(sock.try_clone()?, SocketAddr::new(p.sfu_ip, SFU_PORT), crate::conference::flow_main(i), Profile::voice());
        plan = plan.receiver(format!("p{i}"), sock, (0..n).filter(|j| *j != i).map(crate::conference::flow_main));
    }
    // The attacker: right SSRC, wrong source address.
    let attacker = &tb.peers[n];
    let evil = tb.udp_socket(&attacker.ns, SocketAddr::new(attacker.ip, MEDIA_PORT))?;
    let stats0 = api(&tb, "GET", "/v1/stats", None)?;
    let drops0 = stranger_drops(&stats0);
    let (tc0, xdp0, xdrops0) = kernel_cost(&stats0);
    let cpu0 = process_cpu_ns(serve.pid());
    let target = capacity_pps * factor;
    let stop = AtomicBool::new(false);
    let (report, flood_report, (mut lat, api_errors)) = std::thread::scope(|scope| {
        let flooder = scope.spawn(|| flood(&evil, sfu0, &rtp, Duration::from_secs_f64(seconds), Some(target)));
        // The API probe, from inside the SFU namespace, every 50 ms.
        let probe = scope.spawn(|| {
            let mut lat = Vec::new();
            let mut errors = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                match api(&tb, "GET", "/v1/stats", None) {
                    Ok(_) => lat.push(t.elapsed().as_secs_f64() * 1e3),
                    Err(_) => errors += 1,
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            (lat, errors)
        });
        let report = traffic::run(&plan);
        let flood_report = flooder.join().expect("flood thread");
        stop.store(true, Ordering::Relaxed);
        (report, flood_report, probe.join().expect("probe thread"))
    });
    let report = report?;
    let serve_cpu_ns = process_cpu_ns(serve.pid()).saturating_sub(cpu0);
    let serve_alive = serve.alive();
    let stats = api(&tb, "GET", "/v1/stats", None)?;
    let (tc1, xdp1, xdrops1) = kernel_cost(&stats);
    serve.stop()?;
    let _ = std::fs::remove_file(&log);
    crate::conference::remove_store(&store);

    let expected = report.totals.expected_copies;
    let received = report.totals.received;
    let mut delays = crate::conference::empty_histogram();
    for c in &report.copies {
        delays.add(&c.delay_histogram).ok();
    }
    Ok(OverloadResult {
        dataplane: dp.to_string(),
        streams: if wildcard { "wildcard" } else { "ssrc" },
        capacity_pps,
        flood_target_pps: target,
        flood: flood_report,
        stranger_drops: stranger_drops(&stats) - drops0,
        copies_to_strangers: report.totals.unexpected,
        established_expected: expected,
        established_received: received,
        established_loss_percent: if expected > 0 { 100.0 * (expected - received.min(expected)) as f64 / expected as f64 } else { 0.0 },
        established_delay_ns: Summary::of_histogram(&delays),
        api_requests: lat.len() as u64,
        api_errors,
        api_latency_ms: Summary::of(&mut lat),
        serve_cpu_ns,
        tc_run_time_ns: tc1.saturating_sub(tc0),
        xdp_run_time_ns: xdp1.saturating_sub(xdp0),
        xdp_drops: xdrops1.saturating_sub(xdrops0),
        serve_alive,
    })
}
