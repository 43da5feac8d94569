//! One conformance suite for every data plane: the same scenarios run through `mediaplane serve`
//! in a namespace star with each data plane, and every participant must receive exactly what
//! core's per-packet pipeline (`mediaplane_core::pipeline::reference`, on `classify`) decides on
//! the daemon's own compiled table — same copies, same source addresses, same payload bytes — so
//! the planes also agree with each other.

mod common;

use common::netns::NetnsServe;
use common::planes;
use mediaplane_bench::netns::Testbed;
use mediaplane_core::pipeline::{reference, Effect};
use mediaplane_core::rtp::build_rtp;
use mediaplane_core::table::{ForwardingTable, StreamEntry};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

const SFU_PORT: u16 = 40000;
const MEDIA_PORT: u16 = 5004;
const STRANGER_PORT: u16 = 5999;
const N: usize = 5;

/// The session: p0 publishes "main" (RTP, any SSRC) and "hi" (its own port, SSRC 77);
/// p1 publishes "raw" (non-RTP); p2 publishes nothing; p3 and p4 publish "main".
/// Subscriptions: everyone to p0/main; p3, p4 to p0/hi; p0, p2 to p1/raw; p0 to p3/main;
/// nobody to p4/main (a stream with 0 subscribers).
fn setup(s: &NetnsServe) {
    let tb = s.tb;
    let api = |m: &str, p: &str, b: Option<Value>| s.api(m, p, b);
    api("POST", "/v1/rooms", Some(json!({"id": "c"})));
    for (i, p) in tb.peers.iter().enumerate() {
        let body = json!({"id": format!("p{i}"), "local": SocketAddr::new(p.sfu_ip, SFU_PORT), "remote": SocketAddr::new(p.ip, MEDIA_PORT)});
        api("POST", "/v1/rooms/c/participants", Some(body));
    }
    let publish = |p: &str, body: Value| api("POST", &format!("/v1/rooms/c/participants/{p}/streams"), Some(body));
    publish("p0", json!({"name": "main"}));
    publish("p0", json!({"name": "hi", "ssrc": 77, "local": SocketAddr::new(tb.peers[0].sfu_ip, SFU_PORT + 2)}));
    publish("p1", json!({"name": "raw", "rtp": false}));
    publish("p3", json!({"name": "main"}));
    publish("p4", json!({"name": "main"}));
    let sub = |who: usize, publisher: &str, stream: &str| {
        api("POST", &format!("/v1/rooms/c/participants/p{who}/subscriptions"), Some(json!({"publisher": publisher, "stream": stream})));
    };
    for i in 1..N {
        sub(i, "p0", "main");
    }
    sub(3, "p0", "hi");
    sub(4, "p0", "hi");
    sub(0, "p1", "raw");
    sub(2, "p1", "raw");
    sub(0, "p3", "main");
}

/// What is sent: (sender participant, from the registered port?, SFU destination, payload).
fn traffic(tb: &Testbed) -> Vec<(usize, bool, SocketAddr, Vec<u8>)> {
    let sfu = |i: usize, port: u16| SocketAddr::new(tb.peers[i].sfu_ip, port);
    let mut v = Vec::new();
    for seq in 0..20u16 {
        v.push((0, true, sfu(0, SFU_PORT), build_rtp(0, seq, 160 * seq as u32, 1234, &[seq as u8; 160])));
        v.push((0, true, sfu(0, SFU_PORT + 2), build_rtp(96, seq, 0, 77, &[0xab; 900])));
        v.push((1, true, sfu(1, SFU_PORT), format!("raw datagram {seq}").into_bytes()));
        v.push((3, true, sfu(3, SFU_PORT), build_rtp(0, seq, 0, 3333, &[3; 40])));
        v.push((4, true, sfu(4, SFU_PORT), build_rtp(0, seq, 0, 4444, &[4; 40])));
    }
    // Strangers: right IP, wrong port; and a participant injecting into someone else's stream.
    for seq in 0..5u16 {
        v.push((0, false, sfu(0, SFU_PORT), build_rtp(0, seq, 0, 1234, &[9; 20])));
        // On the SSRC-narrowed port: with its stream's SSRC (a stranger), and with an SSRC no
        // stream there has (no stream).
        v.push((0, false, sfu(0, SFU_PORT + 2), build_rtp(96, seq, 0, 77, &[8; 20])));
        v.push((0, false, sfu(0, SFU_PORT + 2), build_rtp(96, seq, 0, 79, &[8; 20])));
        v.push((2, true, sfu(3, SFU_PORT), build_rtp(0, seq, 0, 3333, &[9; 20])));
        // Wrong SSRC on the SSRC-narrowed port; garbage and a truncated RTP header on RTP streams.
        v.push((0, true, sfu(0, SFU_PORT + 2), build_rtp(96, seq, 0, 78, &[1; 20])));
        v.push((3, true, sfu(3, SFU_PORT), b"garbage!".to_vec()));
        v.push((4, true, sfu(4, SFU_PORT), vec![0x80, 0, 0]));
    }
    v
}

type Delivered = BTreeMap<usize, Vec<(SocketAddr, Vec<u8>)>>;

/// Run the scenario through one data plane; returns what each participant received and the
/// daemon's compiled table.
fn run_plane(tb: &Testbed, plane: &str) -> (Delivered, ForwardingTable, Value) {
    // The store (and its -wal/-shm files) lives in a directory removed on success and failure.
    let tmp = common::TempDir::new("store");
    let store = tmp.0.join("store.db");
    let serve = NetnsServe::start(tb, plane, &store, &["--reset"]);
    setup(&serve);
    let socks: Vec<UdpSocket> = tb.peers.iter().map(|p| tb.udp_socket(&p.ns, SocketAddr::new(p.ip, MEDIA_PORT)).unwrap()).collect();
    let strangers: Vec<UdpSocket> = tb.peers.iter().map(|p| tb.udp_socket(&p.ns, SocketAddr::new(p.ip, STRANGER_PORT)).unwrap()).collect();
    // Neighbour entries for every participant exist before the first packet (a real
    // participant's signalling or first packet would have created them; the kernel path uses
    // the neighbour table).
    for (i, s) in socks.iter().enumerate() {
        s.send_to(b"", SocketAddr::new(tb.peers[i].sfu_ip, 9)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    for (from, registered, to, payload) in traffic(tb) {
        let s = if registered { &socks[from] } else { &strangers[from] };
        s.send_to(&payload, to).unwrap();
        std::thread::sleep(Duration::from_micros(300));
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut got = Delivered::new();
    let mut buf = vec![0u8; 2048];
    for (i, s) in socks.iter().enumerate() {
        s.set_nonblocking(true).unwrap();
        while let Ok((n, from)) = s.recv_from(&mut buf) {
            got.entry(i).or_default().push((from, buf[..n].to_vec()));
        }
        got.entry(i).or_default().sort();
    }
    for s in &strangers {
        s.set_nonblocking(true).unwrap();
        assert!(s.recv_from(&mut buf).is_err(), "a stranger's socket received a copy");
    }
    let table_json = serve.api("GET", "/v1/table", None);
    let stats = serve.api("GET", "/v1/stats", None);
    let entries: Vec<StreamEntry> = serde_json::from_value(table_json["streams"].clone()).unwrap();
    let table =
        ForwardingTable { version: table_json["version"].as_u64().unwrap(), streams: entries.into_iter().map(|e| (e.key, e)).collect(), ..Default::default() };
    (got, table, stats)
}

/// What core's per-packet pipeline (`mediaplane_core::pipeline::reference`) says each
/// participant must receive.
fn oracle(tb: &Testbed, table: &ForwardingTable) -> Delivered {
    let mut want = Delivered::new();
    for i in 0..N {
        want.insert(i, Vec::new());
    }
    for (from, registered, to, payload) in traffic(tb) {
        let src = SocketAddr::new(tb.peers[from].ip, if registered { MEDIA_PORT } else { STRANGER_PORT });
        for effect in reference(table, to, src, &payload) {
            if let Effect::Send { from: sfu, to: dst, packet, copy: Some(_), .. } = effect {
                let who = tb.peers.iter().position(|p| SocketAddr::new(p.ip, MEDIA_PORT) == dst).unwrap();
                want.get_mut(&who).unwrap().push((sfu, packet.to_vec()));
            }
        }
    }
    for v in want.values_mut() {
        v.sort();
    }
    want
}

#[test]
fn every_data_plane_delivers_exactly_what_the_model_says() {
    if !mediaplane_bench::require_root("conformance") {
        return;
    }
    let tb = Testbed::star(N).unwrap();
    let mut per_plane = Vec::new();
    for plane in planes() {
        let (got, table, stats) = run_plane(&tb, &plane);
        let want = oracle(&tb, &table);
        // Sanity of the oracle itself: p2 gets p0/main and p1/raw only, 20 each.
        assert_eq!(want[&2].len(), 40);
        assert_eq!(want[&3].len(), 40, "p0/main + p0/hi");
        for i in 0..N {
            let (g, w) = (&got[&i], &want[&i]);
            assert_eq!(g.len(), w.len(), "[{plane}] p{i}: {} copies, the model says {}; {}", g.len(), w.len(), stats["extra"]);
            assert!(g == w, "[{plane}] p{i}: copies differ from the model (source address or payload)");
        }
        let t = &stats["total"];
        // One set of counters on every plane: the eBPF plane's XDP pre-filter drops these
        // strangers before TC, and its drops are in the totals under classify()'s reason (the
        // breakdown by hook in `extra`).
        let xdp = stats["extra"]["xdp_drop_stranger"].as_u64().unwrap_or(0);
        let xdp_no_stream = stats["extra"]["xdp_drop_no_stream"].as_u64().unwrap_or(0);
        assert_eq!(t["drop_stranger"], 15, "[{plane}] {t} {}", stats["extra"]);
        assert_eq!(t["drop_no_stream"], 10, "[{plane}] wrong SSRC, stranger's unknown SSRC: {t} {}", stats["extra"]);
        if plane == "ebpf-xdp" {
            assert_eq!((xdp, xdp_no_stream), (15, 5), "[{plane}] the XDP pre-filter drops the strangers: {}", stats["extra"]);
        }
        assert_eq!(t["drop_malformed"], 10, "[{plane}] garbage + truncated: {t}");
        if plane == "afxdp" {
            // Every datagram came by an AF_XDP socket and every copy left by a TX ring: none took
            // the socket path underneath.
            let x = &stats["extra"];
            let copies: usize = want.values().map(Vec::len).sum();
            assert_eq!(x["xsk_redirected"], traffic(&tb).len(), "[{plane}] {x}");
            assert_eq!(x["afxdp_tx_frames"], copies, "[{plane}] {x}");
        }
        per_plane.push((plane, got));
    }
    for w in per_plane.windows(2) {
        assert!(w[0].1 == w[1].1, "{} and {} delivered different copies", w[0].0, w[1].0);
    }
}
