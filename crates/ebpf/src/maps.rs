//! Rust mirror of the kernel map layouts (bpf/maps.h, bpf/common.h) and the compiler from a
//! [`ForwardingTable`] to the kernel entries that express it. Sans-I/O: no maps are touched here.
//!
//! One table stream becomes one `streams` entry keyed by (local ip, local port, ssrc?). A local
//! address that has SSRC-narrowed streams always gets a wildcard (no SSRC) entry too: either its
//! real wildcard stream or a placeholder, flagged `NARROWED`, so the program learns with one
//! lookup whether it must read the SSRC (mirrors `ForwardingTable::has_ssrc_streams`).
//!
//! When every stream on a local address has the same fixed source (in the model: always, as
//! each address has one owner, unless a relay leg learns or takes any source), its wildcard entry — real or
//! placeholder — says so: `ONE_SOURCE` and that source. The XDP pre-filter then drops any other
//! source without reading the SSRC; the TC program ignores the flag (the placeholder stays a
//! placeholder: not `PRESENT`, it forwards nothing and counts nothing).

use mediaplane_core::feedback::FeedbackEntry;
use mediaplane_core::ratelimit::RateLimit;
use mediaplane_core::reception::RtpReception;
use mediaplane_core::table::{ForwardingTable, IngressKey, SourceRule, StreamEntry};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

pub const FAMILY_V4: u8 = 4;
pub const FAMILY_V6: u8 = 6;

/// `stream_value.flags` (bpf/common.h STREAM_F_*).
pub mod flags {
    pub const PRESENT: u32 = 1 << 0;
    pub const RTP: u32 = 1 << 1;
    pub const NARROWED: u32 = 1 << 2;
    /// Learning its source: packets from `src` (when set) are forwarded, others go to the
    /// slow path, which relays them and reports the source.
    pub const LATCH: u32 = 1 << 3;
    pub const SLOW: u32 = 1 << 4;
    pub const RATE: u32 = 1 << 5;
    /// (wildcard entry only) every stream on the local address has the same fixed source,
    /// written in this entry (the placeholder too): the XDP pre-filter drops other sources.
    pub const ONE_SOURCE: u32 = 1 << 6;
    /// Any source is forwarded (no source check).
    pub const ANY_SOURCE: u32 = 1 << 7;
    /// Its RTCP goes to the slow path, which relays it and hands it to the control plane.
    pub const RTCP_UP: u32 = 1 << 8;
    /// (wildcard entry only) a consumer's address: RTCP from the source written in this entry
    /// (the placeholder too) is feedback, for the slow path to route.
    pub const FEEDBACK: u32 = 1 << 9;
    /// One layer of a simulcast stream: every copy is decided and renumbered for its consumer
    /// (bpf/layer_rewrite.h), on the consumer's `layer_state`.
    pub const SIMULCAST: u32 = 1 << 10;
    /// (wildcard entry only) an ICE + DTLS-SRTP address ([`StreamEntry::handshake`]): all but
    /// STUN goes to the slow path, which judges it (SRTCP cannot be walked in the kernel).
    pub const ADDRESS_UP: u32 = 1 << 11;
    /// RTP of the (up to two) payload types in `layer`/`codec` goes to the slow path, the rest
    /// is forwarded: a relay leg whose RFC 4733 events are reported from there.
    pub const PT_UP: u32 = 1 << 12;
}

/// Copies per stream the kernel fans out itself (MAX_FANOUT); bigger streams take the slow path.
pub const MAX_FANOUT: usize = 4096;

include!(concat!(env!("OUT_DIR"), "/counters.rs"));

/// The pass counters of packets of the SFU's or relay's own streams that the program hands to
/// the user-space slow path; the other `pass_*` counters are traffic that is not theirs (not
/// IP, not UDP, not to one of their addresses, ...). The benches split a run's packets into
/// kernel and slow path with it.
pub const SLOW_PATH_PASSES: [&str; 11] = [
    "pass_stun",
    "pass_unlatched",
    "pass_slow_stream",
    "pass_no_neigh",
    "pass_fib_fail",
    "pass_stale_copy",
    "pass_error",
    "pass_in_order",
    "pass_rtcp",
    "pass_feedback",
    "pass_dtmf",
];

/// An unused `up_pt` slot (payload types are 7 bits).
pub const NO_PT: u8 = 0xff;

/// Index of a global counter by name (panics on a typo: names are compile-time constants).
pub fn counter_index(name: &str) -> u32 {
    GLOBAL_COUNTERS.iter().position(|n| *n == name).unwrap_or_else(|| panic!("no counter {name}")) as u32
}

/// Latency histogram geometry (LAT_* in bpf/common.h).
pub const LAT_EXACT: usize = 16;
pub const LAT_SUB: usize = 8;
pub const LAT_MAX_EXP: usize = 40;
pub const LAT_BUCKETS: usize = LAT_EXACT + (LAT_MAX_EXP - 4) * LAT_SUB;

/// Plain-old-data map structs: `#[repr(C)]`, no implicit padding, any bit pattern valid.
///
/// # Safety
/// Implementors must be `repr(C)` without padding bytes and valid for every bit pattern.
pub unsafe trait Pod: Copy + Default {
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: Pod guarantees no padding, so every byte is initialized.
        unsafe { std::slice::from_raw_parts(self as *const Self as *const u8, std::mem::size_of::<Self>()) }
    }
    fn from_bytes(b: &[u8]) -> Self {
        assert_eq!(b.len(), std::mem::size_of::<Self>(), "map value size mismatch");
        let mut v = Self::default();
        // SAFETY: sizes match and any bit pattern is valid.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), &mut v as *mut Self as *mut u8, b.len()) };
        v
    }
}

/// `struct mp_ingress_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyRaw {
    pub addr: [u8; 16],
    /// Network byte order.
    pub port: [u8; 2],
    pub family: u8,
    pub has_ssrc: u8,
    pub ssrc: u32,
}

/// `struct mp_stream_value`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamValueRaw {
    pub id: u32,
    pub flags: u32,
    pub src_addr: [u8; 16],
    pub src_port: [u8; 2],
    /// With `flags::SIMULCAST`: the layer (0 = lowest) and the codec (`CODEC_*`). With
    /// `flags::PT_UP` (never simulcast): the two payload types that go up (`NO_PT`: none); the
    /// C struct names these two bytes `up_pt`.
    pub layer: u8,
    pub codec: u8,
    pub stats_slot: u32,
    pub copies_base: u32,
    pub copies_count: u32,
    /// RTP clock rate (Hz), 0 = unknown.
    pub clock_rate: u32,
}

/// `struct mp_copy_rewrite`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyRaw {
    pub from_addr: [u8; 16],
    pub to_addr: [u8; 16],
    pub from_port: [u8; 2],
    pub to_port: [u8; 2],
    pub stream_id: u32,
    /// The consumer uid, key of `consumer_stats` (0: none).
    pub consumer: u32,
}

/// `struct mp_consumer_counters`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerCountersRaw {
    pub tx_copies: u64,
    pub tx_bytes: u64,
    pub tx_errors: u64,
}

impl ConsumerCountersRaw {
    pub fn add(&mut self, o: &ConsumerCountersRaw) {
        self.tx_copies += o.tx_copies;
        self.tx_bytes += o.tx_bytes;
        self.tx_errors += o.tx_errors;
    }

    pub fn to_counters(&self) -> mediaplane_dataplane::ConsumerCounters {
        mediaplane_dataplane::ConsumerCounters { tx_copies: self.tx_copies, tx_bytes: self.tx_bytes, tx_errors: self.tx_errors, ..Default::default() }
    }
}

/// `struct mp_stream_counters`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamCountersRaw {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_copies: u64,
    pub tx_bytes: u64,
    pub tx_errors: u64,
    pub drop_stranger: u64,
    pub drop_malformed: u64,
    pub pass_slow: u64,
    pub drop_rate_limited: u64,
    pub drop_bad_checksum: u64,
    pub drop_spoofed: u64,
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) of the last packet forwarded; the maximum over
    /// CPUs, not a sum.
    pub last_rx_ns: u64,
    /// Keyframe starts of a simulcast layer the kernel forwarded.
    pub keyframes: u64,
}

impl StreamCountersRaw {
    /// What the kernel counted for a stream, as the data planes' common counters.
    pub fn to_counters(&self) -> mediaplane_dataplane::Counters {
        mediaplane_dataplane::Counters {
            rx_packets: self.rx_packets,
            rx_bytes: self.rx_bytes,
            tx_copies: self.tx_copies,
            tx_bytes: self.tx_bytes,
            tx_errors: self.tx_errors,
            drop_stranger: self.drop_stranger,
            drop_malformed: self.drop_malformed,
            drop_rate_limited: self.drop_rate_limited,
            drop_bad_checksum: self.drop_bad_checksum,
            drop_spoofed: self.drop_spoofed,
            // Both CLOCK_MONOTONIC: the kernel's bpf_ktime_get_ns is the clock of monotonic_ns.
            last_rx_ns: self.last_rx_ns,
            ..Default::default()
        }
    }
}

/// `struct mp_fast_config` (fast_config[0]): what copies' IP headers carry and which checks run.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FastConfigRaw {
    pub flags: u32,
    pub ttl: u8,
    pub hop_limit: u8,
    pub dscp: u8,
    pub rpf_v6: u8,
}

/// `fast_config.flags` (MP_CFG_* in bpf/common.h).
pub mod config_flags {
    pub const VERIFY_CSUM: u32 = 1 << 0;
    pub const KEEP_DSCP: u32 = 1 << 1;
    pub const HOLD_ORDER: u32 = 1 << 2;
    pub const FORWARDED_QOS: u32 = 1 << 3;
}

/// Reverse-path check modes (MP_RPF_*: the values of `net.ipv4.conf.*.rp_filter`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RpfMode {
    #[default]
    Off = 0,
    Strict = 1,
    Loose = 2,
}

impl RpfMode {
    /// The mode an rp_filter sysctl value means (the kernel treats anything above 2 as loose).
    pub fn from_sysctl(v: u32) -> RpfMode {
        match v {
            0 => RpfMode::Off,
            1 => RpfMode::Strict,
            _ => RpfMode::Loose,
        }
    }
}

/// Marks the fast path puts on packets it hands up in stream order (MP_ORDER_* in bpf/common.h):
/// `ORDER_MARK | seq << ORDER_SLOT_BITS | stats slot`.
pub const ORDER_MARK: u32 = 0x8000_0000;
pub const ORDER_SLOT_BITS: u32 = 21;
pub const ORDER_SEQ_MASK: u32 = 0x3ff;

/// The mark of the packet numbered `seq` of the stream in `slot`.
pub fn order_mark(slot: u32, seq: u32) -> u32 {
    ORDER_MARK | (seq & ORDER_SEQ_MASK) << ORDER_SLOT_BITS | slot
}

/// `struct mp_stream_path` (see bpf/maps.h): the reverse-path cache and the order hold.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamPathRaw {
    pub rpf_ok: u64,
    pub rpf_src: [u8; 16],
    pub up: u64,
    pub done: u64,
    pub seen_done: u64,
    pub progress_ns: u64,
}

/// `struct mp_rate`: a stream's limit (see [`mediaplane_core::ratelimit::RateParams`]) and state.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateRaw {
    /// struct bpf_spin_lock (user space never touches it: writes use BPF_F_LOCK).
    pub lock: u32,
    pub pad: u32,
    pub interval_ns: u64,
    pub byte_cost_q16: u64,
    pub tau_ns: u64,
    pub tat_packets: u64,
    pub tat_bytes: u64,
}

impl RateRaw {
    /// A fresh (idle) bucket for `limit`.
    pub fn new(limit: &RateLimit) -> RateRaw {
        let p = limit.params();
        RateRaw { interval_ns: p.interval_ns, byte_cost_q16: p.byte_cost_q16, tau_ns: p.tau_ns, ..Default::default() }
    }
}

/// `struct mp_source_limit`: the per-source limit (all zero = off).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceLimitRaw {
    pub interval_ns: u64,
    pub byte_cost_q16: u64,
    pub tau_ns: u64,
}

impl SourceLimitRaw {
    pub fn new(limit: Option<&RateLimit>) -> SourceLimitRaw {
        let p = limit.filter(|l| !l.is_unlimited()).map(|l| l.params()).unwrap_or_default();
        SourceLimitRaw { interval_ns: p.interval_ns, byte_cost_q16: p.byte_cost_q16, tau_ns: p.tau_ns }
    }
}

/// `struct mp_source_key` / `struct mp_source_state`: one source address's bucket.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceKeyRaw {
    pub addr: [u8; 16],
    pub family: u8,
    pub pad: [u8; 3],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceStateRaw {
    pub tat_packets: u64,
    pub tat_bytes: u64,
}

/// Source addresses whose buckets the kernel keeps (MAX_SOURCES, LRU).
pub const MAX_SOURCES: u32 = 65536;

/// `struct mp_latency_hist`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatencyHistRaw {
    pub buckets: [u64; LAT_BUCKETS],
    pub sum: u64,
    /// 0 = none yet.
    pub min: u64,
    pub max: u64,
    pub count: u64,
}

impl Default for LatencyHistRaw {
    fn default() -> Self {
        LatencyHistRaw { buckets: [0; LAT_BUCKETS], sum: 0, min: 0, max: 0, count: 0 }
    }
}

/// `struct mp_reception` (bpf/reception.h): a stream's reception state, the kernel's
/// [`RtpReception`]. Read and written with BPF_F_LOCK.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceptionRaw {
    /// struct bpf_spin_lock (user space never touches it).
    pub lock: u32,
    pub started: u32,
    pub ssrc: u32,
    pub clock_rate: u32,
    pub max_ext: u32,
    pub base_ext: u32,
    pub window: u64,
    pub probation: u32,
    pub has_transit: u32,
    pub received: u64,
    pub expected_prior: u64,
    pub received_prior: u64,
    pub duplicates: u64,
    pub reordered: u64,
    pub jumps: u64,
    pub resyncs: u64,
    pub ssrc_changes: u64,
    pub transit: u32,
    pub jitter_q4: u32,
}

impl ReceptionRaw {
    pub fn to_reception(&self) -> RtpReception {
        RtpReception {
            started: self.started != 0,
            ssrc: self.ssrc,
            clock_rate: self.clock_rate,
            max_ext: self.max_ext,
            base_ext: self.base_ext,
            window: self.window,
            probation: self.probation,
            received: self.received,
            expected_prior: self.expected_prior,
            received_prior: self.received_prior,
            duplicates: self.duplicates,
            reordered: self.reordered,
            jumps: self.jumps,
            resyncs: self.resyncs,
            ssrc_changes: self.ssrc_changes,
            transit: self.transit,
            has_transit: self.has_transit != 0,
            jitter_q4: self.jitter_q4,
        }
    }
}

unsafe impl Pod for KeyRaw {}
unsafe impl Pod for ReceptionRaw {}
unsafe impl Pod for StreamValueRaw {}
unsafe impl Pod for CopyRaw {}
unsafe impl Pod for ConsumerCountersRaw {}
unsafe impl Pod for StreamCountersRaw {}
unsafe impl Pod for RateRaw {}
unsafe impl Pod for LatencyHistRaw {}
unsafe impl Pod for SourceLimitRaw {}
unsafe impl Pod for SourceKeyRaw {}
unsafe impl Pod for SourceStateRaw {}
unsafe impl Pod for FastConfigRaw {}
unsafe impl Pod for StreamPathRaw {}
unsafe impl Pod for u32 {}
unsafe impl Pod for u64 {}

impl StreamCountersRaw {
    pub fn add(&mut self, o: &StreamCountersRaw) {
        self.rx_packets += o.rx_packets;
        self.rx_bytes += o.rx_bytes;
        self.tx_copies += o.tx_copies;
        self.tx_bytes += o.tx_bytes;
        self.tx_errors += o.tx_errors;
        self.drop_stranger += o.drop_stranger;
        self.drop_malformed += o.drop_malformed;
        self.pass_slow += o.pass_slow;
        self.drop_rate_limited += o.drop_rate_limited;
        self.drop_bad_checksum += o.drop_bad_checksum;
        self.drop_spoofed += o.drop_spoofed;
        self.last_rx_ns = self.last_rx_ns.max(o.last_rx_ns);
        self.keyframes += o.keyframes;
    }
}

impl LatencyHistRaw {
    pub fn add(&mut self, o: &LatencyHistRaw) {
        for (a, b) in self.buckets.iter_mut().zip(o.buckets.iter()) {
            *a += b;
        }
        self.sum += o.sum;
        self.count += o.count;
        self.max = self.max.max(o.max);
        if o.min != 0 && (self.min == 0 || o.min < self.min) {
            self.min = o.min;
        }
    }

    /// Value (ns) at quantile `q` in 0..=1: the middle of the bucket holding it.
    pub fn quantile(&self, q: f64) -> u64 {
        let total: u64 = self.buckets.iter().sum();
        if total == 0 {
            return 0;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let (lo, hi) = latency_bucket_bounds(i);
                return (lo + (hi - lo) / 2).clamp(self.min, self.max.max(self.min));
            }
        }
        self.max
    }
}

impl LatencyHistRaw {
    /// Cumulative counts at `bounds_ns` (each a bucket bound of this histogram: the powers of two
    /// from 16 ns on are), for a Prometheus histogram.
    pub fn cumulative(&self, bounds_ns: &[u64]) -> mediaplane_dataplane::LatencyHistogram {
        let mut cumulative = vec![0u64; bounds_ns.len()];
        for (i, n) in self.buckets.iter().enumerate() {
            let lo = latency_bucket_bounds(i).0;
            for (c, b) in cumulative.iter_mut().zip(bounds_ns) {
                if lo < *b {
                    *c += n;
                }
            }
        }
        // Per-CPU values are read one by one: never let +Inf fall below a finite bucket.
        let count = self.count.max(self.buckets.iter().sum());
        mediaplane_dataplane::LatencyHistogram { bounds_ns: bounds_ns.to_vec(), cumulative, count, sum_ns: self.sum }
    }
}

/// Bucket index of `ns`, as the BPF program computes it (latency_bucket in sfu_tc.bpf.c).
pub fn latency_bucket(ns: u64) -> usize {
    if ns < LAT_EXACT as u64 {
        return ns as usize;
    }
    let e = 63 - ns.leading_zeros() as usize;
    if e >= LAT_MAX_EXP {
        return LAT_BUCKETS - 1;
    }
    LAT_EXACT + (e - 4) * LAT_SUB + ((ns >> (e - 3)) as usize & (LAT_SUB - 1))
}

/// [low, high) in ns of a histogram bucket.
pub fn latency_bucket_bounds(i: usize) -> (u64, u64) {
    if i < LAT_EXACT {
        return (i as u64, i as u64 + 1);
    }
    let e = 4 + (i - LAT_EXACT) / LAT_SUB;
    let m = ((i - LAT_EXACT) % LAT_SUB) as u64;
    let lo = (8 + m) << (e - 3);
    (lo, lo + (1 << (e - 3)))
}

fn addr_bytes(ip: IpAddr) -> ([u8; 16], u8) {
    let mut b = [0; 16];
    match ip {
        IpAddr::V4(v4) => {
            b[..4].copy_from_slice(&v4.octets());
            (b, FAMILY_V4)
        }
        IpAddr::V6(v6) => (v6.octets(), FAMILY_V6),
    }
}

impl KeyRaw {
    pub fn new(local: SocketAddr, ssrc: Option<u32>) -> KeyRaw {
        let (addr, family) = addr_bytes(local.ip());
        KeyRaw { addr, port: local.port().to_be_bytes(), family, has_ssrc: ssrc.is_some() as u8, ssrc: ssrc.unwrap_or(0) }
    }

    pub fn local(&self) -> SocketAddr {
        SocketAddr::new(ip_of(self.family, &self.addr), u16::from_be_bytes(self.port))
    }

    pub fn ssrc(&self) -> Option<u32> {
        (self.has_ssrc != 0).then_some(self.ssrc)
    }

    pub fn is_wildcard(&self) -> bool {
        self.has_ssrc == 0
    }
}

fn ip_of(family: u8, addr: &[u8; 16]) -> IpAddr {
    if family == FAMILY_V4 {
        IpAddr::from([addr[0], addr[1], addr[2], addr[3]])
    } else {
        IpAddr::from(*addr)
    }
}

impl CopyRaw {
    pub fn new(stream_id: u32, consumer: u32, from: SocketAddr, to: SocketAddr) -> CopyRaw {
        CopyRaw {
            from_addr: addr_bytes(from.ip()).0,
            to_addr: addr_bytes(to.ip()).0,
            from_port: from.port().to_be_bytes(),
            to_port: to.port().to_be_bytes(),
            stream_id,
            consumer,
        }
    }
}

/// What one `streams` entry must say, before slots (fan-out range, stats) are assigned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelStream {
    /// Stream id; 0 for a placeholder.
    pub id: u32,
    pub flags: u32,
    pub source: Option<SocketAddr>,
    pub copies: Vec<CopyRaw>,
    /// With `flags::RATE`: the limit to write to `stream_rate[stats slot]`. `None` with the flag
    /// set means "unknown" (adopted from pins): the next apply rewrites it.
    pub rate: Option<RateLimit>,
    pub clock_rate: u32,
    /// With `flags::SIMULCAST`: (layer, codec).
    pub layer: (u8, u8),
}

impl KernelStream {
    pub fn is_placeholder(&self) -> bool {
        self.flags & flags::PRESENT == 0
    }

    /// The entry value, given where its copies and counters live.
    pub fn value(&self, stats_slot: u32, copies_base: u32) -> StreamValueRaw {
        let (src_addr, src_port) = match self.source {
            Some(s) => (addr_bytes(s.ip()).0, s.port().to_be_bytes()),
            None => ([0; 16], [0; 2]),
        };
        StreamValueRaw {
            id: self.id,
            flags: self.flags,
            src_addr,
            src_port,
            layer: self.layer.0,
            codec: self.layer.1,
            stats_slot,
            copies_base,
            copies_count: self.copies.len() as u32,
            clock_rate: self.clock_rate,
        }
    }
}

fn kernel_stream(e: &StreamEntry, narrowed: bool) -> KernelStream {
    let mut f = flags::PRESENT;
    // SRTCP is encrypted past its first header: the slow path checks what it can (see
    // `ForwardingTable::classify`) and the authentication tag the rest.
    if e.rtp && e.inbound.is_clear() {
        f |= flags::RTP;
        // A relay leg's RTCP is evaluated (RTT, MOS); an SFU stream's sender reports are timed
        // as they pass, for its consumers' round-trip times.
        if e.rtcp_to_slow_path() {
            f |= flags::RTCP_UP;
        }
    }
    if narrowed && e.key.ssrc.is_none() {
        f |= flags::NARROWED;
    }
    let source = match e.source {
        SourceRule::Fixed(s) => Some(s),
        SourceRule::Learn(followed) => {
            f |= flags::LATCH;
            followed
        }
        SourceRule::Any => {
            f |= flags::ANY_SOURCE;
            None
        }
    };
    if !kernel_forwards(e) {
        f |= flags::SLOW;
    }
    if e.handshake && e.key.ssrc.is_none() {
        f |= flags::ADDRESS_UP;
    }
    // A simulcast layer's copies are renumbered per consumer in the kernel; its sender reports
    // go up, where they are rewritten for each consumer from the kernel's state.
    let mut layer = (0, 0);
    if let Some(l) = &e.simulcast {
        f |= flags::SIMULCAST | flags::RTCP_UP;
        layer = (l.index, codec_raw(l.codec));
    }
    // A leg whose DTMF is reported: its events go up, its audio stays here.
    if f & flags::SLOW == 0 && e.control.report_dtmf {
        f |= flags::PT_UP;
        let pts = &e.control.telephone_events;
        layer = (pts.first().copied().unwrap_or(NO_PT), pts.get(1).copied().unwrap_or(NO_PT));
    }
    let rate = e.rate.filter(|r| !r.is_unlimited());
    if rate.is_some() {
        f |= flags::RATE;
    }
    let copies = if f & flags::SLOW != 0 { Vec::new() } else { e.copies.iter().map(|c| CopyRaw::new(e.id, c.consumer, c.from, c.to)).collect() };
    KernelStream { id: e.id, flags: f, source, copies, rate, clock_rate: if e.rtp { e.clock_rate } else { 0 }, layer }
}

/// Whether the kernel makes `e`'s copies itself; else every packet of it goes to the slow path
/// (`STREAM_F_SLOW`), which then alone decides its simulcast consumers.
pub fn kernel_forwards(e: &StreamEntry) -> bool {
    let v4 = e.key.local.is_ipv4();
    let source = match e.source {
        SourceRule::Fixed(s) | SourceRule::Learn(Some(s)) => Some(s),
        SourceRule::Learn(None) | SourceRule::Any => None,
    };
    // The kernel rewrites headers in place: it cannot turn IPv4 into IPv6. Such streams (and
    // fan-outs bigger than its scratch space) are left whole to the slow path.
    let mixed = source.is_some_and(|s| s.is_ipv4() != v4) || e.copies.iter().any(|c| c.from.is_ipv4() != v4 || c.to.is_ipv4() != v4);
    // Recorded streams too: the slow path hands what it forwards to the recording tap. And SRTP
    // ones: the kernel has no AES-CM/HMAC, the slow path has libsrtp and AES-NI. And those
    // under call control (blocked or silenced media, blocked DTMF) or with DTMF to put in:
    // rare, and decided per payload type or packet, which the kernel path does not look at. So
    // are copies that renumber the payload type (a browser's over WHEP: SRTP anyway).
    let renumbered = e.copies.iter().any(|c| c.payload_type.is_some());
    // Reported DTMF is not judged: the kernel passes up those payload types only (`PT_UP`),
    // two of them at most.
    let judged = !e.control.control.is_off() || e.control.telephone_events.len() > 2 && e.control.report_dtmf;
    !(mixed || e.record || e.has_srtp() || renumbered || judged || !e.dtmf.is_empty() || e.copies.len() > MAX_FANOUT)
}

/// `stream_value.codec` (bpf/layer_rewrite.h MP_CODEC_*).
pub fn codec_raw(c: mediaplane_core::simulcast::Codec) -> u8 {
    match c {
        mediaplane_core::simulcast::Codec::Vp8 => 0,
        mediaplane_core::simulcast::Codec::H264 => 1,
    }
}

/// The consumers whose copies of `e` the kernel sends (none for a stream it leaves to the slow
/// path, nor for a relay's copies).
pub fn kernel_consumers(e: &StreamEntry) -> impl Iterator<Item = u32> {
    kernel_stream(e, false).copies.into_iter().map(|c| c.consumer).filter(|c| *c != 0)
}

/// Kernel entries of the streams on `locals` (all locals when `None`).
pub fn kernel_entries(table: &ForwardingTable, locals: Option<&BTreeSet<SocketAddr>>) -> BTreeMap<KeyRaw, KernelStream> {
    // Only the entries at the wanted addresses: a range per address, not a pass over the table.
    let entries: Box<dyn Iterator<Item = (&IngressKey, &StreamEntry)>> = match locals {
        None => Box::new(table.streams.iter()),
        Some(ls) => {
            Box::new(ls.iter().flat_map(|l| table.streams.range(IngressKey { local: *l, ssrc: None }..=IngressKey { local: *l, ssrc: Some(u32::MAX) })))
        }
    };
    let entries: Vec<(&IngressKey, &StreamEntry)> = entries.collect();
    let narrowed_locals: BTreeSet<SocketAddr> = entries.iter().filter(|(k, _)| k.ssrc.is_some()).map(|(k, _)| k.local).collect();
    // Per local: Some(source) while every stream seen there has that fixed source, None once
    // one latches or has another.
    let mut one_source: BTreeMap<SocketAddr, Option<SocketAddr>> = BTreeMap::new();
    for (k, e) in &entries {
        let src = match e.source {
            SourceRule::Fixed(s) => Some(s),
            SourceRule::Learn(_) | SourceRule::Any => None,
        };
        one_source.entry(k.local).and_modify(|o| *o = o.filter(|s| Some(*s) == src)).or_insert(src);
    }
    let mut out = BTreeMap::new();
    for (k, e) in entries {
        let mut s = kernel_stream(e, narrowed_locals.contains(&k.local));
        if k.ssrc.is_none() && one_source[&k.local].is_some() {
            s.flags |= flags::ONE_SOURCE;
        }
        out.insert(KeyRaw::new(k.local, k.ssrc), s);
    }
    for local in narrowed_locals {
        let source = one_source[&local];
        out.entry(KeyRaw::new(local, None)).or_insert(KernelStream {
            id: 0,
            flags: flags::NARROWED | if source.is_some() { flags::ONE_SOURCE } else { 0 },
            source,
            copies: Vec::new(),
            rate: None,
            clock_rate: 0,
            layer: (0, 0),
        });
    }
    // Consumers' addresses: the wildcard entry (a placeholder if there is none) says whose RTCP
    // is feedback. Its source is the consumer's, which is also that of every stream it publishes
    // there (one owner per address); an entry with another source keeps the RTCP its own.
    let feedback: Box<dyn Iterator<Item = &FeedbackEntry>> = match locals {
        None => Box::new(table.feedback.keys().filter_map(|l| table.feedback_at(*l))),
        Some(ls) => Box::new(ls.iter().filter_map(|l| table.feedback_at(*l))),
    };
    for fb in feedback {
        let wild = out.entry(KeyRaw::new(fb.local, None)).or_insert(KernelStream {
            id: 0,
            flags: 0,
            source: Some(fb.source),
            copies: Vec::new(),
            rate: None,
            clock_rate: 0,
            layer: (0, 0),
        });
        if wild.is_placeholder() && wild.source.is_none() {
            wild.source = Some(fb.source);
        }
        // feedback_at() vouches that a real wildcard stream here is RTP from the consumer.
        debug_assert_eq!(wild.source, Some(fb.source));
        wild.flags |= flags::FEEDBACK;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use mediaplane_core::model::{Model, StreamRef, StreamSpec};

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn slow_path_passes_are_pass_counters_of_the_registry() {
        for name in SLOW_PATH_PASSES {
            assert!(name.starts_with("pass_") && GLOBAL_COUNTERS.contains(&name), "{name}");
        }
    }

    #[test]
    fn latency_buckets_sum_exactly_into_power_of_two_bounds() {
        let bounds = mediaplane_dataplane::COPY_LATENCY_BOUNDS_NS;
        for b in bounds {
            assert_eq!(latency_bucket_bounds(latency_bucket(b)).0, b, "{b} ns is a bucket bound");
        }
        let mut h = LatencyHistRaw::default();
        for ns in [10u64, 63, 64, 100, 127, 128, 5_000, 10_000_000] {
            h.buckets[latency_bucket(ns)] += 1;
            h.count += 1;
            h.sum += ns;
        }
        let c = h.cumulative(&bounds);
        // < 64 ns: 10, 63; < 128: also 64, 100, 127; < 8192: also 128, 5000; 10 ms: +Inf only.
        assert_eq!((c.cumulative[0], c.cumulative[1], c.cumulative[7]), (2, 5, 7));
        assert_eq!(*c.cumulative.last().unwrap(), 7);
        assert_eq!((c.count, c.sum_ns), (8, h.sum));
        assert!(c.cumulative.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn layouts_match_the_c_structs() {
        use std::mem::size_of;
        assert_eq!(size_of::<KeyRaw>(), 24);
        assert_eq!(size_of::<StreamValueRaw>(), 44);
        assert_eq!(size_of::<ReceptionRaw>(), 112);
        assert_eq!(size_of::<CopyRaw>(), 44);
        assert_eq!(size_of::<ConsumerCountersRaw>(), 24);
        assert_eq!(size_of::<StreamCountersRaw>(), 104);
        assert_eq!(size_of::<RateRaw>(), 48);
        assert_eq!(size_of::<LatencyHistRaw>(), (LAT_BUCKETS + 4) * 8);
        // The generated skeleton carries the C layout (from BTF): compare.
        use crate::skel::types;
        assert_eq!(size_of::<types::mp_ingress_key>(), size_of::<KeyRaw>());
        assert_eq!(size_of::<types::mp_stream_value>(), size_of::<StreamValueRaw>());
        assert_eq!(size_of::<types::mp_copy_rewrite>(), size_of::<CopyRaw>());
        assert_eq!(size_of::<types::mp_stream_counters>(), size_of::<StreamCountersRaw>());
        assert_eq!(size_of::<types::mp_latency_hist>(), size_of::<LatencyHistRaw>());
        assert_eq!(size_of::<types::mp_rate>(), size_of::<RateRaw>());
        assert_eq!(size_of::<types::mp_reception>(), size_of::<ReceptionRaw>());
        assert_eq!(std::mem::offset_of!(types::mp_reception, window), std::mem::offset_of!(ReceptionRaw, window));
        assert_eq!(std::mem::offset_of!(types::mp_reception, jitter_q4), std::mem::offset_of!(ReceptionRaw, jitter_q4));
        assert_eq!(size_of::<types::mp_source_limit>(), size_of::<SourceLimitRaw>());
        assert_eq!(size_of::<types::mp_source_key>(), size_of::<SourceKeyRaw>());
        assert_eq!(size_of::<types::mp_source_state>(), size_of::<SourceStateRaw>());
        assert_eq!(size_of::<types::mp_fast_config>(), size_of::<FastConfigRaw>());
        assert_eq!(size_of::<types::mp_stream_path>(), size_of::<StreamPathRaw>());
        assert_eq!(std::mem::offset_of!(types::mp_stream_path, done), std::mem::offset_of!(StreamPathRaw, done));
    }

    #[test]
    fn latency_buckets_round_trip() {
        for ns in [0u64, 1, 15, 16, 17, 31, 32, 100, 1000, 12345, 1 << 30, (1 << 40) - 1] {
            let b = latency_bucket(ns);
            let (lo, hi) = latency_bucket_bounds(b);
            assert!(lo <= ns && ns < hi, "{ns} in bucket {b} [{lo},{hi})");
        }
        assert_eq!(latency_bucket(u64::MAX), LAT_BUCKETS - 1);
    }

    #[test]
    fn narrowed_locals_get_a_placeholder_wildcard() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "p0", a("10.0.0.1:4000"), a("10.0.1.1:5000")).unwrap();
        m.add_participant("r", "p1", a("10.0.0.1:4002"), a("10.0.1.2:5000")).unwrap();
        m.publish("r", "p0", "low", StreamSpec { ssrc: Some(1), ..Default::default() }).unwrap();
        m.publish("r", "p1", "main", StreamSpec::default()).unwrap();
        let consumer = m.subscribe("r", "p1", StreamRef { publisher: "p0".into(), stream: "low".into() }).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        let e = kernel_entries(&t, None);
        assert_eq!(e.len(), 3);
        let ph = &e[&KeyRaw::new(a("10.0.0.1:4000"), None)];
        assert!(ph.is_placeholder());
        assert_eq!(ph.flags, flags::NARROWED | flags::ONE_SOURCE);
        assert_eq!(ph.source, Some(a("10.0.1.1:5000")), "the owner's remote");
        let low = &e[&KeyRaw::new(a("10.0.0.1:4000"), Some(1))];
        // It has a consumer: its sender reports go up to be timed (the consumer's RTT).
        assert_eq!(low.flags, flags::PRESENT | flags::RTP | flags::RTCP_UP);
        assert_eq!(low.copies, vec![CopyRaw::new(low.id, consumer, a("10.0.0.1:4002"), a("10.0.1.2:5000"))]);
        // p1 subscribes: its RTCP is feedback.
        let main = &e[&KeyRaw::new(a("10.0.0.1:4002"), None)];
        assert_eq!(main.flags, flags::PRESENT | flags::RTP | flags::ONE_SOURCE | flags::FEEDBACK);
        // Restricting to one local only yields its entries.
        let only: BTreeSet<_> = [a("10.0.0.1:4002")].into();
        assert_eq!(kernel_entries(&t, Some(&only)).len(), 1);
    }

    #[test]
    fn a_subscriber_that_publishes_nothing_gets_a_feedback_placeholder() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "p0", a("10.0.0.1:4000"), a("10.0.1.1:5000")).unwrap();
        m.add_participant("r", "p1", a("10.0.0.1:4002"), a("10.0.1.2:5000")).unwrap();
        m.publish("r", "p0", "low", StreamSpec { ssrc: Some(1), ..Default::default() }).unwrap();
        m.subscribe("r", "p1", StreamRef { publisher: "p0".into(), stream: "low".into() }).unwrap();
        m.subscribe("r", "p0", StreamRef { publisher: "p0".into(), stream: "low".into() }).unwrap_err();
        let e = kernel_entries(&ForwardingTable::compile(&m, 1), None);
        let ph = &e[&KeyRaw::new(a("10.0.0.1:4002"), None)];
        assert!(ph.is_placeholder());
        // Not ONE_SOURCE: the pre-filter must not drop a stranger's non-RTCP there as a
        // stranger (classify calls it NoStream); TC tells the two apart.
        assert_eq!((ph.flags, ph.source), (flags::FEEDBACK, Some(a("10.0.1.2:5000"))));
        // The publisher subscribes to nothing: its narrowed-only placeholder stays as it was.
        assert_eq!(e[&KeyRaw::new(a("10.0.0.1:4000"), None)].flags, flags::NARROWED | flags::ONE_SOURCE);
    }

    #[test]
    fn a_leg_whose_dtmf_is_reported_passes_up_only_its_event_payload_types() {
        use mediaplane_core::model::{LegSpec, MediaControl, Side};
        let mut m = Model::new();
        let leg = |local: &str, remote: &str| LegSpec { local: a(local), remote: Some(a(remote)), strict: false, rtp: true, follow: Default::default() };
        m.create_relay("call", leg("10.0.0.1:6000", "10.0.2.1:4000"), leg("10.0.0.1:6002", "10.0.2.2:4000")).unwrap();
        m.set_leg_telephone_events("call", Side::A, vec![101]).unwrap();
        m.set_leg_telephone_events("call", Side::B, vec![96]).unwrap();
        let from_a = |m: &Model| kernel_entries(&ForwardingTable::compile(m, 1), None)[&KeyRaw::new(a("10.0.0.1:6000"), None)].clone();
        assert_eq!(from_a(&m).flags & (flags::PT_UP | flags::SLOW), 0);
        m.set_report_dtmf("call", true).unwrap();
        let s = from_a(&m);
        assert_eq!(s.flags & (flags::PT_UP | flags::SLOW), flags::PT_UP);
        assert_eq!((s.copies.len(), s.layer), (1, (96, 101)), "the kernel still forwards, events of either number go up");
        assert_eq!(s.value(0, 0).codec, 101);
        // Judged per packet (blocked DTMF): the whole leg goes up, as before.
        m.set_media_control("call", Some(Side::A), MediaControl { block_dtmf: true, ..Default::default() }).unwrap();
        assert_eq!(from_a(&m).flags & (flags::PT_UP | flags::SLOW), flags::SLOW);
    }

    #[test]
    fn mixed_family_streams_go_slow() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "v4", a("10.0.0.1:4000"), a("10.0.1.1:5000")).unwrap();
        m.add_participant("r", "v6", a("[fd00::1]:4000"), a("[fd00::2]:5000")).unwrap();
        m.publish("r", "v4", "main", StreamSpec::default()).unwrap();
        m.subscribe("r", "v6", StreamRef { publisher: "v4".into(), stream: "main".into() }).unwrap();
        let t = ForwardingTable::compile(&m, 1);
        let e = kernel_entries(&t, None);
        let s = &e[&KeyRaw::new(a("10.0.0.1:4000"), None)];
        assert_ne!(s.flags & flags::SLOW, 0);
        assert!(s.copies.is_empty());
    }

    #[test]
    fn key_round_trips_addresses() {
        for s in ["10.1.2.3:4000", "[fd00::7]:9"] {
            let k = KeyRaw::new(a(s), Some(7));
            assert_eq!(k.local(), a(s));
            assert_eq!(k.ssrc(), Some(7));
            assert_eq!(KeyRaw::from_bytes(k.as_bytes()), k);
        }
    }
}
