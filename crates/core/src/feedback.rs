//! RTCP feedback in a room (RFC 3550, RFC 4585, RFC 5104): what a subscriber says about the
//! streams it receives goes back to their publishers; what is the SFU's own business stays here.
//!
//! A participant's RTCP arriving at its own SFU address from its registered address is its
//! feedback ([`crate::table::Verdict::Feedback`]). Per message of the compound packet:
//!
//! | message                              | what happens                                          |
//! |--------------------------------------|-------------------------------------------------------|
//! | PLI (PSFB 1), FIR (PSFB 4, per entry)| routed to the publisher of the media SSRC it names, at most one keyframe request per stream and SSRC per [`KEYFRAME_REQUEST_INTERVAL_NS`] (the rest coalesced: 50 subscribers asking at once cause one keyframe; the SFU's own request for a consumer waiting for a layer goes at once when the last one's keyframe already passed, [`FeedbackRouter::request_keyframe`]) |
//! | generic NACK (RTPFB 1)               | routed to the publisher (it retransmits), each sequence number at most once per [`NACK_REPEAT_INTERVAL_NS`] however many subscribers ask (the retransmission reaches them all), and within the stream's NACK budget ([`NACK_SHARE`] of its packets): one subscriber on a thin link cannot multiply its publisher's uplink; a NACK left with no number is coalesced |
//! | RR and the report blocks of an SR    | consumed: the receiver's view of each stream ([`Outcome::reports`]) |
//! | REMB (PSFB 15 "REMB")                | consumed: the receiver's estimate ([`Outcome::remb`]) for the consumers of the SSRCs it lists, input to layer choice |
//! | TWCC (RTPFB 15), other feedback, XR  | consumed (the SFU would have to answer them itself)   |
//! | SR sender info, SDES, BYE, APP       | a sender's own: forwarded to its subscribers ([`Outcome::forward`]) when the compound starts with an SR (the SR without its report blocks) |
//!
//! A feedback message naming an SSRC the participant does not receive (or one of a stream
//! published without an SSRC, which cannot be told apart) is counted as unroutable and goes
//! nowhere; so a participant can only ask for keyframes of what it is subscribed to. A compound
//! with a feedback message shorter than its type needs is malformed as a whole.
//!
//! What goes to a publisher is a compound packet of its own: an empty receiver report from the
//! subscriber's SSRC (RFC 3550 wants a compound to start with one) and the messages about that
//! publisher's streams, their media SSRCs mapped to what the publisher sent
//! ([`FeedbackRoute::publisher_ssrc`]). Sans-I/O: time is passed in.

use crate::call_quality::ReportBlock;
use crate::rtp::{parse_rtcp_compound, RtpError};
use crate::srtp::Protection;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::SocketAddr;

/// At most one keyframe request (PLI or FIR) per published stream and SSRC in this interval.
pub const KEYFRAME_REQUEST_INTERVAL_NS: u64 = 500_000_000;
/// Keyframe request times kept; beyond it, the ones older than the interval are forgotten.
const MAX_KEYFRAME_STATES: usize = 65_536;

/// A publisher is asked for a sequence number at most once in this interval.
pub const NACK_REPEAT_INTERVAL_NS: u64 = 100_000_000;
/// Sequence numbers a publisher is asked to retransmit, per published stream: at most this share
/// of the stream's packets the SFU saw (1.2x its rate at worst, retransmissions included) ...
pub const NACK_SHARE: f64 = 0.2;
/// ... plus this many at once (a keyframe's worth of lost packets, also the start) ...
pub const NACK_BURST: f64 = 64.0;
/// ... and this many a second, for streams the SFU does not see packet by packet (plain RTP the
/// kernel forwards: [`FeedbackRouter::on_media`] is not called for them).
pub const NACK_FLOOR_PER_S: f64 = 20.0;
/// NACK budgets kept; beyond it, the ones unused for a second are forgotten.
const MAX_NACK_STATES: usize = 65_536;

const SR: u8 = 200;
const RR: u8 = 201;
const SDES: u8 = 202;
const BYE: u8 = 203;
const APP: u8 = 204;
const RTPFB: u8 = 205;
const PSFB: u8 = 206;
const FMT_NACK: u8 = 1;
const FMT_PLI: u8 = 1;
const FMT_FIR: u8 = 4;
const FMT_AFB: u8 = 15;

/// Where a consumer's feedback about one media SSRC goes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FeedbackRoute {
    /// The media SSRC as the consumer receives it.
    pub ssrc: u32,
    /// The published stream (its id: counters are kept per stream).
    pub stream: u32,
    /// The consumer (uid) the feedback speaks for: the subscriber's subscription to `stream`.
    pub consumer: u32,
    /// The SSRC the publisher sends that media with (the same until layers are rewritten).
    pub publisher_ssrc: u32,
    /// The publisher's SFU address (where it sends the stream) and the publisher.
    pub from: SocketAddr,
    pub to: SocketAddr,
    /// A simulcast stream's layers, lowest first: (stream id, SSRC). Its consumer receives them
    /// all on `ssrc` (the first layer's); what it says goes to the layer it receives, sequence
    /// numbers mapped back ([`LayerMap`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<(u32, u32)>,
    /// How what is sent to the publisher is protected (a WebRTC publisher's SRTCP key).
    #[serde(default, skip_serializing_if = "Protection::is_clear")]
    pub outbound: Protection,
}

/// A consumer address: RTCP arriving at `local` from `source` is feedback, routed by `routes`
/// (sorted by SSRC).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeedbackEntry {
    /// `room/participant`.
    pub consumer: String,
    pub local: SocketAddr,
    pub source: SocketAddr,
    pub routes: Vec<FeedbackRoute>,
    /// How the consumer's RTCP arrives (a WebRTC participant's SRTCP key): unprotected before
    /// it is read.
    #[serde(default, skip_serializing_if = "Protection::is_clear")]
    pub inbound: Protection,
}

impl FeedbackEntry {
    pub fn route(&self, ssrc: u32) -> Option<&FeedbackRoute> {
        self.routes.binary_search_by_key(&ssrc, |r| r.ssrc).ok().map(|i| &self.routes[i])
    }
}

/// Feedback messages by fate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Sent on to a publisher.
    pub routed: u64,
    /// Keyframe requests not sent because one was sent for the same stream and SSRC shortly before.
    pub coalesced: u64,
    /// Consumed by the SFU (receiver reports, bandwidth estimates, feedback it does not route).
    pub consumed: u64,
    /// Naming an SSRC the consumer does not receive.
    pub unroutable: u64,
}

impl Tally {
    pub fn add(&mut self, o: &Tally) {
        self.routed += o.routed;
        self.coalesced += o.coalesced;
        self.consumed += o.consumed;
        self.unroutable += o.unroutable;
    }
}

/// One compound packet for a publisher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    pub stream: u32,
    pub from: SocketAddr,
    pub to: SocketAddr,
    pub packet: Vec<u8>,
}

/// A report block a consumer sent about what it receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerBlock {
    pub consumer: u32,
    /// The published stream it is about (of a simulcast stream, the layer the consumer receives
    /// now): whose sender reports its LSR echoes.
    pub stream: u32,
    pub block: ReportBlock,
}

/// A receiver's estimate (REMB), bits per second, for everything it lists together.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Remb {
    pub bps: u64,
    pub consumers: Vec<u32>,
}

/// What one feedback packet turns into.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    pub routed: Vec<Routed>,
    /// The sender's own part (SR, SDES, BYE, APP) when the compound starts with an SR: what its
    /// subscribers get.
    pub forward: Option<Vec<u8>>,
    /// Report blocks about streams the consumer receives, as the SFU forwarded them (the
    /// consumer's view: loss, jitter, LSR/DLSR).
    pub reports: Vec<ConsumerBlock>,
    /// The packet's REMBs: each one estimate for the consumers whose SSRCs it lists (a consumer
    /// named again by a later REMB counts only there).
    pub remb: Vec<Remb>,
    /// The sequence numbers simulcast consumers NACKed that the SFU had sent them, in their own
    /// numbering: a loss signal beside report blocks, and the only one from receivers that send
    /// none while they lose packets ([`crate::layer_choice::LayerChoice::on_nacks`]). (A receiver also NACKs a packet
    /// that is late, e.g. the next one while its publisher is silent: that is no loss.)
    pub nacks: Vec<(u32, Vec<u16>)>,
    /// What consumers NACKed that the SFU holds ([`LayerMap::holds`]), in their numbering: sent
    /// again from its history, not asked of the publisher.
    pub resend: Vec<(u32, Vec<u16>)>,
    pub total: Tally,
    /// Per published stream the messages were about (routed and coalesced ones).
    pub per_stream: Vec<(u32, Tally)>,
    /// The same per consumer (the subscription the message spoke for).
    pub per_consumer: Vec<(u32, Tally)>,
}

impl Outcome {
    fn tally(&mut self, route: Option<&FeedbackRoute>, f: impl Fn(&mut Tally)) {
        f(&mut self.total);
        if let Some(r) = route {
            for (list, id) in [(&mut self.per_stream, r.stream), (&mut self.per_consumer, r.consumer)] {
                match list.iter_mut().find(|(s, _)| *s == id) {
                    Some((_, t)) => f(t),
                    None => {
                        let mut t = Tally::default();
                        f(&mut t);
                        list.push((id, t));
                    }
                }
            }
        }
    }
}

/// What the data plane knows of its simulcast consumers, for their feedback
/// ([`FeedbackRoute::layers`]).
pub trait LayerMap {
    /// The layer the consumer receives now (or waits for, when it has not started).
    fn layer(&self, consumer: u32) -> Option<u8>;
    /// The layer and sequence number of what went out to the consumer as `out_seq`.
    fn original(&self, consumer: u32, out_seq: u16) -> Option<(u8, u16)>;
    /// The SFU still has what it sent the consumer as `out_seq`: it answers the NACK itself
    /// ([`Outcome::resend`]) instead of asking the publisher.
    fn holds(&self, _consumer: u32, _out_seq: u16) -> bool {
        false
    }
}

/// No simulcast consumers.
pub struct NoLayers;

impl LayerMap for NoLayers {
    fn layer(&self, _: u32) -> Option<u8> {
        None
    }
    fn original(&self, _: u32, _: u16) -> Option<(u8, u16)> {
        None
    }
}

/// `route` as it applies now: a simulcast consumer's goes to the layer it receives.
fn resolve<'r>(route: &'r FeedbackRoute, layers: &dyn LayerMap) -> Option<std::borrow::Cow<'r, FeedbackRoute>> {
    if route.layers.is_empty() {
        return Some(std::borrow::Cow::Borrowed(route));
    }
    let &(stream, ssrc) = route.layers.get(layers.layer(route.consumer)? as usize)?;
    Some(std::borrow::Cow::Owned(FeedbackRoute { stream, publisher_ssrc: ssrc, ..route.clone() }))
}

/// The sequence numbers a generic NACK's FCI entries (packet id, bitmask) name.
fn nack_sequences(fci: &[u8]) -> Vec<u16> {
    let mut out = Vec::new();
    for e in fci.chunks_exact(4) {
        let (pid, blp) = (u16::from_be_bytes([e[0], e[1]]), u16::from_be_bytes([e[2], e[3]]));
        out.push(pid);
        out.extend((0..16).filter(|b| blp & (1 << b) != 0).map(|b| pid.wrapping_add(b + 1)));
    }
    out
}

/// FCI entries naming `seqs` (sorted in RTP order, distinct).
fn nack_fci(seqs: &[u16]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < seqs.len() {
        let pid = seqs[i];
        let mut blp = 0u16;
        i += 1;
        while i < seqs.len() && (1..=16).contains(&seqs[i].wrapping_sub(pid)) {
            blp |= 1 << (seqs[i].wrapping_sub(pid) - 1);
            i += 1;
        }
        out.extend_from_slice(&pid.to_be_bytes());
        out.extend_from_slice(&blp.to_be_bytes());
    }
    out
}

/// The routing state that outlives a packet: when each stream last had a keyframe requested, and
/// whether its keyframe passed since; what each stream's publisher was asked to retransmit.
#[derive(Debug, Default)]
pub struct FeedbackRouter {
    keyframe_requested: HashMap<(u32, u32), KeyframeRequest>,
    nacks: HashMap<u32, NackBudget>,
}

/// What a published stream's publisher may still be asked to retransmit (a token bucket fed by
/// the stream's packets and by time), and what it was asked lately.
#[derive(Debug)]
struct NackBudget {
    credit: f64,
    /// The stream's packets seen ([`FeedbackRouter::on_media`]), and how many of them were
    /// turned into credit.
    packets: u64,
    credited: u64,
    at_ns: u64,
    /// (sequence number, when asked), oldest first, none older than the repeat interval.
    asked: std::collections::VecDeque<(u16, u64)>,
}

impl NackBudget {
    fn new(now_ns: u64) -> NackBudget {
        NackBudget { credit: NACK_BURST, packets: 0, credited: 0, at_ns: now_ns, asked: Default::default() }
    }

    /// Keep of `seqs` what may be asked now, and note it as asked.
    fn admit(&mut self, seqs: &mut Vec<u16>, now_ns: u64) {
        let secs = now_ns.saturating_sub(self.at_ns) as f64 / 1e9;
        let earned = NACK_SHARE * self.packets.saturating_sub(self.credited) as f64 + NACK_FLOOR_PER_S * secs;
        self.credit = (self.credit + earned).min(NACK_BURST);
        (self.credited, self.at_ns) = (self.packets, self.at_ns.max(now_ns));
        while self.asked.front().is_some_and(|(_, at)| now_ns.saturating_sub(*at) >= NACK_REPEAT_INTERVAL_NS) {
            self.asked.pop_front();
        }
        seqs.retain(|seq| {
            if self.asked.iter().any(|(s, _)| s == seq) || self.credit < 1.0 {
                return false;
            }
            self.credit -= 1.0;
            self.asked.push_back((*seq, now_ns));
            true
        });
    }
}

/// The last keyframe request for a stream and SSRC.
#[derive(Debug, Clone, Copy)]
struct KeyframeRequest {
    at_ns: u64,
    /// A keyframe passed since.
    answered: bool,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

impl FeedbackRouter {
    /// Route `packet` (a compound RTCP packet from `entry`'s consumer) at `now_ns`.
    /// Err: not a valid compound, or a feedback message too short for its type.
    pub fn route(&mut self, entry: &FeedbackEntry, packet: &[u8], now_ns: u64) -> Result<Outcome, RtpError> {
        self.route_with(entry, packet, now_ns, &NoLayers)
    }

    /// [`FeedbackRouter::route`] for consumers that may be of simulcast streams, whose state
    /// `layers` has.
    pub fn route_with(&mut self, entry: &FeedbackEntry, packet: &[u8], now_ns: u64, layers: &dyn LayerMap) -> Result<Outcome, RtpError> {
        let packets = parse_rtcp_compound(packet)?;
        let mut out = Outcome::default();
        let starts_with_sr = packets[0].packet_type == SR;
        let mut forward = Vec::new();
        // Per publisher (from, to): the stream first named and the messages for it.
        let mut per_publisher: Vec<((SocketAddr, SocketAddr), u32, Vec<u8>)> = Vec::new();
        let mut send = |route: &FeedbackRoute, message: Vec<u8>| match per_publisher.iter_mut().find(|(k, _, _)| *k == (route.from, route.to)) {
            Some((_, _, buf)) => buf.extend_from_slice(&message),
            None => per_publisher.push(((route.from, route.to), route.stream, message)),
        };
        for p in &packets {
            let b = p.bytes;
            match (p.packet_type, p.count) {
                (SR | RR, _) => {
                    let first = if p.packet_type == SR { 28 } else { 8 };
                    if b.len() < first {
                        return Err(RtpError::BadRtcpLength); // an SR without its sender info
                    }
                    for i in 0..p.count as usize {
                        let at = first + 24 * i;
                        let Some(block) = b.get(at..at + 24) else { break };
                        if let Some(route) = entry.route(be32(block, 0)).and_then(|r| resolve(r, layers)) {
                            out.reports.push(ConsumerBlock {
                                consumer: route.consumer,
                                stream: route.stream,
                                block: ReportBlock {
                                    reporter: p.sender_ssrc,
                                    about: route.publisher_ssrc,
                                    fraction_lost: block[4],
                                    cumulative_lost: ((be32(block, 4) << 8) as i32) >> 8,
                                    highest_seq: be32(block, 8),
                                    jitter: be32(block, 12),
                                    lsr: be32(block, 16),
                                    dlsr: be32(block, 20),
                                },
                            });
                        }
                    }
                    if p.packet_type == SR && starts_with_sr {
                        // The sender info only: its report blocks are about streams it
                        // receives, consumed like a receiver report's.
                        forward.extend_from_slice(&[0x80, SR, 0, 6]);
                        forward.extend_from_slice(&b[4..28]);
                    } else {
                        out.tally(None, |t| t.consumed += 1);
                    }
                }
                (SDES | BYE | APP, _) if starts_with_sr => forward.extend_from_slice(b),
                (RTPFB, FMT_NACK) | (PSFB, FMT_PLI) => {
                    let too_short = b.len() < 12 || (p.packet_type == RTPFB && b.len() < 16);
                    if too_short {
                        return Err(RtpError::BadRtcpLength);
                    }
                    let named = entry.route(be32(b, 8));
                    if let Some(route) = named.filter(|r| p.packet_type == RTPFB && !r.layers.is_empty()) {
                        // A simulcast consumer's numbers are its own: each goes back to the
                        // layer and number it was sent from.
                        let mut by_layer: Vec<(u8, Vec<u16>)> = Vec::new();
                        let mut sent = Vec::new();
                        let mut held = Vec::new();
                        for seq in nack_sequences(&b[12..]) {
                            if layers.holds(route.consumer, seq) {
                                sent.push(seq);
                                held.push(seq);
                                continue;
                            }
                            let Some((layer, orig)) = layers.original(route.consumer, seq) else { continue };
                            sent.push(seq);
                            match by_layer.iter_mut().find(|(l, _)| *l == layer) {
                                Some((_, v)) => v.push(orig),
                                None => by_layer.push((layer, vec![orig])),
                            }
                        }
                        if !held.is_empty() {
                            out.resend.push((route.consumer, held));
                            if by_layer.is_empty() {
                                out.tally(None, |t| t.consumed += 1);
                            }
                        } else if by_layer.is_empty() {
                            out.tally(None, |t| t.unroutable += 1);
                        }
                        match out.nacks.iter_mut().find(|(c, _)| *c == route.consumer) {
                            Some((_, v)) => v.extend_from_slice(&sent),
                            None if !sent.is_empty() => out.nacks.push((route.consumer, sent)),
                            None => {}
                        }
                        for (layer, seqs) in by_layer {
                            let Some(&(stream, ssrc)) = route.layers.get(layer as usize) else { continue };
                            let r = FeedbackRoute { stream, publisher_ssrc: ssrc, ..route.clone() };
                            match self.nack_message(&r, &b[4..8], seqs, now_ns) {
                                Some(m) => {
                                    send(&r, m);
                                    out.tally(Some(&r), |t| t.routed += 1);
                                }
                                None => out.tally(Some(&r), |t| t.coalesced += 1),
                            }
                        }
                        continue;
                    }
                    let Some(route) = named.and_then(|r| resolve(r, layers)) else {
                        out.tally(None, |t| t.unroutable += 1);
                        continue;
                    };
                    let route = &*route;
                    let message = match p.packet_type {
                        PSFB if !self.keyframe_due(route, now_ns) => None,
                        PSFB => {
                            let mut m = b.to_vec();
                            m[8..12].copy_from_slice(&route.publisher_ssrc.to_be_bytes());
                            Some(m)
                        }
                        _ => {
                            let (held, asked): (Vec<u16>, Vec<u16>) = nack_sequences(&b[12..]).into_iter().partition(|s| layers.holds(route.consumer, *s));
                            if !held.is_empty() {
                                out.resend.push((route.consumer, held));
                                if asked.is_empty() {
                                    out.tally(Some(route), |t| t.consumed += 1);
                                    continue;
                                }
                            }
                            self.nack_message(route, &b[4..8], asked, now_ns)
                        }
                    };
                    match message {
                        Some(m) => {
                            send(route, m);
                            out.tally(Some(route), |t| t.routed += 1);
                        }
                        None => out.tally(Some(route), |t| t.coalesced += 1),
                    }
                }
                (PSFB, FMT_FIR) => {
                    // Each FCI entry (SSRC, sequence number, 3 reserved bytes) asks one sender.
                    if b.len() < 20 || (b.len() - 12) % 8 != 0 {
                        return Err(RtpError::BadRtcpLength);
                    }
                    for fci in b[12..].chunks_exact(8) {
                        let Some(route) = entry.route(be32(fci, 0)).and_then(|r| resolve(r, layers)) else {
                            out.tally(None, |t| t.unroutable += 1);
                            continue;
                        };
                        let route = &*route;
                        if !self.keyframe_due(route, now_ns) {
                            out.tally(Some(route), |t| t.coalesced += 1);
                            continue;
                        }
                        let mut m = Vec::with_capacity(20);
                        m.extend_from_slice(&[0x80 | FMT_FIR, PSFB, 0, 4]);
                        m.extend_from_slice(&b[4..12]);
                        m.extend_from_slice(&route.publisher_ssrc.to_be_bytes());
                        m.extend_from_slice(&fci[4..8]);
                        send(route, m);
                        out.tally(Some(route), |t| t.routed += 1);
                    }
                }
                (PSFB, FMT_AFB) if b.len() >= 20 && &b[12..16] == b"REMB" => {
                    let (exp, mantissa) = (b[17] >> 2, (be32(b, 16) & 0x3_ffff) as u64);
                    let bps = u64::try_from((mantissa as u128) << exp).unwrap_or(u64::MAX);
                    // The SSRCs it is about follow (as many as the packet holds).
                    let mut remb = Remb { bps, consumers: Vec::new() };
                    for ssrc in b[20..].chunks_exact(4).take(b[16] as usize) {
                        if let Some(route) = entry.route(be32(ssrc, 0)) {
                            out.remb.iter_mut().for_each(|r| r.consumers.retain(|c| *c != route.consumer));
                            if !remb.consumers.contains(&route.consumer) {
                                remb.consumers.push(route.consumer);
                            }
                        }
                    }
                    out.remb.retain(|r| !r.consumers.is_empty());
                    if !remb.consumers.is_empty() {
                        out.remb.push(remb);
                    }
                    out.tally(None, |t| t.consumed += 1);
                }
                _ => out.tally(None, |t| t.consumed += 1),
            }
        }
        if starts_with_sr {
            out.forward = Some(forward);
        }
        let reporter = packets[0].sender_ssrc;
        out.routed = per_publisher
            .into_iter()
            .map(|((from, to), stream, messages)| {
                // An empty receiver report from the consumer first: a valid compound packet.
                let mut packet = Vec::with_capacity(8 + messages.len());
                packet.extend_from_slice(&[0x80, RR, 0, 1]);
                packet.extend_from_slice(&reporter.to_be_bytes());
                packet.extend_from_slice(&messages);
                Routed { stream, from, to, packet }
            })
            .collect();
        Ok(out)
    }

    /// `route`'s stream had a packet (the data plane saw it): it earns its NACK budget.
    pub fn on_media(&mut self, stream: u32) {
        if let Some(b) = self.nacks.get_mut(&stream) {
            b.packets += 1;
        }
    }

    /// The NACK to send `route`'s publisher for `seqs` (in its numbering) from `sender` (the
    /// subscriber's SSRC, 4 bytes): the numbers not asked within the repeat interval and within
    /// the stream's budget; None when none is left.
    fn nack_message(&mut self, route: &FeedbackRoute, sender: &[u8], mut seqs: Vec<u16>, now_ns: u64) -> Option<Vec<u8>> {
        let anchor = seqs.first()?.wrapping_sub(0x4000);
        seqs.sort_by_key(|s| s.wrapping_sub(anchor));
        seqs.dedup();
        if self.nacks.len() >= MAX_NACK_STATES && !self.nacks.contains_key(&route.stream) {
            self.nacks.retain(|_, b| now_ns.saturating_sub(b.at_ns) < 1_000_000_000);
        }
        self.nacks.entry(route.stream).or_insert_with(|| NackBudget::new(now_ns)).admit(&mut seqs, now_ns);
        if seqs.is_empty() {
            return None;
        }
        let fci = nack_fci(&seqs);
        let mut m = Vec::with_capacity(12 + fci.len());
        m.extend_from_slice(&[0x80 | FMT_NACK, RTPFB]);
        m.extend_from_slice(&((2 + fci.len() / 4) as u16).to_be_bytes());
        m.extend_from_slice(sender);
        m.extend_from_slice(&route.publisher_ssrc.to_be_bytes());
        m.extend_from_slice(&fci);
        Some(m)
    }

    /// Whether a subscriber's keyframe request for `route` may go now (and note it if so): not
    /// within [`KEYFRAME_REQUEST_INTERVAL_NS`] of the last one, answered or not, so a receiver
    /// that keeps losing packets causes at most two keyframes a second.
    fn keyframe_due(&mut self, route: &FeedbackRoute, now_ns: u64) -> bool {
        self.keyframe_due_for(route.stream, route.publisher_ssrc, now_ns, false)
    }

    /// The SFU's own keyframe request (a consumer waiting for a layer it does not receive yet: a
    /// new consumer, or a switch): the compound packet to send to the publisher, unless one went
    /// for the stream and SSRC within [`KEYFRAME_REQUEST_INTERVAL_NS`] and its keyframe has not
    /// passed yet (counted as coalesced by the caller). Once it passed, the consumer waiting
    /// now missed it: the request goes at once, so a late joiner does not wait out the interval
    /// another subscriber's requests keep open.
    pub fn request_keyframe(&mut self, stream: u32, ssrc: u32, sender: u32, now_ns: u64) -> Option<Vec<u8>> {
        if !self.keyframe_due_for(stream, ssrc, now_ns, true) {
            return None;
        }
        let mut p = vec![0x80, RR, 0, 1];
        p.extend_from_slice(&sender.to_be_bytes());
        p.extend_from_slice(&build::pli(sender, ssrc));
        Some(p)
    }

    /// A keyframe of `stream`'s `ssrc` passed the data plane: the requests so far are answered.
    /// Only the data planes that see a stream's keyframes call this (simulcast layers, whose
    /// payload they read); for other streams every request keeps the plain interval.
    pub fn keyframe_arrived(&mut self, stream: u32, ssrc: u32) {
        if let Some(r) = self.keyframe_requested.get_mut(&(stream, ssrc)) {
            r.answered = true;
        }
    }

    fn keyframe_due_for(&mut self, stream: u32, ssrc: u32, now_ns: u64, once_answered: bool) -> bool {
        let key = (stream, ssrc);
        if let Some(last) = self.keyframe_requested.get(&key) {
            if now_ns.saturating_sub(last.at_ns) < KEYFRAME_REQUEST_INTERVAL_NS && !(once_answered && last.answered) {
                return false;
            }
        }
        if self.keyframe_requested.len() >= MAX_KEYFRAME_STATES {
            self.keyframe_requested.retain(|_, r| now_ns.saturating_sub(r.at_ns) < KEYFRAME_REQUEST_INTERVAL_NS);
        }
        self.keyframe_requested.insert(key, KeyframeRequest { at_ns: now_ns, answered: false });
        true
    }
}

/// Builders for the feedback messages (tests, generators).
pub mod build {
    /// Picture Loss Indication (RFC 4585 6.3.1) from `sender` about `media`.
    pub fn pli(sender: u32, media: u32) -> Vec<u8> {
        psfb(super::FMT_PLI, sender, media, &[])
    }

    /// Full Intra Request (RFC 5104 4.3.1) from `sender` to each (SSRC, sequence number).
    pub fn fir(sender: u32, requests: &[(u32, u8)]) -> Vec<u8> {
        let fci: Vec<u8> = requests.iter().flat_map(|(ssrc, seq)| ssrc.to_be_bytes().into_iter().chain([*seq, 0, 0, 0])).collect();
        psfb(super::FMT_FIR, sender, 0, &fci)
    }

    /// Generic NACK (RFC 4585 6.2.1) of `pid` and the bitmask of the 16 following.
    pub fn nack(sender: u32, media: u32, pid: u16, blp: u16) -> Vec<u8> {
        let fci: Vec<u8> = pid.to_be_bytes().into_iter().chain(blp.to_be_bytes()).collect();
        feedback(super::RTPFB, super::FMT_NACK, sender, media, &fci)
    }

    /// REMB (draft-alvestrand-rmcat-remb) of `bps` for `ssrcs`.
    pub fn remb(sender: u32, bps: u64, ssrcs: &[u32]) -> Vec<u8> {
        let exp = (64 - bps.leading_zeros()).saturating_sub(18);
        let mut fci = b"REMB".to_vec();
        let v = (ssrcs.len() as u32) << 24 | exp << 18 | (bps >> exp) as u32;
        fci.extend_from_slice(&v.to_be_bytes());
        ssrcs.iter().for_each(|s| fci.extend_from_slice(&s.to_be_bytes()));
        psfb(super::FMT_AFB, sender, 0, &fci)
    }

    fn psfb(fmt: u8, sender: u32, media: u32, fci: &[u8]) -> Vec<u8> {
        feedback(super::PSFB, fmt, sender, media, fci)
    }

    fn feedback(pt: u8, fmt: u8, sender: u32, media: u32, fci: &[u8]) -> Vec<u8> {
        let mut p = vec![0x80 | fmt, pt];
        p.extend_from_slice(&((2 + fci.len() / 4) as u16).to_be_bytes());
        p.extend_from_slice(&sender.to_be_bytes());
        p.extend_from_slice(&media.to_be_bytes());
        p.extend_from_slice(fci);
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::call_quality::build_report;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// A participant receiving SSRC 10 (stream 1, from publisher P1) as consumer 101 and SSRC 20
    /// (stream 2, P2) as consumer 102.
    fn entry() -> FeedbackEntry {
        let route = |ssrc, stream, from: &str, to: &str| FeedbackRoute {
            ssrc,
            stream,
            consumer: 100 + stream,
            publisher_ssrc: ssrc,
            layers: Vec::new(),
            from: a(from),
            to: a(to),
            outbound: Protection::Clear,
        };
        FeedbackEntry {
            consumer: "r/c".into(),
            local: a("10.0.0.1:4000"),
            source: a("10.0.1.3:5000"),
            routes: vec![route(10, 1, "10.0.0.1:4002", "10.0.1.1:5000"), route(20, 2, "10.0.0.1:4004", "10.0.1.2:5000")],
            inbound: Protection::Clear,
        }
    }

    fn rr(blocks: &[ReportBlock]) -> Vec<u8> {
        build_report(99, None, blocks)
    }

    /// A simulcast consumer (uid 7) on layer 1 of a stream of layers (11, 0x100), (12, 0x101):
    /// its out number 500 was layer 1's 9000, 501 was 9001, 499 was layer 0's 42.
    struct OnLayer1;
    impl LayerMap for OnLayer1 {
        fn layer(&self, consumer: u32) -> Option<u8> {
            (consumer == 7).then_some(1)
        }
        fn original(&self, _: u32, out: u16) -> Option<(u8, u16)> {
            match out {
                499 => Some((0, 42)),
                500 | 501 => Some((1, 9000 + out - 500)),
                _ => None,
            }
        }
    }

    #[test]
    fn a_simulcast_consumers_feedback_goes_to_the_layer_it_receives() {
        let publisher = a("10.0.1.1:5000");
        let route = FeedbackRoute {
            ssrc: 0x100,
            stream: 11,
            consumer: 7,
            publisher_ssrc: 0x100,
            from: a("10.0.0.1:4002"),
            to: publisher,
            layers: vec![(11, 0x100), (12, 0x101)],
            outbound: Protection::Clear,
        };
        let e =
            FeedbackEntry { consumer: "r/c".into(), local: a("10.0.0.1:4000"), source: a("10.0.1.3:5000"), routes: vec![route], inbound: Protection::Clear };
        let mut r = FeedbackRouter::default();
        // PLI and REMB name the SSRC it receives on: the PLI goes to layer 1's.
        let packet = [rr(&[]), build::pli(99, 0x100), build::remb(99, 500_000, &[0x100])].concat();
        let o = r.route_with(&e, &packet, 1_000, &OnLayer1).unwrap();
        assert_eq!(o.routed.len(), 1);
        assert_eq!(o.routed[0].packet[8..], build::pli(99, 0x101)[..]);
        assert_eq!(o.per_stream, vec![(12, Tally { routed: 1, ..Default::default() })]);
        assert_eq!(o.remb, vec![Remb { bps: 500_000, consumers: vec![7] }]);
        // A NACK of its numbers 499, 500, 501 and 502: each layer hears of its own, 502 (never
        // sent) of nobody.
        let o = r.route_with(&e, &[rr(&[]), build::nack(99, 0x100, 499, 0b111)].concat(), 2_000, &OnLayer1).unwrap();
        let nacks: Vec<&[u8]> = o.routed.iter().map(|x| &x.packet[8..]).collect();
        assert_eq!(nacks, vec![&[build::nack(99, 0x100, 42, 0), build::nack(99, 0x101, 9000, 0b1)].concat()[..]]);
        assert_eq!(o.total.routed, 2);
        // ... and the layer choice hears of the three it was sent, in the consumer's numbers.
        assert_eq!(o.nacks, vec![(7, vec![499, 500, 501])]);
        // Without layer state (no packet seen yet) its keyframe requests go nowhere.
        let o = r.route(&e, &[rr(&[]), build::pli(99, 0x100)].concat(), 3_000_000_000).unwrap();
        assert_eq!((o.routed.len(), o.total.unroutable), (0, 1));
        // The SFU's own request for a layer is coalesced with the consumers'.
        assert!(r.request_keyframe(12, 0x101, 1, 1_000_000).is_none(), "layer 1 was asked for at 1 µs");
        let own = r.request_keyframe(11, 0x100, 1, 1_000_000).unwrap();
        assert_eq!(own, [build_report(1, None, &[]), build::pli(1, 0x100)].concat());
    }

    #[test]
    fn pli_and_nack_reach_their_publishers_behind_an_empty_receiver_report() {
        let e = entry();
        let mut r = FeedbackRouter::default();
        let block = ReportBlock { about: 10, fraction_lost: 64, cumulative_lost: -3, jitter: 90, ..Default::default() };
        let packet = [rr(&[block]), build::pli(99, 10), build::nack(99, 20, 7, 0b101)].concat();
        let o = r.route(&e, &packet, 1_000).unwrap();
        assert_eq!(o.routed.len(), 2);
        let to_p1 = &o.routed[0];
        assert_eq!((to_p1.stream, to_p1.from, to_p1.to), (1, a("10.0.0.1:4002"), a("10.0.1.1:5000")));
        assert_eq!(to_p1.packet, [vec![0x80, 201, 0, 1, 0, 0, 0, 99], build::pli(99, 10)].concat());
        assert_eq!(o.routed[1].packet[8..], build::nack(99, 20, 7, 0b101)[..]);
        assert!(parse_rtcp_compound(&o.routed[1].packet).is_ok());
        assert_eq!(o.total, Tally { routed: 2, consumed: 1, ..Default::default() });
        assert_eq!(o.per_stream, vec![(1, Tally { routed: 1, ..Default::default() }), (2, Tally { routed: 1, ..Default::default() })]);
        assert_eq!(o.per_consumer, vec![(101, Tally { routed: 1, ..Default::default() }), (102, Tally { routed: 1, ..Default::default() })]);
        // The report block is consumer 101's view of stream 1; the RR goes nowhere.
        assert_eq!(o.reports, vec![ConsumerBlock { consumer: 101, stream: 1, block: ReportBlock { reporter: 99, ..block } }]);
        assert_eq!(o.forward, None);
    }

    /// The sequence numbers NACKed by a route's publisher-bound messages so far.
    /// What the SFU holds of consumer 102's packets (stream 2, SSRC 20): 8 and 9.
    struct Holds;
    impl LayerMap for Holds {
        fn layer(&self, _: u32) -> Option<u8> {
            None
        }
        fn original(&self, _: u32, _: u16) -> Option<(u8, u16)> {
            None
        }
        fn holds(&self, consumer: u32, seq: u16) -> bool {
            consumer == 102 && (8..=9).contains(&seq)
        }
    }

    #[test]
    fn what_the_sfu_holds_is_sent_again_by_it_and_only_the_rest_asked_of_the_publisher() {
        let e = entry();
        let mut r = FeedbackRouter::default();
        // NACK of 7, 8, 9: the SFU sends 8 and 9 again, the publisher is asked for 7.
        let o = r.route_with(&e, &[rr(&[]), build::nack(99, 20, 7, 0b11)].concat(), 1_000, &Holds).unwrap();
        assert_eq!(o.resend, vec![(102, vec![8, 9])]);
        assert_eq!(nacked(&o), [7]);
        assert_eq!(o.total, Tally { routed: 1, consumed: 1, ..Default::default() });
        // All held: nothing goes to the publisher, the NACK is the SFU's.
        let o = r.route_with(&e, &[rr(&[]), build::nack(99, 20, 8, 0b1)].concat(), 2_000_000_000, &Holds).unwrap();
        assert_eq!((o.resend, o.routed.len()), (vec![(102, vec![8, 9])], 0));
        assert_eq!(o.total, Tally { consumed: 2, ..Default::default() });
    }

    fn nacked(o: &Outcome) -> Vec<u16> {
        let mut seqs = Vec::new();
        for routed in &o.routed {
            for p in parse_rtcp_compound(&routed.packet).unwrap().iter().filter(|p| p.packet_type == RTPFB) {
                seqs.extend(nack_sequences(&p.bytes[12..]));
            }
        }
        seqs
    }

    /// A sequence number goes to the publisher once per repeat interval however many subscribers
    /// ask for it; the others of the same NACK still go.
    #[test]
    fn a_nacked_number_is_asked_once_per_interval() {
        let (e, ms) = (entry(), 1_000_000);
        let mut r = FeedbackRouter::default();
        let mut nack = |pid: u16, blp: u16, at: u64| nacked(&r.route(&e, &[rr(&[]), build::nack(99, 20, pid, blp)].concat(), at).unwrap());
        assert_eq!(nack(7, 0b101, 0), [7, 8, 10]);
        // Another subscriber lost 8 and 9: only 9 is new.
        assert_eq!(nack(8, 0b1, 30 * ms), [9]);
        assert_eq!(nack(7, 0, 99 * ms), Vec::<u16>::new());
        // A repeat interval later the publisher is asked again (its retransmission was lost too).
        assert_eq!(nack(7, 0b1, 100 * ms), [7, 8]);
        let o = r.route(&e, &[rr(&[]), build::nack(99, 20, 7, 0)].concat(), 101 * ms).unwrap();
        assert_eq!((o.total.routed, o.total.coalesced), (0, 1), "nothing left to ask: coalesced");
    }

    /// One subscriber NACKing everything cannot make the publisher send more than the stream's
    /// rate times 1 + NACK_SHARE (after the initial burst), where the SFU sees the stream's
    /// packets; where it does not, the floor rate holds.
    #[test]
    fn nacks_stay_within_the_streams_budget() {
        let (e, ms) = (entry(), 1_000_000u64);
        let mut r = FeedbackRouter::default();
        let mut asked = 0usize;
        // 10 s of a 100 packet/s stream, every packet NACKed 20 ms after it was sent (each a new
        // number: no repeat is involved).
        for i in 0..1000u64 {
            r.on_media(2);
            let o = r.route(&e, &[rr(&[]), build::nack(99, 20, i as u16, 0)].concat(), i * 10 * ms + 20 * ms).unwrap();
            asked += nacked(&o).len();
        }
        let bound = NACK_BURST + 1000.0 * NACK_SHARE + 10.0 * NACK_FLOOR_PER_S;
        assert!(asked as f64 <= bound, "{asked} asked of 1000, bound {bound}");
        assert!(asked as f64 >= bound - 2.0, "{asked} asked: the budget is used, not starved");
        // Another stream the SFU never sees a packet of: the burst, then the floor rate.
        let mut r = FeedbackRouter::default();
        let mut asked = 0usize;
        for i in 0..1000u64 {
            let o = r.route(&e, &[rr(&[]), build::nack(99, 20, i as u16, 0)].concat(), i * 10 * ms).unwrap();
            asked += nacked(&o).len();
        }
        let bound = NACK_BURST + 10.0 * NACK_FLOOR_PER_S;
        assert!(asked as f64 <= bound && asked as f64 >= bound - 2.0, "{asked} asked, bound {bound}");
    }

    #[test]
    fn keyframe_requests_are_coalesced_per_stream_for_half_a_second() {
        let e = entry();
        let mut r = FeedbackRouter::default();
        let ms = 1_000_000;
        let routed = |r: &mut FeedbackRouter, p: Vec<u8>, at: u64| r.route(&e, &[rr(&[]), p].concat(), at).unwrap().total;
        assert_eq!(routed(&mut r, build::pli(99, 10), 0).routed, 1);
        // Another subscriber's PLI, and a FIR, within 500 ms: the keyframe is on its way.
        assert_eq!(routed(&mut r, build::pli(98, 10), 100 * ms).coalesced, 1);
        assert_eq!(routed(&mut r, build::fir(98, &[(10, 1)]), 499 * ms).coalesced, 1);
        // Another stream is asked at once; the first one again after the interval.
        assert_eq!(routed(&mut r, build::fir(98, &[(20, 1)]), 499 * ms).routed, 1);
        assert_eq!(routed(&mut r, build::pli(98, 10), 500 * ms).routed, 1);
        // NACKs are not keyframe requests: one goes whatever the keyframe interval says (see
        // below for what holds them back).
        assert_eq!(routed(&mut r, build::nack(98, 10, 1, 0), 501 * ms).routed, 1);
        // The SFU's own request for a waiting consumer: coalesced while the keyframe is on its
        // way (another stream's keyframe answers nothing of this one) ...
        assert_eq!(routed(&mut r, build::pli(98, 10), 600 * ms).coalesced, 1);
        assert_eq!(r.request_keyframe(1, 10, 0, 610 * ms), None);
        r.keyframe_arrived(2, 20);
        assert_eq!(r.request_keyframe(1, 10, 0, 620 * ms), None);
        // ... at once once it passed (the consumer missed it), and then waits again.
        r.keyframe_arrived(1, 10);
        assert!(r.request_keyframe(1, 10, 0, 630 * ms).is_some());
        assert_eq!(r.request_keyframe(1, 10, 0, 640 * ms), None);
        // A subscriber's request keeps the interval, answered or not: a lossy receiver asking
        // all the time causes at most two keyframes a second.
        r.keyframe_arrived(1, 10);
        assert_eq!(routed(&mut r, build::pli(97, 10), 650 * ms).coalesced, 1);
        assert_eq!(routed(&mut r, build::pli(97, 10), 1130 * ms).routed, 1);
    }

    #[test]
    fn fir_entries_are_split_per_publisher_and_unknown_ssrcs_go_nowhere() {
        let e = entry();
        let mut r = FeedbackRouter::default();
        let o = r.route(&e, &[rr(&[]), build::fir(99, &[(10, 5), (20, 6), (30, 7)])].concat(), 0).unwrap();
        assert_eq!(o.total, Tally { routed: 2, unroutable: 1, consumed: 1, ..Default::default() });
        assert_eq!(o.routed[0].packet[8..], build::fir(99, &[(10, 5)])[..]);
        assert_eq!(o.routed[1].packet[8..], build::fir(99, &[(20, 6)])[..]);
        let o = r.route(&e, &[rr(&[]), build::pli(99, 30), build::nack(99, 0, 1, 0)].concat(), 0).unwrap();
        assert_eq!((o.routed.len(), o.total.unroutable), (0, 2));
    }

    #[test]
    fn a_senders_report_is_forwarded_without_the_feedback_and_remb_is_consumed() {
        let e = entry();
        let mut r = FeedbackRouter::default();
        let sr = build_report(55, Some(0x1234_5678), &[ReportBlock { about: 20, ..Default::default() }]);
        let sdes = vec![0x81, 202, 0, 2, 0, 0, 0, 55, 0, 0, 0, 0];
        let packet = [sr.clone(), sdes.clone(), build::pli(55, 20), build::remb(55, 1_500_000, &[10, 20])].concat();
        let o = r.route(&e, &packet, 0).unwrap();
        // The SR goes on without its report block (about what p55 receives).
        assert_eq!(o.forward, Some([build_report(55, Some(0x1234_5678), &[]), sdes].concat()));
        assert_eq!(o.routed.len(), 1);
        assert_eq!(o.routed[0].packet[..8], [0x80, 201, 0, 1, 0, 0, 0, 55]);
        // The estimate is for both consumers the REMB names.
        assert_eq!(o.remb.len(), 1);
        assert_eq!(o.remb[0].consumers, [101, 102]);
        let remb = o.remb[0].bps;
        assert!((1_499_000..=1_500_000).contains(&remb), "{remb}");
        assert_eq!(o.total, Tally { routed: 1, consumed: 1, ..Default::default() });
        assert_eq!(o.reports.len(), 1);
        // Two REMBs: each is one estimate for what it lists; a consumer named again counts only
        // in the later one.
        let packet = [rr(&[]), build::remb(55, 800_000, &[10, 20]), build::remb(55, 300_000, &[20])].concat();
        let o = r.route(&e, &packet, 0).unwrap();
        let groups: Vec<(u64, Vec<u32>)> = o.remb.iter().map(|x| (x.bps / 1000, x.consumers.clone())).collect();
        assert_eq!(groups, [(800, vec![101]), (300, vec![102])]);
    }

    #[test]
    fn short_feedback_makes_the_compound_malformed() {
        let e = entry();
        let mut r = FeedbackRouter::default();
        let short_nack = vec![0x81, 205, 0, 2, 0, 0, 0, 99, 0, 0, 0, 10];
        assert!(r.route(&e, &[rr(&[]), short_nack].concat(), 0).is_err());
        let bad_fir = vec![0x84, 206, 0, 3, 0, 0, 0, 99, 0, 0, 0, 0, 0, 0, 0, 10];
        assert!(r.route(&e, &[rr(&[]), bad_fir].concat(), 0).is_err());
        assert!(r.route(&e, &[0x80, 201, 0, 5, 0, 0], 0).is_err());
        // An SR of its SSRC only (found by the classify fuzz target: it panicked).
        assert!(r.route(&e, &[0x80, 200, 0, 1, 0x7c, 0xff, 0xad, 0xff], 0).is_err());
    }
}
