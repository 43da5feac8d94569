//! RTSP messages (RFC 2326 §4–§7, the same framing in RTSP 2.0) and the interleaved binary
//! frames that share the connection (`$`, channel, length; §10.12). Sans-I/O: [`decode`] takes
//! the bytes read so far and says what the first complete item is and how many bytes it used.
//!
//! Bounded so a peer cannot make the server hold more than [`MAX_HEAD`] + [`MAX_BODY`] bytes per
//! connection for one message.

use std::fmt::Write as _;

/// The request line and headers together.
pub const MAX_HEAD: usize = 8 * 1024;
pub const MAX_HEADERS: usize = 64;
/// A message body (an SDP, a GET_PARAMETER list).
pub const MAX_BODY: usize = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("request line and headers longer than {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("more than {MAX_HEADERS} headers")]
    TooManyHeaders,
    #[error("body of {0} bytes, more than {MAX_BODY}")]
    BodyTooLarge(usize),
    #[error("malformed start line")]
    BadStartLine,
    #[error("unsupported protocol version {0:?}")]
    BadVersion(String),
    #[error("malformed header line")]
    BadHeader,
    #[error("malformed Content-Length")]
    BadContentLength,
    #[error("control character in the message head")]
    ControlCharacter,
    #[error("message head is not UTF-8")]
    NotUtf8,
}

/// Header fields in the order received; names compare case-insensitively.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(pub Vec<(String, String)>);

impl Headers {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn set(&mut self, name: &str, value: impl Into<String>) {
        self.0.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        self.0.push((name.to_string(), value.into()));
    }

    pub fn cseq(&self) -> Option<u32> {
        self.get("CSeq")?.trim().parse().ok()
    }

    /// The session id of a `Session` header, without its `;timeout=` parameter.
    pub fn session(&self) -> Option<&str> {
        self.get("Session").map(|v| v.split(';').next().unwrap_or("").trim()).filter(|s| !s.is_empty())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub uri: String,
    pub headers: Headers,
    pub body: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub reason: String,
    pub headers: Headers,
    pub body: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Request(Request),
    Response(Response),
    /// RTP or RTCP carried on the RTSP connection.
    Interleaved {
        channel: u8,
        data: Vec<u8>,
    },
}

/// The first complete item in `buf` and the number of bytes it took, `None` when more bytes
/// are needed. An error means the connection's framing is lost: answer 400 and close it.
pub fn decode(buf: &[u8]) -> Result<Option<(Message, usize)>, ParseError> {
    let Some(&first) = buf.first() else { return Ok(None) };
    if first == b'$' {
        if buf.len() < 4 {
            return Ok(None);
        }
        let len = u16::from_be_bytes([buf[2], buf[3]]) as usize;
        if buf.len() < 4 + len {
            return Ok(None);
        }
        return Ok(Some((Message::Interleaved { channel: buf[1], data: buf[4..4 + len].to_vec() }, 4 + len)));
    }
    // Leading empty lines between messages are allowed (RFC 2326 §4, as in HTTP).
    let skip = buf.iter().take_while(|&&b| b == b'\r' || b == b'\n').count();
    if skip > 0 {
        return Ok(decode(&buf[skip..])?.map(|(m, n)| (m, n + skip)));
    }
    let Some((head_len, sep)) = find_head_end(buf) else {
        return if buf.len() > MAX_HEAD { Err(ParseError::HeadTooLarge) } else { Ok(None) };
    };
    if head_len > MAX_HEAD {
        return Err(ParseError::HeadTooLarge);
    }
    let head = std::str::from_utf8(&buf[..head_len]).map_err(|_| ParseError::NotUtf8)?;
    let mut lines = head.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    // Control characters (a bare CR, NUL...) have no place in a head: refused, so a message
    // never means one thing here and another to the next parser.
    if lines.clone().any(|l| l.bytes().any(|b| b.is_ascii_control() && b != b'\t')) {
        return Err(ParseError::ControlCharacter);
    }
    let start = lines.next().ok_or(ParseError::BadStartLine)?;
    let headers = parse_headers(lines)?;
    let body_len = match headers.get("Content-Length") {
        Some(v) => v.trim().parse::<usize>().map_err(|_| ParseError::BadContentLength)?,
        None => 0,
    };
    if body_len > MAX_BODY {
        return Err(ParseError::BodyTooLarge(body_len));
    }
    let total = head_len + sep + body_len;
    if buf.len() < total {
        return Ok(None);
    }
    let body = buf[head_len + sep..total].to_vec();
    let mut parts = start.splitn(3, ' ');
    let (a, b, c) = (parts.next().unwrap_or(""), parts.next().ok_or(ParseError::BadStartLine)?, parts.next().ok_or(ParseError::BadStartLine)?);
    let msg = if a.starts_with("RTSP/") {
        check_version(a)?;
        let status = b.parse::<u16>().ok().filter(|s| (100..1000).contains(s)).ok_or(ParseError::BadStartLine)?;
        Message::Response(Response { status, reason: c.to_string(), headers, body })
    } else {
        check_version(c)?;
        if a.is_empty() || !a.bytes().all(|x| x.is_ascii_alphanumeric() || x == b'_' || x == b'-') || b.is_empty() {
            return Err(ParseError::BadStartLine);
        }
        Message::Request(Request { method: a.to_string(), uri: b.to_string(), headers, body })
    };
    Ok(Some((msg, total)))
}

/// Where the head ends: its length and the separator's (CRLF CRLF, or bare LF LF as some
/// clients send).
fn find_head_end(buf: &[u8]) -> Option<(usize, usize)> {
    let limit = buf.len().min(MAX_HEAD + 4);
    (0..limit).find_map(|i| {
        if buf[i..].starts_with(b"\r\n\r\n") {
            Some((i, 4))
        } else if buf[i..].starts_with(b"\n\n") {
            Some((i, 2))
        } else {
            None
        }
    })
}

fn check_version(v: &str) -> Result<(), ParseError> {
    match v {
        "RTSP/1.0" | "RTSP/2.0" => Ok(()),
        _ => Err(ParseError::BadVersion(v.chars().take(16).collect())),
    }
}

fn parse_headers<'a>(lines: impl Iterator<Item = &'a str>) -> Result<Headers, ParseError> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in lines {
        if line.starts_with([' ', '\t']) {
            // A folded continuation of the previous header's value.
            let (_, v) = out.last_mut().ok_or(ParseError::BadHeader)?;
            let more = line.trim();
            if !more.is_empty() {
                if !v.is_empty() {
                    v.push(' ');
                }
                v.push_str(more);
            }
            continue;
        }
        let (name, value) = line.split_once(':').ok_or(ParseError::BadHeader)?;
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ParseError::BadHeader);
        }
        if out.len() == MAX_HEADERS {
            return Err(ParseError::TooManyHeaders);
        }
        out.push((name.to_string(), value.trim().to_string()));
    }
    Ok(Headers(out))
}

fn write_head(out: &mut String, headers: &Headers, body: &[u8]) {
    for (n, v) in &headers.0 {
        if !n.eq_ignore_ascii_case("Content-Length") {
            let _ = write!(out, "{n}: {v}\r\n");
        }
    }
    if !body.is_empty() {
        let _ = write!(out, "Content-Length: {}\r\n", body.len());
    }
    out.push_str("\r\n");
}

impl Request {
    pub fn new(method: &str, uri: &str, cseq: u32) -> Request {
        let mut headers = Headers::default();
        headers.set("CSeq", cseq.to_string());
        Request { method: method.to_string(), uri: uri.to_string(), headers, body: Vec::new() }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut s = format!("{} {} RTSP/1.0\r\n", self.method, self.uri);
        write_head(&mut s, &self.headers, &self.body);
        let mut out = s.into_bytes();
        out.extend_from_slice(&self.body);
        out
    }
}

impl Response {
    /// A response to `req` with its CSeq (RFC 2326 §12.17: every response carries it).
    pub fn to(req: &Request, status: u16) -> Response {
        let mut headers = Headers::default();
        if let Some(c) = req.headers.get("CSeq") {
            headers.set("CSeq", c);
        }
        Response { status, reason: reason(status).to_string(), headers, body: Vec::new() }
    }

    pub fn with(mut self, name: &str, value: impl Into<String>) -> Response {
        self.headers.set(name, value);
        self
    }

    pub fn with_body(mut self, content_type: &str, body: Vec<u8>) -> Response {
        self.headers.set("Content-Type", content_type);
        self.body = body;
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut s = format!("RTSP/1.0 {} {}\r\n", self.status, self.reason);
        write_head(&mut s, &self.headers, &self.body);
        let mut out = s.into_bytes();
        out.extend_from_slice(&self.body);
        out
    }
}

/// An interleaved frame (`$`, channel, 16-bit length, data); data longer than 65535 bytes
/// cannot be framed and is refused.
pub fn interleaved(channel: u8, data: &[u8]) -> Option<Vec<u8>> {
    let len = u16::try_from(data.len()).ok()?;
    let mut out = Vec::with_capacity(4 + data.len());
    out.extend_from_slice(&[b'$', channel]);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(data);
    Some(out)
}

pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Request Entity Too Large",
        453 => "Not Enough Bandwidth",
        454 => "Session Not Found",
        455 => "Method Not Valid in This State",
        459 => "Aggregate Operation Not Allowed",
        461 => "Unsupported Transport",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "RTSP Version Not Supported",
        _ => "Unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_in_pieces_then_whole() {
        let wire = b"DESCRIBE rtsp://h/cam RTSP/1.0\r\nCSeq: 2\r\nAccept: application/sdp\r\n\r\n";
        for cut in 0..wire.len() {
            assert_eq!(decode(&wire[..cut]).unwrap(), None, "cut at {cut}");
        }
        let (m, n) = decode(wire).unwrap().unwrap();
        assert_eq!(n, wire.len());
        let Message::Request(r) = m else { panic!() };
        assert_eq!((r.method.as_str(), r.uri.as_str(), r.headers.cseq()), ("DESCRIBE", "rtsp://h/cam", Some(2)));
        assert_eq!(r.headers.get("accept"), Some("application/sdp"));
    }

    #[test]
    fn a_response_with_a_body_and_an_interleaved_frame_after_it() {
        let mut wire = b"RTSP/1.0 200 OK\r\nCSeq: 3\r\nSession: 12ab;timeout=60\r\nContent-Length: 4\r\n\r\nv=0\n".to_vec();
        wire.extend_from_slice(&interleaved(1, b"rtcp").unwrap());
        let (m, n) = decode(&wire).unwrap().unwrap();
        let Message::Response(r) = m else { panic!() };
        assert_eq!((r.status, r.body.as_slice(), r.headers.session()), (200, &b"v=0\n"[..], Some("12ab")));
        let (m, k) = decode(&wire[n..]).unwrap().unwrap();
        assert_eq!(m, Message::Interleaved { channel: 1, data: b"rtcp".to_vec() });
        assert_eq!(n + k, wire.len());
    }

    #[test]
    fn limits_and_garbage_are_errors_not_waits() {
        assert_eq!(decode(&vec![b'A'; MAX_HEAD + 5]), Err(ParseError::HeadTooLarge));
        assert_eq!(decode(b"OPTIONS * RTSP/1.0\r\nContent-Length: 99999999\r\n\r\n"), Err(ParseError::BodyTooLarge(99_999_999)));
        assert_eq!(decode(b"OPTIONS * HTTP/1.1\r\n\r\n"), Err(ParseError::BadVersion("HTTP/1.1".into())));
        assert_eq!(decode(b"OPTIONS * RTSP/1.0\r\nno colon\r\n\r\n"), Err(ParseError::BadHeader));
        assert_eq!(decode(b"OPTIONS * RTSP/1.0\r\nContent-Length: -1\r\n\r\n"), Err(ParseError::BadContentLength));
        // Found by the fuzz target: a bare CR inside a value came back as a line break.
        assert_eq!(decode(b"OPTIONS * RTSP/1.0\r\nX: a\rb\r\n\r\n"), Err(ParseError::ControlCharacter));
        let many: String = (0..=MAX_HEADERS).map(|i| format!("X-{i}: v\r\n")).collect();
        assert_eq!(decode(format!("OPTIONS * RTSP/1.0\r\n{many}\r\n").as_bytes()), Err(ParseError::TooManyHeaders));
    }

    #[test]
    fn encode_then_decode_is_the_same_message() {
        let mut req = Request::new("SETUP", "rtsp://h/cam/trackID=0", 4);
        req.headers.set("Transport", "RTP/AVP;unicast;client_port=5000-5001");
        let (m, _) = decode(&req.to_bytes()).unwrap().unwrap();
        assert_eq!(m, Message::Request(req.clone()));
        let resp = Response::to(&req, 461).with_body("text/plain", b"tcp".to_vec());
        let (m, _) = decode(&resp.to_bytes()).unwrap().unwrap();
        let Message::Response(r) = m else { panic!() };
        assert_eq!((r.status, r.headers.cseq(), r.body), (461, Some(4), b"tcp".to_vec()));
    }
}
