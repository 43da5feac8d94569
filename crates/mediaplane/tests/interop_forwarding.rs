//! Interop, `start forwarding` / `stop forwarding`: a call's media streamed to a recording or
//! analytics host (`ng.forward_to`), asked of rtpengine 10.5 and of `mediaplane serve` on each
//! data plane over NG, in a namespace testbed (caller, callee and the host's socket in
//! namespaces of their own).
//!
//! rtpengine hands forwarding to its recording daemon (`rtpengine-recording --forward-to`),
//! which this machine does not run: its replies are the reference (`ok` for both commands, an
//! error for an unknown call), not what reaches the host. mediaplane forwards itself: one more
//! copy of each party's RTP, from an address of its own per party. Phases of media, both
//! parties sending A-law: before (the host gets nothing), after `start forwarding` (the host
//! gets every packet of both parties, told apart by source address, and the parties still hear
//! each other), after `stop forwarding` with the caller's `from-tag` (only the callee's), and
//! after `stop forwarding` (nothing). On the eBPF plane every packet of the forwarded phase is
//! forwarded, fork included, by the BPF program.
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
use std::collections::BTreeMap;
use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

const CALL: &str = "forwarding-interop@interop_forwarding.test";
const CALLER_TAG: &str = "caller-tag";
const CALLEE_TAG: &str = "callee-tag";
const PACKETS: u16 = 25;
const SSRC_CALLER: u32 = 0x1111_1111;
const SSRC_CALLEE: u32 = 0x2222_2222;
/// The forwarding host's port, on the callee's namespace address.
const HOST_PORT: u16 = 9500;

/// What one phase delivered: the parties' packets from each other, and the host's per SSRC
/// (with the source addresses they came from).
#[derive(Debug, Default, PartialEq, Eq)]
struct Heard {
    caller: usize,
    callee: usize,
    host: BTreeMap<u32, usize>,
    host_sources: usize,
}

fn media(c: &TestCall, host: &UdpSocket, seq0: u16) -> Heard {
    let mut heard = Heard::default();
    let mut sources = std::collections::BTreeSet::new();
    let mut buf = [0u8; 2048];
    let ssrc = |b: &[u8]| u32::from_be_bytes([b[8], b[9], b[10], b[11]]);
    let mut read = |heard: &mut Heard, sources: &mut std::collections::BTreeSet<SocketAddr>| {
        while let Ok((n, _)) = c.caller.recv_from(&mut buf) {
            heard.caller += usize::from(n >= 12 && ssrc(&buf) == SSRC_CALLEE);
        }
        while let Ok((n, _)) = c.callee.recv_from(&mut buf) {
            heard.callee += usize::from(n >= 12 && ssrc(&buf) == SSRC_CALLER);
        }
        while let Ok((n, from)) = host.recv_from(&mut buf) {
            if n >= 12 {
                *heard.host.entry(ssrc(&buf)).or_default() += 1;
                sources.insert(from);
            }
        }
    };
    let start = Instant::now();
    for i in 0..PACKETS {
        std::thread::sleep((start + Duration::from_millis(20) * i as u32).saturating_duration_since(Instant::now()));
        let (seq, ts) = (seq0 + i, (seq0 + i) as u32 * 160);
        c.caller.send_to(&build_rtp(8, seq, ts, SSRC_CALLER, &[0xd5; 160]), c.to_caller).unwrap();
        c.callee.send_to(&build_rtp(8, seq, ts, SSRC_CALLEE, &[0xd5; 160]), c.to_callee).unwrap();
        read(&mut heard, &mut sources);
    }
    let until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < until {
        read(&mut heard, &mut sources);
        std::thread::sleep(Duration::from_millis(5));
    }
    heard.host_sources = sources.len();
    heard
}

#[derive(Debug)]
struct Run {
    /// The replies to start, stop (the caller's), stop, and start for an unknown call.
    replies: Vec<String>,
    /// Before, forwarded, the callee's only, stopped.
    phases: Vec<Heard>,
    /// On the eBPF plane: packets the BPF program forwarded in the forwarded phase.
    in_kernel: Option<u64>,
}

fn run(relay: &str, tmp: &Path) -> Run {
    let tb = Testbed::star(2).expect("testbed");
    let host_addr = SocketAddr::new(tb.peers[1].ip, HOST_PORT);
    let setup = RelaySetup { forward_to: Some(host_addr), ..Default::default() };
    let mut relay_proc =
        RelayProc::start_binary(&tb, relay, tmp, Path::new(env!("CARGO_BIN_EXE_mediaplane")), &setup).unwrap_or_else(|e| panic!("starting {relay}: {e:#}"));
    let host = peer_socket(&tb, 1, HOST_PORT);
    let c = set_up_call(&tb, CALL, CALLER_TAG, CALLEE_TAG);
    let command = |cmd: &str, call: &str, from: Option<&str>| {
        let mut req = vec![("command", Value::str(cmd)), ("call-id", Value::str(call))];
        req.extend(from.map(|f| ("from-tag", Value::str(f))));
        outcome(&ng_in(&tb, req))
    };
    let forwarded = || relay_proc.stats(&tb).ok().and_then(|s| s["extra"]["forwarded"].as_u64());
    // Both parties heard once (the relays latch).
    media(&c, &host, 0);
    let mut phases = vec![media(&c, &host, PACKETS)];
    let mut replies = vec![command("start forwarding", CALL, None)];
    let before = forwarded();
    phases.push(media(&c, &host, 2 * PACKETS));
    let in_kernel = forwarded().zip(before).map(|(after, before)| after - before);
    replies.push(command("stop forwarding", CALL, Some(CALLER_TAG)));
    phases.push(media(&c, &host, 3 * PACKETS));
    replies.push(command("stop forwarding", CALL, None));
    phases.push(media(&c, &host, 4 * PACKETS));
    replies.push(command("start forwarding", "no-such-call", None));
    ng_in(&tb, delete(CALL, CALLER_TAG, CALLEE_TAG));
    relay_proc.stop().unwrap_or_else(|e| panic!("{e:#}"));
    Run { replies, phases, in_kernel: in_kernel.filter(|_| relay == "mediaplane-ebpf") }
}

#[test]
fn a_call_is_forwarded_to_the_host_and_stopped_as_asked_beside_rtpengine() {
    if !sip::ready("a_call_is_forwarded_to_the_host_and_stopped_as_asked_beside_rtpengine", &["rtpengine"]) {
        return;
    }
    let tmp = common::TempDir::new("forwarding");
    let runs: Vec<(&str, Run)> =
        ["rtpengine", "mediaplane-userspace", "mediaplane-ebpf", "mediaplane-afxdp"].into_iter().map(|r| (r, run(r, &tmp.0))).collect();
    for (relay, r) in &runs {
        eprintln!("[{relay}] {r:?}");
    }
    let all = PACKETS as usize;
    let rtpengine = &runs[0].1;
    assert_eq!(rtpengine.replies[..3], ["ok", "ok", "ok"], "rtpengine's replies, the reference");
    assert!(rtpengine.replies[3].starts_with("error"), "{:?}", rtpengine.replies);
    for (relay, r) in &runs[1..] {
        assert_eq!(r.replies[..3], rtpengine.replies[..3], "[{relay}] rtpengine's replies");
        assert!(r.replies[3].starts_with("error (unknown call-id"), "[{relay}] {:?}", r.replies);
        for (i, p) in r.phases.iter().enumerate() {
            assert_eq!((p.caller, p.callee), (all, all), "[{relay}] phase {i}: the parties hear each other");
        }
        assert!(r.phases[0].host.is_empty(), "[{relay}] nothing forwarded before start: {:?}", r.phases[0]);
        let both: BTreeMap<u32, usize> = [(SSRC_CALLER, all), (SSRC_CALLEE, all)].into();
        assert_eq!((&r.phases[1].host, r.phases[1].host_sources), (&both, 2), "[{relay}] every packet of both parties, one source each");
        assert_eq!(r.phases[2].host, [(SSRC_CALLEE, all)].into(), "[{relay}] the caller's stopped, the callee's still forwarded");
        assert!(r.phases[3].host.is_empty(), "[{relay}] nothing after stop: {:?}", r.phases[3]);
    }
    // Both parties' packets, each fanned out to the other party and the host by the kernel.
    assert_eq!(runs[2].1.in_kernel, Some(2 * PACKETS as u64), "[mediaplane-ebpf] forwarded in the kernel");
}
