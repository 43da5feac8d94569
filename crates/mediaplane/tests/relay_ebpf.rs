//! The SIP relay through the kernel fast path: `serve --dataplane ebpf --ng-listen` in a relay
//! namespace, the caller and the callee in namespaces of their own (a star of 2). A call is set
//! up over NG from inside the relay namespace, as a SIP proxy there would; the first packet of
//! each leg goes to the slow path, which relays it and latches the leg; after that every packet
//! must be forwarded by the BPF program: the daemon's `extra.forwarded` grows by exactly the
//! packets sent, the slow path saw only the two latching packets, and nothing is lost. Then the
//! caller's NAT binding moves during a learning window: the leg follows it without a loss.
//!
//! The NG engine advertises one media address (`[media] ip`) to both parties: here the relay's
//! address on the caller's link (10.77.0.1). The callee reaches it through the relay namespace's
//! routing (its gateway is the relay side of its own link, 10.77.1.1), so its packets enter TC
//! ingress on the callee's link and the BPF program handles them there.

mod common;
mod ng_common;

use common::netns::{try_api, NetnsServe};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::traffic::{self, Profile, TrafficPlan};
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use mediaplane_ng::bencode::Value;
use ng_common::*;
use serde_json::Value as Json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const NG: &str = "127.0.0.1:2223";
const CALL: &str = "kernel-relay-call@relay_ebpf.test";
const CALLER_PORT: u16 = 6000;
const CALLEE_PORT: u16 = 7000;
const CALLER_FLOW: u32 = 0xca11;
const CALLEE_FLOW: u32 = 0xca1e;

/// One NG request sent from inside the relay namespace.
fn ng(tb: &Testbed, pairs: Vec<(&'static str, Value)>) -> Value {
    tb.in_ns(&tb.sfu_ns, move || ng_client(NG.parse().unwrap()).cmd(pairs)).unwrap()
}

fn api(tb: &Testbed, path: &str) -> Json {
    try_api(tb, "GET", path, None).unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

fn counter(stats: &Json, path: &[&str]) -> u64 {
    path.iter().fold(stats, |v, k| &v[*k]).as_u64().unwrap_or_else(|| panic!("no {path:?} in {stats}"))
}

#[test]
fn relay_call_is_forwarded_by_the_kernel_and_follows_a_new_binding() {
    if !mediaplane_bench::require_root("relay_ebpf") {
        return;
    }
    let tb = Testbed::star(2).unwrap();
    let (caller, callee) = (&tb.peers[0], &tb.peers[1]);
    let tmp = common::TempDir::new("relay-ebpf");
    let cfg = tmp.0.join("mediaplane.toml");
    std::fs::write(&cfg, format!("[media]\nip = \"{}\"\nport_min = 30000\nport_max = 30099\n", caller.sfu_ip)).unwrap();
    let store = tmp.0.join("store.db");
    let mut serve = NetnsServe::start(&tb, "ebpf", &store, &["--reset", "--ng-listen", NG, "--config", cfg.to_str().unwrap()]);
    assert_eq!(api(&tb, "/health")["dataplane"], "ebpf", "{}", api(&tb, "/health"));
    assert_eq!(text(&ng(&tb, vec![("command", "ping".into())]), "result"), "pong");

    // SIP: INVITE from the caller (offer), 200 OK from the callee (answer).
    let (cip, eip) = (caller.ip.to_string(), callee.ip.to_string());
    let offer = ng(&tb, offer_answer("offer", CALL, "caller-tag", None, &sdp(&cip, CALLER_PORT, 1), &cip));
    let to_callee = advertised(&offer); // where the callee sends
    let answer = ng(&tb, offer_answer("answer", CALL, "caller-tag", Some("callee-tag"), &sdp(&eip, CALLEE_PORT, 2), &eip));
    let to_caller = advertised(&answer); // where the caller sends
    assert_eq!(to_caller.ip(), caller.sfu_ip);
    assert_eq!(to_callee.ip(), caller.sfu_ip, "one media address is advertised to both parties");
    // The slow path binds no socket per relay port (packets are steered to it by sk_lookup):
    // the ports are still free for a bind in the relay namespace.
    for addr in [to_caller, to_callee] {
        let bound = tb.in_ns(&tb.sfu_ns, move || std::net::UdpSocket::bind(addr).map(drop)).unwrap();
        assert!(bound.is_ok(), "the daemon holds a socket on {addr}: {bound:?}");
    }

    let caller_sock = tb.udp_socket(&caller.ns, SocketAddr::new(caller.ip, CALLER_PORT)).unwrap();
    let callee_sock = tb.udp_socket(&callee.ns, SocketAddr::new(callee.ip, CALLEE_PORT)).unwrap();

    // Latching: one packet per leg, through the slow path.
    let id = rtp_relay(CALL);
    let before_latch = api(&tb, "/v1/stats");
    for (sock, to, side, src) in [(&caller_sock, to_caller, "a", caller.ip), (&callee_sock, to_callee, "b", callee.ip)] {
        sock.send_to(&build_rtp(8, 0, 0, 0x1a7c4, &[0xd5; 160]), to).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let r = api(&tb, &format!("/v1/relays/{id}"));
            if r[side]["latched"].as_str().is_some_and(|l| l.starts_with(&src.to_string())) {
                break;
            }
            assert!(Instant::now() < deadline, "leg {side} never latched: {r}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // The latching packets were relayed (by the slow path), not consumed.
    for (sock, name) in [(&callee_sock, "callee"), (&caller_sock, "caller")] {
        sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = [0u8; 2048];
        let (n, _) = sock.recv_from(&mut buf).unwrap_or_else(|e| panic!("the {name} never got the other leg's first packet: {e}"));
        assert_eq!(RtpHeader::parse(&buf[..n]).unwrap().ssrc, 0x1a7c4);
    }
    let s0 = api(&tb, "/v1/stats");
    assert_eq!(counter(&s0, &["total", "slow_unlatched"]) - counter(&before_latch, &["total", "slow_unlatched"]), 2, "{s0}");
    let steered = |s: &Json| counter(s, &["extra", "slow_path_steered"]);
    assert_eq!(steered(&s0) - steered(&before_latch), 2, "both latching packets were steered to the slow path: {s0}");
    assert_eq!(counter(&s0, &["extra", "slow_path_steer_failed"]), 0, "{s0}");

    // Media both ways, G.711-sized RTP at 250 packets/s per leg for 2 s.
    let profile = Profile::voice().with_rate(250.0);
    let plan = TrafficPlan::new(Duration::from_secs(2))
        .sender(caller_sock.try_clone().unwrap(), to_caller, CALLER_FLOW, profile.clone())
        .sender(callee_sock.try_clone().unwrap(), to_callee, CALLEE_FLOW, profile)
        .receiver("caller", caller_sock.try_clone().unwrap(), [CALLEE_FLOW])
        .receiver("callee", callee_sock.try_clone().unwrap(), [CALLER_FLOW]);
    let report = traffic::run(&plan).unwrap();
    let s1 = api(&tb, "/v1/stats");

    let sent = report.totals.sent;
    assert_eq!(sent, 1000, "{:?}", report.senders);
    assert_eq!(report.totals.received, sent, "zero loss after latching: {:?}", report.totals);
    assert_eq!((report.totals.lost, report.totals.duplicates, report.totals.unexpected), (0, 0, 0), "{:?}", report.totals);
    let forwarded = counter(&s1, &["extra", "forwarded"]) - counter(&s0, &["extra", "forwarded"]);
    assert_eq!(forwarded, sent, "every packet forwarded by the kernel: {s1}");
    assert_eq!(counter(&s1, &["total", "slow_unlatched"]), counter(&s0, &["total", "slow_unlatched"]), "no slow path after latching: {s1}");
    assert_eq!(counter(&s1, &["extra", "pass_unlatched"]), counter(&s0, &["extra", "pass_unlatched"]), "{s1}");
    assert_eq!(steered(&s1), steered(&s0), "nothing was steered to the user-space slow path after latching: {s1}");
    // Each party hears from the relay address it sends to (symmetric RTP), and delay is small:
    // one-way p50 measured 4.9-5.5 µs in six runs, 8.8 and 9.3 µs in two (this VM has whole runs
    // at about 3x: BENCHMARKS.md), 25.6 µs once in a loaded CI run; p99 8.8-73.8 µs (debug
    // build, 2-core VM). Bounds: 40 µs at p50 (the loaded run and some; that nothing took the
    // slow path is the counters' check above), 150 µs at p99 (twice the largest measured).
    for c in &report.copies {
        eprintln!(
            "relay copy {}: one-way p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
            c.flow_id,
            c.delay_ns.p50 / 1e3,
            c.delay_ns.p99 / 1e3,
            c.delay_ns.max / 1e3
        );
        assert!(c.delay_ns.p50 <= 40_000.0 && c.delay_ns.p99 <= 150_000.0, "{c:?}");
    }

    // query counts the relayed packets (the two latching ones too); delete removes everything.
    let q = ng(&tb, vec![("command", "query".into()), ("call-id", CALL.into())]);
    let rtp = q.get("totals").and_then(|t| t.get("RTP")).and_then(|r| r.get("packets")).and_then(Value::as_int);
    assert_eq!(rtp, Some(sent as i64 + 2), "{q:?}");
    // Reception quality as the kernel measured it in the path: per SSRC in `query` (the flow's
    // SSRC took over from the latching packet's), loss-free, with jitter (PCMA/8000 signalled).
    for flow in [CALLER_FLOW, CALLEE_FLOW] {
        let s = q.get("SSRC").and_then(|d| d.get(&flow.to_string())).unwrap_or_else(|| panic!("no SSRC {flow} in {q:?}"));
        let get = |k: &str| s.get(k).and_then(Value::as_int).unwrap_or_else(|| panic!("no {k:?} in {s:?}"));
        assert_eq!((get("packets"), get("expected packets"), get("cumulative loss"), get("duplicates")), (500, 500, 0, 0), "{s:?}");
        assert!(get("jitter (timestamp units)") >= 0, "{s:?}");
    }
    let rx: Vec<&Json> = s1["streams"].as_array().unwrap().iter().filter_map(|s| s.get("reception")).collect();
    assert!(rx.iter().any(|r| r["ssrc"] == CALLER_FLOW && r["packets"] == 500 && r["lost"] == 0 && r["clock_rate"] == 8000), "{s1}");

    // A session refresh (re-offer, same SDP) re-opens learning; the caller's NAT binding then
    // moves to another port. The leg follows it with one update of the kernel's entries, and
    // nothing is lost on the way: each callee packet reaches the old port or the new one, all
    // the old ones before all the new ones, and every packet from the new port is relayed.
    let s2 = api(&tb, "/v1/stats");
    ng(&tb, offer_answer("offer", CALL, "caller-tag", None, &sdp(&cip, CALLER_PORT, 1), &cip));
    let rebound = tb.udp_socket(&caller.ns, SocketAddr::new(caller.ip, CALLER_PORT + 2)).unwrap();
    let (to_old, to_new, to_callee_side) =
        (Collector::start(&caller_sock, REBIND_B), Collector::start(&rebound, REBIND_B), Collector::start(&callee_sock, REBIND_A));
    let from_callee = paced(callee_sock.try_clone().unwrap(), to_callee, REBIND_B, Duration::ZERO);
    let from_rebound = paced(rebound.try_clone().unwrap(), to_caller, REBIND_A, Duration::from_millis(200));
    from_callee.join().unwrap();
    from_rebound.join().unwrap();
    let (old_seqs, new_seqs, a_seqs) = (to_old.finish(), to_new.finish(), to_callee_side.finish());
    let s3 = api(&tb, "/v1/stats");
    assert_eq!(a_seqs, (0..REBIND_PACKETS).collect::<Vec<_>>(), "every packet from the new binding relayed, the first included");
    let mut all: Vec<u16> = old_seqs.iter().chain(&new_seqs).copied().collect();
    all.sort();
    assert_eq!(all, (0..REBIND_PACKETS).collect::<Vec<_>>(), "callee→caller: lost or duplicated around the switch (old port {old_seqs:?}, new {new_seqs:?})");
    assert!(old_seqs.iter().max() < new_seqs.iter().min(), "a clean switch: old port {old_seqs:?}, new {new_seqs:?}");
    assert!(new_seqs.len() as u16 >= REBIND_PACKETS / 2, "the leg followed the new binding: {} of {REBIND_PACKETS} there", new_seqs.len());
    let pass_up = counter(&s3, &["extra", "pass_unlatched"]) - counter(&s2, &["extra", "pass_unlatched"]);
    let kernel = counter(&s3, &["extra", "forwarded"]) - counter(&s2, &["extra", "forwarded"]);
    eprintln!(
        "rebinding: {} to the old port, {} to the new; {pass_up} packets via the slow path until the entry changed, {kernel} by the kernel",
        old_seqs.len(),
        new_seqs.len()
    );
    assert!((1..20).contains(&pass_up), "only the new binding's first packets go up: {pass_up}");
    assert_eq!(kernel + pass_up, 2 * REBIND_PACKETS as u64, "{s3}");
    assert_eq!(text(&ng(&tb, delete(CALL, "caller-tag", "callee-tag")), "result"), "ok");
    assert_eq!(api(&tb, "/v1/relays")["relays"], serde_json::json!([]));
    assert!(serve.terminate(), "serve exits cleanly");
}

const REBIND_A: u32 = 0xb1d0;
const REBIND_B: u32 = 0xb1d1;
const REBIND_PACKETS: u16 = 300;

/// `REBIND_PACKETS` RTP packets of SSRC `ssrc` (sequence 0..), one every 4 ms, after `delay`.
fn paced(sock: std::net::UdpSocket, to: SocketAddr, ssrc: u32, delay: Duration) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        let start = Instant::now();
        for seq in 0..REBIND_PACKETS {
            let due = start + Duration::from_millis(4) * seq as u32;
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            sock.send_to(&build_rtp(8, seq, seq as u32 * 160, ssrc, &[0xd5; 160]), to).unwrap();
        }
    })
}

/// The sequence numbers of SSRC `ssrc` arriving at a socket, until 500 ms of silence after
/// `finish`.
struct Collector(std::thread::JoinHandle<Vec<u16>>, std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Collector {
    fn start(sock: &std::net::UdpSocket, ssrc: u32) -> Collector {
        let sock = sock.try_clone().unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d = done.clone();
        Collector(
            std::thread::spawn(move || {
                let (mut seqs, mut buf) = (Vec::new(), [0u8; 2048]);
                let deadline = Instant::now() + Duration::from_secs(10);
                while Instant::now() < deadline {
                    match sock.recv_from(&mut buf) {
                        Ok((n, _)) => {
                            if let Ok(h) = RtpHeader::parse(&buf[..n]) {
                                if h.ssrc == ssrc {
                                    seqs.push(h.sequence);
                                }
                            }
                        }
                        Err(_) if d.load(std::sync::atomic::Ordering::Relaxed) => break,
                        Err(_) => {}
                    }
                }
                seqs
            }),
            done,
        )
    }

    fn finish(self) -> Vec<u16> {
        self.1.store(true, std::sync::atomic::Ordering::Relaxed);
        self.0.join().unwrap()
    }
}
