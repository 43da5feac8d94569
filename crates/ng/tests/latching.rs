//! Endpoint learning through real calls over NG (the user-space plane, in-process, loopback):
//! a re-INVITE that moves the caller's port while it still sends from the old one, NAT
//! rebinding inside and after the learning window, `media-handover`, `strict-source` (learns in
//! the window, then drops other sources), and hold
//! with `c=0.0.0.0`. Every packet carries its own sequence number and is looked for at the
//! socket it must reach (and only there). The learning window is 600 ms here (3 s by default).

mod common;

use common::*;
use mediaplane_control::config::MediaConfig;
use mediaplane_core::rtp::build_rtp;
use mediaplane_ng::bencode::Value;
use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

const MEDIA_IP: &str = "127.85.0.1";
const CALLER_IP: &str = "127.85.1.1";
const CALLEE_IP: &str = "127.85.2.1";
const WINDOW: Duration = Duration::from_millis(600);
/// Long enough for a reported source to reach the control plane and the table to change.
const SETTLE: Duration = Duration::from_millis(100);

struct Call {
    relay: Relay,
    ng: NgClient,
    id: &'static str,
    /// Where the caller sends (the relay's caller-facing address), and the callee.
    to_a: SocketAddr,
    to_b: SocketAddr,
    callee: UdpSocket,
    seq: u16,
}

fn media_socket(addr: &str) -> UdpSocket {
    let s = UdpSocket::bind(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(80))).unwrap();
    s
}

fn with_flags(mut req: Vec<(&'static str, Value)>, flags: &[&str]) -> Vec<(&'static str, Value)> {
    let all: Vec<&str> = ["trust-address"].iter().chain(flags).copied().collect();
    req.retain(|(k, _)| *k != "flags");
    req.push(("flags", list(&all)));
    req
}

impl Call {
    /// Caller signals `caller_sdp_port`, the callee 127.85.2.1:7000.
    fn start(id: &'static str, caller_sdp_port: u16, ports: (u16, u16)) -> Call {
        let media =
            MediaConfig { ip: MEDIA_IP.parse().unwrap(), port_min: ports.0, port_max: ports.1, learning_ms: WINDOW.as_millis() as u64, ..Default::default() };
        let relay = Relay::start_with(media, Duration::from_secs(60));
        let mut ng = ng_client(relay.ng);
        let callee = media_socket(&format!("{CALLEE_IP}:{}", ports.0 - 1000));
        let to_b = advertised(&ng.cmd(offer_answer("offer", id, "tagA", None, &sdp(CALLER_IP, caller_sdp_port), CALLER_IP)));
        let callee_port = callee.local_addr().unwrap().port();
        let to_a = advertised(&ng.cmd(offer_answer("answer", id, "tagA", Some("tagB"), &sdp(CALLEE_IP, callee_port), CALLEE_IP)));
        Call { relay, ng, id, to_a, to_b, callee, seq: 0 }
    }

    /// A re-offer from the caller (a re-INVITE), with extra NG flags.
    fn reoffer(&mut self, sdp_body: &str, flags: &[&str]) -> Value {
        let r = self.ng.cmd(with_flags(offer_answer("offer", self.id, "tagA", None, sdp_body, CALLER_IP), flags));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        r
    }

    /// The callee's answer to it (its SDP unchanged).
    fn answer(&mut self) {
        let port = self.callee.local_addr().unwrap().port();
        let r = self.ng.cmd(offer_answer("answer", self.id, "tagA", Some("tagB"), &sdp(CALLEE_IP, port), CALLEE_IP));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
    }

    fn next(&mut self) -> u16 {
        self.seq += 1;
        self.seq
    }

    /// One caller packet from `from`: its sequence number.
    fn caller_sends(&mut self, from: &UdpSocket) -> u16 {
        let seq = self.next();
        from.send_to(&build_rtp(8, seq, 0, 0xa, &[0xd5; 160]), self.to_a).unwrap();
        seq
    }

    fn callee_sends(&mut self) -> u16 {
        let seq = self.next();
        self.callee.send_to(&build_rtp(8, seq, 0, 0xb, &[0xd5; 160]), self.to_b).unwrap();
        seq
    }
}

fn sdp(ip: &str, port: u16) -> String {
    g711_sdp(ip, port, 1, 8)
}

fn seqs(s: &UdpSocket) -> Vec<i32> {
    drain(s).into_iter().map(|(seq, _)| seq).collect()
}

#[test]
fn a_reinvite_moving_the_callers_port_with_a_late_answer_keeps_both_directions() {
    let mut c = Call::start("reinvite@latching.test", 6000, (43000, 43099));
    let (p1, p2) = (media_socket(&format!("{CALLER_IP}:6000")), media_socket(&format!("{CALLER_IP}:6002")));
    let first = c.caller_sends(&p1);
    assert_eq!(seqs(&c.callee), vec![first as i32], "the latching packet is relayed, not consumed");
    let b0 = c.callee_sends();
    assert_eq!(seqs(&p1), vec![b0 as i32]);

    // re-INVITE: the caller moves to 6002 but keeps sending from 6000 until the 200 OK, which
    // comes 200 ms late. Its old port still listens meanwhile.
    c.reoffer(&sdp(CALLER_IP, 6002), &[]);
    let mut to_callee = Vec::new();
    let mut at_p1 = Vec::new();
    for _ in 0..5 {
        to_callee.push(c.caller_sends(&p1) as i32);
        std::thread::sleep(Duration::from_millis(20));
        let b = c.callee_sends() as i32;
        std::thread::sleep(Duration::from_millis(20));
        at_p1.push(b);
    }
    assert_eq!(seqs(&c.callee), to_callee, "caller→callee while the answer is pending");
    let (got_p1, got_p2) = (seqs(&p1), seqs(&p2));
    assert_eq!(got_p1.iter().chain(&got_p2).count(), 5, "nothing lost: at 6000 {got_p1:?}, at 6002 {got_p2:?}");
    assert!(got_p1.len() >= 4, "the caller still sends from 6000: it is followed there ({got_p1:?})");

    c.answer();
    // The caller switches to 6002; an old-port straggler after that must not win it back.
    let a1 = c.caller_sends(&p2);
    std::thread::sleep(SETTLE);
    let straggler = c.caller_sends(&p1);
    std::thread::sleep(SETTLE);
    let mut after = Vec::new();
    let mut from_caller = vec![a1 as i32, straggler as i32];
    for _ in 0..10 {
        from_caller.push(c.caller_sends(&p2) as i32);
        after.push(c.callee_sends() as i32);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(seqs(&c.callee), from_caller, "caller→callee: every packet, the straggler's too");
    assert_eq!(seqs(&p2), after, "callee→caller follows the new port");
    assert!(seqs(&p1).is_empty(), "nothing goes back to the old port");

    // The window closes: 6002 stays; another source is relayed but not followed.
    std::thread::sleep(WINDOW + SETTLE);
    let stranger = media_socket(&format!("{CALLER_IP}:6010"));
    let s = c.caller_sends(&stranger);
    std::thread::sleep(SETTLE);
    let b = c.callee_sends();
    assert_eq!(seqs(&c.callee), vec![s as i32], "after the window a new source is relayed (rtpengine does too)");
    assert_eq!(seqs(&p2), vec![b as i32], "…but not followed");
    assert!(seqs(&stranger).is_empty());
    drop(c.relay);
}

#[test]
fn nat_rebinding_is_followed_in_the_window_and_with_media_handover_only() {
    // The caller signals 6100 but sends through a NAT: from 6101, then 6103, ...
    let mut c = Call::start("nat@latching.test", 6100, (43100, 43199));
    let nat = |port: u16| media_socket(&format!("{CALLER_IP}:{port}"));
    let (n1, n2, n3, n4) = (nat(6101), nat(6103), nat(6105), nat(6107));
    c.caller_sends(&n1);
    std::thread::sleep(SETTLE);
    let b = c.callee_sends();
    assert_eq!(seqs(&n1), vec![b as i32], "latched the NAT binding");
    // Rebinding inside the window: followed.
    std::thread::sleep(WINDOW / 4);
    c.caller_sends(&n2);
    std::thread::sleep(SETTLE);
    let b = c.callee_sends();
    assert_eq!(seqs(&n2), vec![b as i32], "rebinding inside the window is followed");
    assert!(seqs(&n1).is_empty());
    // After the window: relayed one way only (the return path stays), as rtpengine does.
    std::thread::sleep(WINDOW + SETTLE);
    seqs(&c.callee);
    let a = c.caller_sends(&n3);
    std::thread::sleep(SETTLE);
    let b = c.callee_sends();
    assert_eq!(seqs(&c.callee), vec![a as i32]);
    assert_eq!((seqs(&n2), seqs(&n3)), (vec![b as i32], vec![]), "after the window: not followed");

    // media-handover: followed at any time, window or not.
    c.reoffer(&sdp(CALLER_IP, 6100), &["media-handover"]);
    std::thread::sleep(WINDOW + SETTLE);
    let a = c.caller_sends(&n4);
    std::thread::sleep(SETTLE);
    let b = c.callee_sends();
    assert_eq!(seqs(&c.callee), vec![a as i32]);
    assert_eq!(seqs(&n4), vec![b as i32], "media-handover follows a new source after the window");

    // strict-source: learns in the window (rtpengine does too), then drops any other source.
    let n5 = nat(6109);
    c.reoffer(&sdp(CALLER_IP, 6100), &["strict-source"]);
    let a = c.caller_sends(&n5);
    std::thread::sleep(WINDOW + SETTLE);
    c.caller_sends(&n4);
    let ok = c.caller_sends(&n5);
    std::thread::sleep(SETTLE);
    let b = c.callee_sends();
    assert_eq!(seqs(&c.callee), vec![a as i32, ok as i32], "strict-source drops other sources once locked");
    assert_eq!(seqs(&n5), vec![b as i32]);
    let stats = c.relay.mgr.stats();
    let id = mediaplane_ng::calls::rtp_relay_id(&mediaplane_ng::calls::call_key(c.id), 0);
    let uid = c.relay.mgr.read(|m, _| m.relays[&id].a.uid);
    assert_eq!(stats.streams[&uid].drop_stranger, 1, "{:?}", stats.streams[&uid]);
}

#[test]
fn hold_passes_the_zero_address_and_sends_nothing_to_the_holder() {
    let mut c = Call::start("hold@latching.test", 6200, (43200, 43299));
    let a = media_socket(&format!("{CALLER_IP}:6200"));
    c.caller_sends(&a);
    c.callee_sends();
    std::thread::sleep(SETTLE);
    seqs(&a);
    seqs(&c.callee);

    let held = sdp(CALLER_IP, 6200).replace(&format!("c=IN IP4 {CALLER_IP}"), "c=IN IP4 0.0.0.0").replace("a=sendrecv", "a=sendonly");
    let r = c.reoffer(&held, &[]);
    let to_callee = text(&r, "sdp");
    assert!(to_callee.contains("c=IN IP4 0.0.0.0\r\n"), "the zero address is passed through: {to_callee}");
    assert!(to_callee.contains(&format!("m=audio {} ", c.to_b.port())), "the relay port stays: {to_callee}");
    c.answer();
    // Music on hold reaches the callee; nothing reaches the holder.
    let moh = c.caller_sends(&a);
    c.callee_sends();
    std::thread::sleep(SETTLE);
    assert_eq!(seqs(&c.callee), vec![moh as i32]);
    assert!(seqs(&a).is_empty(), "nothing is sent to a party on hold");

    // Unhold: both ways again, to the address learnt before.
    c.reoffer(&sdp(CALLER_IP, 6200), &[]);
    c.answer();
    let x = c.caller_sends(&a);
    let y = c.callee_sends();
    std::thread::sleep(SETTLE);
    assert_eq!((seqs(&c.callee), seqs(&a)), (vec![x as i32], vec![y as i32]));
}
