//! The NG command handler: one datagram in, one datagram out, against a
//! [`SessionManager`]. No sockets and no timers here: the driver ([`crate::serve_ng`]) reads
//! datagrams and calls [`Engine::handle_datagram`], and calls [`Engine::expire`] every second.

use crate::bencode::Value;
use crate::call_control;
use crate::calls::{self, other, AddressPolicy, Call, MediaState, Phase, Placement, Registry, SignalOptions};
use crate::codecs::{self, CodecFilter, CodecSpec, Filtered};
use crate::protocol::{self, error_reply, normalize, ReplyCache, Request, RequestError};
use crate::recording::{self, Recordings};
use crate::sdes;
use crate::sdp::{MediaRewrite, Rewrite, Sdp, SdpError};
use crate::stats::{self as ngstats, CallView, Clock, ControlStats, StatisticsInput, Traffic, TrafficTotals};
use crate::subscribe;
use mediaplane_control::manager::{ManagerError, SessionManager};
use mediaplane_control::metrics::{CallEnd, NgMetrics};
use mediaplane_control::store::Change;
use mediaplane_core::model::{Follow, Side};
use mediaplane_core::Model;
use mediaplane_dataplane::{Counters, DataplaneStats};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// A call whose relays received nothing for this long is deleted.
    pub media_timeout: Duration,
    /// How long a reply is kept for retransmissions of its request.
    pub reply_ttl: Duration,
    pub reply_cache_entries: usize,
    /// This relay's mark in the SDP it produces with `loop-protect` (`a=rtpengine:<id>`).
    pub instance_id: String,
    /// The DTMF events of calls are reported ([`crate::dtmf_log`]): their relays say so.
    pub report_dtmf: bool,
    /// Where `start forwarding` sends a call's media (one more copy of each party's RTP);
    /// None: the command is an error.
    pub forward_to: Option<SocketAddr>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            media_timeout: Duration::from_secs(60),
            reply_ttl: Duration::from_secs(30),
            reply_cache_entries: 65_536,
            instance_id: generate_instance_id(),
            report_dtmf: false,
            forward_to: None,
        }
    }
}

/// The fork tag of `start forwarding`'s copies (reserved: no subscription may take it).
pub const FORWARDING_TAG: &str = "mediaplane-forwarding";

/// 12 random hex digits (from std's randomly keyed hasher), as rtpengine's instance ids.
pub fn generate_instance_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    format!("{:012x}", h.finish() & 0xffff_ffff_ffff)
}

#[derive(Debug, thiserror::Error)]
enum NgError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("invalid SDP: {0}")]
    Sdp(#[from] SdpError),
    #[error(transparent)]
    Signal(#[from] calls::SignalError),
    #[error(transparent)]
    Manager(#[from] ManagerError),
    #[error(transparent)]
    Sdes(#[from] sdes::SdesError),
    #[error(transparent)]
    Webrtc(#[from] crate::webrtc::WebrtcError),
    #[error("{0}")]
    Call(String),
}

/// Totals since start, for `statistics`: read from the metrics registry's counters.
#[derive(Debug, Default, Clone, Copy)]
pub struct Totals {
    pub managed: u64,
    pub deleted: u64,
    pub timed_out: u64,
    pub errors: u64,
}

pub struct Engine {
    cfg: EngineConfig,
    registry: Registry,
    cache: ReplyCache,
    metrics: NgMetrics,
    started: Instant,
    /// Where recorded calls go; None: `record-call` records nothing (and says so).
    recordings: Option<Recordings>,
    /// Per-command counts and times, per client (`statistics`).
    control: ControlStats,
    /// What ended calls relayed, and the sampled rates (`statistics`).
    traffic: TrafficTotals,
    /// The codec of each media section as last signalled, by call key (`query`).
    codecs: HashMap<String, Vec<Option<String>>>,
    /// The most calls held at once (`statistics`).
    peak_sessions: u64,
}

/// The flags and options of an offer or answer that this relay acts on.
struct Options {
    policy: AddressPolicy,
    leg: SignalOptions,
    replace_origin: bool,
    replace_session_connection: bool,
    /// Advertise the relay's address even for a party on hold (rtpengine's `zero address`).
    replace_zero_address: bool,
    ice: Option<String>,
    strip_mux: bool,
    /// The media interfaces facing the SDP's sender and its receiver (`direction`,
    /// `from-interface`, `to-interface`), and `address-family`.
    interfaces: [Option<String>; 2],
    out_v4: Option<bool>,
    /// `record-call` (`yes`/`on` or the flag; `no`/`off`).
    record: Option<bool>,
    /// Mark the SDP, and return an SDP this relay marked unchanged.
    loop_protect: bool,
    /// `transport-protocol` (or a flag naming one): what the offer's receiver is to speak.
    transport: Option<String>,
    /// The `SDES` list and `SDES-` flags.
    sdes: sdes::SdesOptions,
    /// `DTLS=passive|active`: the relay's end of DTLS toward a WebRTC party.
    dtls: crate::webrtc::DtlsOption,
    warnings: Vec<String>,
}

fn options(req: &Request) -> Result<Options, RequestError> {
    let flags = req.list("flags")?;
    let replace = req.list("replace")?;
    let mux = req.list("rtcp-mux")?;
    let has = |f: &str| flags.iter().any(|x| x == f);
    let mut warnings = Vec::new();
    for m in &mux {
        if matches!(m.as_str(), "offer" | "require") {
            warnings.push(format!("rtcp-mux {m} is not supported; rtcp-mux is passed through as offered"));
        }
    }
    let sip_source = (has("sip-source-address") || has("sip-source")) && !has("trust-address");
    // `direction`: the sender's interface, then the receiver's (an answer names them the other
    // way round from its offer); `from-interface`/`to-interface` say the same one at a time.
    let direction = req.names("direction")?;
    if direction.len() > 2 {
        return Err(RequestError::Invalid("direction", format!("names two interfaces (the sender's, the receiver's), not {}", direction.len())));
    }
    let pick = |key: &'static str, i: usize| -> Result<Option<String>, RequestError> {
        Ok(req.opt_nonempty(key)?.map(str::to_string).or_else(|| direction.get(i).cloned().filter(|d| !d.is_empty())))
    };
    let interfaces = [pick("from-interface", 0)?, pick("to-interface", 1)?];
    Ok(Options {
        policy: AddressPolicy { media_address: req.media_address()?, sip_source, received_from: req.received_from()? },
        leg: SignalOptions {
            // With both media-handover and strict-source, rtpengine hands over.
            follow: if has("asymmetric") {
                Follow::Asymmetric
            } else if has("media-handover") {
                Follow::Handover
            } else if has("strict-source") {
                Follow::Strict
            } else {
                Follow::Window
            },
            rtcp_demux: mux.iter().any(|m| m == "demux") || has("rtcp-mux-demux"),
            ..Default::default()
        },
        replace_origin: replace.iter().any(|r| r == "origin") || has("replace-origin"),
        replace_session_connection: replace.iter().any(|r| r == "session-connection") || has("replace-session-connection"),
        replace_zero_address: replace.iter().any(|r| r == "zero-address"),
        ice: req.opt_str("ICE")?.map(normalize),
        strip_mux: mux.iter().any(|m| m == "reject"),
        interfaces,
        out_v4: req.address_family()?,
        record: match req.opt_nonempty("record-call")?.map(normalize).as_deref() {
            Some("yes" | "on" | "true") => Some(true),
            Some("no" | "off" | "false") => Some(false),
            Some(v) => return Err(RequestError::Invalid("record-call", format!("{v:?} is not yes, no, on or off"))),
            None => has("record-call").then_some(true),
        },
        loop_protect: has("loop-protect"),
        transport: transport(req, &flags)?,
        dtls: match req.opt_nonempty("DTLS")?.map(normalize) {
            None => Default::default(),
            Some(v) => crate::webrtc::DtlsOption::parse(&v).unwrap_or_else(|| {
                warnings.push(format!("DTLS={v} is not acted on: toward a WebRTC party bridged to plain RTP, DTLS-SRTP is always terminated"));
                Default::default()
            }),
        },
        sdes: {
            let values = req.list("SDES")?;
            let (sdes, ignored) = sdes::SdesOptions::parse(values.iter().map(String::as_str).chain(flags.iter().filter_map(|f| f.strip_prefix("sdes-"))));
            // Flags not acted on are named by the general warning; the list's values here.
            let from_list: Vec<&String> = ignored.iter().filter(|v| values.contains(v)).collect();
            if !from_list.is_empty() {
                let names: Vec<&str> = from_list.iter().map(|v| v.as_str()).collect();
                warnings.push(format!("SDES options not supported (no DTLS, no SDES session parameters): {}", names.join(", ")));
            }
            sdes
        },
        warnings,
    })
}

/// `transport-protocol`, or the flag naming a protocol (Kamailio passes `RTP/AVP` as a flag); in
/// rtpengine's spelling.
fn transport(req: &Request, flags: &[String]) -> Result<Option<String>, RequestError> {
    let canonical = |v: &str| sdes::PROTOCOLS.iter().find(|p| p.eq_ignore_ascii_case(v)).map(|p| p.to_string());
    if let Some(v) = req.opt_nonempty("transport-protocol")? {
        return canonical(v)
            .map(Some)
            .ok_or_else(|| RequestError::Invalid("transport-protocol", format!("{v:?} is not one of {}", sdes::PROTOCOLS.join(", "))));
    }
    Ok(flags.iter().find_map(|f| canonical(f)))
}

/// Keys Kamailio's rtpengine module adds to every request, that change nothing asked of the
/// relay: what it supports (`load limit` replies, which mediaplane never sends), which SIP
/// message carried the request, and where from.
const INFORMATIONAL: &[&str] = &["supports", "sip-message-type", "sip-code", "via-branch", "received-from"];

/// The keys each command acts on (normalized spelling), besides `command`.
fn keys_acted_on(command: &str) -> &'static [&'static str] {
    match command {
        // via-branch (informational) tells rtpengine a forked branch's answers apart; here the
        // to-tag does.
        "offer" | "answer" => &[
            "call-id",
            "from-tag",
            "to-tag",
            "sdp",
            "flags",
            "replace",
            "rtcp-mux",
            "ice",
            "received-from",
            "media-address",
            "codec",
            "direction",
            "from-interface",
            "to-interface",
            "address-family",
            "record-call",
            "transport-protocol",
            "sdes",
            "dtls",
            "label",
            "from-label",
            "to-label",
        ],
        "delete" => &["call-id", "from-tag", "to-tag", "flags"],
        "query" => &["call-id", "from-tag", "to-tag"],
        // The whole call is recorded, whichever of its parties the tags name.
        "start recording" | "stop recording" | "start-recording" | "stop-recording" => &["call-id", "from-tag", "to-tag"],
        "list" => &["limit"],
        "play DTMF" | "play-DTMF" | "play dtmf" | "play-dtmf" => {
            &["call-id", "from-tag", "to-tag", "address", "label", "from-label", "to-label", "all", "flags", "code", "digit", "duration", "volume", "pause"]
        }
        "subscribe request" | "subscribe-request" => &["call-id", "from-tag", "from-tags", "to-tag", "all", "flags"],
        "subscribe answer" | "subscribe-answer" | "unsubscribe" => &["call-id", "to-tag", "sdp", "flags"],
        "start forwarding" | "start-forwarding" | "stop forwarding" | "stop-forwarding" => &["call-id", "from-tag", "all", "flags"],
        c if call_control::Command::parse(c).is_some() => {
            &["call-id", "from-tag", "to-tag", "address", "label", "from-label", "to-label", "all", "flags", "dtmf-security"]
        }
        _ => &[],
    }
}

/// The flags each command acts on. `symmetric` is what every leg does anyway.
fn flags_acted_on(command: &str) -> &'static [&'static str] {
    match command {
        "offer" | "answer" => &[
            "strict-source",
            "media-handover",
            "sip-source-address",
            "sip-source",
            "trust-address",
            "replace-origin",
            "replace-session-connection",
            "symmetric",
            "asymmetric",
            "record-call",
            "loop-protect",
            "rtp/avp",
            "rtp/avpf",
            "rtp/savp",
            "rtp/savpf",
            "udp/tls/rtp/savp",
            "udp/tls/rtp/savpf",
            // What the relay gives every WebRTC party anyway; toward another party the reply warns
            // (offer_answer).
            "generate-mid",
            "rtcp-mux-require",
            // The same as `rtcp-mux: [demux]`.
            "rtcp-mux-demux",
            // rtpengine needs it for `play DTMF` (it then transcodes everything); here the
            // events ride the party's own packets, nothing to prepare.
            "inject-dtmf",
        ],
        "delete" => &["fatal"],
        "subscribe request" | "subscribe-request" => &["all"],
        "start forwarding" | "start-forwarding" | "stop forwarding" | "stop-forwarding" => &["all"],
        "play DTMF" | "play-DTMF" | "play dtmf" | "play-dtmf" => &["all"],
        // `directional` is how Kamailio's module is told to send the From tag: the tag selects.
        c if call_control::Command::parse(c).is_some() => &["all", "directional"],
        _ => &[],
    }
}

/// What happens instead, for keys and flags SIP servers commonly send that mediaplane does not
/// act on yet.
fn consequence(name: &str) -> Option<&'static str> {
    Some(match name {
        "interface" => "interfaces are chosen with direction, from-interface and to-interface",
        "record" => "record-call records a call",
        "osrtp" => "opportunistic SRTP is neither offered nor accepted",
        "trickle-ice" => "the relay's one candidate is in the SDP (end-of-candidates)",
        "port-latching" | "no-port-latching" => "local ports are allocated per call as usual",
        "delete-delay" => "the call is deleted at once",
        _ => return codecs::consequence(name),
    })
}

/// One warning naming every key and flag of `req` that `command` does not act on, with what
/// happens instead where that is known: a flag is never accepted in silence.
fn not_acted_on(req: &Request, command: &str) -> Option<String> {
    let keys = keys_acted_on(command);
    let flags_ok = flags_acted_on(command);
    let mut ignored: Vec<String> =
        req.keys().into_iter().filter(|k| !matches!(*k, "command" | "flags") && !keys.contains(k) && !INFORMATIONAL.contains(k)).map(str::to_string).collect();
    // Malformed lists are the command's own error to report.
    let filters_codecs = keys.contains(&"codec");
    if let Ok(flags) = req.list("flags") {
        let acted_on =
            |f: &str| flags_ok.contains(&f) || (filters_codecs && codecs::flag_acted_on(f)) || (keys.contains(&"sdes") && sdes::SdesOptions::flag_acted_on(f));
        ignored.extend(flags.into_iter().filter(|f| !acted_on(f)));
    }
    if filters_codecs {
        ignored.extend(codecs::dictionary_keys_not_acted_on(req));
    }
    if keys.contains(&"replace") {
        if let Ok(replace) = req.list("replace") {
            ignored.extend(
                replace.into_iter().filter(|r| !matches!(r.as_str(), "origin" | "session-connection" | "zero-address")).map(|r| format!("replace={r}")),
            );
        }
    }
    ignored.dedup();
    if ignored.is_empty() {
        return None;
    }
    let described: Vec<String> = ignored
        .iter()
        .map(|name| match consequence(name) {
            Some(c) => format!("{name} (not supported: {c})"),
            None => name.clone(),
        })
        .collect();
    Some(format!("not acted on by {command}: {}", described.join(", ")))
}

/// Per media section: the payload types to advertise (None: as offered), and the codecs removed.
type SectionCodecs = (Vec<Option<Vec<u8>>>, Vec<Vec<CodecSpec>>);

/// `reply` with `warning` added (joined to one it already has).
/// No packet of `call` is known for `timeout` at `now`: its counters must be read (and, when
/// they show none either, it ends).
fn deadline_passed(call: &Call, now: Instant, timeout: Duration) -> bool {
    now.saturating_duration_since(call.last_activity) >= timeout
}

fn with_warning(reply: Value, warning: String) -> Value {
    let Value::Dict(mut d) = reply else { return reply };
    let joined = match d.get(b"warning".as_slice()).and_then(Value::as_str) {
        Some(w) => format!("{w}; {warning}"),
        None => warning,
    };
    d.insert(b"warning".to_vec(), Value::from(joined));
    Value::Dict(d)
}

impl Engine {
    /// An engine counting into metrics of its own.
    pub fn new(cfg: EngineConfig) -> Engine {
        Self::with_metrics(cfg, NgMetrics::default())
    }

    /// An engine counting into `metrics` (the daemon's registry's).
    pub fn with_metrics(cfg: EngineConfig, metrics: NgMetrics) -> Engine {
        let cache = ReplyCache::new(cfg.reply_ttl, cfg.reply_cache_entries);
        Engine {
            cfg,
            registry: Registry::default(),
            cache,
            metrics,
            started: Instant::now(),
            control: ControlStats::default(),
            traffic: TrafficTotals::default(),
            codecs: HashMap::new(),
            peak_sessions: 0,
            recordings: None,
        }
    }

    /// Record calls that ask for it (`record-call`, `start recording`) with `recordings`.
    pub fn record_with(&mut self, recordings: Recordings) {
        self.recordings = Some(recordings);
    }

    pub fn recordings(&self) -> Option<&Recordings> {
        self.recordings.as_ref()
    }

    /// Mark every relay of `call` recorded or not, as `call.recording` says (inside a mutation).
    fn mark_recorded(model: &mut Model, call: &Call, changes: &mut Vec<Change>) -> Result<(), ManagerError> {
        for id in call.relay_ids() {
            if model.set_relay_record(&id, call.recording)? && !changes.contains(&Change::Relay(id.clone())) {
                changes.push(Change::Relay(id));
            }
        }
        Ok(())
    }

    /// Write a recorded call's metadata; `ended`: it is over (its pcap is closed too).
    fn recording_metadata(&self, call: &Call, ended: Option<SystemTime>) {
        let Some(rec) = &self.recordings else { return };
        if !call.recorded {
            return;
        }
        let media: Vec<serde_json::Value> = call
            .media
            .iter()
            .enumerate()
            .filter(|(_, m)| m.active)
            .map(|(i, m)| {
                serde_json::json!({
                    "index": i + 1, "type": m.kind, "protocol": m.proto, "rtcp-mux": m.mux,
                    "local": [m.local[0].to_string(), m.local[1].to_string()],
                    "peer": [m.peer[0].map(|a| a.to_string()), m.peer[1].map(|a| a.to_string())],
                })
            })
            .collect();
        let meta = serde_json::json!({
            "call-id": call.call_id, "from-tag": call.tag_a, "to-tag": call.tag_b, "key": call.key,
            "created": recording::unix_secs(call.created), "ended": ended.map(recording::unix_secs),
            "recording": call.recording, "pcap": format!("{}.pcap", call.key),
            "pcap-format": "Ethernet/IP/UDP frames as each packet arrived at the relay (source: the party, destination: the relay)",
            "media": media,
        });
        rec.write_metadata(&call.key, &meta);
        if ended.is_some() {
            rec.close(&call.key);
        }
    }

    /// `start recording` / `stop recording`: the call's relays are (no longer) recorded.
    fn set_recording(&mut self, mgr: &SessionManager, req: &Request, on: bool) -> Result<Value, NgError> {
        let call_id = req.nonempty("call-id")?;
        let Some(call) = self.registry.get(call_id).filter(|c| c.call_id.is_empty() || c.call_id == call_id) else {
            return Err(NgError::Call(format!("unknown call-id {call_id:?}")));
        };
        if self.recordings.is_none() {
            return Err(NgError::Call("recording is not configured (ng.recording_dir)".into()));
        }
        let mut call = call.clone();
        call.recording = on;
        call.recorded |= on;
        mgr.mutate(|model, _| {
            let mut changes = Vec::new();
            Self::mark_recorded(model, &call, &mut changes)?;
            Ok(((), changes))
        })?;
        self.recording_metadata(&call, None);
        self.registry.insert(call);
        Ok(Value::dict([("result", Value::str("ok"))]))
    }

    /// `block media`, `silence media`, `block DTMF` and their ends ([`call_control`]), on every
    /// media section of the call.
    fn media_control(&mut self, mgr: &SessionManager, req: &Request, command: call_control::Command) -> Result<Value, NgError> {
        let call_id = req.nonempty("call-id")?;
        let Some(call) = self.registry.get(call_id).filter(|c| c.call_id.is_empty() || c.call_id == call_id) else {
            return Err(NgError::Call(format!("unknown call-id {call_id:?}")));
        };
        let target = call_control::select(call, req, command).map_err(|e| NgError::Call(e.to_string()))?;
        let relays: Vec<String> = (0..call.media.len()).filter(|i| call.media[*i].active).map(|i| calls::rtp_relay_id(&call.key, i)).collect();
        mgr.mutate(|model, _| {
            let mut changes = Vec::new();
            for id in relays {
                let Some(r) = model.relays.get(&id).cloned() else { continue };
                let mut changed = false;
                match &target {
                    call_control::Target::Call { and_participants } => {
                        changed |= model.set_media_control(&id, None, command.apply(r.control))?;
                        if *and_participants && !command.on {
                            for side in [Side::A, Side::B] {
                                changed |= model.set_media_control(&id, Some(side), command.apply(r.leg(side).control))?;
                            }
                        }
                    }
                    call_control::Target::Participants(sides) => {
                        for side in sides {
                            changed |= model.set_media_control(&id, Some(*side), command.apply(r.leg(*side).control))?;
                        }
                    }
                }
                if changed {
                    changes.push(Change::Relay(id));
                }
            }
            Ok(((), changes))
        })?;
        Ok(Value::dict([("result", Value::str("ok"))]))
    }

    /// `play DTMF`: an RFC 4733 event into what the selected party sends (toward the other),
    /// on every audio section whose receiving party's SDP has `telephone-event`
    /// ([`mediaplane_core::model::DtmfEvent`]).
    fn play_dtmf(&mut self, mgr: &SessionManager, req: &Request) -> Result<Value, NgError> {
        let call = self.call_of(req)?.clone();
        let dtmf = call_control::DtmfRequest::parse(req).map_err(|e| NgError::Call(e.to_string()))?;
        let all = req.list("flags")?.iter().any(|f| normalize(f) == "all") || req.opt_str("all")?.is_some_and(|a| normalize(a) == "all");
        let sides = match call_control::participants(&call, req).map_err(|e| NgError::Call(e.to_string()))? {
            Some(sides) => sides,
            None if all => vec![Side::A, Side::B],
            None => return Err(NgError::Call("play DTMF needs the party that sends it: from-tag, address or all".into())),
        };
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let relays: Vec<String> =
            (0..call.media.len()).filter(|i| call.media[*i].active && call.media[*i].kind == "audio").map(|i| calls::rtp_relay_id(&call.key, i)).collect();
        let queued = mgr.mutate(|model, _| {
            let mut changes = Vec::new();
            for id in &relays {
                let Some(r) = model.relays.get(id).cloned() else { continue };
                for &side in &sides {
                    // The receiver's own number for telephone-event.
                    let Some(&payload_type) = r.leg(other(side)).telephone_events.first() else { continue };
                    let event = mediaplane_core::model::DtmfEvent {
                        id: 0,
                        code: dtmf.code,
                        volume: dtmf.volume,
                        duration_ms: dtmf.duration_ms,
                        pause_ms: dtmf.pause_ms,
                        payload_type,
                        queued_ms: now_ms,
                    };
                    model.queue_dtmf(id, side, event)?;
                    if !changes.contains(&Change::Relay(id.clone())) {
                        changes.push(Change::Relay(id.clone()));
                    }
                }
            }
            Ok((!changes.is_empty(), changes))
        })?;
        if !queued {
            return Err(NgError::Call("no audio section whose receiving party's SDP has telephone-event: in-band tones are not generated".into()));
        }
        Ok(Value::dict([("result", Value::str("ok"))]))
    }

    /// The call a request's `call-id` names (one adopted after a restart too).
    fn call_of(&self, req: &Request) -> Result<&Call, NgError> {
        let call_id = req.nonempty("call-id")?;
        self.registry.get(call_id).filter(|c| c.call_id.is_empty() || c.call_id == call_id).ok_or_else(|| NgError::Call(format!("unknown call-id {call_id:?}")))
    }

    /// `subscribe request` ([`subscribe`]): fork the selected parties' media sections to new
    /// addresses; the reply offers them `sendonly`. The forwarding tag is not a subscriber's.
    fn subscribe_request(&mut self, mgr: &SessionManager, req: &Request) -> Result<Value, NgError> {
        let call = self.call_of(req)?.clone();
        let err = |e: subscribe::SubscribeError| NgError::Call(e.to_string());
        let parties = subscribe::parties(&call, req).map_err(err)?;
        let sections = subscribe::sections(&call, &parties).map_err(err)?;
        let tag = match req.opt_nonempty("to-tag")? {
            Some(t) if call.side_of(t).is_some() || t == FORWARDING_TAG => return Err(err(subscribe::SubscribeError::PartyTag(t.to_string()))),
            Some(t) => t.to_string(),
            None => subscribe::new_tag(),
        };
        let relays = call.relay_ids();
        let placed = mgr.mutate(|model, media| {
            let mut changes = Vec::new();
            // A request with an existing to-tag replaces that subscription.
            for id in &relays {
                if model.relays.contains_key(id) && model.remove_forks(id, &tag)? {
                    changes.push(Change::Relay(id.clone()));
                }
            }
            let mut placed = Vec::new();
            for (position, s) in sections.iter().enumerate() {
                let local = mediaplane_control::manager::allocate_on(model, media, s.ip, &[])?;
                for (id, fork) in subscribe::forks(&call, &tag, position, s, local) {
                    model.add_fork(&id, fork)?;
                    if !changes.contains(&Change::Relay(id.clone())) {
                        changes.push(Change::Relay(id));
                    }
                }
                let advertised = media.interface_of(local.ip()).map_or(local.ip(), |i| i.advertised());
                placed.push((s.clone(), SocketAddr::new(advertised, local.port())));
            }
            Ok((placed, changes))
        })?;
        let session = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let sdp = subscribe::offer_sdp(session, &placed);
        let tag_of = |s: Side| if s == Side::A { call.tag_a.clone() } else { call.tag_b.clone() }.unwrap_or_default();
        let from_tags: Vec<Value> = parties.iter().map(|s| Value::from(tag_of(*s))).collect();
        let mut reply =
            vec![("result", Value::str("ok")), ("sdp", Value::from(sdp)), ("to-tag", Value::from(tag.clone())), ("from-tags", Value::List(from_tags))];
        if let [one] = parties[..] {
            reply.push(("from-tag", Value::from(tag_of(one))));
        }
        tracing::info!(call_id = %call.call_id, to_tag = %tag, sections = placed.len(), "subscription offered");
        Ok(Value::dict(reply))
    }

    /// `start forwarding` / `stop forwarding`: one more copy of each selected party's RTP
    /// (`from-tag`, else both) to `ng.forward_to`, leaving from an address of its own per party
    /// and section (so the host tells them apart) and made where the party's other copies are
    /// (in the kernel on eBPF). rtpengine hands this to its recording daemon; here it is a fork
    /// ([`mediaplane_core::model::Fork`]) under the reserved tag [`FORWARDING_TAG`]. Starting
    /// again replaces what was forwarded; stopping what is not forwarded is not an error.
    fn forwarding(&mut self, mgr: &SessionManager, req: &Request, on: bool) -> Result<Value, NgError> {
        let call = self.call_of(req)?.clone();
        let Some(to) = self.cfg.forward_to else {
            return Err(NgError::Call("forwarding is not configured (ng.forward_to)".into()));
        };
        let err = |e: subscribe::SubscribeError| NgError::Call(e.to_string());
        let parties = match req.opt_nonempty("from-tag")? {
            Some(t) => vec![call.side_of(t).ok_or_else(|| err(subscribe::SubscribeError::UnknownTag(t.to_string())))?],
            None => vec![Side::A, Side::B],
        };
        let sections = if on { subscribe::sections(&call, &parties).map_err(err)? } else { Vec::new() };
        let relays = call.relay_ids();
        mgr.mutate(|model, media| {
            let mut changes = Vec::new();
            for id in &relays {
                for of in &parties {
                    if model.relays.contains_key(id) && model.remove_forks_of(id, FORWARDING_TAG, *of)? && !changes.contains(&Change::Relay(id.clone())) {
                        changes.push(Change::Relay(id.clone()));
                    }
                }
            }
            for (position, s) in sections.iter().enumerate() {
                // RTP only: the host gets the media, not the parties' reports.
                let s = subscribe::Section { rtcp: false, ..s.clone() };
                let local = mediaplane_control::manager::allocate_on(model, media, s.ip, &[])?;
                for (id, fork) in subscribe::forks(&call, FORWARDING_TAG, position, &s, local) {
                    let of = fork.of;
                    model.add_fork(&id, fork)?;
                    model.set_fork_remote(&id, FORWARDING_TAG, of, to)?;
                    if !changes.contains(&Change::Relay(id.clone())) {
                        changes.push(Change::Relay(id));
                    }
                }
            }
            Ok(((), changes))
        })?;
        tracing::info!(call_id = %call.call_id, on, %to, parties = parties.len(), "forwarding");
        Ok(Value::dict([("result", Value::str("ok"))]))
    }

    /// The forks of the subscription `tag` on `call`'s relays: (relay id, fork).
    fn forks_of(mgr: &SessionManager, call: &Call, tag: &str) -> Vec<(String, mediaplane_core::model::Fork)> {
        let relays = call.relay_ids();
        mgr.read(|model, _| {
            relays
                .iter()
                .filter_map(|id| model.relays.get(id).map(|r| (id, r)))
                .flat_map(|(id, r)| r.forks.iter().filter(|f| f.tag == tag).map(move |f| (id.clone(), f.clone())))
                .collect()
        })
    }

    /// `subscribe answer`: the subscriber's SDP says where each forked section goes.
    fn subscribe_answer(&mut self, mgr: &SessionManager, req: &Request) -> Result<Value, NgError> {
        let call = self.call_of(req)?.clone();
        let tag = req.nonempty("to-tag")?.to_string();
        let sdp = Sdp::parse(req.sdp()?)?;
        let forks = Self::forks_of(mgr, &call, &tag);
        let err = |e: subscribe::SubscribeError| NgError::Call(e.to_string());
        if forks.is_empty() {
            return Err(err(subscribe::SubscribeError::UnknownSubscription(tag)));
        }
        let want = forks.iter().map(|(_, f)| f.position as usize + 1).max().unwrap_or(0);
        if sdp.media.len() < want {
            return Err(err(subscribe::SubscribeError::TooFewSections { got: sdp.media.len(), want }));
        }
        let signals = calls::media_signals(&sdp, &AddressPolicy::default(), false)?;
        mgr.mutate(|model, _| {
            let mut changes = Vec::new();
            for (id, f) in &forks {
                let sig = &signals[f.position as usize];
                // The RTCP relay's fork goes to the section's RTCP address; a rejected section
                // (port 0) or one on hold gets nothing.
                let rtcp = calls::parse_relay_id(id).is_some_and(|(_, _, rtcp)| rtcp);
                let Some(to) = (if rtcp { sig.rtcp } else { sig.rtp }) else { continue };
                if model.set_fork_remote(id, &tag, f.of, to)? && !changes.contains(&Change::Relay(id.clone())) {
                    changes.push(Change::Relay(id.clone()));
                }
            }
            Ok(((), changes))
        })?;
        tracing::info!(call_id = %call.call_id, to_tag = %tag, "subscription answered");
        Ok(Value::dict([("result", Value::str("ok"))]))
    }

    /// `unsubscribe`: end the subscription `to-tag` names.
    fn unsubscribe(&mut self, mgr: &SessionManager, req: &Request) -> Result<Value, NgError> {
        let call = self.call_of(req)?.clone();
        let tag = req.nonempty("to-tag")?.to_string();
        let forks = Self::forks_of(mgr, &call, &tag);
        if forks.is_empty() {
            return Err(NgError::Call(subscribe::SubscribeError::UnknownSubscription(tag).to_string()));
        }
        mgr.mutate(|model, _| {
            let mut changes = Vec::new();
            for (id, _) in forks {
                if model.remove_forks(&id, &tag)? && !changes.contains(&Change::Relay(id.clone())) {
                    changes.push(Change::Relay(id));
                }
            }
            Ok(((), changes))
        })?;
        Ok(Value::dict([("result", Value::str("ok"))]))
    }

    /// The `loop-protect` mark this engine puts in SDP.
    pub fn instance_id(&self) -> &str {
        &self.cfg.instance_id
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn totals(&self) -> Totals {
        let t = self.metrics.totals();
        Totals { managed: t.calls_created, deleted: t.calls_deleted, timed_out: t.calls_timed_out, errors: t.errors }
    }

    /// Take over relays of this crate found in the model (after a restart). Returns how many
    /// calls were adopted.
    pub fn adopt(&mut self, mgr: &SessionManager, now: Instant) -> usize {
        let n = mgr.read(|m, _| self.registry.adopt(m, now));
        self.metrics.set_calls(self.registry.len());
        n
    }

    /// One request datagram from `client`; the reply datagram, if one is due (a datagram without
    /// a readable cookie gets none). A retransmitted request gets the cached reply.
    pub fn handle_datagram(&mut self, mgr: &SessionManager, client: SocketAddr, datagram: &[u8], now: Instant) -> Option<Vec<u8>> {
        let (cookie, dict) = match protocol::parse_frame(datagram) {
            Ok(x) => x,
            Err((None, e)) => {
                tracing::warn!(%client, error = %e, "NG datagram ignored");
                self.metrics.invalid(Duration::ZERO);
                return None;
            }
            Err((Some(cookie), e)) => {
                self.metrics.invalid(Duration::ZERO);
                return Some(protocol::frame(cookie, &error_reply(e.to_string())));
            }
        };
        if let Some(r) = self.cache.get(now, client, cookie) {
            tracing::debug!(%client, cookie = %String::from_utf8_lossy(cookie), "retransmission: cached reply");
            self.metrics.retransmission();
            return Some(r.to_vec());
        }
        let start = Instant::now();
        let reply = self.handle(mgr, &dict, now);
        let command = dict.get("command").and_then(Value::as_str).unwrap_or("");
        let ok = reply.get("result").and_then(Value::as_str) != Some("error");
        self.control.record(client.ip(), command, start.elapsed(), ok);
        let bytes = protocol::frame(cookie, &reply);
        self.cache.insert(now, client, cookie, bytes.clone());
        Some(bytes)
    }

    /// Execute one request dictionary; always returns a reply dictionary. Counted in the
    /// metrics by command and result, with the time it took.
    pub fn handle(&mut self, mgr: &SessionManager, dict: &Value, now: Instant) -> Value {
        tracing::debug!(request = ?dict, "NG request");
        let start = Instant::now();
        let req = Request::new(dict);
        let command = match req.str("command") {
            Ok(c) => c.to_string(),
            Err(e) => {
                self.metrics.invalid(start.elapsed());
                return error_reply(e.to_string());
            }
        };
        let result = match command.as_str() {
            "ping" => Ok(Value::dict([("result", "pong".into())])),
            "offer" => self.offer_answer(mgr, &req, Phase::Offer, now),
            "answer" => self.offer_answer(mgr, &req, Phase::Answer, now),
            "delete" => self.delete(mgr, &req),
            "query" => self.query(mgr, &req),
            "list" => self.list(&req),
            "statistics" => Ok(self.statistics(mgr, now)),
            "start recording" | "start-recording" => self.set_recording(mgr, &req, true),
            "stop recording" | "stop-recording" => self.set_recording(mgr, &req, false),
            "subscribe request" | "subscribe-request" => self.subscribe_request(mgr, &req),
            "subscribe answer" | "subscribe-answer" => self.subscribe_answer(mgr, &req),
            "unsubscribe" => self.unsubscribe(mgr, &req),
            "start forwarding" | "start-forwarding" => self.forwarding(mgr, &req, true),
            "stop forwarding" | "stop-forwarding" => self.forwarding(mgr, &req, false),
            "play DTMF" | "play-DTMF" | "play dtmf" | "play-dtmf" => self.play_dtmf(mgr, &req),
            other => match call_control::Command::parse(other) {
                Some(c) => self.media_control(mgr, &req, c),
                None => Err(NgError::Call(format!("unknown command {other:?}"))),
            },
        };
        // Also in our own log: Kamailio's module does not log a reply's warning.
        let result = result.map(|v| match not_acted_on(&req, &command) {
            Some(w) => {
                tracing::warn!(command, warning = %w, "NG request carried what mediaplane does not act on");
                with_warning(v, w)
            }
            None => v,
        });
        let call_id = req.opt_str("call-id").ok().flatten().unwrap_or("");
        self.metrics.request(&command, result.is_ok(), start.elapsed());
        self.metrics.set_calls(self.registry.len());
        self.peak_sessions = self.peak_sessions.max(self.registry.len() as u64);
        match result {
            Ok(v) => {
                tracing::info!(command, call_id, "NG request done");
                v
            }
            Err(e) => {
                tracing::warn!(command, call_id, error = %e, "NG request failed");
                error_reply(e.to_string())
            }
        }
    }

    fn offer_answer(&mut self, mgr: &SessionManager, req: &Request, phase: Phase, now: Instant) -> Result<Value, NgError> {
        let call_id = req.nonempty("call-id")?;
        let from_tag = req.nonempty("from-tag")?;
        let to_tag = req.opt_nonempty("to-tag")?;
        if phase == Phase::Answer && to_tag.is_none() {
            return Err(RequestError::Missing("to-tag").into());
        }
        let body = req.sdp()?;
        let mut opt = options(req)?;
        let sdp = Sdp::parse(body)?;
        if opt.loop_protect && sdp.marked(&self.cfg.instance_id) {
            // This relay's own SDP came back (a signalling loop): it is not relayed twice.
            tracing::info!(call_id, "SDP carries this relay's loop-protect mark: returned unchanged");
            return Ok(Value::dict([("result", "ok".into()), ("sdp", Value::Bytes(body.to_vec()))]));
        }
        let signals = calls::media_signals(&sdp, &opt.policy, opt.strip_mux)?;

        // Which call, and whose SDP this is.
        let existing = self.registry.get(call_id);
        if let Some(c) = existing {
            if !c.call_id.is_empty() && c.call_id != call_id {
                return Err(NgError::Call(format!("call-id {call_id:?} collides with call-id {:?}; retry with another", c.call_id)));
            }
        }
        let mut call = match (existing, phase) {
            (Some(c), _) => c.clone(),
            (None, Phase::Offer) => {
                let mut c = Call::new(call_id, now);
                c.tag_a = Some(from_tag.to_string());
                c.tag_b = to_tag.map(str::to_string);
                c
            }
            (None, Phase::Answer) => return Err(NgError::Call(format!("unknown call-id {call_id:?}"))),
        };
        if call.call_id.is_empty() {
            // Adopted after a restart: learn the Call-ID and the tags again.
            call.call_id = call_id.to_string();
            if call.tag_a.is_none() {
                call.tag_a = Some(from_tag.to_string());
                call.tag_b = to_tag.map(str::to_string);
            }
        }
        let offerer = call.side_of(from_tag).ok_or_else(|| NgError::Call(format!("from-tag {from_tag:?} is not part of call {call_id:?}")))?;
        let sender = match phase {
            Phase::Offer => offerer,
            Phase::Answer => other(offerer),
        };
        // Labels, as rtpengine keeps them: `label` (or `from-label`) names the SDP's sender,
        // `to-label` the other party; what call control may select by later.
        if let Some(l) = req.opt_nonempty("label")?.or(req.opt_nonempty("from-label")?) {
            call.labels[calls::side_index(sender)] = Some(l.to_string());
        }
        if let Some(l) = req.opt_nonempty("to-label")? {
            call.labels[calls::side_index(other(sender))] = Some(l.to_string());
        }
        if phase == Phase::Answer {
            if signals.len() > call.media.len() {
                return Err(NgError::Call(format!("the answer has {} media sections, the offer had {}", signals.len(), call.media.len())));
            }
            if sender == Side::B {
                call.tag_b = to_tag.map(str::to_string);
            }
        }
        let (formats, codecs_removed) = Self::filter_codecs(req, phase, &sdp, &call, &mut opt.warnings)?;
        let transport = if phase == Phase::Offer { opt.transport.as_deref() } else { None };
        let secure = sdes::plan(&call, sender, phase, &sdp, transport, &opt.sdes, &mut opt.warnings)?;
        let outgoing: Vec<(Option<String>, Option<Vec<String>>)> = secure.iter().map(|p| (p.proto.clone(), p.crypto.clone())).collect();
        let webrtc = crate::webrtc::plan(&call, sender, phase, &sdp, &secure, opt.dtls)?;
        // Toward a WebRTC party the relay is the ICE agent (ICE=force is what it does).
        let terminates_ice = webrtc.iter().any(|w| w.outgoing != crate::webrtc::Outgoing::Keep);
        if sdp.has_ice() && !terminates_ice {
            match opt.ice.as_deref() {
                Some("remove") => {}
                Some(v) => opt.warnings.push(format!("ICE={v} is not supported: ICE attributes removed")),
                None => opt.warnings.push("the SDP carries ICE candidates that bypass the relay; send ICE=remove".into()),
            }
        }
        let remove_ice = opt.ice.is_some() || terminates_ice;

        let mut interface: [Option<String>; 2] = Default::default();
        let [mut to_sender, to_receiver] = opt.interfaces.clone();
        // An answer's sender already has its relay address (from the offer): its leg stays on
        // the interface the offer chose; a different name gets a warning, not a move.
        let answer_names = if phase == Phase::Answer { to_sender.take() } else { None };
        interface[calls::side_index(sender)] = to_sender;
        interface[calls::side_index(other(sender))] = to_receiver;
        let leg = SignalOptions {
            at_ms: mediaplane_control::manager::unix_ms(),
            placement: Placement { interface, out_v4: opt.out_v4 },
            report_dtmf: self.cfg.report_dtmf,
            ..opt.leg.clone()
        };
        if let Some(on) = opt.record {
            if self.recordings.is_some() {
                call.recording = on;
                call.recorded |= on;
            } else if on {
                opt.warnings.push("record-call: nothing is recorded (no ng.recording_dir configured)".into());
            }
        }
        let (call, media_cfg) = mgr.mutate(|model, media| {
            let mut next = call;
            let mut changes = calls::apply_signal(model, media, &mut next, sender, phase, &signals, &leg)?;
            crate::webrtc::install(model, &mut next, &webrtc, &mut changes)?;
            sdes::install(model, &mut next, sender, secure, &mut changes)?;
            Self::mark_recorded(model, &next, &mut changes)?;
            Ok(((next, media.clone()), changes))
        })?;

        crate::webrtc::hand_over_legs(mgr, &call);
        if let Some(name) = answer_names {
            let on = |m: &MediaState| media_cfg.interface_of(m.local_of(sender).ip()).map(|i| i.name);
            if let Some(other_name) = call.media.iter().filter(|m| m.active).filter_map(on).find(|n| *n != name) {
                opt.warnings.push(format!(
                    "the answer names interface {name:?} for its sender, whose leg is on {other_name:?} since the offer: kept (direction lists the sender's interface first)"
                ));
            }
        }
        let fingerprint = mgr.dtls_fingerprint();
        // The SDP goes to the other party: advertise the relay side facing it (the address of
        // its interface, or what that interface advertises).
        let to = other(sender);
        let ip = call.media.iter().find(|m| m.active).map_or(media_cfg.ip, |m| m.local_of(to).ip());
        let ip = media_cfg.interface_of(ip).map_or(ip, |i| i.advertised());
        let media: Vec<MediaRewrite> = call
            .media
            .iter()
            .zip(&signals)
            .enumerate()
            .map(|(i, (m, sig))| {
                if !m.active {
                    return MediaRewrite { strip_rtcp_mux: opt.strip_mux, ..Default::default() };
                }
                let port = m.local_of(to).port();
                let formats = formats.get(i).cloned().flatten();
                let (proto, crypto) = outgoing.get(i).cloned().unwrap_or_default();
                let transport = match webrtc.get(i).map(|w| &w.outgoing) {
                    None | Some(crate::webrtc::Outgoing::Keep) => None,
                    Some(crate::webrtc::Outgoing::Strip) => Some(Vec::new()),
                    Some(crate::webrtc::Outgoing::Ours { side, setup, add_mid, add_mux }) => {
                        m.webrtc[*side].as_ref().map(|w| crate::webrtc::attributes(w, SocketAddr::new(ip, port), &fingerprint, setup, *add_mid, *add_mux))
                    }
                };
                // A WebRTC party's SDP says nothing of its address (ICE does): never a hold.
                let webrtc_sender = call.media.get(i).is_some_and(|m| m.webrtc[calls::side_index(sender)].is_some());
                let hold = sig.rtp.is_none() && !opt.replace_zero_address && !webrtc_sender;
                // `rtcp-mux-demux`: the party keeping RTCP apart is offered none; the other is
                // told RTCP is multiplexed.
                let (apart, muxed) = (m.demux == Some(to), m.demux == Some(sender));
                MediaRewrite {
                    port: Some(port),
                    rtcp_port: if m.rtcp || apart { port + 1 } else { port },
                    strip_rtcp_mux: opt.strip_mux || apart,
                    add_rtcp_mux: muxed,
                    hold,
                    formats,
                    proto,
                    crypto,
                    transport,
                }
            })
            .collect();
        let mark = opt.loop_protect.then(|| self.cfg.instance_id.clone());
        let gives_ice = webrtc.iter().any(|w| matches!(w.outgoing, crate::webrtc::Outgoing::Ours { .. }));
        // These two ask for what the relay gives a WebRTC party anyway (a=mid on every section,
        // rtcp-mux only); toward any other party nothing is generated, and the reply says so.
        if !gives_ice {
            for flag in req.list("flags").unwrap_or_default().into_iter().filter(|f| matches!(f.as_str(), "generate-mid" | "rtcp-mux-require")) {
                opt.warnings.push(format!("{flag} is acted on only toward a WebRTC party (ICE=force or UDP/TLS/RTP/SAVPF): this SDP is passed on as it is"));
            }
        }
        let rewritten = sdp.rewrite(&Rewrite {
            addr: ip,
            origin: opt.replace_origin,
            session_connection: opt.replace_session_connection,
            remove_ice,
            media,
            mark,
            session_attrs: if gives_ice {
                std::iter::once("ice-lite".to_string()).chain(crate::webrtc::bundle_groups(&call, to)).collect()
            } else {
                Vec::new()
            },
            remove_dtls: terminates_ice,
            // What is bundled is the relay's to say: toward the bundling party, its groups;
            // toward the other, none (its sections have ports of their own).
            remove_bundle: call.media.iter().any(|m| m.bundle.is_some()),
        });

        let mut call = call;
        if phase == Phase::Offer {
            call.codecs_removed = codecs_removed;
        }
        call.last_signal = SystemTime::now();
        for (i, m) in call.media.iter_mut().enumerate() {
            m.formats_of[calls::side_index(sender)] = sdp.format_description(i);
        }
        if phase == Phase::Answer {
            call.answered = true;
        }
        if existing.is_none() {
            self.metrics.call_created();
            call.last_activity = now;
        }
        tracing::debug!(call_id, relays = ?call.relay_ids(), "call updated");
        let codecs = self.codecs.entry(call.key.clone()).or_default();
        for (i, c) in ngstats::first_codecs(body).into_iter().enumerate() {
            match codecs.get_mut(i) {
                Some(slot) => *slot = c.or(slot.take()),
                None => codecs.push(c),
            }
        }
        self.recording_metadata(&call, None);
        self.registry.insert(call);

        let mut reply = vec![("result", Value::str("ok")), ("sdp", Value::Bytes(rewritten))];
        if !opt.warnings.is_empty() {
            reply.push(("warning", Value::from(opt.warnings.join("; "))));
        }
        Ok(Value::dict(reply))
    }

    /// The payload types each media section of `sdp` keeps under the request's codec filter (an
    /// answer also loses what the call's last offer removed), and what was removed, per section.
    /// A section the filter would leave without a codec keeps its list, with a warning.
    fn filter_codecs(req: &Request, phase: Phase, sdp: &Sdp, call: &Call, warnings: &mut Vec<String>) -> Result<SectionCodecs, NgError> {
        let (filter, w) = CodecFilter::from_request(req, phase == Phase::Offer)?;
        warnings.extend(w);
        let mut formats = Vec::with_capacity(sdp.media.len());
        let mut removed = Vec::with_capacity(sdp.media.len());
        for (i, m) in sdp.media.iter().enumerate() {
            let from_offer = match phase {
                Phase::Answer => call.codecs_removed.get(i).map_or(&[][..], Vec::as_slice),
                Phase::Offer => &[],
            };
            let outcome = if m.port == 0 { Filtered::Unchanged } else { filter.clone().and_strip(from_offer).apply(&m.formats) };
            match outcome {
                Filtered::Unchanged => {
                    formats.push(None);
                    removed.push(Vec::new());
                }
                Filtered::Narrowed { keep, removed: r } => {
                    formats.push(Some(keep));
                    removed.push(r.iter().map(CodecSpec::exact).collect());
                }
                Filtered::Refused => {
                    warnings.push(format!(
                        "the codec filter would remove every codec of media section {} ({}): its codecs are passed through unchanged",
                        i + 1,
                        m.kind
                    ));
                    formats.push(None);
                    removed.push(Vec::new());
                }
            }
        }
        Ok((formats, removed))
    }

    fn delete(&mut self, mgr: &SessionManager, req: &Request) -> Result<Value, NgError> {
        let call_id = req.nonempty("call-id")?;
        let from_tag = req.opt_nonempty("from-tag")?;
        let to_tag = req.opt_nonempty("to-tag")?;
        let fatal = req.list("flags")?.iter().any(|f| f == "fatal");
        let not_found = |what: String| -> Result<Value, NgError> {
            if fatal {
                Err(NgError::Call(what))
            } else {
                Ok(Value::dict([("result", "ok".into()), ("warning", what.into())]))
            }
        };
        let Some(call) = self.registry.get(call_id).filter(|c| c.call_id.is_empty() || c.call_id == call_id) else {
            return not_found(format!("unknown call-id {call_id:?}"));
        };
        let adopted = call.tag_a.is_none();
        let tag_ok = |t: Option<&str>| t.is_none_or(|t| adopted || call.has_tag(t) || call.tag_b.is_none());
        if !(tag_ok(from_tag) && tag_ok(to_tag)) {
            let tag = |t: Option<&str>| t.map_or_else(|| "none".to_string(), |t| format!("{t:?}"));
            return not_found(format!("tags {}/{} are not in dialogue in call {call_id:?}", tag(from_tag), tag(to_tag)));
        }
        let call = call.clone();
        // rtpengine replies to delete with the call's final statistics, as to query.
        let mut reply = self.call_reply(mgr, &call, |totals, model, streams| totals.call_ended(&call, model, streams, SystemTime::now()));
        mgr.mutate(|model, _| Ok(((), calls::delete_call(model, &call)?)))?;
        self.recording_metadata(&call, Some(SystemTime::now()));
        self.registry.remove(&call.key);
        self.codecs.remove(&call.key);
        self.metrics.call_ended(CallEnd::Deleted);
        reply.insert(0, ("result", Value::str("ok")));
        Ok(Value::dict(reply))
    }

    fn list(&self, req: &Request) -> Result<Value, NgError> {
        let limit = req.int("limit")?.unwrap_or(32);
        if limit <= 0 {
            return Err(RequestError::Invalid("limit", "must be > 0".into()).into());
        }
        let mut ids: Vec<&str> = self.registry.calls().map(|c| if c.call_id.is_empty() { c.key.as_str() } else { c.call_id.as_str() }).collect();
        ids.sort_unstable();
        ids.truncate(limit as usize);
        Ok(Value::dict([("result", "ok".into()), ("calls", Value::List(ids.into_iter().map(Value::str).collect()))]))
    }

    /// rtpengine's per-call reply keys (see [`ngstats::call_reply`]), read from the counters of
    /// the call's streams; `also` sees the same counters (the delete records them).
    fn call_reply(
        &mut self,
        mgr: &SessionManager,
        call: &Call,
        also: impl FnOnce(&mut TrafficTotals, &Model, &BTreeMap<u32, Counters>),
    ) -> Vec<(&'static str, Value)> {
        let kernel = mgr.dataplane().name() == "ebpf";
        let none = Vec::new();
        let view = CallView { call, codecs: self.codecs.get(&call.key).unwrap_or(&none), kernel, clock: Clock::now() };
        let traffic = &mut self.traffic;
        mgr.read(|model, _| {
            let ids = calls::stream_ids(model, call);
            let streams = mgr.stream_counters(&ids);
            let reception = mgr.stream_reception(&ids);
            let quality = mgr.relay_quality(&call.relay_ids());
            also(traffic, model, &streams);
            ngstats::call_reply(model, &streams, &reception, &quality, &view)
        })
    }

    fn query(&mut self, mgr: &SessionManager, req: &Request) -> Result<Value, NgError> {
        let call_id = req.nonempty("call-id")?;
        let call = self.registry.get(call_id).ok_or_else(|| NgError::Call(format!("unknown call-id {call_id:?}")))?.clone();
        let mut reply = self.call_reply(mgr, &call, |_, _, _| {});
        reply.insert(0, ("result", Value::str("ok")));
        Ok(Value::dict(reply))
    }

    /// The rates (`packetrate`, `byterate`, `errorrate`) are averages since the previous
    /// `statistics` request (0 in the first reply): this is where every call's counters are read.
    fn statistics(&mut self, mgr: &SessionManager, now: Instant) -> Value {
        let (live, media, ports_used, last_port) = mgr.read(|model, _| {
            let mut live = Traffic::default();
            let mut media = 0u64;
            let mc = mgr.media_config();
            for call in self.registry.calls() {
                let streams = mgr.stream_counters(&calls::stream_ids(model, call));
                let (rtp, rtcp) = ngstats::call_traffic(call, model, &streams, Traffic::relayed);
                live.add(rtp);
                live.add(rtcp);
                media += call.media.iter().filter(|m| m.active).count() as u64;
            }
            let in_range = |a: &&SocketAddr| a.ip() == mc.ip && (mc.port_min..=mc.port_max).contains(&a.port());
            (live, media, model.local_addresses().filter(in_range).count() as u64, model.last_claimed_port())
        });
        self.traffic.sample(now, live);
        let t = self.totals();
        let input = StatisticsInput {
            sessions: self.registry.len() as u64,
            uptime: self.started.elapsed(),
            managed: t.managed,
            deleted: t.deleted,
            timed_out: t.timed_out,
            control_errors: t.errors,
            peak_sessions: self.peak_sessions,
            live,
            media,
            kernel: mgr.dataplane().name() == "ebpf",
            media_config: mgr.media_config(),
            ports_used,
            last_port,
            mos: mgr.mos_totals(),
        };
        Value::dict([("result", "ok".into()), ("statistics", ngstats::statistics(&input, &self.traffic, &self.control))])
    }

    /// Media timeout: delete the calls whose last packet (or creation, before any) is older
    /// than the configured timeout, by the data planes' per-stream last-packet times. Called
    /// once per sweep interval, a call ends within one interval of `last packet + timeout`.
    /// Returns the Call-IDs (or keys) deleted.
    ///
    /// Only the calls whose deadline passed (no packet known for the timeout) have their
    /// counters read: a call that had one is read again only a timeout later, so a sweep over
    /// thousands of live calls costs next to nothing (it read every stream every second, most
    /// of an idle relay's CPU), and a call still ends within one sweep of `last packet + timeout`.
    pub fn expire(&mut self, mgr: &SessionManager, now: Instant) -> Vec<String> {
        let timeout = self.cfg.media_timeout;
        let ids: Vec<u32> =
            mgr.read(|model, _| self.registry.calls().filter(|c| deadline_passed(c, now, timeout)).flat_map(|c| calls::stream_ids(model, c)).collect());
        let streams = if ids.is_empty() { BTreeMap::new() } else { mgr.stream_counters(&ids) };
        let stats = DataplaneStats { streams, ..Default::default() };
        self.expire_with(mgr, &stats, now, mediaplane_dataplane::monotonic_ns())
    }

    fn expire_dtmf(&self, mgr: &SessionManager) {
        if !mgr.read(|model, _| model.relays.values().any(|r| !r.a.dtmf.is_empty() || !r.b.dtmf.is_empty())) {
            return;
        }
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let r = mgr.mutate(|model: &mut Model, _| Ok(((), model.expire_dtmf(now_ms).into_iter().map(Change::Relay).collect())));
        if let Err(e) = r {
            tracing::error!(error = %e, "could not drop played DTMF events");
        }
    }

    /// [`Engine::expire`] with the counters read and the time given: `now` and `now_mono_ns`
    /// ([`mediaplane_dataplane::monotonic_ns`]) are the same instant on the two clocks.
    pub fn expire_with(&mut self, mgr: &SessionManager, stats: &DataplaneStats, now: Instant, now_mono_ns: u64) -> Vec<String> {
        let timeout = self.cfg.media_timeout;
        // The sweep also samples the request rates `statistics` reports, and drops DTMF events
        // that must be over (their relays go back to the kernel on the eBPF plane).
        self.control.sample(now);
        self.expire_dtmf(mgr);
        let traffic = &mut self.traffic;
        let idle: Vec<Call> = mgr.read(|model, _| {
            let mut idle = Vec::new();
            for call in self.registry.calls_mut().filter(|c| deadline_passed(c, now, timeout)) {
                let relays = calls::call_relays(model, call);
                let last = calls::leg_uids(&relays).iter().filter_map(|u| stats.streams.get(u)).map(|c| c.last_rx_ns).max().unwrap_or(0);
                if last > call.last_rx {
                    call.last_rx = last;
                    let packet_at = now.checked_sub(Duration::from_nanos(now_mono_ns.saturating_sub(last))).unwrap_or(now);
                    call.last_activity = call.last_activity.max(packet_at);
                }
                if deadline_passed(call, now, timeout) {
                    idle.push(call.clone());
                }
            }
            for call in &idle {
                traffic.call_ended(call, model, &stats.streams, SystemTime::now());
            }
            idle
        });
        if idle.is_empty() {
            return Vec::new();
        }
        let r = mgr.mutate(|model: &mut Model, _| {
            let mut changes = Vec::new();
            for c in &idle {
                changes.extend(calls::delete_call(model, c)?);
            }
            Ok(((), changes))
        });
        if let Err(e) = r {
            tracing::error!(error = %e, "could not delete timed-out calls");
            return Vec::new();
        }
        let mut gone = Vec::new();
        for c in idle {
            tracing::info!(call_id = %c.call_id, key = %c.key, "media timeout: call deleted");
            self.recording_metadata(&c, Some(SystemTime::now()));
            self.registry.remove(&c.key);
            self.codecs.remove(&c.key);
            self.metrics.call_ended(CallEnd::Timeout);
            gone.push(if c.call_id.is_empty() { c.key } else { c.call_id });
        }
        self.metrics.set_calls(self.registry.len());
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mediaplane_control::config::{Limits, MediaConfig};
    use mediaplane_control::store::Store;
    use mediaplane_core::ForwardingTable;
    use mediaplane_dataplane::{Dataplane, DataplaneError};
    use std::sync::Arc;

    /// Accepts every table, forwards nothing.
    struct NullDataplane;
    impl Dataplane for NullDataplane {
        fn name(&self) -> &'static str {
            "null"
        }
        fn apply(&self, _t: Arc<ForwardingTable>) -> Result<(), DataplaneError> {
            Ok(())
        }
        fn stats(&self) -> DataplaneStats {
            DataplaneStats::default()
        }
        fn shutdown(&self) -> Result<(), DataplaneError> {
            Ok(())
        }
    }

    /// Counters set by the test, and every read of them recorded.
    #[derive(Default)]
    struct CountingDataplane {
        streams: parking_lot::Mutex<BTreeMap<u32, Counters>>,
        reads: parking_lot::Mutex<Vec<Vec<u32>>>,
    }
    impl Dataplane for CountingDataplane {
        fn name(&self) -> &'static str {
            "counting"
        }
        fn apply(&self, _t: Arc<ForwardingTable>) -> Result<(), DataplaneError> {
            Ok(())
        }
        fn stats(&self) -> DataplaneStats {
            DataplaneStats { streams: self.streams.lock().clone(), ..Default::default() }
        }
        fn stream_counters(&self, ids: &[u32]) -> BTreeMap<u32, Counters> {
            self.reads.lock().push(ids.to_vec());
            let s = self.streams.lock();
            ids.iter().filter_map(|id| Some((*id, *s.get(id)?))).collect()
        }
        fn shutdown(&self) -> Result<(), DataplaneError> {
            Ok(())
        }
    }

    fn manager() -> SessionManager {
        manager_with(MediaConfig { ip: "203.0.113.5".parse().unwrap(), port_min: 30000, port_max: 30019, ..Default::default() })
    }

    fn manager_with(media: MediaConfig) -> SessionManager {
        SessionManager::open(Store::in_memory().unwrap(), Arc::new(NullDataplane), media, Limits::default()).unwrap()
    }

    const CLIENT: &str = "127.0.0.1:5060";
    const OFFER_SDP: &str = "v=0\r\no=alice 2890844526 2890844526 IN IP4 198.51.100.1\r\ns=-\r\nc=IN IP4 198.51.100.1\r\nt=0 0\r\nm=audio 49170 RTP/AVP 8 101\r\na=rtpmap:8 PCMA/8000\r\na=rtpmap:101 telephone-event/8000\r\na=sendrecv\r\n";
    const ANSWER_SDP: &str =
        "v=0\r\no=bob 2808844564 2808844564 IN IP4 198.51.100.2\r\ns=-\r\nc=IN IP4 198.51.100.2\r\nt=0 0\r\nm=audio 3456 RTP/AVP 8\r\na=rtpmap:8 PCMA/8000\r\n";

    fn req(cookie: &str, pairs: Vec<(&str, Value)>) -> Vec<u8> {
        protocol::frame(cookie.as_bytes(), &Value::dict(pairs))
    }

    fn send(e: &mut Engine, m: &SessionManager, cookie: &str, pairs: Vec<(&str, Value)>) -> Value {
        let d = protocol::frame(cookie.as_bytes(), &Value::dict(pairs));
        let r = e.handle_datagram(m, CLIENT.parse().unwrap(), &d, Instant::now()).unwrap();
        let (c, v) = protocol::parse_frame(&r).unwrap();
        assert_eq!(c, cookie.as_bytes());
        v
    }

    fn offer(sdp: &str) -> Vec<(&'static str, Value)> {
        vec![
            ("command", "offer".into()),
            ("call-id", "cfBXzDSZqhYNcXM".into()),
            ("from-tag", "mS9rSAn0Cr".into()),
            ("via-branch", "5KiTRPZHH1nL6".into()),
            ("sdp", sdp.into()),
            ("flags", Value::List(vec!["trust address".into()])),
            ("replace", Value::List(vec!["origin".into(), "session connection".into()])),
            ("received-from", Value::List(vec!["IP4".into(), "10.65.31.43".into()])),
            ("supports", Value::List(vec!["load limit".into()])),
            ("sip-message-type", "sip-request".into()),
        ]
    }

    fn answer(sdp: &str) -> Vec<(&'static str, Value)> {
        let mut a = offer(sdp);
        a[0].1 = "answer".into();
        a.push(("to-tag", "8fa3b2".into()));
        a
    }

    fn text(v: &Value, k: &str) -> String {
        v.get(k).and_then(Value::as_str).unwrap_or_default().to_string()
    }

    #[test]
    fn requests_and_calls_are_counted_in_the_shared_metrics_and_statistics_reads_them() {
        let metrics = NgMetrics::default();
        let (m, mut e) = (manager(), Engine::with_metrics(EngineConfig::default(), metrics.clone()));
        send(&mut e, &m, "p1", vec![("command", "ping".into())]);
        let d = req("p1", vec![("command", "ping".into())]);
        e.handle_datagram(&m, CLIENT.parse().unwrap(), &d, Instant::now()).unwrap(); // a retransmission
        assert!(e.handle_datagram(&m, CLIENT.parse().unwrap(), b"nothing", Instant::now()).is_none());
        send(&mut e, &m, "x1", vec![("command", "frobnicate".into())]);
        send(&mut e, &m, "o1", offer(OFFER_SDP));
        let t = metrics.totals();
        assert_eq!((t.requests, t.errors, t.calls, t.calls_created), (4, 2, 1, 1), "{t:?}");
        let s = send(&mut e, &m, "s1", vec![("command", "statistics".into())]);
        let total = |k: &str| s.get("statistics").unwrap().get("totalstatistics").unwrap().get(k).cloned();
        assert_eq!((total("controlerrors"), total("managedsessions")), (Some(Value::Int(2)), Some(Value::Int(1))), "{s:?}");
    }

    #[test]
    fn address_family_and_direction_bridge_ipv4_to_ipv6() {
        let interfaces = ["internal/10.0.0.1", "external/203.0.113.1!198.51.100.7", "external/2001:db8::1"];
        let media = MediaConfig { interfaces: interfaces.iter().map(|i| i.to_string().try_into().unwrap()).collect(), ..MediaConfig::default() };
        let (m, mut e) = (manager_with(media), Engine::new(EngineConfig::default()));
        let mut o = offer(OFFER_SDP);
        o[6].1 = Value::List(vec!["origin".into(), "session connection".into()]);
        o.push(("direction", Value::List(vec!["internal".into(), "external".into()])));
        o.push(("address family", "IP6".into()));
        let r = send(&mut e, &m, "o1", o);
        assert_eq!((text(&r, "result"), text(&r, "warning")), ("ok".into(), String::new()), "{r:?}");
        let sdp = text(&r, "sdp");
        assert!(sdp.contains("o=alice 2890844526 2890844526 IN IP6 2001:db8::1\r\n"), "{sdp}");
        assert!(sdp.contains("c=IN IP6 2001:db8::1\r\n") && !sdp.contains("IP4"), "{sdp}");
        // The IPv6 callee answers; the caller, inside, is told the internal IPv4 address.
        let v6_answer = ANSWER_SDP.replace("IN IP4 198.51.100.2", "IN IP6 2001:db8::9");
        let mut a = answer(&v6_answer);
        a.push(("direction", Value::List(vec!["external".into(), "internal".into()])));
        let r = send(&mut e, &m, "a1", a);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        assert!(text(&r, "sdp").contains("c=IN IP4 10.0.0.1\r\n"), "{r:?}");
        let relay = m.read(|model, _| model.relays.values().find(|r| r.a.rtp).cloned()).unwrap();
        assert_eq!((relay.a.local.ip().to_string(), relay.b.remote), ("10.0.0.1".into(), Some("[2001:db8::9]:3456".parse().unwrap())));
        // What an interface advertises behind NAT is what the SDP carries.
        let mut o = offer(OFFER_SDP);
        o[1].1 = "second".into();
        o.push(("to-interface", "external".into()));
        let r = send(&mut e, &m, "o2", o);
        assert!(text(&r, "sdp").contains("c=IN IP4 198.51.100.7\r\n"), "{r:?}");
        // An answer naming the interfaces in the offer's order (rtpengine reads the first as
        // the SDP sender's): the answerer stays where its offer put it, with a warning.
        let mut a = answer(ANSWER_SDP);
        a[1].1 = "second".into();
        a.push(("direction", Value::List(vec!["internal".into(), "external".into()])));
        let r = send(&mut e, &m, "a2", a);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        assert!(text(&r, "warning").contains("names interface \"internal\" for its sender, whose leg is on \"external\" since the offer: kept"), "{r:?}");
        // Bad values are errors that say why.
        for (k, v, why) in [("address-family", "IPX", "\"IPX\" is neither IP4 nor IP6"), ("from-interface", "dmz", "no media interface is named \"dmz\"")] {
            let mut o = offer(OFFER_SDP);
            o[1].1 = "third".into();
            o.push((k, v.into()));
            let r = send(&mut e, &m, k, o);
            assert!(text(&r, "error-reason").contains(why), "{r:?}");
        }
    }

    #[test]
    fn start_and_stop_recording_mark_the_calls_relays() {
        let recorded = |m: &SessionManager| m.read(|model, _| model.relays.values().filter(|r| r.record).count());
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        send(&mut e, &m, "o1", offer(OFFER_SDP));
        let start = |call: &str| vec![("command", "start recording".into()), ("call-id", call.into())];
        let r = send(&mut e, &m, "r0", start("cfBXzDSZqhYNcXM"));
        assert_eq!(text(&r, "error-reason"), "recording is not configured (ng.recording_dir)", "{r:?}");
        let dir = std::env::temp_dir().join(format!("mp-rec-{}-{}", std::process::id(), line!()));
        e.record_with(Recordings::start(&dir).unwrap());
        let r = send(&mut e, &m, "r1", start("cfBXzDSZqhYNcXM"));
        assert_eq!((text(&r, "result"), text(&r, "warning")), ("ok".into(), String::new()), "{r:?}");
        assert_eq!(recorded(&m), 2, "the RTP and RTCP relays");
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(e.recordings().unwrap().metadata_path(&calls::call_key("cfBXzDSZqhYNcXM"))).unwrap()).unwrap();
        assert_eq!((meta["call-id"].as_str(), meta["ended"].is_null()), (Some("cfBXzDSZqhYNcXM"), true));
        // A re-INVITE keeps recording; stop recording ends it; an unknown call is an error.
        send(&mut e, &m, "o2", offer(OFFER_SDP));
        assert_eq!(recorded(&m), 2);
        let r = send(&mut e, &m, "r2", vec![("command", "stop recording".into()), ("call-id", "cfBXzDSZqhYNcXM".into())]);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        assert_eq!(recorded(&m), 0);
        let r = send(&mut e, &m, "r3", start("nope"));
        assert_eq!(text(&r, "error-reason"), "unknown call-id \"nope\"", "{r:?}");
        drop(e);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_key_and_flag_not_acted_on_is_named_in_a_warning() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        // What Kamailio's module sends for a plain call: acted on, no warning.
        let r = send(&mut e, &m, "o0", offer(OFFER_SDP));
        assert_eq!((text(&r, "result"), text(&r, "warning")), ("ok".into(), String::new()), "{r:?}");
        send(&mut e, &m, "d0", vec![("command", "delete".into()), ("call-id", "cfBXzDSZqhYNcXM".into())]);

        let mut o = offer(OFFER_SDP);
        o[6].1 = Value::List(vec!["origin".into(), "zero-address".into(), "username".into()]);
        o.push(("transport-protocol", "RTP/AVPF".into()));
        o.push(("interface", "internal".into()));
        o.push(("codec", Value::dict([("strip", Value::List(vec!["PCMU".into()])), ("transcode", Value::List(vec!["G729".into()]))])));
        o[5].1 = Value::List(vec![
            "trust address".into(),
            "media-handover".into(),
            "loop-protect".into(),
            "frobnicate".into(),
            "codec-strip-PCMA".into(),
            "codec-accept-PCMU".into(),
        ]);
        o.push(("record call", "yes".into()));
        let r = send(&mut e, &m, "o1", o);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let w = text(&r, "warning");
        for named in [
            "frobnicate",
            "codec-accept-pcmu (not supported: no transcoding",
            "codec.transcode (not supported: no transcoding",
            "replace=username",
            "interface (not supported: interfaces are chosen with direction",
            "record-call: nothing is recorded (no ng.recording_dir configured)",
        ] {
            assert!(w.contains(named), "{named:?} not in the warning {w:?}");
        }
        for acted in [
            "trust-address",
            "media-handover",
            "replace=origin",
            "replace=zero-address",
            "call-id",
            "sdp",
            "loop-protect",
            "codec-strip",
            "codec.strip",
            "transport-protocol",
        ] {
            assert!(!w.contains(acted), "{acted:?} is acted on but named in {w:?}");
        }
        // Commands without flags name theirs; errors carry the error only.
        let q = send(&mut e, &m, "q1", vec![("command", "query".into()), ("call-id", "cfBXzDSZqhYNcXM".into()), ("flags", Value::List(vec!["all".into()]))]);
        assert_eq!(text(&q, "warning"), "not acted on by query: all", "{q:?}");
        let bad = send(&mut e, &m, "q2", vec![("command", "query".into()), ("call-id", "nope".into()), ("frob", "1".into())]);
        assert_eq!((text(&bad, "result"), text(&bad, "warning")), ("error".into(), String::new()), "{bad:?}");
        // A wrong tag is named as sent, not as Rust's Option.
        assert_eq!(text(&send(&mut e, &m, "a1", answer(ANSWER_SDP)), "result"), "ok");
        let d = send(&mut e, &m, "d1", vec![("command", "delete".into()), ("call-id", "cfBXzDSZqhYNcXM".into()), ("from-tag", "nobody".into())]);
        assert_eq!(text(&d, "warning"), "tags \"nobody\"/none are not in dialogue in call \"cfBXzDSZqhYNcXM\"", "{d:?}");
    }

    /// The m= line and the rtpmap/fmtp/rtcp-fb lines of an SDP.
    fn codec_lines(sdp: &str) -> Vec<String> {
        let m_port = m_port(sdp);
        sdp.lines()
            .filter(|l| l.starts_with("m=") || l.starts_with("a=rtpmap") || l.starts_with("a=fmtp") || l.starts_with("a=rtcp-fb"))
            .map(|l| l.replace(&m_port, "P"))
            .collect()
    }

    fn m_port(sdp: &str) -> String {
        sdp.lines().find_map(|l| l.strip_prefix("m=audio ")).and_then(|r| r.split(' ').next()).unwrap_or("").to_string()
    }

    const FOUR_CODECS: &str = "v=0\r\no=alice 1 1 IN IP4 198.51.100.1\r\ns=-\r\nc=IN IP4 198.51.100.1\r\nt=0 0\r\nm=audio 49170 RTP/AVP 0 8 9 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:8 PCMA/8000\r\na=rtcp-fb:8 nack\r\na=rtpmap:9 G722/8000\r\na=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-16\r\na=sendrecv\r\n";

    fn with_flags(mut req: Vec<(&'static str, Value)>, flags: &[&str]) -> Vec<(&'static str, Value)> {
        req[5].1 = list(flags);
        req
    }

    const SRTP_OFFER: &str = "v=0\r\no=alice 1 1 IN IP4 198.51.100.1\r\ns=-\r\nc=IN IP4 198.51.100.1\r\nt=0 0\r\nm=audio 49170 RTP/SAVP 0\r\n\
a=rtpmap:0 PCMU/8000\r\n\
a=crypto:1 F8_128_HMAC_SHA1_80 inline:MTIzNDU2Nzg5MEFCQ0RFRjEyMzQ1Njc4OTBBQkNE\r\n\
a=crypto:2 AES_CM_128_HMAC_SHA1_80 inline:QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVoxMjM0|2^31\r\n\
a=crypto:3 AES_CM_128_HMAC_SHA1_32 inline:YWJjZGVmZ2hpamtsbW5vcHFyc3R1dnd4eXoxMjM0\r\n\
a=sendrecv\r\n";

    fn crypto_lines(sdp: &str) -> Vec<String> {
        sdp.lines().filter(|l| l.starts_with("a=crypto:")).map(str::to_string).collect()
    }

    fn m_line(sdp: &str) -> String {
        sdp.lines().find(|l| l.starts_with("m=")).unwrap().to_string()
    }

    /// The SRTP of the call's RTP relay legs [A, B].
    fn leg_srtp(m: &SessionManager) -> [Option<mediaplane_core::srtp::LegSrtp>; 2] {
        m.read(|model, _| {
            let r = model.relays.values().next().expect("a relay");
            [r.a.srtp.clone(), r.b.srtp.clone()]
        })
    }

    fn inline_key(line: &str) -> Vec<u8> {
        use base64::Engine as _;
        let b64 = line.split("inline:").nth(1).unwrap().split(['|', ' ']).next().unwrap();
        base64::engine::general_purpose::STANDARD_NO_PAD.decode(b64.trim_end_matches('=')).unwrap()
    }

    /// What Chrome offers for one microphone (trimmed): DTLS-SRTP with ICE, rtcp-mux, a mid.
    const WEBRTC_OFFER: &str = "v=0\r\no=- 4611731400430051336 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\na=group:BUNDLE 0\r\n\
a=extmap-allow-mixed\r\na=msid-semantic: WMS\r\nm=audio 50000 UDP/TLS/RTP/SAVPF 111 0\r\nc=IN IP4 198.51.100.9\r\n\
a=rtcp:9 IN IP4 0.0.0.0\r\na=candidate:1 1 udp 2122260223 198.51.100.9 50000 typ host generation 0\r\n\
a=ice-ufrag:brws\r\na=ice-pwd:browserpasswordbrowser12\r\na=ice-options:trickle\r\n\
a=fingerprint:sha-256 AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89\r\n\
a=setup:actpass\r\na=mid:0\r\na=sendrecv\r\na=rtcp-mux\r\na=rtpmap:111 opus/48000/2\r\na=rtpmap:0 PCMU/8000\r\n";

    fn attr<'a>(sdp: &'a str, name: &str) -> Option<&'a str> {
        sdp.lines().find_map(|l| l.strip_prefix("a=").and_then(|a| a.strip_prefix(name)).and_then(|v| v.strip_prefix(':').or((v.is_empty()).then_some(""))))
    }

    /// What Chrome offers for a microphone and a camera with `bundlePolicy: max-bundle`
    /// (trimmed): one transport for both sections, each section's SSRC in `a=ssrc`.
    const BUNDLED_OFFER: &str = "v=0\r\no=- 4611731400430051337 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\na=group:BUNDLE 0 1\r\n\
a=msid-semantic: WMS\r\nm=audio 50000 UDP/TLS/RTP/SAVPF 111\r\nc=IN IP4 198.51.100.9\r\n\
a=rtcp:9 IN IP4 0.0.0.0\r\na=candidate:1 1 udp 2122260223 198.51.100.9 50000 typ host generation 0\r\n\
a=ice-ufrag:brws\r\na=ice-pwd:browserpasswordbrowser12\r\n\
a=fingerprint:sha-256 AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89\r\n\
a=setup:actpass\r\na=mid:0\r\na=sendrecv\r\na=rtcp-mux\r\na=rtpmap:111 opus/48000/2\r\na=ssrc:1111 cname:c\r\n\
m=video 50000 UDP/TLS/RTP/SAVPF 96\r\nc=IN IP4 198.51.100.9\r\na=rtcp:9 IN IP4 0.0.0.0\r\n\
a=ice-ufrag:brws\r\na=ice-pwd:browserpasswordbrowser12\r\n\
a=fingerprint:sha-256 AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89\r\n\
a=setup:actpass\r\na=mid:1\r\na=sendrecv\r\na=rtcp-mux\r\na=rtpmap:96 VP8/90000\r\n\
a=ssrc-group:FID 2222 3333\r\na=ssrc:2222 cname:c\r\na=ssrc:3333 cname:c\r\n";

    /// A browser bundling audio and video bridged to a plain callee with a port pair per
    /// section: the callee is offered no BUNDLE; the browser is answered with the group, one
    /// port and one set of credentials for both sections; its video leg is on the audio leg's
    /// address, taking SSRC 2222; the nomination the audio leg's handshake makes is both legs'.
    #[test]
    fn a_browsers_bundle_is_accepted_on_one_transport() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mut o = offer(BUNDLED_OFFER);
        o.extend([("transport-protocol", "RTP/AVP".into()), ("ICE", "remove".into())]);
        let to_callee = text(&send(&mut e, &m, "o1", o), "sdp");
        assert!(!to_callee.contains("a=group"), "{to_callee}");
        let ports = |sdp: &str| sdp.lines().filter_map(|l| l.strip_prefix("m=")).map(|l| l.split(' ').nth(1).unwrap().to_string()).collect::<Vec<_>>();
        let callee_ports = ports(&to_callee);
        assert_ne!(callee_ports[0], callee_ports[1], "the callee's sections keep ports of their own: {to_callee}");
        let callee_answer = "v=0\r\no=bob 1 1 IN IP4 198.51.100.2\r\ns=-\r\nc=IN IP4 198.51.100.2\r\nt=0 0\r\n\
m=audio 3456 RTP/AVP 111\r\na=rtpmap:111 opus/48000/2\r\nm=video 3458 RTP/AVP 96\r\na=rtpmap:96 VP8/90000\r\n";
        let to_caller = text(&send(&mut e, &m, "a1", answer(callee_answer)), "sdp");
        assert!(to_caller.contains("\r\na=group:BUNDLE 0 1\r\n"), "{to_caller}");
        let caller_ports = ports(&to_caller);
        assert_eq!(caller_ports[0], caller_ports[1], "one transport: {to_caller}");
        let ufrags: Vec<&str> = to_caller.lines().filter_map(|l| l.strip_prefix("a=ice-ufrag:")).collect();
        assert!(ufrags.len() == 2 && ufrags[0] == ufrags[1], "{to_caller}");

        let key = calls::call_key("cfBXzDSZqhYNcXM");
        let (audio, video) = m.read(|model, _| (model.relays[&calls::rtp_relay_id(&key, 0)].clone(), model.relays[&calls::rtp_relay_id(&key, 1)].clone()));
        assert_eq!(video.a.local, audio.a.local);
        assert_eq!(video.a.bundled.as_ref().map(|b| b.ssrc), Some(2222));
        assert_ne!(video.b.local, audio.b.local);
        let pwd = to_caller.lines().find_map(|l| l.strip_prefix("a=ice-pwd:")).unwrap();
        use mediaplane_webrtc::stun::{attr as stun_attr, Builder, Class, BINDING};
        let check = Builder::new(BINDING, Class::Request, [5; 12])
            .attribute(stun_attr::USERNAME, format!("{}:brws", ufrags[0]).as_bytes())
            .attribute(stun_attr::USE_CANDIDATE, &[])
            .integrity(pwd.as_bytes())
            .fingerprint();
        let browser: SocketAddr = "198.51.100.9:50000".parse().unwrap();
        m.on_handshake(audio.a.uid, audio.a.local, browser, 1, &check);
        let remotes = m.read(|model, _| (0..2).map(|i| model.relays[&calls::rtp_relay_id(&key, i)].a.remote).collect::<Vec<_>>());
        assert_eq!(remotes, [Some(browser), Some(browser)]);
        assert!(m.crypto_leg(video.a.uid).is_none(), "the video leg has no handshake of its own");

        // The browser's re-offer keeps the group; one that stops its camera (no a=ssrc in the
        // video section) keeps the video on the transport; one that takes video out of the
        // group is refused.
        let mut o = offer(BUNDLED_OFFER);
        o.extend([("transport-protocol", "RTP/AVP".into()), ("ICE", "remove".into())]);
        assert_eq!(text(&send(&mut e, &m, "o2", o), "result"), "ok");
        let camera_off = BUNDLED_OFFER
            .replace("a=ssrc-group:FID 2222 3333\r\na=ssrc:2222 cname:c\r\na=ssrc:3333 cname:c\r\n", "")
            .replace("a=mid:1\r\na=sendrecv", "a=mid:1\r\na=recvonly");
        assert!(!camera_off.contains("2222"));
        let mut o = offer(&camera_off);
        o.extend([("transport-protocol", "RTP/AVP".into()), ("ICE", "remove".into())]);
        let r = send(&mut e, &m, "o2b", o);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        assert_eq!(m.read(|model, _| model.relays[&calls::rtp_relay_id(&key, 1)].a.bundled.clone()), video.a.bundled, "still on the transport");
        let mut o = offer(&BUNDLED_OFFER.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0"));
        o.extend([("transport-protocol", "RTP/AVP".into()), ("ICE", "remove".into())]);
        let r = send(&mut e, &m, "o3", o);
        assert_eq!(text(&r, "result"), "error", "{r:?}");
        assert!(text(&r, "error-reason").contains("BUNDLE"), "{r:?}");
        assert_eq!(m.read(|model, _| model.relays[&calls::rtp_relay_id(&key, 1)].a.bundled.clone()), video.a.bundled, "nothing changed");
    }

    #[test]
    fn webrtc_caller_bridged_to_a_plain_callee() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mut o = offer(WEBRTC_OFFER);
        o.push(("transport-protocol", "RTP/AVP".into()));
        o.push(("ICE", "remove".into()));
        let r = send(&mut e, &m, "o1", o);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        assert!(!r.get("warning").is_some_and(|w| w.as_str().is_some_and(|w| w.contains("ICE"))), "{r:?}");
        let to_callee = text(&r, "sdp");
        assert_eq!(m_line(&to_callee), "m=audio 30002 RTP/AVP 111 0");
        for gone in ["candidate", "ice-ufrag", "ice-pwd", "ice-options", "fingerprint", "setup"] {
            assert_eq!(attr(&to_callee, gone), None, "{gone} stripped: {to_callee}");
        }
        // The caller's leg is an ICE leg keyed by its handshake: SRTP with no key yet.
        let (ice, srtp) = m.read(|model, _| {
            let r = model.relays.values().next().unwrap();
            ((r.a.ice, r.b.ice), (r.a.srtp.clone(), r.b.srtp.clone()))
        });
        assert_eq!(ice, (true, false));
        assert_eq!(srtp, (Some(Default::default()), None));
        m.read(|_, t| assert!(t.streams.values().any(|e| e.handshake && !e.inbound.is_clear()), "the table hands its STUN and DTLS up"));

        let r = send(&mut e, &m, "a1", answer(ANSWER_SDP));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let to_caller = text(&r, "sdp");
        assert_eq!(m_line(&to_caller), "m=audio 30000 UDP/TLS/RTP/SAVPF 8", "back in the protocol the caller offered");
        assert!(to_caller.contains("\r\na=ice-lite\r\nm=audio"), "session-level ice-lite: {to_caller}");
        assert_eq!(attr(&to_caller, "candidate"), Some("1 1 UDP 2130706431 203.0.113.5 30000 typ host"));
        assert_eq!(attr(&to_caller, "setup"), Some("passive"), "the browser offered actpass: the relay is the DTLS server");
        assert_eq!(attr(&to_caller, "mid"), Some("0"), "the offer's mid");
        assert!(attr(&to_caller, "rtcp-mux").is_some() && attr(&to_caller, "end-of-candidates").is_some(), "{to_caller}");
        assert_eq!(attr(&to_caller, "fingerprint"), Some(m.dtls_fingerprint().to_sdp().as_str()));
        // `query` reports each party in its own protocol, the browser's media flagged as
        // rtpengine flags what it terminates (its ng_stats_media: "DTLS-SRTP", "ICE"); no crypto
        // suite before the handshake keyed the leg.
        let q = send(&mut e, &m, "q1", vec![("command", "query".into()), ("call-id", "cfBXzDSZqhYNcXM".into())]);
        let media = |tag: &str| {
            q.get("tags").and_then(|t| t.get(tag)).and_then(|t| t.get("medias")).and_then(|m| m.as_list()).and_then(|m| m.first()).cloned().unwrap()
        };
        let flags = |m: &Value| m.get("flags").and_then(Value::as_list).unwrap().iter().filter_map(|f| f.as_str().map(str::to_string)).collect::<Vec<_>>();
        let (caller, callee) = (media("mS9rSAn0Cr"), media("8fa3b2"));
        assert_eq!(caller.get("protocol").and_then(Value::as_str), Some("UDP/TLS/RTP/SAVPF"));
        assert_eq!(flags(&caller), ["initialized", "send", "recv", "DTLS-SRTP", "ICE"]);
        assert_eq!(callee.get("protocol").and_then(Value::as_str), Some("RTP/AVP"));
        assert_eq!(flags(&callee), ["initialized", "send", "recv"]);
        assert!(!q.encode().windows(12).any(|w| w == b"crypto suite"), "{q:?}");
        let (ufrag, pwd) = (attr(&to_caller, "ice-ufrag").unwrap(), attr(&to_caller, "ice-pwd").unwrap());
        assert!(ufrag.len() >= 4 && pwd.len() >= 22);
        // The control plane has the leg's handshake: a check signed with the relay's password
        // (as the browser learns it from this answer) is answered and nominates its source,
        // which becomes the leg's only peer; one signed otherwise does nothing.
        let uid = m.read(|model, _| model.relays.values().next().unwrap().a.uid);
        let view = m.crypto_leg(uid).expect("the caller's leg has ICE state");
        assert_eq!((view.dtls_role, view.nominated, view.keyed), ("passive", None, false));
        use mediaplane_webrtc::stun::{attr as stun_attr, Builder, Class, BINDING};
        let check = |pwd: &str| {
            Builder::new(BINDING, Class::Request, [9; 12])
                .attribute(stun_attr::USERNAME, format!("{ufrag}:brws").as_bytes())
                .attribute(stun_attr::USE_CANDIDATE, &[])
                .integrity(pwd.as_bytes())
                .fingerprint()
        };
        let (local, browser): (SocketAddr, SocketAddr) = ("203.0.113.5:30000".parse().unwrap(), "198.51.100.9:50000".parse().unwrap());
        m.on_handshake(uid, local, browser, 1, &check("not-the-relays-password-x"));
        assert_eq!(m.crypto_leg(uid).map(|v| (v.checks_refused, v.nominated)), Some((1, None)));
        m.on_handshake(uid, local, browser, 2, &check(pwd));
        assert_eq!(m.crypto_leg(uid).map(|v| (v.checks_answered, v.nominated)), Some((1, Some(browser))));
        assert_eq!(m.read(|model, _| model.relays.values().next().unwrap().a.remote), Some(browser), "the nominated address is the leg's peer");

        // A re-offer from the browser without an ICE restart keeps the relay's credentials.
        let mut o = offer(WEBRTC_OFFER);
        o.push(("transport-protocol", "RTP/AVP".into()));
        send(&mut e, &m, "o2", o);
        let r = send(&mut e, &m, "a2", answer(ANSWER_SDP));
        assert_eq!(attr(&text(&r, "sdp"), "ice-ufrag"), Some(ufrag));
    }

    /// A directory for a store that outlives a manager (a restart), and the media config.
    fn restart_dir(name: &str) -> (std::path::PathBuf, MediaConfig) {
        let dir = std::env::temp_dir().join(format!("mp-ng-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        (dir, MediaConfig { ip: "203.0.113.5".parse().unwrap(), port_min: 30000, port_max: 30019, ..Default::default() })
    }

    /// A browser's call to a plain callee through `m`: the engine, and the SDP the browser got.
    fn browser_call(m: &SessionManager) -> (Engine, String) {
        let mut e = Engine::new(EngineConfig::default());
        let mut o = offer(WEBRTC_OFFER);
        o.extend([("transport-protocol", "RTP/AVP".into()), ("ICE", "remove".into())]);
        send(&mut e, m, "o1", o);
        let to_caller = text(&send(&mut e, m, "a1", answer(ANSWER_SDP)), "sdp");
        (e, to_caller)
    }

    /// A restart keeps a browser's call: the ICE leg's credentials are stored with it, so the
    /// restarted relay answers the browser's consent checks from its nominated address (and
    /// refuses a check signed otherwise); the stored credentials never show in the API's view.
    #[test]
    fn an_ice_leg_answers_consent_checks_after_a_restart() {
        let (dir, media) = restart_dir("ice-restart");
        let open = || SessionManager::open(Store::open(&dir.join("store.db")).unwrap(), Arc::new(NullDataplane), media.clone(), Limits::default()).unwrap();
        let m = open();
        let (mut e, to_caller) = browser_call(&m);
        let (ufrag, pwd) = (attr(&to_caller, "ice-ufrag").unwrap().to_string(), attr(&to_caller, "ice-pwd").unwrap().to_string());
        use mediaplane_webrtc::stun::{attr as stun_attr, Builder, Class, BINDING};
        let check = |pwd: &str, nominate: bool, tx: u8| {
            let b = Builder::new(BINDING, Class::Request, [tx; 12]).attribute(stun_attr::USERNAME, format!("{ufrag}:brws").as_bytes());
            let b = if nominate { b.attribute(stun_attr::USE_CANDIDATE, &[]) } else { b };
            b.integrity(pwd.as_bytes()).fingerprint()
        };
        let (local, browser): (SocketAddr, SocketAddr) = ("203.0.113.5:30000".parse().unwrap(), "198.51.100.9:50000".parse().unwrap());
        let uid = m.read(|model, _| model.relays.values().next().unwrap().a.uid);
        m.on_handshake(uid, local, browser, 1, &check(&pwd, true, 1));
        assert_eq!(m.crypto_leg(uid).and_then(|v| v.nominated), Some(browser));
        let fingerprint = attr(&to_caller, "fingerprint").unwrap().to_string();
        assert_eq!(fingerprint, m.dtls_fingerprint().to_sdp());
        drop(m);

        let m = open();
        // The same certificate: the fingerprint the browser checked is still the relay's.
        assert_eq!(m.dtls_fingerprint().to_sdp(), fingerprint, "the certificate was kept in the store");
        let view = m.crypto_leg(uid).expect("the leg's ICE state resumed");
        assert_eq!((view.nominated, view.checks_answered), (Some(browser), 0));
        m.on_handshake(uid, local, browser, 2, &check(&pwd, false, 2));
        m.on_handshake(uid, local, browser, 3, &check("not-the-relays-password-x", false, 3));
        let view = m.crypto_leg(uid).unwrap();
        assert_eq!((view.checks_answered, view.checks_refused, view.nominated), (1, 1, Some(browser)));
        assert_eq!(m.read(|model, _| model.relays.values().next().unwrap().a.remote), Some(browser), "still the leg's peer");
        let stored = m.read(|model, _| model.relays.values().next().unwrap().a.ice_credentials.clone()).unwrap();
        assert!(stored.local_pwd == pwd && !format!("{stored:?}").contains(&pwd), "kept, and out of Debug");
        assert_eq!(stored.remote_fingerprint.as_deref(), attr(WEBRTC_OFFER, "fingerprint"), "the browser's fingerprint kept");
        // The browser's re-offer after the restart is answered with the same credentials and
        // fingerprint, and starts no new handshake.
        let mut o = offer(WEBRTC_OFFER);
        o.extend([("transport-protocol", "RTP/AVP".into()), ("ICE", "remove".into())]);
        send(&mut e, &m, "o2", o);
        let again = text(&send(&mut e, &m, "a2", answer(ANSWER_SDP)), "sdp");
        assert_eq!((attr(&again, "ice-ufrag"), attr(&again, "fingerprint")), (Some(ufrag.as_str()), Some(fingerprint.as_str())));
        assert_eq!(m.crypto_leg(uid).map(|v| v.dtls), Some("waiting".to_string()));
        drop(m);

        // --reset forgets the certificate with the sessions.
        let mut store = Store::open(&dir.join("store.db")).unwrap();
        store.clear().unwrap();
        let m = SessionManager::open(store, Arc::new(NullDataplane), media.clone(), Limits::default()).unwrap();
        assert_ne!(m.dtls_fingerprint().to_sdp(), fingerprint);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A leg the relay keyed as the DTLS client before a restart keeps its keys: the restarted
    /// relay starts no new handshake when the peer's checks come (the peer has its session),
    /// until signalling changes the peer's fingerprint.
    #[test]
    fn a_resumed_dtls_client_leg_starts_no_new_handshake() {
        let (dir, media) = restart_dir("dtls-client-restart");
        let open = || SessionManager::open(Store::open(&dir.join("store.db")).unwrap(), Arc::new(NullDataplane), media.clone(), Limits::default()).unwrap();
        let m = open();
        let (_, to_caller) = browser_call(&m);
        let (ufrag, pwd) = (attr(&to_caller, "ice-ufrag").unwrap().to_string(), attr(&to_caller, "ice-pwd").unwrap().to_string());
        // As if the relay had been the client (`a=setup:active`) and the handshake had keyed it.
        let id = m.read(|model, _| model.relays.keys().next().unwrap().clone());
        let key = mediaplane_core::srtp::SrtpKey { suite: mediaplane_core::srtp::SrtpSuite::AeadAes128Gcm, master: vec![7; 28] };
        m.mutate(|model, _| {
            let mut c = model.relays[&id].a.ice_credentials.clone().unwrap();
            c.dtls_client = true;
            model.set_leg_ice_credentials(&id, Side::A, Some(c))?;
            model.set_leg_srtp(&id, Side::A, Some(mediaplane_core::srtp::LegSrtp { inbound: Some(key.clone()), outbound: Some(key.clone()) }))?;
            Ok(((), vec![Change::Relay(id.clone())]))
        })
        .unwrap();
        let uid = m.read(|model, _| model.relays[&id].a.uid);
        drop(m);

        let m = open();
        let view = m.crypto_leg(uid).unwrap();
        assert_eq!((view.dtls_role, view.keyed, view.dtls.as_str()), ("active", true, "waiting"));
        use mediaplane_webrtc::stun::{attr as stun_attr, Builder, Class, BINDING};
        let check = Builder::new(BINDING, Class::Request, [4; 12])
            .attribute(stun_attr::USERNAME, format!("{ufrag}:brws").as_bytes())
            .attribute(stun_attr::USE_CANDIDATE, &[])
            .integrity(pwd.as_bytes())
            .fingerprint();
        let (local, browser): (SocketAddr, SocketAddr) = ("203.0.113.5:30000".parse().unwrap(), "198.51.100.9:50000".parse().unwrap());
        m.on_handshake(uid, local, browser, 1, &check);
        let view = m.crypto_leg(uid).unwrap();
        assert_eq!((view.checks_answered, view.keyed, view.dtls.as_str()), (1, true, "waiting"), "no ClientHello to a peer that has its session");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn generate_mid_and_rtcp_mux_require_are_acted_on_toward_webrtc_only() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let flags = || ("flags", list(&["generate-mid", "rtcp-mux-require"]));
        // Toward a plain party nothing is generated: said, not swallowed.
        let mut o = offer(OFFER_SDP);
        o[5] = flags();
        let r = send(&mut e, &m, "plain", o);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let w = text(&r, "warning");
        assert!(w.contains("generate-mid is acted on only toward a WebRTC party") && w.contains("rtcp-mux-require is acted on only"), "{w}");
        assert_eq!(attr(&text(&r, "sdp"), "mid"), None);
        // Toward a browser: a=mid and rtcp-mux, no warning.
        let mut o = offer(OFFER_SDP);
        (o[1].1, o[5]) = ("webrtc-call".into(), flags());
        o.extend([("transport-protocol", "UDP/TLS/RTP/SAVPF".into()), ("ICE", "force".into())]);
        let r = send(&mut e, &m, "webrtc", o);
        assert!(r.get("warning").is_none(), "{r:?}");
        let sdp = text(&r, "sdp");
        assert!(attr(&sdp, "mid").is_some() && attr(&sdp, "rtcp-mux").is_some(), "{sdp}");
    }

    #[test]
    fn plain_caller_bridged_to_a_webrtc_callee() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mut o = offer(OFFER_SDP);
        o.push(("transport-protocol", "UDP/TLS/RTP/SAVPF".into()));
        o.push(("ICE", "force".into()));
        let r = send(&mut e, &m, "o1", o);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        assert!(r.get("warning").is_none(), "{r:?}");
        let to_browser = text(&r, "sdp");
        assert_eq!(m_line(&to_browser), "m=audio 30002 UDP/TLS/RTP/SAVPF 8 101");
        assert_eq!(attr(&to_browser, "setup"), Some("actpass"));
        assert_eq!(attr(&to_browser, "mid"), Some("0"), "a mid where the offer had none");
        assert!(attr(&to_browser, "rtcp-mux").is_some() && attr(&to_browser, "ice-lite").is_some(), "{to_browser}");
        assert_eq!(attr(&to_browser, "candidate"), Some("1 1 UDP 2130706431 203.0.113.5 30002 typ host"));

        for needed in ["ice-ufrag", "ice-pwd", "fingerprint", "end-of-candidates"] {
            assert!(attr(&to_browser, needed).is_some(), "{needed}: {to_browser}");
        }
        let leg_b = |m: &SessionManager| m.read(|model, _| model.relays.values().next().map(|r| (r.b.ice, r.b.srtp.clone())).unwrap());
        assert_eq!(leg_b(&m), (true, Some(Default::default())), "the callee's leg waits for its handshake");
        let uid = m.read(|model, _| model.relays.values().next().unwrap().b.uid);
        assert_eq!(m.crypto_leg(uid).map(|v| v.dtls_role), Some("passive"), "until the answer says");
        // The browser answers as the DTLS server (setup:passive): the relay connects.
        let browser =
            WEBRTC_OFFER.replace("m=audio 50000 UDP/TLS/RTP/SAVPF 111 0", "m=audio 50000 UDP/TLS/RTP/SAVPF 8").replace("a=setup:actpass", "a=setup:passive");
        let r = send(&mut e, &m, "a1", answer(&browser));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let to_caller = text(&r, "sdp");
        assert_eq!(m_line(&to_caller), "m=audio 30000 RTP/AVP 8");
        for gone in ["candidate", "ice-ufrag", "fingerprint", "setup", "ice-lite"] {
            assert_eq!(attr(&to_caller, gone), None, "{gone} stripped: {to_caller}");
        }
        assert_eq!(m.crypto_leg(uid).map(|v| v.dtls_role), Some("active"), "the answer's role reached the handshake");
        assert!(leg_b(&m).0);

        // An answer that refuses DTLS-SRTP is an error, not a silent plain leg.
        let mut o = offer(OFFER_SDP);
        o.push(("transport-protocol", "UDP/TLS/RTP/SAVPF".into()));
        send(&mut e, &m, "o2", o);
        let r = send(&mut e, &m, "a2", answer(ANSWER_SDP));
        assert_eq!(text(&r, "result"), "error", "{r:?}");
        assert!(text(&r, "error-reason").contains("refuses DTLS-SRTP"), "{r:?}");
    }

    #[test]
    fn dtls_srtp_bridged_to_sdes_srtp_both_ways() {
        // A browser (DTLS-SRTP) calls an SDES party: the callee is offered RTP/SAVP with the
        // relay's keys and nothing of ICE or DTLS; its answer's key keys its leg; the browser
        // gets the relay's ICE and DTLS attributes and no a=crypto.
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mut o = offer(WEBRTC_OFFER);
        o.extend([("transport-protocol", "RTP/SAVP".into()), ("ICE", "remove".into())]);
        let r = send(&mut e, &m, "o1", o);
        assert_eq!((text(&r, "result"), text(&r, "warning")), ("ok".into(), String::new()), "{r:?}");
        let to_callee = text(&r, "sdp");
        assert_eq!(m_line(&to_callee), "m=audio 30002 RTP/SAVP 111 0");
        for gone in ["candidate", "ice-ufrag", "fingerprint", "setup"] {
            assert_eq!(attr(&to_callee, gone), None, "{gone} stripped: {to_callee}");
        }
        let offered = crypto_lines(&to_callee);
        assert_eq!(offered.len(), 8, "{to_callee}");
        let callee_key = b"zyxwvutsrqponmlkjihgfedcba0987".to_vec();
        let answer_sdp = ANSWER_SDP.replace("RTP/AVP 8", "RTP/SAVP 0")
            + &format!("a=crypto:7 AES_CM_128_HMAC_SHA1_80 inline:{}\r\n", {
                use base64::Engine as _;
                base64::engine::general_purpose::STANDARD_NO_PAD.encode(&callee_key)
            });
        let r = send(&mut e, &m, "a1", answer(&answer_sdp));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let to_caller = text(&r, "sdp");
        assert_eq!(m_line(&to_caller), "m=audio 30000 UDP/TLS/RTP/SAVPF 0");
        assert!(crypto_lines(&to_caller).is_empty(), "{to_caller}");
        for needed in ["ice-ufrag", "ice-pwd", "fingerprint", "setup", "candidate"] {
            assert!(attr(&to_caller, needed).is_some(), "{needed}: {to_caller}");
        }
        let (a, b) = m.read(|model, _| model.relays.values().next().map(|r| ((r.a.ice, r.a.srtp.clone()), (r.b.ice, r.b.srtp.clone()))).unwrap());
        assert_eq!(a, (true, Some(Default::default())), "the browser's leg waits for its handshake");
        let b_srtp = b.1.expect("the SDES leg is keyed");
        assert!(!b.0);
        assert_eq!(b_srtp.inbound.map(|k| k.master), Some(callee_key));
        assert_eq!(b_srtp.outbound.map(|k| k.master), Some(inline_key(&offered[6])), "the relay's key under the accepted tag 7");
        let q = send(&mut e, &m, "q1", vec![("command", "query".into()), ("call-id", "cfBXzDSZqhYNcXM".into())]);
        let flags = |tag: &str| {
            let medias = q.get("tags").and_then(|t| t.get(tag)).and_then(|t| t.get("medias")).and_then(|m| m.as_list()).unwrap();
            medias[0].get("flags").and_then(Value::as_list).unwrap().iter().filter_map(|f| f.as_str().map(str::to_string)).collect::<Vec<_>>()
        };
        assert_eq!(flags("mS9rSAn0Cr"), ["initialized", "send", "recv", "DTLS-SRTP", "ICE"]);
        assert_eq!(flags("8fa3b2"), ["initialized", "send", "recv", "SDES"]);

        // An SDES caller to a browser: the browser gets the relay's ICE and DTLS and no
        // a=crypto; the caller is answered RTP/SAVP with the relay's key under its tag.
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mut o = offer(SRTP_OFFER);
        o.extend([("transport-protocol", "UDP/TLS/RTP/SAVPF".into()), ("ICE", "force".into())]);
        let r = send(&mut e, &m, "o1", o);
        assert_eq!((text(&r, "result"), text(&r, "warning")), ("ok".into(), String::new()), "{r:?}");
        let to_browser = text(&r, "sdp");
        assert_eq!(m_line(&to_browser), "m=audio 30002 UDP/TLS/RTP/SAVPF 0");
        assert!(crypto_lines(&to_browser).is_empty() && attr(&to_browser, "fingerprint").is_some(), "{to_browser}");
        let browser = WEBRTC_OFFER.replace("m=audio 50000 UDP/TLS/RTP/SAVPF 111 0", "m=audio 50000 UDP/TLS/RTP/SAVPF 0");
        let r = send(&mut e, &m, "a1", answer(&browser));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let to_caller = text(&r, "sdp");
        assert_eq!(m_line(&to_caller), "m=audio 30000 RTP/SAVP 0");
        let answered = crypto_lines(&to_caller);
        assert!(answered.len() == 1 && answered[0].starts_with("a=crypto:2 AES_CM_128_HMAC_SHA1_80 inline:"), "{to_caller}");
        for gone in ["candidate", "ice-ufrag", "fingerprint", "setup"] {
            assert_eq!(attr(&to_caller, gone), None, "{gone} stripped: {to_caller}");
        }
        let (a, b) = m.read(|model, _| model.relays.values().next().map(|r| ((r.a.ice, r.a.srtp.clone()), (r.b.ice, r.b.srtp.clone()))).unwrap());
        assert!(!a.0 && b.0, "the caller's leg is SDES, the browser's ICE");
        assert_eq!(a.1.and_then(|l| l.outbound).map(|k| k.master), Some(inline_key(&answered[0])));
        assert_eq!(b.1, Some(Default::default()), "the browser's leg waits for its handshake");
    }

    #[test]
    fn sdes_caller_bridged_to_a_plain_callee() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mut o = offer(SRTP_OFFER);
        o.push(("transport-protocol", "RTP/AVP".into()));
        let r = send(&mut e, &m, "o1", o);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let to_callee = text(&r, "sdp");
        assert_eq!(m_line(&to_callee), "m=audio 30002 RTP/AVP 0");
        assert!(crypto_lines(&to_callee).is_empty(), "{to_callee}");
        assert!(to_callee.contains("a=sendrecv\r\n"), "other lines stay");
        // The first line with a suite mediaplane speaks (tag 2, its lifetime ignored) is the caller's key.
        let caller_key = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ1234".to_vec();
        let [a, b] = leg_srtp(&m);
        let a = a.expect("SRTP terminated toward the caller");
        assert_eq!(a.inbound.as_ref().map(|k| (&k.master, k.suite.name())), Some((&caller_key, "AES_CM_128_HMAC_SHA1_80")));
        assert!(b.is_none(), "the callee's leg is plain");

        let r = send(&mut e, &m, "a1", answer(ANSWER_SDP));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let to_caller = text(&r, "sdp");
        assert_eq!(m_line(&to_caller), "m=audio 30000 RTP/SAVP 8", "back in the protocol the caller offered");
        let lines = crypto_lines(&to_caller);
        assert_eq!(lines.len(), 1, "{to_caller}");
        assert!(lines[0].starts_with("a=crypto:2 AES_CM_128_HMAC_SHA1_80 inline:"), "{lines:?}");
        let ours = inline_key(&lines[0]);
        assert_eq!(ours.len(), 30);
        assert_ne!(ours, caller_key);
        let [a, _] = leg_srtp(&m);
        assert_eq!(a.unwrap().outbound.map(|k| k.master), Some(ours.clone()), "what the relay sends the caller is protected with the key it answered");
        // The table: the caller's packets are unprotected, the copies to it protected.
        m.read(|_, t| {
            let protections: Vec<_> = t.streams.values().map(|e| (e.inbound.is_clear(), e.copies.iter().all(|c| c.outbound.is_clear()))).collect();
            assert!(protections.contains(&(false, true)) && protections.contains(&(true, false)), "{protections:?}");
        });

        // A re-INVITE with the same key keeps the relay's key (and so the SRTP sessions).
        let mut o = offer(SRTP_OFFER);
        o.push(("transport-protocol", "RTP/AVP".into()));
        send(&mut e, &m, "o2", o);
        let r = send(&mut e, &m, "a2", answer(ANSWER_SDP));
        assert_eq!(inline_key(&crypto_lines(&text(&r, "sdp"))[0]), ours);
        let legs = leg_srtp(&m);

        // A re-INVITE from the plain callee, without transport-protocol: the call stays bridged.
        // The caller is offered SRTP again, with the relay's key under its tag.
        let mut re = offer(&ANSWER_SDP.replace("o=bob 2808844564 2808844564", "o=bob 2808844564 2808844565"));
        re[2].1 = "8fa3b2".into();
        re.push(("to-tag", "mS9rSAn0Cr".into()));
        let r = send(&mut e, &m, "o3", re);
        let to_caller = text(&r, "sdp");
        assert_eq!(m_line(&to_caller), "m=audio 30000 RTP/SAVP 8", "{r:?}");
        let lines = crypto_lines(&to_caller);
        assert_eq!(lines.len(), 1);
        assert!(lines[0].starts_with("a=crypto:2 AES_CM_128_HMAC_SHA1_80 inline:"));
        assert_eq!(inline_key(&lines[0]), ours);
        // The caller answers with its key: back to the callee as plain RTP, the legs unchanged.
        let caller_answer = SRTP_OFFER.replace("a=crypto:1 F8_128_HMAC_SHA1_80 inline:MTIzNDU2Nzg5MEFCQ0RFRjEyMzQ1Njc4OTBBQkNE\r\n", "");
        let caller_answer = caller_answer.replace("a=crypto:3 AES_CM_128_HMAC_SHA1_32 inline:YWJjZGVmZ2hpamtsbW5vcHFyc3R1dnd4eXoxMjM0\r\n", "");
        let mut ans = answer(&caller_answer);
        ans[2].1 = "8fa3b2".into();
        ans.last_mut().unwrap().1 = "mS9rSAn0Cr".into();
        let r = send(&mut e, &m, "a3", ans);
        assert_eq!(m_line(&text(&r, "sdp")), "m=audio 30002 RTP/AVP 0", "{r:?}");
        assert!(crypto_lines(&text(&r, "sdp")).is_empty());
        assert_eq!(leg_srtp(&m), legs, "same keys, same SRTP sessions");
    }

    #[test]
    fn plain_caller_bridged_to_an_sdes_callee() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mut o = offer(OFFER_SDP);
        o[5].1 = Value::List(vec!["trust address".into(), "RTP/SAVP".into()]);
        let r = send(&mut e, &m, "o1", o);
        assert_eq!((text(&r, "result"), text(&r, "warning")), ("ok".into(), String::new()), "{r:?}");
        let to_callee = text(&r, "sdp");
        assert_eq!(m_line(&to_callee), "m=audio 30002 RTP/SAVP 8 101");
        let offered = crypto_lines(&to_callee);
        // rtpengine 10.5's suites, tags and order (without its F8 and NULL suites, 9-12).
        let suites: Vec<(String, usize)> = offered.iter().map(|l| (l.split(" inline:").next().unwrap().to_string(), inline_key(l).len())).collect();
        let want = [
            ("a=crypto:1 AEAD_AES_256_GCM", 44),
            ("a=crypto:2 AEAD_AES_128_GCM", 28),
            ("a=crypto:3 AES_256_CM_HMAC_SHA1_80", 46),
            ("a=crypto:4 AES_256_CM_HMAC_SHA1_32", 46),
            ("a=crypto:5 AES_192_CM_HMAC_SHA1_80", 38),
            ("a=crypto:6 AES_192_CM_HMAC_SHA1_32", 38),
            ("a=crypto:7 AES_CM_128_HMAC_SHA1_80", 30),
            ("a=crypto:8 AES_CM_128_HMAC_SHA1_32", 30),
        ];
        assert_eq!(suites, want.map(|(l, n)| (l.to_string(), n)), "{to_callee}");
        assert!(offered.iter().all(|l| !l.split(" inline:").nth(1).unwrap().contains('=')), "no base64 padding, as rtpengine: {offered:?}");
        assert!(to_callee.ends_with(&format!("{}\r\n", offered[7])), "added at the end of the section");

        // The callee accepts tag 8 with its own key.
        let callee_key = b"zyxwvutsrqponmlkjihgfedcba0987".to_vec();
        let answer_sdp = ANSWER_SDP.replace("RTP/AVP 8", "RTP/SAVP 8")
            + &format!("a=crypto:8 AES_CM_128_HMAC_SHA1_32 inline:{}\r\n", {
                use base64::Engine as _;
                base64::engine::general_purpose::STANDARD.encode(&callee_key)
            });
        let r = send(&mut e, &m, "a1", answer(&answer_sdp));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let to_caller = text(&r, "sdp");
        assert_eq!(m_line(&to_caller), "m=audio 30000 RTP/AVP 8");
        assert!(crypto_lines(&to_caller).is_empty(), "{to_caller}");
        let [a, b] = leg_srtp(&m);
        assert!(a.is_none());
        let b = b.unwrap();
        assert_eq!(b.inbound.map(|k| k.master), Some(callee_key));
        assert_eq!(b.outbound.map(|k| k.master), Some(inline_key(&offered[7])), "the relay's key under the accepted tag");

        // An answer accepting no offered tag is refused, and changes nothing.
        let bad = answer_sdp.replace("a=crypto:8", "a=crypto:9");
        let r = send(&mut e, &m, "a2", answer(&bad));
        assert_eq!(
            text(&r, "error-reason"),
            "media section 1: the answer accepts none of the a=crypto keys offered to it (tags 1, 2, 3, 4, 5, 6, 7, 8)",
            "{r:?}"
        );
        let r = send(&mut e, &m, "a3", answer(ANSWER_SDP));
        assert!(text(&r, "error-reason").contains("refuses SRTP (RTP/AVP)"), "{r:?}");
        assert!(leg_srtp(&m)[1].is_some());
    }

    #[test]
    fn sdes_options_shape_what_is_offered_and_accepted() {
        // Plain caller to an SRTP callee: `no-` drops a suite (its tag stays), `lifetime` marks
        // every key given, `order:` is accepted, unsupported values are named.
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mut o = offer(OFFER_SDP);
        o[5].1 = Value::List(vec!["trust address".into(), "RTP/SAVP".into(), "SDES-no-AES_CM_128_HMAC_SHA1_80".into()]);
        o.push(("SDES", Value::List(vec!["lifetime".into(), "order:AES_CM_128_HMAC_SHA1_32".into(), "unencrypted_srtp".into(), "pad".into()])));
        let r = send(&mut e, &m, "o1", o);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let offered = crypto_lines(&text(&r, "sdp"));
        assert_eq!(offered.len(), 7, "{offered:?}");
        assert!(offered[0].starts_with("a=crypto:8 AES_CM_128_HMAC_SHA1_32 inline:") && offered[0].ends_with("|2^31"), "{offered:?}");
        assert!(offered.iter().all(|l| !l.contains("a=crypto:7 ")), "the suite of tag 7 is not offered");
        assert_eq!(inline_key(&offered[0]).len(), 30);
        // `pad`: the 28-byte AEAD_AES_128_GCM key keeps its two `=`.
        assert!(offered.iter().any(|l| l.starts_with("a=crypto:2 AEAD_AES_128_GCM inline:") && l.ends_with("==|2^31")), "{offered:?}");
        let warning = text(&r, "warning");
        assert!(warning.contains("unencrypted-srtp") && !warning.contains("lifetime") && !warning.contains("sdes-no"), "{warning}");

        // `only-` wins over `no-`; `nonew` leaves nothing to offer: an error, nothing changes.
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mut o = offer(OFFER_SDP);
        o[5].1 = Value::List(vec!["RTP/SAVP".into(), "SDES-only-AES_CM_128_HMAC_SHA1_80".into(), "SDES-no-AES_CM_128_HMAC_SHA1_80".into()]);
        let r = send(&mut e, &m, "o1", o);
        let offered = crypto_lines(&text(&r, "sdp"));
        assert!(offered.len() == 1 && offered[0].starts_with("a=crypto:7 AES_CM_128_HMAC_SHA1_80 inline:"), "{r:?}");
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mut o = offer(OFFER_SDP);
        o[5].1 = Value::List(vec!["RTP/SAVP".into(), "SDES-nonew".into()]);
        let r = send(&mut e, &m, "o1", o);
        assert!(text(&r, "error-reason").contains("the SDES options leave no suite to offer"), "{r:?}");
        assert_eq!(m.read(|model, _| model.relays.len()), 0, "nothing created");

        // SRTP caller to a plain callee: `offerer_pref` picks which of its keys the relay takes
        // (tag 3, _32, over the first usable, tag 2); `no-` of the only usable suites falls back
        // to the first usable one.
        for (flag, tag, suite) in [
            ("SDES-offerer_pref:AES_CM_128_HMAC_SHA1_32", 3, "AES_CM_128_HMAC_SHA1_32"),
            ("SDES-no-AES_CM_128_HMAC_SHA1_80", 3, "AES_CM_128_HMAC_SHA1_32"),
            ("SDES-only-AEAD_AES_256_GCM", 2, "AES_CM_128_HMAC_SHA1_80"),
        ] {
            let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
            let mut o = offer(SRTP_OFFER);
            o.push(("transport-protocol", "RTP/AVP".into()));
            o[5].1 = Value::List(vec![flag.into()]);
            let r = send(&mut e, &m, "o1", o);
            assert_eq!(text(&r, "result"), "ok", "{flag}: {r:?}");
            let [a, _] = leg_srtp(&m);
            assert_eq!(a.and_then(|l| l.inbound).map(|k| k.suite.name()), Some(suite), "{flag}");
            let r = send(&mut e, &m, "a1", answer(ANSWER_SDP));
            let lines = crypto_lines(&text(&r, "sdp"));
            assert!(lines.len() == 1 && lines[0].starts_with(&format!("a=crypto:{tag} {suite} inline:")), "{flag}: {lines:?}");
        }
    }

    #[test]
    fn sdes_offers_without_a_usable_key_are_refused_and_dtls_to_sdes_is_said_to_pass_through() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let unusable = SRTP_OFFER
            .replace("a=crypto:2 AES_CM_128_HMAC_SHA1_80", "a=crypto:2 AES_256_CM_HMAC_SHA1_80")
            .replace("AES_CM_128_HMAC_SHA1_32 inline:YWJjZGVmZ2hpamtsbW5vcHFyc3R1dnd4eXoxMjM0", "AES_CM_128_HMAC_SHA1_32 inline:YWJj|2^20|1:4");
        let mut o = offer(&unusable);
        o.push(("transport-protocol", "RTP/AVP".into()));
        let r = send(&mut e, &m, "o1", o);
        assert!(text(&r, "error-reason").starts_with("media section 1: no a=crypto line offers a suite and key mediaplane speaks"), "{r:?}");
        assert_eq!(m.read(|model, _| model.relays.len()), 0, "nothing created");
        // SRTP passthrough (no transport-protocol): untouched.
        let r = send(&mut e, &m, "o2", offer(SRTP_OFFER));
        assert_eq!(crypto_lines(&text(&r, "sdp")).len(), 3);
        assert_eq!(leg_srtp(&m), [None, None]);
        // SDES-SRTP to DTLS-SRTP is bridged (see dtls_srtp_bridged_to_sdes_srtp_both_ways).
        let mut o = offer(SRTP_OFFER);
        o.push(("transport-protocol", "UDP/TLS/RTP/SAVPF".into()));
        let r = send(&mut e, &m, "o3", o);
        assert!(r.get("warning").is_none(), "{r:?}");
        assert_eq!(m_line(&text(&r, "sdp")), "m=audio 30002 UDP/TLS/RTP/SAVPF 0");
        let mut o = offer(OFFER_SDP);
        o.push(("transport-protocol", "RTP/XYZ".into()));
        assert!(text(&send(&mut e, &m, "o4", o), "error-reason").contains("is not one of RTP/AVP"));
        // A translated profile comes back translated; an untranslated answer is left as answered.
        let mut o = offer(OFFER_SDP);
        o.push(("transport-protocol", "RTP/AVPF".into()));
        assert_eq!(m_line(&text(&send(&mut e, &m, "o5", o), "sdp")), "m=audio 30002 RTP/AVPF 8 101");
        let avpf_answer = ANSWER_SDP.replace("RTP/AVP 8", "RTP/AVPF 8");
        assert_eq!(m_line(&text(&send(&mut e, &m, "a5", answer(&avpf_answer)), "sdp")), "m=audio 30000 RTP/AVP 8", "in the offerer's profile");
        // A re-INVITE without transport-protocol stays translated.
        assert_eq!(m_line(&text(&send(&mut e, &m, "o6", offer(OFFER_SDP)), "sdp")), "m=audio 30002 RTP/AVPF 8 101");
        assert_eq!(m_line(&text(&send(&mut e, &m, "a6", answer(&avpf_answer)), "sdp")), "m=audio 30000 RTP/AVP 8");
        let other_call = |mut req: Vec<(&'static str, Value)>| {
            req[1].1 = "another-call".into();
            req
        };
        send(&mut e, &m, "o7", other_call(offer(OFFER_SDP)));
        let r = send(&mut e, &m, "a7", other_call(answer(&avpf_answer)));
        assert!(m_line(&text(&r, "sdp")).ends_with(" RTP/AVPF 8"), "never translated: left as answered {r:?}");
    }

    #[test]
    fn codec_strip_narrows_the_offer_and_its_answer() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let r = send(&mut e, &m, "o1", with_flags(offer(FOUR_CODECS), &["codec-strip-PCMA"]));
        assert_eq!((text(&r, "result"), text(&r, "warning")), ("ok".into(), String::new()), "{r:?}");
        assert_eq!(
            codec_lines(&text(&r, "sdp")),
            ["m=audio P RTP/AVP 0 9 101", "a=rtpmap:0 PCMU/8000", "a=rtpmap:9 G722/8000", "a=rtpmap:101 telephone-event/8000", "a=fmtp:101 0-16"]
        );
        // The answerer answers with the codec it was not offered: it goes from the answer too.
        let ans = ANSWER_SDP.replace("RTP/AVP 8\r\n", "RTP/AVP 8 0\r\n");
        let r = send(&mut e, &m, "a1", answer(&ans));
        assert_eq!(codec_lines(&text(&r, "sdp")), ["m=audio P RTP/AVP 0"], "{r:?}");
        // A re-offer without filter forgets it.
        let r = send(&mut e, &m, "o2", offer(FOUR_CODECS));
        assert_eq!(codec_lines(&text(&r, "sdp"))[0], "m=audio P RTP/AVP 0 8 9 101");
        assert_eq!(codec_lines(&text(&send(&mut e, &m, "a2", answer(&ans)), "sdp")), ["m=audio P RTP/AVP 8 0", "a=rtpmap:8 PCMA/8000"]);

        // strip all but the except list, mask, the dictionary form, offer's order.
        let cases: &[(&[&str], Option<Value>, &str)] = &[
            (&["codec-strip-all", "codec-except-PCMU"], None, "m=audio P RTP/AVP 0"),
            (&["codec-mask-PCMA", "codec-mask-g722"], None, "m=audio P RTP/AVP 0 101"),
            (&[], Some(Value::dict([("strip", list(&["all"])), ("offer", list(&["G722", "PCMU"]))])), "m=audio P RTP/AVP 9 0"),
            (&["codec-strip-8"], None, "m=audio P RTP/AVP 0 9 101"),
        ];
        for (i, (flags, dict, want)) in cases.iter().enumerate() {
            let mut o = with_flags(offer(FOUR_CODECS), flags);
            o[1].1 = format!("call-{i}").into();
            if let Some(d) = dict {
                o.push(("codec", d.clone()));
            }
            let r = send(&mut e, &m, &format!("c{i}"), o);
            assert_eq!(codec_lines(&text(&r, "sdp"))[0], *want, "{flags:?} {dict:?}: {r:?}");
            assert_eq!(text(&r, "warning"), "", "{r:?}");
        }
    }

    #[test]
    fn stripping_every_codec_keeps_the_list_with_a_warning() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let r = send(&mut e, &m, "o1", with_flags(offer(FOUR_CODECS), &["codec-strip-all", "codec-strip-opus/1/2/3"]));
        assert_eq!(text(&r, "result"), "ok");
        assert_eq!(text(&r, "sdp"), FOUR_CODECS.replace("IN IP4 198.51.100.1", "IN IP4 203.0.113.5").replace("49170", &m_port(&text(&r, "sdp"))));
        let w = text(&r, "warning");
        assert!(w.contains("would remove every codec of media section 1 (audio): its codecs are passed through unchanged"), "{w}");
        assert!(w.contains("codec-strip-opus/1/2/3 is not acted on"), "{w}");
    }

    #[test]
    fn loop_protect_marks_the_sdp_and_returns_its_own_unchanged() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig { instance_id: "mp-test-1".into(), ..Default::default() }));
        let r = send(&mut e, &m, "o1", with_flags(offer(OFFER_SDP), &["loop-protect"]));
        let marked = text(&r, "sdp");
        assert!(marked.contains("t=0 0\r\na=rtpengine:mp-test-1\r\nm=audio "), "{marked}");
        assert_eq!(text(&r, "warning"), "");
        let relays = m.read(|md, _| md.relays.len());
        let version = m.read(|_, t| t.version);
        // The SDP comes back (a spiral through the same proxy, or another call): unchanged, and
        // nothing is created or changed.
        for (cookie, call_id) in [("o2", "cfBXzDSZqhYNcXM"), ("o3", "another-call")] {
            let mut o = with_flags(offer(&marked), &["loop-protect"]);
            o[1].1 = call_id.into();
            let r = send(&mut e, &m, cookie, o);
            assert_eq!((text(&r, "result"), text(&r, "sdp")), ("ok".into(), marked.clone()), "{r:?}");
        }
        assert_eq!((m.read(|md, _| md.relays.len()), m.read(|_, t| t.version), e.registry().len()), (relays, version, 1));
        // Without the flag, or with another relay's mark, it is processed (and marked once).
        let mut o = offer(&marked);
        o[1].1 = "third".into();
        assert_ne!(text(&send(&mut e, &m, "o4", o), "sdp"), marked);
        let foreign = OFFER_SDP.replace("t=0 0\r\n", "t=0 0\r\na=rtpengine:someone-else\r\n");
        let mut o = with_flags(offer(&foreign), &["loop-protect"]);
        o[1].1 = "fourth".into();
        let out = text(&send(&mut e, &m, "o5", o), "sdp");
        assert!(out.contains("a=rtpengine:someone-else\r\na=rtpengine:mp-test-1\r\nm=audio"), "{out}");
        assert_eq!(e.registry().len(), 3);
        // The answer is marked too.
        let a = send(&mut e, &m, "a1", with_flags(answer(ANSWER_SDP), &["loop-protect"]));
        assert!(text(&a, "sdp").contains("a=rtpengine:mp-test-1\r\n"), "{a:?}");
    }

    #[test]
    fn documented_ping() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let r = e.handle_datagram(&m, CLIENT.parse().unwrap(), b"5323_1 d7:command4:pinge", Instant::now()).unwrap();
        assert_eq!(r, b"5323_1 d6:result4:ponge");
    }

    #[test]
    fn offer_answer_delete() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let r = send(&mut e, &m, "o1", offer(OFFER_SDP));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let sdp = text(&r, "sdp");
        // What B is told: the relay's address and leg B's port; everything else as sent.
        let lb = e.registry().get("cfBXzDSZqhYNcXM").unwrap().media[0].local_of(Side::B);
        assert_eq!(sdp, OFFER_SDP.replace("IN IP4 198.51.100.1", "IN IP4 203.0.113.5").replace("m=audio 49170", &format!("m=audio {}", lb.port())));
        assert_eq!(m.read(|md, _| md.relays.len()), 2, "RTP and RTCP relays");

        let r = send(&mut e, &m, "a1", answer(ANSWER_SDP));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let la = e.registry().get("cfBXzDSZqhYNcXM").unwrap().media[0].local_of(Side::A);
        assert!(text(&r, "sdp").contains(&format!("m=audio {} RTP/AVP 8\r\n", la.port())));
        assert!(text(&r, "sdp").contains("c=IN IP4 203.0.113.5\r\n"));
        m.read(|md, _| {
            let rel = md.relays.values().next().unwrap();
            assert_eq!(rel.a.remote, Some("198.51.100.1:49170".parse().unwrap()));
            assert_eq!(rel.b.remote, Some("198.51.100.2:3456".parse().unwrap()));
        });

        let q = send(&mut e, &m, "q1", vec![("command", "query".into()), ("call-id", "cfBXzDSZqhYNcXM".into())]);
        assert_eq!(text(&q, "result"), "ok");
        let tags = q.get("tags").unwrap().as_dict().unwrap();
        assert!(tags.contains_key(&b"mS9rSAn0Cr"[..]) && tags.contains_key(&b"8fa3b2"[..]), "{q:?}");
        let l = send(&mut e, &m, "l1", vec![("command", "list".into())]);
        assert_eq!(l.get("calls").unwrap().as_list().unwrap().len(), 1);
        let s = send(&mut e, &m, "s1", vec![("command", "statistics".into())]);
        assert_eq!(s.get("statistics").unwrap().get("currentstatistics").unwrap().get("sessionsown"), Some(&Value::Int(1)));

        let del = vec![("command", "delete".into()), ("call-id", "cfBXzDSZqhYNcXM".into()), ("from-tag", "mS9rSAn0Cr".into()), ("to-tag", "8fa3b2".into())];
        let r = send(&mut e, &m, "d1", del.clone());
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        assert!(r.get("warning").is_none());
        assert_eq!(m.read(|md, _| md.relays.len()), 0);
        assert!(e.registry().is_empty());
        // Deleting again: a warning, or an error with the fatal flag.
        let r = send(&mut e, &m, "d2", del.clone());
        assert_eq!(text(&r, "result"), "ok");
        assert!(text(&r, "warning").contains("unknown call-id"));
        let mut fatal = del;
        fatal.push(("flags", Value::List(vec!["fatal".into()])));
        let r = send(&mut e, &m, "d3", fatal);
        assert_eq!(text(&r, "result"), "error");
    }

    #[test]
    fn retransmission_gets_the_cached_reply() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let d = protocol::frame(b"77_3", &Value::dict(offer(OFFER_SDP)));
        let client: SocketAddr = CLIENT.parse().unwrap();
        let r1 = e.handle_datagram(&m, client, &d, Instant::now()).unwrap();
        let version = m.read(|_, t| t.version);
        let r2 = e.handle_datagram(&m, client, &d, Instant::now()).unwrap();
        assert_eq!(r1, r2);
        assert_eq!(m.read(|_, t| t.version), version, "not executed twice");
        // A new cookie (a retransmitted INVITE seen again by the proxy) is idempotent too.
        let d2 = protocol::frame(b"77_4", &Value::dict(offer(OFFER_SDP)));
        let r3 = e.handle_datagram(&m, client, &d2, Instant::now()).unwrap();
        assert_eq!(&r3[5..], &r1[5..], "same ports, same SDP");
        assert_eq!(m.read(|md, _| md.relays.len()), 2);
    }

    #[test]
    fn call_control_reaches_the_relays_by_participant_or_for_the_whole_call() {
        use mediaplane_core::model::MediaControl;
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        send(&mut e, &m, "o1", offer(OFFER_SDP));
        send(&mut e, &m, "a1", answer(ANSWER_SDP));
        let id = calls::rtp_relay_id(&calls::call_key("cfBXzDSZqhYNcXM"), 0);
        let relay = |m: &SessionManager| m.read(|model, _| model.relays.get(&id).cloned().unwrap());
        let control = |pairs: Vec<(&'static str, Value)>, cookie: &str, e: &mut Engine| {
            let mut req = vec![("call-id", Value::from("cfBXzDSZqhYNcXM"))];
            req.extend(pairs);
            let r = send(e, &m, cookie, req);
            assert_eq!(text(&r, "result"), "ok", "{r:?}");
            assert!(r.get("warning").is_none(), "{r:?}");
        };
        // The offerer's SDP maps telephone-event; the answerer's does not.
        assert_eq!((relay(&m).a.telephone_events, relay(&m).b.telephone_events), (vec![101], vec![]));
        let blocked = MediaControl { block_media: true, ..Default::default() };

        control(vec![("command", "block media".into()), ("from-tag", "8fa3b2".into())], "c1", &mut e);
        assert_eq!((relay(&m).control, relay(&m).a.control, relay(&m).b.control), (MediaControl::default(), MediaControl::default(), blocked));
        control(vec![("command", "block media".into())], "c2", &mut e);
        assert_eq!(relay(&m).control, blocked);
        // Unblocking the call leaves the participant's block; with `all`, not.
        control(vec![("command", "unblock media".into())], "c3", &mut e);
        assert_eq!((relay(&m).control, relay(&m).b.control), (MediaControl::default(), blocked));
        control(vec![("command", "unblock media".into()), ("flags", Value::List(vec!["all".into()]))], "c4", &mut e);
        assert_eq!(relay(&m).b.control, MediaControl::default());
        // By address, and the other controls beside one another.
        control(vec![("command", "silence media".into()), ("address", "198.51.100.1".into())], "c5", &mut e);
        control(vec![("command", "block DTMF".into()), ("from-tag", "mS9rSAn0Cr".into()), ("DTMF-security", "drop".into())], "c6", &mut e);
        assert_eq!(relay(&m).a.control, MediaControl { silence_media: true, block_dtmf: true, ..Default::default() });
        // What is set survives a re-INVITE.
        send(&mut e, &m, "o2", offer(OFFER_SDP));
        assert_eq!(relay(&m).a.control, MediaControl { silence_media: true, block_dtmf: true, ..Default::default() });

        // As Kamailio's `block_media("directional")` sends it: no warning.
        control(
            vec![
                ("command", "block media".into()),
                ("flags", Value::List(vec!["directional".into()])),
                ("received-from", Value::List(vec!["IP4".into(), "127.0.0.1".into()])),
                ("from-tag", "8fa3b2".into()),
            ],
            "c9",
            &mut e,
        );
        assert_eq!(relay(&m).b.control, blocked);

        // Labels: the answer labels its sender, the callee; call control selects by it, and
        // query shows it.
        let mut a = answer(ANSWER_SDP);
        a.push(("label", "callee".into()));
        send(&mut e, &m, "a2", a);
        control(vec![("command", "unblock media".into()), ("label", "callee".into())], "c11", &mut e);
        assert_eq!(relay(&m).b.control, MediaControl::default());
        let q = send(&mut e, &m, "q1", vec![("command", "query".into()), ("call-id", "cfBXzDSZqhYNcXM".into())]);
        assert_eq!(q.get("tags").and_then(|t| t.get("8fa3b2")).and_then(|t| t.get("label")), Some(&Value::from("callee")), "{q:?}");

        // After a restart (the call adopted from the store, its tags not known yet) the whole
        // call is still reached.
        let mut e = Engine::new(EngineConfig::default());
        assert_eq!(e.adopt(&m, Instant::now()), 1);
        control(vec![("command", "block DTMF".into())], "c10", &mut e);
        assert!(relay(&m).control.block_dtmf);

        let r = send(&mut e, &m, "c7", vec![("command", "block media".into()), ("call-id", "nope".into())]);
        assert_eq!(text(&r, "error-reason"), "unknown call-id \"nope\"");
        let r = send(&mut e, &m, "c8", vec![("command", "block media".into()), ("call-id", "cfBXzDSZqhYNcXM".into()), ("label", "caller".into())]);
        assert_eq!(text(&r, "error-reason"), "no party of the call is labelled \"caller\"", "{r:?}");
    }

    #[test]
    fn a_subscription_forks_each_partys_media_to_the_subscriber_until_it_unsubscribes() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        send(&mut e, &m, "o1", offer(OFFER_SDP));
        send(&mut e, &m, "a1", answer(ANSWER_SDP));
        let call = |cmd: &str, more: Vec<(&'static str, Value)>| {
            let mut v = vec![("command", Value::from(cmd)), ("call-id", "cfBXzDSZqhYNcXM".into())];
            v.extend(more);
            v
        };
        let r = send(&mut e, &m, "s1", call("subscribe request", vec![("flags", Value::List(vec!["all".into()])), ("to-tag", "mon".into())]));
        assert_eq!((text(&r, "result"), text(&r, "to-tag")), ("ok".into(), "mon".into()), "{r:?}");
        assert_eq!(r.get("from-tags"), Some(&Value::List(vec!["mS9rSAn0Cr".into(), "8fa3b2".into()])));
        let offered = Sdp::parse(text(&r, "sdp").as_bytes()).unwrap();
        // Each party's formats: the caller's A-law and events, the callee's A-law.
        assert_eq!(offered.media.iter().map(|m| m.formats.iter().map(|f| f.pt).collect::<Vec<_>>()).collect::<Vec<_>>(), [vec![8, 101], vec![8]]);
        let ports: Vec<u16> = offered.media.iter().map(|m| m.port).collect();
        let table = |m: &SessionManager| m.read(|model, _| mediaplane_core::ForwardingTable::compile(model, 1));
        let fork_copies = |m: &SessionManager| {
            table(m)
                .streams
                .values()
                .flat_map(|e| e.copies.iter().filter(|c| c.subscriber.contains("/fork:")).map(|c| (c.from.port(), c.to)).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        };
        assert!(fork_copies(&m).is_empty(), "no copies before the subscriber answers");

        let answer_sdp = "v=0\r\no=- 1 1 IN IP4 198.51.100.9\r\ns=-\r\nc=IN IP4 198.51.100.9\r\nt=0 0\r\nm=audio 9000 RTP/AVP 8\r\na=recvonly\r\nm=audio 9002 RTP/AVP 8\r\na=recvonly\r\n";
        let r = send(&mut e, &m, "s2", call("subscribe answer", vec![("to-tag", "mon".into()), ("sdp", answer_sdp.into())]));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let mut copies = fork_copies(&m);
        copies.sort();
        let to = |p: u16| SocketAddr::new("198.51.100.9".parse().unwrap(), p);
        // RTP and RTCP of each party, from the subscription's ports.
        let mut want = vec![(ports[0], to(9000)), (ports[0] + 1, to(9001)), (ports[1], to(9002)), (ports[1] + 1, to(9003))];
        want.sort();
        assert_eq!(copies, want);
        // What the subscriber sends back (its RTCP) is heard at each fork's address, from it.
        let ingress = |m: &SessionManager| {
            let t = table(m);
            let mut v: Vec<(u16, mediaplane_core::SourceRule, usize)> =
                t.streams.values().filter(|e| e.label.contains("/fork:")).map(|e| (e.key.local.port(), e.source, e.copies.len())).collect();
            v.sort_by_key(|x| x.0);
            v
        };
        let fixed = |p| mediaplane_core::SourceRule::Fixed(to(p));
        assert_eq!(ingress(&m), [(ports[0], fixed(9000), 0), (ports[0] + 1, fixed(9001), 0), (ports[1], fixed(9002), 0), (ports[1] + 1, fixed(9003), 0)]);

        let r = send(&mut e, &m, "s3", call("unsubscribe", vec![("to-tag", "mon".into())]));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        assert!(fork_copies(&m).is_empty() && ingress(&m).is_empty());
        assert!(m
            .read(|model, _| model.owner_of(&to(0)).is_none()
                && ports.iter().all(|p| model.owner_of(&SocketAddr::new("203.0.113.5".parse().unwrap(), *p)).is_none())));
        let r = send(&mut e, &m, "s4", call("unsubscribe", vec![("to-tag", "mon".into())]));
        assert_eq!(text(&r, "error-reason"), "no subscription with to-tag \"mon\"");
        let r = send(&mut e, &m, "s5", call("subscribe request", vec![("to-tag", "8fa3b2".into()), ("from-tag", "mS9rSAn0Cr".into())]));
        assert_eq!(text(&r, "result"), "error", "{r:?}");
    }

    #[test]
    fn start_forwarding_copies_each_partys_rtp_to_the_forwarding_host_until_stopped() {
        let to: SocketAddr = "198.51.100.77:5000".parse().unwrap();
        let call = |cmd: &str, more: Vec<(&'static str, Value)>| {
            let mut v = vec![("command", Value::from(cmd)), ("call-id", "cfBXzDSZqhYNcXM".into())];
            v.extend(more);
            v
        };
        // Not configured: an error, as `start recording` without a directory.
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        send(&mut e, &m, "o1", offer(OFFER_SDP));
        let r = send(&mut e, &m, "f0", call("start forwarding", vec![]));
        assert_eq!(text(&r, "error-reason"), "forwarding is not configured (ng.forward_to)", "{r:?}");

        let (m, mut e) = (manager(), Engine::new(EngineConfig { forward_to: Some(to), ..Default::default() }));
        send(&mut e, &m, "o1", offer(OFFER_SDP));
        send(&mut e, &m, "a1", answer(ANSWER_SDP));
        // (from port, to) of every forwarding copy in the table; RTP only.
        let forwarded = |m: &SessionManager| {
            let t = m.read(|model, _| mediaplane_core::ForwardingTable::compile(model, 1));
            let mut v: Vec<(String, SocketAddr)> = t
                .streams
                .values()
                .flat_map(|e| e.copies.iter().filter(|c| c.subscriber.contains(FORWARDING_TAG)).map(|c| (e.label.clone(), c.to)).collect::<Vec<_>>())
                .collect();
            v.sort();
            v
        };
        let r = send(&mut e, &m, "f1", call("start forwarding", vec![]));
        assert_eq!(r, Value::dict([("result", Value::str("ok"))]), "rtpengine's reply");
        let both = forwarded(&m);
        assert_eq!(both.len(), 2, "each party's RTP once: {both:?}");
        assert!(both.iter().all(|(_, t)| *t == to));
        // Again: replaced, not doubled; one party stopped, then the other.
        send(&mut e, &m, "f2", call("start forwarding", vec![]));
        assert_eq!(forwarded(&m), both);
        let r = send(&mut e, &m, "f3", call("stop forwarding", vec![("from-tag", "mS9rSAn0Cr".into())]));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        assert_eq!(forwarded(&m).len(), 1);
        send(&mut e, &m, "f4", call("stop forwarding", vec![]));
        assert!(forwarded(&m).is_empty());
        assert_eq!(text(&send(&mut e, &m, "f5", call("stop forwarding", vec![])), "result"), "ok", "nothing to stop is not an error");
        // The reserved tag is no subscriber's.
        let r = send(&mut e, &m, "s1", call("subscribe request", vec![("to-tag", FORWARDING_TAG.into()), ("from-tag", "mS9rSAn0Cr".into())]));
        assert_eq!(text(&r, "result"), "error", "{r:?}");
        let r = send(&mut e, &m, "f6", call("start forwarding", vec![("from-tag", "nobody".into())]));
        assert_eq!(text(&r, "result"), "error", "{r:?}");
    }

    #[test]
    fn play_dtmf_queues_the_event_on_the_senders_leg_in_the_receivers_payload_type() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        send(&mut e, &m, "o1", offer(OFFER_SDP));
        send(&mut e, &m, "a1", answer(ANSWER_SDP));
        let id = calls::rtp_relay_id(&calls::call_key("cfBXzDSZqhYNcXM"), 0);
        let play = |from: &str, cookie: &str, e: &mut Engine| {
            let req = vec![("command", "play DTMF".into()), ("call-id", "cfBXzDSZqhYNcXM".into()), ("from-tag", from.into()), ("code", "*".into())];
            send(e, &m, cookie, req)
        };
        // The callee (B) sends it to the caller, whose SDP maps telephone-event to 101.
        let r = play("8fa3b2", "p1", &mut e);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let queued = m.read(|model, _| model.relays[&id].b.dtmf.clone());
        assert_eq!(queued.iter().map(|d| (d.code, d.payload_type, d.duration_ms, d.volume, d.pause_ms)).collect::<Vec<_>>(), [(10, 101, 250, 8, 100)]);
        assert_eq!(m.read(|model, _| mediaplane_core::ForwardingTable::compile(model, 1)).streams.values().filter(|s| !s.dtmf.is_empty()).count(), 1);
        // The callee's SDP has no telephone-event: nothing to send the caller's event in.
        let r = play("mS9rSAn0Cr", "p2", &mut e);
        assert!(text(&r, "error-reason").contains("telephone-event"), "{r:?}");
        // Once it must be over (queued + 250 + 100 ms + 5 s of slack) it leaves the model.
        let queued_ms = queued[0].queued_ms;
        let expire = |now_ms| {
            m.mutate(|model, _| {
                let changed = model.expire_dtmf(now_ms);
                Ok((changed.clone(), changed.into_iter().map(Change::Relay).collect()))
            })
            .unwrap()
        };
        assert!(expire(queued_ms + 5_000).is_empty(), "not yet");
        let changed = expire(queued_ms + 5_351);
        assert_eq!(changed, std::slice::from_ref(&id));
        assert!(m.read(|model, _| model.relays[&id].b.dtmf.is_empty()));
    }

    #[test]
    fn error_replies_have_clear_reasons() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let client: SocketAddr = CLIENT.parse().unwrap();
        let reason = |e: &mut Engine, d: &[u8]| {
            let r = e.handle_datagram(&m, client, d, Instant::now()).expect("a reply");
            let (_, v) = protocol::parse_frame(&r).unwrap();
            assert_eq!(text(&v, "result"), "error", "{v:?}");
            assert_eq!(v.as_dict().unwrap().len(), 2, "only result and error-reason");
            text(&v, "error-reason")
        };
        assert!(reason(&mut e, b"c1 d7:command").contains("malformed bencode"));
        assert!(reason(&mut e, b"c1 li1ee").contains("not a bencoded dictionary"));
        assert!(reason(&mut e, &req("r1", vec![("foo", "bar".into())])).contains("missing key \"command\""));
        assert!(reason(&mut e, &req("r2", vec![("command", "frobnicate".into())])).contains("unknown command \"frobnicate\""));
        let mut o = offer(OFFER_SDP);
        o.remove(1);
        assert!(reason(&mut e, &protocol::frame(b"c2", &Value::dict(o))).contains("missing key \"call-id\""));
        let mut o = offer(OFFER_SDP);
        o.retain(|(k, _)| *k != "sdp");
        assert!(reason(&mut e, &protocol::frame(b"c3", &Value::dict(o))).contains("missing key \"sdp\""));
        assert!(reason(&mut e, &protocol::frame(b"c4", &Value::dict(offer("hello")))).contains("invalid SDP"));
        assert!(reason(&mut e, &protocol::frame(b"c5", &Value::dict(answer(ANSWER_SDP)))).contains("unknown call-id"));
        let mut o = offer(OFFER_SDP);
        o[2].1 = Value::Int(3);
        assert!(reason(&mut e, &protocol::frame(b"c6", &Value::dict(o))).contains("must be a string"));
        // No cookie: nothing to answer.
        assert!(e.handle_datagram(&m, client, b"garbage", Instant::now()).is_none());
        assert!(e.handle_datagram(&m, client, b"", Instant::now()).is_none());
        // Port exhaustion is an error reply, and changes nothing.
        // 30000-30019 holds 10 RTP ports: 5 calls of two legs.
        for i in 0..7 {
            let mut o = offer(OFFER_SDP);
            o[1].1 = format!("call-{i}").into();
            let r = send(&mut e, &m, &format!("x{i}"), o);
            if i < 5 {
                assert_eq!(text(&r, "result"), "ok", "{r:?}");
            } else {
                assert!(text(&r, "error-reason").contains("no free port"), "{r:?}");
            }
        }
        assert_eq!(e.registry().len(), 5);
        assert_eq!(m.read(|md, _| md.relays.len()), 10);
    }

    #[test]
    fn answer_from_the_callee_of_a_reinvite_and_unknown_tags() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        send(&mut e, &m, "o1", offer(OFFER_SDP));
        send(&mut e, &m, "a1", answer(ANSWER_SDP));
        // Re-INVITE from B (from-tag = B's tag) with a new port; A answers.
        let mut re = offer(&ANSWER_SDP.replace("3456", "4000"));
        re[2].1 = "8fa3b2".into();
        re.push(("to-tag", "mS9rSAn0Cr".into()));
        let r = send(&mut e, &m, "o2", re);
        let la = e.registry().get("cfBXzDSZqhYNcXM").unwrap().media[0].local_of(Side::A);
        assert!(text(&r, "sdp").contains(&format!("m=audio {} ", la.port())), "B's SDP goes to A: {r:?}");
        m.read(|md, _| assert_eq!(md.relays.values().next().unwrap().b.remote, Some("198.51.100.2:4000".parse().unwrap())));
        let mut ans = answer(OFFER_SDP);
        ans[2].1 = "8fa3b2".into();
        ans.last_mut().unwrap().1 = "mS9rSAn0Cr".into();
        assert_eq!(text(&send(&mut e, &m, "a2", ans), "result"), "ok");
        let mut stranger = offer(OFFER_SDP);
        stranger[2].1 = "nobody".into();
        let r = send(&mut e, &m, "o3", stranger);
        assert!(text(&r, "error-reason").contains("not part of call"), "{r:?}");
    }

    #[test]
    fn rtcp_mux_passes_through_or_is_rejected() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mux = OFFER_SDP.replace("a=sendrecv\r\n", "a=rtcp-mux\r\na=sendrecv\r\n");
        let r = send(&mut e, &m, "o1", offer(&mux));
        assert!(text(&r, "sdp").contains("a=rtcp-mux\r\n"));
        let r = send(&mut e, &m, "a1", answer(&ANSWER_SDP.replace("a=rtpmap:8 PCMA/8000\r\n", "a=rtpmap:8 PCMA/8000\r\na=rtcp-mux\r\n")));
        assert!(text(&r, "sdp").contains("a=rtcp-mux\r\n"));
        assert_eq!(m.read(|md, _| md.relays.len()), 1, "muxed: no RTCP relay");
        let mut o = offer(&mux);
        o[1].1 = "other-call".into();
        o.push(("rtcp-mux", list(&["reject"])));
        let r = send(&mut e, &m, "o2", o);
        assert!(!text(&r, "sdp").contains("a=rtcp-mux"), "{r:?}");
    }

    /// `rtcp-mux: [demux]` (Kamailio's `rtcp-mux-demux`): the muxing offerer's receiver is offered
    /// RTCP on the port above (`a=rtcp`, no `a=rtcp-mux`), the answer back says `a=rtcp-mux`, and
    /// the RTP relay carries the receiver's RTCP address (no RTCP relay); a re-offer without the
    /// flag goes back to an RTCP relay.
    #[test]
    fn rtcp_mux_demux_keeps_the_receivers_rtcp_apart() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        let mux = OFFER_SDP.replace("a=sendrecv\r\n", "a=rtcp:49170\r\na=rtcp-mux\r\na=sendrecv\r\n");
        let mut o = offer(&mux);
        o.push(("rtcp-mux", list(&["demux"])));
        let r = send(&mut e, &m, "o1", o);
        let sdp = text(&r, "sdp");
        assert!(!sdp.contains("a=rtcp-mux") && r.get("warning").is_none(), "{r:?}");
        let port: u16 = attr(&sdp, "rtcp").unwrap().split(' ').next().unwrap().parse().unwrap();
        let rtp_port: u16 = sdp.split("m=audio ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        assert_eq!(port, rtp_port + 1, "{sdp}");
        let r = send(&mut e, &m, "a1", answer(ANSWER_SDP));
        let sdp = text(&r, "sdp");
        assert!(sdp.contains("a=rtcp-mux\r\n") && attr(&sdp, "rtcp").is_none(), "{sdp}");
        let relays = m.read(|md, _| md.relays.clone());
        assert_eq!(relays.len(), 1, "no RTCP relay");
        let d = relays.values().next().unwrap().rtcp_demux.clone().expect("the callee's RTCP apart");
        assert_eq!((d.of, d.local.port(), d.remote), (mediaplane_core::model::Side::B, rtp_port + 1, Some("198.51.100.2:3457".parse().unwrap())));
        // `query`: the caller multiplexes; the callee has an RTCP stream on the port above.
        let q = send(&mut e, &m, "q1", vec![("command", "query".into()), ("call-id", "cfBXzDSZqhYNcXM".into())]);
        let media =
            |tag: &str| q.get("tags").and_then(|t| t.get(tag)).and_then(|t| t.get("medias")).and_then(Value::as_list).and_then(|m| m.first()).cloned().unwrap();
        let strings = |v: Option<&Value>| v.and_then(Value::as_list).unwrap().iter().filter_map(|f| f.as_str().map(str::to_string)).collect::<Vec<_>>();
        let (caller, callee) = (media("mS9rSAn0Cr"), media("8fa3b2"));
        assert!(strings(caller.get("flags")).contains(&"rtcp-mux".to_string()) && !strings(callee.get("flags")).contains(&"rtcp-mux".to_string()));
        let streams = |m: &Value| m.get("streams").and_then(Value::as_list).unwrap().to_vec();
        assert_eq!(streams(&caller).len(), 1);
        let callee_streams = streams(&callee);
        let rtcp = callee_streams.iter().find(|s| strings(s.get("flags")).contains(&"RTCP".to_string())).expect("the callee's RTCP stream");
        assert_eq!(rtcp.get("local port").and_then(Value::as_int), Some(rtp_port as i64 + 1));
        // The same offer again (a re-INVITE), the flag as a flag: nothing moves.
        let mut o = offer(&mux);
        o[5].1 = list(&["trust address", "rtcp-mux-demux"]);
        assert!(send(&mut e, &m, "o2", o).get("warning").is_none());
        send(&mut e, &m, "a2", answer(ANSWER_SDP));
        assert_eq!(m.read(|md, _| md.relays.values().next().unwrap().rtcp_demux.clone()), Some(d));
        // Without the flag the offer goes on muxed; unanswered with mux, RTCP has a relay again.
        send(&mut e, &m, "o3", offer(&mux));
        send(&mut e, &m, "a3", answer(ANSWER_SDP));
        let relays = m.read(|md, _| md.relays.clone());
        assert_eq!(relays.len(), 2);
        assert!(relays.values().all(|r| r.rtcp_demux.is_none()));
    }

    fn list(items: &[&str]) -> Value {
        Value::List(items.iter().map(|s| Value::str(s)).collect())
    }

    /// The sweep reads the counters of a call only once its deadline passed (a call that had a
    /// packet is not read again until a timeout after it), and still ends it on time.
    #[test]
    fn the_sweep_reads_a_call_only_past_its_deadline() {
        let dp = Arc::new(CountingDataplane::default());
        let m = SessionManager::open(
            Store::in_memory().unwrap(),
            dp.clone(),
            MediaConfig { ip: "203.0.113.5".parse().unwrap(), port_min: 30000, port_max: 30019, ..Default::default() },
            Limits::default(),
        )
        .unwrap();
        let mut e = Engine::new(EngineConfig { media_timeout: Duration::from_secs(5), ..Default::default() });
        send(&mut e, &m, "o1", offer(OFFER_SDP));
        send(&mut e, &m, "a1", answer(ANSWER_SDP));
        let t0 = e.registry().get("cfBXzDSZqhYNcXM").unwrap().last_activity;
        let mut uids: Vec<u32> = m.read(|md, _| md.relays.values().flat_map(|r| [r.a.uid, r.b.uid]).collect());
        uids.sort();
        let s = Duration::from_secs_f64;
        let reads = |dp: &CountingDataplane| {
            std::mem::take(&mut *dp.reads.lock())
                .into_iter()
                .map(|mut r| {
                    r.sort();
                    r
                })
                .collect::<Vec<_>>()
        };
        assert!(e.expire(&m, t0 + s(1.0)).is_empty());
        assert!(e.expire(&m, t0 + s(4.9)).is_empty());
        assert_eq!(reads(&dp), Vec::<Vec<u32>>::new(), "no call was due");
        // At 5 s the call is due: read, and a packet half a second ago keeps it.
        dp.streams.lock().insert(uids[0], Counters { tx_copies: 1, last_rx_ns: mediaplane_dataplane::monotonic_ns() - 500_000_000, ..Default::default() });
        assert!(e.expire(&m, t0 + s(5.0)).is_empty(), "a packet at 4.5 s");
        assert_eq!(reads(&dp), vec![uids.clone()]);
        // Not read again until 5 s after that packet; then read, and ended.
        assert!(e.expire(&m, t0 + s(9.0)).is_empty());
        assert_eq!(reads(&dp), Vec::<Vec<u32>>::new(), "due only at 9.5 s");
        assert_eq!(e.expire(&m, t0 + s(9.6)), vec!["cfBXzDSZqhYNcXM".to_string()]);
        assert_eq!(reads(&dp), vec![uids.clone()]);
    }

    /// `statistics`' current rates are what every call relayed since the previous request.
    #[test]
    fn statistics_rates_are_averages_since_the_previous_request() {
        let dp = Arc::new(CountingDataplane::default());
        let m = SessionManager::open(
            Store::in_memory().unwrap(),
            dp.clone(),
            MediaConfig { ip: "203.0.113.5".parse().unwrap(), port_min: 30000, port_max: 30019, ..Default::default() },
            Limits::default(),
        )
        .unwrap();
        let mut e = Engine::new(EngineConfig::default());
        send(&mut e, &m, "o1", offer(OFFER_SDP));
        let uid = m.read(|md, _| md.relays.values().next().unwrap().a.uid);
        let t = Instant::now();
        let mut rate_at = |cookie: &str, at: Instant, copies: u64| {
            dp.streams.lock().insert(uid, Counters { tx_copies: copies, tx_bytes: 172 * copies, ..Default::default() });
            let r = e.handle_datagram(&m, CLIENT.parse().unwrap(), &req(cookie, vec![("command", "statistics".into())]), at).unwrap();
            let v = protocol::parse_frame(&r).unwrap().1;
            let current = v.get("statistics").unwrap().get("currentstatistics").unwrap().clone();
            let int = |k: &str| match current.get(k) {
                Some(Value::Int(i)) => *i,
                other => panic!("{k}: {other:?}"),
            };
            (int("packetrate"), int("byterate"))
        };
        assert_eq!(rate_at("s1", t, 1_000), (0, 0), "no earlier request");
        assert_eq!(rate_at("s2", t + Duration::from_secs(2), 1_100), (50, 50 * 172));
        assert_eq!(rate_at("s3", t + Duration::from_secs(12), 1_100), (0, 0), "nothing since");
    }

    #[test]
    fn ice_removed_on_request_and_media_timeout() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig { media_timeout: Duration::from_secs(5), ..Default::default() }));
        let ice = OFFER_SDP.replace(
            "a=sendrecv\r\n",
            "a=ice-ufrag:abcd\r\na=ice-pwd:0123456789abcdef01234567\r\na=candidate:1 1 UDP 2130706431 198.51.100.1 49170 typ host\r\na=sendrecv\r\n",
        );
        let r = send(&mut e, &m, "o1", offer(&ice));
        assert!(text(&r, "sdp").contains("a=candidate"), "kept without ICE=remove");
        assert!(text(&r, "warning").contains("ICE"));
        let mut o = offer(&ice);
        o.push(("ICE", "remove".into()));
        let r = send(&mut e, &m, "o2", o);
        assert!(!text(&r, "sdp").contains("a=ice") && !text(&r, "sdp").contains("a=candidate"), "{r:?}");
        assert!(r.get("warning").is_none());

        // The call was created at t0 (mono 100 s); A's stream last heard a packet at mono 103.5 s.
        let t0 = e.registry().get("cfBXzDSZqhYNcXM").unwrap().last_activity;
        let (mono0, s) = (100_000_000_000u64, |secs: f64| Duration::from_secs_f64(secs));
        let at = |secs: f64| (t0 + s(secs), mono0 + s(secs).as_nanos() as u64);
        let uids: Vec<u32> = m.read(|md, _| md.relays.values().flat_map(|r| [r.a.uid, r.b.uid]).collect());
        let mut stats = DataplaneStats::default();
        // Strangers and counters without a packet time are no media.
        stats.streams.insert(uids[1], Counters { rx_packets: 50, drop_stranger: 50, ..Default::default() });
        let (now, mono) = at(3.0);
        assert!(e.expire_with(&m, &stats, now, mono).is_empty());
        stats.streams.insert(uids[0], Counters { rx_packets: 1, last_rx_ns: mono0 + s(3.5).as_nanos() as u64, ..Default::default() });
        for t in [4.0, 5.0, 8.0, 8.4] {
            let (now, mono) = at(t);
            assert!(e.expire_with(&m, &stats, now, mono).is_empty(), "media at 3.5 s, a 5 s timeout: alive at {t} s");
        }
        let (now, mono) = at(8.5);
        assert_eq!(e.expire_with(&m, &stats, now, mono), vec!["cfBXzDSZqhYNcXM".to_string()], "deleted at last packet + timeout");
        assert_eq!(m.read(|md, _| md.relays.len()), 0);
        assert_eq!(e.totals().timed_out, 1);
    }
}
