//! The SDP of WHIP (RFC 9725) and WHEP sessions: what a browser's offer asks ([`Offer::parse`])
//! and the SFU's answer ([`Answer::write`]). Only what a WebRTC endpoint sends is read: one
//! BUNDLE transport (ICE credentials, DTLS fingerprint and setup role), and per media section its
//! mid, direction, payload formats with their feedback, and the SSRCs it sends.
//!
//! The SFU is an ICE-lite, rtcp-mux, BUNDLE-only endpoint that forwards payloads as they are:
//! it answers one payload format per section (no RTX, RED or FEC), and a subscriber's section
//! gets the publisher's format only with the payload type the publisher used (copies are not
//! renumbered). The only header extensions it answers are those a simulcast publisher's
//! layers are told apart by (RFC 8852's RTP stream id and RFC 8843's MID): a section sent in
//! several encodings (`a=simulcast`, RFC 8853, with `a=rid`, RFC 8851) is answered with them,
//! so the SFU learns each layer's SSRC from its first packets.

use crate::dtls::{Fingerprint, Role};
use crate::ice::Credentials;
use std::fmt::Write as _;
use std::net::SocketAddr;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SdpError {
    #[error("not an SDP offer: {0}")]
    Malformed(String),
    #[error("the offer has no {0}")]
    Missing(&'static str),
    #[error("{0}")]
    Unsupported(String),
}

/// Why an `a=fingerprint` the SFU cannot check refuses the offer: one of a hash function
/// RFC 8122 names but the SFU does not compute (`md5`, `md2`, `sha-224`) is a valid offer it
/// cannot take; anything else (no hash function, bytes that are not hex or not its length) is
/// not a fingerprint, malformed as a missing one is missing.
fn fingerprint_refused(value: &str) -> SdpError {
    let hash = value.trim().split_once(' ').map(|(h, _)| h.to_ascii_lowercase());
    match hash.as_deref() {
        Some(h @ ("md5" | "md2" | "sha-224")) => SdpError::Unsupported(format!("a=fingerprint in {h}: the SFU checks sha-1, sha-256, sha-384 or sha-512")),
        _ => SdpError::Malformed(format!("a=fingerprint {value:?} is not <hash function> <its bytes in hex>")),
    }
}

/// `audio` or `video` (other media sections are answered rejected).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Audio,
    Video,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Audio => "audio",
            Kind::Video => "video",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        match s {
            "audio" => Some(Kind::Audio),
            "video" => Some(Kind::Video),
            _ => None,
        }
    }
}

/// A media section's direction, as its sender sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    SendRecv,
    SendOnly,
    RecvOnly,
    Inactive,
}

impl Direction {
    fn parse(s: &str) -> Option<Direction> {
        match s {
            "sendrecv" => Some(Direction::SendRecv),
            "sendonly" => Some(Direction::SendOnly),
            "recvonly" => Some(Direction::RecvOnly),
            "inactive" => Some(Direction::Inactive),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Direction::SendRecv => "sendrecv",
            Direction::SendOnly => "sendonly",
            Direction::RecvOnly => "recvonly",
            Direction::Inactive => "inactive",
        }
    }

    pub fn sends(self) -> bool {
        matches!(self, Direction::SendRecv | Direction::SendOnly)
    }

    pub fn receives(self) -> bool {
        matches!(self, Direction::SendRecv | Direction::RecvOnly)
    }
}

/// One payload format of a section: `a=rtpmap`, `a=fmtp`, `a=rtcp-fb`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Format {
    pub pt: u8,
    /// The encoding, as `a=rtpmap` has it after the payload type: `VP8/90000`, `opus/48000/2`.
    pub rtpmap: String,
    pub fmtp: Option<String>,
    /// `nack`, `nack pli`, `ccm fir`, `goog-remb`, `transport-cc`…
    pub feedback: Vec<String>,
}

impl Format {
    /// The encoding name (`VP8`, `opus`), as written.
    pub fn encoding(&self) -> &str {
        self.rtpmap.split('/').next().unwrap_or("")
    }

    /// The RTP clock rate.
    pub fn clock_rate(&self) -> Option<u32> {
        self.rtpmap.split('/').nth(1)?.parse().ok()
    }

    /// A format that repairs or protects others rather than carrying media.
    pub fn is_repair(&self) -> bool {
        ["rtx", "red", "ulpfec", "flexfec-03"].iter().any(|n| self.encoding().eq_ignore_ascii_case(n))
    }

    /// The same encoding as `other` (name, clock rate and channels; not the payload type).
    pub fn same_encoding(&self, other: &str) -> bool {
        self.rtpmap.eq_ignore_ascii_case(other)
    }
}

/// One media section of an offer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfferedMedia {
    /// None: neither audio nor video (answered rejected).
    pub kind: Option<Kind>,
    /// The `m=` line's media, protocol and formats, for a rejected section's answer.
    pub media: String,
    pub proto: String,
    pub fmt: String,
    pub mid: String,
    pub direction: Direction,
    /// Port 0: a section the offerer itself disabled.
    pub disabled: bool,
    pub formats: Vec<Format>,
    /// The SSRCs it sends media on, in order: an `a=ssrc-group:FID` pair's repair SSRC is not.
    pub ssrcs: Vec<u32>,
    /// Simulcast (`a=simulcast:send`): the RIDs of the encodings it sends, in the offer's
    /// order (paused ones and alternatives beyond the first left out), each declared by an
    /// `a=rid:<id> send`. Empty: one encoding.
    pub rids: Vec<String>,
    /// Its `a=simulcast` line, whatever it says (an offer may name RIDs it never declares).
    pub simulcast: bool,
    /// `a=extmap`: (id, URI).
    pub extmaps: Vec<(u8, String)>,
}

/// RFC 8852's RTP stream id header extension: a simulcast encoding's RID in its packets.
/// The transport-wide sequence number header extension (transport-cc).
pub use mediaplane_core::remote_estimate::ABS_SEND_TIME_URI;
pub use mediaplane_core::transport_feedback::TRANSPORT_CC_URI;
pub const RTP_STREAM_ID: &str = "urn:ietf:params:rtp-hdrext:sdes:rtp-stream-id";
/// RFC 8843's MID header extension: the media section a packet belongs to.
pub const SDES_MID: &str = "urn:ietf:params:rtp-hdrext:sdes:mid";

impl OfferedMedia {
    /// The id the offer gave the header extension `uri`.
    pub fn extmap(&self, uri: &str) -> Option<u8> {
        self.extmaps.iter().find(|(_, u)| u == uri).map(|(id, _)| *id)
    }
}

/// What a browser offers (WHIP to publish, WHEP to subscribe).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    pub ice: Credentials,
    pub fingerprint: Fingerprint,
    /// The offerer's `a=setup`.
    pub setup: String,
    pub media: Vec<OfferedMedia>,
}

impl Offer {
    /// Parse an offer; what a WebRTC endpoint must say and this one does not is an error.
    pub fn parse(sdp: &str) -> Result<Offer, SdpError> {
        let mut session: Vec<(&str, &str)> = Vec::new();
        let mut sections: Vec<(String, Vec<(&str, &str)>)> = Vec::new();
        for (n, raw) in sdp.lines().enumerate() {
            let line = raw.trim_end_matches('\r');
            if line.is_empty() {
                continue;
            }
            // What the answer echoes (mids, formats) must not carry line breaks or controls.
            if line.chars().any(|c| c.is_control() && c != '\t') {
                return Err(SdpError::Malformed(format!("line {} has a control character", n + 1)));
            }
            let (t, value) = line.split_once('=').filter(|(t, _)| t.len() == 1).ok_or_else(|| SdpError::Malformed(format!("line {}: {line:?}", n + 1)))?;
            match t {
                "m" => sections.push((value.to_string(), Vec::new())),
                "a" => {
                    let attr = value.split_once(':').unwrap_or((value, ""));
                    match sections.last_mut() {
                        Some((_, attrs)) => attrs.push(attr),
                        None => session.push(attr),
                    }
                }
                _ => {}
            }
        }
        if !sdp.starts_with("v=0") {
            return Err(SdpError::Malformed("it does not start with v=0".into()));
        }
        if sections.is_empty() {
            return Err(SdpError::Missing("media section"));
        }
        // Transport attributes: the first bundled section's, or the session's.
        let find =
            |name: &str| -> Option<&str> { sections.iter().flat_map(|(_, a)| a.iter()).chain(session.iter()).find(|(n, _)| *n == name).map(|(_, v)| v.trim()) };
        let ice = Credentials {
            ufrag: find("ice-ufrag").ok_or(SdpError::Missing("a=ice-ufrag"))?.to_string(),
            pwd: find("ice-pwd").ok_or(SdpError::Missing("a=ice-pwd"))?.to_string(),
        };
        let fingerprint = find("fingerprint").ok_or(SdpError::Missing("a=fingerprint"))?;
        let fingerprint = Fingerprint::parse(fingerprint).map_err(|_| fingerprint_refused(fingerprint))?;
        let setup = find("setup").unwrap_or("actpass").to_string();
        let mut media = Vec::new();
        if sections.len() > 64 {
            return Err(SdpError::Unsupported(format!("{} media sections: at most 64", sections.len())));
        }
        for (mline, attrs) in &sections {
            media.push(parse_section(mline, attrs)?);
        }
        // One transport for everything: every section in the BUNDLE group.
        let bundle: Vec<&str> =
            session.iter().find(|(n, v)| *n == "group" && v.starts_with("BUNDLE")).map(|(_, v)| v.split_whitespace().skip(1).collect()).unwrap_or_default();
        if let Some(m) = media.iter().find(|m| !m.disabled && !bundle.contains(&m.mid.as_str())) {
            return Err(SdpError::Unsupported(format!("media section {:?} is not bundled: the SFU takes one BUNDLE transport (a=group:BUNDLE)", m.mid)));
        }
        let muxed = |attrs: &[(&str, &str)]| attrs.iter().any(|(n, _)| *n == "rtcp-mux");
        if !sections.iter().zip(&media).all(|((_, a), m)| m.disabled || m.kind.is_none() || muxed(a)) {
            return Err(SdpError::Unsupported("the SFU needs RTP and RTCP on one port (a=rtcp-mux)".into()));
        }
        Ok(Offer { ice, fingerprint, setup, media })
    }

    /// The SFU's DTLS role and `a=setup` answering this offer.
    pub fn answer_role(&self) -> Result<(Role, &'static str), SdpError> {
        match self.setup.as_str() {
            // The offerer may be either: the SFU waits for its ClientHello.
            "actpass" | "active" => Ok((Role::Server, "passive")),
            "passive" => Ok((Role::Client, "active")),
            other => Err(SdpError::Unsupported(format!("a=setup:{other}"))),
        }
    }
}

fn parse_section(mline: &str, attrs: &[(&str, &str)]) -> Result<OfferedMedia, SdpError> {
    let mut parts = mline.split_whitespace();
    let media = parts.next().unwrap_or("").to_string();
    let port: u16 = parts.next().and_then(|p| p.split('/').next()?.parse().ok()).ok_or_else(|| SdpError::Malformed(format!("m={mline}")))?;
    let proto = parts.next().unwrap_or("").to_string();
    let fmt: Vec<&str> = parts.collect();
    if fmt.is_empty() || fmt.len() > 128 || !fmt.iter().all(|f| is_token(f)) {
        return Err(SdpError::Malformed(format!("m={mline}: 1 to 128 formats")));
    }
    let mut pts: Vec<u8> = Vec::new();
    for pt in fmt.iter().filter_map(|p| p.parse::<u8>().ok()) {
        if !pts.contains(&pt) && pts.len() < 128 {
            pts.push(pt);
        }
    }
    let kind = Kind::parse(&media);
    let mid = attrs.iter().find(|(n, _)| *n == "mid").map(|(_, v)| v.trim().to_string()).ok_or(SdpError::Missing("a=mid"))?;
    // Echoed into the answer's m= line, a=mid and BUNDLE group: tokens only (RFC 8866 §9).
    for (what, v) in [("media", media.as_str()), ("proto", proto.as_str()), ("a=mid", mid.as_str())] {
        let ok = if what == "proto" { v.split('/').all(is_token) } else { is_token(v) };
        if !ok {
            return Err(SdpError::Malformed(format!("{what} {v:?} is not a token")));
        }
    }
    let direction = attrs.iter().rev().find_map(|(n, _)| Direction::parse(n)).unwrap_or(Direction::SendRecv);
    // `a=rtpmap:96 VP8/90000` and the like: the values after each payload type, read once.
    let mut by_pt: std::collections::HashMap<(&str, u8), Vec<String>> = std::collections::HashMap::new();
    for (name, v) in attrs.iter().filter(|(n, _)| matches!(*n, "rtpmap" | "fmtp" | "rtcp-fb")) {
        let Some((pt, rest)) = v.split_once(' ') else { continue };
        if let Ok(pt) = pt.parse::<u8>() {
            let values = by_pt.entry((name, pt)).or_default();
            if values.len() < 16 {
                values.push(rest.trim().to_string());
            }
        }
    }
    let of = |name: &'static str, pt: u8| -> Vec<String> { by_pt.get(&(name, pt)).cloned().unwrap_or_default() };
    let formats = pts
        .iter()
        .filter_map(|&pt| {
            let rtpmap = of("rtpmap", pt).into_iter().next().filter(|r| !r.is_empty() && r.split('/').all(is_token))?;
            Some(Format { pt, rtpmap, fmtp: of("fmtp", pt).into_iter().next(), feedback: of("rtcp-fb", pt) })
        })
        .collect();
    let repair: Vec<u32> =
        attrs.iter().filter(|(n, v)| *n == "ssrc-group" && v.starts_with("FID")).filter_map(|(_, v)| v.split_whitespace().nth(2)?.parse().ok()).collect();
    let mut ssrcs: Vec<u32> = Vec::new();
    for (_, v) in attrs.iter().filter(|(n, _)| *n == "ssrc") {
        let ssrc = v.split_whitespace().next().and_then(|s| s.parse().ok()).ok_or_else(|| SdpError::Malformed(format!("a=ssrc:{v}")))?;
        if !repair.contains(&ssrc) && !ssrcs.contains(&ssrc) {
            ssrcs.push(ssrc);
        }
    }
    let simulcast = attrs.iter().any(|(n, _)| *n == "simulcast");
    let rids = if simulcast { simulcast_rids(attrs)? } else { Vec::new() };
    let mut extmaps = Vec::new();
    for (_, v) in attrs.iter().filter(|(n, _)| *n == "extmap") {
        // `a=extmap:<id>[/<direction>] <uri> [<attributes>]`
        let mut parts = v.split_whitespace();
        // Ids past 255 (RFC 8285's 4096-4351, offered for negotiation) cannot be answered: skipped.
        let id = parts.next().and_then(|i| i.split('/').next()?.parse::<u8>().ok()).filter(|i| *i >= 1);
        let (Some(id), Some(uri)) = (id, parts.next()) else { continue };
        if extmaps.len() < 32 && uri.len() <= 256 {
            extmaps.push((id, uri.to_string()));
        }
    }
    let fmt = fmt.join(" ");
    Ok(OfferedMedia { kind, media, proto, fmt, mid, direction, disabled: port == 0, formats, ssrcs, rids, simulcast, extmaps })
}

/// The RIDs `a=simulcast:send` lists (RFC 8853 §5.1: `send <rid>[,<alt>];...`), first
/// alternatives only, paused (`~`) ones left out; each must be declared `a=rid:<id> send`.
fn simulcast_rids(attrs: &[(&str, &str)]) -> Result<Vec<String>, SdpError> {
    let declared: Vec<&str> = attrs
        .iter()
        .filter(|(n, _)| *n == "rid")
        .filter_map(|(_, v)| v.split_whitespace().collect::<Vec<_>>().get(..2).filter(|p| p[1] == "send").map(|p| p[0]))
        .collect();
    let Some(list) = attrs.iter().find(|(n, _)| *n == "simulcast").and_then(|(_, v)| {
        let mut parts = v.split_whitespace();
        // `send a;b recv c` or `recv c send a;b`: the send list.
        std::iter::from_fn(|| Some((parts.next()?, parts.next()?))).find(|(dir, _)| *dir == "send").map(|(_, l)| l)
    }) else {
        return Ok(Vec::new());
    };
    let mut rids: Vec<String> = Vec::new();
    for entry in list.split(';') {
        let first = entry.split(',').next().unwrap_or("");
        if first.starts_with('~') {
            continue;
        }
        // RFC 8851's rid-id: letters, digits, '-' and '_' (and short: it is echoed and reported).
        if first.is_empty() || first.len() > 16 || !first.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(SdpError::Malformed(format!("a=simulcast: {first:?} is not a RID")));
        }
        if !declared.contains(&first) {
            return Err(SdpError::Malformed(format!("a=simulcast names RID {first:?}, which no a=rid:{first} send declares")));
        }
        if !rids.iter().any(|r| r == first) && rids.len() < 16 {
            rids.push(first.to_string());
        }
    }
    Ok(rids)
}

/// RFC 8866's `token`: visible ASCII but separators and spaces.
fn is_token(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_graphic() && !b"\"(),/:;<=>?@[]{}".contains(&b))
}

/// What the SFU sends on one section of a subscriber's answer: a stream's SSRC and its names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sending {
    pub ssrc: u32,
    /// `a=ssrc:… cname:` (RTCP's CNAME, what lip sync groups by): the publisher.
    pub cname: String,
    /// `a=msid:` stream and track ids.
    pub msid: (String, String),
}

/// The answer to one offered section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnsweredMedia {
    /// The one format taken; None: nothing flows on it (an audio or video section is answered
    /// inactive with its first offered format, anything else rejected with port 0).
    pub format: Option<Format>,
    pub direction: Direction,
    pub sending: Option<Sending>,
    /// A simulcast publisher's section.
    pub simulcast: Option<SimulcastAnswer>,
    /// A publisher's section whose offer mapped the transport-wide sequence number extension to
    /// this id: answered with it and `transport-cc` feedback (the SFU feeds back its arrivals).
    pub transport_cc: Option<u8>,
    /// A publisher's section without transport-cc whose offer mapped abs-send-time to this id:
    /// answered with it (the SFU estimates the path from the send times and sends REMBs).
    pub abs_send_time: Option<u8>,
}

/// How a simulcast publisher's section is answered: the RIDs the SFU receives (`a=rid:<id>
/// recv`, `a=simulcast:recv`), and the header extensions (id, URI) its packets name them with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimulcastAnswer {
    pub rids: Vec<String>,
    pub extmaps: Vec<(u8, String)>,
}

impl AnsweredMedia {
    /// A section nothing flows on.
    pub fn inactive() -> AnsweredMedia {
        AnsweredMedia { format: None, direction: Direction::Inactive, sending: None, simulcast: None, transport_cc: None, abs_send_time: None }
    }

    /// A section the SFU receives `format` on (a publisher's).
    pub fn receiving(format: Format) -> AnsweredMedia {
        AnsweredMedia { format: Some(format), direction: Direction::RecvOnly, sending: None, simulcast: None, transport_cc: None, abs_send_time: None }
    }
}

/// The SFU's answer.
pub struct Answer<'a> {
    pub offer: &'a Offer,
    pub ice: &'a Credentials,
    pub fingerprint: &'a Fingerprint,
    pub setup: &'static str,
    /// The participant's transport address, as advertised (its one host candidate).
    pub candidate: SocketAddr,
    /// One per offered section, in order.
    pub media: Vec<AnsweredMedia>,
}

/// The feedback the SFU takes part in: it routes keyframe requests and NACKs, and reads REMB
/// (and sends `transport-cc` feedback where [`AnsweredMedia::transport_cc`] says).
const FEEDBACK: [&str; 4] = ["nack", "nack pli", "ccm fir", "goog-remb"];

impl Answer<'_> {
    pub fn write(&self) -> String {
        let ip = self.candidate.ip();
        let family = if ip.is_ipv4() { "IP4" } else { "IP6" };
        let mut s = String::new();
        let session_id = u64::from(self.candidate.port()) << 32 | u64::from(std::process::id());
        let _ = write!(s, "v=0\r\no=- {session_id} 1 IN {family} {ip}\r\ns=mediaplane\r\nt=0 0\r\na=ice-lite\r\n");
        // Every audio or video section stays in the BUNDLE, inactive when it carries nothing
        // (browsers refuse a bundled answer whose first section was rejected).
        let format_of = |o: &'_ OfferedMedia, a: &'_ AnsweredMedia| {
            a.format.clone().or_else(|| o.kind.filter(|_| !o.disabled).and(o.formats.iter().find(|f| !f.is_repair()).cloned()))
        };
        let bundled: Vec<&str> = self.offer.media.iter().zip(&self.media).filter(|(o, a)| format_of(o, a).is_some()).map(|(o, _)| o.mid.as_str()).collect();
        if !bundled.is_empty() {
            let _ = write!(s, "a=group:BUNDLE {}\r\n", bundled.join(" "));
        }
        let _ = write!(s, "a=msid-semantic: WMS *\r\n");
        for (o, a) in self.offer.media.iter().zip(&self.media) {
            let Some(f) = &format_of(o, a) else {
                let _ = write!(s, "m={} 0 {} {}\r\nc=IN {family} {ip}\r\na=mid:{}\r\na=inactive\r\n", o.media, o.proto, o.fmt, o.mid);
                continue;
            };
            let _ = write!(s, "m={} {} {} {}\r\nc=IN {family} {ip}\r\n", o.media, self.candidate.port(), o.proto, f.pt);
            let direction = if a.format.is_some() { a.direction } else { Direction::Inactive };
            let _ = write!(s, "a=mid:{}\r\na={}\r\n", o.mid, direction.name());
            let _ = write!(s, "a=ice-ufrag:{}\r\na=ice-pwd:{}\r\n", self.ice.ufrag, self.ice.pwd);
            let _ = write!(s, "a=fingerprint:{}\r\na=setup:{}\r\n", self.fingerprint.to_sdp(), self.setup);
            let _ = write!(s, "a=rtcp-mux\r\na=rtpmap:{} {}\r\n", f.pt, f.rtpmap);
            if let Some(fmtp) = &f.fmtp {
                let _ = write!(s, "a=fmtp:{} {fmtp}\r\n", f.pt);
            }
            let transport_cc = a.transport_cc.filter(|_| a.format.is_some());
            for fb in f.feedback.iter().filter(|fb| FEEDBACK.contains(&fb.as_str()) || (fb.as_str() == "transport-cc" && transport_cc.is_some())) {
                let _ = write!(s, "a=rtcp-fb:{} {fb}\r\n", f.pt);
            }
            if let Some(out) = &a.sending {
                let _ = write!(s, "a=msid:{} {}\r\na=ssrc:{} cname:{}\r\n", out.msid.0, out.msid.1, out.ssrc, out.cname);
            }
            if let Some(id) = transport_cc {
                let _ = write!(s, "a=extmap:{id} {TRANSPORT_CC_URI}\r\n");
            }
            if let Some(id) = a.abs_send_time.filter(|_| a.format.is_some()) {
                let _ = write!(s, "a=extmap:{id} {ABS_SEND_TIME_URI}\r\n");
            }
            if let Some(SimulcastAnswer { rids, extmaps }) = a.simulcast.as_ref().filter(|_| a.format.is_some()) {
                for (id, uri) in extmaps {
                    let _ = write!(s, "a=extmap:{id} {uri}\r\n");
                }
                for rid in rids {
                    let _ = write!(s, "a=rid:{rid} recv\r\n");
                }
                let _ = write!(s, "a=simulcast:recv {}\r\n", rids.join(";"));
            }
            let _ = write!(s, "a=candidate:1 1 udp 2130706431 {ip} {} typ host\r\na=end-of-candidates\r\n", self.candidate.port());
        }
        s
    }
}

/// The format a publisher's section is answered with: for video VP8 first (the SFU finds its
/// keyframes), then H.264, then the first other media format; for audio Opus first.
pub fn choose_format(m: &OfferedMedia) -> Option<&Format> {
    let media: Vec<&Format> = m.formats.iter().filter(|f| !f.is_repair()).collect();
    let prefer: &[&str] = match m.kind? {
        Kind::Video => &["VP8", "H264"],
        Kind::Audio => &["opus"],
    };
    prefer.iter().find_map(|p| media.iter().find(|f| f.encoding().eq_ignore_ascii_case(p)).copied()).or_else(|| media.first().copied())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What Chromium offers for `addTransceiver('audio'/'video', {direction: 'sendonly'})`,
    /// shortened: two bundled sections, RTX with its FID group, header extensions.
    pub const CHROME_OFFER: &str = "v=0\r\no=- 4611731400430051336 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\n\
a=group:BUNDLE 0 1\r\na=extmap-allow-mixed\r\na=msid-semantic: WMS s1\r\n\
m=audio 9 UDP/TLS/RTP/SAVPF 111 63 9\r\nc=IN IP4 0.0.0.0\r\na=rtcp:9 IN IP4 0.0.0.0\r\n\
a=ice-ufrag:Xh7q\r\na=ice-pwd:5nqXbTqXq7ZJzs3V2w0tD6fG\r\na=ice-options:trickle\r\n\
a=fingerprint:sha-256 0F:74:31:25:CB:A2:13:EC:28:6F:6D:2C:61:FF:5D:C2:BC:B9:DB:3D:98:14:8D:1A:BB:EA:33:0C:A4:60:A8:8E\r\n\
a=setup:actpass\r\na=mid:0\r\na=extmap:1 urn:ietf:params:rtp-hdrext:ssrc-audio-level\r\na=sendonly\r\na=msid:s1 a1\r\n\
a=rtcp-mux\r\na=rtcp-rsize\r\na=rtpmap:111 opus/48000/2\r\na=rtcp-fb:111 transport-cc\r\na=fmtp:111 minptime=10;useinbandfec=1\r\n\
a=rtpmap:63 red/48000/2\r\na=fmtp:63 111/111\r\na=rtpmap:9 G722/8000\r\na=ssrc:1111 cname:c\r\na=ssrc:1111 msid:s1 a1\r\n\
m=video 9 UDP/TLS/RTP/SAVPF 96 97 98\r\nc=IN IP4 0.0.0.0\r\na=rtcp:9 IN IP4 0.0.0.0\r\n\
a=ice-ufrag:Xh7q\r\na=ice-pwd:5nqXbTqXq7ZJzs3V2w0tD6fG\r\na=ice-options:trickle\r\n\
a=fingerprint:sha-256 0F:74:31:25:CB:A2:13:EC:28:6F:6D:2C:61:FF:5D:C2:BC:B9:DB:3D:98:14:8D:1A:BB:EA:33:0C:A4:60:A8:8E\r\n\
a=setup:actpass\r\na=mid:1\r\na=sendonly\r\na=msid:s1 v1\r\na=rtcp-mux\r\na=rtcp-rsize\r\n\
a=rtpmap:96 VP8/90000\r\na=rtcp-fb:96 goog-remb\r\na=rtcp-fb:96 transport-cc\r\na=rtcp-fb:96 ccm fir\r\na=rtcp-fb:96 nack\r\na=rtcp-fb:96 nack pli\r\n\
a=rtpmap:97 rtx/90000\r\na=fmtp:97 apt=96\r\na=rtpmap:98 H264/90000\r\n\
a=ssrc-group:FID 2222 3333\r\na=ssrc:2222 cname:c\r\na=ssrc:3333 cname:c\r\n";

    /// The SFU's answer to `o` (its credentials `sfu1`, the offer's own fingerprint, port 40000).
    fn answer_to(o: &Offer, media: Vec<AnsweredMedia>) -> String {
        let ice = Credentials { ufrag: "sfu1".into(), pwd: "p".repeat(24) };
        Answer { offer: o, ice: &ice, fingerprint: &o.fingerprint, setup: "passive", candidate: "10.1.2.3:40000".parse().unwrap(), media }.write()
    }

    /// Every section of `o` answered as received (the first format the SFU takes, if any).
    fn receive_all(o: &Offer) -> Vec<AnsweredMedia> {
        o.media
            .iter()
            .map(|m| AnsweredMedia {
                format: choose_format(m).cloned(),
                direction: Direction::RecvOnly,
                sending: None,
                simulcast: None,
                transport_cc: None,
                abs_send_time: None,
            })
            .collect()
    }

    fn assert_lines(answer: &str, lines: &[&str]) {
        for line in lines {
            assert!(answer.lines().any(|l| l == *line), "{line:?} missing from\n{answer}");
        }
    }

    #[test]
    fn a_browsers_offer_is_read_and_answered_with_one_format_per_section() {
        let o = Offer::parse(CHROME_OFFER).unwrap();
        assert_eq!((o.ice.ufrag.as_str(), o.setup.as_str(), o.fingerprint.algorithm.as_str()), ("Xh7q", "actpass", "sha-256"));
        assert_eq!(o.media.len(), 2);
        let (audio, video) = (&o.media[0], &o.media[1]);
        assert_eq!((audio.kind, audio.mid.as_str(), audio.direction, &audio.ssrcs[..]), (Some(Kind::Audio), "0", Direction::SendOnly, &[1111][..]));
        assert_eq!(&video.ssrcs[..], &[2222], "the RTX SSRC of the FID group is not media");
        assert_eq!(choose_format(audio).map(|f| f.pt), Some(111));
        let vp8 = choose_format(video).unwrap();
        assert_eq!((vp8.pt, vp8.clock_rate(), vp8.feedback.len()), (96, Some(90000), 5));
        assert_eq!(o.answer_role().unwrap(), (Role::Server, "passive"));

        let a = answer_to(&o, receive_all(&o));
        assert_lines(
            &a,
            &[
                "a=ice-lite",
                "a=group:BUNDLE 0 1",
                "m=audio 40000 UDP/TLS/RTP/SAVPF 111",
                "a=fmtp:111 minptime=10;useinbandfec=1",
                "m=video 40000 UDP/TLS/RTP/SAVPF 96",
                "a=rtcp-fb:96 nack pli",
                "a=recvonly",
                "a=setup:passive",
                "a=candidate:1 1 udp 2130706431 10.1.2.3 40000 typ host",
            ],
        );
        assert!(!a.contains("transport-cc") && !a.contains("rtx") && !a.contains("extmap"), "nothing the SFU does not do:\n{a}");
        // The answer is an SDP this parser reads back (as a browser would).
        let back = Offer::parse(&a).unwrap();
        assert_eq!(back.media.iter().map(|m| m.formats.len()).collect::<Vec<_>>(), [1, 1]);
    }

    /// A publisher whose offer maps the transport-wide sequence number extension is answered
    /// with it and with `transport-cc` feedback on its sections (the SFU feeds back); the
    /// extension's id is the offer's.
    #[test]
    fn transport_cc_is_answered_where_the_sfu_feeds_back() {
        let offer = CHROME_OFFER.replace("a=mid:1\r\n", &format!("a=mid:1\r\na=extmap:3 {TRANSPORT_CC_URI}\r\n"));
        let o = Offer::parse(&offer).unwrap();
        let video = &o.media[1];
        assert_eq!(video.extmap(TRANSPORT_CC_URI), Some(3), "{offer}");
        let media: Vec<AnsweredMedia> = o
            .media
            .iter()
            .map(|m| AnsweredMedia { transport_cc: m.extmap(TRANSPORT_CC_URI), ..AnsweredMedia::receiving(choose_format(m).unwrap().clone()) })
            .collect();
        let a = answer_to(&o, media);
        assert_lines(&a, &["m=video 40000 UDP/TLS/RTP/SAVPF 96", "a=rtcp-fb:96 transport-cc", &format!("a=extmap:3 {TRANSPORT_CC_URI}")]);
        let counts = (a.matches("a=rtcp-fb:96 transport-cc").count(), a.matches(TRANSPORT_CC_URI).count(), a.matches("transport-cc").count());
        assert_eq!(counts, (1, 1, 1), "the video section only (the audio offered no extension):\n{a}");
    }

    /// Without transport-cc, a section's abs-send-time is answered (with goog-remb, which the
    /// offer lists): the SFU estimates the path and sends REMBs.
    #[test]
    fn abs_send_time_is_answered_where_the_sfu_estimates() {
        let offer = CHROME_OFFER.replace("a=mid:1\r\n", &format!("a=mid:1\r\na=extmap:2 {ABS_SEND_TIME_URI}\r\n"));
        let o = Offer::parse(&offer).unwrap();
        let media: Vec<AnsweredMedia> = o
            .media
            .iter()
            .map(|m| AnsweredMedia { abs_send_time: m.extmap(ABS_SEND_TIME_URI), ..AnsweredMedia::receiving(choose_format(m).unwrap().clone()) })
            .collect();
        let a = answer_to(&o, media);
        assert_lines(&a, &["m=video 40000 UDP/TLS/RTP/SAVPF 96", "a=rtcp-fb:96 goog-remb", &format!("a=extmap:2 {ABS_SEND_TIME_URI}")]);
        assert_eq!(a.matches(ABS_SEND_TIME_URI).count(), 1, "{a}");
    }

    /// A subscriber's section nothing is sent on (a publisher without audio): still bundled,
    /// inactive, with a format and the transport (a browser refuses a bundle whose first section
    /// is rejected).
    #[test]
    fn a_section_with_nothing_to_send_is_answered_inactive_in_the_bundle() {
        let offer = CHROME_OFFER.replace("a=sendonly", "a=recvonly");
        let o = Offer::parse(&offer).unwrap();
        let sending = Sending { ssrc: 42, cname: "gst".into(), msid: ("gst".into(), "video".into()) };
        let media = vec![
            AnsweredMedia::inactive(),
            AnsweredMedia {
                format: choose_format(&o.media[1]).cloned(),
                direction: Direction::SendOnly,
                sending: Some(sending),
                simulcast: None,
                transport_cc: None,
                abs_send_time: None,
            },
        ];
        let a = answer_to(&o, media);
        assert_lines(&a, &["a=group:BUNDLE 0 1", "m=audio 40000 UDP/TLS/RTP/SAVPF 111", "a=inactive", "a=sendonly", "a=ssrc:42 cname:gst", "a=msid:gst video"]);
        assert_eq!(a.matches("a=rtcp-mux").count(), 2);
    }

    #[test]
    fn offers_the_sfu_cannot_take_are_refused_with_the_reason() {
        assert!(matches!(Offer::parse("hello"), Err(SdpError::Malformed(_))));
        let no_ice = CHROME_OFFER.replace("a=ice-ufrag:Xh7q\r\n", "");
        assert_eq!(Offer::parse(&no_ice), Err(SdpError::Missing("a=ice-ufrag")));
        let unbundled = CHROME_OFFER.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0");
        assert!(matches!(Offer::parse(&unbundled), Err(SdpError::Unsupported(m)) if m.contains("not bundled")));
        let no_mux = CHROME_OFFER.replace("a=rtcp-mux\r\n", "");
        assert!(matches!(Offer::parse(&no_mux), Err(SdpError::Unsupported(m)) if m.contains("rtcp-mux")));
        let bad_fp = CHROME_OFFER.replace("sha-256 0F:74", "md5 0F:74");
        assert!(matches!(Offer::parse(&bad_fp), Err(SdpError::Unsupported(m)) if m.contains("md5")));
        // A fingerprint that is not one is malformed, as a missing one is missing (400, not 422).
        for garbage in ["sha-256 0F:74:31", "sha-256 ZZ:74", "nonsense", "sha-257 0F:74"] {
            let bad = CHROME_OFFER.replace("sha-256 0F:74:31:25:CB:A2:13:EC:28:6F:6D:2C:61:FF:5D:C2:BC:B9:DB:3D:98:14:8D:1A:BB:EA:33:0C:A4:60:A8:8E", garbage);
            assert!(matches!(Offer::parse(&bad), Err(SdpError::Malformed(m)) if m.contains("fingerprint")), "{garbage}");
        }
        let no_fp = CHROME_OFFER.lines().filter(|l| !l.starts_with("a=fingerprint")).map(|l| format!("{l}\r\n")).collect::<String>();
        assert_eq!(Offer::parse(&no_fp), Err(SdpError::Missing("a=fingerprint")));
        // Nothing the answer would echo may break its lines.
        let injected = CHROME_OFFER.replace("a=mid:1", "a=mid:1\ra=evil");
        assert!(matches!(Offer::parse(&injected), Err(SdpError::Malformed(_))));
        let spaced = CHROME_OFFER.replace("a=mid:1", "a=mid:1 2");
        assert!(matches!(Offer::parse(&spaced), Err(SdpError::Malformed(_))));
        // A data channel section is rejected as it was offered.
        let with_data = format!("{CHROME_OFFER}m=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\na=mid:2\r\n").replace("BUNDLE 0 1", "BUNDLE 0 1 2");
        let o = Offer::parse(&with_data).unwrap();
        let a = answer_to(&o, receive_all(&o));
        assert!(a.contains("m=application 0 UDP/DTLS/SCTP webrtc-datachannel\r\n"), "{a}");
        let holdconn = CHROME_OFFER.replace("a=setup:actpass", "a=setup:holdconn");
        assert!(Offer::parse(&holdconn).unwrap().answer_role().is_err());
    }

    /// What Chromium offers for `addTransceiver(track, {sendEncodings: [{rid: 'q'}, {rid: 'h'},
    /// {rid: 'f'}]})` (shortened): no `a=ssrc` at all, the RIDs and the extensions naming them.
    #[test]
    fn a_simulcast_offer_is_answered_with_its_rids_and_the_extensions_that_name_them() {
        let video = CHROME_OFFER.split("m=video").nth(1).unwrap();
        let simulcast = video.replace("a=ssrc-group:FID 2222 3333\r\na=ssrc:2222 cname:c\r\na=ssrc:3333 cname:c\r\n", "").replace(
            "a=sendonly\r\n",
            "a=extmap:4 http://www.ietf.org/id/draft-holmer-rmcat-transport-wide-cc-extensions-01\r\n\
                 a=extmap:9 urn:ietf:params:rtp-hdrext:sdes:mid\r\na=extmap:10 urn:ietf:params:rtp-hdrext:sdes:rtp-stream-id\r\n\
                 a=extmap:11/sendonly urn:ietf:params:rtp-hdrext:sdes:repaired-rtp-stream-id\r\na=sendonly\r\n",
        );
        let offer = format!("v=0\r\no=- 1 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\na=group:BUNDLE 1\r\nm=video{simulcast}a=rid:q send\r\na=rid:h send\r\na=rid:f send\r\na=simulcast:send q;h;~x,y;f\r\na=rid:x send\r\n");
        let o = Offer::parse(&offer).unwrap();
        let m = &o.media[0];
        assert!(m.ssrcs.is_empty() && m.simulcast);
        assert_eq!(m.rids, ["q", "h", "f"], "paused encodings are not received");
        assert_eq!((m.extmap(RTP_STREAM_ID), m.extmap(SDES_MID), m.extmap("urn:x")), (Some(10), Some(9), None));
        let extmaps = vec![(9, SDES_MID.to_string()), (10, RTP_STREAM_ID.to_string())];
        let answered =
            AnsweredMedia { simulcast: Some(SimulcastAnswer { rids: m.rids.clone(), extmaps }), ..AnsweredMedia::receiving(choose_format(m).unwrap().clone()) };
        let a = answer_to(&o, vec![answered]);
        assert_lines(
            &a,
            &[
                "a=recvonly",
                "a=extmap:9 urn:ietf:params:rtp-hdrext:sdes:mid",
                "a=extmap:10 urn:ietf:params:rtp-hdrext:sdes:rtp-stream-id",
                "a=rid:q recv",
                "a=rid:f recv",
                "a=simulcast:recv q;h;f",
            ],
        );
        assert!(!a.contains("transport-wide") && !a.contains("repaired") && !a.contains("a=rid:x"), "{a}");
        // What does not add up is refused.
        let undeclared = offer.replace("a=rid:h send\r\n", "");
        assert!(matches!(Offer::parse(&undeclared), Err(SdpError::Malformed(m)) if m.contains("\"h\"")));
        let odd = offer.replace("send q;h", "send q!;h").replace("a=rid:q send", "a=rid:q! send");
        assert!(matches!(Offer::parse(&odd), Err(SdpError::Malformed(_))));
        // An extension id the SFU cannot answer is skipped, not a reason to refuse the offer.
        let odd_ext = offer.replace("a=extmap:9 ", "a=extmap:4096 ");
        assert_eq!(Offer::parse(&odd_ext).unwrap().media[0].extmap(SDES_MID), None);
    }
}
