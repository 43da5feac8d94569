//! NG framing (`<cookie> <bencoded dictionary>`), request option access with rtpengine's
//! spelling variants, and the reply cache that answers a retransmitted request (same cookie from
//! the same client) with the very same reply instead of executing it twice.

use crate::bencode::{self, Value};
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// Longest cookie accepted.
pub const MAX_COOKIE: usize = 128;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Nothing to answer to: no cookie could be read.
    #[error("no cookie")]
    NoCookie,
    #[error("malformed bencode: {0}")]
    Bencode(#[from] bencode::DecodeError),
    #[error("the message is not a bencoded dictionary")]
    NotADict,
}

/// A cookie and a request dictionary, or the error with the cookie when it could be read.
pub type Frame<'a> = Result<(&'a [u8], Value), (Option<&'a [u8]>, FrameError)>;

/// Split a datagram into its cookie and its dictionary. `Err((Some(cookie), e))` means the
/// cookie was readable, so the client can be told what was wrong.
pub fn parse_frame(datagram: &[u8]) -> Frame<'_> {
    let Some(sp) = datagram.iter().position(|&b| b == b' ') else {
        return Err((None, FrameError::NoCookie));
    };
    let cookie = &datagram[..sp];
    if cookie.is_empty() || cookie.len() > MAX_COOKIE || !cookie.iter().all(|b| b.is_ascii_graphic()) {
        return Err((None, FrameError::NoCookie));
    }
    let body = &datagram[sp + 1..];
    if body.first() == Some(&b'{') {
        return Err((Some(cookie), FrameError::NotADict));
    }
    match bencode::decode(body) {
        Ok(v @ Value::Dict(_)) => Ok((cookie, v)),
        Ok(_) => Err((Some(cookie), FrameError::NotADict)),
        Err(e) => Err((Some(cookie), FrameError::Bencode(e))),
    }
}

pub fn frame(cookie: &[u8], reply: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(cookie.len() + 64);
    out.extend_from_slice(cookie);
    out.push(b' ');
    reply.encode_into(&mut out);
    out
}

pub fn error_reply(reason: impl Into<String>) -> Value {
    Value::dict([("result", Value::str("error")), ("error-reason", Value::from(reason.into()))])
}

/// Normalise an option or flag name: rtpengine accepts spaces, dashes and underscores alike
/// and ignores case.
pub fn normalize(name: &str) -> String {
    name.chars().map(|c| if c == ' ' || c == '_' { '-' } else { c.to_ascii_lowercase() }).collect()
}

/// A request dictionary with lookups that accept rtpengine's spelling variants
/// (`received from` / `received-from`, `ICE` / `ice`, ...).
pub struct Request<'a> {
    dict: &'a Value,
    keys: HashMap<String, &'a Value>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("missing key {0:?}")]
    Missing(&'static str),
    #[error("key {0:?} must be a string")]
    NotString(&'static str),
    #[error("key {0:?} must be a list of strings")]
    NotList(&'static str),
    #[error("key {0:?}: {1}")]
    Invalid(&'static str, String),
}

impl<'a> Request<'a> {
    pub fn new(dict: &'a Value) -> Request<'a> {
        let keys = dict.as_dict().map(|d| d.iter().filter_map(|(k, v)| Some((normalize(std::str::from_utf8(k).ok()?), v))).collect()).unwrap_or_default();
        Request { dict, keys }
    }

    pub fn raw(&self) -> &'a Value {
        self.dict
    }

    /// The request's keys, in their normalized spelling ([`normalize`]), sorted.
    pub fn keys(&self) -> Vec<&str> {
        let mut keys: Vec<&str> = self.keys.keys().map(String::as_str).collect();
        keys.sort_unstable();
        keys
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.keys.get(&normalize(key)).copied()
    }

    pub fn opt_str(&self, key: &'static str) -> Result<Option<&'a str>, RequestError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or(RequestError::NotString(key)),
        }
    }

    pub fn str(&self, key: &'static str) -> Result<&'a str, RequestError> {
        self.opt_str(key)?.ok_or(RequestError::Missing(key))
    }

    /// A non-empty string (call-id, tags).
    pub fn nonempty(&self, key: &'static str) -> Result<&'a str, RequestError> {
        match self.str(key)? {
            "" => Err(RequestError::Invalid(key, "must not be empty".into())),
            s => Ok(s),
        }
    }

    pub fn opt_nonempty(&self, key: &'static str) -> Result<Option<&'a str>, RequestError> {
        Ok(self.opt_str(key)?.filter(|s| !s.is_empty()))
    }

    /// A list of strings, normalised; a single string is taken as a one-element list.
    pub fn list(&self, key: &'static str) -> Result<Vec<String>, RequestError> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Bytes(_)) => Ok(vec![normalize(self.str(key)?)]),
            Some(Value::List(l)) => l.iter().map(|v| v.as_str().map(normalize).ok_or(RequestError::NotList(key))).collect(),
            Some(_) => Err(RequestError::NotList(key)),
        }
    }

    /// A list of names as given (interface names are not normalised: they match the
    /// configuration exactly); a single string is taken as a one-element list.
    pub fn names(&self, key: &'static str) -> Result<Vec<String>, RequestError> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Bytes(_)) => Ok(vec![self.str(key)?.to_string()]),
            Some(Value::List(l)) => l.iter().map(|v| v.as_str().map(str::to_string).ok_or(RequestError::NotList(key))).collect(),
            Some(_) => Err(RequestError::NotList(key)),
        }
    }

    /// `address-family`: `IP4` (true) or `IP6` (false).
    pub fn address_family(&self) -> Result<Option<bool>, RequestError> {
        match self.opt_nonempty("address-family")? {
            None => Ok(None),
            Some(f) if f.eq_ignore_ascii_case("IP4") => Ok(Some(true)),
            Some(f) if f.eq_ignore_ascii_case("IP6") => Ok(Some(false)),
            Some(f) => Err(RequestError::Invalid("address-family", format!("{f:?} is neither IP4 nor IP6"))),
        }
    }

    pub fn sdp(&self) -> Result<&'a [u8], RequestError> {
        self.get("sdp").ok_or(RequestError::Missing("sdp"))?.as_bytes().ok_or(RequestError::NotString("sdp"))
    }

    /// `received-from`: `["IP4", "10.0.0.1"]`.
    pub fn received_from(&self) -> Result<Option<IpAddr>, RequestError> {
        let Some(v) = self.get("received-from") else { return Ok(None) };
        let l = v.as_list().ok_or(RequestError::NotList("received-from"))?;
        let ip = l.get(1).and_then(Value::as_str).ok_or(RequestError::Invalid("received-from", "expected [family, address]".into()))?;
        ip.parse().map(Some).map_err(|_| RequestError::Invalid("received-from", format!("{ip:?} is not an IP address")))
    }

    pub fn media_address(&self) -> Result<Option<IpAddr>, RequestError> {
        match self.opt_nonempty("media-address")? {
            None => Ok(None),
            Some(s) => s.parse().map(Some).map_err(|_| RequestError::Invalid("media-address", format!("{s:?} is not an IP address"))),
        }
    }

    pub fn int(&self, key: &'static str) -> Result<Option<i64>, RequestError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Int(i)) => Ok(Some(*i)),
            Some(v) => match v.as_str().and_then(|s| s.parse().ok()) {
                Some(i) => Ok(Some(i)),
                None => Err(RequestError::Invalid(key, "must be an integer".into())),
            },
        }
    }
}

/// Replies by (client, cookie), kept for `ttl`, at most `capacity` of them (oldest evicted).
pub struct ReplyCache {
    ttl: Duration,
    capacity: usize,
    map: HashMap<(SocketAddr, Vec<u8>), Vec<u8>>,
    order: VecDeque<(Instant, SocketAddr, Vec<u8>)>,
}

impl ReplyCache {
    pub fn new(ttl: Duration, capacity: usize) -> ReplyCache {
        ReplyCache { ttl, capacity: capacity.max(1), map: HashMap::new(), order: VecDeque::new() }
    }

    pub fn get(&mut self, now: Instant, client: SocketAddr, cookie: &[u8]) -> Option<&[u8]> {
        self.expire(now);
        self.map.get(&(client, cookie.to_vec())).map(Vec::as_slice)
    }

    pub fn insert(&mut self, now: Instant, client: SocketAddr, cookie: &[u8], reply: Vec<u8>) {
        self.expire(now);
        while self.map.len() >= self.capacity {
            let Some((_, c, k)) = self.order.pop_front() else { break };
            self.map.remove(&(c, k));
        }
        if self.map.insert((client, cookie.to_vec()), reply).is_none() {
            self.order.push_back((now, client, cookie.to_vec()));
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn expire(&mut self, now: Instant) {
        while let Some((t, _, _)) = self.order.front() {
            if now.duration_since(*t) < self.ttl {
                break;
            }
            let (_, c, k) = self.order.pop_front().unwrap();
            self.map.remove(&(c, k));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_ping_frame() {
        let (cookie, v) = parse_frame(b"5323_1 d7:command4:pinge").unwrap();
        assert_eq!(cookie, b"5323_1");
        assert_eq!(Request::new(&v).str("command").unwrap(), "ping");
        assert_eq!(frame(b"5323_1", &Value::dict([("result", "pong".into())])), b"5323_1 d6:result4:ponge");
    }

    #[test]
    fn frame_errors() {
        assert_eq!(parse_frame(b"nocookie").unwrap_err().1, FrameError::NoCookie);
        assert_eq!(parse_frame(b" d1:ai1ee").unwrap_err().1, FrameError::NoCookie);
        let (c, e) = parse_frame(b"c1 d1:a").unwrap_err();
        assert_eq!(c, Some(&b"c1"[..]));
        assert!(matches!(e, FrameError::Bencode(_)));
        assert_eq!(parse_frame(b"c1 li1ee").unwrap_err().1, FrameError::NotADict);
        assert_eq!(parse_frame(b"c1 {\"command\":\"ping\"}").unwrap_err().1, FrameError::NotADict);
        assert_eq!(parse_frame(b"c1 ").unwrap_err().1, FrameError::Bencode(bencode::DecodeError::Eof(0)));
    }

    #[test]
    fn spelling_variants() {
        let v = Value::dict([
            ("received from", Value::List(vec!["IP4".into(), "127.0.0.1".into()])),
            ("media-address", "10.0.0.9".into()),
            ("ICE", "remove".into()),
            ("flags", Value::List(vec!["trust address".into()])),
        ]);
        let v = bencode::decode(&v.encode()).unwrap();
        let r = Request::new(&v);
        assert_eq!(r.received_from().unwrap(), Some("127.0.0.1".parse().unwrap()));
        assert_eq!(r.media_address().unwrap(), Some("10.0.0.9".parse().unwrap()));
        assert_eq!(r.opt_str("ice").unwrap(), Some("remove"));
        assert_eq!(r.list("flags").unwrap(), vec!["trust-address".to_string()]);
        assert_eq!(r.str("call-id"), Err(RequestError::Missing("call-id")));
        let v = bencode::decode(b"d7:call-idi5e5:flagsi1ee").unwrap();
        let r = Request::new(&v);
        assert_eq!(r.str("call-id"), Err(RequestError::NotString("call-id")));
        assert_eq!(r.list("flags"), Err(RequestError::NotList("flags")));
    }

    #[test]
    fn reply_cache_expires_and_is_bounded() {
        let t0 = Instant::now();
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let mut c = ReplyCache::new(Duration::from_secs(5), 2);
        c.insert(t0, a, b"1", b"r1".to_vec());
        assert_eq!(c.get(t0, a, b"1"), Some(&b"r1"[..]));
        assert_eq!(c.get(t0, b, b"1"), None, "keyed by client too");
        c.insert(t0, a, b"2", b"r2".to_vec());
        c.insert(t0, a, b"3", b"r3".to_vec());
        assert_eq!(c.len(), 2);
        assert_eq!(c.get(t0, a, b"1"), None, "oldest evicted");
        assert_eq!(c.get(t0 + Duration::from_secs(5), a, b"3"), None, "expired");
        assert!(c.is_empty());
    }
}
