//! Simulcast consumers in the kernel: the Rust side of bpf/layer_rewrite.h.
//!
//! Each simulcast consumer has a `layer_state` entry: core's [`RewriterState`] in the kernel's
//! layout ([`LayerStateRaw`]). The TC program decides every copy of a layer packet on it, under
//! its lock. User space creates and deletes the entries, sets the target layer, decides the
//! packets the slow path forwards, and reads the states back, always through the kernel so that
//! one set of rules, applied one packet at a time, owns the renumbering:
//! * target changes and slow-path packets run the `layer_ctl` program with `BPF_PROG_TEST_RUN`
//!   ([`FastPath::layer_set_target`], [`FastPath::layer_packet`]);
//! * reads copy the entry under its lock (`BPF_F_LOCK`, [`FastPath::layer_state`]).

use crate::loader::{bpf_err, FastPath};
use crate::maps::Pod;
use libbpf_rs::{MapCore, MapFlags, ProgramInput};
use mediaplane_core::simulcast::{Codec, Cut, RewriterState, Segment, Skip, ALL_TEMPORAL, HISTORY, MAX_LAYERS};
use mediaplane_core::StreamEntry;
use mediaplane_dataplane::kernel_layers::{KernelLayers, KernelReceived};
use mediaplane_dataplane::DataplaneError;

/// `MP_LAYER_NONE`: no target (paused).
pub const LAYER_NONE: u8 = 0xff;
/// The program run for user space's requests.
pub const LAYER_CTL_PROGRAM: &str = "layer_ctl";
const OP_PACKET: u32 = 1;
const OP_TARGET: u32 = 2;
/// Bytes before the request in the frame `layer_ctl` runs on (an Ethernet header's worth).
const FRAME_HEAD: usize = 14;

/// `struct mp_layer_segment`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerSegmentRaw {
    pub start: u16,
    pub highest: u16,
    pub seq_offset: u16,
    pub pic_offset: u16,
    pub ts_offset: u32,
    pub layer: u8,
    pub tl0_offset: u8,
    pub pad: u16,
}

/// `struct mp_layer_state`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStateRaw {
    /// `struct bpf_spin_lock`: the kernel's, never written by user space.
    pub lock: u32,
    pub ssrc: u32,
    pub clock_rate: u32,
    pub target: u8,
    pub open: u8,
    pub nsegs: u8,
    pub newest_set: u8,
    pub newest: [u16; MAX_LAYERS],
    pub top_seq: u16,
    pub top_pic: u16,
    pub top_ts: u32,
    pub top_tl0: u8,
    pub temporal_target: u8,
    pub temporal_current: u8,
    /// `MP_CUT` | `MP_CUT_PICTURES`.
    pub cut: u8,
    pub cut_next_seq: u16,
    pub cut_resume_seq: u16,
    pub top_at_ns: u64,
    pub sent: u64,
    pub forwarded: u64,
    pub switches: u64,
    pub duplicates: u64,
    pub late: u64,
    pub seg: [LayerSegmentRaw; HISTORY],
    pub temporal_dropped: u64,
    pub cut_next_pic: u16,
    pub cut_resume_pic: u16,
    pub pad: u32,
}

const CUT: u8 = 1;
const CUT_PICTURES: u8 = 2;

unsafe impl Pod for LayerSegmentRaw {}
unsafe impl Pod for LayerStateRaw {}

impl LayerStateRaw {
    /// A consumer that receives on `ssrc`, with no target yet (as `LayerRewriter::new`).
    pub fn new(ssrc: u32, clock_rate: u32) -> LayerStateRaw {
        LayerStateRaw {
            ssrc,
            clock_rate: if clock_rate == 0 { 90_000 } else { clock_rate },
            target: LAYER_NONE,
            temporal_target: ALL_TEMPORAL,
            temporal_current: ALL_TEMPORAL,
            ..Default::default()
        }
    }

    /// `state` in the kernel's layout, for a consumer receiving on `ssrc` (the inverse of
    /// [`LayerStateRaw::to_state`]).
    pub fn from_state(ssrc: u32, clock_rate: u32, state: &RewriterState) -> LayerStateRaw {
        let mut raw = LayerStateRaw::new(ssrc, clock_rate);
        raw.target = state.target.unwrap_or(LAYER_NONE);
        raw.open = state.open as u8;
        raw.nsegs = state.segments.len().min(HISTORY) as u8;
        for (r, g) in raw.seg.iter_mut().zip(&state.segments) {
            *r = LayerSegmentRaw {
                start: g.start,
                highest: g.highest,
                seq_offset: g.seq_offset,
                pic_offset: g.pic_offset,
                ts_offset: g.ts_offset,
                layer: g.layer,
                tl0_offset: g.tl0_offset,
                pad: 0,
            };
        }
        for (l, n) in state.newest.iter().enumerate() {
            if let Some(n) = n {
                raw.newest_set |= 1 << l;
                raw.newest[l] = *n;
            }
        }
        (raw.top_seq, raw.top_ts, raw.top_pic, raw.top_tl0, raw.top_at_ns, raw.sent) =
            (state.top_seq, state.top_ts, state.top_pic, state.top_tl0, state.top_at_ns, state.sent);
        (raw.forwarded, raw.switches, raw.duplicates, raw.late) = (state.forwarded, state.switches, state.duplicates, state.late);
        (raw.temporal_target, raw.temporal_current, raw.temporal_dropped) = (state.temporal_target, state.temporal_current, state.temporal_dropped);
        if let Some(c) = state.cut {
            raw.cut = CUT;
            (raw.cut_next_seq, raw.cut_resume_seq) = (c.next_seq, c.resume_seq);
            if let Some((next, resume)) = c.pictures {
                raw.cut |= CUT_PICTURES;
                (raw.cut_next_pic, raw.cut_resume_pic) = (next, resume);
            }
        }
        raw
    }

    pub fn to_state(&self) -> RewriterState {
        let n = (self.nsegs as usize).min(HISTORY);
        RewriterState {
            target: (self.target != LAYER_NONE).then_some(self.target),
            segments: self.seg[..n]
                .iter()
                .map(|g| Segment {
                    layer: g.layer,
                    start: g.start,
                    highest: g.highest,
                    seq_offset: g.seq_offset,
                    ts_offset: g.ts_offset,
                    pic_offset: g.pic_offset,
                    tl0_offset: g.tl0_offset,
                })
                .collect(),
            open: self.open != 0,
            newest: std::array::from_fn(|l| (self.newest_set & 1 << l != 0).then_some(self.newest[l])),
            top_seq: self.top_seq,
            top_ts: self.top_ts,
            top_pic: self.top_pic,
            top_tl0: self.top_tl0,
            top_at_ns: self.top_at_ns,
            sent: self.sent,
            forwarded: self.forwarded,
            switches: self.switches,
            duplicates: self.duplicates,
            late: self.late,
            temporal_target: self.temporal_target,
            temporal_current: self.temporal_current,
            cut: (self.cut & CUT != 0).then_some(Cut {
                next_seq: self.cut_next_seq,
                resume_seq: self.cut_resume_seq,
                pictures: (self.cut & CUT_PICTURES != 0).then_some((self.cut_next_pic, self.cut_resume_pic)),
            }),
            temporal_dropped: self.temporal_dropped,
        }
    }
}

/// `struct mp_layer_request`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct LayerRequestRaw {
    op: u32,
    consumer: u32,
    arg: u32,
    codec: u32,
    now_ns: u64,
}

unsafe impl Pod for LayerRequestRaw {}

/// What the kernel made of a packet for a consumer (`enum mp_layer_verdict`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerVerdict {
    Forward,
    Skip(Skip),
    /// The consumer has no state in the kernel.
    NoState,
    /// Not RTP (or a request the program does not know).
    Invalid,
}

impl LayerVerdict {
    fn from_raw(v: u32) -> LayerVerdict {
        match v {
            1 => LayerVerdict::Forward,
            2 => LayerVerdict::Skip(Skip::OtherLayer),
            3 => LayerVerdict::Skip(Skip::WaitingKeyframe),
            4 => LayerVerdict::Skip(Skip::Duplicate),
            5 => LayerVerdict::Skip(Skip::Late),
            6 => LayerVerdict::Skip(Skip::Paused),
            7 => LayerVerdict::NoState,
            9 => LayerVerdict::Skip(Skip::TemporalLayer),
            _ => LayerVerdict::Invalid,
        }
    }
}

impl FastPath {
    /// Give `consumer` a state (no target yet) unless it has one. True: created.
    pub fn layer_create(&self, consumer: u32, ssrc: u32, clock_rate: u32) -> Result<bool, DataplaneError> {
        let v = LayerStateRaw::new(ssrc, clock_rate);
        match self.map("layer_state").update(consumer.as_bytes(), v.as_bytes(), MapFlags::NO_EXIST) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == libbpf_rs::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(bpf_err("creating a simulcast consumer's kernel state", e)),
        }
    }

    /// Make `state` `consumer`'s (created, or replaced under its lock): a consumer the slow path
    /// decided alone until now hands its state to the kernel before the kernel's first copy.
    pub fn layer_load(&self, consumer: u32, ssrc: u32, clock_rate: u32, state: &RewriterState) -> Result<(), DataplaneError> {
        let v = LayerStateRaw::from_state(ssrc, clock_rate, state);
        self.map("layer_state")
            .update(consumer.as_bytes(), v.as_bytes(), MapFlags::LOCK)
            .map_err(|e| bpf_err("loading a simulcast consumer's state into the kernel", e))
    }

    /// Forget `consumer`'s state (nothing if it has none).
    pub fn layer_remove(&self, consumer: u32) {
        let _ = self.map("layer_state").delete(consumer.as_bytes());
    }

    /// The consumers that have a state.
    pub fn layer_consumers(&self) -> Vec<u32> {
        self.map("layer_state").keys().filter_map(|k| k.get(..4).map(u32::from_bytes)).collect()
    }

    /// `consumer`'s state, read under its lock: its SSRC and what its packets made of it.
    pub fn layer_state(&self, consumer: u32) -> Result<Option<(u32, RewriterState)>, DataplaneError> {
        let raw = self.map("layer_state").lookup(consumer.as_bytes(), MapFlags::LOCK).map_err(|e| bpf_err("reading a simulcast consumer's kernel state", e))?;
        Ok(raw.filter(|b| b.len() == std::mem::size_of::<LayerStateRaw>()).map(|b| {
            let s = LayerStateRaw::from_bytes(&b);
            (s.ssrc, s.to_state())
        }))
    }

    /// Want `target` (None: pause) from its next keyframe on, as `LayerRewriter::set_target`,
    /// and temporal layers up to `temporal` (None: all), as `LayerRewriter::set_temporal`.
    pub fn layer_set_target(&self, consumer: u32, target: Option<u8>, temporal: Option<u8>) -> Result<LayerVerdict, DataplaneError> {
        let temporal = temporal.map_or(ALL_TEMPORAL, |t| t.min(ALL_TEMPORAL - 1)) as u32;
        let arg = target.map_or(LAYER_NONE as u32, u32::from) | temporal << 8;
        let req = LayerRequestRaw { op: OP_TARGET, consumer, arg, ..Default::default() };
        Ok(self.layer_ctl(&req, &[])?.0)
    }

    /// Decide `packet` (RTP of `layer`, arrived at `now_ns` on the monotonic clock) for
    /// `consumer`: on [`LayerVerdict::Forward`] the packet as it goes out to it.
    pub fn layer_packet(&self, consumer: u32, layer: u8, codec: Codec, now_ns: u64, packet: &[u8]) -> Result<(LayerVerdict, Vec<u8>), DataplaneError> {
        let req = LayerRequestRaw { op: OP_PACKET, consumer, arg: layer as u32, codec: crate::maps::codec_raw(codec) as u32, now_ns };
        self.layer_ctl(&req, packet)
    }

    // ProgramInput is non-exhaustive: no struct literal possible.
    #[allow(clippy::field_reassign_with_default)]
    fn layer_ctl(&self, req: &LayerRequestRaw, packet: &[u8]) -> Result<(LayerVerdict, Vec<u8>), DataplaneError> {
        let mut frame = vec![0u8; FRAME_HEAD];
        frame.extend_from_slice(req.as_bytes());
        frame.extend_from_slice(packet);
        let mut out = vec![0u8; frame.len()];
        let mut input = ProgramInput::default();
        input.data_in = Some(&frame);
        input.data_out = Some(&mut out);
        let prog = self.program_named(LAYER_CTL_PROGRAM);
        let res = prog.test_run(input).map_err(|e| bpf_err("BPF_PROG_TEST_RUN of layer_ctl", e))?;
        let verdict = LayerVerdict::from_raw(res.return_value);
        let at = FRAME_HEAD + std::mem::size_of::<LayerRequestRaw>();
        let data = res.data.map(|d| d.get(at..).unwrap_or(&[]).to_vec()).unwrap_or_default();
        Ok((verdict, data))
    }
}

/// The kernel's states as the slow path reaches them (errors are logged: the slow path then
/// forwards nothing of that packet to the consumer, as on any failed send).
pub struct KernelStates(pub std::sync::Arc<FastPath>);

impl KernelLayers for KernelStates {
    fn create(&self, consumer: u32, ssrc: u32, clock_rate: u32) {
        if let Err(e) = self.0.layer_create(consumer, ssrc, clock_rate) {
            tracing::warn!(consumer, error = %e, "creating a simulcast consumer's kernel state");
        }
    }
    fn remove(&self, consumer: u32) {
        self.0.layer_remove(consumer);
    }
    fn judges(&self, entry: &StreamEntry) -> bool {
        crate::maps::kernel_forwards(entry)
    }
    fn load(&self, consumer: u32, ssrc: u32, clock_rate: u32, state: &RewriterState) -> bool {
        self.0
            .layer_load(consumer, ssrc, clock_rate, state)
            .inspect_err(|e| tracing::warn!(consumer, error = %e, "handing a simulcast consumer to the kernel"))
            .is_ok()
    }
    fn set_target(&self, consumer: u32, target: Option<u8>, temporal: Option<u8>) -> bool {
        match self.0.layer_set_target(consumer, target, temporal) {
            Ok(LayerVerdict::Forward) => true,
            Ok(v) => {
                tracing::warn!(consumer, ?v, "setting a simulcast consumer's target in the kernel");
                false
            }
            Err(e) => {
                tracing::warn!(consumer, error = %e, "setting a simulcast consumer's target in the kernel");
                false
            }
        }
    }
    fn consumers(&self) -> Vec<u32> {
        self.0.layer_consumers()
    }
    fn decide(&self, consumer: u32, layer: u8, codec: Codec, now_ns: u64, packet: &[u8]) -> Option<Vec<u8>> {
        match self.0.layer_packet(consumer, layer, codec, now_ns, packet) {
            Ok((LayerVerdict::Forward, bytes)) => Some(bytes),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(consumer, error = %e, "deciding a simulcast packet in the kernel");
                None
            }
        }
    }
    fn state(&self, consumer: u32) -> Option<RewriterState> {
        self.0.layer_state(consumer).ok().flatten().map(|(_, s)| s)
    }
    fn received(&self, id: u32) -> Option<KernelReceived> {
        let c = self.0.kernel_stream_raw(id).ok()??;
        Some(KernelReceived { packets: c.rx_packets, bytes: c.rx_bytes, last_ns: c.last_rx_ns, keyframes: c.keyframes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_c_structs() {
        use crate::skel::types;
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<LayerSegmentRaw>(), 16);
        assert_eq!(size_of::<types::mp_layer_segment>(), size_of::<LayerSegmentRaw>());
        assert_eq!(size_of::<types::mp_layer_state>(), size_of::<LayerStateRaw>());
        assert_eq!(offset_of!(types::mp_layer_state, top_at_ns), offset_of!(LayerStateRaw, top_at_ns));
        assert_eq!(offset_of!(types::mp_layer_state, seg), offset_of!(LayerStateRaw, seg));
        assert_eq!(offset_of!(types::mp_layer_state, cut_resume_seq), offset_of!(LayerStateRaw, cut_resume_seq));
        assert_eq!(offset_of!(types::mp_layer_state, cut_resume_pic), offset_of!(LayerStateRaw, cut_resume_pic));
        assert_eq!(size_of::<LayerRequestRaw>(), 24); // struct mp_layer_request (sfu_tc.bpf.c)
    }

    /// Every field goes into the kernel's layout and comes back.
    #[test]
    fn a_state_survives_the_kernel_layout() {
        use mediaplane_core::simulcast::{Codec, LayerRewriter};
        let mut rw = LayerRewriter::new(7, 48_000);
        rw.set_target(Some(1));
        rw.set_temporal(Some(0));
        let vp8 = |seq: u16, tid: u8, key: bool| {
            let payload = [0x90, 0xe0, 0x80, seq as u8, 3, tid << 6, if key { 0x10 } else { 0x11 }, 0];
            mediaplane_core::simulcast::inspect(Codec::Vp8, &mediaplane_core::rtp::build_rtp(96, seq, 10 * seq as u32, 1, &payload)).unwrap()
        };
        rw.on_packet(1, &vp8(40, 0, true), 1);
        rw.on_packet(1, &vp8(41, 1, false), 2);
        rw.on_packet(0, &vp8(900, 0, false), 3);
        let state = rw.state();
        assert!(state.cut.is_some_and(|c| c.pictures.is_some()), "{state:?}");
        assert_eq!(LayerStateRaw::from_state(7, 48_000, &state).to_state(), state);
    }

    #[test]
    fn a_new_state_is_a_new_rewriter() {
        let s = LayerStateRaw::new(7, 0);
        assert_eq!(s.clock_rate, 90_000);
        assert_eq!(s.to_state(), mediaplane_core::simulcast::LayerRewriter::new(7, 0).state());
    }
}
