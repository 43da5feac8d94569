//! Shared by the NG tests of the binary: a small NG (bencode over UDP) client, SDP helpers, and
//! the relay views of the HTTP API.

// Each test binary uses a different part of this module.
#![allow(dead_code, unused_imports)]

use mediaplane_ng::bencode::Value;
use std::net::{SocketAddr, UdpSocket};

#[path = "../../../ng/tests/common/ng_test.rs"]
mod ng_test;
pub use mediaplane_ng::client::{delete, list, offer_answer, text, NgClient};
pub use ng_test::*;

/// A G.711 A-law SDP body of a party receiving RTP on `ip:port`.
pub fn sdp(ip: &str, port: u16, sess: u32) -> String {
    mediaplane_ng::client::g711_sdp(ip, port, sess, 8)
}

/// The RTP relay id of media section 0 of a call.
pub fn rtp_relay(call: &str) -> String {
    mediaplane_ng::calls::rtp_relay_id(&mediaplane_ng::calls::call_key(call), 0)
}

/// A free UDP port on loopback (bound, then released).
pub fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One NG command to the relay of a namespace testbed (at `bench_relay::NG` in its SFU
/// namespace); its reply, whatever its result.
pub fn ng_in(tb: &mediaplane_bench::netns::Testbed, pairs: Vec<(&'static str, Value)>) -> Value {
    tb.in_ns(&tb.sfu_ns, move || ng_client(mediaplane_harness::bench_relay::NG.parse().unwrap()).cmd(pairs)).unwrap()
}

/// A reply's result, with its `error-reason` in parentheses if it has one ("ok", "error (…)").
pub fn outcome(r: &Value) -> String {
    match r.get("error-reason").and_then(Value::as_str) {
        Some(e) => format!("{} ({e})", text(r, "result")),
        None => text(r, "result"),
    }
}

/// A nonblocking UDP socket of a testbed peer's namespace.
pub fn peer_socket(tb: &mediaplane_bench::netns::Testbed, peer: usize, port: u16) -> UdpSocket {
    let p = &tb.peers[peer];
    let s = tb.udp_socket(&p.ns, SocketAddr::new(p.ip, port)).unwrap();
    s.set_nonblocking(true).unwrap();
    s
}

/// A call set up over NG between a testbed's first two peers (caller on :6000, callee on
/// :7000, A-law and telephone-event): their RTP sockets and where each sends.
pub struct TestCall {
    pub caller: UdpSocket,
    pub callee: UdpSocket,
    /// Where the caller sends (the answer's address), and the callee (the offer's).
    pub to_caller: SocketAddr,
    pub to_callee: SocketAddr,
}

pub fn set_up_call(tb: &mediaplane_bench::netns::Testbed, call: &str, caller_tag: &str, callee_tag: &str) -> TestCall {
    set_up_call_with(tb, call, caller_tag, callee_tag, &[])
}

/// [`set_up_call`] with more flags on the offer and the answer.
pub fn set_up_call_with(tb: &mediaplane_bench::netns::Testbed, call: &str, caller_tag: &str, callee_tag: &str, flags: &[&str]) -> TestCall {
    let (cip, eip) = (tb.peers[0].ip.to_string(), tb.peers[1].ip.to_string());
    let with_flags = |mut req: Vec<(&'static str, Value)>| {
        for (k, v) in req.iter_mut() {
            if let (&mut "flags", Value::List(l)) = (k, v) {
                l.extend(flags.iter().map(|f| Value::str(f)));
            }
        }
        req
    };
    let offer = ng_in(tb, with_flags(offer_answer("offer", call, caller_tag, None, &sdp(&cip, 6000, 1), &cip)));
    let answer = ng_in(tb, with_flags(offer_answer("answer", call, caller_tag, Some(callee_tag), &sdp(&eip, 7000, 2), &eip)));
    TestCall { caller: peer_socket(tb, 0, 6000), callee: peer_socket(tb, 1, 7000), to_caller: advertised(&answer), to_callee: advertised(&offer) }
}
