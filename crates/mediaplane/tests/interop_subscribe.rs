//! Interop, subscriptions (call monitoring, a SIPREC recorder's fork): `subscribe request`,
//! `subscribe answer` and `unsubscribe` sent to rtpengine 10.5 and to `mediaplane serve` on
//! each data plane over NG, in a namespace testbed (caller, callee and a monitor in namespaces
//! of their own).
//!
//! A call between caller and callee; the monitor subscribes to both parties (`all`), answers the
//! offer the reply carries, and must receive each party's RTP on the port its answer gave that
//! party's section, while the parties still hear each other; after `unsubscribe` it receives
//! nothing. Then a subscription to one party (`from-tag`, the `to-tag` made by the relay). The
//! replies carry rtpengine's keys; what the monitor and the parties heard is compared between
//! rtpengine and mediaplane on both planes.
//!
//! Needs root and rtpengine; skipped otherwise, except under CI=true, where that is a failure.

mod common;
mod ng_common;

use mediaplane_bench::netns::Testbed;
use mediaplane_bench::sip;
use mediaplane_core::rtp::build_rtp;
use mediaplane_harness::bench_relay::{RelayProc, RelaySetup};
use mediaplane_ng::bencode::Value;
use ng_common::*;
use std::collections::BTreeSet;
use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

const CALL: &str = "subscribe-interop@interop_subscribe.test";
const CALLER_TAG: &str = "caller-tag";
const CALLEE_TAG: &str = "callee-tag";
const PACKETS: u16 = 25;
const SSRC_CALLER: u32 = 0x1111_1111;
const SSRC_CALLEE: u32 = 0x2222_2222;
/// The monitor's ports for the first and second section of a subscription.
const MONITOR_PORTS: [u16; 2] = [8000, 8002];

/// What everybody received in one phase: RTP packets per (receiver, SSRC).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Heard {
    caller: usize,
    callee: usize,
    /// Per monitor port, per SSRC.
    monitor: [(usize, usize); 2],
}

/// A phase of media, 20 ms apart, both parties sending A-law; then 200 ms to read what is left.
fn media(caller: (&UdpSocket, SocketAddr), callee: (&UdpSocket, SocketAddr), monitor: [&UdpSocket; 2], seq0: u16) -> Heard {
    let mut heard = Heard::default();
    let mut buf = [0u8; 2048];
    let ssrc = |b: &[u8]| u32::from_be_bytes([b[8], b[9], b[10], b[11]]);
    let mut read = |heard: &mut Heard| {
        while let Ok((n, _)) = caller.0.recv_from(&mut buf) {
            heard.caller += usize::from(n >= 12 && ssrc(&buf) == SSRC_CALLEE);
        }
        while let Ok((n, _)) = callee.0.recv_from(&mut buf) {
            heard.callee += usize::from(n >= 12 && ssrc(&buf) == SSRC_CALLER);
        }
        for (i, s) in monitor.iter().enumerate() {
            while let Ok((n, _)) = s.recv_from(&mut buf) {
                match (n >= 12).then(|| ssrc(&buf)) {
                    Some(SSRC_CALLER) => heard.monitor[i].0 += 1,
                    Some(SSRC_CALLEE) => heard.monitor[i].1 += 1,
                    _ => {}
                }
            }
        }
    };
    let start = Instant::now();
    for i in 0..PACKETS {
        std::thread::sleep((start + Duration::from_millis(20) * i as u32).saturating_duration_since(Instant::now()));
        let seq = seq0 + i;
        caller.0.send_to(&build_rtp(8, seq, seq as u32 * 160, SSRC_CALLER, &[0x2a; 160]), caller.1).unwrap();
        callee.0.send_to(&build_rtp(8, seq, seq as u32 * 160, SSRC_CALLEE, &[0x2b; 160]), callee.1).unwrap();
        read(&mut heard);
    }
    let until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < until {
        read(&mut heard);
        std::thread::sleep(Duration::from_millis(5));
    }
    heard
}

/// The monitor's answer to a subscription offer of `sections` sections.
fn monitor_answer(ip: &str, sections: usize) -> String {
    let mut sdp = format!("v=0\r\no=- 3 3 IN IP4 {ip}\r\ns=monitor\r\nc=IN IP4 {ip}\r\nt=0 0\r\n");
    for port in &MONITOR_PORTS[..sections] {
        sdp += &format!("m=audio {port} RTP/AVP 8 101\r\na=rtpmap:8 PCMA/8000\r\na=rtpmap:101 telephone-event/8000\r\na=recvonly\r\n");
    }
    sdp
}

struct Run {
    /// The key sets of the two `subscribe request` replies (both parties; one party).
    reply_keys: [BTreeSet<String>; 2],
    /// The offers' media sections' payload types.
    offered: [Vec<Vec<u8>>; 2],
    /// Subscribed to both; after unsubscribing; subscribed to the caller only.
    heard: [Heard; 3],
    /// On the eBPF plane: packets the BPF program forwarded while subscribed to both.
    in_kernel: Option<u64>,
    /// On mediaplane: the monitor's three receiver reports counted as packets for no stream.
    reports_dropped: Option<u64>,
}

fn ok(relay: &str, what: &str, r: &Value) {
    assert_eq!(text(r, "result"), "ok", "[{relay}] {what}: {r:?}");
}

fn payload_types(relay: &str, r: &Value) -> Vec<Vec<u8>> {
    let sdp = mediaplane_ng::sdp::Sdp::parse(text(r, "sdp").as_bytes()).unwrap_or_else(|e| panic!("[{relay}] offer SDP: {e}: {r:?}"));
    sdp.media.iter().map(|m| m.formats.iter().map(|f| f.pt).collect()).collect()
}

fn run(relay: &str, tmp: &Path) -> Run {
    let tb = Testbed::star(3).expect("testbed");
    let mut relay_proc = RelayProc::start_binary(&tb, relay, tmp, Path::new(env!("CARGO_BIN_EXE_mediaplane")), &RelaySetup::default())
        .unwrap_or_else(|e| panic!("starting {relay}: {e:#}"));
    let TestCall { caller: a, callee: b, to_caller, to_callee } = set_up_call(&tb, CALL, CALLER_TAG, CALLEE_TAG);
    let mip = tb.peers[2].ip.to_string();
    let mon = MONITOR_PORTS.map(|p| peer_socket(&tb, 2, p));
    let phase = |seq0| media((&a, to_caller), (&b, to_callee), [&mon[0], &mon[1]], seq0);
    phase(0); // both parties heard once (the relays latch)
    let cmd = |c: &str, more: Vec<(&'static str, Value)>| {
        let mut v = vec![("command", Value::str(c)), ("call-id", Value::str(CALL))];
        v.extend(more);
        v
    };
    let keys = |r: &Value| r.as_dict().map(|d| d.keys().map(|k| String::from_utf8_lossy(k).to_string()).collect()).unwrap_or_default();

    let both = ng_in(&tb, cmd("subscribe request", vec![("flags", Value::List(vec![Value::str("all")])), ("to-tag", Value::str("monitor"))]));
    ok(relay, "subscribe request (all)", &both);
    let r = ng_in(&tb, cmd("subscribe answer", vec![("to-tag", Value::str("monitor")), ("sdp", Value::from(monitor_answer(&mip, 2)))]));
    ok(relay, "subscribe answer", &r);
    // The monitor's receiver reports reach the subscription's address (section 1's, from its
    // RTP port): heard and consumed there, not counted as packets for no stream.
    let offered = mediaplane_ng::sdp::Sdp::parse(text(&both, "sdp").as_bytes()).unwrap();
    let fork = match offered.media_addr(0) {
        Some(mediaplane_ng::sdp::ConnAddr::Ip(ip)) => SocketAddr::new(*ip, offered.media[0].port),
        other => panic!("[{relay}] the offer's address: {other:?}"),
    };
    let no_stream = || {
        relay
            .starts_with("mediaplane")
            .then(|| common::netns::try_api(&tb, "GET", "/v1/stats", None).expect("GET /v1/stats")["total"]["drop_no_stream"].as_u64().unwrap_or(0))
    };
    let no_stream_before = no_stream();
    for _ in 0..3 {
        mon[0].send_to(&[0x80, 201, 0, 1, 0x33, 0x33, 0x33, 0x33], fork).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    let reports_dropped = no_stream().zip(no_stream_before).map(|(a, b)| a - b);
    // On the eBPF plane the forks are copies the kernel makes: every packet of the phase is
    // forwarded by the BPF program (`extra.forwarded`), none goes up to the slow path.
    let forwarded = || {
        (relay == "mediaplane-ebpf")
            .then(|| common::netns::try_api(&tb, "GET", "/v1/stats", None).expect("GET /v1/stats")["extra"]["forwarded"].as_u64().unwrap_or(0))
    };
    let before = forwarded();
    let subscribed = phase(1000);
    let in_kernel = forwarded().zip(before).map(|(after, before)| after - before);
    let r = ng_in(&tb, cmd("unsubscribe", vec![("to-tag", Value::str("monitor"))]));
    ok(relay, "unsubscribe", &r);
    let unsubscribed = phase(2000);

    let one = ng_in(&tb, cmd("subscribe request", vec![("from-tag", Value::str(CALLER_TAG))]));
    ok(relay, "subscribe request (caller)", &one);
    let tag = text(&one, "to-tag");
    assert!(!tag.is_empty(), "[{relay}] a to-tag is made: {one:?}");
    let r = ng_in(&tb, cmd("subscribe answer", vec![("to-tag", Value::from(tag)), ("sdp", Value::from(monitor_answer(&mip, 1)))]));
    ok(relay, "subscribe answer (caller)", &r);
    let caller_only = phase(3000);

    ok(relay, "delete", &ng_in(&tb, delete(CALL, CALLER_TAG, CALLEE_TAG)));
    relay_proc.stop().unwrap_or_else(|e| panic!("{e:#}"));
    Run {
        reply_keys: [keys(&both), keys(&one)],
        offered: [payload_types(relay, &both), payload_types(relay, &one)],
        heard: [subscribed, unsubscribed, caller_only],
        in_kernel,
        reports_dropped,
    }
}

#[test]
fn a_monitor_subscribes_to_a_call_as_with_rtpengine_on_both_planes() {
    if !sip::ready("a_monitor_subscribes_to_a_call_as_with_rtpengine_on_both_planes", &["rtpengine"]) {
        return;
    }
    let tmp = common::TempDir::new("subscribe");
    let runs: Vec<(&str, Run)> = ["rtpengine", "mediaplane-userspace", "mediaplane-ebpf"].into_iter().map(|r| (r, run(r, &tmp.0))).collect();
    for (relay, r) in &runs {
        eprintln!("[{relay}] replies {:?}; offered {:?}; heard {:?}; in the kernel {:?}", r.reply_keys, r.offered, r.heard, r.in_kernel);
    }
    let n = PACKETS as usize;
    let want = [
        // The monitor's first section is the caller's, its second the callee's.
        Heard { caller: n, callee: n, monitor: [(n, 0), (0, n)] },
        Heard { caller: n, callee: n, monitor: [(0, 0), (0, 0)] },
        Heard { caller: n, callee: n, monitor: [(n, 0), (0, 0)] },
    ];
    let rtpe = &runs[0].1;
    assert_eq!(rtpe.heard, want, "rtpengine does what the test expects of a subscription");
    for (relay, r) in &runs[1..] {
        assert_eq!(r.heard, want, "[{relay}]");
        assert_eq!(r.reply_keys, rtpe.reply_keys, "[{relay}] the replies' keys");
        assert_eq!(r.offered, rtpe.offered, "[{relay}] the offers' formats");
        assert_eq!(r.reports_dropped, Some(0), "[{relay}] the monitor's receiver reports are heard at its fork");
    }
    let ebpf = &runs[2].1;
    assert_eq!(ebpf.in_kernel, Some(2 * PACKETS as u64), "[mediaplane-ebpf] every packet of both parties forwarded (and forked) in the kernel");
}
