//! `subscribe request`, `subscribe answer` and `unsubscribe`: a third party (call monitoring,
//! a SIPREC recorder) receives a copy of what one or both parties of a call send, as rtpengine
//! 10.5 has it. Each subscribed party's media section becomes a [`Fork`] of its relay (one more
//! copy; in the kernel on the eBPF plane) leaving from an address of its own; the request's
//! reply offers these sections `sendonly` with the party's formats, the subscriber's answer
//! says where they go. A subscription is named by its `to-tag` (given, or made here); a new
//! request with the same `to-tag` replaces it.
//!
//! The subscriber gets what the relay has in clear: RTP/AVP, also of a party whose SDES or
//! DTLS-SRTP the relay terminates. A party whose SRTP passes through the relay untouched cannot
//! be subscribed to (the copies would be ciphertext without a key): an error.

use crate::calls::{other, rtcp_relay_id, rtp_relay_id, side_index, Call};
use crate::protocol::{normalize, Request};
use crate::sdp::FormatDescription;
use mediaplane_core::model::{Fork, Side};
use std::net::{IpAddr, SocketAddr};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubscribeError {
    #[error("subscribe request selects no party: give from-tag, from-tags or all")]
    NoParty,
    #[error("from-tag {0:?} is not part of the call")]
    UnknownTag(String),
    #[error("to-tag {0:?} names a party of the call, not a subscription")]
    PartyTag(String),
    #[error("the call has no media section to subscribe to")]
    NoMedia,
    #[error("media section {section} of {tag:?}: its SDP is not known (it sent no offer or answer yet, or the call was adopted after a restart and it has not signalled since)")]
    UnknownFormats { tag: String, section: usize },
    #[error("media section {section} of {tag:?} is SRTP the relay passes through without its key: a subscriber could not decrypt it")]
    PassThroughSrtp { tag: String, section: usize },
    #[error("no subscription with to-tag {0:?}")]
    UnknownSubscription(String),
    #[error("the answer has {got} media sections, the subscription offered {want}")]
    TooFewSections { got: usize, want: usize },
    #[error("{0}")]
    Request(#[from] crate::protocol::RequestError),
}

/// The parties a `subscribe request` selects, in order: `from-tag`, the `from-tags` list (or
/// flags `from-tags-<tag>`), or both with `all`.
pub fn parties(call: &Call, req: &Request) -> Result<Vec<Side>, SubscribeError> {
    let flags = req.list("flags")?;
    let all = flags.iter().any(|f| normalize(f) == "all") || req.opt_str("all")?.is_some_and(|a| normalize(a) == "all");
    let mut tags: Vec<String> = req.opt_nonempty("from-tag")?.map(str::to_string).into_iter().collect();
    if req.get("from-tags").is_some() {
        tags.extend(req.list("from-tags")?);
    }
    tags.extend(flags.iter().filter_map(|f| f.strip_prefix("from-tags-")).map(str::to_string));
    if all {
        return Ok(vec![Side::A, Side::B]);
    }
    let mut sides = Vec::new();
    for t in tags {
        let side = call.side_of(&t).ok_or(SubscribeError::UnknownTag(t))?;
        if !sides.contains(&side) {
            sides.push(side);
        }
    }
    if sides.is_empty() {
        return Err(SubscribeError::NoParty);
    }
    Ok(sides)
}

/// One section of a subscription: whose, which of the call's sections, and its formats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    pub of: Side,
    pub media: usize,
    pub kind: String,
    pub formats: FormatDescription,
    /// The section has RTCP of its own (not multiplexed): it is forked too, one port up.
    pub rtcp: bool,
    /// The interface address the party's media leaves the relay from (toward the other party).
    pub ip: IpAddr,
}

/// The sections a subscription to `parties` has, in its SDP's order.
pub fn sections(call: &Call, parties: &[Side]) -> Result<Vec<Section>, SubscribeError> {
    let tag = |s: Side| if s == Side::A { call.tag_a.clone() } else { call.tag_b.clone() }.unwrap_or_default();
    let mut out = Vec::new();
    for &of in parties {
        for (i, m) in call.media.iter().enumerate().filter(|(_, m)| m.active) {
            let x = side_index(of);
            let passes_srtp = m.proto_of[x].as_deref().is_some_and(|p| p.contains("SAVP")) && m.sdes[x].is_none() && m.webrtc[x].is_none();
            if passes_srtp {
                return Err(SubscribeError::PassThroughSrtp { tag: tag(of), section: i + 1 });
            }
            let formats = m.formats_of[x].clone().ok_or_else(|| SubscribeError::UnknownFormats { tag: tag(of), section: i + 1 })?;
            out.push(Section { of, media: i, kind: m.kind.clone(), formats, rtcp: m.rtcp, ip: m.local_of(other(of)).ip() });
        }
    }
    if out.is_empty() {
        return Err(SubscribeError::NoMedia);
    }
    Ok(out)
}

/// The forks of one section (RTP, and RTCP one port up when it has its own), by relay id.
pub fn forks(call: &Call, tag: &str, position: usize, s: &Section, local: SocketAddr) -> Vec<(String, Fork)> {
    let fork = |local| Fork { uid: 0, tag: tag.to_string(), of: s.of, position: position as u16, local, remote: None };
    let mut v = vec![(rtp_relay_id(&call.key, s.media), fork(local))];
    if s.rtcp {
        v.push((rtcp_relay_id(&call.key, s.media), fork(SocketAddr::new(local.ip(), local.port() + 1))));
    }
    v
}

/// The subscription's offer: each section `sendonly` at its address (`advertised`: what the
/// section's interface advertises), with the party's formats.
pub fn offer_sdp(session: u64, sections: &[(Section, SocketAddr)]) -> String {
    let family = |ip: IpAddr| if ip.is_ipv4() { "IP4" } else { "IP6" };
    let first = sections.first().map_or(IpAddr::from([0, 0, 0, 0]), |(_, a)| a.ip());
    let mut sdp = format!("v=0\r\no=- {session} {session} IN {} {first}\r\ns=mediaplane\r\nt=0 0\r\n", family(first));
    for (s, at) in sections {
        let pts: Vec<String> = s.formats.payload_types.iter().map(u8::to_string).collect();
        sdp += &format!("m={} {} RTP/AVP {}\r\nc=IN {} {}\r\n", s.kind, at.port(), pts.join(" "), family(at.ip()), at.ip());
        for a in &s.formats.attrs {
            sdp += &format!("a={a}\r\n");
        }
        sdp += "a=sendonly\r\n";
        if s.rtcp {
            sdp += &format!("a=rtcp:{}\r\n", at.port() + 1);
        }
    }
    sdp
}

/// A subscription tag made here: 32 hex digits.
pub fn new_tag() -> String {
    let mut b = [0u8; 16];
    getrandom::getrandom(&mut b).expect("the OS random source");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bencode::Value;
    use std::time::Instant;

    fn call() -> Call {
        let mut c = Call::new("c1", Instant::now());
        c.key = "k".into();
        c.tag_a = Some("alice".into());
        c.tag_b = Some("bob".into());
        let mut m = crate::calls::media_between("192.0.2.1:4000".parse().unwrap(), "192.0.2.2:5000".parse().unwrap());
        m.local = ["203.0.113.1:30000".parse().unwrap(), "203.0.113.2:30002".parse().unwrap()];
        m.rtcp = true;
        let pcma = FormatDescription { payload_types: vec![8, 101], attrs: vec!["rtpmap:8 PCMA/8000".into(), "rtpmap:101 telephone-event/8000".into()] };
        m.formats_of = [Some(pcma.clone()), Some(FormatDescription { payload_types: vec![0], attrs: vec![] })];
        c.media.push(m);
        c
    }

    fn parties_of(pairs: Vec<(&str, Value)>) -> Result<Vec<Side>, SubscribeError> {
        let dict = Value::dict(pairs);
        parties(&call(), &Request::new(&dict))
    }

    #[test]
    fn parties_by_tag_tags_or_all() {
        assert_eq!(parties_of(vec![("from-tag", "bob".into())]), Ok(vec![Side::B]));
        assert_eq!(parties_of(vec![("from-tags", Value::List(vec!["bob".into(), "alice".into()]))]), Ok(vec![Side::B, Side::A]));
        assert_eq!(parties_of(vec![("flags", Value::List(vec!["from-tags-alice".into()]))]), Ok(vec![Side::A]));
        assert_eq!(parties_of(vec![("flags", Value::List(vec!["all".into()]))]), Ok(vec![Side::A, Side::B]));
        assert_eq!(parties_of(vec![]), Err(SubscribeError::NoParty));
        assert_eq!(parties_of(vec![("from-tag", "carol".into())]), Err(SubscribeError::UnknownTag("carol".into())));
    }

    #[test]
    fn a_subscription_offers_each_partys_sections_sendonly_with_its_formats() {
        let c = call();
        let secs = sections(&c, &[Side::A, Side::B]).unwrap();
        // A's media leaves toward B from B's leg: its interface.
        assert_eq!((secs[0].of, secs[0].ip, secs[1].ip), (Side::A, "203.0.113.2".parse().unwrap(), "203.0.113.1".parse().unwrap()));
        let at = |p| SocketAddr::new("198.51.100.9".parse().unwrap(), p);
        let sdp = offer_sdp(7, &[(secs[0].clone(), at(40000)), (secs[1].clone(), at(40002))]);
        assert_eq!(
            sdp,
            "v=0\r\no=- 7 7 IN IP4 198.51.100.9\r\ns=mediaplane\r\nt=0 0\r\n\
             m=audio 40000 RTP/AVP 8 101\r\nc=IN IP4 198.51.100.9\r\na=rtpmap:8 PCMA/8000\r\na=rtpmap:101 telephone-event/8000\r\na=sendonly\r\na=rtcp:40001\r\n\
             m=audio 40002 RTP/AVP 0\r\nc=IN IP4 198.51.100.9\r\na=sendonly\r\na=rtcp:40003\r\n"
        );
        let f = forks(&c, "mon", 1, &secs[1], at(40002));
        assert_eq!(f.len(), 2);
        assert_eq!((f[0].1.of, f[0].1.position, f[1].1.local), (Side::B, 1, at(40003)));
        assert_eq!(new_tag().len(), 32);
    }

    #[test]
    fn srtp_the_relay_does_not_terminate_and_unknown_formats_are_errors() {
        let mut c = call();
        c.media[0].proto_of[1] = Some("RTP/SAVP".into());
        assert_eq!(sections(&c, &[Side::B]), Err(SubscribeError::PassThroughSrtp { tag: "bob".into(), section: 1 }));
        assert!(sections(&c, &[Side::A]).is_ok());
        c.media[0].formats_of[0] = None;
        assert!(matches!(sections(&c, &[Side::A]), Err(SubscribeError::UnknownFormats { .. })));
    }
}
