//! The thesis topology: 12 participants in a star around the SFU, both scenarios (one stream to
//! all; low quality to all plus high quality to the upper half), through every data plane.
//! Every copy is captured on the wire at its receiver (AF_PACKET) and accounted for, and its
//! IPv4 and UDP checksums are verified. Transmit checksum offload is off on every veth, so the
//! frames carry final checksums (with offload, veth frames hold only a partial sum).

mod common;

use common::netns::NetnsServe;
use common::wire::{capture, ethtool_tx_off, frames};
use mediaplane_bench::netns::Testbed;
use mediaplane_core::packet::{parse_frame, verify_checksums};
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use serde_json::json;
use std::collections::BTreeMap;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::OwnedFd;
use std::time::Duration;

const N: usize = 12;
const SFU_PORT: u16 = 40000;
const SFU_HIGH_PORT: u16 = 40002;
const MEDIA_PORT: u16 = 5004;
const PACKETS: u16 = 10;

fn low(i: usize) -> u32 {
    1000 + i as u32
}
fn high(i: usize) -> u32 {
    2000 + i as u32
}

/// (receiver, ssrc) -> copies seen on the wire; panics on a bad checksum.
fn drain(tb: &Testbed, caps: &[OwnedFd]) -> BTreeMap<(usize, u32), u32> {
    let mut seen = BTreeMap::new();
    for (i, cap) in caps.iter().enumerate() {
        let me = SocketAddr::new(tb.peers[i].ip, MEDIA_PORT);
        for frame in frames(cap) {
            let Ok(f) = parse_frame(&frame) else { continue };
            if f.dst != me {
                continue; // our own outgoing media, ARP, ...
            }
            let sums = verify_checksums(&frame, &f);
            assert!(sums.ok(), "p{i}: bad checksum {sums:?} on a copy from {}", f.src);
            assert_eq!(f.src, SocketAddr::new(tb.peers[i].sfu_ip, SFU_PORT), "p{i}: copies come from its SFU address");
            let h = RtpHeader::parse(&frame[f.payload..f.payload + f.payload_len]).unwrap();
            *seen.entry((i, h.ssrc)).or_insert(0) += 1;
        }
    }
    seen
}

fn run(tb: &Testbed, plane: &str, two_streams: bool, caps: &[OwnedFd], socks: &[UdpSocket]) {
    // The store (and its -wal/-shm files) lives in a directory removed on success and failure.
    let tmp = common::TempDir::new("store");
    let store = tmp.0.join("store.db");
    let s = NetnsServe::start(tb, plane, &store, &["--reset"]);
    s.api("POST", "/v1/rooms", Some(json!({"id": "t"})));
    for (i, p) in tb.peers.iter().enumerate() {
        let body = json!({"id": format!("p{i}"), "local": SocketAddr::new(p.sfu_ip, SFU_PORT), "remote": SocketAddr::new(p.ip, MEDIA_PORT)});
        s.api("POST", "/v1/rooms/t/participants", Some(body));
        s.api("POST", &format!("/v1/rooms/t/participants/p{i}/streams"), Some(json!({"name": "low", "ssrc": low(i)})));
        if two_streams {
            let body = json!({"name": "high", "ssrc": high(i), "local": SocketAddr::new(p.sfu_ip, SFU_HIGH_PORT)});
            s.api("POST", &format!("/v1/rooms/t/participants/p{i}/streams"), Some(body));
        }
    }
    for i in 0..N {
        for j in (0..N).filter(|j| *j != i) {
            let path = format!("/v1/rooms/t/participants/p{i}/subscriptions");
            s.api("POST", &path, Some(json!({"publisher": format!("p{j}"), "stream": "low"})));
            if two_streams && i >= N / 2 {
                s.api("POST", &path, Some(json!({"publisher": format!("p{j}"), "stream": "high"})));
            }
        }
    }
    drain(tb, caps); // forget setup-time traffic
    for seq in 0..PACKETS {
        for (i, sock) in socks.iter().enumerate() {
            let p = &tb.peers[i];
            sock.send_to(&build_rtp(0, seq, 0, low(i), &[i as u8; 160]), SocketAddr::new(p.sfu_ip, SFU_PORT)).unwrap();
            if two_streams {
                sock.send_to(&build_rtp(96, seq, 0, high(i), &[0x55; 1000]), SocketAddr::new(p.sfu_ip, SFU_HIGH_PORT)).unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300));
    let seen = drain(tb, caps);
    let mut expected = BTreeMap::new();
    for i in 0..N {
        for j in (0..N).filter(|j| *j != i) {
            expected.insert((i, low(j)), PACKETS as u32);
            if two_streams && i >= N / 2 {
                expected.insert((i, high(j)), PACKETS as u32);
            }
        }
    }
    assert_eq!(seen, expected, "[{plane}, two_streams={two_streams}] copies on the wire");
    let stats = s.api("GET", "/v1/stats", None);
    let copies: u64 = expected.values().map(|v| *v as u64).sum();
    assert_eq!(stats["total"]["tx_copies"].as_u64().unwrap(), copies, "[{plane}] daemon counters: {}", stats["total"]);
    drop(s);
}

#[test]
fn twelve_participants_both_scenarios_every_copy_on_the_wire_with_valid_checksums() {
    if !mediaplane_bench::require_root("star12") {
        return;
    }
    let tb = Testbed::star(N).unwrap();
    for p in &tb.peers {
        ethtool_tx_off(&tb, &p.ns, &p.peer_if);
        ethtool_tx_off(&tb, &tb.sfu_ns, &p.sfu_if);
    }
    let caps: Vec<OwnedFd> = tb.peers.iter().map(|p| capture(&tb, &p.ns, &p.peer_if)).collect();
    let socks: Vec<UdpSocket> = tb.peers.iter().map(|p| tb.udp_socket(&p.ns, SocketAddr::new(p.ip, MEDIA_PORT)).unwrap()).collect();
    for plane in ["userspace", "ebpf", "afxdp"] {
        for two in [false, true] {
            run(&tb, plane, two, &caps, &socks);
        }
    }
}
