//! STUN messages (RFC 8489) as ICE uses them (RFC 8445 §7): parsing with the checks a server
//! must make, short-term credential MESSAGE-INTEGRITY (HMAC-SHA1, from OpenSSL) and FINGERPRINT
//! (CRC-32), and building binding responses. No I/O.

use openssl::hash::MessageDigest;
use openssl::pkey::PKey;
use openssl::sign::Signer;
use std::net::{IpAddr, SocketAddr};

pub const MAGIC_COOKIE: u32 = 0x2112_a442;
pub const HEADER_LEN: usize = 20;
/// The method of every message ICE sends.
pub const BINDING: u16 = 0x001;
const FINGERPRINT_XOR: u32 = 0x5354_554e;
const INTEGRITY_LEN: usize = 20;

/// Attribute types used here (RFC 8489 §18.3, RFC 8445 §16.1).
pub mod attr {
    pub const USERNAME: u16 = 0x0006;
    pub const MESSAGE_INTEGRITY: u16 = 0x0008;
    pub const ERROR_CODE: u16 = 0x0009;
    pub const XOR_MAPPED_ADDRESS: u16 = 0x0020;
    pub const PRIORITY: u16 = 0x0024;
    pub const USE_CANDIDATE: u16 = 0x0025;
    pub const SOFTWARE: u16 = 0x8022;
    pub const FINGERPRINT: u16 = 0x8028;
    pub const ICE_CONTROLLED: u16 = 0x8029;
    pub const ICE_CONTROLLING: u16 = 0x802a;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Request,
    Indication,
    Success,
    Error,
}

impl Class {
    fn bits(self) -> u16 {
        match self {
            Class::Request => 0x000,
            Class::Indication => 0x010,
            Class::Success => 0x100,
            Class::Error => 0x110,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StunError {
    #[error("not a STUN message: {0}")]
    NotStun(&'static str),
    #[error("malformed attribute at byte {0}")]
    BadAttribute(usize),
    #[error("attributes after {0}")]
    AfterLast(&'static str),
    #[error("no MESSAGE-INTEGRITY")]
    NoIntegrity,
    #[error("MESSAGE-INTEGRITY does not match")]
    BadIntegrity,
    #[error("FINGERPRINT does not match")]
    BadFingerprint,
}

/// One attribute: its type, value (without padding) and where its header starts in the message.
#[derive(Debug, Clone, Copy)]
struct Attribute<'a> {
    kind: u16,
    value: &'a [u8],
    at: usize,
}

/// A parsed STUN message borrowing the datagram it came in.
#[derive(Debug, Clone)]
pub struct Message<'a> {
    pub method: u16,
    pub class: Class,
    pub transaction: [u8; 12],
    attributes: Vec<Attribute<'a>>,
    raw: &'a [u8],
}

impl<'a> Message<'a> {
    /// Parse a whole datagram. Its length must be the header's, attributes must fit, and
    /// nothing but FINGERPRINT may follow MESSAGE-INTEGRITY, nothing at all FINGERPRINT.
    pub fn parse(raw: &'a [u8]) -> Result<Message<'a>, StunError> {
        if raw.len() < HEADER_LEN {
            return Err(StunError::NotStun("shorter than a header"));
        }
        let kind = u16::from_be_bytes([raw[0], raw[1]]);
        if kind & 0xc000 != 0 {
            return Err(StunError::NotStun("top bits set"));
        }
        if u32::from_be_bytes([raw[4], raw[5], raw[6], raw[7]]) != MAGIC_COOKIE {
            return Err(StunError::NotStun("no magic cookie"));
        }
        let len = u16::from_be_bytes([raw[2], raw[3]]) as usize;
        if !len.is_multiple_of(4) || HEADER_LEN + len != raw.len() {
            return Err(StunError::NotStun("length does not match the datagram"));
        }
        let class = match kind & 0x0110 {
            0x000 => Class::Request,
            0x010 => Class::Indication,
            0x100 => Class::Success,
            _ => Class::Error,
        };
        let method = (kind & 0x000f) | ((kind & 0x00e0) >> 1) | ((kind & 0x3e00) >> 2);
        let mut transaction = [0u8; 12];
        transaction.copy_from_slice(&raw[8..20]);
        let mut attributes = Vec::new();
        let mut at = HEADER_LEN;
        let mut last: Option<u16> = None;
        while at < raw.len() {
            if at + 4 > raw.len() {
                return Err(StunError::BadAttribute(at));
            }
            match last {
                Some(attr::FINGERPRINT) => return Err(StunError::AfterLast("FINGERPRINT")),
                Some(attr::MESSAGE_INTEGRITY) if u16::from_be_bytes([raw[at], raw[at + 1]]) != attr::FINGERPRINT => {
                    return Err(StunError::AfterLast("MESSAGE-INTEGRITY"))
                }
                _ => {}
            }
            let kind = u16::from_be_bytes([raw[at], raw[at + 1]]);
            let vlen = u16::from_be_bytes([raw[at + 2], raw[at + 3]]) as usize;
            let end = at + 4 + vlen;
            if end > raw.len() {
                return Err(StunError::BadAttribute(at));
            }
            let fixed = match kind {
                attr::MESSAGE_INTEGRITY => Some(INTEGRITY_LEN),
                attr::FINGERPRINT | attr::PRIORITY => Some(4),
                attr::ICE_CONTROLLED | attr::ICE_CONTROLLING => Some(8),
                attr::USE_CANDIDATE => Some(0),
                _ => None,
            };
            if fixed.is_some_and(|n| n != vlen) {
                return Err(StunError::BadAttribute(at));
            }
            attributes.push(Attribute { kind, value: &raw[at + 4..end], at });
            last = Some(kind);
            at = end.next_multiple_of(4);
        }
        Ok(Message { method, class, transaction, attributes, raw })
    }

    /// The value of the first attribute of this type.
    pub fn get(&self, kind: u16) -> Option<&'a [u8]> {
        self.attributes.iter().find(|a| a.kind == kind).map(|a| a.value)
    }

    pub fn has(&self, kind: u16) -> bool {
        self.get(kind).is_some()
    }

    pub fn username(&self) -> Option<&'a str> {
        self.get(attr::USERNAME).and_then(|v| std::str::from_utf8(v).ok())
    }

    pub fn priority(&self) -> Option<u32> {
        self.get(attr::PRIORITY).map(|v| u32::from_be_bytes([v[0], v[1], v[2], v[3]]))
    }

    /// The address an XOR-MAPPED-ADDRESS carries.
    pub fn xor_mapped_address(&self) -> Option<SocketAddr> {
        let v = self.get(attr::XOR_MAPPED_ADDRESS)?;
        if v.len() < 8 {
            return None;
        }
        let port = u16::from_be_bytes([v[2], v[3]]) ^ (MAGIC_COOKIE >> 16) as u16;
        let mask: Vec<u8> = MAGIC_COOKIE.to_be_bytes().into_iter().chain(self.transaction).collect();
        match v[1] {
            0x01 => {
                let ip: [u8; 4] = std::array::from_fn(|i| v[4 + i] ^ mask[i]);
                Some(SocketAddr::new(IpAddr::from(ip), port))
            }
            0x02 if v.len() >= 20 => {
                let ip: [u8; 16] = std::array::from_fn(|i| v[4 + i] ^ mask[i]);
                Some(SocketAddr::new(IpAddr::from(ip), port))
            }
            _ => None,
        }
    }

    /// Check MESSAGE-INTEGRITY with a short-term credential's `key` (the password, RFC 8489
    /// §9.1.1): an HMAC-SHA1 over the message up to the attribute, with the header's length
    /// as if the message ended right after it.
    pub fn check_integrity(&self, key: &[u8]) -> Result<(), StunError> {
        let a = self.attributes.iter().find(|a| a.kind == attr::MESSAGE_INTEGRITY).ok_or(StunError::NoIntegrity)?;
        let expected = hmac_sha1(key, self.raw, a.at).map_err(|_| StunError::BadIntegrity)?;
        if openssl::memcmp::eq(&expected, a.value) {
            Ok(())
        } else {
            Err(StunError::BadIntegrity)
        }
    }

    /// Check FINGERPRINT, when there is one (None: there is none).
    pub fn check_fingerprint(&self) -> Option<Result<(), StunError>> {
        let a = self.attributes.iter().find(|a| a.kind == attr::FINGERPRINT)?;
        let want = crc32fast::hash(&self.raw[..a.at]) ^ FINGERPRINT_XOR;
        Some(if a.value == want.to_be_bytes() { Ok(()) } else { Err(StunError::BadFingerprint) })
    }
}

/// HMAC-SHA1 over `msg[..upto]` with the header's length field counting up to the end of a
/// MESSAGE-INTEGRITY attribute placed at `upto`.
fn hmac_sha1(key: &[u8], msg: &[u8], upto: usize) -> Result<Vec<u8>, openssl::error::ErrorStack> {
    let pkey = PKey::hmac(key)?;
    let mut signer = Signer::new(MessageDigest::sha1(), &pkey)?;
    let len = (upto + 4 + INTEGRITY_LEN - HEADER_LEN) as u16;
    signer.update(&msg[..2])?;
    signer.update(&len.to_be_bytes())?;
    signer.update(&msg[4..upto])?;
    signer.sign_to_vec()
}

/// Builds one message, attribute by attribute; MESSAGE-INTEGRITY and FINGERPRINT last.
pub struct Builder {
    buf: Vec<u8>,
    transaction: [u8; 12],
}

impl Builder {
    pub fn new(method: u16, class: Class, transaction: [u8; 12]) -> Builder {
        let kind = (method & 0x000f) | ((method & 0x0070) << 1) | ((method & 0x0f80) << 2) | class.bits();
        let mut buf = Vec::with_capacity(128);
        buf.extend_from_slice(&kind.to_be_bytes());
        buf.extend_from_slice(&[0, 0]);
        buf.extend_from_slice(&MAGIC_COOKIE.to_be_bytes());
        buf.extend_from_slice(&transaction);
        Builder { buf, transaction }
    }

    fn set_len(&mut self) {
        let len = (self.buf.len() - HEADER_LEN) as u16;
        self.buf[2..4].copy_from_slice(&len.to_be_bytes());
    }

    pub fn attribute(mut self, kind: u16, value: &[u8]) -> Builder {
        self.buf.extend_from_slice(&kind.to_be_bytes());
        self.buf.extend_from_slice(&(value.len() as u16).to_be_bytes());
        self.buf.extend_from_slice(value);
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
        self.set_len();
        self
    }

    pub fn xor_mapped_address(self, addr: SocketAddr) -> Builder {
        let port = addr.port() ^ (MAGIC_COOKIE >> 16) as u16;
        let mask: Vec<u8> = MAGIC_COOKIE.to_be_bytes().into_iter().chain(self.transaction).collect();
        let mut v = vec![0u8];
        match addr.ip() {
            IpAddr::V4(ip) => {
                v.push(0x01);
                v.extend_from_slice(&port.to_be_bytes());
                v.extend(ip.octets().iter().zip(&mask).map(|(a, m)| a ^ m));
            }
            IpAddr::V6(ip) => {
                v.push(0x02);
                v.extend_from_slice(&port.to_be_bytes());
                v.extend(ip.octets().iter().zip(&mask).map(|(a, m)| a ^ m));
            }
        }
        self.attribute(attr::XOR_MAPPED_ADDRESS, &v)
    }

    /// ERROR-CODE (RFC 8489 §14.8): class and number from `code`, a reason phrase.
    pub fn error_code(self, code: u16, reason: &str) -> Builder {
        let mut v = vec![0, 0, (code / 100) as u8, (code % 100) as u8];
        v.extend_from_slice(reason.as_bytes());
        self.attribute(attr::ERROR_CODE, &v)
    }

    pub fn integrity(mut self, key: &[u8]) -> Builder {
        let at = self.buf.len();
        let mac = hmac_sha1(key, &self.buf, at).expect("HMAC-SHA1 from OpenSSL");
        self = self.attribute(attr::MESSAGE_INTEGRITY, &mac);
        self
    }

    pub fn fingerprint(mut self) -> Vec<u8> {
        let at = self.buf.len();
        // The CRC covers the header with the length that includes FINGERPRINT itself.
        self.buf.extend_from_slice(&[0; 8]);
        self.set_len();
        self.buf.truncate(at);
        let crc = crc32fast::hash(&self.buf) ^ FINGERPRINT_XOR;
        self.attribute(attr::FINGERPRINT, &crc.to_be_bytes()).buf
    }

    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWORD: &[u8] = b"VOkJxbRl1RmTxUk/WvJxBt";

    /// RFC 5769 §2.1-2.3, as printed there (hex, one 32-bit word per group).
    const SAMPLE_REQUEST: &str = "00010058 2112a442 b7e7a701 bc34d686 fa87dfae 80220010 5354554e 20746573 7420636c 69656e74 \
        00240004 6e0001ff 80290008 932ff9b1 51263b36 00060009 6576746a 3a683676 59202020 00080014 9aeaa70c bfd8cb56 781ef2b5 \
        b2d3f249 c1b571a2 80280004 e57a3bcf";
    const SAMPLE_IPV4_RESPONSE: &str = "0101003c 2112a442 b7e7a701 bc34d686 fa87dfae 8022000b 74657374 20766563 746f7220 \
        00200008 0001a147 e112a643 00080014 2b91f599 fd9e90c3 8c7489f9 2af9ba53 f06be7d7 80280004 c07d4c96";
    const SAMPLE_IPV6_RESPONSE: &str = "01010048 2112a442 b7e7a701 bc34d686 fa87dfae 8022000b 74657374 20766563 746f7220 \
        00200014 0002a147 0113a9fa a5d3f179 bc25f4b5 bed2b9d9 00080014 a382954e 4be67bf1 1784c97c 8292c275 bfe3ed41 \
        80280004 c8fb0b4c";

    fn hex(s: &str) -> Vec<u8> {
        let digits: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
        digits.chunks(2).map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap()).collect()
    }

    #[test]
    fn rfc5769_sample_request_parses_and_checks() {
        let raw = hex(SAMPLE_REQUEST);
        let m = Message::parse(&raw).unwrap();
        assert_eq!((m.method, m.class), (BINDING, Class::Request));
        assert_eq!(m.username(), Some("evtj:h6vY"));
        assert_eq!(m.priority(), Some(0x6e0001ff));
        assert!(m.has(attr::ICE_CONTROLLED));
        assert_eq!(m.check_integrity(PASSWORD), Ok(()));
        assert_eq!(m.check_fingerprint(), Some(Ok(())));
        assert_eq!(m.check_integrity(b"VOkJxbRl1RmTxUk/WvJxBu"), Err(StunError::BadIntegrity));
    }

    #[test]
    fn rfc5769_sample_responses_carry_their_addresses() {
        let raw4 = hex(SAMPLE_IPV4_RESPONSE);
        let v4 = Message::parse(&raw4).unwrap();
        assert_eq!(v4.class, Class::Success);
        assert_eq!(v4.xor_mapped_address(), Some("192.0.2.1:32853".parse().unwrap()));
        assert_eq!(v4.check_integrity(PASSWORD), Ok(()));
        assert_eq!(v4.check_fingerprint(), Some(Ok(())));
        let raw6 = hex(SAMPLE_IPV6_RESPONSE);
        let v6 = Message::parse(&raw6).unwrap();
        assert_eq!(v6.xor_mapped_address(), Some("[2001:db8:1234:5678:11:2233:4455:6677]:32853".parse().unwrap()));
        assert_eq!(v6.check_integrity(PASSWORD), Ok(()));
        assert_eq!(v6.check_fingerprint(), Some(Ok(())));
    }

    #[test]
    fn the_builder_rebuilds_the_rfc5769_ipv4_response_byte_for_byte() {
        let want = hex(SAMPLE_IPV4_RESPONSE);
        // The vector pads SOFTWARE with a space where the builder pads with zeros (RFC 8489
        // §14: any value), so start from the vector's header and SOFTWARE; what the builder
        // adds (the address, both MACs) must then be the vector's, byte for byte.
        let software_end = 20 + 4 + 12;
        let mut b = Builder { buf: want[..software_end].to_vec(), transaction: want[8..20].try_into().unwrap() };
        b.set_len();
        let built = b.xor_mapped_address("192.0.2.1:32853".parse().unwrap()).integrity(PASSWORD).fingerprint();
        assert_eq!(built, want);
    }

    #[test]
    fn broken_messages_are_refused() {
        let good = hex(SAMPLE_REQUEST);
        assert!(Message::parse(&good[..19]).is_err());
        let mut long = good.clone();
        long.extend_from_slice(&[0; 4]);
        assert_eq!(Message::parse(&long).unwrap_err(), StunError::NotStun("length does not match the datagram"));
        let mut cookie = good.clone();
        cookie[4] ^= 1;
        assert!(Message::parse(&cookie).is_err());
        let mut attr_len = good.clone();
        attr_len[22] = 0x7f; // SOFTWARE claims more than the message holds
        assert!(matches!(Message::parse(&attr_len), Err(StunError::BadAttribute(20))));
        let mut flipped = good.clone();
        flipped[30] ^= 0x20; // a byte of SOFTWARE: both checks fail
        let m = Message::parse(&flipped).unwrap();
        assert_eq!(m.check_integrity(PASSWORD), Err(StunError::BadIntegrity));
        assert_eq!(m.check_fingerprint(), Some(Err(StunError::BadFingerprint)));
    }

    #[test]
    fn built_requests_round_trip() {
        let tx = [7u8; 12];
        let msg = Builder::new(BINDING, Class::Request, tx)
            .attribute(attr::USERNAME, b"abcd:efgh")
            .attribute(attr::PRIORITY, &1234u32.to_be_bytes())
            .attribute(attr::USE_CANDIDATE, &[])
            .integrity(b"secret")
            .fingerprint();
        let m = Message::parse(&msg).unwrap();
        assert_eq!((m.method, m.class, m.transaction), (BINDING, Class::Request, tx));
        assert_eq!(m.username(), Some("abcd:efgh"));
        assert_eq!(m.priority(), Some(1234));
        assert!(m.has(attr::USE_CANDIDATE));
        assert_eq!(m.check_integrity(b"secret"), Ok(()));
        assert_eq!(m.check_fingerprint(), Some(Ok(())));
        let err = Builder::new(BINDING, Class::Error, tx).error_code(401, "Unauthorized").fingerprint();
        let m = Message::parse(&err).unwrap();
        assert_eq!(m.class, Class::Error);
        assert_eq!(m.get(attr::ERROR_CODE).unwrap()[2..4], [4, 1]);
        let v6 = Builder::new(BINDING, Class::Success, tx).xor_mapped_address("[2001:db8::1]:5000".parse().unwrap()).finish();
        assert_eq!(Message::parse(&v6).unwrap().xor_mapped_address(), Some("[2001:db8::1]:5000".parse().unwrap()));
    }
}
