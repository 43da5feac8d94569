//! Latency of one table change: `FastPath::apply_changes` (eBPF maps, nothing attached) and
//! `UserspaceDataplane::apply_changes`, each call replacing one subscriber of one stream in a
//! table of `streams` streams of 8 subscribers. Runs in a network namespace of its own (as root):
//! `cargo run -p mediaplane-ebpf --release --example apply_latency -- 200 100`
//! = 200 changes, 100 streams; prints min / p50 / p90 / max / mean per call.

use mediaplane_core::table::{Copy, IngressKey, SourceRule, StreamEntry};
use mediaplane_core::ForwardingTable;
use mediaplane_dataplane::{Dataplane, UserspaceConfig, UserspaceDataplane};
use mediaplane_ebpf::{FastPath, LoadOptions};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn a(s: String) -> SocketAddr {
    s.parse().unwrap()
}

fn entry(i: u32, subs: u16) -> StreamEntry {
    let local = a(format!("127.0.0.1:{}", 20000 + 2 * i));
    StreamEntry {
        id: i + 1,
        label: format!("s{i}"),
        key: IngressKey { local, ssrc: None },
        source: SourceRule::Fixed(a(format!("127.0.0.2:{}", 30000 + i))),
        rtp: true,
        copies: (0..subs)
            .map(|j| Copy {
                subscriber: format!("sub{j}"),
                from: local,
                to: a(format!("127.0.0.3:{}", 40000 + j)),
                outbound: Default::default(),
                consumer: 0,
                layer: None,
                max_layer: None,
                auto_layer: true,
                temporal_layer: None,
                payload_type: None,
                rtcp: None,
            })
            .collect(),
        rate: None,
        record: false,
        inbound: Default::default(),
        clock_rate: 0,
        evaluate_rtcp: false,
        simulcast: None,
        handshake: false,
        stream_ids: None,
        publisher_feedback: None,
        reverse: mediaplane_core::srtp::Protection::Clear,
        control: Default::default(),
        dtmf: Vec::new(),
    }
}

/// 200 tables, each differing from the one before in one subscriber of stream 0.
fn changes(base: &ForwardingTable, n: usize) -> Vec<(Arc<ForwardingTable>, IngressKey)> {
    let key = *base.streams.keys().next().unwrap();
    (0..n)
        .map(|i| {
            let mut t = base.clone();
            t.version = 2 + i as u64;
            t.streams.get_mut(&key).unwrap().copies[0].to = a(format!("127.0.0.4:{}", 1000 + i % 2));
            (Arc::new(t), key)
        })
        .collect()
}

fn summary(name: &str, mut d: Vec<Duration>) {
    d.sort();
    let q = |p: f64| d[((d.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e3;
    let mean = d.iter().sum::<Duration>().as_secs_f64() * 1e3 / d.len() as f64;
    println!("{name:>10}: n={} min {:.3} p50 {:.3} p90 {:.3} max {:.3} mean {:.3} ms", d.len(), q(0.0), q(0.5), q(0.9), q(1.0), mean);
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|s| s.parse().expect("number")).collect();
    let (n, streams) = (args.first().copied().unwrap_or(200), args.get(1).copied().unwrap_or(100));
    // SAFETY: plain syscall; the namespace goes away with the process.
    assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "unshare(CLONE_NEWNET) needs root");
    assert!(std::process::Command::new("ip").args(["link", "set", "lo", "up"]).status().unwrap().success());
    let base = ForwardingTable { version: 1, streams: (0..streams as u32).map(|i| entry(i, 8)).map(|e| (e.key, e)).collect(), ..Default::default() };
    let base = Arc::new(base);

    let fp = FastPath::load(&LoadOptions::default()).expect("loading the BPF program (root?)");
    fp.apply(base.clone()).unwrap();
    let (mut times, mut barriers) = (Vec::new(), 0);
    for (t, key) in changes(&base, n) {
        let start = Instant::now();
        let r = fp.apply_changes(t, Some(&[key])).unwrap();
        times.push(start.elapsed());
        barriers += r.barrier as usize;
    }
    summary("ebpf", times);
    println!("{:>10}  {barriers} of {n} calls waited for an RCU barrier", "");
    drop(fp);

    let us = UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, None).unwrap();
    us.apply(base.clone()).unwrap();
    let mut times = Vec::new();
    for (t, key) in changes(&base, n) {
        let start = Instant::now();
        us.apply_changes(t, &[key]).unwrap();
        times.push(start.elapsed());
    }
    summary("userspace", times);
    us.shutdown().unwrap();
}
