//! The NG media timeout on time, on both data planes: `mediaplane serve --ng-media-timeout 4`
//! in a relay namespace, a caller and a callee in namespaces of their own. After RTP both ways
//! (through the kernel fast path on the eBPF plane) the media stops; the data plane's
//! per-stream last-packet time must be the time of the last packet sent, and the call must be
//! deleted within one sweep (1 s) after `last packet + 4 s`, never before.

mod common;
mod ng_common;

use common::netns::{try_api, NetnsServe};
use mediaplane_bench::netns::Testbed;
use mediaplane_core::rtp::build_rtp;
use mediaplane_dataplane::monotonic_ns;
use mediaplane_ng::bencode::Value;
use ng_common::*;
use serde_json::Value as Json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const NG: &str = "127.0.0.1:2223";
const TIMEOUT: Duration = Duration::from_secs(4);
/// The NG sweep interval for a 4 s timeout (a quarter of it, at most 1 s).
const SWEEP: Duration = Duration::from_secs(1);
/// Polling the API, the deletion itself, and a loaded machine.
const SLACK: Duration = Duration::from_millis(300);

fn ng(tb: &Testbed, pairs: Vec<(&'static str, Value)>) -> Value {
    tb.in_ns(&tb.sfu_ns, move || ng_client(NG.parse().unwrap()).cmd(pairs)).unwrap()
}

fn api(tb: &Testbed, path: &str) -> Json {
    try_api(tb, "GET", path, None).unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

fn wait_latched(tb: &Testbed, id: &str, side: &str, src: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = api(tb, &format!("/v1/relays/{id}"));
        if r[side]["latched"].as_str() == Some(src.to_string().as_str()) {
            return;
        }
        assert!(Instant::now() < deadline, "leg {side} never latched {src}: {r}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The latest `last_rx_ns` of any stream (the call's are the only ones).
fn last_rx_ns(stats: &Json) -> u64 {
    stats["streams"].as_array().unwrap().iter().filter_map(|s| s["last_rx_ns"].as_u64()).max().unwrap_or(0)
}

fn times_out_on_time(plane: &str) {
    let tb = Testbed::star(2).unwrap();
    let (caller, callee) = (&tb.peers[0], &tb.peers[1]);
    let tmp = common::TempDir::new(&format!("media-timeout-{plane}"));
    let cfg = tmp.0.join("mediaplane.toml");
    std::fs::write(&cfg, format!("[media]\nip = \"{}\"\nport_min = 30000\nport_max = 30099\n", caller.sfu_ip)).unwrap();
    let store = tmp.0.join("store.db");
    let timeout_s = TIMEOUT.as_secs().to_string();
    let mut serve = NetnsServe::start(&tb, plane, &store, &["--reset", "--ng-listen", NG, "--ng-media-timeout", &timeout_s, "--config", cfg.to_str().unwrap()]);
    assert_eq!(api(&tb, "/health")["dataplane"], plane);

    let call = format!("media-timeout-{plane}@media_timeout.test");
    let (cip, eip) = (caller.ip.to_string(), callee.ip.to_string());
    let offer = ng(&tb, offer_answer("offer", &call, "caller-tag", None, &sdp(&cip, 6000, 1), &cip));
    let to_callee = advertised(&offer);
    let answer = ng(&tb, offer_answer("answer", &call, "caller-tag", Some("callee-tag"), &sdp(&eip, 7000, 2), &eip));
    let to_caller = advertised(&answer);
    let a = tb.udp_socket(&caller.ns, SocketAddr::new(caller.ip, 6000)).unwrap();
    let b = tb.udp_socket(&callee.ns, SocketAddr::new(callee.ip, 7000)).unwrap();
    let id = rtp_relay(&call);
    for (sock, to, side) in [(&a, to_caller, "a"), (&b, to_callee, "b")] {
        sock.send_to(&build_rtp(8, 0, 0, 0x7e57, &[0xd5; 160]), to).unwrap();
        wait_latched(&tb, &id, side, sock.local_addr().unwrap());
    }

    // 2 s of RTP both ways at 50 packets/s (after latching: by the kernel on the eBPF plane).
    let before = api(&tb, "/v1/stats");
    let start = Instant::now();
    let mut last_sent = (Instant::now(), 0u64);
    for seq in 1..=100u16 {
        std::thread::sleep((start + Duration::from_millis(20) * seq as u32).saturating_duration_since(Instant::now()));
        a.send_to(&build_rtp(8, seq, seq as u32 * 160, 0x7e57, &[0xd5; 160]), to_caller).unwrap();
        b.send_to(&build_rtp(8, seq, seq as u32 * 160, 0x7e58, &[0xd5; 160]), to_callee).unwrap();
        last_sent = (Instant::now(), monotonic_ns());
    }
    let (last_at, last_mono) = last_sent;
    let after = api(&tb, "/v1/stats");
    if plane == "ebpf" {
        let fwd = |s: &Json| s["extra"]["forwarded"].as_u64().unwrap_or(0);
        assert!(fwd(&after) - fwd(&before) >= 190, "the kernel forwarded the media: {after}");
    }
    // The stream's last packet is the last one sent (received a few µs after it was sent).
    let reported = last_rx_ns(&after);
    let skew = reported as i128 - last_mono as i128;
    assert!((-20_000_000..20_000_000).contains(&skew), "[{plane}] last_rx_ns {reported} is {skew} ns from the last packet sent ({last_mono}): {after}");

    let deadline = last_at + TIMEOUT + SWEEP + Duration::from_secs(3);
    let gone = loop {
        let relays = api(&tb, "/v1/relays")["relays"].as_array().map_or(0, Vec::len);
        if relays == 0 {
            break Instant::now();
        }
        assert!(Instant::now() < deadline, "[{plane}] the call was not deleted {:?} after its last packet", deadline - last_at);
        std::thread::sleep(Duration::from_millis(20));
    };
    let after_last = gone - last_at;
    eprintln!("[{plane}] deleted {after_last:?} after the last packet (timeout {TIMEOUT:?}, sweep {SWEEP:?})");
    assert!(after_last >= TIMEOUT, "[{plane}] deleted {after_last:?} after the last packet: before the {TIMEOUT:?} timeout");
    assert!(after_last <= TIMEOUT + SWEEP + SLACK, "[{plane}] deleted {after_last:?} after the last packet: more than one sweep late");
    let d = ng(&tb, vec![("command", "statistics".into())]);
    let total = d.get("statistics").and_then(|s| s.get("totalstatistics")).and_then(|t| t.get("timeoutsessions")).cloned();
    assert_eq!(total, Some(Value::Int(1)), "{d:?}");
    assert!(serve.terminate(), "serve exits cleanly");
}

#[test]
fn media_timeout_on_time_userspace() {
    if !mediaplane_bench::require_root("media_timeout") {
        return;
    }
    times_out_on_time("userspace");
}

#[test]
fn media_timeout_on_time_ebpf() {
    if !mediaplane_bench::require_root("media_timeout") {
        return;
    }
    times_out_on_time("ebpf");
}
