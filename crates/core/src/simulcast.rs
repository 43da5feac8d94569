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

/// What the rewrite needs to know of one RTP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketInfo {
    pub sequence: u16,
    pub timestamp: u32,
    /// The first packet of a keyframe: a layer switch may happen here.
    pub keyframe_start: bool,
    pub picture_id: Option<PictureId>,
    /// VP8 TL0PICIDX and where it is.
    pub tl0picidx: Option<(u8, usize)>,
}

/// Read what the rewrite needs from an RTP packet of `codec`. None: not valid RTP.
pub fn inspect(codec: Codec, packet: &[u8]) -> Option<PacketInfo> {
    let h = RtpHeader::parse(packet).ok()?;
    let payload = &packet[h.payload_offset..h.payload_offset + h.payload_len];
    let mut info = PacketInfo { sequence: h.sequence, timestamp: h.timestamp, keyframe_start: false, picture_id: None, tl0picidx: None };
    match codec {
        Codec::Vp8 => {
            if let Some(d) = vp8_descriptor(payload) {
                info.keyframe_start = d.keyframe_start;
                info.picture_id = d.picture_id.map(|p| PictureId { at: p.at + h.payload_offset, ..p });
                info.tl0picidx = d.tl0picidx.map(|(v, at)| (v, at + h.payload_offset));
            }
        }
        Codec::H264 => info.keyframe_start = h264_keyframe_start(payload),
    }
    Some(info)
}

struct Vp8Descriptor {
    keyframe_start: bool,
    picture_id: Option<PictureId>,
    tl0picidx: Option<(u8, usize)>,
}

/// RFC 7741 4.2: the payload descriptor, and (4.3) the inverse key frame flag of the payload
/// header that follows it at the start of a frame's first partition.
fn vp8_descriptor(p: &[u8]) -> Option<Vp8Descriptor> {
    let b0 = *p.first()?;
    let (extended, start, partition) = (b0 & 0x80 != 0, b0 & 0x10 != 0, b0 & 0x07);
    let mut at = 1;
    let mut d = Vp8Descriptor { keyframe_start: false, picture_id: None, tl0picidx: None };
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
            p.get(at)?;
            at += 1;
        }
    }
    d.keyframe_start = start && partition == 0 && p.get(at).is_some_and(|h| h & 1 == 0);
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
        for i in 0..self.segments.len() {
            let g = self.segments[i];
            if g.layer != layer {
                continue;
            }
            let after_start = !seq_newer(g.start, s);
            let belongs = if i == 0 && self.open { after_start } else { after_start && !seq_newer(s, g.highest) };
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

    fn open_segment(&mut self, layer: u8, info: &PacketInfo, now_ns: u64) {
        let started = !self.segments.is_empty();
        let g = if started {
            let ticks = (now_ns.saturating_sub(self.top_at_ns) as u128 * self.clock_rate as u128 / 1_000_000_000).clamp(1, u32::MAX as u128) as u32;
            Segment {
                layer,
                start: info.sequence,
                highest: info.sequence,
                seq_offset: self.top_seq.wrapping_add(1).wrapping_sub(info.sequence),
                ts_offset: self.top_ts.wrapping_add(ticks).wrapping_sub(info.timestamp),
                pic_offset: info.picture_id.map_or(0, |p| self.top_pic.wrapping_add(1).wrapping_sub(p.value) & 0x7fff),
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
    }

    fn emit(&mut self, i: usize, info: &PacketInfo, now_ns: u64) -> Decision {
        let g = self.segments[i];
        let out = info.sequence.wrapping_add(g.seq_offset);
        let first = self.stats.forwarded == 0;
        let behind = self.top_seq.wrapping_sub(out);
        let newer = !first && seq_newer(out, self.top_seq);
        // Only the current segment extends the consumer's numbering (an older one's range is
        // closed; pruning keeps it from coming back when its layer wraps around).
        if !(i == 0 && self.open) && newer {
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
        if seq_newer(info.sequence, g.highest) {
            let g = &mut self.segments[i];
            g.highest = info.sequence;
            if g.highest.wrapping_sub(g.start) > SEGMENT_SPAN {
                g.start = g.highest.wrapping_sub(SEGMENT_SPAN);
            }
        }
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
