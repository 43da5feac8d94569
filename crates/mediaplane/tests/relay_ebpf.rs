//! The SIP relay through the kernel fast path: `serve --dataplane ebpf --ng-listen` in a relay
//! namespace, the caller and the callee in namespaces of their own (a star of 2). A call is set
//! up over NG from inside the relay namespace, as a SIP proxy there would; the first packet of
//! each leg goes to the slow path and latches the leg; after that every packet must be forwarded
//! by the BPF program: the daemon's `extra.forwarded` grows by exactly the packets sent, the slow
//! path saw only the two latching packets, and nothing is lost.
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
use mediaplane_core::rtp::build_rtp;
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
fn relay_call_is_forwarded_by_the_kernel_after_latching() {
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
        .receiver("caller", caller_sock, [CALLEE_FLOW])
        .receiver("callee", callee_sock, [CALLER_FLOW]);
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
    // Each party hears from the relay address it sends to (symmetric RTP), and delay is small.
    for c in &report.copies {
        assert!(c.delay_ns.p50 < 5e6, "{c:?}");
    }

    // query counts the relayed packets; delete removes everything.
    let q = ng(&tb, vec![("command", "query".into()), ("call-id", CALL.into())]);
    let rtp = q.get("totals").and_then(|t| t.get("RTP")).and_then(|r| r.get("packets")).and_then(Value::as_int);
    assert_eq!(rtp, Some(sent as i64), "{q:?}");
    assert_eq!(text(&ng(&tb, delete(CALL, "caller-tag", "callee-tag")), "result"), "ok");
    assert_eq!(api(&tb, "/v1/relays")["relays"], serde_json::json!([]));
    assert!(serve.terminate(), "serve exits cleanly");
}
