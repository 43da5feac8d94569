//! Sessions survive a restart of `serve` (graceful or `kill -9`): restored from the store and
//! forwarding again.

mod common;

use common::{free_port, Daemon, TempDir};
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use serde_json::json;
use std::net::UdpSocket;
use std::time::Duration;

const SFU_A: &str = "127.79.5.1:43000";
const SFU_B: &str = "127.79.5.1:43002";

fn setup(d: &Daemon, remote_a: &str, remote_b: &str) {
    assert_eq!(d.call("POST", "/v1/rooms", Some(json!({"id": "r"}))).0, 201);
    for (id, remote, local) in [("a", remote_a, SFU_A), ("b", remote_b, SFU_B)] {
        let (s, v) = d.call("POST", "/v1/rooms/r/participants", Some(json!({"id": id, "remote": remote, "local": local})));
        assert_eq!(s, 201, "{v}");
    }
    assert_eq!(d.call("POST", "/v1/rooms/r/participants/a/streams", Some(json!({"name": "main"}))).0, 201);
    assert_eq!(d.call("POST", "/v1/rooms/r/participants/b/subscriptions", Some(json!({"publisher": "a", "stream": "main"}))).0, 201);
}

/// a sends `n` packets; returns how many b received.
fn media_flows(a: &UdpSocket, b: &UdpSocket, base: u16, n: u16) -> usize {
    for seq in base..base + n {
        a.send_to(&build_rtp(0, seq, 0, 7, &[1; 160]), SFU_A).unwrap();
    }
    b.set_read_timeout(Some(Duration::from_millis(400))).unwrap();
    let mut buf = [0u8; 2048];
    let mut got = 0;
    while let Ok((len, from)) = b.recv_from(&mut buf) {
        assert_eq!(from.to_string(), SFU_B);
        let h = RtpHeader::parse(&buf[..len]).unwrap();
        assert!((base..base + n).contains(&h.sequence));
        got += 1;
    }
    got
}

#[test]
fn sessions_survive_graceful_and_hard_restarts() {
    let dir = TempDir::new("restart");
    let store = dir.0.join("s.db");
    let a = UdpSocket::bind("127.79.5.10:5000").unwrap();
    let b = UdpSocket::bind("127.79.5.11:5000").unwrap();
    let port = free_port();

    let mut d = Daemon::start_on(port, &store, &[]);
    setup(&d, "127.79.5.10:5000", "127.79.5.11:5000");
    assert_eq!(media_flows(&a, &b, 0, 20), 20);

    // Graceful restart.
    assert!(d.terminate().success());
    let mut d = Daemon::start_on(port, &store, &[]);
    assert_eq!(d.call("GET", "/v1/rooms", None).1["rooms"], json!(["r"]));
    assert_eq!(media_flows(&a, &b, 100, 20), 20, "forwarding again after a graceful restart");

    // kill -9: the store is still consistent.
    d.kill9();
    let mut d = Daemon::start_on(port, &store, &[]);
    let (s, p) = d.call("GET", "/v1/rooms/r/participants/b", None);
    assert_eq!(s, 200);
    assert_eq!(p["subscriptions"][0]["publisher"], "a");
    assert_eq!(media_flows(&a, &b, 200, 20), 20, "forwarding again after kill -9");

    // --reset starts empty.
    assert!(d.terminate().success());
    let d = Daemon::start_on(port, &store, &["--reset"]);
    assert_eq!(d.call("GET", "/v1/rooms", None).1["rooms"], json!([]));
    assert_eq!(media_flows(&a, &b, 300, 5), 0);
}
