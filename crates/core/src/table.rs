//! Forwarding tables: the model compiled into "ingress key -> fan-out list with per-copy
//! rewrite", and the reference per-packet decision ([`ForwardingTable::classify`]).
//!
//! Invariants hold by construction here, so every data plane inherits them:
//! a copy never goes back to its publisher, only subscribers get copies, and a stream says who may
//! inject into it ([`SourceRule`]: one fixed source; a relay leg learning its peer's; anyone).

use crate::feedback::{FeedbackEntry, FeedbackRoute};
use crate::model::{Leg, MediaControl, Model, Relay, Room, Side, StreamRef};
use crate::ratelimit::RateLimit;
use crate::rtp::{self, MediaKind, RtpHeader};
use crate::srtp::Protection;
use imbl::OrdMap;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// Where a packet enters: an SFU address, optionally narrowed by SSRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct IngressKey {
    pub local: SocketAddr,
    pub ssrc: Option<u32>,
}

/// Who may inject into a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceRule {
    /// Only this source; any other is dropped as a stranger.
    Fixed(SocketAddr),
    /// A relay leg learning its peer's source: packets from the source followed so far (if
    /// any) are relayed; any other source's are relayed too, by the slow path, which reports
    /// the source so the control plane can follow it ([`Verdict::Learn`]).
    Learn(Option<SocketAddr>),
    /// Any source is relayed (a relay leg that locked its source, or an asymmetric one).
    Any,
}

/// One output copy: sent from `from` (the SFU address for that subscriber) to `to`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Copy {
    pub subscriber: String,
    pub from: SocketAddr,
    pub to: SocketAddr,
    /// SRTP the copy is protected with on its way out (a relay leg terminating SDES).
    #[serde(default, skip_serializing_if = "Protection::is_clear")]
    pub outbound: Protection,
    /// The consumer this copy is for (its uid, [`crate::model::Consumer`]): the data planes count
    /// copies per consumer. 0 for a relay leg's copy (a call has no consumers).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub consumer: u32,
    /// A copy of a simulcast layer: the layer the consumer wants
    /// ([`crate::model::Consumer::wanted_layer`]). The data plane sends it the packets of one
    /// layer at a time, renumbered ([`crate::simulcast::LayerRewriter`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u8>,
    /// The consumer's `max_layer`: never exceeded, not even when only higher layers are sent
    /// (`layer` is only a preference when none is set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_layer: Option<u8>,
    /// The consumer's own reports may lower `layer` ([`crate::model::Consumer::auto_layer`]).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub auto_layer: bool,
    /// A copy of a simulcast layer: the highest temporal layer it takes of it (None: all;
    /// [`crate::model::Consumer::temporal_layer`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temporal_layer: Option<u8>,
    /// (the stream's payload type, the one this copy carries instead): the consumer's
    /// [`crate::model::Consumer::payload_type`]. Its RTP packets of that payload type are
    /// renumbered before they are protected; the kernel path leaves such streams to the slow path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_type: Option<(u8, u8)>,
    /// (from, to) the stream's RTCP goes instead: the receiver does not multiplex RTCP with RTP
    /// ([`crate::model::DemuxedRtcp`]). Streams with such a copy leave their RTCP to the slow path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rtcp: Option<(SocketAddr, SocketAddr)>,
}

impl Copy {
    /// Where a packet of this copy leaves from and goes: RTCP by [`Copy::rtcp`] if it has one.
    pub fn route(&self, rtcp: bool) -> (SocketAddr, SocketAddr) {
        match self.rtcp {
            Some(route) if rtcp => route,
            _ => (self.from, self.to),
        }
    }
}

fn yes() -> bool {
    true
}

fn is_true(v: &bool) -> bool {
    *v
}

/// An entry that is one layer of a simulcast stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimulcastLayer {
    /// The simulcast stream's uid.
    pub group: u32,
    /// Which layer this entry is (0 = lowest quality).
    pub index: u8,
    /// Every layer of the stream, lowest first: (entry id, SSRC). A consumer receives on the
    /// first layer's SSRC, whichever layer it gets; keyframe requests name the layer's own.
    pub layers: Vec<(u32, u32)>,
    pub codec: crate::simulcast::Codec,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamEntry {
    /// Stable id (model uid): counters and kernel map slots are keyed by it.
    pub id: u32,
    /// Human-readable name: `room/participant/stream` or `relay:id/a`.
    pub label: String,
    pub key: IngressKey,
    pub source: SourceRule,
    pub rtp: bool,
    pub copies: Vec<Copy>,
    /// Packet/bit-rate limit on what the source may inject (checked after the source, before the
    /// fan-out; excess is dropped and counted as `drop_rate_limited`). Set by the control plane.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<crate::ratelimit::RateLimit>,
    /// Its packets are recorded (a relay of a call with `record-call`): the data plane hands
    /// each one it forwards to the recording tap; the kernel path leaves such streams to the slow
    /// path, which does.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub record: bool,
    /// SRTP the stream's packets arrive in (a relay leg terminating SDES): unprotected before
    /// anything else reads them, so RTCP is checked only as far as SRTCP leaves it readable.
    /// The kernel path leaves such streams, and those with a protected copy, to the slow path.
    #[serde(default, skip_serializing_if = "Protection::is_clear")]
    pub inbound: Protection,
    /// RTP clock rate (Hz) of the stream's payload, 0 = unknown: the data planes measure its
    /// interarrival jitter (see [`crate::reception`]) only when known.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub clock_rate: u32,
    /// Its RTCP is handed to the control plane, which evaluates the reports (a relay leg's:
    /// round-trip times and MOS, see [`crate::call_quality`]). The kernel path leaves such RTCP
    /// to the slow path, which does.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub evaluate_rtcp: bool,
    /// One layer of a simulcast stream: its copies go only to the consumers receiving this
    /// layer now, renumbered. The kernel path leaves these to the slow path (for now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub simulcast: Option<SimulcastLayer>,
    /// An ICE + DTLS-SRTP leg's ([`crate::model::Leg::ice`]): its STUN and DTLS (RFC 7983's
    /// first bytes 0-3 and 20-63) go to the control plane, which answers them. The kernel path
    /// hands both up already (STUN always, DTLS with the rest of an SRTP stream).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub handshake: bool,
    /// A WebRTC transport's entry while one of its simulcast sections waits for its layers
    /// ([`crate::model::WebrtcTransport::pending`]): an RTP packet no stream claims (it comes
    /// here) is read for these header extensions, and the RID and MID it names are reported
    /// with its SSRC ([`crate::pipeline::Effect::StreamId`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_ids: Option<crate::model::StreamIdExtensions>,
    /// What the SFU feeds back to its source of its own accord (a WebRTC publisher's transport):
    /// see [`PublisherFeedback`] and [`crate::pipeline::Effect::PublisherRtp`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher_feedback: Option<PublisherFeedback>,
    /// How what the SFU sends back to the stream's source (keyframe requests, the consumers'
    /// feedback routed to it) is protected: a WebRTC publisher's SRTCP key.
    #[serde(default, skip_serializing_if = "Protection::is_clear")]
    pub reverse: Protection,
    /// Call control of a relay direction (NG `block media` and the like): the slow path's.
    #[serde(default, skip_serializing_if = "StreamControl::is_off")]
    pub control: StreamControl,
    /// DTMF events to put into the stream (NG `play DTMF`): the slow path's while any is queued.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dtmf: Vec<crate::model::DtmfEvent>,
}

/// A relay direction's call control as the pipeline applies it: the call's and the sending
/// leg's [`MediaControl`], and the `telephone-event` payload types of both legs' SDPs (a party
/// sends with the numbers either side mapped; they agree after an answer).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamControl {
    pub control: MediaControl,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub telephone_events: Vec<u8>,
    /// The events the party sends are reported ([`crate::pipeline::Effect::Dtmf`]); the rest
    /// of the stream is not judged (the kernel forwards it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub report_dtmf: bool,
}

/// What call control makes of one RTP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Controlled {
    Pass,
    Drop,
    /// Its payload is replaced with this codec's silence byte.
    Silence(u8),
}

impl StreamControl {
    /// Nothing to judge or report.
    pub fn is_off(&self) -> bool {
        self.control.is_off() && !self.report_dtmf
    }

    /// Whether a packet of `payload_type` carries an event to report.
    pub fn reports(&self, payload_type: u8) -> bool {
        self.report_dtmf && self.telephone_events.contains(&payload_type)
    }

    /// What becomes of an RTP packet of `payload_type`.
    pub fn judge(&self, payload_type: u8) -> Controlled {
        let c = self.control;
        if self.telephone_events.contains(&payload_type) {
            return if c.block_dtmf { Controlled::Drop } else { Controlled::Pass };
        }
        if c.block_media {
            return Controlled::Drop;
        }
        match silence_byte(payload_type) {
            Some(b) if c.silence_media => Controlled::Silence(b),
            _ => Controlled::Pass,
        }
    }
}

/// The byte that is silence in every sample of a codec with a static payload type, for those
/// that have one: G.711 µ-law (0) and A-law (8), one byte per sample. Others (G.722's silence
/// depends on its encoder state, compressed codecs have none) pass unchanged.
pub fn silence_byte(payload_type: u8) -> Option<u8> {
    match payload_type {
        0 => Some(0xff),
        8 => Some(0xd5),
        _ => None,
    }
}

/// What the SFU sends a WebRTC publisher's transport of its own accord: receiver reports always,
/// transport feedback and a REMB ceiling when these say so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublisherFeedback {
    /// The id of the transport-wide sequence number header extension its RTP carries (it
    /// negotiated transport-cc): each arrival is reported back ([`crate::transport_feedback`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport_cc: Option<u8>,
    /// Without transport-cc: the id of the abs-send-time header extension its RTP carries,
    /// which the SFU's own estimate of its path reads ([`crate::remote_estimate`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abs_send_time: Option<u8>,
    /// The room's ceiling on what a publisher sends (bits/s): a REMB with it goes to the
    /// transport every second (browsers cap their send-side estimate at a REMB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bitrate_bps: Option<u64>,
}

impl PublisherFeedback {
    pub fn of(w: &crate::model::WebrtcTransport, max_kbps: Option<u32>) -> PublisherFeedback {
        PublisherFeedback {
            transport_cc: w.transport_cc,
            // Transport-cc, when negotiated, is what the publisher estimates on.
            abs_send_time: w.abs_send_time.filter(|_| w.transport_cc.is_none()),
            max_bitrate_bps: max_kbps.map(|k| u64::from(k) * 1000),
        }
    }
}

/// The lower of two optional ceilings.
fn lower(a: Option<u32>, b: Option<u32>) -> Option<u32> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl StreamEntry {
    /// A published RTP stream with consumers whose reports can name it (narrowed to an SSRC; a
    /// simulcast layer is): its sender reports are timed as they pass, for the consumers'
    /// round-trip times (their reports echo them).
    pub fn times_sender_reports(&self) -> bool {
        self.rtp && self.key.ssrc.is_some() && self.copies.iter().any(|c| c.consumer != 0)
    }

    /// Its RTCP is the slow path's, never forwarded by a kernel path: evaluated (a relay leg's,
    /// [`StreamEntry::evaluate_rtcp`]) or timed ([`StreamEntry::times_sender_reports`]). A few
    /// packets a second.
    pub fn rtcp_to_slow_path(&self) -> bool {
        self.evaluate_rtcp || self.times_sender_reports() || self.copies.iter().any(|c| c.rtcp.is_some())
    }

    /// Some packet of this stream needs SRTP work (unprotecting it, or protecting a copy).
    pub fn has_srtp(&self) -> bool {
        !self.inbound.is_clear() || !self.reverse.is_clear() || self.copies.iter().any(|c| !c.outbound.is_clear())
    }
}

/// Why a packet was dropped; every drop is counted under one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    /// Arrived on an SFU address but matches no stream (e.g. unknown SSRC).
    NoStream,
    /// Not from the stream's registered or latched source.
    Stranger,
    /// Not a valid RTP/RTCP packet on an RTP stream (truncated, garbage).
    Malformed,
    /// From the stream's source, but with a wrong IPv4 header or UDP checksum (or a zero UDP
    /// checksum over IPv6). Frame-level: the kernel path checks it after the source; the host
    /// stack drops such packets before any socket sees them (`classify` never returns it).
    BadChecksum,
    /// The source fails the reverse-path check on the interface it arrived on (rp_filter).
    /// Frame-level, like `BadChecksum`.
    Spoofed,
}

impl DropReason {
    pub const ALL: [DropReason; 5] = [DropReason::NoStream, DropReason::Stranger, DropReason::Malformed, DropReason::BadChecksum, DropReason::Spoofed];
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::NoStream => "no_stream",
            DropReason::Stranger => "stranger",
            DropReason::Malformed => "malformed",
            DropReason::BadChecksum => "bad_checksum",
            DropReason::Spoofed => "spoofed",
        }
    }
}

/// Why a packet goes to the slow path (user space) rather than being forwarded or dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SlowReason {
    /// STUN/ICE connectivity checks.
    Stun,
    /// A relay leg that is learning its source heard a source it does not follow (yet).
    Unlatched,
    /// DTLS of an ICE + DTLS-SRTP leg ([`StreamEntry::handshake`]), for the control plane. The
    /// kernel path hands such a stream up whole (it is SRTP), and the slow path decides this.
    Handshake,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict<'t> {
    Forward(&'t StreamEntry),
    /// Relay it like [`Verdict::Forward`], and report its source to the control plane, which
    /// decides whether the leg follows it ([`SourceRule::Learn`]). The kernel path hands these
    /// to the slow path ([`SlowReason::Unlatched`]).
    Learn(&'t StreamEntry),
    /// A consumer's RTCP from its registered address ([`crate::feedback`]): routed to the
    /// publishers it names; `stream` is the stream its sender's report (if it starts with one)
    /// is forwarded as, chosen as for any packet. The kernel path hands these to the slow path.
    Feedback {
        entry: &'t FeedbackEntry,
        stream: Option<&'t StreamEntry>,
    },
    Drop {
        reason: DropReason,
        stream: Option<u32>,
    },
    SlowPath {
        reason: SlowReason,
        stream: Option<u32>,
    },
}

/// The compiled tables. `version` increases with every change so drivers can tell updates apart.
///
/// A persistent map: the control plane clones the installed table in O(1), recompiles only the
/// rooms and relays a mutation touched ([`ForwardingTable::update`]), and hands the data planes
/// the new table together with the keys that changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardingTable {
    pub version: u64,
    pub streams: OrdMap<IngressKey, StreamEntry>,
    /// The per-stream limit [`ForwardingTable::update`] puts on entries it compiles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_rate: Option<crate::ratelimit::RateLimit>,
    /// Per-source limit: one bucket per source IP address (any port, any SFU address), set by the
    /// control plane ([`ForwardingTable::set_source_limit`]). Data planes apply it to every packet
    /// [`ForwardingTable::classify`] does not drop (so strangers, malformed and unknown-stream
    /// packets are never charged: they cost nothing further), before anything costs work: before
    /// the per-stream limit and the fan-out, and before the slow path takes STUN or a first
    /// packet. Excess is dropped and counted as `drop_source_limited`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_limit: Option<crate::ratelimit::RateLimit>,
    /// Consumer addresses (a participant's own SFU address, when it subscribes to an RTP
    /// stream): what its RTCP says goes back to the publishers ([`Verdict::Feedback`]). A change
    /// of one is reported as a change of the wildcard key of its address.
    #[serde(default, skip_serializing_if = "OrdMap::is_empty")]
    pub feedback: OrdMap<SocketAddr, FeedbackEntry>,
}

/// What changed between two tables, for drivers that update entries in place (kernel maps).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TableDiff<'t> {
    pub upserts: Vec<&'t StreamEntry>,
    pub removals: Vec<IngressKey>,
    /// Addresses whose feedback entry came, went or changed.
    pub feedback: Vec<SocketAddr>,
}

/// A part of the model that compiles into its own table entries: a mutation names the ones it
/// touched and only those are recompiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner<'a> {
    Room(&'a str),
    Relay(&'a str),
}

/// The entries of one room: one per published stream, copies to its subscribers; and one per
/// WebRTC participant for its transport (its STUN, DTLS and SSRCs it does not publish).
fn compile_room(rid: &str, room: &Room, rate: Option<RateLimit>) -> Vec<StreamEntry> {
    let mut out = Vec::new();
    for (pid, p) in &room.participants {
        let base = |id, label, key, copies| StreamEntry {
            id,
            label,
            key,
            // A WebRTC participant's before ICE nominated (or after): the unspecified address, nobody.
            source: SourceRule::Fixed(p.source()),
            rtp: true,
            copies,
            rate,
            record: false,
            inbound: p.inbound(),
            clock_rate: 0,
            evaluate_rtcp: false,
            simulcast: None,
            handshake: false,
            stream_ids: None,
            // Once nominated: before, its media may come from a checked address, where nothing is sent.
            publisher_feedback: p.webrtc.as_ref().filter(|w| w.nominated).map(|w| PublisherFeedback::of(w, lower(room.publisher_max_kbps, w.max_kbps))),
            reverse: p.outbound(),
            control: StreamControl::default(),
            dtmf: Vec::new(),
        };
        if let Some(w) = &p.webrtc {
            let key = IngressKey { local: p.local, ssrc: None };
            let stream_ids = w.stream_ids.filter(|_| !w.pending.is_empty() || !w.late.is_empty());
            out.push(StreamEntry { handshake: true, stream_ids, ..base(w.uid, format!("{rid}/{pid}"), key, Vec::new()) });
        }
        for (sid, s) in &p.streams {
            let this = StreamRef { publisher: pid.clone(), stream: sid.clone() };
            let simulcast = !s.layers.is_empty();
            let mut copies: Vec<Copy> = room
                .participants
                .iter()
                .filter(|(sub_id, _)| *sub_id != pid)
                .filter_map(|(sub_id, sub)| {
                    let c = sub.subscriptions.get(&this)?;
                    let layer = simulcast.then(|| c.wanted_layer(s.layers.len()));
                    let max_layer = c.max_layer.filter(|_| simulcast);
                    Some(Copy {
                        subscriber: format!("{rid}/{sub_id}"),
                        from: sub.local,
                        to: sub.peer()?,
                        outbound: sub.outbound(),
                        consumer: c.uid,
                        layer,
                        max_layer,
                        auto_layer: c.auto_layer,
                        temporal_layer: c.temporal_layer.filter(|_| simulcast),
                        payload_type: s.format.as_ref().zip(c.payload_type).map(|(f, to)| (f.pt, to)).filter(|(from, to)| from != to),
                        rtcp: None,
                    })
                })
                .collect();
            copies.sort();
            let entry = |id, label, ssrc, simulcast| StreamEntry {
                rtp: s.rtp,
                clock_rate: s.clock_rate.unwrap_or(0),
                simulcast,
                ..base(id, label, IngressKey { local: s.local.unwrap_or(p.local), ssrc }, copies.clone())
            };
            if !simulcast {
                out.push(entry(s.uid, format!("{rid}/{pid}/{sid}"), s.ssrc, None));
                continue;
            }
            // One entry per layer, each with every consumer's copy: which layer a consumer gets
            // is decided per packet.
            let layers: Vec<(u32, u32)> = s.layers.iter().map(|l| (l.uid, l.ssrc)).collect();
            for (i, l) in s.layers.iter().enumerate() {
                let info = SimulcastLayer { group: s.uid, index: i as u8, layers: layers.clone(), codec: s.codec.unwrap_or_default() };
                out.push(entry(l.uid, format!("{rid}/{pid}/{sid}#{i}"), Some(l.ssrc), Some(info)));
            }
        }
    }
    out
}

/// The feedback entries of one room: one per participant subscribed to an RTP stream, routing
/// by the SSRCs of those streams that have one.
fn compile_room_feedback(rid: &str, room: &Room) -> Vec<FeedbackEntry> {
    let mut out = Vec::new();
    for (pid, p) in room.participants.iter().filter(|(_, p)| p.peer().is_some()) {
        let mut subscribed_rtp = false;
        let mut routes = Vec::new();
        for (r, c) in &p.subscriptions {
            // Feedback goes to a publisher ICE nominated, if it is a WebRTC one.
            let Some(publisher) = room.participants.get(&r.publisher).filter(|p| p.peer().is_some()) else { continue };
            let Some(s) = publisher.streams.get(&r.stream).filter(|s| s.rtp) else { continue };
            subscribed_rtp = true;
            let from = s.local.unwrap_or(publisher.local);
            let outbound = publisher.outbound();
            if let Some(ssrc) = s.ssrc {
                let layers = Vec::new();
                routes.push(FeedbackRoute { ssrc, stream: s.uid, consumer: c.uid, publisher_ssrc: ssrc, from, to: publisher.remote, layers, outbound });
            } else if let Some(first) = s.layers.first() {
                // A simulcast consumer receives on the first layer's SSRC; what it says about
                // it goes to the layer it receives ([`crate::feedback::LayerMap`]).
                let layers = s.layers.iter().map(|l| (l.uid, l.ssrc)).collect();
                routes.push(FeedbackRoute {
                    ssrc: first.ssrc,
                    stream: first.uid,
                    consumer: c.uid,
                    publisher_ssrc: first.ssrc,
                    from,
                    to: publisher.remote,
                    layers,
                    outbound,
                });
            }
        }
        if subscribed_rtp {
            routes.sort();
            // Two streams with one SSRC (different publishers) cannot be told apart: neither is routed.
            let dup: Vec<u32> = routes.windows(2).filter(|w| w[0].ssrc == w[1].ssrc).map(|w| w[0].ssrc).collect();
            routes.retain(|r| !dup.contains(&r.ssrc));
            out.push(FeedbackEntry { consumer: format!("{rid}/{pid}"), local: p.local, source: p.remote, routes, inbound: p.inbound() });
        }
    }
    out
}

/// The two entries of a relay: each leg's ingress, a fan-out of one to the other leg's peer.
fn compile_relay(id: &str, r: &Relay, rate: Option<RateLimit>) -> Vec<StreamEntry> {
    let legs = [(&r.a, &r.b, "a", "b", Side::A), (&r.b, &r.a, "b", "a", Side::B)].map(|(from_leg, to_leg, side, other, from_side)| {
        // A bundled leg shares its group's address: it takes its own SSRC's packets there.
        let key = IngressKey { local: from_leg.local, ssrc: from_leg.bundled.as_ref().map(|b| b.ssrc) };
        let outbound = to_leg.srtp.as_ref().map_or(Protection::Clear, |s| Protection::Srtp(s.outbound.clone()));
        // The other party keeps its RTCP apart while this one multiplexes: this leg's RTCP
        // goes to that party's RTCP address.
        let rtcp = r.rtcp_demux.as_ref().filter(|d| d.of != from_side).and_then(|d| Some((d.local, d.peer()?)));
        let copy = |to| Copy { rtcp, ..relay_copy(format!("relay:{id}/{other}"), to_leg.local, to, outbound.clone()) };
        let mut copies: Vec<Copy> = to_leg.peer().map(|to| vec![copy(to)]).unwrap_or_default();
        // A subscriber gets what the relay has in clear (it unprotects a party's SRTP it terminates).
        copies.extend(
            r.forks
                .iter()
                .filter(|f| f.of == from_side)
                .filter_map(|f| Some(relay_copy(format!("relay:{id}/fork:{}", f.tag), f.local, f.remote?, Protection::Clear))),
        );
        StreamEntry {
            id: from_leg.uid,
            label: format!("relay:{id}/{side}"),
            key,
            source: relay_source(from_leg),
            rtp: from_leg.rtp,
            copies,
            rate,
            record: r.record,
            inbound: from_leg.srtp.as_ref().map_or(Protection::Clear, |s| Protection::Srtp(s.inbound.clone())),
            clock_rate: from_leg.clock_rate.unwrap_or(0),
            evaluate_rtcp: from_leg.rtp,
            simulcast: None,
            // The group's first leg answers the transport's STUN and DTLS.
            handshake: from_leg.ice && from_leg.bundled.is_none(),
            stream_ids: None,
            publisher_feedback: None,
            reverse: Protection::Clear,
            control: relay_control(r, from_leg, to_leg),
            dtmf: if from_leg.rtp { from_leg.dtmf.clone() } else { Vec::new() },
        }
    });
    // What an answered subscriber sends its fork's address (its RTCP) is heard and consumed,
    // not dropped as a stranger's or counted as no stream's.
    let forks = r.forks.iter().filter_map(|f| {
        let remote = f.remote?;
        Some(StreamEntry {
            id: f.uid,
            label: format!("relay:{id}/fork:{}", f.tag),
            key: IngressKey { local: f.local, ssrc: None },
            source: SourceRule::Fixed(remote),
            rtp: true,
            copies: Vec::new(),
            rate,
            record: false,
            inbound: Protection::Clear,
            clock_rate: 0,
            evaluate_rtcp: false,
            simulcast: None,
            handshake: false,
            stream_ids: None,
            publisher_feedback: None,
            reverse: Protection::Clear,
            control: StreamControl::default(),
            dtmf: Vec::new(),
        })
    });
    legs.into_iter().chain(forks).chain(r.rtcp_demux.as_ref().map(|d| compile_demuxed_rtcp(id, r, d, rate))).collect()
}

/// The RTCP address of a party that does not multiplex ([`crate::model::DemuxedRtcp`]): what
/// arrives goes to the other party's RTP address from its RTP leg, protected as that leg's
/// copies are.
fn compile_demuxed_rtcp(id: &str, r: &Relay, d: &crate::model::DemuxedRtcp, rate: Option<RateLimit>) -> StreamEntry {
    let (leg, to_leg) = match d.of {
        Side::A => (&r.a, &r.b),
        Side::B => (&r.b, &r.a),
    };
    let outbound = to_leg.srtp.as_ref().map_or(Protection::Clear, |s| Protection::Srtp(s.outbound.clone()));
    let other = if d.of == Side::A { "b" } else { "a" };
    let copies = to_leg.peer().map(|to| relay_copy(format!("relay:{id}/{other}"), to_leg.local, to, outbound)).into_iter().collect();
    let source = match leg.follow {
        _ if leg.pinned() => d.remote.map_or(SourceRule::Any, SourceRule::Fixed),
        crate::model::Follow::Asymmetric => SourceRule::Any,
        _ if d.learns(leg) => SourceRule::Learn(d.latched),
        crate::model::Follow::Strict => d.peer().map_or(SourceRule::Any, SourceRule::Fixed),
        _ => SourceRule::Any,
    };
    StreamEntry {
        id: d.uid,
        label: format!("relay:{id}/{}-rtcp", if d.of == Side::A { "a" } else { "b" }),
        key: IngressKey { local: d.local, ssrc: None },
        source,
        rtp: true,
        copies,
        rate,
        record: false,
        inbound: leg.srtp.as_ref().map_or(Protection::Clear, |s| Protection::Srtp(s.inbound.clone())),
        clock_rate: 0,
        evaluate_rtcp: true,
        simulcast: None,
        handshake: false,
        stream_ids: None,
        publisher_feedback: None,
        reverse: Protection::Clear,
        control: StreamControl::default(),
        dtmf: Vec::new(),
    }
}

/// A copy a relay sends (to a party or a fork): no consumer, no layer, no rewrite.
fn relay_copy(subscriber: String, from: SocketAddr, to: SocketAddr, outbound: Protection) -> Copy {
    Copy { subscriber, from, to, outbound, consumer: 0, layer: None, max_layer: None, auto_layer: true, temporal_layer: None, payload_type: None, rtcp: None }
}

fn relay_control(r: &Relay, from_leg: &Leg, to_leg: &Leg) -> StreamControl {
    let control = r.control.or(from_leg.control);
    let mut telephone_events: Vec<u8> = from_leg.telephone_events.iter().chain(&to_leg.telephone_events).copied().collect();
    telephone_events.sort_unstable();
    telephone_events.dedup();
    let report_dtmf = r.report_dtmf && !telephone_events.is_empty();
    if (control.is_off() && !report_dtmf) || !from_leg.rtp {
        return StreamControl::default();
    }
    StreamControl { control, telephone_events, report_dtmf }
}

fn compile_owner_feedback(model: &Model, owner: Owner) -> Vec<FeedbackEntry> {
    match owner {
        Owner::Room(id) => model.rooms.get(id).map(|r| compile_room_feedback(id, r)).unwrap_or_default(),
        Owner::Relay(_) => Vec::new(),
    }
}

fn compile_owner(model: &Model, owner: Owner, rate: Option<RateLimit>) -> Vec<StreamEntry> {
    match owner {
        Owner::Room(id) => model.rooms.get(id).map(|r| compile_room(id, r, rate)).unwrap_or_default(),
        Owner::Relay(id) => model.relays.get(id).map(|r| compile_relay(id, r, rate)).unwrap_or_default(),
    }
}

impl ForwardingTable {
    /// Compile the whole model. Copies are sorted by subscriber so equal models give equal tables.
    pub fn compile(model: &Model, version: u64) -> ForwardingTable {
        Self::compile_with_rate(model, version, None)
    }

    /// [`ForwardingTable::compile`] with `rate` on every stream (`None` or unlimited: no limit).
    pub fn compile_with_rate(model: &Model, version: u64, rate: Option<RateLimit>) -> ForwardingTable {
        let rate = rate.filter(|l| !l.is_unlimited());
        let mut streams = OrdMap::new();
        let mut feedback = OrdMap::new();
        for (rid, room) in &model.rooms {
            for e in compile_room(rid, room, rate) {
                streams.insert(e.key, e);
            }
            for f in compile_room_feedback(rid, room) {
                feedback.insert(f.local, f);
            }
        }
        for (id, r) in &model.relays {
            for e in compile_relay(id, r, rate) {
                streams.insert(e.key, e);
            }
        }
        ForwardingTable { version, streams, stream_rate: rate, source_limit: None, feedback }
    }

    /// Turn this table (compiled from `old`) into the table of `new`, where `new` differs from
    /// `old` only in `touched`. Bumps the version; returns the keys whose entry was added,
    /// changed or removed (each once, sorted). Cost: the size of what was touched.
    pub fn update<'a>(&mut self, old: &Model, new: &Model, touched: impl IntoIterator<Item = Owner<'a>>) -> Vec<IngressKey> {
        self.version += 1;
        let mut changed = Vec::new();
        for owner in touched {
            let before = compile_owner(old, owner, self.stream_rate);
            let after = compile_owner(new, owner, self.stream_rate);
            for e in &before {
                if !after.iter().any(|a| a.key == e.key) && self.streams.remove(&e.key).is_some() {
                    changed.push(e.key);
                }
            }
            for e in after {
                if self.streams.get(&e.key) != Some(&e) {
                    changed.push(e.key);
                    self.streams.insert(e.key, e);
                }
            }
            let before = compile_owner_feedback(old, owner);
            let after = compile_owner_feedback(new, owner);
            for f in &before {
                if !after.iter().any(|a| a.local == f.local) && self.feedback.remove(&f.local).is_some() {
                    changed.push(IngressKey { local: f.local, ssrc: None });
                }
            }
            for f in after {
                if self.feedback.get(&f.local) != Some(&f) {
                    changed.push(IngressKey { local: f.local, ssrc: None });
                    self.feedback.insert(f.local, f);
                }
            }
        }
        changed.sort();
        changed.dedup();
        changed
    }

    /// Every SFU address a data plane uses: ingress addresses and the addresses copies are sent
    /// from (a subscriber that publishes nothing still receives from its own SFU address).
    pub fn local_addresses(&self) -> Vec<SocketAddr> {
        let mut v: Vec<SocketAddr> = self.streams.values().flat_map(|e| std::iter::once(e.key.local).chain(e.copies.iter().map(|c| c.from))).collect();
        v.sort();
        v.dedup();
        v
    }

    /// The feedback entry of a consumer at `local`, unless a stream there owns its RTCP: one not
    /// RTP (any datagram is its payload) or not the consumer's own (never in a room: one owner
    /// per address). The kernel path flags exactly these addresses.
    pub fn feedback_at(&self, local: SocketAddr) -> Option<&FeedbackEntry> {
        self.feedback_beside(local, self.streams.get(&IngressKey { local, ssrc: None }))
    }

    /// [`ForwardingTable::feedback_at`] given the wildcard stream of `local` (`any`), already
    /// looked up on the per-packet path.
    fn feedback_beside(&self, local: SocketAddr, any: Option<&StreamEntry>) -> Option<&FeedbackEntry> {
        if self.feedback.is_empty() {
            return None; // no room has a subscriber: relays only
        }
        self.feedback.get(&local).filter(|fb| any.is_none_or(|s| s.rtp && s.source == SourceRule::Fixed(fb.source)))
    }

    /// Some stream enters at `local`, or it is a consumer's address.
    pub fn is_local(&self, local: SocketAddr) -> bool {
        self.feedback.contains_key(&local) || self.streams.range(IngressKey { local, ssrc: None }..=IngressKey { local, ssrc: Some(u32::MAX) }).next().is_some()
    }

    /// True when some stream on `local` is narrowed by SSRC (the packet's SSRC must be read).
    pub fn has_ssrc_streams(&self, local: SocketAddr) -> bool {
        self.streams.range(IngressKey { local, ssrc: Some(0) }..=IngressKey { local, ssrc: Some(u32::MAX) }).next().is_some()
    }

    /// Set the per-source limit (`None` or an unlimited one removes it).
    pub fn set_source_limit(&mut self, limit: Option<crate::ratelimit::RateLimit>) {
        self.source_limit = limit.filter(|l| !l.is_unlimited());
    }

    pub fn by_id(&self, id: u32) -> Option<&StreamEntry> {
        self.streams.values().find(|s| s.id == id)
    }

    /// The reference decision for a UDP payload that arrived at `local` from `src`.
    ///
    /// Order matters and every data plane follows it: unknown address, STUN, a consumer's
    /// feedback, RTP validity, SSRC lookup, source check, then forward.
    pub fn classify(&self, local: SocketAddr, src: SocketAddr, payload: &[u8]) -> Verdict<'_> {
        let any = self.streams.get(&IngressKey { local, ssrc: None });
        let narrowed = self.has_ssrc_streams(local);
        let feedback = self.feedback_beside(local, any);
        if any.is_none() && !narrowed && feedback.is_none() {
            return Verdict::Drop { reason: DropReason::NoStream, stream: None };
        }
        let kind = rtp::demux(payload);
        if kind == MediaKind::Stun {
            return Verdict::SlowPath { reason: SlowReason::Stun, stream: any.map(|s| s.id) };
        }
        // DTLS (RFC 7983: first byte 20-63) of an ICE + DTLS-SRTP leg: its handshake, which the
        // control plane checks against the address ICE nominated. (The kernel path hands the
        // whole stream up: it is SRTP.)
        if let Some(e) = any.filter(|e| e.handshake && matches!(payload.first(), Some(20..=63))) {
            return Verdict::SlowPath { reason: SlowReason::Handshake, stream: Some(e.id) };
        }
        // RTCP from the consumer itself: feedback (its sender report, if any, picks the stream
        // the usual way). Anyone else's RTCP there is never feedback.
        if let Some(fb) = feedback.filter(|f| kind == MediaKind::Rtcp && f.source == src) {
            // SRTCP (a WebRTC consumer's) is readable only as far as its first header until it
            // is unprotected; its tag decides the rest.
            let first = match fb.inbound.is_clear() {
                true => rtp::parse_rtcp_compound(payload).ok().map(|p| (p[0].packet_type, p[0].sender_ssrc)),
                false => srtcp_first_header(payload),
            };
            let Some((first_type, first_ssrc)) = first else {
                return Verdict::Drop { reason: DropReason::Malformed, stream: any.map(|s| s.id) };
            };
            let sender = (first_type == 200).then_some(first_ssrc);
            let stream = sender
                .and_then(|ssrc| self.streams.get(&IngressKey { local, ssrc: Some(ssrc) }).filter(|_| narrowed))
                .or(any)
                .filter(|e| sender.is_some() && matches!(e.source, SourceRule::Fixed(s) if s == src));
            return Verdict::Feedback { entry: fb, stream };
        }
        let wants_rtp = narrowed || any.is_some_and(|s| s.rtp);
        // SRTCP encrypts all but the first packet's header: only that much can be checked here
        // (its authentication tag decides the rest, when it is unprotected).
        let srtcp = any.is_some_and(|s| !s.inbound.is_clear());
        // An ICE + DTLS-SRTP address's RTP likewise: its padding count is ciphertext (or the
        // tag's last byte), not checkable before unprotecting. (Other SRTP addresses are judged
        // as the kernel judges them; it hands these up whole, unjudged.)
        let srtp = srtcp && any.is_some_and(|s| s.handshake);
        let ssrc = if wants_rtp {
            match rtp_ssrc(kind, payload, srtcp, srtp) {
                Some(ssrc) => Some(ssrc),
                None => return Verdict::Drop { reason: DropReason::Malformed, stream: any.map(|s| s.id) },
            }
        } else {
            None
        };
        let entry = ssrc.filter(|_| narrowed).and_then(|ssrc| self.streams.get(&IngressKey { local, ssrc: Some(ssrc) })).or(any);
        let Some(entry) = entry else {
            // A stranger's RTCP to a consumer's address: spoofed feedback.
            let reason = if feedback.is_some() && kind == MediaKind::Rtcp { DropReason::Stranger } else { DropReason::NoStream };
            return Verdict::Drop { reason, stream: None };
        };
        match entry.source {
            SourceRule::Fixed(allowed) if allowed == src => Verdict::Forward(entry),
            SourceRule::Fixed(_) => Verdict::Drop { reason: DropReason::Stranger, stream: Some(entry.id) },
            SourceRule::Learn(Some(followed)) if followed == src => Verdict::Forward(entry),
            SourceRule::Learn(_) => Verdict::Learn(entry),
            SourceRule::Any => Verdict::Forward(entry),
        }
    }

    /// Entries to write and keys to delete to turn `old` into `self`.
    pub fn diff<'t>(&'t self, old: &ForwardingTable) -> TableDiff<'t> {
        let upserts = self.streams.iter().filter(|(k, v)| old.streams.get(*k) != Some(v)).map(|(_, v)| v).collect();
        let removals = old.streams.keys().filter(|k| !self.streams.contains_key(*k)).copied().collect();
        let feedback = self
            .feedback
            .iter()
            .filter(|(k, v)| old.feedback.get(*k) != Some(v))
            .map(|(k, _)| *k)
            .chain(old.feedback.keys().filter(|k| !self.feedback.contains_key(*k)).copied())
            .collect();
        TableDiff { upserts, removals, feedback }
    }
}

fn relay_source(leg: &Leg) -> SourceRule {
    if leg.ice {
        // Only the nominated address; before a nomination nobody (whatever arrives is
        // unprotected with no key and dropped, and reported sources are not followed).
        return leg.remote.map_or(SourceRule::Learn(None), SourceRule::Fixed);
    }
    match leg.remote {
        Some(r) if leg.pinned() => SourceRule::Fixed(r),
        _ if leg.learns() => SourceRule::Learn(leg.latched),
        _ => match (leg.follow, leg.latched.or(leg.remote)) {
            (crate::model::Follow::Strict, Some(locked)) => SourceRule::Fixed(locked),
            _ => SourceRule::Any,
        },
    }
}

/// The packet type and sender SSRC of an SRTCP packet's first header, if that header is valid
/// (the rest is encrypted).
fn srtcp_first_header(payload: &[u8]) -> Option<(u8, u32)> {
    let first_len = (u16::from_be_bytes([*payload.get(2)?, *payload.get(3)?]) as usize + 1) * 4;
    (payload[0] >> 6 == 2 && first_len >= 8 && first_len <= payload.len()).then(|| (payload[1], u32::from_be_bytes(payload[4..8].try_into().unwrap())))
}

/// The SSRC of a valid RTP packet, or of the sender of a valid RTCP compound packet (`srtcp`:
/// of one whose first header is valid).
fn rtp_ssrc(kind: MediaKind, payload: &[u8], srtcp: bool, srtp: bool) -> Option<u32> {
    match kind {
        MediaKind::Rtp if srtp => RtpHeader::parse_srtp(payload).ok().map(|h| h.ssrc),
        MediaKind::Rtp => RtpHeader::parse(payload).ok().map(|h| h.ssrc),
        MediaKind::Rtcp if srtcp => srtcp_first_header(payload).map(|(_, ssrc)| ssrc),
        MediaKind::Rtcp => rtp::parse_rtcp_compound(payload).ok().map(|p| p[0].sender_ssrc),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LegSpec, StreamRef, StreamSpec};
    use crate::rtp::build_rtp;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// A WebRTC publisher's entries carry what the SFU feeds back: its transport-cc id, and the
    /// lower of its room's and its own ceiling; a plain participant's carry nothing.
    #[test]
    fn webrtc_entries_carry_the_lower_ceiling() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_webrtc_participant("r", "w", a("10.0.0.1:4000")).unwrap();
        m.set_participant_nominated("r", "w", Some(a("10.0.1.1:5000"))).unwrap();
        m.publish("r", "w", "video", StreamSpec { ssrc: Some(5), ..Default::default() }).unwrap();
        m.add_participant("r", "plain", a("10.0.0.1:4002"), a("10.0.1.2:5000")).unwrap();
        m.publish("r", "plain", "mic", StreamSpec { ssrc: Some(6), ..Default::default() }).unwrap();
        let fed = |m: &Model| -> Vec<(String, Option<PublisherFeedback>)> {
            let t = ForwardingTable::compile(m, 1);
            let mut v: Vec<_> = t.streams.values().map(|e| (e.label.clone(), e.publisher_feedback)).collect();
            v.sort_by(|x, y| x.0.cmp(&y.0));
            v
        };
        let w = |cc, max| Some(PublisherFeedback { transport_cc: cc, abs_send_time: None, max_bitrate_bps: max });
        assert_eq!(fed(&m), vec![("r/plain/mic".into(), None), ("r/w".into(), w(None, None)), ("r/w/video".into(), w(None, None))]);
        m.set_transport_cc("r", "w", 3).unwrap();
        m.set_publisher_max_kbps("r", Some(800)).unwrap();
        m.set_participant_max_kbps("r", "w", Some(500)).unwrap();
        assert_eq!(fed(&m)[2], ("r/w/video".into(), w(Some(3), Some(500_000))));
        m.set_participant_max_kbps("r", "w", Some(1_000)).unwrap();
        assert_eq!(fed(&m)[2], ("r/w/video".into(), w(Some(3), Some(800_000))), "the room's is lower");
        m.set_publisher_max_kbps("r", None).unwrap();
        assert_eq!(fed(&m)[2], ("r/w/video".into(), w(Some(3), Some(1_000_000))));
        assert!(m.set_participant_max_kbps("r", "plain", Some(500)).is_err(), "a plain participant has no REMB to obey");
    }

    /// A browser's SRTP with the padding bit: its padding count is ciphertext (here a 0 and a
    /// count longer than the packet), so it is not judged before unprotecting; a plain RTP
    /// address still refuses such a packet. (Chromium pads its bandwidth probes: judged, about
    /// three in four were dropped as malformed.)
    #[test]
    fn a_browsers_padded_srtp_is_not_judged_by_its_encrypted_padding() {
        let key = || crate::srtp::SrtpKey::new(crate::srtp::SrtpSuite::AesCm128HmacSha1_80, vec![7; 30]).unwrap();
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_webrtc_participant("r", "w", a("10.0.0.1:4000")).unwrap();
        m.set_participant_nominated("r", "w", Some(a("10.0.1.1:5000"))).unwrap();
        m.set_participant_srtp("r", "w", crate::srtp::LegSrtp { inbound: Some(key()), outbound: Some(key()) }).unwrap();
        m.publish("r", "w", "video", StreamSpec { ssrc: Some(5), ..Default::default() }).unwrap();
        m.add_participant("r", "plain", a("10.0.0.1:4002"), a("10.0.1.2:5000")).unwrap();
        m.publish("r", "plain", "video", StreamSpec { ssrc: Some(6), ..Default::default() }).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        for last in [0u8, 255] {
            let padded = |ssrc| {
                let mut p = build_rtp(96, 1, 0, ssrc, &[9; 40]);
                p[0] |= 0x20;
                *p.last_mut().unwrap() = last;
                p
            };
            let v = t.classify(a("10.0.0.1:4000"), a("10.0.1.1:5000"), &padded(5));
            assert!(matches!(v, Verdict::Forward(e) if e.key.ssrc == Some(5)), "last byte {last}: {v:?}");
            let v = t.classify(a("10.0.0.1:4002"), a("10.0.1.2:5000"), &padded(6));
            assert!(matches!(v, Verdict::Drop { reason: DropReason::Malformed, .. }), "plain, last byte {last}: {v:?}");
        }
    }

    /// A browser's media from the address its ICE check came from is taken before it nominates
    /// (it sends as soon as its DTLS is done: its first packets are its bandwidth probes and
    /// first keyframe), nothing is sent to it until then, and the nomination decides after.
    #[test]
    fn a_browser_is_heard_from_its_checked_address_before_it_nominates() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_webrtc_participant("r", "w", a("10.0.0.1:4000")).unwrap();
        m.publish("r", "w", "video", StreamSpec { ssrc: Some(5), ..Default::default() }).unwrap();
        m.add_webrtc_participant("r", "viewer", a("10.0.0.1:4002")).unwrap();
        m.subscribe("r", "viewer", StreamRef { publisher: "w".into(), stream: "video".into() }).unwrap();
        let rtp = build_rtp(96, 1, 0, 5, &[9; 40]);
        let heard = |m: &Model, from: &str| matches!(ForwardingTable::compile(m, 1).classify(a("10.0.0.1:4000"), a(from), &rtp), Verdict::Forward(_));
        assert!(!heard(&m, "10.0.1.1:5000"), "nobody's before a check");
        assert!(m.set_participant_checked("r", "w", a("10.0.1.1:5000")).unwrap());
        assert!(!m.set_participant_checked("r", "w", a("10.0.1.1:6000")).unwrap(), "the first checked address only");
        assert!((heard(&m, "10.0.1.1:5000"), heard(&m, "10.0.1.1:6000")) == (true, false));
        m.set_participant_checked("r", "viewer", a("10.0.1.2:5000")).unwrap();
        let t = ForwardingTable::compile(&m, 2);
        assert!(t.streams.values().all(|e| e.copies.is_empty()), "nothing is sent to a checked address");
        assert!(t.streams.values().all(|e| e.publisher_feedback.is_none()), "no feedback either (it would go there)");
        m.set_participant_nominated("r", "w", Some(a("10.0.1.1:6000"))).unwrap();
        assert!((heard(&m, "10.0.1.1:5000"), heard(&m, "10.0.1.1:6000")) == (false, true), "the nomination decides");
        let fed_back = ForwardingTable::compile(&m, 3).streams.values().filter(|e| e.publisher_feedback.is_some()).count();
        assert!(fed_back > 0, "fed back once nominated");
        m.set_participant_nominated("r", "w", None).unwrap();
        assert!((heard(&m, "10.0.1.1:5000"), heard(&m, "10.0.1.1:6000")) == (false, false), "consent over: not the checked address again");
    }

    /// n participants p0..p(n-1); each publishes "main" and subscribes to everybody else's.
    fn full_mesh(n: usize) -> Model {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        for i in 0..n {
            m.add_participant("r", &format!("p{i}"), a(&format!("10.0.0.1:{}", 4000 + 2 * i)), a(&format!("10.0.1.{}:5000", i + 1))).unwrap();
            m.publish("r", &format!("p{i}"), "main", StreamSpec::default()).unwrap();
        }
        for i in 0..n {
            for j in 0..n {
                if i != j {
                    let r = StreamRef { publisher: format!("p{j}"), stream: "main".into() };
                    m.subscribe("r", &format!("p{i}"), r).unwrap();
                }
            }
        }
        m
    }

    #[test]
    fn a_simulcast_stream_compiles_to_one_entry_per_layer_with_every_consumer() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "p0", a("10.0.0.1:4000"), a("10.0.1.1:5000")).unwrap();
        m.add_participant("r", "p1", a("10.0.0.1:4002"), a("10.0.1.2:5000")).unwrap();
        let spec = StreamSpec { layers: vec![0x100, 0x101], codec: Some(crate::simulcast::Codec::H264), ..Default::default() };
        let uid = m.publish("r", "p0", "v", spec).unwrap();
        let c = m.subscribe("r", "p1", StreamRef { publisher: "p0".into(), stream: "v".into() }).unwrap();
        m.set_consumer_layers("r", c, Some(0), None, true, None).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        let layers: Vec<(u32, u32)> = m.rooms["r"].participants["p0"].streams["v"].layers.iter().map(|l| (l.uid, l.ssrc)).collect();
        assert_eq!(t.streams.len(), 2, "no wildcard entry");
        for (i, (id, ssrc)) in layers.iter().enumerate() {
            let e = &t.streams[&IngressKey { local: a("10.0.0.1:4000"), ssrc: Some(*ssrc) }];
            assert_eq!(e.id, *id);
            let want = SimulcastLayer { group: uid, index: i as u8, layers: layers.clone(), codec: crate::simulcast::Codec::H264 };
            assert_eq!(e.simulcast.as_ref(), Some(&want));
            assert_eq!(e.copies.iter().map(|c| (c.consumer, c.layer)).collect::<Vec<_>>(), vec![(c, Some(0))]);
        }
        // Its consumer's feedback names the first layer's SSRC and knows every layer.
        let fb = &t.feedback[&a("10.0.0.1:4002")];
        assert_eq!((fb.routes[0].ssrc, fb.routes[0].consumer, &fb.routes[0].layers), (0x100, c, &layers));
        // The RTP of an unknown SSRC at the address is no stream's.
        let rtp = crate::rtp::build_rtp(96, 1, 1, 0x102, &[0; 4]);
        assert!(matches!(t.classify(a("10.0.0.1:4000"), a("10.0.1.1:5000"), &rtp), Verdict::Drop { reason: DropReason::NoStream, .. }));
    }

    #[test]
    fn full_mesh_never_copies_back_to_the_publisher() {
        let t = ForwardingTable::compile(&full_mesh(12), 1);
        assert_eq!(t.streams.len(), 12);
        for e in t.streams.values() {
            assert_eq!(e.copies.len(), 11);
            let SourceRule::Fixed(src) = e.source else { panic!() };
            assert!(e.copies.iter().all(|c| c.to != src));
            // Each copy leaves from its subscriber's own SFU address.
            assert!(e.copies.iter().all(|c| c.from != e.key.local));
        }
    }

    #[test]
    fn only_subscribers_get_copies_per_quality() {
        let mut m = full_mesh(4);
        // p0 also publishes "high" on its own port; only p2 and p3 subscribe to it.
        m.publish("r", "p0", "high", StreamSpec { local: Some(a("10.0.0.1:4100")), ..Default::default() }).unwrap();
        for s in ["p2", "p3"] {
            m.subscribe("r", s, StreamRef { publisher: "p0".into(), stream: "high".into() }).unwrap();
        }
        let t = ForwardingTable::compile(&m, 1);
        let high = &t.streams[&IngressKey { local: a("10.0.0.1:4100"), ssrc: None }];
        let subs: Vec<_> = high.copies.iter().map(|c| c.subscriber.as_str()).collect();
        assert_eq!(subs, ["r/p2", "r/p3"]);
    }

    #[test]
    fn local_addresses_include_egress_only_subscribers() {
        let mut m = full_mesh(2);
        m.add_participant("r", "viewer", a("10.0.0.1:4100"), a("10.0.1.9:5000")).unwrap();
        m.subscribe("r", "viewer", StreamRef { publisher: "p0".into(), stream: "main".into() }).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        assert_eq!(t.local_addresses(), vec![a("10.0.0.1:4000"), a("10.0.0.1:4002"), a("10.0.0.1:4100")]);
    }

    #[test]
    fn classify_follows_the_invariants() {
        let t = ForwardingTable::compile(&full_mesh(3), 1);
        let local = a("10.0.0.1:4000");
        let owner = a("10.0.1.1:5000");
        let rtp = build_rtp(0, 1, 160, 42, &[0; 160]);
        match t.classify(local, owner, &rtp) {
            Verdict::Forward(e) => assert_eq!(e.copies.len(), 2),
            v => panic!("{v:?}"),
        }
        let stranger = t.classify(local, a("10.9.9.9:5000"), &rtp);
        assert!(matches!(stranger, Verdict::Drop { reason: DropReason::Stranger, stream: Some(_) }));
        // Same IP, different port is a stranger too.
        let other_port = t.classify(local, a("10.0.1.1:5001"), &rtp);
        assert!(matches!(other_port, Verdict::Drop { reason: DropReason::Stranger, .. }));
        for garbage in [&b""[..], b"\x80", b"hello world!", &[0x80; 11]] {
            let v = t.classify(local, owner, garbage);
            assert!(matches!(v, Verdict::Drop { reason: DropReason::Malformed, .. }), "{garbage:?}: {v:?}");
        }
        assert!(matches!(t.classify(a("10.0.0.1:9999"), owner, &rtp), Verdict::Drop { reason: DropReason::NoStream, stream: None }));
        let mut stun = vec![0, 1, 0, 0, 0x21, 0x12, 0xa4, 0x42];
        stun.extend_from_slice(&[0; 12]);
        assert!(matches!(t.classify(local, a("10.9.9.9:1"), &stun), Verdict::SlowPath { reason: SlowReason::Stun, .. }));
    }

    #[test]
    fn rate_limits_are_set_on_every_stream_and_serialised_only_when_present() {
        let t = ForwardingTable::compile(&full_mesh(3), 1);
        let e = t.streams.values().next().unwrap().clone();
        let plain = serde_json::to_string(&e).unwrap();
        assert!(!plain.contains("rate"), "{plain}");
        assert_eq!(serde_json::from_str::<StreamEntry>(&plain).unwrap(), e);
        let t = ForwardingTable::compile_with_rate(&full_mesh(3), 1, Some(crate::RateLimit::packets(100)));
        assert!(t.streams.values().all(|e| e.rate == Some(crate::RateLimit::packets(100))));
        let e = t.streams.values().next().unwrap();
        assert_eq!(&serde_json::from_str::<StreamEntry>(&serde_json::to_string(e).unwrap()).unwrap(), e);
        let t = ForwardingTable::compile_with_rate(&full_mesh(3), 1, Some(crate::RateLimit { pps: 0, bps: 0, burst_ms: 5 }));
        assert!(t.streams.values().all(|e| e.rate.is_none()));
    }

    #[test]
    fn non_rtp_streams_forward_any_payload() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "x", a("10.0.0.1:6363"), a("10.0.1.1:6363")).unwrap();
        m.add_participant("r", "y", a("10.0.0.1:6364"), a("10.0.1.2:6363")).unwrap();
        m.publish("r", "x", "raw", StreamSpec { rtp: false, ..Default::default() }).unwrap();
        m.subscribe("r", "y", StreamRef { publisher: "x".into(), stream: "raw".into() }).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        for payload in [&b""[..], b"hello", &[0xff; 46]] {
            assert!(matches!(t.classify(a("10.0.0.1:6363"), a("10.0.1.1:6363"), payload), Verdict::Forward(_)));
        }
    }

    #[test]
    fn ssrc_narrows_streams_on_one_port() {
        let mut m = full_mesh(2);
        m.unpublish("r", "p0", "main").unwrap();
        m.publish("r", "p0", "low", StreamSpec { ssrc: Some(1), ..Default::default() }).unwrap();
        m.publish("r", "p0", "high", StreamSpec { ssrc: Some(2), ..Default::default() }).unwrap();
        m.subscribe("r", "p1", StreamRef { publisher: "p0".into(), stream: "high".into() }).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        let (local, src) = (a("10.0.0.1:4000"), a("10.0.1.1:5000"));
        let v = t.classify(local, src, &build_rtp(96, 1, 1, 2, b"x"));
        assert!(matches!(v, Verdict::Forward(e) if e.label == "r/p0/high" && e.copies.len() == 1));
        let v = t.classify(local, src, &build_rtp(96, 1, 1, 1, b"x"));
        assert!(matches!(v, Verdict::Forward(e) if e.label == "r/p0/low" && e.copies.is_empty()));
        let v = t.classify(local, src, &build_rtp(96, 1, 1, 3, b"x"));
        assert!(matches!(v, Verdict::Drop { reason: DropReason::NoStream, .. }));
        // RTCP SR from SSRC 2 follows the high stream.
        let mut sr = vec![0x80, 200, 0, 6];
        sr.extend_from_slice(&2u32.to_be_bytes());
        sr.extend_from_slice(&[0; 20]);
        // (p0 subscribes to p1: its RTCP is feedback, its SR forwarded as that stream's.)
        assert!(matches!(t.classify(local, src, &sr), Verdict::Feedback { stream: Some(e), .. } if e.label == "r/p0/high"));
    }

    #[test]
    fn an_srtp_leg_is_unprotected_on_arrival_and_protected_on_the_way_back() {
        use crate::srtp::{LegSrtp, SrtpKey, SrtpSuite};
        let mut m = Model::new();
        let leg = |l, r| LegSpec { local: a(l), remote: r, strict: false, rtp: true, follow: Default::default() };
        m.create_relay("call", leg("10.0.0.1:30000", Some(a("10.0.2.1:7000"))), leg("10.0.0.1:30002", Some(a("10.0.3.1:8000")))).unwrap();
        let (theirs, ours) =
            (SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, vec![1; 30]).unwrap(), SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, vec![2; 30]).unwrap());
        assert!(m.set_leg_srtp("call", crate::model::Side::A, Some(LegSrtp { inbound: Some(theirs.clone()), outbound: Some(ours.clone()) })).unwrap());
        assert!(!m.set_leg_srtp("call", crate::model::Side::A, Some(LegSrtp { inbound: Some(theirs.clone()), outbound: Some(ours.clone()) })).unwrap());
        let t = ForwardingTable::compile(&m, 1);
        let from_a = &t.streams[&IngressKey { local: a("10.0.0.1:30000"), ssrc: None }];
        let from_b = &t.streams[&IngressKey { local: a("10.0.0.1:30002"), ssrc: None }];
        assert_eq!((&from_a.inbound, &from_a.copies[0].outbound), (&Protection::Srtp(Some(theirs)), &Protection::Clear));
        assert_eq!((&from_b.inbound, &from_b.copies[0].outbound), (&Protection::Clear, &Protection::Srtp(Some(ours))));
        assert!(from_a.has_srtp() && from_b.has_srtp());
        // SRTCP: the first header is clear, the rest encrypted; only the header is checked.
        let mut srtcp = vec![0x81, 201, 0, 7];
        srtcp.extend_from_slice(&0xfeed_u32.to_be_bytes());
        srtcp.extend_from_slice(&[0xa5; 24 + 4 + 10]);
        assert!(matches!(t.classify(a("10.0.0.1:30000"), a("10.0.2.1:7000"), &srtcp), Verdict::Learn(_)));
        assert!(
            matches!(t.classify(a("10.0.0.1:30002"), a("10.0.3.1:8000"), &srtcp), Verdict::Drop { reason: DropReason::Malformed, .. }),
            "plain RTCP is checked whole"
        );
        let mut bad = srtcp.clone();
        bad[0] = 0x41;
        assert!(matches!(t.classify(a("10.0.0.1:30000"), a("10.0.2.1:7000"), &bad), Verdict::Drop { reason: DropReason::Malformed, .. }));
        bad[0] = 0x81;
        bad[3] = 200; // longer than the datagram
        assert!(matches!(t.classify(a("10.0.0.1:30000"), a("10.0.2.1:7000"), &bad), Verdict::Drop { reason: DropReason::Malformed, .. }));
    }

    /// BUNDLE: the video section's browser leg shares the audio section's ICE leg's address and
    /// takes its SSRC's RTP and RTCP there; the rest of the address is the audio relay's. The
    /// nomination and the keys of the first leg are the bundled leg's too; the address stays
    /// the first leg's when the bundled relay goes.
    #[test]
    fn a_bundled_leg_takes_its_ssrc_at_its_groups_address() {
        use crate::model::{Bundled, ModelError, Side};
        use crate::srtp::{LegSrtp, SrtpKey, SrtpSuite};
        let mut m = Model::new();
        let leg = |l, r| LegSpec { local: a(l), remote: r, strict: false, rtp: true, follow: Default::default() };
        m.create_relay("audio", leg("10.0.0.1:30000", None), leg("10.0.0.1:30002", Some(a("10.0.3.1:8000")))).unwrap();
        m.create_relay("video", leg("10.0.0.1:30004", None), leg("10.0.0.1:30006", Some(a("10.0.3.1:8002")))).unwrap();
        let bundle = |ssrc| Bundled { relay: "audio".into(), ssrc };
        assert!(matches!(m.bundle_leg("video", Side::A, bundle(0xbeef)), Err(ModelError::Invalid(_))), "the first leg is no ICE leg yet");
        m.set_leg_ice("audio", Side::A, true).unwrap();
        assert!(matches!(m.bundle_leg("audio", Side::A, Bundled { relay: "audio".into(), ssrc: 1 }), Err(ModelError::Invalid(_))));
        assert!(m.bundle_leg("video", Side::A, bundle(0xbeef)).unwrap());
        assert!(!m.bundle_leg("video", Side::A, bundle(0xbeef)).unwrap(), "again: no change");
        assert_eq!(m.owner_of(&a("10.0.0.1:30004")), None, "its own address was released");
        assert_eq!(m.relays["video"].a.local, a("10.0.0.1:30000"));
        m.create_relay("other", leg("10.0.0.1:30008", None), leg("10.0.0.1:30010", None)).unwrap();
        assert!(matches!(m.bundle_leg("other", Side::A, bundle(0xbeef)), Err(ModelError::IngressInUse { ssrc: Some(0xbeef), .. })));
        m.delete_relay("other").unwrap();

        let browser = a("198.51.100.9:50000");
        let key = SrtpKey::new(SrtpSuite::AeadAes128Gcm, vec![3; 28]).unwrap();
        m.set_leg_nominated("audio", Side::A, Some(browser)).unwrap();
        m.set_leg_srtp("audio", Side::A, Some(LegSrtp { inbound: Some(key.clone()), outbound: Some(key.clone()) })).unwrap();
        assert_eq!((m.relays["video"].a.remote, m.relays["video"].a.srtp.clone()), (Some(browser), m.relays["audio"].a.srtp.clone()));

        let t = ForwardingTable::compile(&m, 1);
        let bundled = &t.streams[&IngressKey { local: a("10.0.0.1:30000"), ssrc: Some(0xbeef) }];
        assert_eq!((bundled.id, bundled.handshake, bundled.source), (m.relays["video"].a.uid, false, SourceRule::Fixed(browser)));
        assert!(t.streams[&IngressKey { local: a("10.0.0.1:30000"), ssrc: None }].handshake, "the first leg answers the transport's handshake");
        let video_rtp = build_rtp(96, 1, 1, 0xbeef, &[0; 100]);
        let audio_rtp = build_rtp(111, 1, 1, 0xa0d1, &[0; 100]);
        let to = |v: Verdict| match v {
            Verdict::Forward(e) => e.copies.iter().map(|c| c.to).collect::<Vec<_>>(),
            v => panic!("{v:?}"),
        };
        assert_eq!(to(t.classify(a("10.0.0.1:30000"), browser, &video_rtp)), [a("10.0.3.1:8002")]);
        assert_eq!(to(t.classify(a("10.0.0.1:30000"), browser, &audio_rtp)), [a("10.0.3.1:8000")]);
        // SRTCP whose sender is the video SSRC goes with the video.
        let mut srtcp = vec![0x80, 200, 0, 6];
        srtcp.extend_from_slice(&0xbeef_u32.to_be_bytes());
        srtcp.extend_from_slice(&[0xa5; 20 + 4 + 16]);
        assert_eq!(to(t.classify(a("10.0.0.1:30000"), browser, &srtcp)), [a("10.0.3.1:8002")]);
        // The way back leaves from the group's address, protected with its key.
        let back = &t.streams[&IngressKey { local: a("10.0.0.1:30006"), ssrc: None }];
        assert_eq!((back.copies[0].from, back.copies[0].to, &back.copies[0].outbound), (a("10.0.0.1:30000"), browser, &Protection::Srtp(Some(key))));

        // Stored and loaded, it is the same model; deleting the bundled relay keeps the address.
        let again = Model::from_parts(m.rooms.clone(), m.relays.clone(), m.next_uid()).unwrap();
        assert_eq!(again, m);
        let mut without_video = m.clone();
        without_video.delete_relay("video").unwrap();
        assert_eq!(without_video.owner_of(&a("10.0.0.1:30000")), Some("relay audio/a"));
        // The first relay deleted (through the API) while a leg is bundled with it: the address
        // stays claimed by that leg, a restart loads the model, the last one out releases it.
        m.delete_relay("audio").unwrap();
        assert_eq!(m.owner_of(&a("10.0.0.1:30000")), Some("relay video/a"));
        let again = Model::from_parts(m.rooms.clone(), m.relays.clone(), m.next_uid()).expect("loads");
        assert_eq!(again.owner_of(&a("10.0.0.1:30000")), Some("relay video/a"));
        m.delete_relay("video").unwrap();
        assert_eq!(m.owner_of(&a("10.0.0.1:30000")), None);
    }

    #[test]
    fn relay_pairs_are_fan_outs_of_one_and_learn() {
        let mut m = Model::new();
        let leg = |l, r| LegSpec { local: a(l), remote: r, strict: false, rtp: true, follow: Default::default() };
        m.create_relay("call", leg("10.0.0.1:30000", Some(a("10.0.2.1:7000"))), leg("10.0.0.1:30002", Some(a("10.0.3.1:8000")))).unwrap();
        m.open_learning("call", crate::model::Side::A, 3_000).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        let rtp = build_rtp(8, 1, 1, 1, &[0; 160]);
        // Nothing learnt yet: relayed, and reported.
        let v = t.classify(a("10.0.0.1:30000"), a("10.0.2.1:7000"), &rtp);
        assert!(matches!(v, Verdict::Learn(e) if e.copies[0].to == a("10.0.3.1:8000")), "{v:?}");
        // Behind a NAT: the real source differs from the signalled address.
        assert!(m.latch("call", crate::model::Side::A, a("10.0.2.9:7777"), 1_000).unwrap());
        let t2 = ForwardingTable::compile(&m, 2);
        let back = &t2.streams[&IngressKey { local: a("10.0.0.1:30002"), ssrc: None }];
        assert_eq!(back.copies[0].to, a("10.0.2.9:7777"), "b's media goes to a's latched source");
        match t2.classify(a("10.0.0.1:30000"), a("10.0.2.9:7777"), &rtp) {
            Verdict::Forward(e) => {
                assert_eq!(
                    e.copies,
                    vec![Copy {
                        subscriber: "relay:call/b".into(),
                        from: a("10.0.0.1:30002"),
                        to: a("10.0.3.1:8000"),
                        outbound: Protection::Clear,
                        consumer: 0,
                        layer: None,
                        max_layer: None,
                        auto_layer: true,
                        temporal_layer: None,
                        payload_type: None,
                        rtcp: None,
                    }]
                )
            }
            v => panic!("{v:?}"),
        }
        // Still learning: another source is relayed and reported.
        assert!(matches!(t2.classify(a("10.0.0.1:30000"), a("10.0.2.1:7000"), &rtp), Verdict::Learn(_)));
        let d = t2.diff(&t);
        assert_eq!(d.upserts.len(), 2, "a's source and b's destination both changed");
        assert!(d.removals.is_empty());
        // The window closes: any source is relayed, none followed.
        assert_eq!(m.close_learning(3_000), vec!["call".to_string()]);
        let t3 = ForwardingTable::compile(&m, 3);
        assert!(matches!(t3.classify(a("10.0.0.1:30000"), a("10.0.2.1:7000"), &rtp), Verdict::Forward(_)));
        assert_eq!(t3.streams[&IngressKey { local: a("10.0.0.1:30002"), ssrc: None }].copies[0].to, a("10.0.2.9:7777"));
        // strict-source: after the window, only the locked source may send.
        let strict = crate::LegSignal { remote: Some(a("10.0.2.1:7000")), follow: crate::model::Follow::Strict, ..Default::default() };
        m.set_leg_signal("call", crate::model::Side::A, strict).unwrap();
        let t4 = ForwardingTable::compile(&m, 4);
        assert!(matches!(t4.classify(a("10.0.0.1:30000"), a("10.0.2.1:7000"), &rtp), Verdict::Drop { reason: DropReason::Stranger, .. }));
        assert!(matches!(t4.classify(a("10.0.0.1:30000"), a("10.0.2.9:7777"), &rtp), Verdict::Forward(_)));
        m.delete_relay("call").unwrap();
        let t5 = ForwardingTable::compile(&m, 5);
        assert_eq!(t5.diff(&t4).removals.len(), 2);
    }

    /// Random mutations applied incrementally give exactly the table a full compile gives, and
    /// the changed keys are exactly the keys whose entries differ.
    #[test]
    fn incremental_update_equals_full_compile() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let rate = Some(crate::RateLimit::packets(50));
        let mut model = Model::new();
        let mut table = ForwardingTable::compile_with_rate(&model, 0, rate);
        let mut routed = false;
        let leg =
            |port: u64| LegSpec { local: a(&format!("10.0.0.1:{}", 30000 + 2 * port)), remote: None, strict: false, rtp: true, follow: Default::default() };
        for step in 0..3000 {
            let mut next = model.clone();
            // Relays whose learning window closed this step (any relay: it is a sweep).
            let mut closed = Vec::new();
            let room = format!("r{}", rnd(2));
            let relay = format!("c{}", rnd(40));
            let p = |i: u64| format!("p{i}");
            let owner = match rnd(9) {
                0 => {
                    let _ = next.create_room(&room);
                    Owner::Room(&room)
                }
                1 if rnd(16) == 0 => {
                    let _ = next.delete_room(&room);
                    Owner::Room(&room)
                }
                2 => {
                    let i = rnd(4);
                    let port = 4000 + 100 * (room.as_bytes()[1] as u64 - b'0' as u64) + 2 * i;
                    let _ = next.add_participant(&room, &p(i), a(&format!("10.0.0.1:{port}")), a(&format!("10.0.1.{}:5000", i + 1)));
                    Owner::Room(&room)
                }
                3 => {
                    let _ = next.remove_participant(&room, &p(rnd(4)));
                    Owner::Room(&room)
                }
                4 => {
                    let ssrc = (rnd(2) == 0).then(|| rnd(3) as u32);
                    let _ = next.publish(&room, &p(rnd(4)), &format!("s{}", rnd(2)), StreamSpec { ssrc, ..Default::default() });
                    Owner::Room(&room)
                }
                5 => {
                    let r = StreamRef { publisher: p(rnd(4)), stream: format!("s{}", rnd(2)) };
                    let _ = if rnd(3) == 0 { next.unsubscribe(&room, &p(rnd(4)), &r) } else { next.subscribe(&room, &p(rnd(4)), r).map(|_| ()) };
                    Owner::Room(&room)
                }
                6 => {
                    let n = rnd(40);
                    let _ = next.create_relay(&relay, leg(2 * n), leg(2 * n + 1));
                    Owner::Relay(&relay)
                }
                7 => {
                    let side = if rnd(2) == 0 { crate::model::Side::A } else { crate::model::Side::B };
                    let now = step as u64;
                    let _ = match rnd(4) {
                        0 => next.open_learning(&relay, side, now + rnd(20)),
                        1 => {
                            closed = next.close_learning(now);
                            Ok(())
                        }
                        _ => next.latch(&relay, side, a(&format!("10.0.2.{}:7000", rnd(3) + 1)), now).map(|_| ()),
                    };
                    Owner::Relay(&relay)
                }
                _ => {
                    let _ = next.delete_relay(&relay);
                    Owner::Relay(&relay)
                }
            };
            let before = table.clone();
            let changed = table.update(&model, &next, std::iter::once(owner).chain(closed.iter().map(|id| Owner::Relay(id))));
            let full = ForwardingTable::compile_with_rate(&next, table.version, rate);
            assert_eq!(table, full, "step {step}");
            let d = full.diff(&before);
            let feedback = d.feedback.iter().map(|local| IngressKey { local: *local, ssrc: None });
            let mut expected: Vec<IngressKey> = d.upserts.iter().map(|e| e.key).chain(d.removals).chain(feedback).collect();
            expected.sort();
            expected.dedup();
            assert_eq!(changed, expected, "step {step}");
            routed |= table.feedback.values().any(|f| !f.routes.is_empty());
            model = next;
        }
        assert!(table.streams.len() > 10, "the walk built something: {}", table.streams.len());
        assert!(routed, "the walk routed some feedback");
    }

    /// p0 publishes SSRC 10 on its transport and "any" (no SSRC) on its own port; p1 publishes
    /// SSRC 20; p2 publishes nothing. p1 and p2 subscribe to all of p0's; p0 to p1's.
    fn feedback_room() -> Model {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        for i in 0..3 {
            m.add_participant("r", &format!("p{i}"), a(&format!("10.0.0.1:{}", 4000 + 2 * i)), a(&format!("10.0.1.{}:5000", i + 1))).unwrap();
        }
        m.publish("r", "p0", "v", StreamSpec { ssrc: Some(10), ..Default::default() }).unwrap();
        m.publish("r", "p0", "any", StreamSpec { local: Some(a("10.0.0.1:4100")), ..Default::default() }).unwrap();
        m.publish("r", "p1", "v", StreamSpec { ssrc: Some(20), ..Default::default() }).unwrap();
        for (who, publisher, stream) in [(1, 0, "v"), (1, 0, "any"), (2, 0, "v"), (2, 0, "any"), (0, 1, "v")] {
            m.subscribe("r", &format!("p{who}"), StreamRef { publisher: format!("p{publisher}"), stream: stream.into() }).unwrap();
        }
        m
    }

    #[test]
    fn a_consumers_rtcp_is_feedback_routed_by_the_ssrcs_it_receives() {
        use crate::feedback::build;
        let t = ForwardingTable::compile(&feedback_room(), 1);
        let p2 = t.feedback.get(&a("10.0.0.1:4004")).unwrap();
        assert_eq!(p2.source, a("10.0.1.3:5000"));
        // Only the stream with an SSRC can be named; the route leads back to where it came from.
        assert_eq!(p2.routes.len(), 1);
        let r = &p2.routes[0];
        assert_eq!((r.ssrc, r.from, r.to), (10, a("10.0.0.1:4000"), a("10.0.1.1:5000")));
        assert_eq!(t.feedback.len(), 3);

        let rr = crate::call_quality::build_report(7, None, &[]);
        let pli = [rr.clone(), build::pli(7, 10)].concat();
        // From the consumer: feedback, no stream to forward (p2 publishes nothing).
        assert!(matches!(t.classify(a("10.0.0.1:4004"), a("10.0.1.3:5000"), &pli), Verdict::Feedback { stream: None, .. }));
        // From anyone else: a stranger, not a stream that does not exist.
        assert!(matches!(t.classify(a("10.0.0.1:4004"), a("10.0.1.9:5000"), &pli), Verdict::Drop { reason: DropReason::Stranger, stream: None }));
        // Broken RTCP from the consumer is malformed; RTP to a subscriber's address no stream.
        assert!(matches!(t.classify(a("10.0.0.1:4004"), a("10.0.1.3:5000"), &pli[..10]), Verdict::Drop { reason: DropReason::Malformed, .. }));
        let rtp = build_rtp(0, 1, 0, 7, &[0; 20]);
        assert!(matches!(t.classify(a("10.0.0.1:4004"), a("10.0.1.3:5000"), &rtp), Verdict::Drop { reason: DropReason::NoStream, .. }));
        // p0 publishes and subscribes on one address: its SR picks its stream by SSRC, its RR
        // (or any RTCP of a stranger's SSRC) picks none.
        let sr = [crate::call_quality::build_report(10, Some(1), &[]), build::pli(10, 20)].concat();
        match t.classify(a("10.0.0.1:4000"), a("10.0.1.1:5000"), &sr) {
            Verdict::Feedback { entry, stream: Some(s) } => assert_eq!((entry.consumer.as_str(), s.label.as_str()), ("r/p0", "r/p0/v")),
            v => panic!("{v:?}"),
        }
        assert!(matches!(t.classify(a("10.0.0.1:4000"), a("10.0.1.1:5000"), &rr), Verdict::Feedback { stream: None, .. }));
        // Its RTP is forwarded as before.
        assert!(matches!(t.classify(a("10.0.0.1:4000"), a("10.0.1.1:5000"), &build_rtp(0, 1, 0, 10, &[0; 20])), Verdict::Forward(_)));
        assert!(t.is_local(a("10.0.0.1:4004")) && !t.is_local(a("10.0.0.1:4006")));

        // A consumer whose transport carries a non-RTP stream: what looks like RTCP there is
        // that stream's payload, forwarded, not feedback.
        let mut m = feedback_room();
        m.publish("r", "p2", "raw", StreamSpec { rtp: false, ..Default::default() }).unwrap();
        m.subscribe("r", "p1", StreamRef { publisher: "p2".into(), stream: "raw".into() }).unwrap();
        let t = ForwardingTable::compile(&m, 2);
        assert!(t.feedback.contains_key(&a("10.0.0.1:4004")) && t.feedback_at(a("10.0.0.1:4004")).is_none());
        assert!(matches!(t.classify(a("10.0.0.1:4004"), a("10.0.1.3:5000"), &pli), Verdict::Forward(e) if e.label == "r/p2/raw"));
    }
}
