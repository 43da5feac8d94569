//! The `Transport` header (RFC 2326 §12.39): what a client asks for in SETUP and what the
//! server answers with. A client may list several choices, comma-separated, best first.

use std::fmt::Write as _;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lower {
    Udp,
    Tcp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportSpec {
    /// `RTP/AVP`, `RTP/SAVP`, `RTP/AVPF`...
    pub profile: String,
    pub lower: Lower,
    pub multicast: bool,
    pub client_port: Option<(u16, u16)>,
    pub server_port: Option<(u16, u16)>,
    pub interleaved: Option<(u8, u8)>,
    pub ssrc: Option<u32>,
    pub destination: Option<String>,
    /// Where the server's media comes from and goes to (RFC 2326 §12.39): its media address,
    /// when that is not the RTSP connection's (ffmpeg publishes to it).
    pub source: Option<String>,
    pub mode: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("unknown transport {0:?}")]
    Protocol(String),
    #[error("malformed parameter {0:?}")]
    Parameter(String),
}

impl TransportSpec {
    /// RTP/AVP over UDP, unicast, to these client ports.
    pub fn udp(client_port: (u16, u16)) -> TransportSpec {
        TransportSpec {
            profile: "RTP/AVP".into(),
            lower: Lower::Udp,
            multicast: false,
            client_port: Some(client_port),
            server_port: None,
            interleaved: None,
            ssrc: None,
            destination: None,
            source: None,
            mode: None,
        }
    }

    pub fn parse(spec: &str) -> Result<TransportSpec, TransportError> {
        let mut params = spec.split(';').map(str::trim);
        let proto = params.next().unwrap_or("");
        let mut parts = proto.split('/');
        let (a, b) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        if !a.eq_ignore_ascii_case("RTP") || !matches!(b.to_ascii_uppercase().as_str(), "AVP" | "SAVP" | "AVPF" | "SAVPF") {
            return Err(TransportError::Protocol(proto.chars().take(32).collect()));
        }
        let lower = match parts.next().map(|s| s.to_ascii_uppercase()) {
            None => Lower::Udp,
            Some(s) if s == "UDP" => Lower::Udp,
            Some(s) if s == "TCP" => Lower::Tcp,
            Some(_) => return Err(TransportError::Protocol(proto.chars().take(32).collect())),
        };
        let mut t = TransportSpec { profile: format!("{a}/{b}"), lower, ..TransportSpec::udp((0, 0)) };
        t.client_port = None;
        for p in params.filter(|p| !p.is_empty()) {
            let (k, v) = p.split_once('=').map(|(k, v)| (k.trim(), Some(v.trim()))).unwrap_or((p, None));
            let bad = || TransportError::Parameter(p.chars().take(48).collect());
            match (k.to_ascii_lowercase().as_str(), v) {
                ("unicast", None) => t.multicast = false,
                ("multicast", None) => t.multicast = true,
                ("client_port", Some(v)) => t.client_port = Some(range(v).ok_or_else(bad)?),
                ("server_port", Some(v)) => t.server_port = Some(range(v).ok_or_else(bad)?),
                ("interleaved", Some(v)) => {
                    let (a, b) = range(v).ok_or_else(bad)?;
                    t.interleaved = Some((u8::try_from(a).map_err(|_| bad())?, u8::try_from(b).map_err(|_| bad())?));
                }
                ("ssrc", Some(v)) => t.ssrc = Some(u32::from_str_radix(v, 16).map_err(|_| bad())?),
                ("destination", Some(v)) => t.destination = Some(v.to_string()),
                ("source", Some(v)) => t.source = Some(v.to_string()),
                ("mode", Some(v)) => t.mode = Some(v.trim_matches('"').to_ascii_uppercase()),
                // Parameters this server does not act on (ttl, layers, source, append...).
                _ => {}
            }
        }
        Ok(t)
    }

    /// Every choice a client listed, in its order; the ones that do not parse are skipped.
    pub fn parse_list(header: &str) -> Vec<TransportSpec> {
        header.split(',').filter_map(|s| TransportSpec::parse(s).ok()).take(16).collect()
    }

    pub fn to_header(&self) -> String {
        let mut s = self.profile.clone();
        if self.lower == Lower::Tcp {
            s.push_str("/TCP");
        }
        s.push_str(if self.multicast { ";multicast" } else { ";unicast" });
        if let Some(d) = &self.destination {
            let _ = write!(s, ";destination={d}");
        }
        if let Some(src) = &self.source {
            let _ = write!(s, ";source={src}");
        }
        if let Some((a, b)) = self.client_port {
            let _ = write!(s, ";client_port={a}-{b}");
        }
        if let Some((a, b)) = self.server_port {
            let _ = write!(s, ";server_port={a}-{b}");
        }
        if let Some((a, b)) = self.interleaved {
            let _ = write!(s, ";interleaved={a}-{b}");
        }
        if let Some(x) = self.ssrc {
            let _ = write!(s, ";ssrc={x:08X}");
        }
        if let Some(m) = &self.mode {
            let _ = write!(s, ";mode={m}");
        }
        s
    }
}

/// `a-b` or `a` (then `b` = `a` + 1: RTCP on the next port).
fn range(v: &str) -> Option<(u16, u16)> {
    match v.split_once('-') {
        Some((a, b)) => Some((a.trim().parse().ok()?, b.trim().parse().ok()?)),
        None => {
            let a: u16 = v.parse().ok()?;
            Some((a, a.checked_add(1)?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_ffmpeg_and_gstreamer_send() {
        let ff = TransportSpec::parse("RTP/AVP/UDP;unicast;client_port=22936-22937").unwrap();
        assert_eq!((ff.lower, ff.multicast, ff.client_port), (Lower::Udp, false, Some((22936, 22937))));
        let list = TransportSpec::parse_list("RTP/AVP;unicast;client_port=5000-5001,RTP/AVP/TCP;unicast;interleaved=0-1");
        assert_eq!(list.len(), 2);
        assert_eq!((list[1].lower, list[1].interleaved), (Lower::Tcp, Some((0, 1))));
        let m = TransportSpec::parse("RTP/AVP;multicast;destination=224.2.0.1;client_port=6000").unwrap();
        assert_eq!((m.multicast, m.client_port, m.destination.as_deref()), (true, Some((6000, 6001)), Some("224.2.0.1")));
    }

    #[test]
    fn the_answer_reads_back() {
        let mut t = TransportSpec::udp((5000, 5001));
        t.server_port = Some((30000, 30001));
        t.ssrc = Some(0xdeadbeef);
        t.source = Some("192.0.2.7".into());
        assert_eq!(t.to_header(), "RTP/AVP;unicast;source=192.0.2.7;client_port=5000-5001;server_port=30000-30001;ssrc=DEADBEEF");
        assert_eq!(TransportSpec::parse(&t.to_header()).unwrap(), t);
    }

    #[test]
    fn bad_choices_are_refused() {
        assert!(TransportSpec::parse("RAW/RAW/UDP;unicast").is_err());
        assert!(TransportSpec::parse("RTP/AVP;client_port=70000-70001").is_err());
        assert!(TransportSpec::parse("RTP/AVP/TCP;interleaved=300-301").is_err());
        assert!(TransportSpec::parse_list("x,y,z").is_empty());
    }
}
