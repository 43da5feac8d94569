//! The [`Dataplane`] trait that every forwarding path implements, the counters they report, and
//! the portable user-space data plane ([`userspace::UserspaceDataplane`]).
//!
//! A data plane is a driver: it installs [`ForwardingTable`]s compiled by the core and moves
//! packets according to [`ForwardingTable::classify`]; it never decides anything the table does
//! not say. Slow-path events (a source to latch) go back to the control plane as [`DataplaneEvent`]s.

pub mod afxdp;
pub mod engine;
pub mod kernel_layers;
pub mod netlink;
pub mod reassembly;
pub mod record;
pub mod srtp;
pub mod sys;
pub mod userspace;

use mediaplane_core::reception::ReceptionReport;
use mediaplane_core::table::{DropReason, IngressKey, SlowReason};
use mediaplane_core::ForwardingTable;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

pub use userspace::{MarkAck, UserspaceConfig, UserspaceDataplane};

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("cannot bind {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("{0}")]
    Unsupported(String),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    /// A bounded table of the data plane (a kernel map) has no room for the update; nothing
    /// was changed. Size it in the configuration (`dataplane.max_streams`, `max_copies`).
    #[error("{0}")]
    Full(String),
    #[error("{0}")]
    Other(String),
}

/// Something the slow path learned that the control plane must decide on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataplaneEvent {
    /// A relay leg learning its source heard `source`, which it does not follow yet (the packet
    /// was relayed).
    Unlatched { stream: u32, source: SocketAddr },
    /// RTCP of a stream with [`mediaplane_core::StreamEntry::evaluate_rtcp`], as relayed (clear,
    /// after SRTCP) from `source`, for the control plane's report evaluation. `at_ns`: when it
    /// arrived ([`monotonic_ns`]); `wall_us`: the same on the wall clock (µs since the Unix
    /// epoch). At most [`RTCP_REPORTS_PER_SECOND`] per stream, none over [`MAX_RTCP_REPORT`].
    Rtcp { stream: u32, source: SocketAddr, at_ns: u64, wall_us: u64, packet: Vec<u8> },
    /// STUN or DTLS that arrived at `local` from `source` for a stream with
    /// [`mediaplane_core::StreamEntry::handshake`] (an ICE + DTLS-SRTP leg): the control plane
    /// answers it with [`Dataplane::send_datagram`]. `at_ns` as for `Rtcp`.
    Handshake { stream: u32, local: SocketAddr, source: SocketAddr, at_ns: u64, packet: Vec<u8> },
    /// A packet on WebRTC transport `transport` (the id of its table entry) on an SSRC no
    /// stream claims named simulcast encoding `rid` of section `mid` (see
    /// [`mediaplane_core::pipeline::Effect::StreamId`]); each worker reports one SSRC at most
    /// every 100 ms.
    StreamId { transport: u32, ssrc: u32, mid: Option<String>, rid: String },
    /// The end of an RFC 4733 event that `source` sent on a stream whose events are reported
    /// ([`mediaplane_core::table::StreamControl::report_dtmf`]): once per event (its repeated
    /// end packets are not reported again), at most [`RTCP_REPORTS_PER_SECOND`] per stream.
    /// `event`: the event's report (code, E/R/volume, duration); `wall_us` as for `Rtcp`.
    Dtmf { stream: u32, source: SocketAddr, ssrc: u32, payload_type: u8, timestamp: u32, event: [u8; 4], wall_us: u64 },
}

/// Events queued for the control plane before the data plane drops new ones (counted as
/// `events_dropped`): a flood of reports must not grow memory without bound.
pub const EVENT_QUEUE: usize = 4096;
/// RTCP reports per stream and second a worker hands to the control plane (endpoints send one
/// every few seconds, RFC 3550 6.2; a stream's source is one flow, which stays on one worker);
/// more are relayed but not evaluated, so a flood neither fills the queue that source learning
/// shares nor costs the control plane.
pub const RTCP_REPORTS_PER_SECOND: u32 = 20;
/// Larger RTCP is relayed but not evaluated (a report with 31 blocks is 772 bytes).
pub const MAX_RTCP_REPORT: usize = 1500;

/// The channel a data plane reports [`DataplaneEvent`]s on, bounded by [`EVENT_QUEUE`].
pub fn event_channel() -> (SyncSender<DataplaneEvent>, Receiver<DataplaneEvent>) {
    std::sync::mpsc::sync_channel(EVENT_QUEUE)
}

/// What the IP header of every copy carries, on every plane and both paths of the kernel plane
/// (a copy is a packet the SFU itself sends): the host's TTL / hop limit, the DSCP of the policy,
/// ECN Not-ECT, IPv4 DF set with an ID of the SFU's own (as a Linux UDP socket sends what fits
/// the path: DF, and an ID from its generator), IPv6 flow label 0.
///
/// A copy larger than its path MTU is fragmented by the kernel as it fragments UDP: its
/// fragments carry no DF (the same on both planes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderPolicy {
    pub ttl: u8,
    pub hop_limit: u8,
    /// 0..=63.
    pub dscp: u8,
}

impl Default for HeaderPolicy {
    fn default() -> Self {
        HeaderPolicy { ttl: 64, hop_limit: 64, dscp: 0 }
    }
}

impl HeaderPolicy {
    /// The calling thread's namespace defaults (`net.ipv4.ip_default_ttl`,
    /// `net.ipv6.conf.all.hop_limit`) with `dscp`.
    pub fn from_host(dscp: u8) -> HeaderPolicy {
        let read = |path: &str| std::fs::read_to_string(path).ok().and_then(|v| v.trim().parse::<u8>().ok()).filter(|v| *v > 0);
        HeaderPolicy {
            ttl: read("/proc/sys/net/ipv4/ip_default_ttl").unwrap_or(64),
            hop_limit: read("/proc/sys/net/ipv6/conf/all/hop_limit").unwrap_or(64),
            dscp: dscp & 0x3f,
        }
    }

    /// IPv4 TOS / IPv6 traffic class byte.
    pub fn tos(&self) -> u8 {
        (self.dscp & 0x3f) << 2
    }
}

/// Packet counters. The same shape is used per stream and for a whole data plane.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Packets and bytes (UDP payload) received on SFU addresses.
    pub rx_packets: u64,
    pub rx_bytes: u64,
    /// Copies sent and their UDP payload bytes.
    pub tx_copies: u64,
    pub tx_bytes: u64,
    /// Copies that could not be sent (socket error, no route or neighbour, SRTP protect failed).
    pub tx_errors: u64,
    /// Copies not made because their subscriber speaks SRTP but has no key yet (a browser before
    /// its DTLS handshake is done, an SDES leg before the answer): expected at every join, so
    /// not among `tx_errors`.
    #[serde(default)]
    pub tx_unkeyed: u64,
    pub drop_no_stream: u64,
    pub drop_stranger: u64,
    pub drop_malformed: u64,
    pub slow_stun: u64,
    pub slow_unlatched: u64,
    /// DTLS of an ICE leg handed to the control plane (its STUN counts as `slow_stun`).
    #[serde(default)]
    pub slow_handshake: u64,
    /// From the registered source but over the stream's rate limit.
    #[serde(default)]
    pub drop_rate_limited: u64,
    /// Over the per-source (IP address) limit ([`ForwardingTable::source_limit`]). Counted in
    /// totals only: a source is not a stream.
    #[serde(default)]
    pub drop_source_limited: u64,
    /// Invalid checksums (IPv4 header, UDP; zero UDP checksum on IPv6) from a stream's source,
    /// dropped by the kernel path. The user-space plane never sees these (the host drops them
    /// first, counted in its own `UdpInCsumErrors`/`IpInHdrErrors`; see `extra`).
    #[serde(default)]
    pub drop_bad_checksum: u64,
    /// Sources that fail the reverse-path check (rp_filter) on their ingress interface, dropped
    /// by the kernel path (for the user-space plane the host drops them: `IPReversePathFilter`).
    #[serde(default)]
    pub drop_spoofed: u64,
    /// RTP that call control blocks (NG `block media`, `block DTMF`): the party is heard (it
    /// counts as received), not passed on. Not an error.
    #[serde(default)]
    pub drop_blocked: u64,
    /// RTCP feedback messages of consumers ([`mediaplane_core::feedback`]): sent on to the
    /// publisher; keyframe requests coalesced (one went shortly before); consumed by the SFU
    /// (receiver reports, REMB, TWCC...); naming an SSRC the consumer does not receive. Per
    /// stream: the published stream they were about (routed, coalesced).
    #[serde(default)]
    pub feedback_routed: u64,
    #[serde(default)]
    pub feedback_coalesced: u64,
    #[serde(default)]
    pub feedback_consumed: u64,
    #[serde(default)]
    pub feedback_unroutable: u64,
    /// Per stream (0 in totals): when the stream last accepted a packet from its source (or from
    /// a source it is learning): [`monotonic_ns`] nanoseconds, the kernel's `bpf_ktime_get_ns` clock; 0 =
    /// never. A time, not a counter: [`Counters::add`] keeps the later of two. Strangers and
    /// rate-limited packets do not move it, so they cannot keep an idle call alive.
    #[serde(default)]
    pub last_rx_ns: u64,
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of [`Counters::last_rx_ns`] on every data plane.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Counters {
    pub fn add(&mut self, o: &Counters) {
        self.rx_packets += o.rx_packets;
        self.rx_bytes += o.rx_bytes;
        self.tx_copies += o.tx_copies;
        self.tx_bytes += o.tx_bytes;
        self.tx_errors += o.tx_errors;
        self.tx_unkeyed += o.tx_unkeyed;
        self.drop_no_stream += o.drop_no_stream;
        self.drop_stranger += o.drop_stranger;
        self.drop_malformed += o.drop_malformed;
        self.slow_stun += o.slow_stun;
        self.slow_unlatched += o.slow_unlatched;
        self.slow_handshake += o.slow_handshake;
        self.drop_rate_limited += o.drop_rate_limited;
        self.drop_source_limited += o.drop_source_limited;
        self.drop_bad_checksum += o.drop_bad_checksum;
        self.drop_spoofed += o.drop_spoofed;
        self.drop_blocked += o.drop_blocked;
        self.feedback_routed += o.feedback_routed;
        self.feedback_coalesced += o.feedback_coalesced;
        self.feedback_consumed += o.feedback_consumed;
        self.feedback_unroutable += o.feedback_unroutable;
        self.last_rx_ns = self.last_rx_ns.max(o.last_rx_ns);
    }

    pub fn count_drop(&mut self, reason: DropReason) {
        match reason {
            DropReason::NoStream => self.drop_no_stream += 1,
            DropReason::Stranger => self.drop_stranger += 1,
            DropReason::Malformed => self.drop_malformed += 1,
            DropReason::BadChecksum => self.drop_bad_checksum += 1,
            DropReason::Spoofed => self.drop_spoofed += 1,
        }
    }

    /// Count a drop of the per-packet pipeline (the model's, or a limit's, or a packet that did
    /// not unprotect or parse).
    pub fn count_dropped(&mut self, why: mediaplane_core::pipeline::Dropped) {
        use mediaplane_core::pipeline::Dropped;
        match why {
            Dropped::Model(reason) => self.count_drop(reason),
            Dropped::SourceLimited => self.drop_source_limited += 1,
            Dropped::RateLimited => self.drop_rate_limited += 1,
            Dropped::Malformed | Dropped::MalformedFeedback => self.drop_malformed += 1,
            Dropped::Blocked => self.drop_blocked += 1,
        }
    }

    /// Count what became of a consumer's feedback messages.
    pub fn count_feedback(&mut self, t: &mediaplane_core::feedback::Tally) {
        self.feedback_routed += t.routed;
        self.feedback_coalesced += t.coalesced;
        self.feedback_consumed += t.consumed;
        self.feedback_unroutable += t.unroutable;
    }

    pub fn count_slow(&mut self, reason: SlowReason) {
        match reason {
            SlowReason::Stun => self.slow_stun += 1,
            SlowReason::Unlatched => self.slow_unlatched += 1,
            SlowReason::Handshake => self.slow_handshake += 1,
        }
    }

    /// (name, value) pairs of the counters (not [`Counters::last_rx_ns`]), for metrics exposition.
    pub fn fields(&self) -> [(&'static str, u64); 21] {
        [
            ("rx_packets", self.rx_packets),
            ("rx_bytes", self.rx_bytes),
            ("tx_copies", self.tx_copies),
            ("tx_bytes", self.tx_bytes),
            ("tx_errors", self.tx_errors),
            ("tx_unkeyed", self.tx_unkeyed),
            ("drop_no_stream", self.drop_no_stream),
            ("drop_stranger", self.drop_stranger),
            ("drop_malformed", self.drop_malformed),
            ("slow_stun", self.slow_stun),
            ("slow_unlatched", self.slow_unlatched),
            ("slow_handshake", self.slow_handshake),
            ("drop_rate_limited", self.drop_rate_limited),
            ("drop_source_limited", self.drop_source_limited),
            ("drop_bad_checksum", self.drop_bad_checksum),
            ("drop_spoofed", self.drop_spoofed),
            ("drop_blocked", self.drop_blocked),
            ("feedback_routed", self.feedback_routed),
            ("feedback_coalesced", self.feedback_coalesced),
            ("feedback_consumed", self.feedback_consumed),
            ("feedback_unroutable", self.feedback_unroutable),
        ]
    }
}

/// One consumer's counters ([`mediaplane_core::model::Consumer`]): the copies a data plane sent
/// it, and what its RTCP said about the stream it receives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerCounters {
    /// Copies sent for it and their UDP payload bytes; copies that could not be sent.
    pub tx_copies: u64,
    pub tx_bytes: u64,
    pub tx_errors: u64,
    /// Its feedback about the stream: sent on to the publisher / keyframe requests coalesced.
    #[serde(default)]
    pub feedback_routed: u64,
    #[serde(default)]
    pub feedback_coalesced: u64,
    /// Its latest receiver report block about the stream, as received.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<ConsumerReport>,
    /// Its latest REMB naming the stream's SSRC: the receiver's estimate, bits per second, and
    /// when it arrived ([`monotonic_ns`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remb_bps: Option<u64>,
    #[serde(default)]
    pub remb_at_ns: u64,
    /// The round-trip time (µs) between the SFU and the consumer, from its latest report block
    /// that echoed a sender report the SFU forwarded it (RFC 3550 6.4.1: arrival − when that SR
    /// passed − DLSR), and when that report arrived ([`monotonic_ns`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rtt_us: Option<u64>,
    #[serde(default)]
    pub rtt_at_ns: u64,
    /// A consumer of a simulcast stream: the layer it receives and how it got there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<LayerState>,
}

/// A simulcast consumer's layer ([`mediaplane_core::simulcast::LayerRewriter`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerState {
    /// The layer it receives (none before the first keyframe), and the one it should.
    pub current: Option<u8>,
    pub target: Option<u8>,
    /// The highest temporal layer it takes now (None: all).
    #[serde(default)]
    pub temporal_current: Option<u8>,
    /// The SSRC it receives on, whichever layer.
    pub ssrc: u32,
    pub stats: mediaplane_core::simulcast::RewriteStats,
    /// The highest layer its own reports allow now (None: no limit; see `layer_choice`).
    pub auto_limit: Option<u8>,
    pub choice: mediaplane_core::layer_choice::ChoiceStats,
    /// Layers of the stream its publisher does not send now (bit i: layer i).
    pub absent: u8,
}

/// A receiver report block of a consumer (RFC 3550 6.4.1): its view of what the SFU sent it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerReport {
    /// Fraction of packets lost since its previous report, in 1/256.
    pub fraction_lost: u8,
    pub cumulative_lost: i32,
    /// Extended highest sequence number received.
    pub highest_seq: u32,
    /// Interarrival jitter, RTP timestamp units.
    pub jitter: u32,
    /// When it arrived ([`monotonic_ns`]).
    pub at_ns: u64,
}

impl ConsumerCounters {
    /// Add `o`'s counts; the later report and estimate win.
    pub fn add(&mut self, o: &ConsumerCounters) {
        self.tx_copies += o.tx_copies;
        self.tx_bytes += o.tx_bytes;
        self.tx_errors += o.tx_errors;
        self.feedback_routed += o.feedback_routed;
        self.feedback_coalesced += o.feedback_coalesced;
        if o.report.is_some_and(|r| self.report.is_none_or(|mine| r.at_ns >= mine.at_ns)) {
            self.report = o.report;
        }
        if o.remb_bps.is_some() && (self.remb_bps.is_none() || o.remb_at_ns >= self.remb_at_ns) {
            (self.remb_bps, self.remb_at_ns) = (o.remb_bps, o.remb_at_ns);
        }
        if o.rtt_us.is_some() && (self.rtt_us.is_none() || o.rtt_at_ns >= self.rtt_at_ns) {
            (self.rtt_us, self.rtt_at_ns) = (o.rtt_us, o.rtt_at_ns);
        }
        if o.layer.is_some() {
            self.layer = o.layer;
        }
    }
}

/// Summary of a latency histogram in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub min_ns: u64,
    pub p50_ns: u64,
    pub mean_ns: f64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

/// Cumulative latency histogram: `cumulative[i]` observations took less than `bounds_ns[i]`
/// (a Prometheus histogram's buckets, `+Inf` being `count`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyHistogram {
    pub bounds_ns: Vec<u64>,
    pub cumulative: Vec<u64>,
    pub count: u64,
    pub sum_ns: u64,
}

/// Bucket bounds of [`DataplaneStats::copy_latency_histogram`]: powers of two from 64 ns to
/// about 4 ms, which are also bucket bounds of the kernel's log-linear histogram (so the
/// coarser buckets are exact sums of its buckets).
pub const COPY_LATENCY_BOUNDS_NS: [u64; 17] = {
    let mut b = [0u64; 17];
    let mut i = 0;
    while i < 17 {
        b[i] = 64 << i;
        i += 1;
    }
    b
};

/// How full one bounded table of a data plane is (a kernel map, as Katran reports them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapFill {
    pub entries: u64,
    pub capacity: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DataplaneStats {
    pub dataplane: String,
    /// Version of the table currently installed.
    pub table_version: u64,
    pub total: Counters,
    /// Per stream id (see [`mediaplane_core::StreamEntry::id`]).
    pub streams: BTreeMap<u32, Counters>,
    /// Per-copy processing time inside the data plane, where it measures it.
    pub copy_latency: Option<LatencySummary>,
    /// The same measurements in buckets, where the data plane keeps them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_latency_histogram: Option<LatencyHistogram>,
    /// Counters particular to one data plane (e.g. kernel verdicts), by name.
    pub extra: BTreeMap<String, u64>,
    /// Fill of the data plane's bounded tables, by table name (none for a plane without any).
    #[serde(default)]
    pub maps: BTreeMap<String, MapFill>,
    /// In-path reception quality of each RTP stream (by stream id) that has had a packet
    /// accepted: loss, duplicates, reordering, jitter ([`mediaplane_core::reception`]). Where a
    /// stream's packets took two paths (the kernel's and the slow path), the one that carried
    /// more of them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub reception: BTreeMap<u32, ReceptionReport>,
}

/// A forwarding path. Implementations must be safe to call from any thread.
pub trait Dataplane: Send + Sync {
    /// "userspace", "ebpf", ...
    fn name(&self) -> &'static str;

    /// Install `table`. Atomic: each packet sees either the old or the new table, never a mix,
    /// so an update never yields a duplicate or a copy to a removed subscriber.
    fn apply(&self, table: Arc<ForwardingTable>) -> Result<(), DataplaneError>;

    /// Install `table`, which differs from the installed one only at `changed` (the keys
    /// [`ForwardingTable::update`] returned). Same atomicity as [`Dataplane::apply`]; data planes
    /// that can update in place override it so a change costs what changed, not the table size.
    fn apply_changes(&self, table: Arc<ForwardingTable>, changed: &[IngressKey]) -> Result<(), DataplaneError> {
        let _ = changed;
        self.apply(table)
    }

    fn stats(&self) -> DataplaneStats;

    /// [`Dataplane::stats`] without the per-stream counters (`streams` empty), for readers of
    /// totals only (`/metrics`); data planes that read those per stream override it.
    fn stats_totals(&self) -> DataplaneStats {
        let mut s = self.stats();
        s.streams.clear();
        s.reception.clear();
        s
    }

    /// Counters of these consumers (see [`mediaplane_core::table::Copy::consumer`]; absent: no
    /// copy or feedback yet). Read on demand only, never with [`Dataplane::stats`]: there are
    /// N×(N−1) of them in a room of N publishers. A plane without consumers has none.
    fn consumer_counters(&self, ids: &[u32]) -> BTreeMap<u32, ConsumerCounters> {
        let _ = ids;
        BTreeMap::new()
    }

    /// What these consumers were sent, as it left: the same accounting as a stream's reception
    /// ([`mediaplane_core::reception`]) over the RTP copies sent to each, with the headers they
    /// carried (a simulcast consumer's renumbered ones): loss passed on, duplicates and
    /// reordering forwarded, jitter of the stream as the consumer got it (timed at the packet's
    /// arrival). Absent: no RTP copy sent yet. Read on demand, as [`Dataplane::consumer_counters`].
    fn consumer_reception(&self, ids: &[u32]) -> BTreeMap<u32, ReceptionReport> {
        let _ = ids;
        BTreeMap::new()
    }

    /// Reception quality of just these streams (absent: no RTP packet accepted yet); the
    /// per-stream counterpart of [`DataplaneStats::reception`], overridden as
    /// [`Dataplane::stream_counters`] is.
    fn stream_reception(&self, ids: &[u32]) -> BTreeMap<u32, ReceptionReport> {
        let s = self.stats();
        ids.iter().filter_map(|id| s.reception.get(id).map(|r| (*id, *r))).collect()
    }

    /// Counters of just these streams (absent: no counters yet). Data planes whose full
    /// [`Dataplane::stats`] costs a read per installed stream override it, so that callers
    /// watching a few streams (the NG media timeout) do not pay for every session.
    fn stream_counters(&self, ids: &[u32]) -> BTreeMap<u32, Counters> {
        let s = self.stats();
        ids.iter().filter_map(|id| s.streams.get(id).map(|c| (*id, *c))).collect()
    }

    /// Send one datagram from the relay address `from` (an installed stream's local address)
    /// to `to`: the control plane's own packets on a media port (STUN responses, DTLS).
    fn send_datagram(&self, from: SocketAddr, to: SocketAddr, payload: &[u8]) -> Result<(), DataplaneError> {
        let _ = (from, to, payload);
        Err(DataplaneError::Unsupported(format!("the {} data plane sends no datagrams of its own", self.name())))
    }

    /// Stop forwarding and release everything this data plane created (sockets, programs, pins).
    fn shutdown(&self) -> Result<(), DataplaneError>;
}
