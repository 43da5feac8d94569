//! Datagrams larger than the path MTU are forwarded, fragmented as the host fragments UDP, by
//! both data planes (issue 15, item 5).
//!
//! A star of four: p0 (1500-byte link) and p1 (jumbo link, MTU 9100) publish interleaved RTP
//! datagrams of 200, 3,000 and 9,000 bytes; p0 subscribes to p1, p1 to p0, p2 and p3 (1500) to
//! both. So large datagrams reach the SFU fragmented (from p0: the kernel plane hands them up,
//! `pass_fragment`) and whole (from p1: a copy too big for its egress link, `pass_fib_fail`),
//! and leave whole (to p1) or fragmented (to everyone else). Every subscriber must receive every
//! datagram exactly once, intact (reassembled by its UDP socket, which also checks the UDP
//! checksum), with `tx_errors` 0; the fragments on p0's link must look the same on both planes
//! (lengths, offsets, flags, TTL, TOS), and arrive in order on both planes (the kernel path
//! holds a stream in the slow path behind a jumbo copy or a fragmented datagram it handed up).

mod common;

use common::wire::{capture, frames};

use common::netns::NetnsServe;
use mediaplane_bench::netns::Testbed;
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use serde_json::json;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

const N: usize = 4;
const JUMBO: usize = 1;
const JUMBO_MTU: &str = "9100";
const SFU_PORT: u16 = 40000;
const MEDIA_PORT: u16 = 5004;
/// Datagram (RTP header + payload) sizes, sent in this order, over and over.
const SIZES: [usize; 6] = [200, 3000, 200, 9000, 200, 200];
const ROUNDS: usize = 5;

fn ssrc(i: usize) -> u32 {
    7000 + i as u32
}

/// Who subscribes to whom: (subscriber, publisher).
fn subscriptions() -> Vec<(usize, usize)> {
    vec![(0, 1), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1)]
}

fn datagram(publisher: usize, seq: u16) -> Vec<u8> {
    let len = SIZES[seq as usize % SIZES.len()] - 12;
    let payload: Vec<u8> = (0..len).map(|k| (k as u32 * 7 + seq as u32 * 13 + publisher as u32) as u8).collect();
    build_rtp(96, seq, 90 * seq as u32, ssrc(publisher), &payload)
}

/// One IPv4 frame as the wire shows it: (total length, fragment offset, MF, DF, TTL, TOS, ID != 0).
type FrameShape = (u16, u16, bool, bool, u8, u8, bool);

/// The shapes of the IPv4 frames from `src` to `dst` captured so far, in order.
fn drain_shapes(fd: &OwnedFd, src: IpAddr, dst: IpAddr) -> Vec<FrameShape> {
    let mut out = Vec::new();
    for f in frames(fd) {
        if f.len() < 34 || f[12..14] != [0x08, 0x00] {
            continue;
        }
        let ip = &f[14..];
        let (s, d) = (IpAddr::from([ip[12], ip[13], ip[14], ip[15]]), IpAddr::from([ip[16], ip[17], ip[18], ip[19]]));
        if s != src || d != dst || ip[9] != 17 {
            continue;
        }
        let frag = u16::from_be_bytes([ip[6], ip[7]]);
        let id = u16::from_be_bytes([ip[4], ip[5]]);
        out.push((u16::from_be_bytes([ip[2], ip[3]]), (frag & 0x1fff) * 8, frag & 0x2000 != 0, frag & 0x4000 != 0, ip[8], ip[1], id != 0));
    }
    out
}

/// Everything `sock` receives until `want` datagrams or a quiet second: (ssrc, seq) in arrival
/// order; panics on a datagram that is not one the publisher sent.
fn receive(sock: &UdpSocket, want: usize, who: usize) -> Vec<(u32, u16)> {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65536];
    sock.set_read_timeout(Some(Duration::from_millis(1000))).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.len() < want && Instant::now() < deadline {
        let Ok((n, _)) = sock.recv_from(&mut buf) else { break };
        let h = RtpHeader::parse(&buf[..n]).unwrap_or_else(|e| panic!("p{who}: not RTP ({n} bytes): {e:?}"));
        let publisher = (h.ssrc - ssrc(0)) as usize;
        assert!(publisher < N, "p{who}: unknown ssrc {}", h.ssrc);
        assert!(buf[..n] == datagram(publisher, h.sequence)[..], "p{who}: datagram {} of p{publisher} damaged ({n} bytes)", h.sequence);
        got.push((h.ssrc, h.sequence));
    }
    got
}

/// The sequence numbers of `order` that arrived before a smaller one (overtaken datagrams show as
/// the ones that overtook them).
fn out_of_order(order: &[u16]) -> Vec<u16> {
    order.windows(2).filter(|w| w[1] < w[0]).map(|w| w[0]).collect()
}

fn run(tb: &Testbed, plane: &str, socks: &[UdpSocket], cap: &OwnedFd) -> Vec<FrameShape> {
    let tmp = common::TempDir::new("large");
    let store = tmp.0.join("store.db");
    let s = NetnsServe::start(tb, plane, &store, &["--reset"]);
    s.api("POST", "/v1/rooms", Some(json!({"id": "big"})));
    for (i, p) in tb.peers.iter().enumerate() {
        let body = json!({"id": format!("p{i}"), "local": SocketAddr::new(p.sfu_ip, SFU_PORT), "remote": SocketAddr::new(p.ip, MEDIA_PORT)});
        s.api("POST", "/v1/rooms/big/participants", Some(body));
        if i < 2 {
            s.api("POST", &format!("/v1/rooms/big/participants/p{i}/streams"), Some(json!({"name": "main", "ssrc": ssrc(i)})));
        }
    }
    for (sub, publisher) in subscriptions() {
        let path = format!("/v1/rooms/big/participants/p{sub}/subscriptions");
        s.api("POST", &path, Some(json!({"publisher": format!("p{publisher}"), "stream": "main"})));
    }
    let (p0, sfu0) = (tb.peers[0].ip, tb.peers[0].sfu_ip);
    drain_shapes(cap, sfu0, p0);
    let total = (SIZES.len() * ROUNDS) as u16;
    // Each round back to back (as the packets of a video frame go), rounds 5 ms apart.
    for seq in 0..total {
        for (i, sock) in socks.iter().enumerate().take(2) {
            sock.send_to(&datagram(i, seq), SocketAddr::new(tb.peers[i].sfu_ip, SFU_PORT)).unwrap();
        }
        if (seq as usize + 1).is_multiple_of(SIZES.len()) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let mut expected_copies = 0;
    for (i, sock) in socks.iter().enumerate() {
        let from: Vec<usize> = subscriptions().iter().filter(|(s, _)| *s == i).map(|(_, p)| *p).collect();
        let got = receive(sock, from.len() * total as usize, i);
        for &publisher in &from {
            let order: Vec<u16> = got.iter().filter(|(s, _)| *s == ssrc(publisher)).map(|(_, q)| *q).collect();
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, (0..total).collect::<Vec<_>>(), "[{plane}] p{i} from p{publisher}: every datagram exactly once (arrival order {order:?})");
            let late = out_of_order(&order);
            if !late.is_empty() {
                let sizes: Vec<usize> = late.iter().map(|q| SIZES[*q as usize % SIZES.len()]).collect();
                eprintln!("[{plane}] p{i} from p{publisher}: reordered: {sizes:?}-byte datagrams {late:?} arrived before earlier ones: {order:?}");
            }
            assert!(late.is_empty(), "[{plane}] p{i} from p{publisher}: in order: {order:?}");
            expected_copies += total as u64;
        }
        assert!(receive_nothing_more(sock), "[{plane}] p{i}: a duplicate");
    }
    let stats = s.api("GET", "/v1/stats", None);
    let t = &stats["total"];
    eprintln!(
        "[{plane}] tx_copies {} tx_errors {} pass_fragment {} pass_fib_fail {} pass_in_order {}",
        t["tx_copies"], t["tx_errors"], stats["extra"]["pass_fragment"], stats["extra"]["pass_fib_fail"], stats["extra"]["pass_in_order"]
    );
    assert_eq!(t["tx_errors"].as_u64(), Some(0), "[{plane}] no send failed: {t}");
    if plane == "afxdp" {
        // Nothing went round by the host stack: p0's fragments were reassembled from AF_XDP
        // frames, p1's jumbo datagrams gathered from several; the copies too big for a link left
        // by the socket (the kernel fragments them).
        let x = &stats["extra"];
        let n = |k: &str| x[k].as_u64().unwrap_or_else(|| panic!("[{plane}] no {k}: {x}"));
        eprintln!("[{plane}] {x}");
        assert_eq!(n("xsk_pass_fragment"), 0, "[{plane}] {x}");
        assert!(n("afxdp_rx_reassembled") > 0 && n("afxdp_rx_gathered") > 0 && n("afxdp_tx_socket_too_big") > 0, "[{plane}] {x}");
        assert_eq!(n("afxdp_reassembly_timeouts") + n("afxdp_reassembly_dropped"), 0, "[{plane}] {x}");
    }
    assert_eq!(t["tx_copies"].as_u64(), Some(expected_copies), "[{plane}] {t}");
    drop(s);
    drain_shapes(cap, sfu0, p0)
}

fn receive_nothing_more(sock: &UdpSocket) -> bool {
    sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    sock.recv_from(&mut [0u8; 65536]).is_err()
}

#[test]
fn large_datagrams_are_fragmented_as_the_host_would_on_both_planes() {
    if !mediaplane_bench::require_root("large_datagrams") {
        return;
    }
    let tb = Testbed::star(N).unwrap();
    let p = &tb.peers[JUMBO];
    for (ns, dev) in [(&p.ns, &p.peer_if), (&tb.sfu_ns, &p.sfu_if)] {
        let st = tb.command(ns, "ip").args(["link", "set", "dev", dev, "mtu", JUMBO_MTU]).status().unwrap();
        assert!(st.success(), "ip link set {dev} mtu {JUMBO_MTU}");
    }
    let socks: Vec<UdpSocket> = tb.peers.iter().map(|p| tb.udp_socket(&p.ns, SocketAddr::new(p.ip, MEDIA_PORT)).unwrap()).collect();
    for s in &socks {
        let size: libc::c_int = 4 << 20;
        unsafe { libc::setsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, (&size as *const libc::c_int).cast(), 4) };
    }
    let cap = capture(&tb, &tb.peers[0].ns, &tb.peers[0].peer_if);
    let mut shapes = BTreeMap::new();
    for plane in ["userspace", "ebpf", "afxdp"] {
        shapes.insert(plane, run(&tb, plane, &socks, &cap));
    }
    // What p0 received from its SFU address (p1's datagrams), frame by frame.
    let fragments = shapes["userspace"].iter().filter(|f| f.2 || f.1 > 0).count();
    assert!(fragments > 0, "the large datagrams reach p0 fragmented: {:?}", shapes["userspace"]);
    let mut normalized = BTreeMap::new();
    for (plane, frames) in &shapes {
        for f in frames {
            assert!(f.0 <= 1500, "[{plane}] a frame over p0's MTU: {f:?}");
            let fragmented = f.2 || f.1 > 0;
            assert_eq!(f.3, !fragmented, "[{plane}] DF on whole datagrams only: {f:?}");
            if fragmented {
                assert!(f.6, "[{plane}] fragments carry an IP ID: {f:?}");
            }
        }
        // Whole datagrams: DF with an ID of the SFU's own on both planes (HeaderPolicy).
        let whole_with_id = frames.iter().filter(|f| !(f.2 || f.1 > 0) && f.6).count();
        eprintln!(
            "[{plane}] p0 got {} frames from its SFU address, {} of them fragments, {whole_with_id} whole ones with a non-zero ID",
            frames.len(),
            frames.iter().filter(|f| f.2 || f.1 > 0).count()
        );
        let mut v: Vec<FrameShape> = frames.iter().map(|f| (f.0, f.1, f.2, f.3, f.4, f.5, f.2 || f.1 > 0)).collect();
        v.sort();
        normalized.insert(*plane, v);
    }
    assert_eq!(normalized["userspace"], normalized["ebpf"], "the same frames on the wire from both planes");
    assert_eq!(normalized["userspace"], normalized["afxdp"], "the same frames on the wire from the AF_XDP plane");
}
