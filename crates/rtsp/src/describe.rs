//! The presentation description an upstream answers DESCRIBE with (SDP, RFC 8866), as far as a
//! proxy needs it: its media sections, each one's control URL and clock rate, and the
//! description the proxy serves its own viewers (the same media, its own control URLs).

/// An SDP longer than this, or with more sections, is refused (a camera sends a few hundred
/// bytes and one to three sections).
pub const MAX_SDP: usize = 64 * 1024;
pub const MAX_TRACKS: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescribeError {
    #[error("SDP is not UTF-8")]
    NotUtf8,
    #[error("SDP longer than {MAX_SDP} bytes")]
    TooLarge,
    #[error("SDP has no v= line")]
    NotSdp,
    #[error("SDP has no media section")]
    NoMedia,
    #[error("SDP has more than {MAX_TRACKS} media sections")]
    TooManyTracks,
    #[error("malformed m= line {0:?}")]
    BadMedia(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Track {
    /// `video`, `audio`, `application`.
    pub kind: String,
    /// The `m=` line's payload type list (the first is what the camera sends).
    pub payload_types: Vec<u8>,
    /// `a=control` as written (relative or absolute); `None` means the base URL itself.
    pub control: Option<String>,
    /// From `a=rtpmap` of the first payload type; static types' rates from RFC 3551.
    pub clock_rate: Option<u32>,
    /// The section's lines after `m=`, as received.
    attributes: Vec<String>,
    proto: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presentation {
    /// Session-level attribute lines worth keeping for viewers (`a=range`, `a=tool`...).
    session_attributes: Vec<String>,
    pub session_name: String,
    pub tracks: Vec<Track>,
}

impl Presentation {
    pub fn parse(body: &[u8]) -> Result<Presentation, DescribeError> {
        if body.len() > MAX_SDP {
            return Err(DescribeError::TooLarge);
        }
        let text = std::str::from_utf8(body).map_err(|_| DescribeError::NotUtf8)?;
        let mut lines = text.lines().map(str::trim_end).filter(|l| !l.is_empty());
        if !lines.clone().next().is_some_and(|l| l.starts_with("v=")) {
            return Err(DescribeError::NotSdp);
        }
        let mut p = Presentation { session_attributes: Vec::new(), session_name: "-".into(), tracks: Vec::new() };
        for line in lines.by_ref() {
            if let Some(m) = line.strip_prefix("m=") {
                if p.tracks.len() == MAX_TRACKS {
                    return Err(DescribeError::TooManyTracks);
                }
                p.tracks.push(media_line(m)?);
            } else if let Some(t) = p.tracks.last_mut() {
                if let Some(c) = line.strip_prefix("a=control:") {
                    t.control = Some(c.trim().to_string()).filter(|c| c != "*");
                } else if line.starts_with("a=") || line.starts_with("b=") {
                    if let Some(rate) = rtpmap_rate(line, t.payload_types.first().copied()) {
                        t.clock_rate = Some(rate);
                    }
                    t.attributes.push(line.to_string());
                }
            } else if let Some(s) = line.strip_prefix("s=") {
                p.session_name = s.chars().take(128).collect();
            } else if line.starts_with("a=") && !line.starts_with("a=control:") {
                p.session_attributes.push(line.to_string());
            }
        }
        if p.tracks.is_empty() {
            return Err(DescribeError::NoMedia);
        }
        Ok(p)
    }

    /// What this proxy answers its own viewers' DESCRIBE with: the same media, connection
    /// address left to the transport (RFC 2326 C.1.7: 0.0.0.0 for unicast), one control URL
    /// per track relative to the Content-Base: `trackID=<index>`.
    pub fn served(&self, origin: std::net::IpAddr, session_id: u64) -> String {
        let family = if origin.is_ipv4() { "IP4" } else { "IP6" };
        let any = if origin.is_ipv4() { "0.0.0.0" } else { "::" };
        let mut s = format!("v=0\r\no=- {session_id} 1 IN {family} {origin}\r\ns={}\r\nc=IN {family} {any}\r\nt=0 0\r\n", self.session_name);
        for a in &self.session_attributes {
            s.push_str(a);
            s.push_str("\r\n");
        }
        s.push_str("a=control:*\r\n");
        for (i, t) in self.tracks.iter().enumerate() {
            let pts: Vec<String> = t.payload_types.iter().map(|p| p.to_string()).collect();
            s.push_str(&format!("m={} 0 {} {}\r\n", t.kind, t.proto, pts.join(" ")));
            for a in &t.attributes {
                s.push_str(a);
                s.push_str("\r\n");
            }
            s.push_str(&format!("a=control:trackID={i}\r\n"));
        }
        s
    }
}

impl Track {
    /// What `a=rtpmap` says of its first payload type after the number (`H264/90000`,
    /// `opus/48000/2`), or RFC 3551's name of a static one that browsers take (PCMU, PCMA, G722).
    pub fn rtpmap(&self) -> Option<String> {
        let pt = *self.payload_types.first()?;
        let mapped = self.attribute("a=rtpmap:", pt);
        mapped.or_else(|| {
            let name = match pt {
                0 => "PCMU/8000",
                8 => "PCMA/8000",
                9 => "G722/8000",
                _ => return None,
            };
            Some(name.to_string())
        })
    }

    /// `a=fmtp` of its first payload type, after the number.
    pub fn fmtp(&self) -> Option<String> {
        self.attribute("a=fmtp:", *self.payload_types.first()?)
    }

    /// The SSRC its `a=ssrc` lines name (RFC 5576), when they name one.
    pub fn ssrc(&self) -> Option<u32> {
        let mut named = self.attributes.iter().filter_map(|l| l.strip_prefix("a=ssrc:")?.split_whitespace().next()?.parse::<u32>().ok());
        let first = named.next()?;
        named.all(|s| s == first).then_some(first)
    }

    /// The value of `<prefix><pt> value`.
    fn attribute(&self, prefix: &str, pt: u8) -> Option<String> {
        self.attributes.iter().find_map(|l| {
            let (p, v) = l.strip_prefix(prefix)?.split_once(' ')?;
            (p.trim().parse::<u8>().ok()? == pt).then(|| v.trim().to_string())
        })
    }
}

/// The URL a track is set up at: its control resolved against the base (Content-Base, else
/// Content-Location, else the DESCRIBE URL; RFC 2326 C.1.1).
pub fn control_url(base: &url::Url, control: Option<&str>) -> Option<url::Url> {
    let Some(c) = control else { return Some(base.clone()) };
    if c.contains("://") {
        return url::Url::parse(c).ok();
    }
    // A base with a query (`rtsp://cam/realmonitor?channel=1&subtype=0/`, as many cameras say):
    // appended to, as ffmpeg and live555 do; resolving would drop the query.
    if base.query().is_some() {
        return url::Url::parse(&format!("{}/{c}", base.as_str().trim_end_matches('/'))).ok();
    }
    // Relative to the base as a directory, as servers mean it (`rtsp://h/cam` + `stream=0`).
    let mut dir = base.clone();
    if !dir.path().ends_with('/') {
        let p = format!("{}/", dir.path());
        dir.set_path(&p);
    }
    dir.join(c).ok()
}

fn media_line(m: &str) -> Result<Track, DescribeError> {
    let bad = || DescribeError::BadMedia(m.chars().take(64).collect());
    let mut f = m.split_whitespace();
    let kind = f.next().ok_or_else(bad)?;
    let _port = f.next().ok_or_else(bad)?;
    let proto = f.next().ok_or_else(bad)?;
    let payload_types = f.map(|x| x.parse::<u8>().ok().filter(|p| *p < 128)).collect::<Option<Vec<u8>>>().ok_or_else(bad)?;
    if payload_types.is_empty() || !proto.starts_with("RTP/") {
        return Err(bad());
    }
    let clock_rate = static_rate(payload_types[0]);
    Ok(Track { kind: kind.to_string(), payload_types, control: None, clock_rate, attributes: Vec::new(), proto: proto.to_string() })
}

fn rtpmap_rate(line: &str, pt: Option<u8>) -> Option<u32> {
    let rest = line.strip_prefix("a=rtpmap:")?;
    let (p, enc) = rest.split_once(' ')?;
    if p.trim().parse::<u8>().ok()? != pt? {
        return None;
    }
    enc.split('/').nth(1)?.trim().parse().ok().filter(|r| *r > 0)
}

/// RFC 3551's static payload types' clocks.
fn static_rate(pt: u8) -> Option<u32> {
    match pt {
        0..=8 | 12 | 13 | 15 | 18 => Some(8000),
        9 => Some(8000),
        10 | 11 => Some(44100),
        14 | 25 | 26 | 28 | 31..=34 => Some(90000),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What gst-rtsp-server answers for an H.264 + Opus mount.
    const GST: &str = "v=0\r\no=- 1188340656180883 1 IN IP4 127.0.0.1\r\ns=Session streamed with GStreamer\r\ni=rtsp-server\r\nt=0 0\r\na=tool:GStreamer\r\na=type:broadcast\r\na=control:*\r\na=range:npt=now-\r\nm=video 0 RTP/AVP 96\r\nc=IN IP4 0.0.0.0\r\na=rtpmap:96 H264/90000\r\na=fmtp:96 packetization-mode=1;profile-level-id=42c01f\r\na=control:stream=0\r\nm=audio 0 RTP/AVP 97\r\nc=IN IP4 0.0.0.0\r\na=rtpmap:97 OPUS/48000/2\r\na=control:stream=1\r\n";

    #[test]
    fn tracks_controls_and_clocks() {
        let p = Presentation::parse(GST.as_bytes()).unwrap();
        assert_eq!(p.tracks.len(), 2);
        assert_eq!((p.tracks[0].kind.as_str(), p.tracks[0].clock_rate, p.tracks[0].control.as_deref()), ("video", Some(90000), Some("stream=0")));
        assert_eq!((p.tracks[1].kind.as_str(), p.tracks[1].clock_rate), ("audio", Some(48000)));
        let base = url::Url::parse("rtsp://127.0.0.1:8554/cam").unwrap();
        assert_eq!(control_url(&base, p.tracks[1].control.as_deref()).unwrap().as_str(), "rtsp://127.0.0.1:8554/cam/stream=1");
        let abs = control_url(&base, Some("rtsp://10.0.0.1/x/track1")).unwrap();
        assert_eq!(abs.as_str(), "rtsp://10.0.0.1/x/track1");
        let query = url::Url::parse("rtsp://cam/cam/realmonitor?channel=1&subtype=0/").unwrap();
        assert_eq!(control_url(&query, Some("trackID=0")).unwrap().as_str(), "rtsp://cam/cam/realmonitor?channel=1&subtype=0/trackID=0");
    }

    #[test]
    fn what_viewers_are_served_names_our_tracks_and_parses_again() {
        let p = Presentation::parse(GST.as_bytes()).unwrap();
        let served = p.served("192.0.2.1".parse().unwrap(), 7);
        assert!(served.contains("a=control:trackID=1\r\n"), "{served}");
        assert!(!served.contains("stream=0"), "{served}");
        assert!(served.contains("a=fmtp:96 packetization-mode=1"), "{served}");
        let again = Presentation::parse(served.as_bytes()).unwrap();
        assert_eq!(again.tracks.iter().map(|t| t.control.clone()).collect::<Vec<_>>(), vec![Some("trackID=0".into()), Some("trackID=1".into())]);
        assert_eq!(again.tracks[0].clock_rate, Some(90000));
    }

    #[test]
    fn each_tracks_format_and_ssrc_for_browsers() {
        let sdp = GST.replace("a=control:stream=0\r\n", "a=control:stream=0\r\na=ssrc:1718335435 cname:u@h\r\n");
        let p = Presentation::parse(sdp.as_bytes()).unwrap();
        let v = &p.tracks[0];
        assert_eq!(
            (v.rtpmap().as_deref(), v.fmtp().as_deref(), v.ssrc()),
            (Some("H264/90000"), Some("packetization-mode=1;profile-level-id=42c01f"), Some(1718335435))
        );
        assert_eq!((p.tracks[1].rtpmap().as_deref(), p.tracks[1].fmtp(), p.tracks[1].ssrc()), (Some("OPUS/48000/2"), None, None));
        let pcmu = Presentation::parse(b"v=0\r\nm=audio 0 RTP/AVP 0\r\na=ssrc:1 cname:a\r\na=ssrc:2 cname:b\r\n").unwrap();
        assert_eq!((pcmu.tracks[0].rtpmap().as_deref(), pcmu.tracks[0].ssrc()), (Some("PCMU/8000"), None), "two SSRCs name none");
    }

    #[test]
    fn refusals() {
        assert_eq!(Presentation::parse(b"hello"), Err(DescribeError::NotSdp));
        assert_eq!(Presentation::parse(b"v=0\r\ns=x\r\n"), Err(DescribeError::NoMedia));
        assert!(matches!(Presentation::parse(b"v=0\r\nm=video 0 RTP/AVP 300\r\n"), Err(DescribeError::BadMedia(_))));
        let many = "v=0\r\n".to_string() + &"m=audio 0 RTP/AVP 0\r\n".repeat(MAX_TRACKS + 1);
        assert_eq!(Presentation::parse(many.as_bytes()), Err(DescribeError::TooManyTracks));
    }
}
