//! A blocking NG client, as a SIP server's rtpengine module speaks the protocol: one UDP socket,
//! a fresh cookie per request, the same datagram retransmitted when no reply comes (the server
//! answers a repeated cookie from its cache, so a retry never acts twice). Used by the relay
//! benchmark and the tests; small request builders for the common offer/answer/delete shapes.

use crate::bencode::Value;
use crate::protocol;
use crate::sdp::{ConnAddr, Sdp};
use std::fmt::Display;
use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("NG client socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("no reply after {tries} tries of {timeout:?}")]
    NoReply { tries: u32, timeout: Duration },
    /// The server answered with a result other than `ok`/`pong`.
    #[error("{result}: {reason}")]
    Refused { result: String, reason: String },
    #[error("reply without {0}")]
    Incomplete(&'static str),
}

/// How often a request is sent before giving up.
const TRIES: u32 = 3;

/// Client instances in this process: part of every cookie, so two clients never share one.
static CLIENTS: AtomicU32 = AtomicU32::new(0);

pub struct NgClient {
    sock: UdpSocket,
    server: SocketAddr,
    cookie_prefix: String,
    n: u64,
    buf: Vec<u8>,
}

impl NgClient {
    /// A client on `local` (e.g. "127.0.0.1:0") waiting `timeout` per try for each reply.
    /// `tag` starts every cookie (handy in the server's logs).
    pub fn bind(local: impl ToSocketAddrs, server: SocketAddr, timeout: Duration, tag: &str) -> std::io::Result<NgClient> {
        let sock = UdpSocket::bind(local)?;
        sock.set_read_timeout(Some(timeout))?;
        let k = CLIENTS.fetch_add(1, Ordering::Relaxed);
        let cookie_prefix = format!("{tag}-{}-{k}", std::process::id());
        Ok(NgClient { sock, server, cookie_prefix, n: 0, buf: vec![0; 65536] })
    }

    /// On an ephemeral loopback port, 2 s per try.
    pub fn new(server: SocketAddr, tag: &str) -> std::io::Result<NgClient> {
        Self::bind("127.0.0.1:0", server, Duration::from_secs(2), tag)
    }

    /// The socket (e.g. to change its read timeout).
    pub fn socket(&self) -> &UdpSocket {
        &self.sock
    }

    /// Send a datagram once; the first datagram back within the read timeout, if any.
    pub fn raw(&mut self, datagram: &[u8]) -> std::io::Result<Option<Vec<u8>>> {
        self.sock.send_to(datagram, self.server)?;
        match self.sock.recv_from(&mut self.buf) {
            Ok((n, _)) => Ok(Some(self.buf[..n].to_vec())),
            Err(e) if is_timeout(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// One request, whatever its result: (the request datagram as sent, the reply dictionary).
    /// Replies to other cookies (late answers to earlier requests) are skipped.
    pub fn exchange(&mut self, pairs: Vec<(&str, Value)>) -> Result<(Vec<u8>, Value), ClientError> {
        self.n += 1;
        let cookie = format!("{}_{}", self.cookie_prefix, self.n);
        let request = protocol::frame(cookie.as_bytes(), &Value::dict(pairs));
        for _ in 0..TRIES {
            self.sock.send_to(&request, self.server)?;
            loop {
                match self.sock.recv_from(&mut self.buf) {
                    Ok((n, _)) => match protocol::parse_frame(&self.buf[..n]) {
                        Ok((c, v)) if c == cookie.as_bytes() => return Ok((request, v)),
                        _ => continue,
                    },
                    Err(e) if is_timeout(&e) => break,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let timeout = self.sock.read_timeout()?.unwrap_or_default();
        Err(ClientError::NoReply { tries: TRIES, timeout })
    }

    /// One request whose result must be `ok` (or `pong`); any other is an error with the
    /// server's `error-reason`.
    pub fn request(&mut self, pairs: Vec<(&str, Value)>) -> Result<Value, ClientError> {
        let (_, v) = self.exchange(pairs)?;
        match text(&v, "result").as_str() {
            "ok" | "pong" => Ok(v),
            other => {
                let reason = v.get("error-reason").and_then(Value::as_str).unwrap_or("no reason").to_string();
                Err(ClientError::Refused { result: other.to_string(), reason })
            }
        }
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
}

/// A string value of a reply, "" when absent.
pub fn text(v: &Value, key: &str) -> String {
    v.get(key).and_then(Value::as_str).unwrap_or_default().to_string()
}

/// A list of strings (flags, replace, received-from).
pub fn list(items: &[&str]) -> Value {
    Value::List(items.iter().map(|s| Value::str(s)).collect())
}

/// A G.711 SDP body (`payload_type` 0 = PCMU, 8 = PCMA, plus telephone-event) of a party
/// receiving RTP on `ip:port`.
pub fn g711_sdp(ip: impl Display, port: u16, session: impl Display, payload_type: u8) -> String {
    let codec = if payload_type == 8 { "PCMA" } else { "PCMU" };
    format!(
        "v=0\r\no=- {session} {session} IN IP4 {ip}\r\ns=mediaplane\r\nc=IN IP4 {ip}\r\nt=0 0\r\nm=audio {port} RTP/AVP {payload_type} 101\r\n\
         a=rtpmap:{payload_type} {codec}/8000\r\na=rtpmap:101 telephone-event/8000\r\na=ptime:20\r\na=sendrecv\r\n"
    )
}

/// An offer (`to` = None) or answer as Kamailio's rtpengine module sends it with
/// `trust-address replace-origin replace-session-connection`.
pub fn offer_answer(command: &str, call: &str, from: &str, to: Option<&str>, sdp: &str, received_from: impl Display) -> Vec<(&'static str, Value)> {
    let mut v = vec![
        ("command", Value::str(command)),
        ("call-id", Value::str(call)),
        ("from-tag", Value::str(from)),
        ("sdp", Value::str(sdp)),
        ("flags", list(&["trust-address"])),
        ("replace", list(&["origin", "session-connection"])),
        ("received-from", list(&["IP4", &received_from.to_string()])),
    ];
    if let Some(t) = to {
        v.push(("to-tag", Value::str(t)));
    }
    v
}

pub fn delete(call: &str, from: &str, to: &str) -> Vec<(&'static str, Value)> {
    vec![("command", Value::str("delete")), ("call-id", Value::str(call)), ("from-tag", Value::str(from)), ("to-tag", Value::str(to))]
}

/// Where a reply's SDP tells its recipient to send RTP: media section 0's address and port.
pub fn advertised(v: &Value) -> Result<SocketAddr, ClientError> {
    let sdp = Sdp::parse(text(v, "sdp").as_bytes()).map_err(|_| ClientError::Incomplete("a valid SDP"))?;
    match (sdp.media_addr(0), sdp.media.first()) {
        (Some(ConnAddr::Ip(ip)), Some(m)) => Ok(SocketAddr::new(*ip, m.port)),
        _ => Err(ClientError::Incomplete("a media address")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offer_sdp_parses_and_names_its_address() {
        let body = g711_sdp("10.0.0.1", 4000, 7, 8);
        let v = Value::dict(vec![("result", Value::str("ok")), ("sdp", Value::str(&body))]);
        assert_eq!(advertised(&v).unwrap(), "10.0.0.1:4000".parse().unwrap());
        assert!(body.contains("a=rtpmap:8 PCMA/8000"));
        assert!(matches!(advertised(&Value::dict(vec![])), Err(ClientError::Incomplete(_))));
    }

    #[test]
    fn a_silent_server_is_no_reply_after_the_retries() {
        let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut c = NgClient::bind("127.0.0.1:0", silent.local_addr().unwrap(), Duration::from_millis(20), "t").unwrap();
        assert!(matches!(c.request(vec![("command", Value::str("ping"))]), Err(ClientError::NoReply { tries: 3, .. })));
        let mut buf = [0u8; 512];
        silent.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let (n, _) = silent.recv_from(&mut buf).unwrap();
        let (cookie, v) = protocol::parse_frame(&buf[..n]).unwrap();
        assert!(cookie.starts_with(b"t-"));
        assert_eq!(text(&v, "command"), "ping");
    }
}
