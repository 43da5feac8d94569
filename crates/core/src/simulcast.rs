//! Simulcast: a publisher sends one stream in several layers (own SSRCs, low to high quality);
//! each consumer receives one layer at a time, on one SSRC, with continuous sequence numbers,
//! timestamps and VP8 picture ids, and moves to another layer only at a keyframe of it.
//!
//! [`LayerRewriter`] is one consumer's state (sans-I/O: time is passed in). Its rule for the
//! sequence numbers, which makes the rewrite exact under any switch schedule, loss and
//! reordering (`tests/simulcast_rewrite.rs` holds it to that):
//!
//! * what a consumer receives is a series of *segments*, each a run of one layer's sequence
//!   numbers `[start, highest]` mapped by a constant offset; a segment opens at the first packet
//!   of a keyframe and the next one continues right after the highest number sent so far, so the
//!   segments tile the consumer's sequence space with no hole and no overlap;
//! * a keyframe opens a segment only if it is the newest packet of its layer seen so far: had a
//!   later packet of that layer arrived first, it was not forwarded (not yet the consumer's
//!   layer), and the switch would leave a gap that was no loss; the switch waits for the next
//!   keyframe instead;
//! * a late (reordered) packet still goes out with the offset of the segment it belongs to, as
//!   long as that segment is among the last [`HISTORY`] and within [`DEDUPE_WINDOW`] of the
//!   newest number sent; packets outside every segment (an old layer's after the switch, the new
//!   layer's before its keyframe) are not the consumer's;
//! * a packet already sent (a duplicate from the network) is not sent again.
//!
//! So a consumer sees a gap only where a packet of its layer never reached the SFU (or came
//! later than the window), and never a duplicate.
//!
//! **Temporal layers** (VP8's TID, RFC 7741 4.2): a consumer may also take only the temporal
//! layers up to a ceiling of the layer it receives. Frames above it are dropped, and the numbers
//! they would have had are given to what follows, so the drop is no gap:
//!
//! * the ceiling in force changes only at the start of a frame that is the newest packet of its
//!   layer: down at any such frame; up only at a frame with the layer sync bit, to that frame's
//!   temporal layer (RFC 7741: it depends only on layer 0, while other frames of a layer not sent
//!   so far may refer to frames the receiver never got); and to the wanted ceiling at every
//!   switch keyframe; a frame is never split;
//! * the newest packet of a dropped frame *cuts* the current segment: its range ends right
//!   before that packet (what is still on its way of the kept frames before fills in), and the
//!   next kept packet of the layer opens a segment that maps the packet after the last one
//!   dropped (or the first packet of the picture after the last one dropped, when that is the
//!   packet: the dropped picture's lost tail takes no number) to the number and picture id the
//!   first one dropped would have had; timestamps and TL0PICIDX keep their offsets (frames of
//!   layer 0 are never dropped); a hole remains only for a lost packet the SFU could not tell
//!   was of a dropped frame (a whole picture lost, or lost packets just before a dropped one);
//! * only the newest packet of the layer is judged by its temporal layer; a late one goes
//!   where its number falls, like any late packet, because the numbers around it were given
//!   out already. So a drop never leaves a hole; the price, under reordering only, is that a
//!   packet of a frame above the ceiling that arrives after a later packet of its layer still
//!   goes out (a frame the receiver does not need, or cannot complete; its picture id may repeat
//!   a neighbour's).

use crate::rtp::RtpHeader;
use serde::{Deserialize, Serialize};

/// Layers a simulcast stream may have.
pub const MAX_LAYERS: usize = 4;
/// Segments remembered for late packets (one segment per switch).
pub const HISTORY: usize = 8;
/// How far behind the newest sequence number sent a late packet may be (duplicates are
/// recognised within it).
pub const DEDUPE_WINDOW: u16 = 64;
/// How far a segment's range reaches back from its highest number: `start` follows `highest`
/// within this, so the half-space comparisons of RTP sequence numbers hold however long a layer
/// runs (a wrap-around every 65,536 packets).
const SEGMENT_SPAN: u16 = 0x4000;
/// A keyframe of the wanted layer is asked for again if none arrived within this.
pub const KEYFRAME_RETRY_NS: u64 = crate::feedback::KEYFRAME_REQUEST_INTERVAL_NS;

/// The payload format, for finding keyframes (and VP8's descriptor, which is rewritten too).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    #[default]
    Vp8,
    H264,
}

impl Codec {
    /// Its name in SDP (`a=rtpmap`) and in the API, case-insensitively.
    pub fn parse(s: &str) -> Option<Codec> {
        match s.to_ascii_lowercase().as_str() {
            "vp8" => Some(Codec::Vp8),
            "h264" => Some(Codec::H264),
            _ => None,
        }
    }
}

/// A VP8 picture id (RFC 7741 4.2) as found in a packet: its value, its width (7 or 15 bits)
/// and where it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PictureId {
    pub value: u16,
    pub wide: bool,
    pub at: usize,
}

impl PictureId {
    fn mask(self) -> u16 {
        if self.wide {
            0x7fff
        } else {
            0x7f
        }
    }
}

/// A VP8 packet's temporal layer (RFC 7741 4.2: TID and the layer sync bit Y).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemporalIndex {
    pub tid: u8,
    /// The frame depends only on frames of temporal layer 0: higher layers may start here.
    pub sync: bool,
}

/// What the rewrite needs to know of one RTP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketInfo {
    pub sequence: u16,
    pub timestamp: u32,
    /// The first packet of a frame (VP8: S bit and partition 0); temporal ceilings change here.
    pub frame_start: bool,
    /// The first packet of a keyframe: a layer switch may happen here.
    pub keyframe_start: bool,
    pub picture_id: Option<PictureId>,
    /// VP8 TL0PICIDX and where it is.
    pub tl0picidx: Option<(u8, usize)>,
    pub temporal: Option<TemporalIndex>,
}

/// Read what the rewrite needs from an RTP packet of `codec`. None: not valid RTP.
pub fn inspect(codec: Codec, packet: &[u8]) -> Option<PacketInfo> {
    let h = RtpHeader::parse(packet).ok()?;
    let payload = &packet[h.payload_offset..h.payload_offset + h.payload_len];
    let mut info = PacketInfo {
        sequence: h.sequence,
        timestamp: h.timestamp,
        frame_start: false,
        keyframe_start: false,
        picture_id: None,
        tl0picidx: None,
        temporal: None,
    };
    match codec {
        Codec::Vp8 => {
            if let Some(d) = vp8_descriptor(payload) {
                info.frame_start = d.frame_start;
                info.keyframe_start = d.keyframe_start;
                info.temporal = d.temporal;
                info.picture_id = d.picture_id.map(|p| PictureId { at: p.at + h.payload_offset, ..p });
                info.tl0picidx = d.tl0picidx.map(|(v, at)| (v, at + h.payload_offset));
            }
        }
        Codec::H264 => info.keyframe_start = h264_keyframe_start(payload),
    }
    Some(info)
}

struct Vp8Descriptor {
    frame_start: bool,
    keyframe_start: bool,
    picture_id: Option<PictureId>,
    tl0picidx: Option<(u8, usize)>,
    temporal: Option<TemporalIndex>,
}

/// RFC 7741 4.2: the payload descriptor, and (4.3) the inverse key frame flag of the payload
/// header that follows it at the start of a frame's first partition.
fn vp8_descriptor(p: &[u8]) -> Option<Vp8Descriptor> {
    let b0 = *p.first()?;
    let (extended, start, partition) = (b0 & 0x80 != 0, b0 & 0x10 != 0, b0 & 0x07);
    let mut at = 1;
    let mut d = Vp8Descriptor { frame_start: start && partition == 0, keyframe_start: false, picture_id: None, tl0picidx: None, temporal: None };
    if extended {
        let x = *p.get(1)?;
        at = 2;
        if x & 0x80 != 0 {
            let m = *p.get(at)?;
            if m & 0x80 != 0 {
                let lo = *p.get(at + 1)?;
                d.picture_id = Some(PictureId { value: u16::from_be_bytes([m & 0x7f, lo]), wide: true, at });
                at += 2;
            } else {
                d.picture_id = Some(PictureId { value: m as u16, wide: false, at });
                at += 1;
            }
        }
        if x & 0x40 != 0 {
            d.tl0picidx = Some((*p.get(at)?, at));
            at += 1;
        }
        if x & 0x30 != 0 {
            let t = *p.get(at)?;
            if x & 0x20 != 0 {
                d.temporal = Some(TemporalIndex { tid: t >> 6, sync: t & 0x20 != 0 });
            }
            at += 1;
        }
    }
    d.keyframe_start = d.frame_start && p.get(at).is_some_and(|h| h & 1 == 0);
    Some(d)
}

/// NAL units of a STAP-A looked at for a keyframe (the kernel's loop has this bound too; an
/// encoder puts the SPS first, with its PPS and the IDR slice).
pub const STAP_A_SCAN: usize = 16;

/// RFC 6184: an IDR slice, or the SPS that precedes one (as libwebrtc counts keyframes), alone,
/// among the first [`STAP_A_SCAN`] of a STAP-A, or starting an FU-A.
fn h264_keyframe_start(p: &[u8]) -> bool {
    let key = |nal_type: u8| nal_type == 5 || nal_type == 7;
    let Some(&b0) = p.first() else { return false };
    match b0 & 0x1f {
        24 => {
            // STAP-A: (16-bit size, NAL unit)*
            let mut i = 1;
            for _ in 0..STAP_A_SCAN {
                if i + 2 >= p.len() {
                    return false;
                }
                let size = u16::from_be_bytes([p[i], p[i + 1]]) as usize;
                if size == 0 || i + 2 + size > p.len() {
                    return false;
                }
                if key(p[i + 2] & 0x1f) {
                    return true;
                }
                i += 2 + size;
            }
            false
        }
        28 => p.get(1).is_some_and(|fu| fu & 0x80 != 0 && key(fu & 0x1f)),
        t => key(t),
    }
}

/// `a` comes after `b` in RTP sequence order (RFC 3550 wrap-around).
pub fn seq_newer(a: u16, b: u16) -> bool {
    a != b && a.wrapping_sub(b) < 0x8000
}

/// The header values a forwarded packet goes out with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rewrite {
    pub ssrc: u32,
    pub sequence: u16,
    pub timestamp: u32,
    pub picture_id: Option<u16>,
    pub tl0picidx: Option<u8>,
}

impl Rewrite {
    /// Write these values into `packet`, which `info` was read from.
    pub fn apply(&self, info: &PacketInfo, packet: &mut [u8]) {
        packet[2..4].copy_from_slice(&self.sequence.to_be_bytes());
        packet[4..8].copy_from_slice(&self.timestamp.to_be_bytes());
        packet[8..12].copy_from_slice(&self.ssrc.to_be_bytes());
        if let (Some(p), Some(v)) = (info.picture_id, self.picture_id) {
            if p.wide {
                packet[p.at] = 0x80 | (v >> 8) as u8 & 0x7f;
                packet[p.at + 1] = v as u8;
            } else {
                packet[p.at] = v as u8 & 0x7f;
            }
        }
        if let (Some((_, at)), Some(v)) = (info.tl0picidx, self.tl0picidx) {
            packet[at] = v;
        }
    }
}

/// Why a packet of the stream does not go to this consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Skip {
    /// Of a layer (or a stretch of one) the consumer does not receive.
    OtherLayer,
    /// No keyframe of the wanted layer yet: the consumer has not started.
    WaitingKeyframe,
    /// Sent to it already.
    Duplicate,
    /// Later than [`DEDUPE_WINDOW`] or [`HISTORY`] allow.
    Late,
    /// It wants no layer.
    Paused,
    /// Of a temporal layer above its ceiling.
    TemporalLayer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Forward(Rewrite),
    Skip(Skip),
}

/// One run of one layer's sequence numbers, mapped by constant offsets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Segment {
    pub layer: u8,
    pub start: u16,
    pub highest: u16,
    pub seq_offset: u16,
    pub ts_offset: u32,
    pub pic_offset: u16,
    pub tl0_offset: u8,
}

/// No temporal ceiling: every temporal layer (the kernel's `MP_TEMPORAL_ALL`).
pub const ALL_TEMPORAL: u8 = 0xff;

/// A segment cut by a dropped frame (see the module docs): what the next kept packet continues
/// from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cut {
    /// The consumer's number the first dropped packet would have had.
    pub next_seq: u16,
    /// The publisher's number after the newest dropped packet.
    pub resume_seq: u16,
    /// With picture ids: the consumer's id the first dropped frame would have had, and the
    /// publisher's id after the newest dropped frame.
    pub pictures: Option<(u16, u16)>,
}

impl Segment {
    /// Extend its range to `seq` when that is newer than its highest, its start following within
    /// [`SEGMENT_SPAN`].
    fn reach(&mut self, seq: u16) {
        if seq_newer(seq, self.highest) {
            self.highest = seq;
            if self.highest.wrapping_sub(self.start) > SEGMENT_SPAN {
                self.start = self.highest.wrapping_sub(SEGMENT_SPAN);
            }
        }
    }
}

/// What the packets a [`LayerRewriter`] saw made of it: everything but its identity (SSRC, clock
/// rate) and the keyframe requests the SFU makes for it. The eBPF plane keeps exactly this per
/// consumer in a map (`struct mp_layer_state`) and runs the same rules on it in the kernel;
/// user space reads it back into a rewriter to map NACKs and sender reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RewriterState {
    pub target: Option<u8>,
    /// Newest first, at most [`HISTORY`].
    pub segments: Vec<Segment>,
    pub open: bool,
    pub newest: [Option<u16>; MAX_LAYERS],
    pub top_seq: u16,
    pub top_ts: u32,
    pub top_pic: u16,
    pub top_tl0: u8,
    pub top_at_ns: u64,
    pub sent: u64,
    pub forwarded: u64,
    pub switches: u64,
    pub duplicates: u64,
    pub late: u64,
    /// The temporal ceiling wanted and the one in force ([`ALL_TEMPORAL`]: none).
    pub temporal_target: u8,
    pub temporal_current: u8,
    pub cut: Option<Cut>,
    pub temporal_dropped: u64,
}

/// What one consumer's rewrite did, for its counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RewriteStats {
    pub forwarded: u64,
    /// Layer switches (the first layer a consumer starts on is not one).
    pub switches: u64,
    /// Keyframes of a wanted layer asked for ([`LayerRewriter::keyframe_wanted`]).
    pub keyframe_requests: u64,
    pub duplicates: u64,
    pub late: u64,
    /// Packets above its temporal ceiling, not sent.
    #[serde(default)]
    pub temporal_dropped: u64,
}

/// One consumer of a simulcast stream: which layer it gets and how that layer's packets are
/// renumbered for it.
#[derive(Debug, Clone)]
pub struct LayerRewriter {
    ssrc: u32,
    clock_rate: u32,
    target: Option<u8>,
    /// Newest first; `segments[0]` is the current one while `open`.
    segments: Vec<Segment>,
    /// The newest segment takes new packets (false before the first keyframe and while paused:
    /// a resumed consumer starts a new segment at a keyframe, right after what it had).
    open: bool,
    /// The newest sequence number seen per layer (forwarded or not).
    newest: [Option<u16>; MAX_LAYERS],
    /// The packet sent with the highest sequence number: its numbers, and when it was sent.
    top_seq: u16,
    top_ts: u32,
    top_pic: u16,
    top_tl0: u8,
    top_at_ns: u64,
    /// Bit i: sequence number `top_seq - i` was sent.
    sent: u64,
    /// The highest temporal layer it wants of the layer it receives, and the one in force.
    temporal_target: u8,
    temporal_current: u8,
    /// The current segment was cut by a dropped frame.
    cut: Option<Cut>,
    keyframe_asked_ns: Option<u64>,
    pub stats: RewriteStats,
}

impl LayerRewriter {
    /// A consumer that receives on `ssrc`; `clock_rate` (Hz) spaces the timestamps across a switch.
    pub fn new(ssrc: u32, clock_rate: u32) -> LayerRewriter {
        LayerRewriter {
            ssrc,
            clock_rate: if clock_rate == 0 { 90_000 } else { clock_rate },
            target: None,
            segments: Vec::with_capacity(HISTORY),
            open: false,
            newest: [None; MAX_LAYERS],
            top_seq: 0,
            top_ts: 0,
            top_pic: 0,
            top_tl0: 0,
            top_at_ns: 0,
            sent: 0,
            temporal_target: ALL_TEMPORAL,
            temporal_current: ALL_TEMPORAL,
            cut: None,
            keyframe_asked_ns: None,
            stats: RewriteStats::default(),
        }
    }

    /// Its packet-driven state ([`RewriterState`]).
    pub fn state(&self) -> RewriterState {
        RewriterState {
            target: self.target,
            segments: self.segments.clone(),
            open: self.open,
            newest: self.newest,
            top_seq: self.top_seq,
            top_ts: self.top_ts,
            top_pic: self.top_pic,
            top_tl0: self.top_tl0,
            top_at_ns: self.top_at_ns,
            sent: self.sent,
            forwarded: self.stats.forwarded,
            switches: self.stats.switches,
            duplicates: self.stats.duplicates,
            late: self.stats.late,
            temporal_target: self.temporal_target,
            temporal_current: self.temporal_current,
            cut: self.cut,
            temporal_dropped: self.stats.temporal_dropped,
        }
    }

    /// Take `s` as its state (the kernel's copy of it), keeping its identity and its keyframe
    /// requests. A target that changes resets the keyframe request interval, as
    /// [`LayerRewriter::set_target`] does.
    pub fn load_state(&mut self, s: RewriterState) {
        if s.target != self.target {
            self.keyframe_asked_ns = None;
        }
        self.target = s.target;
        self.segments = s.segments;
        self.segments.truncate(HISTORY);
        self.open = s.open;
        self.newest = s.newest;
        (self.top_seq, self.top_ts, self.top_pic, self.top_tl0, self.top_at_ns, self.sent) = (s.top_seq, s.top_ts, s.top_pic, s.top_tl0, s.top_at_ns, s.sent);
        (self.stats.forwarded, self.stats.switches, self.stats.duplicates, self.stats.late) = (s.forwarded, s.switches, s.duplicates, s.late);
        (self.temporal_target, self.temporal_current, self.cut, self.stats.temporal_dropped) =
            (s.temporal_target, s.temporal_current, s.cut, s.temporal_dropped);
    }

    /// The clock rate the timestamps across a switch are spaced with (90 kHz when unknown).
    pub fn clock_rate(&self) -> u32 {
        self.clock_rate
    }

    /// The layer it receives now (None: not started).
    pub fn current(&self) -> Option<u8> {
        self.segments.first().filter(|_| self.open).map(|s| s.layer)
    }

    /// The layer it should receive (None: none, it is paused).
    pub fn target(&self) -> Option<u8> {
        self.target
    }

    pub fn ssrc(&self) -> u32 {
        self.ssrc
    }

    /// Want `layer` from its next keyframe on (the current layer goes on until then).
    pub fn set_target(&mut self, layer: Option<u8>) {
        if self.target != layer {
            self.target = layer;
            self.keyframe_asked_ns = None;
            if layer.is_none() {
                self.open = false;
            }
        }
    }

    /// Take temporal layers up to `ceiling` (None: all) of the layer it receives, from the next
    /// frame where that is safe (module docs).
    pub fn set_temporal(&mut self, ceiling: Option<u8>) {
        self.temporal_target = ceiling.map_or(ALL_TEMPORAL, |c| c.min(ALL_TEMPORAL - 1));
    }

    /// The temporal ceiling wanted (None: all).
    pub fn temporal_target(&self) -> Option<u8> {
        (self.temporal_target != ALL_TEMPORAL).then_some(self.temporal_target)
    }

    /// The temporal ceiling in force (None: all).
    pub fn temporal_current(&self) -> Option<u8> {
        (self.temporal_current != ALL_TEMPORAL).then_some(self.temporal_current)
    }

    /// The layer whose keyframe should be asked for now: the wanted one while the consumer does
    /// not receive it, at most once per [`KEYFRAME_RETRY_NS`].
    pub fn keyframe_wanted(&mut self, now_ns: u64) -> Option<u8> {
        let target = self.target?;
        if self.current() == Some(target) || self.keyframe_asked_ns.is_some_and(|at| now_ns.saturating_sub(at) < KEYFRAME_RETRY_NS) {
            return None;
        }
        self.keyframe_asked_ns = Some(now_ns);
        self.stats.keyframe_requests += 1;
        Some(target)
    }

    /// Decide on one packet of `layer` arriving at `now_ns`.
    pub fn on_packet(&mut self, layer: u8, info: &PacketInfo, now_ns: u64) -> Decision {
        let Some(newest) = self.newest.get_mut(layer as usize) else { return Decision::Skip(Skip::OtherLayer) };
        let s = info.sequence;
        let is_newest = newest.is_none_or(|n| seq_newer(s, n));
        if is_newest {
            *newest = Some(s);
        }
        if self.target == Some(layer) && self.current() != Some(layer) && info.keyframe_start && is_newest {
            self.open_segment(layer, info, now_ns);
            return self.emit(0, info, now_ns);
        }
        // Temporal layers are decided on the newest packets of the layer received; a late one
        // goes where its number falls (the numbers around it are given out already).
        if is_newest && self.current() == Some(layer) {
            if info.frame_start {
                self.follow_temporal_target(info);
            }
            if info.temporal.is_some_and(|t| t.tid > self.temporal_current) {
                self.cut_segment(info);
                self.stats.temporal_dropped += 1;
                return Decision::Skip(Skip::TemporalLayer);
            }
            if self.cut.is_some() {
                self.continue_segment(info);
            }
            // The newest of the layer received extends the current segment (even past a jump
            // in the publisher's numbering of more than half the sequence space from its start).
            return self.emit(0, info, now_ns);
        }
        for i in 0..self.segments.len() {
            let g = self.segments[i];
            if g.layer != layer {
                continue;
            }
            let after_start = !seq_newer(g.start, s);
            let open = i == 0 && self.open && self.cut.is_none();
            let belongs = if open { after_start } else { after_start && !seq_newer(s, g.highest) };
            if belongs {
                return self.emit(i, info, now_ns);
            }
        }
        // (Paused: late packets of what it had still fill their places above; nothing new goes.)
        Decision::Skip(match (self.target, self.segments.is_empty()) {
            (None, _) => Skip::Paused,
            (_, true) => Skip::WaitingKeyframe,
            _ => Skip::OtherLayer,
        })
    }

    /// At the start of a frame that is the newest of the layer received: the temporal ceiling
    /// goes down at once, and up only at a sync frame, to that frame's layer: a frame of a layer
    /// not sent so far may refer to its layer's earlier frames (so may later ones), which the
    /// receiver never got; a sync frame refers only to layer 0 (RFC 7741 4.2).
    fn follow_temporal_target(&mut self, info: &PacketInfo) {
        match info.temporal {
            // No temporal layers: nothing to wait for.
            None => self.temporal_current = self.temporal_target,
            Some(_) if self.temporal_target < self.temporal_current => self.temporal_current = self.temporal_target,
            Some(t) if t.sync && t.tid > self.temporal_current && t.tid <= self.temporal_target => self.temporal_current = t.tid,
            Some(_) => {}
        }
    }

    /// The newest packet of a dropped frame: the current segment ends before it.
    fn cut_segment(&mut self, info: &PacketInfo) {
        let s = info.sequence;
        let g = &mut self.segments[0];
        let cut = self.cut.get_or_insert_with(|| {
            g.reach(s.wrapping_sub(1));
            let pictures = info.picture_id.map(|p| (p.value.wrapping_add(g.pic_offset) & 0x7fff, 0));
            Cut { next_seq: s.wrapping_add(g.seq_offset), resume_seq: 0, pictures }
        });
        cut.resume_seq = s.wrapping_add(1);
        if let (Some((_, resume)), Some(p)) = (cut.pictures.as_mut(), info.picture_id) {
            *resume = p.value.wrapping_add(1) & 0x7fff;
        }
    }

    /// The first kept packet after a cut: a segment of the same layer that maps the packet after
    /// the last one dropped to the first one's number.
    fn continue_segment(&mut self, info: &PacketInfo) {
        let (Some(mut cut), Some(&g)) = (self.cut.take(), self.segments.first()) else { return };
        // The first packet of the picture after the last one dropped: what lies between was the
        // rest of that picture (dropped too, or lost on the way), no number of the consumer's.
        if let (true, Some((_, resume_pic)), Some(p)) = (info.frame_start, cut.pictures, info.picture_id) {
            if p.value & p.mask() == resume_pic & p.mask() {
                cut.resume_seq = info.sequence;
            }
        }
        let pic_offset = cut.pictures.map_or(g.pic_offset, |(next, resume)| next.wrapping_sub(resume) & 0x7fff);
        let c = Segment { start: cut.resume_seq, highest: cut.resume_seq, seq_offset: cut.next_seq.wrapping_sub(cut.resume_seq), pic_offset, ..g };
        self.segments.insert(0, c);
        self.segments.truncate(HISTORY);
    }

    fn open_segment(&mut self, layer: u8, info: &PacketInfo, now_ns: u64) {
        let started = !self.segments.is_empty();
        // After a cut the numbers up to the first dropped one are taken (kept packets on their way).
        let (top_seq, top_pic) = match self.cut.take() {
            Some(c) => (c.next_seq.wrapping_sub(1), c.pictures.map_or(self.top_pic, |(next, _)| next.wrapping_sub(1) & 0x7fff)),
            None => (self.top_seq, self.top_pic),
        };
        let g = if started {
            let ticks = (now_ns.saturating_sub(self.top_at_ns) as u128 * self.clock_rate as u128 / 1_000_000_000).clamp(1, u32::MAX as u128) as u32;
            Segment {
                layer,
                start: info.sequence,
                highest: info.sequence,
                seq_offset: top_seq.wrapping_add(1).wrapping_sub(info.sequence),
                ts_offset: self.top_ts.wrapping_add(ticks).wrapping_sub(info.timestamp),
                pic_offset: info.picture_id.map_or(0, |p| top_pic.wrapping_add(1).wrapping_sub(p.value) & 0x7fff),
                tl0_offset: info.tl0picidx.map_or(0, |(v, _)| self.top_tl0.wrapping_add(1).wrapping_sub(v)),
            }
        } else {
            Segment { layer, start: info.sequence, highest: info.sequence, seq_offset: 0, ts_offset: 0, pic_offset: 0, tl0_offset: 0 }
        };
        if started {
            self.stats.switches += 1;
        }
        self.segments.insert(0, g);
        self.segments.truncate(HISTORY);
        self.open = true;
        // A keyframe: every temporal layer can start here.
        self.temporal_current = self.temporal_target;
    }

    fn emit(&mut self, i: usize, info: &PacketInfo, now_ns: u64) -> Decision {
        let g = self.segments[i];
        let out = info.sequence.wrapping_add(g.seq_offset);
        let first = self.stats.forwarded == 0;
        let behind = self.top_seq.wrapping_sub(out);
        let newer = !first && seq_newer(out, self.top_seq);
        // Only the current segment extends the consumer's numbering (an older one's range is
        // closed; pruning keeps it from coming back when its layer wraps around), and the
        // newest one, paused, into the numbers a cut kept for packets still on their way.
        let kept_by_cut = i == 0 && self.cut.is_some_and(|c| seq_newer(c.next_seq, out));
        let extends = (i == 0 && self.open) || kept_by_cut;
        if newer && !extends {
            self.stats.late += 1;
            return Decision::Skip(Skip::Late);
        }
        if !first && !newer {
            if behind >= DEDUPE_WINDOW {
                self.stats.late += 1;
                return Decision::Skip(Skip::Late);
            }
            if self.sent & (1 << behind) != 0 {
                self.stats.duplicates += 1;
                return Decision::Skip(Skip::Duplicate);
            }
            self.sent |= 1 << behind;
        }
        let rewrite = Rewrite {
            ssrc: self.ssrc,
            sequence: out,
            timestamp: info.timestamp.wrapping_add(g.ts_offset),
            picture_id: info.picture_id.map(|p| p.value.wrapping_add(g.pic_offset) & p.mask()),
            tl0picidx: info.tl0picidx.map(|(v, _)| v.wrapping_add(g.tl0_offset)),
        };
        if first || newer {
            let ahead = out.wrapping_sub(self.top_seq);
            self.sent = if first || ahead >= 64 { 1 } else { (self.sent << ahead) | 1 };
            self.top_seq = out;
            self.top_ts = rewrite.timestamp;
            // Kept at 15 bits: a 7-bit id continues from its low bits.
            self.top_pic = rewrite.picture_id.map_or(self.top_pic, |p| p & 0x7fff);
            self.top_tl0 = rewrite.tl0picidx.unwrap_or(self.top_tl0);
            self.top_at_ns = now_ns;
            // Older segments all of whose numbers are out of the window can take nothing more.
            let top = self.top_seq;
            if let Some(k) = self.segments.iter().skip(1).position(|o| top.wrapping_sub(o.highest.wrapping_add(o.seq_offset)) >= DEDUPE_WINDOW) {
                self.segments.truncate(k + 1);
            }
        }
        self.segments[i].reach(info.sequence);
        self.stats.forwarded += 1;
        Decision::Forward(rewrite)
    }

    /// The layer and sequence number of what went out as `out_seq` (a NACK names the
    /// consumer's numbers; the publisher knows its own). None: nothing within the remembered
    /// segments went out as that.
    pub fn original(&self, out_seq: u16) -> Option<(u8, u16)> {
        self.segments.iter().find_map(|g| {
            let s = out_seq.wrapping_sub(g.seq_offset);
            (!seq_newer(g.start, s) && !seq_newer(s, g.highest)).then_some((g.layer, s))
        })
    }

    /// Rewrite a sender report of `layer` (an RTCP compound starting with one) for this
    /// consumer: its SSRC, and its RTP timestamp by the current segment's offset. False: not
    /// about the layer it receives, not for it.
    pub fn rewrite_sender_report(&self, layer: u8, rtcp: &mut [u8]) -> bool {
        let Some(g) = self.segments.first().filter(|g| self.open && g.layer == layer) else { return false };
        // Where each SDES with a chunk starts (its first chunk names the sender by the same SSRC).
        let sdes: Vec<usize> = match crate::rtp::parse_rtcp_compound(rtcp) {
            Ok(packets) if packets[0].packet_type == 200 && packets[0].bytes.len() >= 28 => {
                let mut at = 0;
                let mut out = Vec::new();
                for p in &packets {
                    if p.packet_type == 202 && p.count >= 1 {
                        out.push(at);
                    }
                    at += p.bytes.len();
                }
                out
            }
            _ => return false,
        };
        rtcp[4..8].copy_from_slice(&self.ssrc.to_be_bytes());
        let ts = u32::from_be_bytes(rtcp[16..20].try_into().unwrap()).wrapping_add(g.ts_offset);
        rtcp[16..20].copy_from_slice(&ts.to_be_bytes());
        for at in sdes {
            rtcp[at + 4..at + 8].copy_from_slice(&self.ssrc.to_be_bytes());
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rtp::build_rtp;

    /// A VP8 packet with a 15-bit picture id and TL0PICIDX; `key`: the start of a keyframe.
    fn vp8(seq: u16, ts: u32, ssrc: u32, pic: u16, tl0: u8, start: bool, key: bool) -> Vec<u8> {
        let b0 = 0x80 | if start { 0x10 } else { 0 };
        let payload = [b0, 0xc0, 0x80 | (pic >> 8) as u8, pic as u8, tl0, if key { 0x10 } else { 0x11 }, 0, 0];
        build_rtp(96, seq, ts, ssrc, &payload)
    }

    #[test]
    fn finds_vp8_keyframes_and_descriptor_fields() {
        let i = inspect(Codec::Vp8, &vp8(7, 900, 1, 0x1234, 9, true, true)).unwrap();
        assert!(i.keyframe_start);
        assert_eq!(i.picture_id, Some(PictureId { value: 0x1234, wide: true, at: 14 }));
        assert_eq!(i.tl0picidx, Some((9, 16)));
        assert!(!inspect(Codec::Vp8, &vp8(7, 900, 1, 5, 9, true, false)).unwrap().keyframe_start);
        assert!(!inspect(Codec::Vp8, &vp8(7, 900, 1, 5, 9, false, true)).unwrap().keyframe_start);
        // No extension: S bit, partition 0, P bit clear.
        assert!(inspect(Codec::Vp8, &build_rtp(96, 1, 1, 1, &[0x10, 0x50])).unwrap().keyframe_start);
        // Truncated descriptors are not keyframes and do not panic.
        for n in 0..5 {
            assert!(!inspect(Codec::Vp8, &build_rtp(96, 1, 1, 1, &[0x90, 0xf0, 0x80, 0][..n])).unwrap().keyframe_start);
        }
    }

    #[test]
    fn finds_h264_keyframes() {
        let k = |p: &[u8]| h264_keyframe_start(p);
        assert!(k(&[0x65, 1])); // IDR
        assert!(k(&[0x67, 1])); // SPS
        assert!(!k(&[0x41, 1])); // non-IDR slice
        assert!(k(&[0x78, 0, 2, 0x67, 1, 0, 2, 0x68, 1])); // STAP-A: SPS, PPS
        assert!(!k(&[0x78, 0, 9, 0x67])); // STAP-A with a size past the end
        assert!(k(&[0x7c, 0x85])); // FU-A start of an IDR
        assert!(!k(&[0x7c, 0x05])); // FU-A middle of an IDR
        assert!(!k(&[]));
    }

    #[test]
    fn rewrite_writes_every_field_back() {
        let mut p = vp8(7, 900, 1, 0x1234, 9, true, true);
        let i = inspect(Codec::Vp8, &p).unwrap();
        let r = Rewrite { ssrc: 42, sequence: 65535, timestamp: 3, picture_id: Some(0x7fff), tl0picidx: Some(255) };
        r.apply(&i, &mut p);
        let j = inspect(Codec::Vp8, &p).unwrap();
        assert_eq!((j.sequence, j.timestamp, j.picture_id.unwrap().value, j.tl0picidx.unwrap().0), (65535, 3, 0x7fff, 255));
        assert_eq!(RtpHeader::parse(&p).unwrap().ssrc, 42);
        assert!(j.keyframe_start);
    }

    fn info(seq: u16, ts: u32, pic: u16, key: bool) -> PacketInfo {
        inspect(Codec::Vp8, &vp8(seq, ts, 1, pic, 0, true, key)).unwrap()
    }

    fn fwd(d: Decision) -> Rewrite {
        match d {
            Decision::Forward(r) => r,
            d => panic!("expected a forward, got {d:?}"),
        }
    }

    #[test]
    fn starts_at_a_keyframe_and_switches_on_the_next_of_the_target() {
        let mut c = LayerRewriter::new(0xabc, 90_000);
        c.set_target(Some(0));
        assert_eq!(c.keyframe_wanted(0), Some(0));
        assert_eq!(c.keyframe_wanted(1), None, "asked once per interval");
        assert_eq!(c.on_packet(0, &info(100, 1000, 5, false), 0), Decision::Skip(Skip::WaitingKeyframe));
        let r = fwd(c.on_packet(0, &info(101, 1000, 6, true), 0));
        assert_eq!((r.ssrc, r.sequence, r.timestamp, r.picture_id), (0xabc, 101, 1000, Some(6)));
        fwd(c.on_packet(0, &info(102, 4000, 7, false), 33_000_000));
        c.set_target(Some(2));
        assert_eq!(c.keyframe_wanted(40_000_000), Some(2));
        // Layer 2's non-key packets are not the consumer's yet; layer 0 goes on.
        assert_eq!(c.on_packet(2, &info(9000, 50, 300, false), 40_000_000), Decision::Skip(Skip::OtherLayer));
        fwd(c.on_packet(0, &info(103, 7000, 8, false), 66_000_000));
        // Layer 2's keyframe: sequence, timestamp and picture id continue from layer 0's.
        let r = fwd(c.on_packet(2, &info(9001, 90_000, 301, true), 76_000_000));
        assert_eq!((r.sequence, r.timestamp, r.picture_id), (104, 7000 + 900, Some(9)));
        assert_eq!(c.current(), Some(2));
        assert_eq!(c.stats.switches, 1);
        // A late layer-0 packet of its segment still goes; a later one does not.
        let mut c2 = c.clone();
        assert_eq!(c2.on_packet(0, &info(104, 7000, 9, false), 77_000_000), Decision::Skip(Skip::OtherLayer));
        assert_eq!(fwd(c2.on_packet(2, &info(9002, 93_000, 302, false), 78_000_000)).sequence, 105);
        assert_eq!(c.on_packet(2, &info(9001, 90_000, 301, true), 80_000_000), Decision::Skip(Skip::Duplicate));
        // NACKed numbers go back to the layer and number they were sent from.
        assert_eq!(c.original(102), Some((0, 102)));
        assert_eq!(c.original(104), Some((2, 9001)));
        assert_eq!(c.original(105), None, "not sent yet");
        assert_eq!(c.original(100), None, "before the consumer started");
        // Paused: nothing goes, the layers are still watched.
        c.set_target(None);
        assert_eq!(c.on_packet(2, &info(9003, 96_000, 303, false), 81_000_000), Decision::Skip(Skip::Paused));
        assert_eq!(c.keyframe_wanted(90_000_000), None);
    }

    #[test]
    fn a_keyframe_that_is_not_the_newest_of_its_layer_does_not_switch() {
        let mut c = LayerRewriter::new(1, 90_000);
        c.set_target(Some(0));
        fwd(c.on_packet(0, &info(10, 0, 0, true), 0));
        c.set_target(Some(1));
        // The keyframe's second packet overtook its first: switching at the first would lose
        // the second (it was not the consumer's when it came).
        assert_eq!(c.on_packet(1, &info(501, 0, 0, false), 1), Decision::Skip(Skip::OtherLayer));
        assert_eq!(c.on_packet(1, &info(500, 0, 0, true), 2), Decision::Skip(Skip::OtherLayer));
        assert_eq!(c.current(), Some(0));
        fwd(c.on_packet(1, &info(510, 0, 0, true), 3));
        assert_eq!(c.current(), Some(1));
    }

    /// A VP8 packet with a 15-bit picture id, TL0PICIDX and a temporal layer.
    fn vp8t(seq: u16, pic: u16, tl0: u8, tid: u8, sync: bool, start: bool, key: bool) -> PacketInfo {
        let b0 = 0x80 | if start { 0x10 } else { 0 };
        let t = tid << 6 | if sync { 0x20 } else { 0 };
        let payload = [b0, 0xe0, 0x80 | (pic >> 8) as u8, pic as u8, tl0, t, if key { 0x10 } else { 0x11 }, 0];
        inspect(Codec::Vp8, &build_rtp(96, seq, 3000 * pic as u32, 1, &payload)).unwrap()
    }

    #[test]
    fn reads_the_temporal_layer_and_frame_start() {
        let i = vp8t(1, 5, 0, 2, true, true, false);
        assert_eq!(i.temporal, Some(TemporalIndex { tid: 2, sync: true }));
        assert!(i.frame_start && !i.keyframe_start);
        assert!(!vp8t(1, 5, 0, 1, false, false, false).frame_start);
        // K without T: a key index, no temporal layer.
        let p = build_rtp(96, 1, 1, 1, &[0x90, 0x10, 0x05, 0x10]);
        let i = inspect(Codec::Vp8, &p).unwrap();
        assert_eq!(i.temporal, None);
        assert!(i.keyframe_start);
    }

    #[test]
    fn a_temporal_ceiling_drops_whole_frames_and_leaves_no_gap() {
        // L1T3: frames of temporal layers 0,2,1,2 repeating; two packets a frame.
        let tids = [0u8, 2, 1, 2];
        let mut c = LayerRewriter::new(9, 90_000);
        c.set_target(Some(0));
        c.set_temporal(Some(0));
        let mut sent = Vec::new();
        let mut seq = 1000u16;
        for f in 0..16u16 {
            let tid = tids[f as usize % 4];
            let tl0 = (f / 4) as u8;
            if f == 8 {
                // Up to layer 1 from here: the frame now is of layer 0, so at once.
                c.set_temporal(Some(1));
            }
            if f == 13 {
                // Down to layer 0 at the next frame (layer 2's frame 13 was already decided).
                c.set_temporal(Some(0));
            }
            // As libwebrtc marks them: the frames of layers 2 and 1 right after layer 0 refer
            // only to it.
            let sync = f % 4 == 1 || f % 4 == 2;
            for k in 0..2 {
                let d = c.on_packet(0, &vp8t(seq, 100 + f, tl0, tid, sync, k == 0, f == 0 && k == 0), f as u64 * 33_000_000);
                if let Decision::Forward(r) = d {
                    sent.push((f, r.sequence, r.picture_id.unwrap(), r.tl0picidx.unwrap(), r.timestamp));
                } else {
                    assert_eq!(d, Decision::Skip(Skip::TemporalLayer), "frame {f}");
                }
                seq = seq.wrapping_add(1);
            }
        }
        let frames: Vec<u16> = sent.iter().step_by(2).map(|s| s.0).collect();
        // Before 10 layer 0 only; from 10 (a layer-1 sync frame) layers 0 and 1; from 13 layer 0.
        assert_eq!(frames, vec![0, 4, 8, 10, 12]);
        assert!(sent.windows(2).all(|w| w[1].1 == w[0].1.wrapping_add(1)), "no gap, no duplicate: {sent:?}");
        let pics: Vec<u16> = sent.iter().step_by(2).map(|s| s.2).collect();
        assert_eq!(pics, vec![100, 101, 102, 103, 104], "picture ids continue over dropped frames");
        assert!(sent.iter().all(|s| s.3 == (s.0 / 4) as u8), "TL0PICIDX is not touched");
        assert!(sent.iter().all(|s| s.4 == 3000 * (100 + s.0) as u32), "timestamps are not touched");
        assert_eq!(c.stats.temporal_dropped, 22);
        assert_eq!(c.stats.switches, 0);
        // A NACK of what followed a cut maps to the publisher's number.
        assert_eq!(c.original(sent[2].1), Some((0, 1008)));
    }

    #[test]
    fn a_ceiling_rises_only_at_sync_frames_one_layer_at_a_time() {
        let mut c = LayerRewriter::new(9, 90_000);
        c.set_target(Some(0));
        c.set_temporal(Some(0));
        fwd(c.on_packet(0, &vp8t(1, 1, 0, 0, false, true, true), 0));
        c.set_temporal(None);
        // A layer-2 frame without sync may refer to layer-2 and layer-1 frames never sent.
        assert_eq!(c.on_packet(0, &vp8t(2, 2, 0, 2, false, true, false), 1), Decision::Skip(Skip::TemporalLayer));
        // Nor does a layer-0 frame open the higher layers (theirs may refer past it).
        fwd(c.on_packet(0, &vp8t(3, 3, 1, 0, false, true, false), 2));
        assert_eq!(c.temporal_current(), Some(0));
        // A layer-1 sync frame: layer 1 from here on, not yet layer 2.
        let r = fwd(c.on_packet(0, &vp8t(4, 4, 1, 1, true, true, false), 3));
        assert_eq!((r.sequence, r.picture_id), (3, Some(3)), "the dropped frame took no number");
        assert_eq!(c.temporal_current(), Some(1));
        assert_eq!(c.on_packet(0, &vp8t(5, 5, 1, 2, false, true, false), 4), Decision::Skip(Skip::TemporalLayer));
        // A layer-2 sync frame: every layer.
        assert_eq!(fwd(c.on_packet(0, &vp8t(6, 6, 1, 2, true, true, false), 5)).sequence, 4);
        assert_eq!(c.temporal_current(), Some(2));
        // A reordered packet of a dropped frame lands where its number falls: between the cuts.
        assert_eq!(c.on_packet(0, &vp8t(2, 2, 0, 2, false, true, false), 6), Decision::Skip(Skip::OtherLayer));
    }

    #[test]
    fn the_lost_tail_of_a_dropped_picture_takes_no_number() {
        let mut c = LayerRewriter::new(9, 90_000);
        c.set_target(Some(0));
        c.set_temporal(Some(0));
        let a = fwd(c.on_packet(0, &vp8t(8, 1, 0, 0, false, true, true), 0)).sequence;
        // Layer-2 picture 2 in packets 9 and 10; 10 is lost. Picture 3 starts at 11.
        assert_eq!(c.on_packet(0, &vp8t(9, 2, 0, 2, false, true, false), 1), Decision::Skip(Skip::TemporalLayer));
        let r = fwd(c.on_packet(0, &vp8t(11, 3, 1, 0, false, true, false), 2));
        assert_eq!((r.sequence, r.picture_id), (a.wrapping_add(1), Some(2)));
        // Had picture 3's first packet (11) been lost too, 12 could not tell where picture 2
        // ended: 10 and 11 keep numbers (a hole for each, as for any loss).
        let mut c = LayerRewriter::new(9, 90_000);
        c.set_target(Some(0));
        c.set_temporal(Some(0));
        fwd(c.on_packet(0, &vp8t(8, 1, 0, 0, false, true, true), 0));
        c.on_packet(0, &vp8t(9, 2, 0, 2, false, true, false), 1);
        assert_eq!(fwd(c.on_packet(0, &vp8t(12, 3, 1, 0, false, false, false), 2)).sequence, a.wrapping_add(3));
    }

    /// CI's case (proptest regression b19f959c): a kept packet still on its way when a frame is
    /// dropped has its number kept by the cut; it arrives after the consumer paused and must
    /// still go out there, or the resumed segment leaves a hole no loss made.
    #[test]
    fn a_late_packet_before_a_cut_fills_its_number_while_paused() {
        let mut c = LayerRewriter::new(9, 90_000);
        c.set_target(Some(0));
        c.set_temporal(Some(0));
        assert_eq!(fwd(c.on_packet(0, &vp8t(22, 1, 0, 0, false, true, true), 0)).sequence, 22);
        // Picture 2 (layer 0) is 23, still on its way; picture 3 (layer 1) in 24 and 25 is dropped.
        assert_eq!(c.on_packet(0, &vp8t(24, 3, 1, 1, false, true, false), 1), Decision::Skip(Skip::TemporalLayer));
        c.set_target(None);
        assert_eq!(c.on_packet(0, &vp8t(25, 3, 1, 1, false, false, false), 2), Decision::Skip(Skip::Paused));
        c.set_target(Some(0));
        let late = fwd(c.on_packet(0, &vp8t(23, 2, 1, 0, false, true, false), 3));
        assert_eq!((late.sequence, late.picture_id), (23, Some(2)));
        let resumed = fwd(c.on_packet(0, &vp8t(26, 4, 2, 0, false, true, true), 4));
        assert_eq!((resumed.sequence, resumed.picture_id), (24, Some(3)), "right after the kept number");
    }

    #[test]
    fn sender_reports_follow_the_layer_received() {
        let mut c = LayerRewriter::new(0x77, 90_000);
        c.set_target(Some(1));
        fwd(c.on_packet(1, &info(10, 1000, 0, true), 0));
        let mut sr = vec![0x80, 200, 0, 6, 0, 0, 0, 2, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0x03, 0xe8, 0, 0, 0, 1, 0, 0, 0, 1];
        sr.extend_from_slice(&[0x81, 202, 0, 2, 0, 0, 0, 2, 1, 1, b'x', 0]);
        assert!(!c.rewrite_sender_report(0, &mut sr.clone()));
        assert!(c.rewrite_sender_report(1, &mut sr));
        assert_eq!(&sr[4..8], &0x77u32.to_be_bytes());
        assert_eq!(&sr[32..36], &0x77u32.to_be_bytes());
        assert!(!c.rewrite_sender_report(1, &mut [0x80, 200, 0, 1]));
    }
}
