//! Call control: rtpengine's `block media` / `unblock media`, `silence media` /
//! `unsilence media` and `block DTMF` / `unblock DTMF`, on the model's relays
//! ([`mediaplane_core::model::MediaControl`]). What a request selects is decided here; the
//! pipeline does the per-packet work (on the eBPF plane such a relay goes to the slow path).
//!
//! As rtpengine has it: with only `call-id` the whole call (both directions); with a
//! participant (`from-tag`, or `address`: every party whose SDP media address it is) what that
//! party sends. Unblocking the whole call leaves what was blocked per participant blocked,
//! unless `all` is given. DTMF events (the `telephone-event` payload types of the call's SDPs)
//! still pass when media is blocked; RTCP is never touched.

use crate::calls::{other, Call};
use crate::protocol::{normalize, Request};
use mediaplane_core::model::{MediaControl, Side};

/// Which of a direction's controls a command sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    Media,
    Silence,
    Dtmf,
}

/// A call-control command: the control and whether it is turned on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Command {
    pub control: Control,
    pub on: bool,
}

impl Command {
    /// The command of an NG `command` value, in any of rtpengine's spellings.
    pub fn parse(command: &str) -> Option<Command> {
        let (control, on) = match normalize(command).as_str() {
            "block-media" => (Control::Media, true),
            "unblock-media" => (Control::Media, false),
            "silence-media" => (Control::Silence, true),
            "unsilence-media" => (Control::Silence, false),
            "block-dtmf" => (Control::Dtmf, true),
            "unblock-dtmf" => (Control::Dtmf, false),
            _ => return None,
        };
        Some(Command { control, on })
    }

    /// `control` with this command applied.
    pub fn apply(self, mut control: MediaControl) -> MediaControl {
        let slot = match self.control {
            Control::Media => &mut control.block_media,
            Control::Silence => &mut control.silence_media,
            Control::Dtmf => &mut control.block_dtmf,
        };
        *slot = self.on;
        control
    }
}

/// What a request selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The whole call; `and_participants`: unblocking also ends what was set per participant
    /// (the `all` flag).
    Call { and_participants: bool },
    /// What these parties send.
    Participants(Vec<Side>),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    #[error("from-tag {0:?} is not part of the call")]
    UnknownTag(String),
    #[error("to-tag {to:?} is not in dialogue with from-tag {from:?}: mediaplane forks no media (subscriptions), a call has one flow each way")]
    NoSuchFlow { from: String, to: String },
    #[error("a to-tag or to-label selects a flow from a participant: give its from-tag too")]
    FlowWithoutSource,
    #[error("no party of the call has the SDP media address {0}")]
    UnknownAddress(String),
    #[error("{0:?} is not an IP address")]
    BadAddress(String),
    #[error("no party of the call is labelled {0:?}")]
    UnknownLabel(String),
    #[error("to-label {to:?} does not name the other party of the one selected")]
    NoSuchLabelledFlow { to: String },
    #[error("all={0:?} selects only media flows made by subscriptions, which mediaplane does not make")]
    NoSubscriptions(String),
    #[error("unknown all={0:?} (all, none, offer-answer, except-offer-answer or flows)")]
    BadAll(String),
    #[error("DTMF-security={0:?} is not supported: blocked DTMF events are dropped (drop)")]
    DtmfSecurity(String),
    #[error("{0}")]
    Request(#[from] crate::protocol::RequestError),
}

/// What `req` selects of `call`, for `command`.
pub fn select(call: &Call, req: &Request, command: Command) -> Result<Target, SelectError> {
    if command.control == Control::Dtmf && command.on {
        match req.opt_str("dtmf-security")?.map(normalize).as_deref() {
            None | Some("drop") => {}
            Some(other) => return Err(SelectError::DtmfSecurity(other.to_string())),
        }
    }
    let flag_all = req.list("flags")?.iter().any(|f| normalize(f) == "all");
    let all = match req.opt_str("all")?.map(normalize) {
        Some(a) if a == "except-offer-answer" => return Err(SelectError::NoSubscriptions(a)),
        Some(a) if matches!(a.as_str(), "all" | "none" | "offer-answer" | "flows") => Some(a),
        Some(a) => return Err(SelectError::BadAll(a)),
        None => None,
    };
    let all = flag_all || all.as_deref() == Some("all");
    Ok(match participants(call, req)? {
        Some(sides) => Target::Participants(sides),
        None => Target::Call { and_participants: all },
    })
}

/// The participants a request names (`from-tag`, with a `to-tag` naming the other party, or
/// `address`: every party whose SDP media address it is); None when it names none.
pub fn participants(call: &Call, req: &Request) -> Result<Option<Vec<Side>>, SelectError> {
    let to_tag = req.opt_nonempty("to-tag")?;
    let to_label = req.opt_nonempty("to-label")?;
    let from = match (req.opt_nonempty("from-tag")?, req.opt_nonempty("label")?.or(req.opt_nonempty("from-label")?)) {
        (Some(tag), _) => Some(call.side_of(tag).ok_or_else(|| SelectError::UnknownTag(tag.to_string()))?),
        (None, Some(label)) => Some(call.side_labelled(label).ok_or_else(|| SelectError::UnknownLabel(label.to_string()))?),
        (None, None) => None,
    };
    if let Some(side) = from {
        if let Some(to) = to_tag {
            if call.side_of(to) != Some(other(side)) {
                return Err(SelectError::NoSuchFlow { from: call_tag(call, side), to: to.to_string() });
            }
        }
        if let Some(to) = to_label {
            if call.side_labelled(to) != Some(other(side)) {
                return Err(SelectError::NoSuchLabelledFlow { to: to.to_string() });
            }
        }
        return Ok(Some(vec![side]));
    }
    if to_tag.is_some() || to_label.is_some() {
        return Err(SelectError::FlowWithoutSource);
    }
    if let Some(address) = req.opt_nonempty("address")? {
        let ip: std::net::IpAddr = address.parse().map_err(|_| SelectError::BadAddress(address.to_string()))?;
        let sides: Vec<Side> =
            [Side::A, Side::B].into_iter().filter(|s| call.media.iter().any(|m| m.peer[crate::calls::side_index(*s)].is_some_and(|a| a.ip() == ip))).collect();
        if sides.is_empty() {
            return Err(SelectError::UnknownAddress(address.to_string()));
        }
        return Ok(Some(sides));
    }
    Ok(None)
}

/// What a `play DTMF` request asks for, checked, with rtpengine's defaults and bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DtmfRequest {
    pub code: u8,
    pub duration_ms: u32,
    /// Attenuation in dB (RFC 4733's volume).
    pub volume: u8,
    pub pause_ms: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DtmfError {
    #[error("play DTMF needs code (or digit): 0-15, or one of 0-9 * # A-D")]
    NoCode,
    #[error("code {0:?} is not a DTMF event: 0-15, or one of 0-9 * # A-D")]
    BadCode(String),
    #[error("{0} must be an integer")]
    NotInteger(&'static str),
}

impl DtmfRequest {
    pub fn parse(req: &Request) -> Result<DtmfRequest, DtmfError> {
        let raw = req.get("code").or_else(|| req.get("digit")).ok_or(DtmfError::NoCode)?;
        let code = match (raw.as_int(), raw.as_str()) {
            (Some(n), _) => u8::try_from(n).ok().filter(|n| *n <= 15).ok_or_else(|| DtmfError::BadCode(n.to_string()))?,
            (None, Some(s)) => event_code(s).ok_or_else(|| DtmfError::BadCode(s.to_string()))?,
            _ => return Err(DtmfError::NoCode),
        };
        let int = |key: &'static str| req.int(key).map_err(|_| DtmfError::NotInteger(key));
        // rtpengine's defaults and bounds: 250 ms (100-5000), -8 dB (a positive volume is the
        // same attenuation), a pause of 100 ms (100-5000).
        let duration_ms = int("duration")?.unwrap_or(250).clamp(100, 5000) as u32;
        let volume = int("volume")?.unwrap_or(-8).unsigned_abs().min(63) as u8;
        let pause_ms = int("pause")?.unwrap_or(100).clamp(100, 5000) as u32;
        Ok(DtmfRequest { code, duration_ms, volume, pause_ms })
    }
}

fn call_tag(call: &Call, side: Side) -> String {
    if side == Side::A { call.tag_a.clone() } else { call.tag_b.clone() }.unwrap_or_default()
}

/// RFC 4733's event code of a DTMF character.
fn event_code(s: &str) -> Option<u8> {
    let mut chars = s.chars();
    let c = chars.next()?;
    if chars.next().is_some() {
        return None;
    }
    Some(match c.to_ascii_uppercase() {
        d @ '0'..='9' => d as u8 - b'0',
        '*' => 10,
        '#' => 11,
        l @ 'A'..='D' => 12 + (l as u8 - b'A'),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bencode::Value;
    use std::time::Instant;

    fn call() -> Call {
        let mut c = Call::new("c1", Instant::now());
        c.tag_a = Some("alice".into());
        c.tag_b = Some("bob".into());
        c.labels[0] = Some("caller".into());
        c.media.push(crate::calls::media_between("192.0.2.1:4000".parse().unwrap(), "192.0.2.2:5000".parse().unwrap()));
        c
    }

    fn select_with(pairs: Vec<(&str, Value)>, command: &str) -> Result<Target, SelectError> {
        let mut pairs = pairs;
        pairs.push(("call-id", "c1".into()));
        let dict = Value::dict(pairs);
        select(&call(), &Request::new(&dict), Command::parse(command).unwrap())
    }

    #[test]
    fn every_spelling_of_the_commands_parses() {
        assert_eq!(Command::parse("block media"), Some(Command { control: Control::Media, on: true }));
        assert_eq!(Command::parse("unblock_DTMF"), Some(Command { control: Control::Dtmf, on: false }));
        assert_eq!(Command::parse("Silence-Media"), Some(Command { control: Control::Silence, on: true }));
        assert_eq!(Command::parse("block"), None);
        let c = Command::parse("block DTMF").unwrap().apply(MediaControl { block_media: true, ..Default::default() });
        assert_eq!(c, MediaControl { block_media: true, block_dtmf: true, ..Default::default() });
    }

    #[test]
    fn participants_are_selected_by_tag_or_address_and_the_call_by_neither() {
        assert_eq!(select_with(vec![], "block media"), Ok(Target::Call { and_participants: false }));
        assert_eq!(select_with(vec![("flags", Value::List(vec!["all".into()]))], "unblock media"), Ok(Target::Call { and_participants: true }));
        assert_eq!(select_with(vec![("all", "all".into())], "unblock media"), Ok(Target::Call { and_participants: true }));
        assert_eq!(select_with(vec![("from-tag", "bob".into())], "block media"), Ok(Target::Participants(vec![Side::B])));
        assert_eq!(select_with(vec![("from-tag", "alice".into()), ("to-tag", "bob".into())], "block media"), Ok(Target::Participants(vec![Side::A])));
        assert_eq!(select_with(vec![("address", "192.0.2.2".into())], "block DTMF"), Ok(Target::Participants(vec![Side::B])));
        assert_eq!(select_with(vec![("label", "caller".into())], "block media"), Ok(Target::Participants(vec![Side::A])));
        assert_eq!(select_with(vec![("from-label", "caller".into())], "block media"), Ok(Target::Participants(vec![Side::A])));
    }

    #[test]
    fn what_cannot_be_honoured_is_an_error() {
        let err = |pairs, command| select_with(pairs, command).unwrap_err();
        assert_eq!(err(vec![("from-tag", "carol".into())], "block media"), SelectError::UnknownTag("carol".into()));
        assert!(matches!(err(vec![("from-tag", "alice".into()), ("to-tag", "alice".into())], "block media"), SelectError::NoSuchFlow { .. }));
        assert_eq!(err(vec![("to-tag", "bob".into())], "block media"), SelectError::FlowWithoutSource);
        assert_eq!(err(vec![("address", "192.0.2.9".into())], "block media"), SelectError::UnknownAddress("192.0.2.9".into()));
        assert_eq!(err(vec![("label", "callee".into())], "block media"), SelectError::UnknownLabel("callee".into()));
        assert_eq!(
            err(vec![("label", "caller".into()), ("to-label", "caller".into())], "block media"),
            SelectError::NoSuchLabelledFlow { to: "caller".into() }
        );
        assert_eq!(err(vec![("all", "except-offer-answer".into())], "block media"), SelectError::NoSubscriptions("except-offer-answer".into()));
        assert_eq!(err(vec![("DTMF-security", "random".into())], "block DTMF"), SelectError::DtmfSecurity("random".into()));
        // Unblocking takes no mode.
        assert!(select_with(vec![("DTMF-security", "random".into())], "unblock DTMF").is_ok());
    }

    #[test]
    fn play_dtmf_takes_rtpengines_codes_defaults_and_bounds() {
        let parse = |pairs: Vec<(&str, Value)>| DtmfRequest::parse(&Request::new(&Value::dict(pairs)));
        assert_eq!(parse(vec![("code", "5".into())]), Ok(DtmfRequest { code: 5, duration_ms: 250, volume: 8, pause_ms: 100 }));
        let clamped = parse(vec![("digit", "#".into()), ("duration", Value::Int(50)), ("volume", Value::Int(10)), ("pause", Value::Int(9000))]);
        assert_eq!(clamped, Ok(DtmfRequest { code: 11, duration_ms: 100, volume: 10, pause_ms: 5000 }));
        assert_eq!(parse(vec![("code", Value::Int(15))]).map(|d| d.code), Ok(15));
        assert_eq!(parse(vec![("code", "d".into())]).map(|d| d.code), Ok(15));
        assert_eq!(parse(vec![("code", Value::Int(16))]), Err(DtmfError::BadCode("16".into())));
        assert_eq!(parse(vec![("code", "55".into())]), Err(DtmfError::BadCode("55".into())));
        assert_eq!(parse(vec![]), Err(DtmfError::NoCode));
    }
}
