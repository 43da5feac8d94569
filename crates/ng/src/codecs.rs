//! Codec filtering of offers and answers, as rtpengine does it without transcoding: the NG flags
//! `codec-strip-…`, `codec-mask-…`, `codec-except-…`, `codec-offer-…` and the `codec` dictionary
//! (`strip`, `mask`, `except`, `offer`) narrow an SDP's list of payload types. Media is never
//! touched: a party that still sends a removed codec is relayed as sent (rtpengine 10.5 relays it
//! too).
//!
//! What rtpengine 10.5 does, and this module with it:
//! * `strip` names codecs to remove, case-insensitively, as `name`, `name/clock` or
//!   `name/clock/channels` (channels default to 1: `opus/48000` is not `opus/48000/2`); a static
//!   payload type listed without `a=rtpmap` is known by RFC 3551's name (0 PCMU, 8 PCMA, 9 G722,
//!   18 G729, ...). `all` removes every codec but those named by `except` or `offer`.
//! * `except` and `offer` only protect codecs from `all` (alone they change nothing; a codec
//!   stripped by name stays stripped). Those kept by `except` keep their order; those kept by
//!   `offer` follow them, in the order `offer` lists them.
//! * `mask` is `strip` (its difference, accepting the codec for transcoding, needs transcoding);
//!   as in rtpengine it is read in offers only.
//! * A telephone-event or comfort noise (CN) format whose clock rate no remaining codec has goes
//!   too.
//! * If no codec would remain (telephone-event and CN alone are not one), the section's list is
//!   left unchanged, with a warning (rtpengine leaves it unchanged in silence, or emits an empty
//!   format list when only telephone-event remained).
//! * What an offer removed is removed from the answer to it as well (an answerer that answers
//!   with a codec it was not offered).
//!
//! Deviation: rtpengine's documentation lets `strip` name a payload type number, 10.5 does not
//! act on it; here `codec-strip-8` strips payload type 8.

use crate::bencode::Value;
use crate::protocol::{normalize, Request, RequestError};
use crate::sdp::{Codec, Format};

/// What a `strip`/`mask`/`except`/`offer` entry names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CodecSpec {
    All,
    Pt(u8),
    /// `name[/clock[/channels]]`, name lower-cased.
    Named {
        name: String,
        clock: Option<u32>,
        channels: Option<u16>,
    },
}

impl CodecSpec {
    /// `all`, a payload type number, or `name[/clock[/channels]]`.
    pub fn parse(s: &str) -> Result<CodecSpec, String> {
        if s.eq_ignore_ascii_case("all") || s.eq_ignore_ascii_case("full") {
            return Ok(CodecSpec::All);
        }
        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            return s.parse::<u8>().ok().filter(|&pt| pt < 128).map(CodecSpec::Pt).ok_or_else(|| format!("{s:?} is not a payload type (0-127)"));
        }
        let mut parts = s.split('/');
        let name = parts.next().filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_graphic())).ok_or_else(|| format!("{s:?} names no codec"))?;
        let clock = parts.next().map(|c| c.parse::<u32>().map_err(|_| format!("{s:?}: clock rate {c:?} is not a number"))).transpose()?;
        let channels =
            parts.next().map(|c| c.parse::<u16>().ok().filter(|&c| c > 0).ok_or_else(|| format!("{s:?}: channels {c:?} is not a number"))).transpose()?;
        if parts.next().is_some() {
            return Err(format!("{s:?}: only name[/clock[/channels]] is matched (bitrate and format parameters are for transcoding)"));
        }
        // As in rtpengine, a clock rate without channels means one channel.
        Ok(CodecSpec::Named { name: name.to_ascii_lowercase(), clock, channels: channels.or(clock.map(|_| 1)) })
    }

    /// The spec that removes exactly `f` from an answer: its codec, or its payload type.
    pub fn exact(f: &Format) -> CodecSpec {
        match &f.codec {
            Some(c) => CodecSpec::Named { name: c.name.to_ascii_lowercase(), clock: Some(c.clock), channels: Some(c.channels) },
            None => CodecSpec::Pt(f.pt),
        }
    }

    fn matches(&self, f: &Format) -> bool {
        match self {
            CodecSpec::All => true,
            CodecSpec::Pt(pt) => f.pt == *pt,
            CodecSpec::Named { name, clock, channels } => f
                .codec
                .as_ref()
                .is_some_and(|c| c.name.eq_ignore_ascii_case(name) && clock.is_none_or(|r| r == c.clock) && channels.is_none_or(|n| n == c.channels)),
        }
    }
}

/// The codec filter of one offer or answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CodecFilter {
    /// `strip` and (in offers) `mask`.
    pub strip: Vec<CodecSpec>,
    pub except: Vec<CodecSpec>,
    pub offer: Vec<CodecSpec>,
}

/// What a filter does to one media section's format list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Filtered {
    Unchanged,
    /// The payload types to advertise, in order, and the formats removed.
    Narrowed {
        keep: Vec<u8>,
        removed: Vec<Format>,
    },
    /// No codec would remain: left unchanged.
    Refused,
}

/// Formats that carry no media of their own: they need a codec of their clock rate.
fn supplementary(c: &Codec) -> bool {
    c.name.eq_ignore_ascii_case("telephone-event") || c.name.eq_ignore_ascii_case("CN")
}

/// The `codec-<op>-` flag prefixes and dictionary keys this relay acts on.
const ACTED: &[&str] = &["strip", "mask", "except", "offer"];
/// Those that need transcoding.
const TRANSCODING: &[&str] = &["transcode", "accept", "consume", "set", "ignore"];

impl CodecFilter {
    /// The filter of a request's flags and `codec` dictionary, with the entries it cannot act
    /// on as warnings. `offer`: `mask` counts (rtpengine ignores it in answers).
    pub fn from_request(req: &Request, offer: bool) -> Result<(CodecFilter, Vec<String>), RequestError> {
        let mut entries: Vec<(String, String, String)> = Vec::new();
        for flag in req.list("flags")? {
            for op in ACTED {
                if let Some(spec) = flag.strip_prefix("codec-").and_then(|r| r.strip_prefix(op)).and_then(|r| r.strip_prefix('-')) {
                    entries.push((op.to_string(), spec.to_string(), flag.clone()));
                }
            }
        }
        if let Some(dict) = req.get("codec") {
            let d = dict.as_dict().ok_or_else(|| RequestError::Invalid("codec", "must be a dictionary".into()))?;
            for (k, v) in d {
                let op = normalize(&String::from_utf8_lossy(k));
                if !ACTED.contains(&op.as_str()) {
                    continue;
                }
                let specs: Vec<&str> = match v {
                    Value::List(l) => l
                        .iter()
                        .map(|x| x.as_str().ok_or_else(|| RequestError::Invalid("codec", format!("{op} must be a list of strings"))))
                        .collect::<Result<_, _>>()?,
                    _ => vec![v.as_str().ok_or_else(|| RequestError::Invalid("codec", format!("{op} must be a list of strings")))?],
                };
                entries.extend(specs.into_iter().map(|s| (op.clone(), s.to_string(), format!("codec.{op}={s}"))));
            }
        }
        let mut f = CodecFilter::default();
        let mut warnings = Vec::new();
        for (op, spec, named) in entries {
            if op == "mask" && !offer {
                continue;
            }
            match CodecSpec::parse(&spec) {
                Ok(s) => match op.as_str() {
                    "strip" | "mask" => f.strip.push(s),
                    "except" => f.except.push(s),
                    _ => f.offer.push(s),
                },
                Err(why) => warnings.push(format!("{named} is not acted on: {why}")),
            }
        }
        Ok((f, warnings))
    }

    /// Strip `removed` too (what the offer removed, applied to its answer).
    pub fn and_strip(mut self, removed: &[CodecSpec]) -> CodecFilter {
        self.strip.extend_from_slice(removed);
        self
    }

    /// The format list of one section after filtering.
    pub fn apply(&self, formats: &[Format]) -> Filtered {
        if formats.is_empty() || self.strip.is_empty() {
            return Filtered::Unchanged;
        }
        let all = self.strip.contains(&CodecSpec::All);
        let by_name = |f: &Format| self.strip.iter().any(|s| *s != CodecSpec::All && s.matches(f));
        let offered = |f: &Format| self.offer.iter().any(|s| s.matches(f));
        let excepted = |f: &Format| self.except.iter().any(|s| s.matches(f));
        // Kept in place: not stripped, or protected from `all` by `except`; then those `offer`
        // protects, in its order.
        let mut keep: Vec<&Format> = formats.iter().filter(|f| !by_name(f) && (!all || (excepted(f) && !offered(f)))).collect();
        if all {
            for s in &self.offer {
                for f in formats.iter().filter(|f| s.matches(f) && !by_name(f)) {
                    if !keep.iter().any(|k| k.pt == f.pt) {
                        keep.push(f);
                    }
                }
            }
        }
        if keep.len() == formats.len() && keep.iter().zip(formats).all(|(k, f)| k.pt == f.pt) {
            return Filtered::Unchanged;
        }
        let primary_clocks: Vec<Option<u32>> =
            keep.iter().filter(|f| !f.codec.as_ref().is_some_and(supplementary)).map(|f| f.codec.as_ref().map(|c| c.clock)).collect();
        if primary_clocks.is_empty() {
            return Filtered::Refused;
        }
        keep.retain(|f| f.codec.as_ref().is_none_or(|c| !supplementary(c) || primary_clocks.contains(&Some(c.clock))));
        let removed = formats.iter().filter(|f| !keep.iter().any(|k| k.pt == f.pt)).cloned().collect();
        Filtered::Narrowed { keep: keep.iter().map(|f| f.pt).collect(), removed }
    }
}

/// True for a flag this relay acts on (`codec-strip-…`, `codec-mask-…`, `codec-except-…`,
/// `codec-offer-…`).
pub fn flag_acted_on(flag: &str) -> bool {
    ACTED.iter().any(|op| flag.strip_prefix("codec-").and_then(|r| r.strip_prefix(op)).is_some_and(|r| r.starts_with('-')))
}

/// Keys of a request's `codec` dictionary this relay does not act on (`codec.transcode`, ...),
/// for the warning.
pub fn dictionary_keys_not_acted_on(req: &Request) -> Vec<String> {
    let Some(d) = req.get("codec").and_then(Value::as_dict) else { return Vec::new() };
    d.keys().map(|k| normalize(&String::from_utf8_lossy(k))).filter(|k| !ACTED.contains(&k.as_str())).map(|k| format!("codec.{k}")).collect()
}

/// What happens instead of a codec flag (`codec-transcode-…`) or `codec` key (`codec.transcode`)
/// that needs transcoding.
pub fn consequence(name: &str) -> Option<&'static str> {
    let op = name.strip_prefix("codec-").or_else(|| name.strip_prefix("codec.")).map(|r| r.split('-').next().unwrap_or(r))?;
    TRANSCODING.contains(&op).then_some("no transcoding: the SDP's codecs are not added to or transcoded")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sdp::Sdp;

    const OFFER: &str = "v=0\r\nc=IN IP4 10.0.0.1\r\nm=audio 4000 RTP/AVP 0 8 9 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:8 PCMA/8000\r\na=rtpmap:9 G722/8000\r\na=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-16\r\n";

    fn formats(sdp: &str) -> Vec<Format> {
        Sdp::parse(sdp.as_bytes()).unwrap().media[0].formats.clone()
    }

    fn filter(strip: &[&str], except: &[&str], offer: &[&str]) -> CodecFilter {
        let specs = |l: &[&str]| l.iter().map(|s| CodecSpec::parse(s).unwrap()).collect();
        CodecFilter { strip: specs(strip), except: specs(except), offer: specs(offer) }
    }

    fn kept(f: &CodecFilter, sdp: &str) -> Option<Vec<u8>> {
        match f.apply(&formats(sdp)) {
            Filtered::Narrowed { keep, .. } => Some(keep),
            Filtered::Unchanged => None,
            Filtered::Refused => Some(vec![]),
        }
    }

    #[test]
    fn what_rtpengine_10_5_keeps() {
        // Each case was run against rtpengine 10.5 over NG (the offer above).
        // (strip, except, offer, the payload types kept: None unchanged, empty refused)
        type Case<'a> = (&'a [&'a str], &'a [&'a str], &'a [&'a str], Option<&'a [u8]>);
        let cases: &[Case] = &[
            (&["PCMA"], &[], &[], Some(&[0, 9, 101])),
            (&["pcma"], &[], &[], Some(&[0, 9, 101])),
            (&["PCMA/8000"], &[], &[], Some(&[0, 9, 101])),
            (&["PCMA/16000"], &[], &[], None),
            (&["PCMA/8000/1"], &[], &[], Some(&[0, 9, 101])),
            (&["all"], &[], &[], Some(&[])),
            (&["all"], &["PCMU"], &[], Some(&[0])),
            (&["all"], &["telephone-event", "PCMA"], &[], Some(&[8, 101])),
            (&["all"], &[], &["G722", "PCMU"], Some(&[9, 0])),
            (&["all"], &["PCMU"], &["G722"], Some(&[0, 9])),
            (&["PCMA"], &["PCMA"], &[], Some(&[0, 9, 101])),
            (&["PCMA"], &[], &["G722"], Some(&[0, 9, 101])),
            (&[], &["PCMU"], &[], None),
            (&["PCMU", "PCMA", "G722", "telephone-event"], &[], &[], Some(&[])),
            (&["PCMU", "PCMA", "G722"], &[], &[], Some(&[])),
            (&["telephone-event"], &[], &[], Some(&[0, 8, 9])),
            (&["G729"], &[], &[], None),
            // Not in rtpengine 10.5: a payload type number.
            (&["8"], &[], &[], Some(&[0, 9, 101])),
        ];
        for (strip, except, offer, want) in cases {
            let got = kept(&filter(strip, except, offer), OFFER);
            assert_eq!(got.as_deref(), *want, "strip {strip:?} except {except:?} offer {offer:?}");
        }
    }

    #[test]
    fn static_types_channels_and_orphaned_telephone_events() {
        let statics = "v=0\r\nm=audio 4000 RTP/AVP 0 8 18 9\r\n";
        assert_eq!(kept(&filter(&["G729", "PCMU"], &[], &[]), statics), Some(vec![8, 9]));
        let multi = "v=0\r\nm=audio 1 RTP/AVP 0 111 13 101 102\r\na=rtpmap:111 opus/48000/2\r\na=rtpmap:101 telephone-event/8000\r\na=rtpmap:102 telephone-event/48000\r\n";
        // rtpengine: opus/48000 means one channel, so it does not match opus/48000/2.
        assert_eq!(kept(&filter(&["opus/48000"], &[], &[]), multi), None);
        assert_eq!(kept(&filter(&["opus/48000/2"], &[], &[]), multi), Some(vec![0, 13, 101]));
        // Without an 8 kHz codec, CN/8000 and telephone-event/8000 go too.
        assert_eq!(kept(&filter(&["PCMU"], &[], &[]), multi), Some(vec![111, 102]));
        // A dynamic type without rtpmap is a codec of its own: kept unless stripped by number.
        let unknown = "v=0\r\nm=audio 1 RTP/AVP 96 0\r\n";
        assert_eq!(kept(&filter(&["PCMU"], &[], &[]), unknown), Some(vec![96]));
        assert_eq!(kept(&filter(&["96"], &[], &[]), unknown), Some(vec![0]));
        // Not RTP: nothing to filter.
        assert_eq!(kept(&filter(&["all"], &["x"], &[]), "v=0\r\nm=image 1 udptl t38\r\n"), None);
    }

    #[test]
    fn specs_that_cannot_be_matched_are_errors() {
        for bad in ["", "/8000", "opus/x", "opus/48000/0", "opus/48000/2/32000", "300", "PC MA"] {
            assert!(CodecSpec::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(CodecSpec::parse("ALL"), Ok(CodecSpec::All));
    }

    #[test]
    fn flags_and_the_codec_dictionary() {
        let dict = Value::dict([
            ("flags", Value::List(vec!["codec-strip-PCMA".into(), "codec-mask-G722".into(), "codec-transcode-G729".into(), "codec-strip-opus/1/2/3".into()])),
            ("codec", Value::dict([("except", Value::List(vec!["PCMU".into()])), ("strip", "all".into()), ("transcode", Value::List(vec!["G729".into()]))])),
        ]);
        let req = Request::new(&dict);
        let (f, warnings) = CodecFilter::from_request(&req, true).unwrap();
        assert_eq!(f.strip, vec![CodecSpec::parse("pcma").unwrap(), CodecSpec::parse("g722").unwrap(), CodecSpec::All]);
        assert_eq!(f.except, vec![CodecSpec::parse("pcmu").unwrap()]);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("codec-strip-opus/1/2/3 is not acted on"), "{warnings:?}");
        // In an answer, mask is not read (as in rtpengine).
        let (f, _) = CodecFilter::from_request(&req, false).unwrap();
        assert_eq!(f.strip, vec![CodecSpec::parse("pcma").unwrap(), CodecSpec::All]);
        assert_eq!(dictionary_keys_not_acted_on(&req), vec!["codec.transcode".to_string()]);
        assert!(flag_acted_on("codec-mask-g722") && !flag_acted_on("codec-transcode-g729") && !flag_acted_on("codec-stripx"));
        assert!(consequence("codec-transcode-g729").unwrap().contains("no transcoding"));
        let bad = Value::dict([("codec", Value::dict([("strip", Value::Int(3))]))]);
        assert!(CodecFilter::from_request(&Request::new(&bad), true).is_err());
    }

    #[test]
    fn what_an_offer_removed_goes_from_its_answer() {
        let (keep, removed) = match filter(&["PCMA"], &[], &[]).apply(&formats(OFFER)) {
            Filtered::Narrowed { keep, removed } => (keep, removed),
            other => panic!("{other:?}"),
        };
        assert_eq!(keep, vec![0, 9, 101]);
        let answer = "v=0\r\nm=audio 5000 RTP/AVP 8 0 101\r\na=rtpmap:101 telephone-event/8000\r\n";
        let removed: Vec<CodecSpec> = removed.iter().map(CodecSpec::exact).collect();
        assert_eq!(kept(&CodecFilter::default().and_strip(&removed), answer), Some(vec![0, 101]));
        // An answer of the removed codec alone is left as it is.
        assert_eq!(kept(&CodecFilter::default().and_strip(&removed), "v=0\r\nm=audio 5000 RTP/AVP 8\r\n"), Some(vec![]));
    }
}
