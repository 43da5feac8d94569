//! Generator/receiver smoke on loopback (no root):
//! `cargo run -p mediaplane-bench --release --example loopback -- video 20 2`
//! = 20 video flows for 2 s to one receiver; prints totals, CPU and the worst copy as JSON.

use std::net::UdpSocket;
use std::time::Duration;

use mediaplane_bench::traffic::{run, Preset, TrafficPlan};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let preset: Preset = args.first().map_or("voice", String::as_str).parse()?;
    let flows: u32 = args.get(1).map_or(Ok(10), |s| s.parse())?;
    let seconds: f64 = args.get(2).map_or(Ok(1.0), |s| s.parse())?;

    let rx = UdpSocket::bind("127.0.0.1:0")?;
    let dest = rx.local_addr()?;
    let mut plan = TrafficPlan::new(Duration::from_secs_f64(seconds));
    for flow in 1..=flows {
        plan = plan.sender(UdpSocket::bind("127.0.0.1:0")?, dest, flow, preset.profile());
    }
    plan = plan.receiver("rx", rx, 1..=flows);
    let report = run(&plan)?;
    let worst = report.copies.iter().max_by(|a, b| a.delay_ns.p99.total_cmp(&b.delay_ns.p99));
    let lateness_p99 = report.senders.iter().map(|s| s.lateness_ns.p99).fold(0.0, f64::max);
    println!(
        "{}",
        serde_json::json!({
            "totals": report.totals,
            "generator_cpu_ms": report.generator_cpu_ns as f64 / 1e6,
            "receiver_cpu_ms": report.receiver_cpu_ns as f64 / 1e6,
            "send_duration_ms": report.send_duration_ns as f64 / 1e6,
            "worst_lateness_p99_ns": lateness_p99,
            "worst_copy": worst,
            "lateness": report.senders.iter().map(|s| s.lateness_ns).collect::<Vec<_>>(),
        })
    );
    Ok(())
}
