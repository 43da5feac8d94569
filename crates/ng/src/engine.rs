//! The NG command handler: one datagram in, one datagram out, against a
//! [`SessionManager`]. No sockets and no timers here: the driver ([`crate::serve_ng`]) reads
//! datagrams and calls [`Engine::handle_datagram`], and calls [`Engine::expire`] every second.

use crate::bencode::Value;
use crate::calls::{self, other, AddressPolicy, Call, MediaState, Phase, Registry, SignalOptions};
use crate::codecs::{self, CodecFilter, CodecSpec, Filtered};
use crate::protocol::{self, error_reply, normalize, ReplyCache, Request, RequestError};
use crate::sdp::{MediaRewrite, Rewrite, Sdp, SdpError};
use mediaplane_control::manager::{ManagerError, SessionManager};
use mediaplane_control::metrics::{CallEnd, NgMetrics};
use mediaplane_core::model::{Follow, Side};
use mediaplane_core::Model;
use mediaplane_dataplane::{Counters, DataplaneStats};
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
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            media_timeout: Duration::from_secs(60),
            reply_ttl: Duration::from_secs(30),
            reply_cache_entries: 65_536,
            instance_id: generate_instance_id(),
        }
    }
}

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
}

fn unix(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
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
    /// Mark the SDP, and return an SDP this relay marked unchanged.
    loop_protect: bool,
    warnings: Vec<String>,
}

fn options(req: &Request) -> Result<Options, RequestError> {
    let flags = req.list("flags")?;
    let replace = req.list("replace")?;
    let mux = req.list("rtcp-mux")?;
    let has = |f: &str| flags.iter().any(|x| x == f);
    let mut warnings = Vec::new();
    for m in &mux {
        if matches!(m.as_str(), "offer" | "require" | "demux") {
            warnings.push(format!("rtcp-mux {m} is not supported; rtcp-mux is passed through as offered"));
        }
    }
    let sip_source = (has("sip-source-address") || has("sip-source")) && !has("trust-address");
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
            at_ms: 0,
        },
        replace_origin: replace.iter().any(|r| r == "origin") || has("replace-origin"),
        replace_session_connection: replace.iter().any(|r| r == "session-connection") || has("replace-session-connection"),
        replace_zero_address: replace.iter().any(|r| r == "zero-address"),
        ice: req.opt_str("ICE")?.map(normalize),
        strip_mux: mux.iter().any(|m| m == "reject"),
        loop_protect: has("loop-protect"),
        warnings,
    })
}

/// Keys Kamailio's rtpengine module adds to every request, that change nothing asked of the
/// relay: what it supports (`load limit` replies, which mediaplane never sends), which SIP
/// message carried the request, and where from.
const INFORMATIONAL: &[&str] = &["supports", "sip-message-type", "sip-code", "via-branch", "received-from"];

/// The keys each command acts on (normalized spelling), besides `command`.
fn keys_acted_on(command: &str) -> &'static [&'static str] {
    match command {
        // via-branch tells rtpengine a forked branch's answers apart; here the to-tag does.
        "offer" | "answer" => {
            &["call-id", "from-tag", "to-tag", "via-branch", "sdp", "flags", "replace", "rtcp-mux", "ice", "received-from", "media-address", "codec"]
        }
        "delete" => &["call-id", "from-tag", "to-tag", "via-branch", "flags"],
        "query" => &["call-id", "from-tag", "to-tag"],
        "list" => &["limit"],
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
            "loop-protect",
        ],
        "delete" => &["fatal"],
        _ => &[],
    }
}

/// What happens instead, for keys and flags SIP servers commonly send that mediaplane does not
/// act on yet.
fn consequence(name: &str) -> Option<&'static str> {
    Some(match name {
        "transport-protocol" | "rtp/avp" | "rtp/savp" | "rtp/avpf" | "rtp/savpf" | "udp/tls/rtp/savp" | "udp/tls/rtp/savpf" => {
            "the SDP keeps its transport protocol and media is relayed as received (no SRTP/DTLS termination)"
        }
        "address-family" => "media stays in the address family of the media address (no IPv4/IPv6 bridging)",
        "direction" | "from-interface" | "to-interface" | "interface" => "media uses the one configured media address (no named interfaces)",
        "record-call" | "start-recording" | "record" => "nothing is recorded",
        "sdes" | "dtls" | "osrtp" | "generate-mid" | "rtcp-mux-require" | "trickle-ice" => "no SRTP, DTLS or ICE is terminated",
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
        let acted_on = |f: &str| flags_ok.contains(&f) || (filters_codecs && codecs::flag_acted_on(f));
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
        Engine { cfg, registry: Registry::default(), cache, metrics, started: Instant::now() }
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
        let reply = self.handle(mgr, &dict, now);
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
            "statistics" => Ok(self.statistics(mgr)),
            other => Err(NgError::Call(format!("unknown command {other:?}"))),
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
        if phase == Phase::Answer {
            if signals.len() > call.media.len() {
                return Err(NgError::Call(format!("the answer has {} media sections, the offer had {}", signals.len(), call.media.len())));
            }
            if sender == Side::B {
                call.tag_b = to_tag.map(str::to_string);
            }
        }
        if sdp.has_ice() {
            match opt.ice.as_deref() {
                Some("remove") => {}
                Some(v) => opt.warnings.push(format!("ICE={v} is not supported: ICE attributes removed")),
                None => opt.warnings.push("the SDP carries ICE candidates that bypass the relay; send ICE=remove".into()),
            }
        }
        let remove_ice = opt.ice.is_some();
        let (formats, codecs_removed) = Self::filter_codecs(req, phase, &sdp, &call, &mut opt.warnings)?;

        let leg = SignalOptions { at_ms: mediaplane_control::manager::unix_ms(), ..opt.leg };
        let (call, ip) = mgr.mutate(|model, media| {
            let mut next = call;
            let changes = calls::apply_signal(model, media, &mut next, sender, phase, &signals, leg)?;
            Ok(((next, media.ip), changes))
        })?;

        // The SDP goes to the other party: advertise the relay side facing it.
        let to = other(sender);
        let media: Vec<MediaRewrite> = call
            .media
            .iter()
            .zip(&signals)
            .enumerate()
            .map(|(i, (m, sig))| {
                if !m.active {
                    return MediaRewrite { port: None, rtcp_port: 0, strip_rtcp_mux: opt.strip_mux, hold: false, formats: None };
                }
                let port = m.local_of(to).port();
                let hold = sig.rtp.is_none() && !opt.replace_zero_address;
                let formats = formats.get(i).cloned().flatten();
                MediaRewrite { port: Some(port), rtcp_port: if m.rtcp { port + 1 } else { port }, strip_rtcp_mux: opt.strip_mux, hold, formats }
            })
            .collect();
        let mark = opt.loop_protect.then(|| self.cfg.instance_id.clone());
        let rewritten =
            sdp.rewrite(&Rewrite { addr: ip, origin: opt.replace_origin, session_connection: opt.replace_session_connection, remove_ice, media, mark });

        let mut call = call;
        if phase == Phase::Offer {
            call.codecs_removed = codecs_removed;
        }
        call.last_signal = SystemTime::now();
        if phase == Phase::Answer {
            call.answered = true;
        }
        if existing.is_none() {
            self.metrics.call_created();
            call.last_activity = now;
        }
        tracing::debug!(call_id, relays = ?call.relay_ids(), "call updated");
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
        let stats = self.call_stats(mgr, &call);
        mgr.mutate(|model, _| Ok(((), calls::delete_call(model, &call)?)))?;
        self.registry.remove(&call.key);
        self.metrics.call_ended(CallEnd::Deleted);
        let mut reply = vec![("result", Value::str("ok")), ("created", Value::Int(unix(call.created))), ("last signal", Value::Int(unix(call.last_signal)))];
        reply.push(("totals", stats));
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

    /// `{"RTP": {...}, "RTCP": {...}}` packet/byte/error totals received on a call's relays.
    fn call_stats(&self, mgr: &SessionManager, call: &Call) -> Value {
        let stats = mgr.stats();
        let (rtp, rtcp) = mgr.read(|model, _| {
            let mut rtp = Counters::default();
            let mut rtcp = Counters::default();
            for (i, m) in call.media.iter().enumerate() {
                for (id, acc) in [(calls::rtp_relay_id(&call.key, i), &mut rtp), (calls::rtcp_relay_id(&call.key, i), &mut rtcp)] {
                    if let Some(r) = model.relays.get(&id).filter(|_| m.active) {
                        for uid in [r.a.uid, r.b.uid] {
                            if let Some(c) = stats.streams.get(&uid) {
                                acc.add(c);
                            }
                        }
                    }
                }
            }
            (rtp, rtcp)
        });
        Value::dict([("RTP", counters_value(&rtp)), ("RTCP", counters_value(&rtcp))])
    }

    fn query(&self, mgr: &SessionManager, req: &Request) -> Result<Value, NgError> {
        let call_id = req.nonempty("call-id")?;
        let call = self.registry.get(call_id).ok_or_else(|| NgError::Call(format!("unknown call-id {call_id:?}")))?;
        let stats = mgr.stats();
        let tags = mgr.read(|model, _| {
            let mut tags = Vec::new();
            for side in [Side::A, Side::B] {
                let (tag, peer_tag) = match side {
                    Side::A => (call.tag_a.clone().unwrap_or_default(), call.tag_b.clone()),
                    Side::B => (call.tag_b.clone().unwrap_or_default(), call.tag_a.clone()),
                };
                let medias = call.media.iter().enumerate().map(|(i, m)| media_value(model, &stats, call, i, m, side)).collect();
                let mut d = vec![("tag", Value::from(tag.clone())), ("created", Value::Int(unix(call.created))), ("medias", Value::List(medias))];
                if let Some(p) = peer_tag {
                    d.push(("in dialogue with", Value::from(p)));
                }
                tags.push((tag, Value::dict(d)));
            }
            tags
        });
        let tags = Value::Dict(tags.into_iter().map(|(k, v)| (k.into_bytes(), v)).collect());
        Ok(Value::dict([
            ("result", "ok".into()),
            ("created", Value::Int(unix(call.created))),
            ("last signal", Value::Int(unix(call.last_signal))),
            ("tags", tags),
            ("totals", self.call_stats(mgr, call)),
        ]))
    }

    fn statistics(&self, mgr: &SessionManager) -> Value {
        let stats = mgr.stats();
        let (mut copies, mut errors) = (0u64, 0u64);
        mgr.read(|model, _| {
            for id in self.registry.calls().flat_map(Call::relay_ids) {
                if let Some(r) = model.relays.get(&id) {
                    for uid in [r.a.uid, r.b.uid] {
                        if let Some(c) = stats.streams.get(&uid) {
                            copies += c.tx_copies;
                            errors += c.tx_errors + c.drop_stranger + c.drop_malformed;
                        }
                    }
                }
            }
        });
        let n = self.registry.len() as i64;
        let t = self.totals();
        Value::dict([
            ("result", "ok".into()),
            (
                "statistics",
                Value::dict([
                    (
                        "currentstatistics",
                        Value::dict([
                            ("sessionsown", Value::Int(n)),
                            ("sessionsforeign", Value::Int(0)),
                            ("sessionstotal", Value::Int(n)),
                            ("transcodedmedia", Value::Int(0)),
                        ]),
                    ),
                    (
                        "totalstatistics",
                        Value::dict([
                            ("uptime", Value::from(self.started.elapsed().as_secs().to_string())),
                            ("managedsessions", Value::Int(t.managed as i64)),
                            ("regularterminatedsessions", Value::Int(t.deleted as i64)),
                            ("timeoutsessions", Value::Int(t.timed_out as i64)),
                            ("relayedpackets", Value::Int(copies as i64)),
                            ("relayedpacketerrors", Value::Int(errors as i64)),
                            ("controlerrors", Value::Int(t.errors as i64)),
                        ]),
                    ),
                ]),
            ),
        ])
    }

    /// Media timeout: note which calls received packets since the last call, delete those idle
    /// for longer than the configured timeout. Returns the Call-IDs (or keys) deleted.
    pub fn expire(&mut self, mgr: &SessionManager, now: Instant) -> Vec<String> {
        // Only the counters of NG calls' streams: the data plane may hold far more sessions
        // (e.g. relays made over HTTP), and reading all of them would cost a map read each.
        let ids: Vec<u32> = mgr.read(|model, _| self.registry.calls().flat_map(|c| calls::stream_ids(model, c)).collect());
        if ids.is_empty() {
            return Vec::new();
        }
        let stats = DataplaneStats { streams: mgr.stream_counters(&ids), ..Default::default() };
        self.expire_with(mgr, &stats, now)
    }

    pub fn expire_with(&mut self, mgr: &SessionManager, stats: &DataplaneStats, now: Instant) -> Vec<String> {
        let timeout = self.cfg.media_timeout;
        let idle: Vec<Call> = mgr.read(|model, _| {
            let mut idle = Vec::new();
            for call in self.registry.calls_mut() {
                let rx: u64 = calls::stream_ids(model, call).iter().filter_map(|u| stats.streams.get(u)).map(|c| c.rx_packets).sum();
                if rx != call.last_rx {
                    call.last_rx = rx;
                    call.last_activity = now;
                } else if now.saturating_duration_since(call.last_activity) >= timeout {
                    idle.push(call.clone());
                }
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
            self.registry.remove(&c.key);
            self.metrics.call_ended(CallEnd::Timeout);
            gone.push(if c.call_id.is_empty() { c.key } else { c.call_id });
        }
        self.metrics.set_calls(self.registry.len());
        gone
    }
}

fn counters_value(c: &Counters) -> Value {
    Value::dict([
        ("packets", Value::Int(c.rx_packets as i64)),
        ("bytes", Value::Int(c.rx_bytes as i64)),
        ("errors", Value::Int((c.drop_stranger + c.drop_malformed + c.tx_errors) as i64)),
        ("relayed", Value::Int(c.tx_copies as i64)),
    ])
}

fn endpoint(a: SocketAddr) -> Value {
    Value::dict([
        ("family", Value::str(if a.is_ipv4() { "IPv4" } else { "IPv6" })),
        ("address", Value::from(a.ip().to_string())),
        ("port", Value::Int(a.port() as i64)),
    ])
}

/// One media of one side in a `query` reply: where that party sends (local port), where the
/// relay sends to it (endpoint), what it signalled (advertised endpoint), what it sent (stats).
fn media_value(model: &Model, stats: &DataplaneStats, call: &Call, i: usize, m: &MediaState, side: Side) -> Value {
    let mut streams = Vec::new();
    if m.active {
        for (id, label) in [(calls::rtp_relay_id(&call.key, i), "RTP"), (calls::rtcp_relay_id(&call.key, i), "RTCP")] {
            let Some(r) = model.relays.get(&id) else { continue };
            let leg = if side == Side::A { &r.a } else { &r.b };
            let mut d = vec![
                ("local port", Value::Int(leg.local.port() as i64)),
                ("flags", Value::List(vec![Value::str(label)])),
                ("stats", counters_value(&stats.streams.get(&leg.uid).copied().unwrap_or_default())),
            ];
            if let Some(p) = leg.peer() {
                d.push(("endpoint", endpoint(p)));
            }
            if let Some(p) = leg.remote {
                d.push(("advertised endpoint", endpoint(p)));
            }
            streams.push(Value::dict(d));
        }
    }
    let mut flags = vec![];
    if m.active {
        flags.push(Value::str("initialized"));
    }
    if m.mux {
        flags.push(Value::str("rtcp-mux"));
    }
    Value::dict([
        ("index", Value::Int(i as i64 + 1)),
        ("type", Value::from(m.kind.clone())),
        ("protocol", Value::from(m.proto.clone())),
        ("flags", Value::List(flags)),
        ("streams", Value::List(streams)),
    ])
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

    fn manager() -> SessionManager {
        let media = MediaConfig { ip: "203.0.113.5".parse().unwrap(), port_min: 30000, port_max: 30019, ..Default::default() };
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
    fn every_key_and_flag_not_acted_on_is_named_in_a_warning() {
        let (m, mut e) = (manager(), Engine::new(EngineConfig::default()));
        // What Kamailio's module sends for a plain call: acted on, no warning.
        let r = send(&mut e, &m, "o0", offer(OFFER_SDP));
        assert_eq!((text(&r, "result"), text(&r, "warning")), ("ok".into(), String::new()), "{r:?}");
        send(&mut e, &m, "d0", vec![("command", "delete".into()), ("call-id", "cfBXzDSZqhYNcXM".into())]);

        let mut o = offer(OFFER_SDP);
        o[5].1 = Value::List(vec!["trust address".into(), "media-handover".into(), "loop-protect".into(), "frobnicate".into()]);
        o[6].1 = Value::List(vec!["origin".into(), "zero-address".into(), "username".into()]);
        o.push(("transport-protocol", "RTP/SAVP".into()));
        o.push(("address family", "IP6".into()));
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
            "transport-protocol (not supported: the SDP keeps its transport protocol",
            "address-family (not supported",
            "record-call (not supported: nothing is recorded)",
        ] {
            assert!(w.contains(named), "{named:?} not in the warning {w:?}");
        }
        for acted in
            ["trust-address", "media-handover", "replace=origin", "replace=zero-address", "call-id", "sdp", "loop-protect", "codec-strip", "codec.strip"]
        {
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
        let mut o = offer(&mux);
        o[1].1 = "third-call".into();
        o.push(("rtcp-mux", list(&["demux"])));
        assert!(text(&send(&mut e, &m, "o3", o), "warning").contains("rtcp-mux demux is not supported"));
    }

    fn list(items: &[&str]) -> Value {
        Value::List(items.iter().map(|s| Value::str(s)).collect())
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

        let t0 = Instant::now();
        let uids: Vec<u32> = m.read(|md, _| md.relays.values().flat_map(|r| [r.a.uid, r.b.uid]).collect());
        let mut stats = DataplaneStats::default();
        stats.streams.insert(uids[0], Counters { rx_packets: 1, ..Default::default() });
        assert!(e.expire_with(&m, &stats, t0 + Duration::from_secs(4)).is_empty());
        stats.streams.insert(uids[0], Counters { rx_packets: 2, ..Default::default() });
        assert!(e.expire_with(&m, &stats, t0 + Duration::from_secs(8)).is_empty(), "media moved");
        assert!(e.expire_with(&m, &stats, t0 + Duration::from_secs(12)).is_empty());
        assert_eq!(e.expire_with(&m, &stats, t0 + Duration::from_secs(13)), vec!["cfBXzDSZqhYNcXM".to_string()]);
        assert_eq!(m.read(|md, _| md.relays.len()), 0);
        assert_eq!(e.totals().timed_out, 1);
    }
}
