//! Shorthands for NG tests, shared by the ng crate's tests and the binary's (`#[path]`-included
//! there): `mediaplane_ng::client` where a missing reply or a socket error fails the test, and
//! the media sockets the tests send RTP through.

use mediaplane_core::rtp::RtpHeader;
use mediaplane_ng::bencode::Value;
use mediaplane_ng::client::{text, NgClient};
use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

/// Where an `ok` reply's SDP tells its recipient to send RTP.
pub fn advertised(v: &Value) -> SocketAddr {
    assert_eq!(text(v, "result"), "ok", "{v:?}");
    mediaplane_ng::client::advertised(v).unwrap_or_else(|e| panic!("{e} in {v:?}"))
}

/// A media socket that stops waiting after 300 ms of quiet.
pub fn udp(addr: &str) -> UdpSocket {
    let s = UdpSocket::bind(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    s
}

/// (RTP sequence or -1, sender) of everything received until the socket stays quiet.
pub fn drain(s: &UdpSocket) -> Vec<(i32, SocketAddr)> {
    let mut buf = [0u8; 2048];
    let mut got = Vec::new();
    while let Ok((n, from)) = s.recv_from(&mut buf) {
        got.push((RtpHeader::parse(&buf[..n]).map_or(-1, |h| h.sequence as i32), from));
    }
    got
}

/// A client on an ephemeral loopback port, 3 s per try.
pub fn ng_client(server: SocketAddr) -> NgClient {
    NgClient::bind("127.0.0.1:0", server, Duration::from_secs(3), "test").expect("NG client socket")
}

pub trait TestClient {
    /// One command, whatever its result: (the request datagram, the reply).
    fn call(&mut self, pairs: Vec<(&str, Value)>) -> (Vec<u8>, Value);
    /// One command's reply, whatever its result.
    fn cmd(&mut self, pairs: Vec<(&str, Value)>) -> Value;
    /// Send raw bytes once; the reply, if one comes within the read timeout.
    fn reply_to(&mut self, datagram: &[u8]) -> Option<Vec<u8>>;
}

impl TestClient for NgClient {
    fn call(&mut self, pairs: Vec<(&str, Value)>) -> (Vec<u8>, Value) {
        self.exchange(pairs).expect("NG reply")
    }

    fn cmd(&mut self, pairs: Vec<(&str, Value)>) -> Value {
        self.call(pairs).1
    }

    fn reply_to(&mut self, datagram: &[u8]) -> Option<Vec<u8>> {
        self.raw(datagram).expect("NG client socket")
    }
}
