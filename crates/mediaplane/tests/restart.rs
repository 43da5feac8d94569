//! Sessions survive a restart of `serve` (graceful or `kill -9`): restored from the store and
//! forwarding again; with the embedded SQLite store and with a Redis one (a redis-server of the
//! test's own, which under CI=true must be installed).

mod common;

use common::{free_port, Daemon, TempDir};
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use serde_json::json;
use std::net::UdpSocket;
use std::path::Path;
use std::time::Duration;

fn setup(d: &Daemon, remote_a: &str, remote_b: &str, sfu_a: &str, sfu_b: &str) {
    assert_eq!(d.call("POST", "/v1/rooms", Some(json!({"id": "r"}))).0, 201);
    for (id, remote, local) in [("a", remote_a, sfu_a), ("b", remote_b, sfu_b)] {
        let (s, v) = d.call("POST", "/v1/rooms/r/participants", Some(json!({"id": id, "remote": remote, "local": local})));
        assert_eq!(s, 201, "{v}");
    }
    assert_eq!(d.call("POST", "/v1/rooms/r/participants/a/streams", Some(json!({"name": "main"}))).0, 201);
    assert_eq!(d.call("POST", "/v1/rooms/r/participants/b/subscriptions", Some(json!({"publisher": "a", "stream": "main"}))).0, 201);
}

/// a sends `n` packets; returns how many b received.
fn media_flows(a: &UdpSocket, b: &UdpSocket, sfu_a: &str, sfu_b: &str, base: u16, n: u16) -> usize {
    for seq in base..base + n {
        a.send_to(&build_rtp(0, seq, 0, 7, &[1; 160]), sfu_a).unwrap();
    }
    b.set_read_timeout(Some(Duration::from_millis(400))).unwrap();
    let mut buf = [0u8; 2048];
    let mut got = 0;
    while let Ok((len, from)) = b.recv_from(&mut buf) {
        assert_eq!(from.to_string(), sfu_b);
        let h = RtpHeader::parse(&buf[..len]).unwrap();
        assert!((base..base + n).contains(&h.sequence));
        got += 1;
    }
    got
}

/// The scenario against `store` (a SQLite path or a Redis URL); `ip` keeps the two runs'
/// addresses apart.
fn survive_restarts(store: &Path, ip: u8) {
    let (sfu_a, sfu_b) = (format!("127.79.{ip}.1:43000"), format!("127.79.{ip}.1:43002"));
    let (ra, rb) = (format!("127.79.{ip}.10:5000"), format!("127.79.{ip}.11:5000"));
    let a = UdpSocket::bind(&ra).unwrap();
    let b = UdpSocket::bind(&rb).unwrap();
    let port = free_port();
    let flows = |base| media_flows(&a, &b, &sfu_a, &sfu_b, base, 20);

    let mut d = Daemon::start_on(port, store, &[]);
    setup(&d, &ra, &rb, &sfu_a, &sfu_b);
    assert_eq!(flows(0), 20);

    // Graceful restart.
    assert!(d.terminate().success());
    let mut d = Daemon::start_on(port, store, &[]);
    assert_eq!(d.call("GET", "/v1/rooms", None).1["rooms"], json!(["r"]));
    assert_eq!(flows(100), 20, "forwarding again after a graceful restart");

    // kill -9: the store is still consistent.
    d.kill9();
    let mut d = Daemon::start_on(port, store, &[]);
    let (s, p) = d.call("GET", "/v1/rooms/r/participants/b", None);
    assert_eq!(s, 200);
    assert_eq!(p["subscriptions"][0]["publisher"], "a");
    assert_eq!(flows(200), 20, "forwarding again after kill -9");

    // --reset starts empty.
    assert!(d.terminate().success());
    let d = Daemon::start_on(port, store, &["--reset"]);
    assert_eq!(d.call("GET", "/v1/rooms", None).1["rooms"], json!([]));
    assert_eq!(media_flows(&a, &b, &sfu_a, &sfu_b, 300, 5), 0);
}

#[test]
fn sessions_survive_graceful_and_hard_restarts() {
    let dir = TempDir::new("restart");
    survive_restarts(&dir.0.join("s.db"), 5);
}

#[test]
fn sessions_survive_restarts_in_redis() {
    let Some(redis) = mediaplane_bench::redis::RedisServer::start("restart") else { return };
    survive_restarts(Path::new(&redis.url), 6);
    // It was Redis that kept them (not a file named like the URL): the daemon wrote its schema.
    let sock = redis.url.trim_start_matches("redis+unix://");
    let schema = std::process::Command::new("redis-cli").args(["-s", sock, "GET", "mediaplane:schema"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&schema.stdout).trim(), "1");
}
