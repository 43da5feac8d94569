//! Shared by the NG tests of the binary: a small NG (bencode over UDP) client, SDP helpers, and
//! the relay views of the HTTP API.

#![allow(dead_code)]

use mediaplane_ng::bencode::Value;
use mediaplane_ng::protocol;
use mediaplane_ng::sdp::{ConnAddr, Sdp};
use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

/// An NG client: one UDP socket, a fresh cookie per request.
pub struct NgClient {
    pub sock: UdpSocket,
    pub server: SocketAddr,
}

/// Cookies unique within the test process, whatever client sends them.
static COOKIE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl NgClient {
    pub fn new(bind: &str, server: SocketAddr) -> NgClient {
        let sock = UdpSocket::bind(bind).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        NgClient { sock, server }
    }

    /// Send raw bytes; the raw reply, if one arrives within the read timeout.
    pub fn raw(&self, datagram: &[u8]) -> Option<Vec<u8>> {
        self.sock.send_to(datagram, self.server).unwrap();
        let mut buf = vec![0u8; 65536];
        match self.sock.recv_from(&mut buf) {
            Ok((n, _)) => Some(buf[..n].to_vec()),
            Err(_) => None,
        }
    }

    /// One command; the reply dictionary (its cookie checked).
    pub fn cmd(&mut self, pairs: Vec<(&str, Value)>) -> Value {
        let n = COOKIE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let cookie = format!("t{}_{n}", std::process::id());
        let d = protocol::frame(cookie.as_bytes(), &Value::dict(pairs));
        let r = self.raw(&d).expect("NG reply");
        let (c, v) = protocol::parse_frame(&r).unwrap();
        assert_eq!(c, cookie.as_bytes());
        v
    }
}

pub fn text(v: &Value, k: &str) -> String {
    v.get(k).and_then(Value::as_str).unwrap_or_default().to_string()
}

pub fn list(items: &[&str]) -> Value {
    Value::List(items.iter().map(|s| Value::str(s)).collect())
}

/// A G.711 A-law SDP body of a party receiving RTP on `ip:port`.
pub fn sdp(ip: &str, port: u16, sess: u32) -> String {
    format!(
        "v=0\r\no=- {sess} {sess} IN IP4 {ip}\r\ns=mediaplane test\r\nc=IN IP4 {ip}\r\nt=0 0\r\nm=audio {port} RTP/AVP 8 101\r\na=rtpmap:8 PCMA/8000\r\na=rtpmap:101 telephone-event/8000\r\na=ptime:20\r\na=sendrecv\r\n"
    )
}

/// An offer (`to` = None) or answer request as Kamailio's rtpengine module sends it.
pub fn offer_answer(cmd: &str, call: &str, from: &str, to: Option<&str>, body: &str, received_from: &str) -> Vec<(&'static str, Value)> {
    let mut v = vec![
        ("command", Value::str(cmd)),
        ("call-id", Value::str(call)),
        ("from-tag", Value::str(from)),
        ("sdp", Value::str(body)),
        ("flags", list(&["trust-address"])),
        ("replace", list(&["origin", "session-connection"])),
        ("received-from", list(&["IP4", received_from])),
    ];
    if let Some(t) = to {
        v.push(("to-tag", Value::str(t)));
    }
    v
}

pub fn delete(call: &str, from: &str, to: &str) -> Vec<(&'static str, Value)> {
    vec![("command", "delete".into()), ("call-id", Value::str(call)), ("from-tag", Value::str(from)), ("to-tag", Value::str(to))]
}

/// The address an SDP reply tells its recipient to send RTP to.
pub fn advertised(v: &Value) -> SocketAddr {
    assert_eq!(text(v, "result"), "ok", "{v:?}");
    let s = Sdp::parse(text(v, "sdp").as_bytes()).unwrap();
    let Some(ConnAddr::Ip(ip)) = s.media_addr(0) else { panic!("no address in {v:?}") };
    SocketAddr::new(*ip, s.media[0].port)
}

/// The RTP relay id of media section 0 of a call.
pub fn rtp_relay(call: &str) -> String {
    mediaplane_ng::calls::rtp_relay_id(&mediaplane_ng::calls::call_key(call), 0)
}

/// A free UDP port on loopback (bound, then released).
pub fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
