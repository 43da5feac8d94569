//! ICE-lite (RFC 8445 §2.5), one agent per leg: the relay has one host candidate per leg (its
//! relay address), never sends checks, answers the peer's, and takes the address of the check
//! that nominates it (USE-CANDIDATE) as the leg's peer. Consent (RFC 7675): a peer whose
//! checks stop for [`CONSENT_TIMEOUT_NS`] has withdrawn it, and nothing more is sent to it.
//! Sans-I/O: packets in, replies out, time passed in.

use crate::stun::{attr, Builder, Class, Message, BINDING};
use std::net::SocketAddr;

/// RFC 7675 §5.1: consent expires 30 s after the last check answered.
pub const CONSENT_TIMEOUT_NS: u64 = 30_000_000_000;

/// ICE credentials (RFC 8445 §5.3): what `a=ice-ufrag` / `a=ice-pwd` carry.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub ufrag: String,
    pub pwd: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, pwd hidden)", self.ufrag)
    }
}

impl Credentials {
    /// Fresh random credentials: 8 ice-chars of username fragment (RFC 8839 §5.4 asks at
    /// least 4) and 24 of password (at least 22).
    pub fn generate() -> Credentials {
        Credentials { ufrag: random_ice_chars(8), pwd: random_ice_chars(24) }
    }
}

/// `ice-char` (RFC 8839 §5.4): ALPHA / DIGIT / "+" / "/".
fn random_ice_chars(n: usize) -> String {
    const CHARS: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut raw = vec![0u8; n];
    openssl::rand::rand_bytes(&mut raw).expect("OpenSSL's random generator");
    raw.iter().map(|b| CHARS[(*b as usize) % CHARS.len()] as char).collect()
}

/// What a datagram that looked like STUN did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckOutcome {
    /// A valid check: send `reply` back to its source. `nominated`: the source is now the
    /// leg's selected address (it differs from the one before, or is the first).
    Answered { reply: Vec<u8>, nominated: bool },
    /// An invalid request that still gets an error response (RFC 8489 §6.3.1.1: 400 for what
    /// lacks credentials, 401 for wrong ones), and counts for nothing.
    Refused { reply: Vec<u8>, reason: &'static str },
    /// Not a request for us (a response, an indication, garbage): dropped, no reply.
    Ignored { reason: &'static str },
}

/// The lite agent of one leg.
#[derive(Debug, Clone)]
pub struct LiteAgent {
    pub local: Credentials,
    /// The peer's, from its SDP; while unknown (an answer not yet seen) the remote part of a
    /// check's USERNAME is taken as it comes.
    pub remote: Option<Credentials>,
    selected: Option<SocketAddr>,
    /// The source of the last valid check: its pair is valid, so DTLS may start on it before
    /// the nomination (browsers do).
    checked: Option<SocketAddr>,
    last_valid_ns: Option<u64>,
    pub checks_answered: u64,
    pub checks_refused: u64,
}

impl LiteAgent {
    pub fn new(local: Credentials, remote: Option<Credentials>) -> LiteAgent {
        LiteAgent { local, remote, selected: None, checked: None, last_valid_ns: None, checks_answered: 0, checks_refused: 0 }
    }

    /// The address the peer nominated, while its consent lasts.
    pub fn selected(&self) -> Option<SocketAddr> {
        self.selected
    }

    /// Whether the peer may speak DTLS from `source`: the nominated address, or, before any
    /// nomination, the source of a valid check.
    pub fn valid_source(&self, source: SocketAddr) -> bool {
        match self.selected {
            Some(s) => s == source,
            None => self.checked == Some(source),
        }
    }

    /// New credentials from a re-offer (an ICE restart, RFC 8445 §9): the peer checks again
    /// and nominates anew.
    pub fn restart(&mut self, local: Credentials, remote: Option<Credentials>) {
        *self = LiteAgent::new(local, remote);
    }

    /// Take `selected` as nominated at `now_ns` (a restarted relay's stored leg): its consent
    /// checks are answered and timed from here, as if it had just nominated.
    pub fn resume(&mut self, selected: SocketAddr, now_ns: u64) {
        self.selected = Some(selected);
        self.checked = Some(selected);
        self.last_valid_ns = Some(now_ns);
    }

    /// Handle a datagram from `source` that demultiplexed as STUN.
    pub fn on_stun(&mut self, packet: &[u8], source: SocketAddr, now_ns: u64) -> CheckOutcome {
        let Ok(msg) = Message::parse(packet) else {
            return CheckOutcome::Ignored { reason: "malformed STUN" };
        };
        if msg.class != Class::Request || msg.method != BINDING {
            return CheckOutcome::Ignored { reason: "not a binding request" };
        }
        if let Some(Err(_)) = msg.check_fingerprint() {
            // RFC 8489 §8: a FINGERPRINT that does not match means the datagram is not STUN.
            return CheckOutcome::Ignored { reason: "FINGERPRINT does not match" };
        }
        let refuse = |agent: &mut LiteAgent, code: u16, reason: &'static str, text: &str| {
            agent.checks_refused += 1;
            CheckOutcome::Refused { reply: Builder::new(BINDING, Class::Error, msg.transaction).error_code(code, text).fingerprint(), reason }
        };
        let (Some(user), true) = (msg.username(), msg.has(attr::MESSAGE_INTEGRITY)) else {
            return refuse(self, 400, "no USERNAME or MESSAGE-INTEGRITY", "Bad Request");
        };
        // USERNAME is "our ufrag:their ufrag" (RFC 8445 §7.2.2).
        let (ours, theirs) = user.split_once(':').unwrap_or((user, ""));
        if ours != self.local.ufrag || self.remote.as_ref().is_some_and(|r| r.ufrag != theirs) {
            return refuse(self, 401, "unknown USERNAME", "Unauthorized");
        }
        if msg.check_integrity(self.local.pwd.as_bytes()).is_err() {
            return refuse(self, 401, "MESSAGE-INTEGRITY does not match", "Unauthorized");
        }
        self.checks_answered += 1;
        self.last_valid_ns = Some(now_ns);
        self.checked = Some(source);
        // A lite agent is controlled: the controlling peer's USE-CANDIDATE nominates the pair
        // (RFC 8445 §7.3.1.5), the latest nomination wins (a peer moving to another path).
        let nominated = msg.has(attr::USE_CANDIDATE) && self.selected != Some(source);
        if msg.has(attr::USE_CANDIDATE) {
            self.selected = Some(source);
        }
        let reply = Builder::new(BINDING, Class::Success, msg.transaction).xor_mapped_address(source).integrity(self.local.pwd.as_bytes()).fingerprint();
        CheckOutcome::Answered { reply, nominated }
    }

    /// Whether the peer's consent has expired at `now_ns`: it nominated an address, then sent
    /// no valid check for [`CONSENT_TIMEOUT_NS`]. The selected address is forgotten then.
    pub fn consent_expired(&mut self, now_ns: u64) -> bool {
        match (self.selected, self.last_valid_ns) {
            (Some(_), Some(last)) if now_ns.saturating_sub(last) >= CONSENT_TIMEOUT_NS => {
                self.selected = None;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(u: &str, p: &str) -> Credentials {
        Credentials { ufrag: u.into(), pwd: p.into() }
    }

    fn check(user: &str, pwd: &str, nominate: bool, tx: u8) -> Vec<u8> {
        let mut b = Builder::new(BINDING, Class::Request, [tx; 12])
            .attribute(attr::USERNAME, user.as_bytes())
            .attribute(attr::PRIORITY, &0x6e0001ffu32.to_be_bytes())
            .attribute(attr::ICE_CONTROLLING, &[1; 8]);
        if nominate {
            b = b.attribute(attr::USE_CANDIDATE, &[]);
        }
        b.integrity(pwd.as_bytes()).fingerprint()
    }

    #[test]
    fn a_valid_check_is_answered_and_use_candidate_selects_its_source() {
        let mut a = LiteAgent::new(creds("srvr", "serverpasswordserverpass"), Some(creds("brws", "browserpassword-browser")));
        let from: SocketAddr = "192.0.2.7:40000".parse().unwrap();
        let CheckOutcome::Answered { reply, nominated } = a.on_stun(&check("srvr:brws", "serverpasswordserverpass", false, 1), from, 0) else {
            panic!("not answered")
        };
        assert!(!nominated);
        assert_eq!(a.selected(), None, "a check without USE-CANDIDATE selects nothing");
        assert!(a.valid_source(from), "but DTLS may start on its pair");
        assert!(!a.valid_source("192.0.2.7:40001".parse().unwrap()));
        let r = Message::parse(&reply).unwrap();
        assert_eq!((r.class, r.transaction), (Class::Success, [1; 12]));
        assert_eq!(r.xor_mapped_address(), Some(from));
        assert_eq!(r.check_integrity(b"serverpasswordserverpass"), Ok(()), "signed with our password");
        assert_eq!(r.check_fingerprint(), Some(Ok(())));
        let CheckOutcome::Answered { nominated, .. } = a.on_stun(&check("srvr:brws", "serverpasswordserverpass", true, 2), from, 1) else { panic!() };
        assert!(nominated);
        assert_eq!(a.selected(), Some(from));
        let CheckOutcome::Answered { nominated, .. } = a.on_stun(&check("srvr:brws", "serverpasswordserverpass", true, 3), from, 2) else { panic!() };
        assert!(!nominated, "the same address nominated again is no change");
        let moved: SocketAddr = "192.0.2.7:40002".parse().unwrap();
        let CheckOutcome::Answered { nominated, .. } = a.on_stun(&check("srvr:brws", "serverpasswordserverpass", true, 4), moved, 3) else { panic!() };
        assert!(nominated);
        assert_eq!(a.selected(), Some(moved));
        assert_eq!(a.checks_answered, 4);
    }

    #[test]
    fn checks_without_the_right_credentials_are_refused_and_select_nothing() {
        let mut a = LiteAgent::new(creds("srvr", "serverpasswordserverpass"), Some(creds("brws", "x")));
        let from: SocketAddr = "192.0.2.7:40000".parse().unwrap();
        for (packet, code, why) in [
            (check("srvr:brws", "wrong-password-wrong-pass", true, 1), 401, "MESSAGE-INTEGRITY does not match"),
            (check("other:brws", "serverpasswordserverpass", true, 2), 401, "unknown USERNAME"),
            (check("srvr:evil", "serverpasswordserverpass", true, 3), 401, "unknown USERNAME"),
            (Builder::new(BINDING, Class::Request, [4; 12]).attribute(attr::USE_CANDIDATE, &[]).fingerprint(), 400, "no USERNAME or MESSAGE-INTEGRITY"),
        ] {
            match a.on_stun(&packet, from, 0) {
                CheckOutcome::Refused { reply, reason } => {
                    assert_eq!(reason, why);
                    let r = Message::parse(&reply).unwrap();
                    assert_eq!(r.class, Class::Error);
                    let e = r.get(attr::ERROR_CODE).unwrap();
                    assert_eq!(e[2] as u16 * 100 + e[3] as u16, code);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(a.selected(), None);
        assert_eq!(a.checks_refused, 4);
        let mut bad_crc = check("srvr:brws", "serverpasswordserverpass", true, 5);
        let n = bad_crc.len();
        bad_crc[n - 1] ^= 1;
        assert_eq!(a.on_stun(&bad_crc, from, 0), CheckOutcome::Ignored { reason: "FINGERPRINT does not match" });
        let response = Builder::new(BINDING, Class::Success, [6; 12]).fingerprint();
        assert_eq!(a.on_stun(&response, from, 0), CheckOutcome::Ignored { reason: "not a binding request" });
        assert_eq!(a.on_stun(&[0, 1, 0, 0], from, 0), CheckOutcome::Ignored { reason: "malformed STUN" });
    }

    #[test]
    fn remote_ufrag_unknown_until_the_answer_is_taken_as_it_comes() {
        let mut a = LiteAgent::new(creds("srvr", "serverpasswordserverpass"), None);
        let from: SocketAddr = "[2001:db8::9]:4000".parse().unwrap();
        assert!(matches!(a.on_stun(&check("srvr:anything", "serverpasswordserverpass", true, 1), from, 0), CheckOutcome::Answered { nominated: true, .. }));
    }

    #[test]
    fn consent_expires_thirty_seconds_after_the_last_valid_check() {
        let mut a = LiteAgent::new(creds("srvr", "serverpasswordserverpass"), None);
        let from: SocketAddr = "192.0.2.7:40000".parse().unwrap();
        assert!(!a.consent_expired(u64::MAX), "nothing selected, nothing to expire");
        a.on_stun(&check("srvr:b", "serverpasswordserverpass", true, 1), from, 1_000);
        a.on_stun(&check("srvr:b", "serverpasswordserverpass", false, 2), from, 5_000_000_000);
        // Refused checks do not refresh consent.
        a.on_stun(&check("srvr:b", "nope-nope-nope-nope-nope", false, 3), from, 20_000_000_000);
        assert!(!a.consent_expired(34_999_999_999));
        assert_eq!(a.selected(), Some(from));
        assert!(a.consent_expired(35_000_000_000));
        assert_eq!(a.selected(), None);
        assert!(!a.consent_expired(36_000_000_000), "reported once");
    }

    #[test]
    fn generated_credentials_are_ice_chars_of_the_right_length() {
        let c = Credentials::generate();
        assert_eq!((c.ufrag.len(), c.pwd.len()), (8, 24));
        assert!(c.ufrag.chars().chain(c.pwd.chars()).all(|ch| ch.is_ascii_alphanumeric() || ch == '+' || ch == '/'));
        assert_ne!(Credentials::generate(), c);
        assert!(!format!("{c:?}").contains(&c.pwd));
    }
}
