//! Hitless restart of the eBPF plane, end to end: `kill -9` of `mediaplane serve` while media
//! flows loses no packet (the pinned kernel path keeps forwarding), the restarted daemon adopts
//! the pinned state, and a graceful shutdown removes every pin.

mod common;

use common::netns::NetnsServe;
use mediaplane_bench::netns::Testbed;
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Removes the pin directory (which detaches pinned links) if a failed test left it.
struct PinGuard(PathBuf);
impl Drop for PinGuard {
    fn drop(&mut self) {
        let _ = mediaplane_ebpf::remove_pins(&self.0);
    }
}

#[test]
fn kill9_of_serve_loses_no_packet_and_the_restart_adopts_the_pins() {
    if !mediaplane_bench::require_root("hitless_restart") {
        return;
    }
    let tb = Testbed::star(2).unwrap();
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/{}-hitless", tb.prefix));
    let _guard = PinGuard(pin_dir.clone());
    // The store (and its -wal/-shm files) lives in a directory removed on success and failure.
    let tmp = common::TempDir::new("hitless");
    let store = tmp.0.join("store.db");
    let extra = ["--pin-dir", pin_dir.to_str().unwrap()];
    let (p0, p1) = (&tb.peers[0], &tb.peers[1]);
    let sfu0 = SocketAddr::new(p0.sfu_ip, 40000);

    let mut serve = NetnsServe::start_shared_bpffs(&tb, "ebpf", &store, &[&extra[..], &["--reset"]].concat());
    serve.two_party_room();

    let tx = tb.udp_socket(&p0.ns, SocketAddr::new(p0.ip, 5004)).unwrap();
    let rx = tb.udp_socket(&p1.ns, SocketAddr::new(p1.ip, 5004)).unwrap();
    // Warm-up: neighbours resolved, so the kernel path (not the slow path) carries the stream.
    for seq in 0..5u16 {
        tx.send_to(&build_rtp(0, 60000 + seq, 0, 1, &[0; 160]), sfu0).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    rx.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 2048];
    while rx.recv_from(&mut buf).is_ok() {}
    let forwarded_before = serve.api("GET", "/v1/stats", None)["extra"]["forwarded"].as_u64().unwrap();
    assert!(forwarded_before > 0, "the kernel path forwards after warm-up");

    // 1500 packets over ~1.5 s; the daemon dies at ~0.3 s and is back at ~0.8 s.
    const PACKETS: u16 = 1500;
    let sender = std::thread::spawn(move || {
        for seq in 0..PACKETS {
            tx.send_to(&build_rtp(0, seq, 0, 1, &[7; 160]), sfu0).unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    rx.set_nonblocking(false).unwrap();
    rx.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let receiver = std::thread::spawn(move || {
        let mut seqs = Vec::new();
        let mut buf = [0u8; 2048];
        while let Ok((n, _)) = rx.recv_from(&mut buf) {
            seqs.push(RtpHeader::parse(&buf[..n]).unwrap().sequence);
        }
        seqs
    });
    std::thread::sleep(Duration::from_millis(300));
    serve.kill9();
    assert!(pin_dir.join("streams").exists(), "pins survive the daemon");
    std::thread::sleep(Duration::from_millis(500));
    let serve = NetnsServe::start_shared_bpffs(&tb, "ebpf", &store, &extra);
    sender.join().unwrap();
    let mut seqs = receiver.join().unwrap();
    let n = seqs.len();
    seqs.sort();
    seqs.dedup();
    assert_eq!(seqs.len(), n, "no duplicates across the restart");
    assert_eq!(n, PACKETS as usize, "no loss across kill -9 and restart");

    // The new daemon adopted the state: its counters continue, and it forwards.
    let st = serve.api("GET", "/v1/stats", None);
    assert!(st["extra"]["forwarded"].as_u64().unwrap() >= forwarded_before + PACKETS as u64, "{}", st["extra"]);
    let mut serve = serve;
    assert!(serve.terminate(), "graceful shutdown");
    assert!(!pin_dir.exists(), "a graceful shutdown removes the pins");
}

/// A simulcast consumer's kernel state (its layer, its numbering) is pinned like the fan-out: a
/// restarted daemon keeps it, so the consumer goes on receiving its layer without waiting for a
/// keyframe (the slow path's first tick ran before the restored table was installed and used to
/// delete every pinned state as belonging to no consumer).
#[test]
fn a_restart_keeps_simulcast_consumers_on_their_layer() {
    use common::simulcast::{vp8, LAYERS};
    if !mediaplane_bench::require_root("hitless_restart_simulcast") {
        return;
    }
    let tb = Testbed::star(2).unwrap();
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/{}-hitless-sc", tb.prefix));
    let _guard = PinGuard(pin_dir.clone());
    let tmp = common::TempDir::new("hitless-sc");
    let store = tmp.0.join("store.db");
    let extra = ["--pin-dir", pin_dir.to_str().unwrap()];
    let (p0, p1) = (&tb.peers[0], &tb.peers[1]);
    let sfu0 = SocketAddr::new(p0.sfu_ip, 40000);
    let mut serve = NetnsServe::start_shared_bpffs(&tb, "ebpf", &store, &[&extra[..], &["--reset"]].concat());
    serve.api("POST", "/v1/rooms", Some(serde_json::json!({"id": "s"})));
    for (i, p) in tb.peers.iter().enumerate() {
        let body = serde_json::json!({"id": format!("p{i}"), "local": SocketAddr::new(p.sfu_ip, 40000), "remote": SocketAddr::new(p.ip, 5004)});
        serve.api("POST", "/v1/rooms/s/participants", Some(body));
    }
    serve.api("POST", "/v1/rooms/s/participants/p0/streams", Some(serde_json::json!({"name": "cam", "layers": LAYERS, "codec": "vp8", "clock_rate": 90000})));
    let consumer =
        serve.api("POST", "/v1/rooms/s/participants/p1/subscriptions", Some(serde_json::json!({"publisher": "p0", "stream": "cam", "preferred_layer": 1})))
            ["consumer"]
            .as_u64()
            .unwrap();
    let tx = tb.udp_socket(&p0.ns, SocketAddr::new(p0.ip, 5004)).unwrap();
    let rx = tb.udp_socket(&p1.ns, SocketAddr::new(p1.ip, 5004)).unwrap();
    rx.set_nonblocking(true).unwrap();
    // Every frame of layer 1 a keyframe until the consumer is on it.
    let current = |serve: &NetnsServe| serve.api("GET", &format!("/v1/rooms/s/consumers/{consumer}"), None)["layers"]["current"].as_u64();
    let mut seq = 100u16;
    for f in 0..50u16 {
        tx.send_to(&vp8(1, seq, 3000 * u32::from(f), f, true, true, 200), sfu0).unwrap();
        seq += 1;
        std::thread::sleep(Duration::from_millis(20));
        if f > 5 && current(&serve) == Some(1) {
            break;
        }
    }
    assert_eq!(current(&serve), Some(1), "the consumer is on layer 1");

    serve.kill9();
    let serve = NetnsServe::start_shared_bpffs(&tb, "ebpf", &store, &extra);
    // Past the slow path's first reconciling ticks (one a second).
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(current(&serve), Some(1), "after the restart, still on layer 1 (its kernel state kept)");
    // And its next non-key packet reaches it, renumbered on.
    let mut buf = [0u8; 2048];
    while rx.recv_from(&mut buf).is_ok() {}
    tx.send_to(&vp8(1, seq, 3000 * 60, 60, true, false, 200), sfu0).unwrap();
    rx.set_nonblocking(false).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let (n, _) = rx.recv_from(&mut buf).expect("a non-key frame after the restart");
    assert_eq!(RtpHeader::parse(&buf[..n]).unwrap().ssrc, LAYERS[0], "on the consumer's SSRC");
    let mut serve = serve;
    assert!(serve.terminate(), "graceful shutdown");
}
