//! Bencode (the NG protocol's encoding): integers, byte strings, lists and dictionaries.
//!
//! The decoder is strict and bounded: trailing data, leading zeros, `-0`, integer overflow,
//! non-string or duplicate dictionary keys, nesting deeper than [`MAX_DEPTH`] and inputs larger
//! than [`MAX_INPUT`] are errors, never panics. Dictionary keys need not be sorted on input
//! (rtpengine does not require it either); the encoder always writes them sorted.

use std::collections::BTreeMap;
use std::fmt;

/// Deepest nesting of lists/dictionaries accepted.
pub const MAX_DEPTH: usize = 32;
/// Largest encoded document accepted (an NG datagram is at most 64 KiB anyway).
pub const MAX_INPUT: usize = 256 * 1024;

#[derive(Clone, PartialEq, Eq)]
pub enum Value {
    Int(i64),
    Bytes(Vec<u8>),
    List(Vec<Value>),
    Dict(BTreeMap<Vec<u8>, Value>),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("unexpected end of input at byte {0}")]
    Eof(usize),
    #[error("unexpected byte {byte:?} at byte {at}")]
    Unexpected { byte: char, at: usize },
    #[error("invalid integer at byte {0}")]
    BadInt(usize),
    #[error("invalid string length at byte {0}")]
    BadLength(usize),
    #[error("dictionary key at byte {0} is not a string")]
    KeyNotString(usize),
    #[error("duplicate dictionary key {0:?}")]
    DuplicateKey(String),
    #[error("nesting deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("input of {0} bytes exceeds {MAX_INPUT}")]
    TooLarge(usize),
    #[error("{0} bytes of trailing data after the document")]
    Trailing(usize),
}

impl Value {
    pub fn str(s: &str) -> Value {
        Value::Bytes(s.as_bytes().to_vec())
    }

    /// A dictionary from (key, value) pairs.
    pub fn dict<'a>(pairs: impl IntoIterator<Item = (&'a str, Value)>) -> Value {
        Value::Dict(pairs.into_iter().map(|(k, v)| (k.as_bytes().to_vec(), v)).collect())
    }

    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Value::Bytes(b) => Some(b),
            _ => None,
        }
    }

    /// The value as UTF-8 text, when it is a byte string holding valid UTF-8.
    pub fn as_str(&self) -> Option<&str> {
        self.as_bytes().and_then(|b| std::str::from_utf8(b).ok())
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub fn as_list(&self) -> Option<&[Value]> {
        match self {
            Value::List(l) => Some(l),
            _ => None,
        }
    }

    pub fn as_dict(&self) -> Option<&BTreeMap<Vec<u8>, Value>> {
        match self {
            Value::Dict(d) => Some(d),
            _ => None,
        }
    }

    /// Look a key up in a dictionary.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.as_dict()?.get(key.as_bytes())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(&mut out);
        out
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Value::Int(i) => {
                out.push(b'i');
                out.extend_from_slice(i.to_string().as_bytes());
                out.push(b'e');
            }
            Value::Bytes(b) => encode_bytes(b, out),
            Value::List(l) => {
                out.push(b'l');
                for v in l {
                    v.encode_into(out);
                }
                out.push(b'e');
            }
            Value::Dict(d) => {
                out.push(b'd');
                for (k, v) in d {
                    encode_bytes(k, out);
                    v.encode_into(out);
                }
                out.push(b'e');
            }
        }
    }
}

fn encode_bytes(b: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(b.len().to_string().as_bytes());
    out.push(b':');
    out.extend_from_slice(b);
}

/// JSON-like rendering for logs and test failures (byte strings shown lossily as text).
impl fmt::Debug for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Int(i) => write!(f, "{i}"),
            Value::Bytes(b) => write!(f, "{:?}", String::from_utf8_lossy(b)),
            Value::List(l) => f.debug_list().entries(l).finish(),
            Value::Dict(d) => f.debug_map().entries(d.iter().map(|(k, v)| (String::from_utf8_lossy(k), v))).finish(),
        }
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Value {
        Value::str(s)
    }
}
impl From<String> for Value {
    fn from(s: String) -> Value {
        Value::Bytes(s.into_bytes())
    }
}
impl From<i64> for Value {
    fn from(i: i64) -> Value {
        Value::Int(i)
    }
}

/// Decode exactly one document occupying all of `input`.
pub fn decode(input: &[u8]) -> Result<Value, DecodeError> {
    if input.len() > MAX_INPUT {
        return Err(DecodeError::TooLarge(input.len()));
    }
    let mut d = Decoder { buf: input, pos: 0 };
    let v = d.value(0)?;
    if d.pos != input.len() {
        return Err(DecodeError::Trailing(input.len() - d.pos));
    }
    Ok(v)
}

struct Decoder<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Decoder<'_> {
    fn peek(&self) -> Result<u8, DecodeError> {
        self.buf.get(self.pos).copied().ok_or(DecodeError::Eof(self.pos))
    }

    fn value(&mut self, depth: usize) -> Result<Value, DecodeError> {
        match self.peek()? {
            b'i' => {
                self.pos += 1;
                let start = self.pos;
                let end = self.find(b'e')?;
                let n = parse_int(&self.buf[start..end]).ok_or(DecodeError::BadInt(start))?;
                self.pos = end + 1;
                Ok(Value::Int(n))
            }
            b'0'..=b'9' => Ok(Value::Bytes(self.bytes()?)),
            b'l' | b'd' if depth >= MAX_DEPTH => Err(DecodeError::TooDeep),
            b'l' => {
                self.pos += 1;
                let mut l = Vec::new();
                while self.peek()? != b'e' {
                    l.push(self.value(depth + 1)?);
                }
                self.pos += 1;
                Ok(Value::List(l))
            }
            b'd' => {
                self.pos += 1;
                let mut d = BTreeMap::new();
                while self.peek()? != b'e' {
                    if !self.peek()?.is_ascii_digit() {
                        return Err(DecodeError::KeyNotString(self.pos));
                    }
                    let k = self.bytes()?;
                    let v = self.value(depth + 1)?;
                    if d.contains_key(&k) {
                        return Err(DecodeError::DuplicateKey(String::from_utf8_lossy(&k).into_owned()));
                    }
                    d.insert(k, v);
                }
                self.pos += 1;
                Ok(Value::Dict(d))
            }
            b => Err(DecodeError::Unexpected { byte: b as char, at: self.pos }),
        }
    }

    fn find(&self, byte: u8) -> Result<usize, DecodeError> {
        self.buf[self.pos..].iter().position(|&b| b == byte).map(|i| self.pos + i).ok_or(DecodeError::Eof(self.buf.len()))
    }

    fn bytes(&mut self) -> Result<Vec<u8>, DecodeError> {
        let start = self.pos;
        let colon = self.find(b':')?;
        let digits = &self.buf[start..colon];
        let len = parse_int(digits).filter(|&n| n >= 0 && !digits.starts_with(b"-")).ok_or(DecodeError::BadLength(start))? as usize;
        let data_start = colon + 1;
        if len > self.buf.len() - data_start {
            return Err(DecodeError::Eof(self.buf.len()));
        }
        self.pos = data_start + len;
        Ok(self.buf[data_start..self.pos].to_vec())
    }
}

/// Canonical decimal: no sign but '-', no leading zeros, no "-0", fits i64.
fn parse_int(digits: &[u8]) -> Option<i64> {
    let (neg, body) = match digits.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, digits),
    };
    if body.is_empty() || !body.iter().all(u8::is_ascii_digit) {
        return None;
    }
    if (body[0] == b'0' && body.len() > 1) || (neg && body == b"0") {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let v = Value::dict([
            ("command", Value::str("offer")),
            ("flags", Value::List(vec![Value::str("trust-address"), Value::str("")])),
            ("n", Value::Int(-42)),
            ("zero", Value::Int(0)),
            ("big", Value::Int(i64::MAX)),
            ("nested", Value::dict([("x", Value::List(vec![Value::List(vec![])]))])),
            ("bin", Value::Bytes(vec![0, 255, b'e', b':'])),
        ]);
        let enc = v.encode();
        assert_eq!(decode(&enc).unwrap(), v);
    }

    #[test]
    fn documented_ping_encoding() {
        assert_eq!(Value::dict([("command", "ping".into())]).encode(), b"d7:command4:pinge");
        assert_eq!(decode(b"d6:result4:ponge").unwrap().get("result").unwrap().as_str(), Some("pong"));
    }

    #[test]
    fn unsorted_keys_are_accepted_and_encoded_sorted() {
        let v = decode(b"d1:bi1e1:ai2ee").unwrap();
        assert_eq!(v.encode(), b"d1:ai2e1:bi1ee");
    }

    #[test]
    fn errors_never_panic() {
        let bad: &[(&[u8], &str)] = &[
            (b"", "end of input"),
            (b"i12", "end of input"),
            (b"i1x2e", "invalid integer"),
            (b"ie", "invalid integer"),
            (b"i-0e", "invalid integer"),
            (b"i012e", "invalid integer"),
            (b"i99999999999999999999e", "invalid integer"),
            (b"5:abc", "end of input"),
            (b"-1:a", "unexpected byte"),
            (b"01:a", "invalid string length"),
            (b"99999999999999999999999:a", "invalid string length"),
            (b"d", "end of input"),
            (b"di1ei2ee", "not a string"),
            (b"d1:ai1e1:ai2ee", "duplicate"),
            (b"l", "end of input"),
            (b"le1", "trailing"),
            (b"d1:a1:bee", "trailing"),
            (b"x", "unexpected byte"),
        ];
        for (input, want) in bad {
            let e = decode(input).unwrap_err().to_string();
            assert!(e.contains(want), "{:?}: {e}", String::from_utf8_lossy(input));
        }
        let deep = format!("{}{}", "l".repeat(MAX_DEPTH + 1), "e".repeat(MAX_DEPTH + 1));
        assert_eq!(decode(deep.as_bytes()), Err(DecodeError::TooDeep));
        let ok_deep = format!("{}{}", "l".repeat(MAX_DEPTH), "e".repeat(MAX_DEPTH));
        assert!(decode(ok_deep.as_bytes()).is_ok());
        assert!(matches!(decode(&vec![b'l'; MAX_INPUT + 1]), Err(DecodeError::TooLarge(_))));
    }

    #[test]
    fn every_prefix_of_a_valid_document_is_an_error_not_a_panic() {
        let doc = Value::dict([("sdp", "v=0\r\n".into()), ("flags", Value::List(vec!["a".into(), Value::Int(7)]))]).encode();
        for i in 0..doc.len() {
            assert!(decode(&doc[..i]).is_err());
        }
        // A cheap fuzz: flip every byte of the document to a few values.
        for i in 0..doc.len() {
            for b in [b'e', b'i', b'l', b'd', b'0', b':', b'-', 0xff] {
                let mut d = doc.clone();
                d[i] = b;
                let _ = decode(&d);
            }
        }
    }
}
