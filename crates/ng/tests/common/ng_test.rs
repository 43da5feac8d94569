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

/// rtpengine 10.5's reply key paths, captured from the real daemon (see tests/data/README.md).
const RTPENGINE_KEY_PATHS: &str = include_str!("../data/rtpengine-10.5-key-paths.json");

/// Every key path of a reply, with its type ("int", "str", "list", "dict"): dictionary keys
/// under `tags` and `SSRC` become `<tag>` and `<ssrc>`, list items `[]` (as in the reference).
pub fn key_paths(v: &Value) -> std::collections::BTreeMap<String, &'static str> {
    fn walk(v: &Value, path: &str, parent: &str, out: &mut std::collections::BTreeMap<String, &'static str>) {
        let kind = match v {
            Value::Int(_) => "int",
            Value::Bytes(_) => "str",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
        };
        if !path.is_empty() {
            out.insert(path.to_string(), kind);
        }
        let join = |k: &str| if path.is_empty() { k.to_string() } else { format!("{path}.{k}") };
        match v {
            Value::Dict(d) => {
                for (k, x) in d {
                    let k = String::from_utf8_lossy(k);
                    let name = match parent {
                        "tags" => "<tag>".to_string(),
                        "SSRC" => "<ssrc>".to_string(),
                        _ => k.to_string(),
                    };
                    walk(x, &join(&name), &k, out);
                }
            }
            Value::List(l) => l.iter().for_each(|x| walk(x, &format!("{path}[]"), "", out)),
            _ => {}
        }
    }
    let mut out = std::collections::BTreeMap::new();
    walk(v, "", "", &mut out);
    out
}

/// rtpengine 10.5's key paths of `command`'s reply.
pub fn rtpengine_key_paths(command: &str) -> std::collections::BTreeMap<String, String> {
    let all: serde_json::Value = serde_json::from_str(RTPENGINE_KEY_PATHS).expect("the reference is JSON");
    let paths = all[command].as_object().unwrap_or_else(|| panic!("no reference for {command}"));
    paths.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string())).collect()
}

/// The paths of `reference` that `reply` lacks or carries with another type, except those
/// under a prefix in `except`.
pub fn missing_key_paths(reference: &std::collections::BTreeMap<String, String>, reply: &Value, except: &[&str]) -> Vec<String> {
    let have = key_paths(reply);
    reference
        .iter()
        .filter(|(path, _)| !except.iter().any(|e| path.as_str() == *e || path.starts_with(&format!("{e}.")) || path.starts_with(&format!("{e}["))))
        .filter_map(|(path, kind)| match have.get(path) {
            Some(k) if k == kind => None,
            Some(k) => Some(format!("{path} ({k}, rtpengine: {kind})")),
            None => Some(format!("{path} (missing, rtpengine: {kind})")),
        })
        .collect()
}
