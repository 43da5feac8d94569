//! The per-packet pipeline, sans-I/O (as quinn-proto beside quinn-udp): what a data plane does
//! with one datagram that arrived at `local` from `src`, decided from the installed table, the
//! plane's state and the time passed in. A plane is a driver around it: it receives, calls
//! [`Pipeline::process`], and carries out the [`Effect`]s in their order (sends, counters,
//! events, measurements). The user-space plane is that driver; the BPF program
//! (`crates/ebpf/bpf/sfu_tc.bpf.c`) runs the same steps in the same order for what it decides
//! itself, and the conformance suite and the BPF fuzz driver hold both to [`reference`], this
//! pipeline's decision on [`ForwardingTable::classify`].
//!
//! The steps, in order:
//! 1. classify ([`ForwardingTable::classify`]): drop, slow path, a consumer's feedback, or media;
//! 2. the per-source limit, on everything classify does not drop;
//! 3. a consumer's feedback is unprotected if it is SRTCP and routed to the publishers it names
//!    ([`Plane::route_feedback`]), protected for each that speaks SRTP; what remains of a
//!    sender's report goes on as media of its stream;
//! 4. an SRTP stream's packet is unprotected ([`Plane::unprotect`]); what fails goes no further,
//!    so only the key's holder can move an SRTP leg's latch;
//! 5. a learning leg's new source is reported (the packet is still relayed);
//! 6. the stream's rate limit;
//! 7. what is measured in the path: RTP arrivals (reception quality), the times sender reports
//!    pass (consumers' round-trip times), a relay leg's RTCP for the control plane;
//! 8. the recording tap;
//! 9. the fan-out: a simulcast layer's copies decided and renumbered per consumer
//!    ([`Plane::layer_fan_out`]); any other stream's to every copy but its sender, each
//!    SRTP-protected with its consumer's key where it has one ([`Plane::protect`]); keyframe
//!    requests to the publisher protected with its key ([`StreamEntry::reverse`]).
//!
//! The [`Plane`] holds what the pipeline does not own: state shared between a plane's workers
//! (source buckets, the feedback router, the simulcast consumers) behind the plane's locks, and
//! its crypto. The pipeline owns what is per worker: the streams' rate limits.

use crate::call_quality::parse_reports;
use crate::feedback::FeedbackEntry;
use crate::feedback::Outcome;
use crate::ratelimit::{RateLimit, RateState};
use crate::rtp::{demux, MediaKind, RtpHeader};
use crate::srtp::{Protection, SrtpKey};
use crate::table::{Controlled, DropReason, ForwardingTable, SimulcastLayer, SlowReason, StreamEntry, Verdict};
use std::borrow::Cow;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

/// What the pipeline asks of the plane running it. None of it does I/O.
pub trait Plane {
    /// The per-source limit ([`ForwardingTable::source_limit`]): may `src` send `bytes` now?
    fn admit_source(&mut self, limit: RateLimit, src: IpAddr, now_ns: u64, bytes: u64) -> bool;
    /// Route a consumer's feedback ([`crate::feedback::FeedbackRouter::route_with`]); None: it is
    /// malformed.
    fn route_feedback(&mut self, entry: &FeedbackEntry, packet: &[u8], now_ns: u64) -> Option<Outcome>;
    /// An SRTP or SRTCP packet that arrived at the SFU address `at`, unprotected with that
    /// address's inbound `key` (one context per address and direction: every SSRC of a
    /// participant's transport shares it); None: dropped (no key yet, failed authentication, a
    /// replay: the plane counts why).
    fn unprotect(&mut self, at: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>>;
    /// A packet the SFU sends from its address `from`, protected with that address's outbound
    /// `key`; None: not sent (counted by the plane).
    fn protect(&mut self, from: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>>;
    /// True: the plane protects what it sends itself, after the decision (outside the locks it
    /// decides under, so encrypting copies for different subscribers runs in parallel):
    /// [`Plane::protect`] is not called, and a packet to protect with a key leaves as
    /// [`Effect::Send`] with `seal` set, in the clear.
    fn seals_later(&self) -> bool {
        false
    }
    /// A simulcast layer's packet (clear): the copies it makes for the consumers receiving that
    /// layer now, renumbered, and the keyframe requests to the publisher for layers consumers
    /// wait for (see `crate::simulcast`).
    fn layer_fan_out(&mut self, entry: &StreamEntry, layer: &SimulcastLayer, src: SocketAddr, packet: &[u8], now_ns: u64) -> LayerFanOut;
}

/// What one packet of a simulcast layer makes ([`Plane::layer_fan_out`]).
#[derive(Debug, Default)]
pub struct LayerFanOut {
    /// (copy number in the entry, the copy's bytes).
    pub copies: Vec<(usize, Vec<u8>)>,
    /// Keyframe requests to the publisher: (from, to, packet).
    pub requests: Vec<(SocketAddr, SocketAddr, Vec<u8>)>,
}

/// Why the pipeline dropped a packet (beside the model's own [`DropReason`]s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// What classify decided.
    Model(DropReason),
    /// Over the per-source limit (counted in total only: before any stream is charged).
    SourceLimited,
    /// Over its stream's rate limit.
    RateLimited,
    /// An SRTP packet that did not unprotect: counted as malformed.
    Malformed,
    /// A consumer's feedback the router could not parse (classify passed it): counted as
    /// malformed. (The kernel hands all feedback up: this is the slow path's drop.)
    MalformedFeedback,
    /// RTP that call control blocks ([`crate::table::StreamControl`]: NG `block media`, `block
    /// DTMF`). Not an error: counted apart.
    Blocked,
}

/// What a copy is a copy of: its stream and consumer, for the counters of both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOf {
    pub stream: u32,
    /// The consumer uid (0: none, a relay leg's copy).
    pub consumer: u32,
    /// An RTP packet of an RTP stream: the header the copy leaves with, for its consumer's
    /// quality as forwarded (counted once it is sent).
    pub rtp: Option<CopyRtp>,
}

/// The RTP header fields a copy leaves with (a simulcast consumer's renumbered ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRtp {
    pub ssrc: u32,
    pub sequence: u16,
    pub timestamp: u32,
    /// The stream's clock rate (0: unknown, no jitter).
    pub clock_rate: u32,
}

impl CopyRtp {
    /// The same fields read from `copy`, a renumbered copy of a packet they were parsed from
    /// (the rewrite changes them in place, nothing around them).
    fn renumbered(self, copy: &[u8]) -> CopyRtp {
        let at = |i: usize| copy.get(i..i + 4).map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
        CopyRtp { ssrc: at(8), sequence: (at(0) & 0xffff) as u16, timestamp: at(4), ..self }
    }
}

/// One thing the driver does, in order.
#[derive(Debug)]
pub enum Effect<'p> {
    /// Dropped and counted: in total, and for `stream` when known; `received`: the bytes the
    /// stream is also counted to have received (None: counted already, by [`Effect::Received`]).
    Dropped { why: Dropped, stream: Option<u32>, received: Option<usize> },
    /// Handed to the slow path's own handling (counted); `handshake`: an ICE leg's STUN or DTLS
    /// for the control plane, of this stream.
    SlowPath { reason: SlowReason, stream: Option<u32>, handshake: Option<u32> },
    /// A consumer's feedback, routed: its tallies, reports, REMBs and NACKs for the plane's
    /// bookkeeping (its packets to publishers follow as [`Effect::Send`]).
    Feedback(Box<Outcome>),
    /// Accepted on `stream` (`bytes` received; before SRTP and the rate limit).
    Received { stream: u32, bytes: usize },
    /// A learning leg heard `source`: for the control plane (the packet is relayed still).
    Unlatched { stream: u32, source: SocketAddr },
    /// Passed every check: the stream's last packet arrived now.
    Accepted { stream: u32 },
    /// An RTP packet measured in the path (reception quality).
    Rtp { stream: u32, header: RtpHeader, clock_rate: u32 },
    /// An RFC 4733 event packet with the end bit, of a stream whose events are reported
    /// ([`crate::table::StreamControl::report_dtmf`]): `event` is its first report (event code,
    /// E/R/volume, duration). A sender repeats the end packet (usually three times, with the
    /// event's timestamp): whoever reports it keeps one per `timestamp`.
    DtmfEnd { stream: u32, ssrc: u32, payload_type: u8, timestamp: u32, event: [u8; 4] },
    /// A packet on WebRTC transport `transport` that no stream claims named its simulcast
    /// encoding `rid` (and its section `mid`) in its header extensions: for the control plane,
    /// which learns the layer's SSRC ([`crate::model::Model::learn_layer`]).
    StreamId { transport: u32, ssrc: u32, mid: Option<String>, rid: String },
    /// An RTP packet of `entry` (`ssrc`), whose source the SFU feeds back to
    /// ([`crate::table::PublisherFeedback`]), came from `source`, with transport-wide sequence
    /// number `seq` when it carries one: the plane records its arrival and feeds back to the
    /// transport `entry.local` is (a packet the rate limit dropped never gets here: its sender
    /// sees it lost).
    /// `send_time`: its abs-send-time, when the SFU estimates the transport from those (`size`:
    /// its bytes). `max_bitrate_bps`: the room's ceiling on what its publishers send (a REMB).
    PublisherRtp {
        entry: crate::IngressKey,
        source: SocketAddr,
        ssrc: u32,
        seq: Option<u16>,
        send_time: Option<u32>,
        size: usize,
        max_bitrate_bps: Option<u64>,
    },
    /// A publisher's sender report passed (its NTP middle bits), for consumers' round-trip times.
    SenderReport { stream: u32, ntp_middle: u32 },
    /// A relay leg's RTCP for the control plane to evaluate (the plane applies its budget).
    RelayRtcp { stream: u32, packet: Cow<'p, [u8]> },
    /// A recorded stream's packet, clear (SRTP legs are recorded decrypted).
    Record { stream: u32, label: String, packet: Cow<'p, [u8]> },
    /// Send `packet` from the SFU address `from` to `to`; `copy`: what it is a copy of (None:
    /// feedback or a keyframe request to a publisher). `seal` (only with [`Plane::seals_later`]):
    /// `packet` is clear, and the plane protects it with `from`'s outbound SRTP context before
    /// sending it (if that fails: a copy is counted as not sent, anything else is not sent).
    Send { from: SocketAddr, to: SocketAddr, packet: Cow<'p, [u8]>, copy: Option<CopyOf>, seal: bool },
    /// A copy that could not be made (SRTP protect failed): counted as not sent.
    CopyFailed { copy: CopyOf },
    /// A copy for a subscriber that speaks SRTP but has no key yet (a browser before its DTLS
    /// handshake is done, an SDES leg before the answer): not made, and counted apart from the
    /// copies that failed (every browser's join makes some, which are no send errors).
    CopyUnkeyed { copy: CopyOf },
}

/// The pipeline of one worker: its own state (the streams' rate limits), the rest in the
/// [`Plane`] it is run with.
#[derive(Debug, Default)]
pub struct Pipeline {
    /// Per stream id: the limit its state was made for, and the state.
    rates: HashMap<u32, (RateLimit, RateState)>,
    /// Per stream id: where its DTMF events stand (kept while it has any).
    dtmf: HashMap<u32, crate::dtmf_inject::Injector>,
}

impl Pipeline {
    pub fn new() -> Pipeline {
        Pipeline::default()
    }

    /// Decide one datagram: `payload` arrived at `local` from `src` at `now_ns` (the limits'
    /// clock) / `received_at` (the monotonic clock measurements and feedback use). The effects
    /// are appended to `out`, in the order the driver must carry them out.
    #[allow(clippy::too_many_arguments)]
    pub fn process<'p>(
        &mut self,
        table: &ForwardingTable,
        local: SocketAddr,
        src: SocketAddr,
        payload: &'p [u8],
        now_ns: u64,
        received_at: u64,
        plane: &mut dyn Plane,
        out: &mut Vec<Effect<'p>>,
    ) {
        let verdict = table.classify(local, src, payload);
        if let (Some(limit), Verdict::Forward(_) | Verdict::Learn(_) | Verdict::Feedback { .. } | Verdict::SlowPath { .. }) = (table.source_limit, &verdict) {
            if !plane.admit_source(limit, src.ip(), now_ns, payload.len() as u64) {
                out.push(Effect::Dropped { why: Dropped::SourceLimited, stream: None, received: None });
                return;
            }
        }
        let (entry, learn, payload): (&StreamEntry, bool, Cow<'p, [u8]>) = match verdict {
            Verdict::Drop { reason, stream } => {
                out.push(Effect::Dropped { why: Dropped::Model(reason), stream, received: Some(payload.len()) });
                return;
            }
            Verdict::SlowPath { reason, stream } => {
                // An ICE leg's connectivity check or DTLS: the control plane answers it.
                let handshake = matches!(reason, SlowReason::Stun | SlowReason::Handshake)
                    .then(|| table.streams.get(&crate::IngressKey { local, ssrc: None }).filter(|e| e.handshake).map(|e| e.id))
                    .flatten();
                out.push(Effect::SlowPath { reason, stream, handshake });
                return;
            }
            Verdict::Feedback { entry: fb, stream } => {
                // A WebRTC consumer's SRTCP: readable only once unprotected.
                let clear = match &fb.inbound {
                    Protection::Clear => Cow::Borrowed(payload),
                    Protection::Srtp(key) => match plane.unprotect(fb.local, key.as_ref(), payload) {
                        Some(clear) => Cow::Owned(clear),
                        None => {
                            out.push(Effect::Dropped { why: Dropped::Malformed, stream: stream.map(|e| e.id), received: Some(payload.len()) });
                            return;
                        }
                    },
                };
                let Some(mut outcome) = plane.route_feedback(fb, &clear, received_at) else {
                    out.push(Effect::Dropped { why: Dropped::MalformedFeedback, stream: stream.map(|e| e.id), received: Some(payload.len()) });
                    return;
                };
                let routed = std::mem::take(&mut outcome.routed);
                let forward = outcome.forward.take();
                out.push(Effect::Feedback(Box::new(outcome)));
                for r in routed {
                    // Every routed packet goes where one of the entry's routes does; if not, it is not sent.
                    let Some(key) = fb.routes.iter().find(|route| (route.from, route.to) == (r.from, r.to)).map(|route| &route.outbound) else { continue };
                    if let Some((packet, seal)) = protected(plane, r.from, key, Cow::Owned(r.packet)) {
                        out.push(Effect::Send { from: r.from, to: r.to, packet, copy: None, seal });
                    }
                }
                // What remains of a sender's report goes on as its stream's media (clear now).
                match (stream, forward) {
                    (Some(entry), Some(report)) => {
                        self.media(entry, false, true, src, Cow::Owned(report), now_ns, received_at, plane, out);
                        return;
                    }
                    _ => return,
                }
            }
            Verdict::Forward(entry) => (entry, false, Cow::Borrowed(payload)),
            Verdict::Learn(entry) => (entry, true, Cow::Borrowed(payload)),
        };
        self.media(entry, learn, false, src, payload, now_ns, received_at, plane, out);
    }

    /// Steps 4 to 9 for a packet of `entry` (`clear`: unprotected already).
    #[allow(clippy::too_many_arguments)]
    fn media<'p>(
        &mut self,
        entry: &StreamEntry,
        learn: bool,
        clear: bool,
        src: SocketAddr,
        payload: Cow<'p, [u8]>,
        now_ns: u64,
        received_at: u64,
        plane: &mut dyn Plane,
        out: &mut Vec<Effect<'p>>,
    ) {
        out.push(Effect::Received { stream: entry.id, bytes: payload.len() });
        let mut payload: Cow<'p, [u8]> = match &entry.inbound {
            _ if clear => payload,
            Protection::Clear => payload,
            Protection::Srtp(key) => match plane.unprotect(entry.key.local, key.as_ref(), &payload) {
                Some(clear) => Cow::Owned(clear),
                None => {
                    out.push(Effect::Dropped { why: Dropped::Malformed, stream: Some(entry.id), received: None });
                    return;
                }
            },
        };
        if learn {
            out.push(Effect::Unlatched { stream: entry.id, source: src });
        }
        if let Some(limit) = entry.rate.filter(|l| !l.is_unlimited()) {
            if !self.admit_stream(entry.id, limit, now_ns, payload.len() as u64) {
                out.push(Effect::Dropped { why: Dropped::RateLimited, stream: Some(entry.id), received: None });
                return;
            }
        }
        out.push(Effect::Accepted { stream: entry.id });
        // What every copy of an RTP packet is accounted with (parsed once for all of them).
        let mut rtp = None;
        match demux(&payload) {
            MediaKind::Rtp if entry.rtp => {
                if let Ok(header) = RtpHeader::parse(&payload) {
                    if let Some((mid, rid)) = entry.stream_ids.and_then(|ids| stream_ids(ids, &header, &payload)) {
                        out.push(Effect::StreamId { transport: entry.id, ssrc: header.ssrc, mid, rid });
                    }
                    if let Some(fb) = &entry.publisher_feedback {
                        let seq = fb.transport_cc.and_then(|id| crate::transport_feedback::sequence_of(&header, &payload, id));
                        // Video only (90 kHz): a browser's REMB governs its video encoders, its audio
                        // is sent on top; counted in what arrives, audio would let video take its share.
                        let video = entry.clock_rate == crate::remote_estimate::VIDEO_CLOCK_RATE;
                        let send_time = fb.abs_send_time.filter(|_| video).and_then(|id| crate::remote_estimate::send_time_of(&header, &payload, id));
                        let (ssrc, size, max_bitrate_bps) = (header.ssrc, payload.len(), fb.max_bitrate_bps);
                        out.push(Effect::PublisherRtp { entry: entry.key, source: src, ssrc, seq, send_time, size, max_bitrate_bps });
                    }
                    rtp = Some(CopyRtp { ssrc: header.ssrc, sequence: header.sequence, timestamp: header.timestamp, clock_rate: entry.clock_rate });
                    out.push(Effect::Rtp { stream: entry.id, header, clock_rate: entry.clock_rate });
                    // What the party sent is reported, blocked or not.
                    if entry.control.reports(header.payload_type) {
                        let event = &payload[header.payload_offset..header.payload_offset + header.payload_len];
                        if let [code, flags, d0, d1, ..] = *event {
                            if flags & 0x80 != 0 {
                                out.push(Effect::DtmfEnd {
                                    stream: entry.id,
                                    ssrc: header.ssrc,
                                    payload_type: header.payload_type,
                                    timestamp: header.timestamp,
                                    event: [code, flags, d0, d1],
                                });
                            }
                        }
                    }
                    // After the reception accounting: a blocked party is still heard (its
                    // quality, its media timeout), only not passed on.
                    match entry.control.judge(header.payload_type) {
                        Controlled::Pass => {}
                        Controlled::Drop => {
                            out.push(Effect::Dropped { why: Dropped::Blocked, stream: Some(entry.id), received: None });
                            return;
                        }
                        Controlled::Silence(byte) => {
                            let mut silenced = payload.into_owned();
                            silenced[header.payload_offset..header.payload_offset + header.payload_len].fill(byte);
                            payload = Cow::Owned(silenced);
                        }
                    }
                    if !entry.dtmf.is_empty() {
                        if let Some(event) = self.dtmf.entry(entry.id).or_default().rewrite(&entry.dtmf, entry.clock_rate, &header, &payload) {
                            payload = Cow::Owned(event);
                        }
                    } else if !self.dtmf.is_empty() {
                        // Its events are over (the ids of new ones only grow: a fresh state plays them).
                        self.dtmf.remove(&entry.id);
                    }
                }
            }
            // Timed for its consumers' round-trip times, and for the receiver reports the SFU
            // sends a publisher it feeds back to (their LSR and DLSR).
            MediaKind::Rtcp if entry.times_sender_reports() || entry.publisher_feedback.is_some() => {
                if let Some(sr) = parse_reports(&payload).and_then(|(srs, _)| srs.into_iter().next()) {
                    out.push(Effect::SenderReport { stream: entry.id, ntp_middle: sr.ntp_middle });
                }
            }
            MediaKind::Rtcp if entry.evaluate_rtcp => out.push(Effect::RelayRtcp { stream: entry.id, packet: payload.clone() }),
            _ => {}
        }
        if entry.record {
            out.push(Effect::Record { stream: entry.id, label: entry.label.clone(), packet: payload.clone() });
        }
        if let Some(layer) = &entry.simulcast {
            let fan = plane.layer_fan_out(entry, layer, src, &payload, received_at);
            for (i, bytes) in fan.copies {
                let c = &entry.copies[i];
                let copy = CopyOf { stream: entry.id, consumer: c.consumer, rtp: rtp.map(|r| r.renumbered(&bytes)) };
                // Renumbered first, then protected for its subscriber (a browser's is SRTP).
                out.push(copy_effect(plane, c, (c.from, c.to), copy, Cow::Owned(bytes)));
            }
            for (from, to, packet) in fan.requests {
                if let Some((packet, seal)) = protected(plane, from, &entry.reverse, Cow::Owned(packet)) {
                    out.push(Effect::Send { from, to, packet, copy: None, seal });
                }
            }
            return;
        }
        // A receiver that keeps RTCP apart from RTP gets it on its RTCP address (`Copy::rtcp`).
        let rtcp = rtp.is_none() && entry.rtp && entry.copies.iter().any(|c| c.rtcp.is_some()) && demux(&payload) == MediaKind::Rtcp;
        for c in &entry.copies {
            if c.to == src {
                continue; // never back to the sender, whatever the table says
            }
            let copy = CopyOf { stream: entry.id, consumer: c.consumer, rtp };
            out.push(copy_effect(plane, c, c.route(rtcp), copy, payload.clone()));
        }
    }

    /// Step 6: GCRA per stream, its state started afresh when the limit changes.
    fn admit_stream(&mut self, stream: u32, limit: RateLimit, now_ns: u64, bytes: u64) -> bool {
        let (l, st) = self.rates.entry(stream).or_insert((limit, RateState::default()));
        if *l != limit {
            *l = limit;
            *st = RateState::default();
        }
        limit.params().admit(st, now_ns, bytes)
    }
}

/// The MID and RID a packet's header extensions name (RFC 8843, RFC 8852), if it names a RID
/// that can be one (RFC 8851's letters, digits, `-` and `_`; at most 16 of them).
fn stream_ids(ids: crate::model::StreamIdExtensions, header: &RtpHeader, packet: &[u8]) -> Option<(Option<String>, String)> {
    let elements = header.extension_elements(packet).ok()?;
    let text = |id: u8| -> Option<String> {
        let (_, v) = elements.iter().find(|(i, _)| *i == id)?;
        let ok = !v.is_empty() && v.len() <= 16 && v.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_');
        ok.then(|| String::from_utf8_lossy(v).into_owned())
    };
    Some((ids.mid.and_then(text), text(ids.rid)?))
}

/// One copy to `c`, from and to `route` (its own, or its RTCP's): sent protected as `c` wants it,
/// or counted as failed if it cannot be (as not keyed, without asking the plane, when `c` has no
/// key yet).
fn copy_effect<'p>(plane: &mut dyn Plane, c: &crate::table::Copy, route: (SocketAddr, SocketAddr), copy: CopyOf, mut packet: Cow<'p, [u8]>) -> Effect<'p> {
    if c.outbound == Protection::Srtp(None) {
        return Effect::CopyUnkeyed { copy };
    }
    if let Some((from, to)) = c.payload_type {
        // RTP only (`copy.rtp`): the byte is RTCP's packet type otherwise.
        if copy.rtp.is_some() && packet.len() > 1 && packet[1] & 0x7f == from {
            packet.to_mut()[1] = (packet[1] & 0x80) | (to & 0x7f);
        }
    }
    let (from, to) = route;
    match protected(plane, from, &c.outbound, packet) {
        Some((packet, seal)) => Effect::Send { from, to, packet, copy: Some(copy), seal },
        None => Effect::CopyFailed { copy },
    }
}

/// `packet` as it leaves the SFU address `from`: as it is, or protected with `protection`'s key
/// (None: it cannot be, and is not sent), or left for the plane to seal (`true`, see
/// [`Plane::seals_later`]).
fn protected<'p>(plane: &mut dyn Plane, from: SocketAddr, protection: &Protection, packet: Cow<'p, [u8]>) -> Option<(Cow<'p, [u8]>, bool)> {
    match protection {
        Protection::Clear => Some((packet, false)),
        Protection::Srtp(Some(_)) if plane.seals_later() => Some((packet, true)),
        Protection::Srtp(key) => plane.protect(from, key.as_ref(), &packet).map(|p| (Cow::Owned(p), false)),
    }
}

/// The pipeline's decision for one datagram with no plane state of its own: the oracle the
/// conformance suite and the BPF fuzz driver hold the data planes to. Every source is admitted,
/// no SRTP key is held (an SRTP stream's packet is dropped: a plane without its key cannot
/// unprotect it), feedback is handed to a router that keeps nothing (an [`Effect::Feedback`]
/// with nothing routed, and what remains of a sender's report forwarded), and a simulcast
/// layer's packet goes to every consumer as it is (the layer decision is judged apart, against
/// `crate::simulcast::LayerRewriter`).
pub fn reference<'p>(table: &ForwardingTable, local: SocketAddr, src: SocketAddr, payload: &'p [u8]) -> Vec<Effect<'p>> {
    struct Stateless;
    impl Plane for Stateless {
        fn admit_source(&mut self, _: RateLimit, _: IpAddr, _: u64, _: u64) -> bool {
            true
        }
        fn route_feedback(&mut self, entry: &FeedbackEntry, packet: &[u8], now_ns: u64) -> Option<Outcome> {
            let mut o = crate::feedback::FeedbackRouter::default().route_with(entry, packet, now_ns, &NoLayers).ok()?;
            o.routed.clear();
            Some(o)
        }
        fn unprotect(&mut self, _: SocketAddr, _: Option<&SrtpKey>, _: &[u8]) -> Option<Vec<u8>> {
            None
        }
        fn protect(&mut self, _: SocketAddr, _: Option<&SrtpKey>, _: &[u8]) -> Option<Vec<u8>> {
            None
        }
        fn layer_fan_out(&mut self, entry: &StreamEntry, _: &SimulcastLayer, src: SocketAddr, packet: &[u8], _: u64) -> LayerFanOut {
            LayerFanOut {
                copies: entry.copies.iter().enumerate().filter(|(_, c)| c.to != src).map(|(i, _)| (i, packet.to_vec())).collect(),
                requests: Vec::new(),
            }
        }
    }
    let mut out = Vec::new();
    Pipeline::new().process(table, local, src, payload, 0, 0, &mut Stateless, &mut out);
    out
}

/// No simulcast consumers: feedback about none is mapped.
struct NoLayers;

impl crate::feedback::LayerMap for NoLayers {
    fn layer(&self, _: u32) -> Option<u8> {
        None
    }
    fn original(&self, _: u32, _: u16) -> Option<(u8, u16)> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feedback::FeedbackRouter;
    use crate::model::{Model, StreamRef, StreamSpec};
    use crate::rtp::build_rtp;
    use crate::srtp::{SrtpKey, SrtpSuite};
    use crate::table::SourceRule;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    const P0_LOCAL: &str = "10.0.0.1:4000";
    const P0: &str = "10.0.1.1:5000";
    const P1_LOCAL: &str = "10.0.0.1:4002";
    const P1: &str = "10.0.1.2:5000";

    /// p0 publishes "main" (RTP, 8 kHz); p1 and p2 subscribe.
    fn room() -> ForwardingTable {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        for (i, (local, remote)) in [(P0_LOCAL, P0), (P1_LOCAL, P1), ("10.0.0.1:4004", "10.0.1.3:5000")].into_iter().enumerate() {
            m.add_participant("r", &format!("p{i}"), a(local), a(remote)).unwrap();
        }
        m.publish("r", "p0", "main", StreamSpec { clock_rate: Some(8000), ..Default::default() }).unwrap();
        for s in ["p1", "p2"] {
            m.subscribe("r", s, StreamRef { publisher: "p0".into(), stream: "main".into() }).unwrap();
        }
        ForwardingTable::compile(&m, 1)
    }

    fn main_entry(t: &mut ForwardingTable) -> &mut StreamEntry {
        t.streams.get_mut(&crate::IngressKey { local: a(P0_LOCAL), ssrc: None }).unwrap()
    }

    /// A plane that records what it was asked: SRTP "unprotects" by dropping a trailing byte
    /// (0xee marks a good tag), sources are admitted while `sources_left` lasts.
    #[derive(Default)]
    struct FakePlane {
        sources_left: Option<u32>,
        router: FeedbackRouter,
        protect_fails: bool,
        /// The router finds the feedback malformed (classify passed it).
        route_fails: bool,
        asked: Vec<String>,
    }

    impl Plane for FakePlane {
        fn admit_source(&mut self, _: RateLimit, src: IpAddr, _: u64, _: u64) -> bool {
            self.asked.push(format!("source {src}"));
            match &mut self.sources_left {
                Some(0) => false,
                Some(n) => {
                    *n -= 1;
                    true
                }
                None => true,
            }
        }
        fn route_feedback(&mut self, entry: &FeedbackEntry, packet: &[u8], now_ns: u64) -> Option<Outcome> {
            self.asked.push("feedback".into());
            if self.route_fails {
                return None;
            }
            self.router.route_with(entry, packet, now_ns, &NoLayers).ok()
        }
        fn unprotect(&mut self, at: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>> {
            self.asked.push(format!("unprotect at {at}"));
            (key.is_some() && packet.last() == Some(&0xee)).then(|| packet[..packet.len() - 1].to_vec())
        }
        fn protect(&mut self, from: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>> {
            self.asked.push(format!("protect from {from}"));
            (key.is_some() && !self.protect_fails).then(|| [packet, &[0xee]].concat())
        }
        /// Every consumer receives this layer, "renumbered" by a byte appended.
        fn layer_fan_out(&mut self, entry: &StreamEntry, _: &SimulcastLayer, _: SocketAddr, packet: &[u8], _: u64) -> LayerFanOut {
            self.asked.push("layer fan-out".into());
            LayerFanOut { copies: (0..entry.copies.len()).map(|i| (i, [packet, &[0x5a]].concat())).collect(), requests: Vec::new() }
        }
    }

    /// The effects of one packet, as short names with what matters of them.
    fn run(p: &mut Pipeline, t: &ForwardingTable, plane: &mut FakePlane, local: &str, src: &str, packet: &[u8], now: u64) -> Vec<String> {
        let mut out = Vec::new();
        p.process(t, a(local), a(src), packet, now, now, plane, &mut out);
        out.iter()
            .map(|e| match e {
                Effect::Dropped { why, received, .. } => format!("dropped {why:?} {}", received.is_some()),
                Effect::SlowPath { reason, handshake, .. } => format!("slow {reason:?} {}", handshake.is_some()),
                Effect::Feedback(o) => format!("feedback {} routed", o.total.routed),
                Effect::Received { .. } => "received".into(),
                Effect::Unlatched { source, .. } => format!("unlatched {source}"),
                Effect::Accepted { .. } => "accepted".into(),
                Effect::Rtp { header, clock_rate, .. } => format!("rtp {} {clock_rate}", header.sequence),
                Effect::SenderReport { .. } => "sender report".into(),
                Effect::RelayRtcp { .. } => "relay rtcp".into(),
                Effect::Record { .. } => "record".into(),
                Effect::StreamId { ssrc, mid, rid, .. } => format!("stream id {ssrc} {mid:?} {rid}"),
                Effect::PublisherRtp { ssrc, seq, .. } => format!("publisher rtp {ssrc} {seq:?}"),
                Effect::Send { to, packet, copy, .. } => format!("send {to} {} {}", packet.len(), copy.map_or(0, |c| c.consumer)),
                Effect::CopyFailed { copy } => format!("copy failed {}", copy.consumer),
                Effect::CopyUnkeyed { copy } => format!("copy unkeyed {}", copy.consumer),
                Effect::DtmfEnd { timestamp, event, .. } => format!("dtmf end {timestamp} {}", event[0]),
            })
            .collect()
    }

    fn consumers(t: &ForwardingTable) -> Vec<u32> {
        t.streams.values().find(|e| e.key.local == a(P0_LOCAL)).unwrap().copies.iter().map(|c| c.consumer).collect()
    }

    #[test]
    fn media_is_measured_and_copied_to_every_consumer_but_its_sender() {
        let mut t = room();
        let c = consumers(&t);
        // The table says "back to the sender" too: never.
        let mut back = main_entry(&mut t).copies[0].clone();
        back.to = a(P0);
        main_entry(&mut t).copies.push(back);
        let rtp = build_rtp(0, 7, 160, 9, &[1; 20]);
        let got = run(&mut Pipeline::new(), &t, &mut FakePlane::default(), P0_LOCAL, P0, &rtp, 1);
        assert_eq!(got, ["received", "accepted", "rtp 7 8000", &format!("send 10.0.1.2:5000 32 {}", c[0]), &format!("send 10.0.1.3:5000 32 {}", c[1])]);
        // A stranger's: dropped as classify says, charged to the stream.
        let got = run(&mut Pipeline::new(), &t, &mut FakePlane::default(), P0_LOCAL, "10.9.9.9:1", &rtp, 1);
        assert_eq!(got, ["dropped Model(Stranger) true"]);
    }

    /// An entry waiting for simulcast layers reports the RID (and MID) a packet's header
    /// extensions name, and nothing for a packet that names none or no RID that can be one.
    #[test]
    fn an_entry_learning_layers_reports_the_rid_and_mid_packets_name() {
        let mut t = room();
        main_entry(&mut t).stream_ids = Some(crate::model::StreamIdExtensions { rid: 10, mid: Some(9) });
        // One-byte header extensions (RFC 8285): MID "1" (id 9), RID "h" (id 10), padding.
        let with = |elements: &[u8]| {
            let mut p = build_rtp(96, 7, 160, 0x1234, &[1; 20]);
            p[0] |= 0x10;
            let mut ext = vec![0xbe, 0xde, 0, (elements.len().div_ceil(4)) as u8];
            ext.extend_from_slice(elements);
            ext.resize(4 + elements.len().div_ceil(4) * 4, 0);
            p.splice(12..12, ext);
            p
        };
        let got = run(&mut Pipeline::new(), &t, &mut FakePlane::default(), P0_LOCAL, P0, &with(&[0x90, b'1', 0xa0, b'h']), 1);
        assert!(got.contains(&"stream id 4660 Some(\"1\") h".to_string()), "{got:?}");
        let got = run(&mut Pipeline::new(), &t, &mut FakePlane::default(), P0_LOCAL, P0, &with(&[0xa1, b'h', b'i']), 1);
        assert!(got.contains(&"stream id 4660 None hi".to_string()), "no MID: the RID alone {got:?}");
        for unnamed in [with(&[0x90, b'1']), with(&[0xa0, b' ']), build_rtp(96, 7, 160, 0x1234, &[1; 20])] {
            let got = run(&mut Pipeline::new(), &t, &mut FakePlane::default(), P0_LOCAL, P0, &unnamed, 1);
            assert!(got.iter().all(|e| !e.starts_with("stream id")) && got.iter().filter(|e| e.starts_with("send")).count() == 2, "{got:?}");
        }
        // An entry not learning reads no extension.
        main_entry(&mut t).stream_ids = None;
        let got = run(&mut Pipeline::new(), &t, &mut FakePlane::default(), P0_LOCAL, P0, &with(&[0x90, b'1', 0xa0, b'h']), 1);
        assert!(got.iter().all(|e| !e.starts_with("stream id")), "{got:?}");
    }

    /// Each copy carries the RTP header it leaves with, for its consumer's quality as forwarded:
    /// a plain copy the packet's, a renumbered one its own; RTCP none.
    #[test]
    fn copies_carry_the_rtp_header_they_leave_with() {
        let t = room();
        let rtp = build_rtp(0, 7, 160, 9, &[1; 20]);
        let mut out = Vec::new();
        Pipeline::new().process(&t, a(P0_LOCAL), a(P0), &rtp, 1, 1, &mut FakePlane::default(), &mut out);
        let marks: Vec<Option<CopyRtp>> = out
            .iter()
            .filter_map(|e| match e {
                Effect::Send { copy: Some(c), .. } => Some(c.rtp),
                _ => None,
            })
            .collect();
        assert_eq!(marks, vec![Some(CopyRtp { ssrc: 9, sequence: 7, timestamp: 160, clock_rate: 8000 }); 2]);
        let renumbered = build_rtp(0, 1000, 90_000, 0x100, &[1; 20]);
        assert_eq!(marks[0].unwrap().renumbered(&renumbered), CopyRtp { ssrc: 0x100, sequence: 1000, timestamp: 90_000, clock_rate: 8000 });
        let rr = crate::call_quality::build_report(9, None, &[]);
        out.clear();
        Pipeline::new().process(&t, a(P0_LOCAL), a(P0), &rr, 1, 1, &mut FakePlane::default(), &mut out);
        assert!(out.iter().any(|e| matches!(e, Effect::Send { copy: Some(CopyOf { rtp: None, .. }), .. })), "{out:?}");
    }

    /// A copy renumbering the payload type (a browser's, over WHEP) carries its own on the RTP
    /// of the stream's payload type; other payload types, RTCP and the other copies are as sent.
    #[test]
    fn a_copy_renumbering_the_payload_type_carries_its_own() {
        let mut t = room();
        main_entry(&mut t).copies[1].payload_type = Some((96, 102));
        let sent = |packet: &[u8]| {
            let mut out = Vec::new();
            Pipeline::new().process(&t, a(P0_LOCAL), a(P0), packet, 1, 1, &mut FakePlane::default(), &mut out);
            out.iter()
                .filter_map(|e| match e {
                    Effect::Send { packet, .. } => Some(packet.to_vec()),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        let mut marked = build_rtp(96, 7, 160, 9, &[1; 20]);
        marked[1] |= 0x80;
        let copies = sent(&marked);
        assert_eq!((copies[0][1], copies[1][1]), (0x80 | 96, 0x80 | 102), "the marker bit kept");
        assert_eq!(copies[1][2..], marked[2..], "nothing else changed");
        let other = sent(&build_rtp(97, 8, 160, 9, &[1; 20]));
        assert_eq!((other[0][1], other[1][1]), (97, 97));
        let rr = crate::call_quality::build_report(9, None, &[]);
        assert!(sent(&rr).iter().all(|c| *c == rr), "RTCP is not RTP: its second byte is its type");
    }

    #[test]
    fn the_source_limit_comes_before_anything_else_and_only_for_what_classify_keeps() {
        let mut t = room();
        t.source_limit = Some(RateLimit { pps: 1, bps: 0, burst_ms: 0 });
        let mut plane = FakePlane { sources_left: Some(1), ..Default::default() };
        let rtp = build_rtp(0, 7, 160, 9, &[1; 20]);
        let mut p = Pipeline::new();
        assert_eq!(run(&mut p, &t, &mut plane, P0_LOCAL, P0, &rtp, 1).len(), 5);
        assert_eq!(run(&mut p, &t, &mut plane, P0_LOCAL, P0, &rtp, 2), ["dropped SourceLimited false"]);
        // A stranger is dropped by classify and never charged.
        assert_eq!(run(&mut p, &t, &mut plane, P0_LOCAL, "10.9.9.9:1", &rtp, 3), ["dropped Model(Stranger) true"]);
        assert_eq!(plane.asked, ["source 10.0.1.1", "source 10.0.1.1"]);
    }

    /// A simulcast layer's copies are renumbered, then protected for each subscriber that
    /// speaks SRTP (a browser's): a renumbered copy is never sent in clear to it.
    #[test]
    fn simulcast_copies_are_protected_after_they_are_renumbered() {
        let mut t = room();
        let key = SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, vec![7; 30]).unwrap();
        let e = main_entry(&mut t);
        e.simulcast = Some(SimulcastLayer { group: e.id, index: 0, layers: vec![(e.id, 9)], codec: Default::default() });
        e.copies[1].outbound = Protection::Srtp(Some(key));
        let c = consumers(&t);
        let mut plane = FakePlane::default();
        let got = run(&mut Pipeline::new(), &t, &mut plane, P0_LOCAL, P0, &build_rtp(0, 7, 160, 9, &[1; 20]), 1);
        assert_eq!(got[3..], [format!("send 10.0.1.2:5000 33 {}", c[0]), format!("send 10.0.1.3:5000 34 {}", c[1])]);
        assert_eq!(plane.asked, ["layer fan-out", "protect from 10.0.0.1:4004"]);
        plane.protect_fails = true;
        let got = run(&mut Pipeline::new(), &t, &mut plane, P0_LOCAL, P0, &build_rtp(0, 8, 160, 9, &[1; 20]), 1);
        assert_eq!(got[3..], [format!("send 10.0.1.2:5000 33 {}", c[0]), format!("copy failed {}", c[1])]);
    }

    /// A copy to a subscriber that speaks SRTP but has no key yet (a browser whose DTLS is not
    /// done) is not made and is told apart from a copy that failed; the plane is not asked to
    /// protect it. Plain copies and layer copies alike.
    #[test]
    fn copies_to_a_subscriber_not_keyed_yet_are_told_apart_from_failures() {
        let mut t = room();
        main_entry(&mut t).copies[1].outbound = Protection::Srtp(None);
        let c = consumers(&t);
        let mut plane = FakePlane::default();
        let got = run(&mut Pipeline::new(), &t, &mut plane, P0_LOCAL, P0, &build_rtp(0, 7, 160, 9, &[1; 20]), 1);
        assert_eq!(got[3..], [format!("send 10.0.1.2:5000 32 {}", c[0]), format!("copy unkeyed {}", c[1])]);
        assert!(plane.asked.is_empty(), "{:?}", plane.asked);
        let e = main_entry(&mut t);
        e.simulcast = Some(SimulcastLayer { group: e.id, index: 0, layers: vec![(e.id, 9)], codec: Default::default() });
        let got = run(&mut Pipeline::new(), &t, &mut plane, P0_LOCAL, P0, &build_rtp(0, 8, 160, 9, &[1; 20]), 1);
        assert_eq!(got[3..], [format!("send 10.0.1.2:5000 33 {}", c[0]), format!("copy unkeyed {}", c[1])]);
        assert_eq!(plane.asked, ["layer fan-out"]);
    }

    #[test]
    fn srtp_is_unprotected_before_the_latch_and_the_limits_and_protected_per_copy() {
        let mut t = room();
        let key = SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, vec![7; 30]).unwrap();
        let e = main_entry(&mut t);
        e.inbound = Protection::Srtp(Some(key.clone()));
        e.copies[1].outbound = Protection::Srtp(Some(key));
        e.source = SourceRule::Learn(None);
        let c = consumers(&t);
        let clear = build_rtp(0, 7, 160, 9, &[1; 20]);
        let sealed = [&clear[..], &[0xee]].concat();
        let mut plane = FakePlane::default();
        let got = run(&mut Pipeline::new(), &t, &mut plane, P0_LOCAL, P0, &sealed, 1);
        assert_eq!(
            got,
            [
                "received",
                "unlatched 10.0.1.1:5000",
                "accepted",
                "rtp 7 8000",
                &format!("send 10.0.1.2:5000 32 {}", c[0]),
                &format!("send 10.0.1.3:5000 33 {}", c[1])
            ]
        );
        assert_eq!(plane.asked, [format!("unprotect at {P0_LOCAL}"), "protect from 10.0.0.1:4004".to_string()]);
        // One that does not unprotect goes no further: no latch report, no copy.
        let forged = [&clear[..], &[0x00]].concat();
        assert_eq!(run(&mut Pipeline::new(), &t, &mut plane, P0_LOCAL, P0, &forged, 1), ["received", "dropped Malformed false"]);
        // A copy that cannot be protected is counted as not sent; the others go.
        plane.protect_fails = true;
        let got = run(&mut Pipeline::new(), &t, &mut plane, P0_LOCAL, P0, &sealed, 1);
        assert_eq!(got[4..], [format!("send 10.0.1.2:5000 32 {}", c[0]), format!("copy failed {}", c[1])]);
    }

    #[test]
    fn the_stream_rate_limit_drops_the_excess_and_starts_afresh_when_it_changes() {
        let mut t = room();
        main_entry(&mut t).rate = Some(RateLimit { pps: 10, bps: 0, burst_ms: 0 });
        let rtp = build_rtp(0, 7, 160, 9, &[1; 20]);
        let mut p = Pipeline::new();
        let mut plane = FakePlane::default();
        let at = |ms: u64| 1_000_000_000 + ms * 1_000_000;
        assert!(run(&mut p, &t, &mut plane, P0_LOCAL, P0, &rtp, at(0)).contains(&"accepted".to_string()));
        assert_eq!(run(&mut p, &t, &mut plane, P0_LOCAL, P0, &rtp, at(1)), ["received", "dropped RateLimited false"]);
        assert!(run(&mut p, &t, &mut plane, P0_LOCAL, P0, &rtp, at(101)).contains(&"accepted".to_string()));
        // A new limit: a fresh bucket, the next packet passes at once.
        main_entry(&mut t).rate = Some(RateLimit { pps: 20, bps: 0, burst_ms: 0 });
        assert!(run(&mut p, &t, &mut plane, P0_LOCAL, P0, &rtp, at(102)).contains(&"accepted".to_string()));
    }

    #[test]
    fn a_consumers_feedback_is_routed_and_malformed_feedback_dropped() {
        use crate::feedback::build;
        // The stream is narrowed to an SSRC, which feedback names.
        let ssrc = 0x1234;
        let mut m = Model::new();
        m.create_room("r").unwrap();
        for (i, (local, remote)) in [(P0_LOCAL, P0), (P1_LOCAL, P1)].into_iter().enumerate() {
            m.add_participant("r", &format!("p{i}"), a(local), a(remote)).unwrap();
        }
        m.publish("r", "p0", "main", StreamSpec { ssrc: Some(ssrc), ..Default::default() }).unwrap();
        m.subscribe("r", "p1", StreamRef { publisher: "p0".into(), stream: "main".into() }).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        let mut plane = FakePlane::default();
        let pli = build::pli(0xb1, ssrc);
        let got = run(&mut Pipeline::new(), &t, &mut plane, P1_LOCAL, P1, &pli, 1);
        // To the publisher, in a compound the router makes (an empty receiver report first).
        assert_eq!(got, ["feedback 1 routed", &format!("send {P0} {} 0", 8 + pli.len())]);
        // A compound whose second packet's length runs past the end: classify drops it as
        // malformed, charged to the address's stream, and the router never sees it.
        let mut bad = [&pli[..], &pli[..]].concat();
        bad[pli.len() + 3] = 9;
        let got = run(&mut Pipeline::new(), &t, &mut plane, P1_LOCAL, P1, &bad, 1);
        assert_eq!(got, ["dropped Model(Malformed) true"]);
        assert_eq!(plane.asked, ["feedback"]);
        // One the router refuses although classify passed it: dropped as malformed feedback.
        plane.route_fails = true;
        assert_eq!(run(&mut Pipeline::new(), &t, &mut plane, P1_LOCAL, P1, &pli, 1), ["dropped MalformedFeedback true"]);
    }

    /// A participant that publishes and subscribes on one address sends a compound of its sender
    /// report and a PLI: the PLI goes to the publisher it names, the sender report on to its own
    /// stream's consumers, as media of that stream (timed for their round-trip times).
    #[test]
    fn a_sender_report_in_feedback_goes_on_as_its_streams_media() {
        use crate::call_quality::build_report;
        use crate::feedback::build;
        let mut m = Model::new();
        m.create_room("r").unwrap();
        for (i, (local, remote)) in [(P0_LOCAL, P0), (P1_LOCAL, P1)].into_iter().enumerate() {
            m.add_participant("r", &format!("p{i}"), a(local), a(remote)).unwrap();
        }
        m.publish("r", "p0", "main", StreamSpec { ssrc: Some(0x1234), ..Default::default() }).unwrap();
        m.publish("r", "p1", "cam", StreamSpec { ssrc: Some(0xb1), ..Default::default() }).unwrap();
        m.subscribe("r", "p1", StreamRef { publisher: "p0".into(), stream: "main".into() }).unwrap();
        let c0 = m.subscribe("r", "p0", StreamRef { publisher: "p1".into(), stream: "cam".into() }).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        let sr = build_report(0xb1, Some(0x0102_0304), &[]);
        let compound = [&sr[..], &build::pli(0xb1, 0x1234)].concat();
        let got = run(&mut Pipeline::new(), &t, &mut FakePlane::default(), P1_LOCAL, P1, &compound, 1);
        assert_eq!(got[..2], ["feedback 1 routed".to_string(), format!("send {P0} 20 0")]);
        assert_eq!(got[2..], ["received", "accepted", "sender report", &format!("send {P0} {} {c0}", sr.len())]);
    }

    #[test]
    fn an_ice_legs_stun_goes_to_the_control_plane() {
        let mut t = room();
        main_entry(&mut t).handshake = true;
        // A STUN binding request (type 0x0001, length 0, the magic cookie, a transaction id).
        let mut stun = vec![0, 1, 0, 0, 0x21, 0x12, 0xa4, 0x42];
        stun.extend_from_slice(&[3; 12]);
        let got = run(&mut Pipeline::new(), &t, &mut FakePlane::default(), P0_LOCAL, P0, &stun, 1);
        assert_eq!(got, ["slow Stun true"]);
        main_entry(&mut t).handshake = false;
        assert_eq!(run(&mut Pipeline::new(), &t, &mut FakePlane::default(), P0_LOCAL, P0, &stun, 1), ["slow Stun false"]);
    }

    /// Two browsers (WebRTC participants), each publishing one stream and subscribing to the
    /// other's: their STUN and DTLS go to the control plane; nothing passes before ICE
    /// nominated them and DTLS keyed them; then SRTCP feedback is unprotected once, routed
    /// protected with the publisher's key, and the sender report in it goes on as media without
    /// being unprotected again.
    #[test]
    fn webrtc_participants_feedback_and_media_are_unprotected_once_and_protected_per_receiver() {
        use crate::call_quality::build_report;
        use crate::feedback::build;
        use crate::srtp::LegSrtp;
        let mut m = Model::new();
        m.create_room("r").unwrap();
        for (i, local) in [P0_LOCAL, P1_LOCAL].into_iter().enumerate() {
            m.add_webrtc_participant("r", &format!("w{i}"), a(local)).unwrap();
        }
        m.publish("r", "w0", "main", StreamSpec { ssrc: Some(0x1234), ..Default::default() }).unwrap();
        m.publish("r", "w1", "cam", StreamSpec { ssrc: Some(0xb1), ..Default::default() }).unwrap();
        m.subscribe("r", "w1", StreamRef { publisher: "w0".into(), stream: "main".into() }).unwrap();
        let c0 = m.subscribe("r", "w0", StreamRef { publisher: "w1".into(), stream: "cam".into() }).unwrap();
        let sealed = |p: &[u8]| [p, &[0xee]].concat();
        let rtp = build_rtp(0, 7, 160, 0x1234, &[1; 20]);
        let mut stun = vec![0, 1, 0, 0, 0x21, 0x12, 0xa4, 0x42];
        stun.extend_from_slice(&[3; 12]);

        // Before ICE: the handshake's STUN reaches the control plane; media from anyone is a stranger's.
        let t = ForwardingTable::compile(&m, 1);
        assert_eq!(run(&mut Pipeline::new(), &t, &mut FakePlane::default(), P0_LOCAL, P0, &stun, 1), ["slow Stun true"]);
        assert_eq!(run(&mut Pipeline::new(), &t, &mut FakePlane::default(), P0_LOCAL, P0, &sealed(&rtp), 1), ["dropped Model(Stranger) true"]);
        assert!(t.streams.values().all(|e| e.copies.is_empty()), "nothing is sent before a nomination");

        // Nominated, not keyed yet: what arrives cannot be unprotected.
        m.set_participant_nominated("r", "w0", Some(a(P0))).unwrap();
        m.set_participant_nominated("r", "w1", Some(a(P1))).unwrap();
        let t = ForwardingTable::compile(&m, 2);
        let mut plane = FakePlane::default();
        assert_eq!(run(&mut Pipeline::new(), &t, &mut plane, P0_LOCAL, P0, &sealed(&rtp), 1), ["received", "dropped Malformed false"]);
        for (w, local) in [("w0", P0_LOCAL), ("w1", P1_LOCAL)] {
            let k = |b: u8| Some(SrtpKey::new(crate::srtp::SrtpSuite::AesCm128HmacSha1_80, vec![b; 30]).unwrap());
            let byte = a(local).port() as u8;
            m.set_participant_srtp("r", w, LegSrtp { inbound: k(byte), outbound: k(byte + 1) }).unwrap();
        }
        let t = ForwardingTable::compile(&m, 3);
        let mut plane = FakePlane::default();
        let got = run(&mut Pipeline::new(), &t, &mut plane, P0_LOCAL, P0, &sealed(&rtp), 1);
        assert_eq!(
            got,
            [
                "received",
                "accepted",
                // A WebRTC publisher's packet, for what the SFU feeds back to it (no transport-cc here).
                "publisher rtp 4660 None",
                "rtp 7 0",
                &format!("send {P1} {} {}", rtp.len() + 1, t.streams.values().find(|e| e.key.ssrc == Some(0x1234)).unwrap().copies[0].consumer)
            ]
        );
        assert_eq!(plane.asked, [format!("unprotect at {P0_LOCAL}"), format!("protect from {P1_LOCAL}")]);

        // w1's SRTCP: its sender report and a PLI for w0's stream.
        let sr = build_report(0xb1, Some(0x0102_0304), &[]);
        let compound = [&sr[..], &build::pli(0xb1, 0x1234)].concat();
        let mut plane = FakePlane::default();
        let got = run(&mut Pipeline::new(), &t, &mut plane, P1_LOCAL, P1, &sealed(&compound), 1);
        assert_eq!(got[..2], ["feedback 1 routed".to_string(), format!("send {P0} 21 0")]);
        assert_eq!(got[2..], ["received", "accepted", "sender report", &format!("send {P0} {} {c0}", sr.len() + 1)]);
        assert_eq!(
            plane.asked,
            [format!("unprotect at {P1_LOCAL}"), "feedback".into(), format!("protect from {P0_LOCAL}"), format!("protect from {P0_LOCAL}")]
        );
        // A forged one goes no further.
        let mut plane = FakePlane::default();
        let forged = [&compound[..], &[0]].concat();
        assert_eq!(run(&mut Pipeline::new(), &t, &mut plane, P1_LOCAL, P1, &forged, 1), ["dropped Malformed true"]);
        assert_eq!(plane.asked, [format!("unprotect at {P1_LOCAL}")]);
    }

    /// A relay 10.0.0.1:6000 (A, peer 10.0.2.1:4000) <-> 10.0.0.1:6002 (B, peer 10.0.2.2:4000),
    /// A's SDP mapping `telephone-event` to 101, under call control `call` and A's own `a`.
    fn controlled_relay(call: crate::model::MediaControl, a_own: crate::model::MediaControl) -> ForwardingTable {
        use crate::model::{LegSpec, Side};
        let mut m = Model::default();
        let leg = |local: &str, remote: &str| LegSpec { local: a(local), remote: Some(a(remote)), strict: false, rtp: true, follow: Default::default() };
        m.create_relay("call", leg("10.0.0.1:6000", "10.0.2.1:4000"), leg("10.0.0.1:6002", "10.0.2.2:4000")).unwrap();
        m.set_leg_telephone_events("call", Side::A, vec![101]).unwrap();
        m.set_media_control("call", None, call).unwrap();
        m.set_media_control("call", Some(Side::A), a_own).unwrap();
        ForwardingTable::compile(&m, 1)
    }

    /// What leaves for B of a packet A sends: the payload after the 12-byte header, or why not.
    fn relayed(t: &ForwardingTable, packet: &[u8]) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        Pipeline::new().process(t, a("10.0.0.1:6000"), a("10.0.2.1:4000"), packet, 1, 1, &mut FakePlane::default(), &mut out);
        let sent: Vec<&[u8]> = out.iter().filter_map(|e| if let Effect::Send { packet, .. } = e { Some(&packet[..]) } else { None }).collect();
        let dropped: Vec<String> = out.iter().filter_map(|e| if let Effect::Dropped { why, .. } = e { Some(format!("{why:?}")) } else { None }).collect();
        // A blocked packet is still heard: counted, measured, accepted from its source.
        assert!(out.iter().any(|e| matches!(e, Effect::Accepted { .. })) && out.iter().any(|e| matches!(e, Effect::Rtp { .. })));
        match (&sent[..], &dropped[..]) {
            ([p], []) => Ok(p[12..].to_vec()),
            ([], [why]) => Err(why.clone()),
            _ => panic!("{out:?}"),
        }
    }

    #[test]
    fn reported_dtmf_is_each_end_packet_of_the_senders_events_blocked_or_not() {
        use crate::model::{MediaControl, Side};
        let ends = |t: &ForwardingTable, packet: &[u8]| -> Vec<(u32, [u8; 4])> {
            let mut out = Vec::new();
            Pipeline::new().process(t, a("10.0.0.1:6000"), a("10.0.2.1:4000"), packet, 1, 1, &mut FakePlane::default(), &mut out);
            out.iter().filter_map(|e| if let Effect::DtmfEnd { timestamp, event, .. } = e { Some((*timestamp, *event)) } else { None }).collect()
        };
        let (start, end, audio, short) = (
            build_rtp(101, 4, 800, 9, &[5, 0x0a, 0, 160]),
            build_rtp(101, 5, 800, 9, &[5, 0x8a, 2, 128]),
            build_rtp(8, 6, 960, 9, &[0x2a; 160]),
            build_rtp(101, 7, 1120, 9, &[5, 0x8a]),
        );
        let off = MediaControl::default();
        let mut m = Model::default();
        let leg = |local: &str, remote: &str| crate::model::LegSpec {
            local: a(local),
            remote: Some(a(remote)),
            strict: false,
            rtp: true,
            follow: Default::default(),
        };
        m.create_relay("call", leg("10.0.0.1:6000", "10.0.2.1:4000"), leg("10.0.0.1:6002", "10.0.2.2:4000")).unwrap();
        m.set_leg_telephone_events("call", Side::A, vec![101]).unwrap();
        // Not asked for: nothing reported, nothing compiled.
        let t = ForwardingTable::compile(&m, 1);
        assert!(ends(&t, &end).is_empty());
        assert!(t.streams.values().all(|e| e.control.is_off()));
        m.set_report_dtmf("call", true).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        assert!(t.streams.values().all(|e| e.control.report_dtmf && e.control.control == off));
        assert_eq!(ends(&t, &end), [(800, [5, 0x8a, 2, 128])]);
        assert!(ends(&t, &start).is_empty() && ends(&t, &audio).is_empty() && ends(&t, &short).is_empty());
        // Reported and still relayed; blocked DTMF is still reported (the party sent it).
        assert_eq!(relayed(&t, &end), Ok(vec![5, 0x8a, 2, 128]));
        m.set_media_control("call", Some(Side::A), MediaControl { block_dtmf: true, ..off }).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        assert_eq!(relayed(&t, &end), Err("Blocked".into()));
        assert_eq!(ends(&t, &end).len(), 1);
    }

    #[test]
    fn call_control_blocks_media_or_dtmf_and_silences_g711_but_never_rtcp() {
        use crate::model::MediaControl;
        let off = MediaControl::default();
        let block = MediaControl { block_media: true, ..off };
        let silence = MediaControl { silence_media: true, ..off };
        let dtmf = MediaControl { block_dtmf: true, ..off };
        let (pcma, pcmu, opus, event) = (
            build_rtp(8, 1, 0, 9, &[0x2a; 160]),
            build_rtp(0, 2, 0, 9, &[0x2a; 160]),
            build_rtp(111, 3, 0, 9, &[0x2a; 40]),
            build_rtp(101, 4, 0, 9, &[1, 0x8a, 0, 160]),
        );
        let t = controlled_relay(off, off);
        assert!(t.streams.values().all(|e| e.control.is_off()), "no control: nothing compiled, the kernel keeps the relay");
        assert_eq!(relayed(&t, &pcma), Ok(vec![0x2a; 160]));

        // The whole call's block reaches both directions; DTMF still passes.
        let t = controlled_relay(block, off);
        assert!(t.streams.values().all(|e| e.control.control.block_media && e.control.telephone_events == [101]));
        assert_eq!(relayed(&t, &pcma), Err("Blocked".into()));
        assert_eq!(relayed(&t, &event), Ok(vec![1, 0x8a, 0, 160]));
        // A's own: only what A sends.
        let t = controlled_relay(off, block);
        let from_b = t.streams.values().find(|e| e.key.local == a("10.0.0.1:6002")).unwrap();
        assert!(from_b.control.is_off());
        assert_eq!(relayed(&t, &pcmu), Err("Blocked".into()));

        // Silence: G.711 payloads become their silence byte; what has none passes as it was.
        let t = controlled_relay(off, silence);
        assert_eq!(relayed(&t, &pcma), Ok(vec![0xd5; 160]));
        assert_eq!(relayed(&t, &pcmu), Ok(vec![0xff; 160]));
        assert_eq!(relayed(&t, &opus), Ok(vec![0x2a; 40]));
        assert_eq!(relayed(&t, &event), Ok(vec![1, 0x8a, 0, 160]));

        // Blocked DTMF; media passes. Both together: only silence would be left, nothing is.
        let t = controlled_relay(dtmf, off);
        assert_eq!(relayed(&t, &event), Err("Blocked".into()));
        assert_eq!(relayed(&t, &pcma), Ok(vec![0x2a; 160]));
        let t = controlled_relay(dtmf, block);
        assert_eq!((relayed(&t, &event), relayed(&t, &opus)), (Err("Blocked".into()), Err("Blocked".into())));

        // RTCP (a muxed receiver report) is never blocked.
        let rr = [0x80, 201, 0, 1, 0, 0, 0, 9];
        let mut out = Vec::new();
        Pipeline::new().process(&t, a("10.0.0.1:6000"), a("10.0.2.1:4000"), &rr, 1, 1, &mut FakePlane::default(), &mut out);
        assert!(out.iter().any(|e| matches!(e, Effect::Send { .. })), "{out:?}");
    }

    /// `rtcp-mux-demux`: A (a browser) multiplexes, B keeps RTCP on its own port. A's RTCP on
    /// A's RTP address goes to B's RTCP address from B's RTCP address, A's RTP as before; B's
    /// RTCP at its RTCP address goes to A's RTP address from A's RTP address, from B's source only.
    #[test]
    fn demuxed_rtcp_goes_between_the_muxed_rtp_address_and_the_other_partys_rtcp_address() {
        use crate::model::{LegSpec, Side};
        let mut m = Model::default();
        let leg = |local: &str, remote: &str| LegSpec { local: a(local), remote: Some(a(remote)), strict: false, rtp: true, follow: Default::default() };
        m.create_relay("call", leg("10.0.0.1:6000", "10.0.2.1:4000"), leg("10.0.0.1:6002", "10.0.2.2:4000")).unwrap();
        let sends = |t: &ForwardingTable, local: &str, src: &str, packet: &[u8]| -> Vec<(SocketAddr, SocketAddr)> {
            let mut out = Vec::new();
            Pipeline::new().process(t, a(local), a(src), packet, 1, 1, &mut FakePlane::default(), &mut out);
            out.iter().filter_map(|e| if let Effect::Send { from, to, .. } = e { Some((*from, *to)) } else { None }).collect()
        };
        let (rtp, rr) = (build_rtp(0, 1, 0, 9, &[0xff; 160]), [0x80, 201, 0, 1, 0, 0, 0, 9]);
        // Without: RTCP rides with RTP.
        let t = ForwardingTable::compile(&m, 1);
        assert_eq!(sends(&t, "10.0.0.1:6000", "10.0.2.1:4000", &rr), [(a("10.0.0.1:6002"), a("10.0.2.2:4000"))]);
        assert!(!t.streams.values().any(|e| e.key.local == a("10.0.0.1:6003")));

        m.set_rtcp_demux("call", Side::B, a("10.0.0.1:6003"), Some(a("10.0.2.2:4001"))).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        assert_eq!(sends(&t, "10.0.0.1:6000", "10.0.2.1:4000", &rr), [(a("10.0.0.1:6003"), a("10.0.2.2:4001"))]);
        assert_eq!(sends(&t, "10.0.0.1:6000", "10.0.2.1:4000", &rtp), [(a("10.0.0.1:6002"), a("10.0.2.2:4000"))]);
        assert_eq!(sends(&t, "10.0.0.1:6003", "10.0.2.2:4001", &rr), [(a("10.0.0.1:6000"), a("10.0.2.1:4000"))]);
        // B's RTCP address is no way in for anyone else once its source is locked.
        let demuxed = t.streams.values().find(|e| e.key.local == a("10.0.0.1:6003")).unwrap();
        assert!(demuxed.rtcp_to_slow_path() && t.streams.values().find(|e| e.key.local == a("10.0.0.1:6000")).unwrap().rtcp_to_slow_path());
        assert_eq!(demuxed.source, SourceRule::Learn(None));
        let uid = demuxed.id;
        assert!(m.latch_demuxed_rtcp(uid, a("10.0.2.2:4001")).unwrap());
        m.close_learning(u64::MAX);
        let t = ForwardingTable::compile(&m, 1);
        assert_eq!(t.streams.values().find(|e| e.id == uid).unwrap().source, SourceRule::Any, "a window leg relays any source once locked");
        // Its address is the relay's, released with it.
        assert!(m.claim(a("10.0.0.1:6003"), "x".into()).is_err());
        assert!(m.clear_rtcp_demux("call").unwrap());
        assert!(m.demuxed_rtcp_by_uid(uid).is_none());
        m.set_rtcp_demux("call", Side::B, a("10.0.0.1:6003"), None).unwrap();
        m.delete_relay("call").unwrap();
        m.claim(a("10.0.0.1:6003"), "x".into()).unwrap();
    }
}
