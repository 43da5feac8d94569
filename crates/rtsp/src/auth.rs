//! Client authentication to an upstream (RFC 2326 leaves it to HTTP's: RFC 7617 Basic, RFC
//! 2617/7616 Digest with MD5, which is what cameras ask for). Sans-I/O: a challenge from a
//! `WWW-Authenticate` header, and the `Authorization` value for one request.

use base64::Engine as _;
use md5::{Digest as _, Md5};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    Basic,
    Digest { realm: String, nonce: String, opaque: Option<String>, qop_auth: bool },
}

impl Challenge {
    /// The challenge to answer among a response's `WWW-Authenticate` values: Digest (MD5) when
    /// offered, Basic otherwise. Digest with another algorithm (SHA-256) is not answered.
    pub fn choose<'a>(values: impl Iterator<Item = &'a str>) -> Option<Challenge> {
        let mut basic = false;
        for v in values {
            let (scheme, params) = v.trim().split_once(' ').unwrap_or((v.trim(), ""));
            if scheme.eq_ignore_ascii_case("Basic") {
                basic = true;
            } else if scheme.eq_ignore_ascii_case("Digest") {
                let p = params_of(params);
                let get = |k: &str| p.iter().find(|(n, _)| n.eq_ignore_ascii_case(k)).map(|(_, v)| v.clone());
                let md5 = get("algorithm").is_none_or(|a| a.eq_ignore_ascii_case("MD5"));
                if let (true, Some(realm), Some(nonce)) = (md5, get("realm"), get("nonce")) {
                    let qop_auth = get("qop").is_some_and(|q| q.split(',').any(|x| x.trim().eq_ignore_ascii_case("auth")));
                    return Some(Challenge::Digest { realm, nonce, opaque: get("opaque"), qop_auth });
                }
            }
        }
        basic.then_some(Challenge::Basic)
    }

    /// The `Authorization` value for `method` on `uri`; `nc` counts the requests answered to
    /// this nonce (1, 2, ...) and `cnonce` is the client's own nonce (both used with qop=auth).
    pub fn authorization(&self, user: &str, password: &str, method: &str, uri: &str, nc: u32, cnonce: &str) -> String {
        match self {
            Challenge::Basic => format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))),
            Challenge::Digest { realm, nonce, opaque, qop_auth } => {
                let ha1 = md5_hex(&format!("{user}:{realm}:{password}"));
                let ha2 = md5_hex(&format!("{method}:{uri}"));
                let mut v = format!("Digest username=\"{user}\", realm=\"{realm}\", nonce=\"{nonce}\", uri=\"{uri}\"");
                if *qop_auth {
                    let response = md5_hex(&format!("{ha1}:{nonce}:{nc:08x}:{cnonce}:auth:{ha2}"));
                    v += &format!(", qop=auth, nc={nc:08x}, cnonce=\"{cnonce}\", response=\"{response}\"");
                } else {
                    v += &format!(", response=\"{}\"", md5_hex(&format!("{ha1}:{nonce}:{ha2}")));
                }
                if let Some(o) = opaque {
                    v += &format!(", opaque=\"{o}\"");
                }
                v
            }
        }
    }
}

/// The server side: who may read a path, and whether a request's `Authorization` says it is one
/// of them. Digest nonces are stateless (issue time and a keyed hash of it, valid
/// [`NONCE_LIFETIME_SECS`]), so nothing is held per client.
pub struct Verifier {
    realm: String,
    /// A per-process secret the nonces are keyed with.
    secret: String,
}

pub const NONCE_LIFETIME_SECS: u64 = 300;

impl Verifier {
    pub fn new(realm: &str, secret: &str) -> Verifier {
        Verifier { realm: realm.to_string(), secret: secret.to_string() }
    }

    /// The challenges of a 401: Digest (MD5, qop=auth) and Basic, in that order. `stale`: the
    /// client's nonce was ours but expired, so it retries with its credentials instead of
    /// taking them for wrong (RFC 7616 3.3).
    pub fn challenges(&self, now_secs: u64, stale: bool) -> [String; 2] {
        let stale = if stale { ", stale=true" } else { "" };
        [
            format!("Digest realm=\"{}\", nonce=\"{}\", algorithm=MD5, qop=\"auth\"{stale}", self.realm, self.nonce(now_secs)),
            format!("Basic realm=\"{}\"", self.realm),
        ]
    }

    /// Whether `authorization` is a Digest answer to a nonce of ours that has expired.
    pub fn is_stale(&self, authorization: Option<&str>, now_secs: u64) -> bool {
        let Some((scheme, rest)) = authorization.map(str::trim).and_then(|v| v.split_once(' ')) else { return false };
        if !scheme.eq_ignore_ascii_case("Digest") {
            return false;
        }
        let p = params_of(rest);
        let Some(nonce) = p.iter().find(|(n, _)| n.eq_ignore_ascii_case("nonce")).map(|(_, v)| v.as_str()) else { return false };
        let Some(at) = nonce.split_once('.').and_then(|(t, _)| u64::from_str_radix(t, 16).ok()) else { return false };
        constant_time_eq(nonce.as_bytes(), self.nonce(at).as_bytes()) && now_secs.saturating_sub(at) > NONCE_LIFETIME_SECS
    }

    fn nonce(&self, at_secs: u64) -> String {
        format!("{at_secs:x}.{}", &md5_hex(&format!("{}:{at_secs:x}", self.secret))[..16])
    }

    fn nonce_fresh(&self, nonce: &str, now_secs: u64) -> bool {
        let Some(at) = nonce.split_once('.').and_then(|(t, _)| u64::from_str_radix(t, 16).ok()) else { return false };
        at <= now_secs && now_secs - at <= NONCE_LIFETIME_SECS && constant_time_eq(nonce.as_bytes(), self.nonce(at).as_bytes())
    }

    /// Whether `authorization` (the header's value) proves one of `users` (`(name, password)`)
    /// for `method` now.
    pub fn verify(&self, authorization: Option<&str>, method: &str, users: &[(String, String)], now_secs: u64) -> bool {
        let Some(value) = authorization else { return false };
        let (scheme, rest) = value.trim().split_once(' ').unwrap_or((value.trim(), ""));
        if scheme.eq_ignore_ascii_case("Basic") {
            let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(rest.trim()) else { return false };
            let Ok(pair) = String::from_utf8(decoded) else { return false };
            let Some((user, password)) = pair.split_once(':') else { return false };
            return users.iter().any(|(u, p)| u == user && constant_time_eq(p.as_bytes(), password.as_bytes()));
        }
        if !scheme.eq_ignore_ascii_case("Digest") {
            return false;
        }
        let p = params_of(rest);
        let get = |k: &str| p.iter().find(|(n, _)| n.eq_ignore_ascii_case(k)).map(|(_, v)| v.as_str());
        let (Some(user), Some(realm), Some(nonce), Some(uri), Some(response)) = (get("username"), get("realm"), get("nonce"), get("uri"), get("response"))
        else {
            return false;
        };
        if realm != self.realm || !self.nonce_fresh(nonce, now_secs) {
            return false;
        }
        let Some((_, password)) = users.iter().find(|(u, _)| u == user) else { return false };
        let ha1 = md5_hex(&format!("{user}:{realm}:{password}"));
        let ha2 = md5_hex(&format!("{method}:{uri}"));
        let expected = match (get("qop"), get("nc"), get("cnonce")) {
            (Some(q), Some(nc), Some(cnonce)) if q.eq_ignore_ascii_case("auth") => md5_hex(&format!("{ha1}:{nonce}:{nc}:{cnonce}:auth:{ha2}")),
            (None, _, _) => md5_hex(&format!("{ha1}:{nonce}:{ha2}")),
            _ => return false,
        };
        constant_time_eq(expected.as_bytes(), response.to_ascii_lowercase().as_bytes())
    }
}

/// Equal, in a time that depends on the lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn md5_hex(s: &str) -> String {
    Md5::digest(s.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// `k=v, k="v, with comma"` pairs.
fn params_of(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let Some((k, after)) = rest.split_once('=') else { break };
        let after = after.trim_start();
        let (v, tail) = match after.strip_prefix('"') {
            Some(q) => match q.find('"') {
                Some(end) => (&q[..end], &q[end + 1..]),
                None => (q, ""),
            },
            None => after.split_once(',').unwrap_or((after, "")),
        };
        out.push((k.trim().to_string(), v.trim().to_string()));
        rest = tail.trim_start().trim_start_matches(',').trim_start();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_verifies_what_the_client_side_answers() {
        let v = Verifier::new("mediaplane", "k3y");
        let users = vec![("ann".to_string(), "s3cret".to_string())];
        let now = 1_000_000;
        for offered in v.challenges(now, false) {
            let c = Challenge::choose(std::iter::once(offered.as_str())).unwrap();
            let good = c.authorization("ann", "s3cret", "DESCRIBE", "rtsp://h/cam", 1, "c0ffee");
            assert!(v.verify(Some(&good), "DESCRIBE", &users, now + 10), "{offered}: {good}");
            let wrong = c.authorization("ann", "guess", "DESCRIBE", "rtsp://h/cam", 1, "c0ffee");
            assert!(!v.verify(Some(&wrong), "DESCRIBE", &users, now + 10), "{offered}");
            let stranger = c.authorization("bob", "s3cret", "DESCRIBE", "rtsp://h/cam", 1, "c0ffee");
            assert!(!v.verify(Some(&stranger), "DESCRIBE", &users, now + 10), "{offered}");
            if offered.starts_with("Digest") {
                // Another method than answered, a stale nonce, a nonce not ours.
                assert!(!v.verify(Some(&good), "TEARDOWN", &users, now + 10));
                assert!(!v.verify(Some(&good), "DESCRIBE", &users, now + NONCE_LIFETIME_SECS + 1));
                assert!(v.is_stale(Some(&good), now + NONCE_LIFETIME_SECS + 1) && !v.is_stale(Some(&good), now + 10));
                assert!(v.challenges(now, true)[0].ends_with(", stale=true"));
                let forged = good.replace(&v.nonce(now), &format!("{now:x}.0000000000000000"));
                assert!(!v.verify(Some(&forged), "DESCRIBE", &users, now + 10));
            }
        }
        assert!(!v.verify(None, "DESCRIBE", &users, now));
        assert!(!v.verify(Some("Bearer x"), "DESCRIBE", &users, now));
        assert!(!v.verify(Some("Basic !!!"), "DESCRIBE", &users, now));
    }

    #[test]
    fn rfc2617_digest_example() {
        let c = Challenge::choose(std::iter::once(
            r#"Digest realm="testrealm@host.com", qop="auth,auth-int", nonce="dcd98b7102dd2f0e8b11d0f600bfb0c093", opaque="5ccc069c403ebaf9f0171e9517f40e41""#,
        ))
        .unwrap();
        let v = c.authorization("Mufasa", "Circle Of Life", "GET", "/dir/index.html", 1, "0a4f113b");
        assert!(v.contains(r#"response="6629fae49393a05397450978507c4ef1""#), "{v}");
        assert!(v.contains("nc=00000001") && v.contains(r#"opaque="5ccc069c403ebaf9f0171e9517f40e41""#), "{v}");
    }

    #[test]
    fn digest_is_preferred_basic_is_the_fallback_sha256_is_not_answered() {
        let both = ["Basic realm=\"cam\"", "Digest realm=\"cam\", nonce=\"abc\""];
        assert!(matches!(Challenge::choose(both.into_iter()), Some(Challenge::Digest { qop_auth: false, .. })));
        assert_eq!(Challenge::choose(["Basic realm=\"cam\""].into_iter()), Some(Challenge::Basic));
        assert_eq!(Challenge::choose(["Digest realm=\"c\", nonce=\"n\", algorithm=SHA-256"].into_iter()), None);
        assert_eq!(Challenge::Basic.authorization("Aladdin", "open sesame", "", "", 0, ""), "Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ==");
        // RFC 2069 form (no qop): MD5(HA1:nonce:HA2).
        let c = Challenge::Digest { realm: "r".into(), nonce: "n".into(), opaque: None, qop_auth: false };
        let ha1 = md5_hex("u:r:p");
        let ha2 = md5_hex("DESCRIBE:rtsp://h/cam");
        assert!(c.authorization("u", "p", "DESCRIBE", "rtsp://h/cam", 1, "x").ends_with(&format!("response=\"{}\"", md5_hex(&format!("{ha1}:n:{ha2}")))));
    }
}
