//! The per-packet engine, sans-I/O (quinn-proto beside quinn-udp; str0m): every piece of state a
//! data plane's per-packet decisions depend on, owned by one object that takes time as an
//! argument and returns what to do. A driver (the socket plane, the eBPF plane's slow path, which
//! is the socket plane in steered mode) receives datagrams, calls [`Engine::handle_datagram`],
//! carries out the [`Output`]s in their order, tells the engine what it sent
//! ([`Engine::on_transmitted`]), and runs [`Engine::handle_timeout`] when
//! [`Engine::poll_timeout`] says so. It holds no decision code and no periodic thread.
//!
//! What the engine owns: the pipeline's stream rate limits ([`Pipeline`]), the per-source
//! buckets, the feedback router, the simulcast consumers (their rewriters and layer choices,
//! what publishers send of each layer), reception quality as received and as forwarded, the
//! times sender reports passed, the arrivals fed back to publishers' transports (transport-cc),
//! every counter, and the throttles on what goes to the control
//! plane. What it is handed: the installed table, the SRTP contexts through [`Crypto`] (libsrtp
//! in [`crate::srtp`]), and with the eBPF plane the kernel's simulcast states
//! ([`KernelLayers`]).
//!
//! One engine serves all of a plane's workers, behind one lock taken per received batch for the
//! decisions and once more for what the batch sent (never across a system call): a stream's
//! state and a consumer's feedback are one, whichever worker SO_REUSEPORT put their flows on.

use crate::kernel_layers::{KernelLayers, KernelReceived, RECONCILE_TICKS, TICK_NS};
use crate::{ConsumerCounters, ConsumerReport, Counters, DataplaneEvent, DataplaneStats, LayerState};
use mediaplane_core::call_quality::{build_report, ReportBlock, SenderReportTimes};
use mediaplane_core::feedback::{FeedbackEntry, FeedbackRouter, LayerMap, Outcome};
use mediaplane_core::layer_choice::{self, LayerActivity, LayerChoice};
use mediaplane_core::pipeline::{CopyOf, CopyRtp, Effect, LayerFanOut, Pipeline, Plane};
use mediaplane_core::ratelimit::{RateLimit, RateParams, RateState};
use mediaplane_core::reception::{ReceptionReport, RtpReception};
use mediaplane_core::remote_estimate::{self, RemoteEstimate, VIDEO_CLOCK_RATE};
use mediaplane_core::rtp::{demux, MediaKind};
use mediaplane_core::send_history::SendHistory;
use mediaplane_core::simulcast::{self, Decision, LayerRewriter};
use mediaplane_core::srtp::{Protection, SrtpKey};
use mediaplane_core::table::{IngressKey, SimulcastLayer, SlowReason, SourceRule, StreamEntry};
use mediaplane_core::transport_feedback::{self, TransportFeedback};
use mediaplane_core::ForwardingTable;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// The SRTP contexts the engine protects and unprotects with (one per SFU address and
/// direction); libsrtp's in the planes ([`crate::srtp::Contexts`]).
pub trait Crypto {
    /// An SRTP or SRTCP packet that arrived at `at`, unprotected with the address's inbound
    /// `key`; None: dropped (no key, failed authentication, a replay: counted by the contexts).
    fn unprotect(&mut self, at: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>>;
    /// A packet sent from `from`, protected with the address's outbound `key`; None: not sent.
    fn protect(&mut self, from: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>>;
}

/// No crypto: every SRTP packet is dropped and no protected copy is made (tests, and a table
/// without SRTP legs).
pub struct NoCrypto;

impl Crypto for NoCrypto {
    fn unprotect(&mut self, _: SocketAddr, _: Option<&SrtpKey>, _: &[u8]) -> Option<Vec<u8>> {
        None
    }
    fn protect(&mut self, _: SocketAddr, _: Option<&SrtpKey>, _: &[u8]) -> Option<Vec<u8>> {
        None
    }
}

/// The clocks a datagram or a timeout is handled at.
#[derive(Debug, Clone, Copy)]
pub struct Now {
    /// The rate limits' clock (monotonic ns, never 0).
    pub limits_ns: u64,
    /// CLOCK_MONOTONIC ns ([`crate::monotonic_ns`]): measurements, feedback, timers.
    pub mono_ns: u64,
    /// The wall clock, µs since the Unix epoch (RTCP handed to the control plane).
    pub wall_us: u64,
}

impl Now {
    /// A kernel receive time on the wall clock (ns, SO_TIMESTAMPNS) as a monotonic time, by
    /// this reading's offset between the clocks; None if it is not within the last second (a
    /// wall clock stepped since, or a datagram that waited that long: the reading stands in).
    pub fn arrival(&self, realtime_ns: i64) -> Option<u64> {
        let waited = (self.wall_us as i64 * 1_000).checked_sub(realtime_ns)?.max(0) as u64;
        (waited < 1_000_000_000).then(|| self.mono_ns.saturating_sub(waited))
    }

    /// The clocks as they read now.
    pub fn read() -> Now {
        let wall_us = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        Now { limits_ns: limits_clock_ns(), mono_ns: crate::monotonic_ns(), wall_us }
    }
}

/// Monotonic nanoseconds since the first call, plus 1 s (the buckets' clock: a zero theoretical
/// arrival time is "idle", never "in the future").
pub fn limits_clock_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64 + 1_000_000_000
}

/// One received datagram as the driver read it.
#[derive(Debug, Clone, Copy)]
pub struct Datagram<'p> {
    /// The SFU address it arrived at (None: unknown, a catch-all socket without the control
    /// message).
    pub local: Option<SocketAddr>,
    /// Its source (None: not an IP address).
    pub src: Option<SocketAddr>,
    /// Cut short by the receive buffer.
    pub truncated: bool,
    pub payload: &'p [u8],
    /// When the kernel received it, on the monotonic clock ([`Now::arrival`]; None: not known,
    /// the batch's reading stands in). What publishers' transports are told of their arrivals.
    pub arrived_ns: Option<u64>,
}

/// What the driver does, in order.
#[derive(Debug)]
pub enum Output<'p> {
    /// Send `packet` from the SFU address `from` to `to`, then report it with
    /// [`Engine::on_transmitted`]; `copy`: what it is a copy of (None: feedback or a keyframe
    /// request to a publisher). `seal`: `packet` is clear; protect it with `from`'s outbound
    /// SRTP context first, outside the engine's lock (encrypting copies for different
    /// subscribers then runs on every worker at once). If that fails it is not sent: a copy is
    /// reported not sent, anything else not at all.
    Transmit { from: SocketAddr, to: SocketAddr, packet: Cow<'p, [u8]>, copy: Option<CopyOf>, seal: bool },
    /// For the control plane (never blocks the driver: a full queue drops it).
    Event(DataplaneEvent),
    /// A recorded stream's packet, clear, as it arrived from `src` at `local`.
    Record { stream: u32, label: String, src: SocketAddr, local: SocketAddr, packet: Cow<'p, [u8]> },
}

/// How the engine is set up.
#[derive(Clone, Default)]
pub struct EngineConfig {
    /// Measure each consumer's RTP as forwarded ([`crate::userspace::UserspaceConfig::forwarded_qos`]).
    pub forwarded_qos: bool,
    /// Keep what video consumers were sent, to answer their NACKs ([`SendHistory`]); off, their
    /// NACKs go to the publisher.
    pub retransmit: bool,
    /// The control plane takes events: report what it must decide on (otherwise nothing is).
    pub events: bool,
    /// The kernel's simulcast states, when this engine is the eBPF plane's slow path.
    pub kernel_layers: Option<Arc<dyn KernelLayers>>,
}

/// Every counter the engine keeps.
#[derive(Default)]
struct Accounting {
    total: Counters,
    streams: HashMap<u32, Counters>,
    consumers: HashMap<u32, ConsumerCounters>,
}

impl Accounting {
    /// A copy of stream `stream` was not made: its subscriber has no SRTP key yet (not an error).
    fn count_unkeyed(&mut self, stream: u32) {
        self.streams.entry(stream).or_default().tx_unkeyed += 1;
        self.total.tx_unkeyed += 1;
    }

    /// A copy of stream `stream` for `consumer` (0: none, a relay leg's copy) went out, or not.
    fn count_copy(&mut self, stream: u32, consumer: u32, bytes: usize, sent: bool) {
        let sc = self.streams.entry(stream).or_default();
        let cc = (consumer != 0).then(|| self.consumers.entry(consumer).or_default());
        if sent {
            sc.tx_copies += 1;
            sc.tx_bytes += bytes as u64;
            self.total.tx_copies += 1;
            self.total.tx_bytes += bytes as u64;
            if let Some(cc) = cc {
                cc.tx_copies += 1;
                cc.tx_bytes += bytes as u64;
            }
        } else {
            sc.tx_errors += 1;
            self.total.tx_errors += 1;
            if let Some(cc) = cc {
                cc.tx_errors += 1;
            }
        }
    }
}

#[derive(Default)]
struct SimulcastState {
    consumers: HashMap<u32, LayerConsumer>,
    /// What each simulcast stream's publisher sends, by the stream's uid (`SimulcastLayer::group`).
    activity: HashMap<u32, LayerActivity>,
    /// With kernel states: what the kernel had received of each layer stream at the last tick,
    /// by stream id.
    kernel_rx: HashMap<u32, KernelReceived>,
    /// With kernel states: the consumers of the installed table that some stream the kernel
    /// forwards itself copies to ([`KernelLayers::judges`]). Their states live in the kernel.
    kernel_judged: HashSet<u32>,
}

/// One simulcast consumer: the layer it should get (from the API's ceiling, its reports and
/// what is sent) and the renumbering of what it gets.
struct LayerConsumer {
    /// In the kernel, a mirror of the kernel's: refreshed before a packet, a NACK or the API
    /// reads it; by the tick while the consumer is new or on its way to a layer, and once a
    /// second when settled (see [`Engine::handle_timeout`]). Else the state itself.
    rewriter: LayerRewriter,
    /// Its state lives in the kernel: the kernel makes the copies of some stream of it, and its
    /// rules, one packet at a time, are then the only ones that may change the state. A
    /// consumer only the slow path serves (every stream of it SRTP, recorded, too big…) is
    /// decided here without a syscall. Set when the consumer is first seen; a consumer the
    /// kernel comes to serve is handed over at the install ([`Engine::forget`]); one the kernel
    /// stops serving stays there (the slow path cannot know when the kernel's last copy of it
    /// was made: a rare change, and it costs only the syscalls).
    in_kernel: bool,
    choice: LayerChoice,
    /// Its stream's uid, for the activity the choice reads.
    group: u32,
    /// With kernel states: the target and temporal ceiling last written there.
    kernel_target: Option<(Option<u8>, Option<u8>)>,
}

impl LayerConsumer {
    fn new(rewriter: LayerRewriter, group: u32, in_kernel: bool) -> LayerConsumer {
        LayerConsumer { rewriter, choice: LayerChoice::default(), group, kernel_target: None, in_kernel }
    }

    /// The kernel, when its state lives there.
    fn kernel<'k>(&self, kernel: Option<&'k dyn KernelLayers>) -> Option<&'k dyn KernelLayers> {
        kernel.filter(|_| self.in_kernel)
    }

    /// Aim at `target` with the temporal ceiling `temporal`: here, and in the kernel's state
    /// when there is one.
    fn set_target(&mut self, id: u32, target: Option<u8>, temporal: Option<u8>, kernel: Option<&dyn KernelLayers>) {
        self.rewriter.set_target(target);
        self.rewriter.set_temporal(temporal);
        if let Some(k) = kernel {
            // Remembered only once the kernel took it (a state created late is aimed then).
            if self.kernel_target != Some((target, temporal)) && k.set_target(id, target, temporal) {
                self.kernel_target = Some((target, temporal));
            }
        }
    }
}

/// Per-source rate-limit buckets ([`ForwardingTable::source_limit`]), bounded: the least
/// recently seen source is forgotten first (an idle bucket is equal to a fresh one, so only a
/// source active while more than [`SourceBuckets::CAPACITY`] others are loses its state).
pub struct SourceBuckets {
    limit: Option<(RateLimit, RateParams)>,
    buckets: hashlink::LruCache<IpAddr, RateState>,
}

impl Default for SourceBuckets {
    fn default() -> Self {
        Self::with_capacity(Self::CAPACITY)
    }
}

impl SourceBuckets {
    /// Sources whose buckets are kept (as many as the kernel plane keeps).
    pub const CAPACITY: usize = 65536;

    pub fn with_capacity(n: usize) -> Self {
        SourceBuckets { limit: None, buckets: hashlink::LruCache::new(n.max(1)) }
    }

    /// Admit (and charge) a packet of `bytes` payload bytes from `src` at `now_ns` under `limit`.
    /// A changed limit starts every bucket afresh.
    pub fn admit(&mut self, limit: RateLimit, src: IpAddr, now_ns: u64, bytes: u64) -> bool {
        let params = match self.limit {
            Some((l, p)) if l == limit => p,
            _ => {
                self.buckets.clear();
                let p = limit.params();
                self.limit = Some((limit, p));
                p
            }
        };
        if let Some(st) = self.buckets.get_mut(&src) {
            return params.admit(st, now_ns, bytes);
        }
        let mut st = RateState::default();
        let ok = params.admit(&mut st, now_ns, bytes);
        self.buckets.insert(src, st);
        ok
    }

    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }
}

/// How often the RID of one SSRC is reported while no stream claims it.
pub const STREAM_ID_REPORT_NS: u64 = 100_000_000;

/// The sender SSRC of the keyframe requests and transport feedback the SFU makes itself (a
/// simulcast consumer waiting for a layer; a publisher's arrivals): "MPLI".
const SFU_SSRC: u32 = 0x4d50_4c49;

/// The decision state ([`Engine`] without its pipeline, which borrows it as its [`Plane`]).
struct Decider {
    sources: SourceBuckets,
    /// Consumers' feedback: keyframe requests coalesced across subscribers.
    feedback: FeedbackRouter,
    /// Simulcast consumers' layer and renumbering, and what publishers send of each layer.
    layers: SimulcastState,
    kernel: Option<Arc<dyn KernelLayers>>,
    /// What video consumers were sent lately: their NACKs are answered from it.
    history: SendHistory,
}

/// What the pipeline asks of the engine for one datagram: its state, and the crypto.
struct PlaneView<'a> {
    decider: &'a mut Decider,
    crypto: &'a mut dyn Crypto,
}

impl Plane for PlaneView<'_> {
    fn admit_source(&mut self, limit: RateLimit, src: IpAddr, now_ns: u64, bytes: u64) -> bool {
        self.decider.sources.admit(limit, src, now_ns, bytes)
    }

    fn route_feedback(&mut self, entry: &FeedbackEntry, packet: &[u8], now_ns: u64) -> Option<Outcome> {
        let d = &mut *self.decider;
        d.feedback.route_with(entry, packet, now_ns, &Layers(&d.layers.consumers, d.kernel.as_deref(), &d.history)).ok()
    }

    fn unprotect(&mut self, at: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>> {
        self.crypto.unprotect(at, key, packet)
    }

    fn protect(&mut self, from: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>> {
        self.crypto.protect(from, key, packet)
    }

    /// The driver seals ([`Output::Transmit`]'s `seal`).
    fn seals_later(&self) -> bool {
        true
    }

    fn layer_fan_out(&mut self, entry: &StreamEntry, layer: &SimulcastLayer, src: SocketAddr, packet: &[u8], now_ns: u64) -> LayerFanOut {
        self.decider.layer_fan_out(entry, layer, src, packet, now_ns)
    }
}

impl Decider {
    /// The copies of one packet of a simulcast layer: to each consumer receiving that layer now,
    /// renumbered for it ([`LayerRewriter`]); and a keyframe request to the publisher for each
    /// layer a consumer waits for (coalesced with the consumers' own). The table is the
    /// installed one (the engine's lock covers both a batch and an install's forgetting).
    fn layer_fan_out(&mut self, entry: &StreamEntry, layer: &SimulcastLayer, src: SocketAddr, payload: &[u8], now_ns: u64) -> LayerFanOut {
        let kind = demux(payload);
        let info = match kind {
            MediaKind::Rtp => simulcast::inspect(layer.codec, payload),
            _ => None,
        };
        let out_ssrc = layer.layers[0].1;
        let count = layer.layers.len() as u8;
        let mut wanted: Vec<u8> = Vec::new();
        let mut fan = LayerFanOut::default();
        let all_kernel = self.kernel.as_deref();
        let SimulcastState { consumers, activity, kernel_judged, .. } = &mut self.layers;
        let activity = activity.entry(layer.group).or_default();
        if info.is_some() {
            activity.on_packet(layer.index, payload.len(), now_ns);
        }
        for (i, copy) in entry.copies.iter().enumerate() {
            if copy.to == src || copy.consumer == 0 {
                continue;
            }
            let c = consumers.entry(copy.consumer).or_insert_with(|| {
                let in_kernel = all_kernel.is_some() && kernel_judged.contains(&copy.consumer);
                if let Some(k) = all_kernel.filter(|_| in_kernel) {
                    k.create(copy.consumer, out_ssrc, entry.clock_rate);
                }
                LayerConsumer::new(LayerRewriter::new(out_ssrc, entry.clock_rate), layer.group, in_kernel)
            });
            c.group = layer.group;
            let kernel = c.kernel(all_kernel);
            mirror(&mut c.rewriter, copy.consumer, kernel);
            // The compiled layer is the API's ceiling (None: paused); the choice may lower it.
            let target = copy.layer.map(|ceiling| c.choice.choose(ceiling, copy.max_layer, copy.auto_layer, count, activity, now_ns));
            c.set_target(copy.consumer, target, copy.temporal_layer, kernel);
            let rw = &mut c.rewriter;
            match (kind, &info) {
                (MediaKind::Rtp, Some(info)) => match kernel {
                    // The kernel's state decides (it also renumbers the kernel's copies).
                    Some(k) => {
                        if let Some(bytes) = k.decide(copy.consumer, layer.index, layer.codec, now_ns, payload) {
                            fan.copies.push((i, bytes));
                        }
                        mirror(rw, copy.consumer, kernel);
                    }
                    None => {
                        if let Decision::Forward(r) = rw.on_packet(layer.index, info, now_ns) {
                            let mut bytes = payload.to_vec();
                            r.apply(info, &mut bytes);
                            fan.copies.push((i, bytes));
                        }
                    }
                },
                (MediaKind::Rtcp, _) => {
                    let mut bytes = payload.to_vec();
                    if rw.rewrite_sender_report(layer.index, &mut bytes) {
                        fan.copies.push((i, bytes));
                    }
                }
                _ => {}
            }
            if let Some(l) = rw.keyframe_wanted(now_ns) {
                if !wanted.contains(&l) {
                    wanted.push(l);
                }
            }
        }
        // A keyframe answers the requests for its layer so far (see FeedbackRouter), once the
        // consumers waiting for it switched on it above: as the tick, before the requests.
        if info.as_ref().is_some_and(|i| i.keyframe_start) {
            if let Some(&(stream, ssrc)) = layer.layers.get(layer.index as usize) {
                self.feedback.keyframe_arrived(stream, ssrc);
            }
        }
        let SourceRule::Fixed(publisher) = entry.source else { return fan };
        for l in wanted {
            let Some(&(stream, ssrc)) = layer.layers.get(l as usize) else { continue };
            let Some(pli) = self.feedback.request_keyframe(stream, ssrc, SFU_SSRC, now_ns) else { continue };
            fan.requests.push((entry.key.local, publisher, pli));
        }
        fan
    }

    /// A simulcast consumer's reports, NACKs and REMBs lower (or let rise) the layer it gets.
    fn feed_layer_choice(&mut self, outcome: &Outcome, now_ns: u64) {
        if outcome.reports.is_empty() && outcome.remb.is_empty() && outcome.nacks.is_empty() {
            return;
        }
        let SimulcastState { consumers, activity, .. } = &mut self.layers;
        for r in &outcome.reports {
            if let Some(c) = consumers.get_mut(&r.consumer) {
                c.choice.on_loss(r.block.fraction_lost, c.rewriter.current(), now_ns);
            }
        }
        for (id, seqs) in &outcome.nacks {
            if let Some(c) = consumers.get_mut(id) {
                // What was sent it so far, fresh (the tick leaves a settled consumer's counters).
                let kernel = c.kernel(self.kernel.as_deref());
                mirror(&mut c.rewriter, *id, kernel);
                c.choice.on_nacks(seqs, c.rewriter.stats.forwarded, c.rewriter.current(), now_ns);
            }
        }
        // A REMB is one estimate for every SSRC it lists.
        for remb in &outcome.remb {
            let receiving: Vec<(u32, u64, bool)> = remb
                .consumers
                .iter()
                .filter_map(|id| {
                    let c = consumers.get(id)?;
                    let current = c.rewriter.current()?;
                    // A consumer with auto_layer off counts toward the total but cannot step.
                    Some((*id, activity.get(&c.group)?.bitrate_bps(current, now_ns)?, current > 0 && c.choice.automatic()))
                })
                .collect();
            if let Some(stepper) = layer_choice::remb_over(remb.bps, &receiving) {
                for (id, _, _) in &receiving {
                    if let Some(c) = consumers.get_mut(id) {
                        c.choice.on_short_estimate(stepper == Some(*id), c.rewriter.current(), now_ns);
                    }
                }
            }
        }
    }
}

/// The consumers of `table`'s simulcast streams that the kernel forwards itself.
fn kernel_judged(kernel: &dyn KernelLayers, table: &ForwardingTable) -> HashSet<u32> {
    let judged = table.streams.values().filter(|e| e.simulcast.is_some() && kernel.judges(e));
    judged.flat_map(|e| e.copies.iter().map(|c| c.consumer)).filter(|c| *c != 0).collect()
}

/// Refresh `rw` from the kernel's state of `id` (nothing without one).
fn mirror(rw: &mut LayerRewriter, id: u32, kernel: Option<&dyn KernelLayers>) {
    if let Some(s) = kernel.and_then(|k| k.state(id)) {
        rw.load_state(s);
    }
}

/// The simulcast consumers' state as the feedback router asks for it (a NACK names what was
/// just sent: with kernel states, read fresh).
struct Layers<'a>(&'a HashMap<u32, LayerConsumer>, Option<&'a dyn KernelLayers>, &'a SendHistory);

impl LayerMap for Layers<'_> {
    fn holds(&self, consumer: u32, out_seq: u16) -> bool {
        self.2.holds(consumer, out_seq)
    }
    fn layer(&self, consumer: u32) -> Option<u8> {
        self.0.get(&consumer).and_then(|c| c.rewriter.current().or(c.rewriter.target()))
    }
    fn original(&self, consumer: u32, out_seq: u16) -> Option<(u8, u16)> {
        let c = self.0.get(&consumer)?;
        match c.kernel(self.1).and_then(|k| k.state(consumer)) {
            Some(s) => {
                let mut rw = LayerRewriter::new(c.rewriter.ssrc(), c.rewriter.clock_rate());
                rw.load_state(s);
                rw.original(out_seq)
            }
            None => c.rewriter.original(out_seq),
        }
    }
}

/// What the kernel received of each simulcast layer stream of a table ([`KernelLayers::received`]),
/// read by the driver outside the engine's lock: a read may wait for an install's map writes
/// (the eBPF plane's installer lock, held through an RCU grace period at times), which must not
/// stall the slow path's batches.
#[derive(Debug, Default, Clone)]
pub struct KernelReadings(HashMap<u32, KernelReceived>);

impl KernelReadings {
    /// What the kernel received of `table`'s layer streams (walks the table: see
    /// [`KernelReadings::read_with`]).
    pub fn read(kernel: &dyn KernelLayers, table: &ForwardingTable) -> KernelReadings {
        KernelReadings::read_with(kernel, table, &mut LayeredStreams::default())
    }

    /// [`KernelReadings::read`] with the layer streams found once per table in `layered`.
    pub fn read_with(kernel: &dyn KernelLayers, table: &ForwardingTable, layered: &mut LayeredStreams) -> KernelReadings {
        KernelReadings(layered.entries(table).into_iter().filter_map(|e| Some((e.id, kernel.received(e.id)?))).collect())
    }
}

/// The simulcast layer streams of a table, found once per table rather than on every tick: a
/// relay's table holds thousands of streams and none of them layered, and a walk of it every
/// [`TICK_NS`] was most of what an idle eBPF relay cost. The table is known by its map's
/// identity (an `imbl` map shares its root until it changes), so a new table is never missed.
#[derive(Debug, Default)]
pub struct LayeredStreams {
    of: Option<imbl::OrdMap<IngressKey, StreamEntry>>,
    keys: Vec<IngressKey>,
}

impl LayeredStreams {
    /// The entries of `table` that are simulcast layers, in key order.
    pub fn entries<'t>(&mut self, table: &'t ForwardingTable) -> Vec<&'t StreamEntry> {
        if !self.of.as_ref().is_some_and(|m| m.ptr_eq(&table.streams)) {
            self.keys = table.streams.iter().filter(|(_, e)| e.simulcast.is_some()).map(|(k, _)| *k).collect();
            self.of = Some(table.streams.clone());
        }
        self.keys.iter().filter_map(|k| table.streams.get(k)).collect()
    }
}

/// A WebRTC publisher's transport the SFU feeds back to: its arrivals (transport-cc), its
/// room's ceiling (REMB), and where they go (from the SFU address its packets came to, to the
/// address they came from, protected as the entry they last came on says).
struct PublisherTransport {
    feedback: TransportFeedback,
    entry: IngressKey,
    peer: SocketAddr,
    /// The SSRCs it sent lately, latest first (a REMB names them; the transport feedback's media
    /// SSRC is the latest: receivers read the numbers).
    ssrcs: Vec<u32>,
    /// The room's ceiling (bits/s), as the latest packet or table said.
    ceiling: Option<u64>,
    /// Without transport-cc, the SFU's own estimate of its path from its packets' send times.
    estimate: Option<RemoteEstimate>,
    /// Its streams (entries narrowed to an SSRC) and, per stream, (expected, received) at the
    /// previous receiver report: each gets a report block every [`RR_INTERVAL_NS`].
    streams: Vec<(IngressKey, (u64, u64))>,
    /// When its next receiver report is due.
    rr_due_ns: u64,
    /// The latest REMB: (bits/s, when). Once capped, a transport hears a REMB every
    /// [`REMB_INTERVAL_NS`] for as long as it lasts, [`UNCAPPED_BPS`] when the cap is lifted (a
    /// browser keeps the last REMB's limit until another comes).
    remb: Option<(u64, u64)>,
}

/// How often a publisher's transport gets a receiver report (libwebrtc's video interval): its
/// loss, jitter and round-trip time as the SFU sees them.
const RR_INTERVAL_NS: u64 = 1_000_000_000;
/// Streams of one transport reported on at most (an RR holds 31 blocks).
const RR_STREAMS: usize = 31;

/// How often a capped publisher's transport is told its ceiling.
const REMB_INTERVAL_NS: u64 = 1_000_000_000;
/// The REMB that lifts a cap: 10 Gbit/s, more than any browser sends.
const UNCAPPED_BPS: u64 = 10_000_000_000;
/// SSRCs a REMB names at most.
const REMB_SSRCS: usize = 8;

impl PublisherTransport {
    /// The REMB it is due: (bits/s, when). The lower of the ceiling and the estimate; an
    /// estimate goes every second, at once when it falls (remote_estimate::remb_at); a
    /// ceiling alone at once when it changes.
    fn remb_due(&self) -> Option<(u64, u64)> {
        let estimate = self.estimate.as_ref().and_then(RemoteEstimate::estimate_bps);
        let value = match (self.ceiling, estimate, self.remb) {
            (Some(c), Some(e), _) => c.min(e),
            (Some(c), None, _) => c,
            (None, Some(e), _) => e,
            (None, None, Some(_)) => UNCAPPED_BPS,
            (None, None, None) => return None,
        };
        Some(match self.remb {
            Some((sent, at)) if sent == value => (value, at + REMB_INTERVAL_NS),
            last if estimate.is_some() => (value, remote_estimate::remb_at(value, last)),
            _ => (value, 0), // a new ceiling goes at once
        })
    }

    /// When it has anything due.
    fn poll_timeout(&self) -> Option<u64> {
        let rr = (!self.streams.is_empty()).then_some(self.rr_due_ns);
        earliest(earliest(self.feedback.poll_timeout(), self.remb_due().map(|(_, at)| at)), rr)
    }
}

/// The engine. See the module documentation.
pub struct Engine {
    cfg: EngineConfig,
    /// The streams' rate limits.
    pipeline: Pipeline,
    decider: Decider,
    counters: Accounting,
    /// In-path reception quality per RTP stream.
    reception: HashMap<u32, RtpReception>,
    /// The same per consumer over the RTP copies sent to it.
    forwarded: HashMap<u32, RtpReception>,
    /// When each published stream's last sender reports passed (by stream id), for the
    /// round-trip times its consumers' reports give.
    sender_reports: HashMap<u32, SenderReportTimes>,
    /// RTCP reports handed to the control plane per stream in the current second: (second, count).
    rtcp_budget: HashMap<u32, (u64, u32)>,
    /// Per stream, the (SSRC, timestamp) of the DTMF event last reported: its repeated end
    /// packets are not reported again. And the reports' own per-second budget.
    dtmf_reported: HashMap<u32, (u32, u32)>,
    dtmf_budget: HashMap<u32, (u64, u32)>,
    /// When the RID of (transport, SSRC) was last reported: a layer's packets name it until the
    /// control plane has learned it, and one report per [`STREAM_ID_REPORT_NS`] is enough.
    stream_ids_reported: HashMap<(u32, u32), u64>,
    /// With kernel states: when the next tick is due, and how many ran.
    next_tick_ns: Option<u64>,
    ticks: u64,
    /// The installed table's layer streams, for the tick.
    layered: LayeredStreams,
    /// The latest limits' clock a batch was decided at.
    limits_ns: u64,
    /// Publishers' transports fed back to, by the SFU address they send to.
    transports: HashMap<SocketAddr, PublisherTransport>,
    /// When the first of them has feedback due.
    next_feedback_ns: Option<u64>,
    /// Transport feedback packets handed to the driver; publishers' packets that arrived after
    /// their number was reported lost.
    feedback_sent: u64,
    feedback_late: u64,
    /// REMBs with a room's ceiling (or its lifting) sent to publishers.
    remb_sent: u64,
    /// Receiver reports sent to publishers.
    rr_sent: u64,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Engine {
        let kernel = cfg.kernel_layers.clone();
        Engine {
            // The first tick at once (it reconciles the kernel's states with the table).
            next_tick_ns: kernel.as_ref().map(|_| 0),
            decider: Decider {
                sources: SourceBuckets::default(),
                feedback: FeedbackRouter::default(),
                layers: SimulcastState::default(),
                kernel,
                history: SendHistory::default(),
            },
            cfg,
            pipeline: Pipeline::new(),
            counters: Accounting::default(),
            reception: HashMap::new(),
            forwarded: HashMap::new(),
            sender_reports: HashMap::new(),
            rtcp_budget: HashMap::new(),
            dtmf_reported: HashMap::new(),
            dtmf_budget: HashMap::new(),
            stream_ids_reported: HashMap::new(),
            ticks: 0,
            layered: LayeredStreams::default(),
            limits_ns: 0,
            transports: HashMap::new(),
            next_feedback_ns: None,
            feedback_sent: 0,
            feedback_late: 0,
            remb_sent: 0,
            rr_sent: 0,
        }
    }

    /// Decide one datagram against the installed `table`; what the driver must do is appended to
    /// `out`, in order.
    pub fn handle_datagram<'p>(&mut self, now: Now, table: &ForwardingTable, crypto: &mut dyn Crypto, dgram: Datagram<'p>, out: &mut Vec<Output<'p>>) {
        self.handle_batch(now, table, crypto, [dgram], out)
    }

    /// [`Engine::handle_datagram`] for each of a batch of datagrams that arrived together.
    pub fn handle_batch<'p>(
        &mut self,
        now: Now,
        table: &ForwardingTable,
        crypto: &mut dyn Crypto,
        batch: impl IntoIterator<Item = Datagram<'p>>,
        out: &mut Vec<Output<'p>>,
    ) {
        // Workers read their clocks before they take the engine's lock, so batches can come in
        // a little out of time order: the limits' clock is kept from going back (a rate limiter
        // would take a late batch's packets for early ones).
        let now = Now { limits_ns: now.limits_ns.max(self.limits_ns), ..now };
        self.limits_ns = now.limits_ns;
        let mut effects: Vec<Effect<'p>> = Vec::new();
        for dgram in batch {
            self.decide(now, table, crypto, dgram, &mut effects, out);
        }
    }

    fn decide<'p>(
        &mut self,
        now: Now,
        table: &ForwardingTable,
        crypto: &mut dyn Crypto,
        dgram: Datagram<'p>,
        effects: &mut Vec<Effect<'p>>,
        out: &mut Vec<Output<'p>>,
    ) {
        let total = &mut self.counters.total;
        total.rx_packets += 1;
        total.rx_bytes += dgram.payload.len() as u64;
        let (Some(src), false) = (dgram.src, dgram.truncated) else {
            total.drop_malformed += 1;
            return;
        };
        let Some(local) = dgram.local else {
            total.drop_no_stream += 1;
            return;
        };
        let (payload, dgram_arrived) = (dgram.payload, dgram.arrived_ns);
        let mut plane = PlaneView { decider: &mut self.decider, crypto };
        // The decision is core's (mediaplane_core::pipeline); the engine keeps its books.
        self.pipeline.process(table, local, src, payload, now.limits_ns, now.mono_ns, &mut plane, effects);
        let received_at = now.mono_ns;
        for effect in effects.drain(..) {
            match effect {
                Effect::Dropped { why, stream, received } => {
                    self.counters.total.count_dropped(why);
                    if let Some(id) = stream {
                        let sc = self.counters.streams.entry(id).or_default();
                        if let Some(bytes) = received {
                            sc.rx_packets += 1;
                            sc.rx_bytes += bytes as u64;
                        }
                        sc.count_dropped(why);
                    }
                }
                Effect::SlowPath { reason, stream, handshake } => {
                    self.counters.total.count_slow(reason);
                    if let Some(id) = stream {
                        self.counters.streams.entry(id).or_default().count_slow(reason);
                    }
                    if let (Some(stream), true) = (handshake, self.cfg.events) {
                        // An ICE leg's connectivity check or DTLS: the control plane answers it.
                        out.push(Output::Event(DataplaneEvent::Handshake { stream, local, source: src, at_ns: received_at, packet: payload.to_vec() }));
                    }
                }
                Effect::Feedback(outcome) => {
                    self.count_feedback(&outcome, received_at);
                    for (consumer, seqs) in &outcome.resend {
                        for seq in seqs {
                            if let Some(s) = self.decider.history.resend(*consumer, *seq, received_at) {
                                let packet = Cow::Owned(s.packet.clone());
                                out.push(Output::Transmit { from: s.from, to: s.to, packet, copy: None, seal: s.seal });
                            }
                        }
                    }
                }
                Effect::Received { stream, bytes } => {
                    let sc = self.counters.streams.entry(stream).or_default();
                    sc.rx_packets += 1;
                    sc.rx_bytes += bytes as u64;
                }
                Effect::Unlatched { stream, source } => {
                    // Relayed like any packet; its source goes to the control plane, which
                    // decides whether the leg follows it.
                    self.counters.streams.entry(stream).or_default().count_slow(SlowReason::Unlatched);
                    self.counters.total.count_slow(SlowReason::Unlatched);
                    if self.cfg.events {
                        out.push(Output::Event(DataplaneEvent::Unlatched { stream, source }));
                    }
                }
                Effect::Accepted { stream } => self.counters.streams.entry(stream).or_default().last_rx_ns = received_at,
                Effect::Rtp { stream, header, clock_rate } => {
                    self.reception.entry(stream).or_default().on_packet(header.ssrc, header.sequence, header.timestamp, received_at, clock_rate);
                    // Each packet earns its stream's NACK budget.
                    self.decider.feedback.on_media(stream);
                }
                // When a publisher's sender report passed, for its consumers' round-trip times.
                Effect::SenderReport { stream, ntp_middle } => self.sender_reports.entry(stream).or_default().on_sender_report(ntp_middle, received_at),
                Effect::RelayRtcp { stream, packet } => {
                    if self.cfg.events && packet.len() <= crate::MAX_RTCP_REPORT && rtcp_admit(&mut self.rtcp_budget, stream, received_at) {
                        out.push(Output::Event(DataplaneEvent::Rtcp {
                            stream,
                            source: src,
                            at_ns: received_at,
                            wall_us: now.wall_us,
                            packet: packet.into_owned(),
                        }));
                    }
                }
                Effect::DtmfEnd { stream, ssrc, payload_type, timestamp, event } => {
                    if self.dtmf_reported.len() > 65_536 {
                        self.dtmf_reported.clear();
                    }
                    let new = self.dtmf_reported.insert(stream, (ssrc, timestamp)) != Some((ssrc, timestamp));
                    if self.cfg.events && new && rtcp_admit(&mut self.dtmf_budget, stream, received_at) {
                        out.push(Output::Event(DataplaneEvent::Dtmf { stream, source: src, ssrc, payload_type, timestamp, event, wall_us: now.wall_us }));
                    }
                }
                Effect::StreamId { transport, ssrc, mid, rid } => {
                    if self.cfg.events && stream_id_due(&mut self.stream_ids_reported, (transport, ssrc), received_at) {
                        out.push(Output::Event(DataplaneEvent::StreamId { transport, ssrc, mid, rid }));
                    }
                }
                Effect::PublisherRtp { entry, source, ssrc, seq, send_time, size, max_bitrate_bps } => {
                    let t = self.transports.entry(entry.local).or_insert_with(|| PublisherTransport {
                        feedback: TransportFeedback::new(),
                        entry,
                        peer: source,
                        ssrcs: Vec::new(),
                        ceiling: None,
                        estimate: None,
                        remb: None,
                        streams: Vec::new(),
                        rr_due_ns: received_at + RR_INTERVAL_NS,
                    });
                    if entry.ssrc.is_some() && t.streams.len() < RR_STREAMS && !t.streams.iter().any(|(k, _)| *k == entry) {
                        t.streams.push((entry, (0, 0)));
                    }
                    (t.entry, t.peer, t.ceiling) = (entry, source, max_bitrate_bps);
                    if t.ssrcs.first() != Some(&ssrc) {
                        t.ssrcs.retain(|s| *s != ssrc);
                        t.ssrcs.insert(0, ssrc);
                        t.ssrcs.truncate(REMB_SSRCS);
                    }
                    if let Some(seq) = seq {
                        let late = t.feedback.late;
                        t.feedback.on_packet(seq, dgram_arrived.unwrap_or(received_at));
                        self.feedback_late += t.feedback.late - late;
                    }
                    if let Some(sent) = send_time {
                        t.estimate.get_or_insert_with(RemoteEstimate::new).on_packet(sent, dgram_arrived.unwrap_or(received_at), size);
                    }
                    self.next_feedback_ns = earliest(self.next_feedback_ns, t.poll_timeout());
                }
                Effect::Record { stream, label, packet } => out.push(Output::Record { stream, label, src, local, packet }),
                Effect::Send { from, to, packet, copy, seal } => {
                    // A video consumer's copy is kept to answer its NACKs (audio is not resent).
                    let kept = |(c, r): &(CopyOf, CopyRtp)| self.cfg.retransmit && c.consumer != 0 && r.clock_rate == VIDEO_CLOCK_RATE;
                    if let Some((c, r)) = copy.and_then(|c| Some((c, c.rtp?))).filter(kept) {
                        self.decider.history.record(c.consumer, r.sequence, received_at, (from, to), &packet, seal);
                    }
                    out.push(Output::Transmit { from, to, packet, copy, seal })
                }
                Effect::CopyFailed { copy } => self.counters.count_copy(copy.stream, copy.consumer, 0, false),
                Effect::CopyUnkeyed { copy } => self.counters.count_unkeyed(copy.stream),
            }
        }
    }

    /// What became of an [`Output::Transmit`]: `bytes` sent (or not) at `received_at`, the time
    /// its datagram arrived (a copy's quality as forwarded is measured at the arrival, as the
    /// kernel does).
    pub fn on_transmitted(&mut self, copy: Option<CopyOf>, bytes: usize, sent: bool, received_at: u64) {
        match copy {
            Some(c) => {
                self.counters.count_copy(c.stream, c.consumer, bytes, sent);
                if let (true, Some(r), true) = (sent, c.rtp, c.consumer != 0 && self.cfg.forwarded_qos) {
                    self.forwarded.entry(c.consumer).or_default().on_packet(r.ssrc, r.sequence, r.timestamp, received_at, r.clock_rate);
                }
            }
            // Feedback or a keyframe request to a publisher: only a failure is counted.
            None => self.counters.total.tx_errors += u64::from(!sent),
        }
    }

    /// When [`Engine::handle_timeout`] is due next (CLOCK_MONOTONIC ns); None: no timer.
    pub fn poll_timeout(&self) -> Option<u64> {
        earliest(self.next_tick_ns, self.next_feedback_ns)
    }

    /// Run what is due at `now`: with kernel simulcast states, the tick
    /// ([`crate::kernel_layers::TICK_NS`]): what the kernel received of each layer feeds the
    /// streams' activity; each consumer of the installed table gets its state, its target (the
    /// API's ceiling as its reports and the activity lower it) and, while it waits for a layer,
    /// a keyframe request to the publisher (coalesced with the consumers' own), appended to
    /// `out`. Every [`RECONCILE_TICKS`]th tick also deletes the states of consumers the table no
    /// longer has.
    /// `readings`: what the kernel received of the table's layer streams, read by the driver
    /// before it took the engine's lock ([`KernelReadings::read`]).
    pub fn handle_timeout(&mut self, now: Now, table: &ForwardingTable, crypto: &mut dyn Crypto, readings: &KernelReadings, out: &mut Vec<Output<'static>>) {
        if self.next_feedback_ns.is_some_and(|due| now.mono_ns >= due) {
            self.feed_back(now.mono_ns, table, crypto, out);
        }
        let Some(due) = self.next_tick_ns else { return };
        if now.mono_ns < due {
            return;
        }
        self.ticks += 1;
        self.next_tick_ns = Some(now.mono_ns + TICK_NS);
        self.layers_tick(table, crypto, readings, now.mono_ns, self.ticks % RECONCILE_TICKS == 1, out);
    }

    /// What is due at `now_ns` to each publisher's transport: its transport feedback and its
    /// REMB (SRTCP with its key, sealed by the driver; not sent without one: the crypto counts
    /// it). A transport whose entry left the table is forgotten; its ceiling is the table's.
    fn feed_back(&mut self, now_ns: u64, table: &ForwardingTable, crypto: &mut dyn Crypto, out: &mut Vec<Output<'static>>) {
        let mut next = None;
        let (feedback_sent, remb_sent, rr_sent) = (&mut self.feedback_sent, &mut self.remb_sent, &mut self.rr_sent);
        let (reception, sender_reports) = (&self.reception, &self.sender_reports);
        self.transports.retain(|_, t| {
            let Some(entry) = table.streams.get(&t.entry) else { return false };
            t.streams.retain(|(k, _)| table.streams.contains_key(k));
            t.ceiling = entry.publisher_feedback.and_then(|f| f.max_bitrate_bps);
            // An estimate the table no longer asks for, or with nothing arriving, is forgotten
            // (it starts afresh from the next packets).
            let estimated = entry.publisher_feedback.is_some_and(|f| f.abs_send_time.is_some());
            if !estimated || t.estimate.as_ref().is_some_and(|e| e.is_stale(now_ns)) {
                t.estimate = None;
            }
            let ssrc = t.ssrcs.first().copied().unwrap_or(0);
            let mut packets = t.feedback.handle_timeout(now_ns, SFU_SSRC, ssrc);
            *feedback_sent += packets.len() as u64;
            if let Some((bps, _)) = t.remb_due().filter(|(_, at)| *at <= now_ns) {
                packets.push(transport_feedback::remb(SFU_SSRC, bps, &t.ssrcs));
                t.remb = Some((bps, now_ns));
                *remb_sent += 1;
            }
            if !t.streams.is_empty() && t.rr_due_ns <= now_ns {
                t.rr_due_ns = now_ns + RR_INTERVAL_NS;
                let blocks: Vec<ReportBlock> = t
                    .streams
                    .iter_mut()
                    .filter_map(|(k, since)| {
                        let id = table.streams.get(k)?.id;
                        let r = reception.get(&id).filter(|r| r.started)?;
                        Some(r.report_block(SFU_SSRC, since, sender_reports.get(&id).and_then(SenderReportTimes::last), now_ns))
                    })
                    .collect();
                if !blocks.is_empty() {
                    packets.push(build_report(SFU_SSRC, None, &blocks));
                    *rr_sent += 1;
                }
            }
            for packet in packets {
                let seal = match &entry.reverse {
                    Protection::Clear => false,
                    Protection::Srtp(Some(_)) => true,
                    Protection::Srtp(None) => {
                        let _ = crypto.protect(entry.key.local, None, &packet);
                        continue;
                    }
                };
                out.push(Output::Transmit { from: entry.key.local, to: t.peer, packet: Cow::Owned(packet), copy: None, seal });
            }
            next = earliest(next, t.poll_timeout());
            true
        });
        self.next_feedback_ns = next;
    }

    fn layers_tick(
        &mut self,
        table: &ForwardingTable,
        crypto: &mut dyn Crypto,
        readings: &KernelReadings,
        now_ns: u64,
        reconcile: bool,
        out: &mut Vec<Output<'static>>,
    ) {
        let Some(kernel) = self.decider.kernel.clone() else { return };
        let kernel = kernel.as_ref();
        // Nothing more when the table has no simulcast stream (a relay's).
        let layered = self.layered.entries(table);
        if layered.is_empty() && !reconcile {
            return;
        }
        // (stream entry, layer) whose keyframe someone waits for.
        let mut wanted: Vec<(&StreamEntry, u8)> = Vec::new();
        // (stream, SSRC) of layers the kernel forwarded a keyframe of since the last tick.
        let mut answered: Vec<(u32, u32)> = Vec::new();
        let SimulcastState { consumers, activity, kernel_rx, kernel_judged } = &mut self.decider.layers;
        let mut seen = HashSet::new();
        for entry in layered.iter().copied() {
            let Some(layer) = &entry.simulcast else { continue };
            let act = activity.entry(layer.group).or_default();
            if let Some(&now) = readings.0.get(&entry.id) {
                let before = kernel_rx.insert(entry.id, now).unwrap_or_default();
                if now.packets > before.packets {
                    act.on_packet(layer.index, now.bytes.saturating_sub(before.bytes) as usize, now.last_ns);
                }
                if now.keyframes > before.keyframes {
                    answered.extend(layer.layers.get(layer.index as usize));
                }
            }
            let (out_ssrc, count) = (layer.layers[0].1, layer.layers.len() as u8);
            for copy in entry.copies.iter().filter(|c| c.consumer != 0) {
                // Every layer's entry lists every consumer: one visit each.
                if !seen.insert(copy.consumer) {
                    continue;
                }
                let c = consumers
                    .entry(copy.consumer)
                    .or_insert_with(|| LayerConsumer::new(LayerRewriter::new(out_ssrc, entry.clock_rate), layer.group, kernel_judged.contains(&copy.consumer)));
                c.group = layer.group;
                let target = copy.layer.map(|ceiling| c.choice.choose(ceiling, copy.max_layer, copy.auto_layer, count, act, now_ns));
                // A consumer whose state is here is aimed as a packet would aim it.
                if c.in_kernel {
                    // Every tick: a state a failed create or a reconcile left missing comes back.
                    let new = c.kernel_target.is_none();
                    if new {
                        kernel.create(copy.consumer, out_ssrc, entry.clock_rate);
                    }
                    // A settled consumer (receiving the layer it is aimed at) changes in the
                    // kernel only by its counters: the kernel switches a consumer only towards a
                    // target this engine set. Those are read where they are used (NACK windows,
                    // the API) and on reconciling ticks; a consumer not aimed yet (its state may
                    // be a restarted daemon's, pinned) or on its way to a layer, every tick.
                    if reconcile || new || c.rewriter.current() != c.rewriter.target() {
                        mirror(&mut c.rewriter, copy.consumer, Some(kernel));
                    }
                }
                let k = c.kernel(Some(kernel));
                c.set_target(copy.consumer, target, copy.temporal_layer, k);
                // Asked only once the publisher sends (as a packet's arrival asks on the
                // user-space plane): a request before its socket is up is lost, and the next one
                // would wait out the retry interval.
                if let Some(l) = act.started().then(|| c.rewriter.keyframe_wanted(now_ns)).flatten() {
                    let of = layer.layers.get(l as usize).and_then(|(stream, _)| layered.iter().copied().find(|e| e.id == *stream));
                    if let Some(e) = of.filter(|e| !wanted.iter().any(|(w, _)| w.id == e.id)) {
                        wanted.push((e, l));
                    }
                }
            }
        }
        let ids: HashSet<u32> = layered.iter().map(|e| e.id).collect();
        kernel_rx.retain(|id, _| ids.contains(id));
        // Not before a table was installed (version 0: the plane's empty start): a restarted
        // daemon's first tick would delete the pinned states of every consumer it restores.
        if reconcile && table.version > 0 {
            // Consumers no longer in the table (`seen` holds every simulcast consumer it has):
            // their states go, here and in the kernel.
            consumers.retain(|id, _| seen.contains(id));
            for id in kernel.consumers().into_iter().filter(|id| !seen.contains(id)) {
                kernel.remove(id);
            }
        }
        // Before this tick's requests: one for a layer whose keyframe just went by is a new need.
        for (stream, ssrc) in answered {
            self.decider.feedback.keyframe_arrived(stream, ssrc);
        }
        for (entry, l) in wanted {
            let (SourceRule::Fixed(publisher), Some(layer)) = (entry.source, &entry.simulcast) else { continue };
            let Some(&(stream, ssrc)) = layer.layers.get(l as usize) else { continue };
            let Some(pli) = self.decider.feedback.request_keyframe(stream, ssrc, SFU_SSRC, now_ns) else { continue };
            // A WebRTC publisher's: SRTCP with its key, sealed by the driver (not sent without one:
            // the crypto counts it).
            let seal = match &entry.reverse {
                Protection::Clear => false,
                Protection::Srtp(Some(_)) => true,
                Protection::Srtp(None) => {
                    let _ = crypto.protect(entry.key.local, None, &pli);
                    continue;
                }
            };
            out.push(Output::Transmit { from: entry.key.local, to: publisher, packet: Cow::Owned(pli), copy: None, seal });
        }
    }

    /// A consumer's feedback, routed: its tallies, what its reports and REMBs said, and what
    /// they mean for its layer.
    fn count_feedback(&mut self, outcome: &Outcome, received_at: u64) {
        let c = &mut self.counters;
        c.total.count_feedback(&outcome.total);
        for (id, t) in &outcome.per_stream {
            c.streams.entry(*id).or_default().count_feedback(t);
        }
        for (id, t) in &outcome.per_consumer {
            let cc = c.consumers.entry(*id).or_default();
            cc.feedback_routed += t.routed;
            cc.feedback_coalesced += t.coalesced;
        }
        for r in &outcome.reports {
            let b = &r.block;
            let cc = c.consumers.entry(r.consumer).or_default();
            cc.report = Some(ConsumerReport {
                fraction_lost: b.fraction_lost,
                cumulative_lost: b.cumulative_lost,
                highest_seq: b.highest_seq,
                jitter: b.jitter,
                at_ns: received_at,
            });
            let rtt = self.sender_reports.get(&r.stream).and_then(|t| t.rtt_us(b.lsr, b.dlsr, received_at));
            if rtt.is_some() {
                (cc.rtt_us, cc.rtt_at_ns) = (rtt, received_at);
            }
        }
        for remb in &outcome.remb {
            for id in &remb.consumers {
                let cc = c.consumers.entry(*id).or_default();
                (cc.remb_bps, cc.remb_at_ns) = (Some(remb.bps), received_at);
            }
        }
        self.decider.feed_layer_choice(outcome, received_at);
    }

    /// A new table replaces `old`; `changed` lists the keys that differ (None: everything may).
    /// Streams and consumers that left it lose their state (ids are never reused: this only
    /// bounds memory), here and in the kernel's simulcast states; a simulcast stream's activity
    /// goes with its entries (one that only changed starts afresh: every layer presumed sent for
    /// a second).
    pub fn forget(&mut self, old: &ForwardingTable, new: &ForwardingTable, changed: Option<&[IngressKey]>) {
        match changed {
            Some(keys) => {
                for e in keys.iter().filter_map(|k| old.streams.get(k)).filter(|e| new.streams.get(&e.key).map(|n| n.id) != Some(e.id)) {
                    self.reception.remove(&e.id);
                    self.sender_reports.remove(&e.id);
                }
            }
            None => {
                let ids: HashSet<u32> = new.streams.values().map(|e| e.id).collect();
                self.reception.retain(|id, _| ids.contains(id));
                self.sender_reports.retain(|id, _| ids.contains(id));
            }
        }
        self.transports.retain(|_, t| new.streams.contains_key(&t.entry));
        let consumers = |t: &ForwardingTable, keys: &mut dyn Iterator<Item = &IngressKey>| -> HashSet<u32> {
            keys.filter_map(|k| t.streams.get(k)).flat_map(|e| e.copies.iter().map(|c| c.consumer)).filter(|c| *c != 0).collect()
        };
        let (gone, keep): (Vec<u32>, Option<HashSet<u32>>) = match changed {
            Some(keys) => {
                let now = consumers(new, &mut keys.iter());
                (consumers(old, &mut keys.iter()).difference(&now).copied().collect(), None)
            }
            None => (Vec::new(), Some(consumers(new, &mut new.streams.keys()))),
        };
        let kernel = self.decider.kernel.as_deref();
        let layers = &mut self.decider.layers;
        match &keep {
            Some(keep) => {
                self.counters.consumers.retain(|id, _| keep.contains(id));
                self.forwarded.retain(|id, _| keep.contains(id));
                self.decider.history.retain(|id| keep.contains(&id));
                layers.consumers.retain(|id, c| {
                    let kept = keep.contains(id);
                    if let (false, Some(k)) = (kept, c.kernel(kernel)) {
                        k.remove(*id);
                    }
                    kept
                });
            }
            None => {
                self.decider.history.retain(|id| !gone.contains(&id));
                for id in &gone {
                    self.counters.consumers.remove(id);
                    self.forwarded.remove(id);
                    if let Some(k) = layers.consumers.remove(id).and_then(|c| c.kernel(kernel)) {
                        k.remove(*id);
                    }
                }
            }
        }
        if let Some(k) = kernel {
            layers.kernel_judged = kernel_judged(k, new);
            // Before the kernel's table (the eBPF plane installs the slow path's first): a
            // consumer decided here until now whose stream the kernel comes to forward takes its
            // state there, so the kernel's first copy continues its numbering.
            for (id, c) in layers.consumers.iter_mut().filter(|(id, c)| !c.in_kernel && layers.kernel_judged.contains(id)) {
                let rw = &c.rewriter;
                if k.load(*id, rw.ssrc(), rw.clock_rate(), &rw.state()) {
                    c.in_kernel = true;
                    c.kernel_target = Some((rw.target(), rw.temporal_target()));
                }
            }
        }
        let group = |t: &ForwardingTable, k: &IngressKey| t.streams.get(k).and_then(|e| e.simulcast.as_ref()).map(|l| l.group);
        match changed {
            Some(keys) => keys.iter().filter_map(|k| group(old, k).filter(|g| group(new, k) != Some(*g))).for_each(|g| {
                layers.activity.remove(&g);
            }),
            None => {
                let groups: HashSet<u32> = new.streams.keys().filter_map(|k| group(new, k)).collect();
                layers.activity.retain(|g, _| groups.contains(g));
            }
        }
    }

    /// The totals, per stream counters and reception quality, into `st`.
    /// Datagrams a driver that sees raw frames dropped before deciding them, for what the host
    /// stack drops before the socket plane sees anything: a wrong IPv4 header or UDP checksum
    /// (`BadChecksum`), a source failing the reverse-path check (`Spoofed`). Counted in totals
    /// only, as received and under the reason.
    pub fn count_driver_drops(&mut self, reason: mediaplane_core::table::DropReason, n: u64) {
        self.counters.total.rx_packets += n;
        for _ in 0..n {
            self.counters.total.count_drop(reason);
        }
    }

    pub fn stats_into(&self, st: &mut DataplaneStats) {
        st.total.add(&self.counters.total);
        for (id, sc) in &self.counters.streams {
            st.streams.entry(*id).or_default().add(sc);
        }
        st.reception = self.reception.iter().map(|(id, r)| (*id, r.report())).collect();
        st.extra.insert("transport_feedback_sent".into(), self.feedback_sent);
        st.extra.insert("transport_feedback_late".into(), self.feedback_late);
        st.extra.insert("transport_feedback_remb".into(), self.remb_sent);
        st.extra.insert("transport_feedback_rr".into(), self.rr_sent);
        st.extra.insert("retransmit_sent".into(), self.decider.history.resent);
        st.extra.insert("retransmit_suppressed".into(), self.decider.history.suppressed);
    }

    /// The counters of consumers `ids`, with a simulcast consumer's layers as of `now_ns`.
    pub fn consumer_counters(&mut self, ids: &[u32], now_ns: u64) -> BTreeMap<u32, ConsumerCounters> {
        let mut out = BTreeMap::<u32, ConsumerCounters>::new();
        for id in ids {
            if let Some(cc) = self.counters.consumers.get(id) {
                out.insert(*id, *cc);
            }
        }
        let kernel = self.decider.kernel.as_deref();
        let layers = &mut self.decider.layers;
        for id in ids {
            // Fresh counters from the kernel (the tick leaves a settled consumer's).
            if let Some(c) = layers.consumers.get_mut(id) {
                let kernel = c.kernel(kernel);
                mirror(&mut c.rewriter, *id, kernel);
            }
            if let Some(c) = layers.consumers.get(id) {
                let r = &c.rewriter;
                let activity = layers.activity.get(&c.group);
                out.entry(*id).or_default().layer = Some(LayerState {
                    current: r.current(),
                    target: r.target(),
                    temporal_current: r.temporal_current(),
                    ssrc: r.ssrc(),
                    stats: r.stats,
                    auto_limit: c.choice.limit(),
                    choice: c.choice.stats,
                    absent: activity.map_or(0, |a| a.absent_mask(now_ns)),
                });
            }
        }
        out
    }

    /// Reception quality of consumers `ids` as forwarded to them.
    pub fn consumer_reception(&self, ids: &[u32]) -> BTreeMap<u32, ReceptionReport> {
        ids.iter().filter_map(|id| self.forwarded.get(id).map(|s| (*id, s.report()))).collect()
    }

    /// Reception quality of streams `ids` as received.
    pub fn stream_reception(&self, ids: &[u32]) -> BTreeMap<u32, ReceptionReport> {
        ids.iter().filter_map(|id| self.reception.get(id).map(|s| (*id, s.report()))).collect()
    }
}

/// Whether another RTCP report of `stream` may go to the control plane this second.
/// The earlier of two optional deadlines.
fn earliest(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn rtcp_admit(budget: &mut HashMap<u32, (u64, u32)>, stream: u32, now_ns: u64) -> bool {
    let second = now_ns / 1_000_000_000;
    if budget.len() > 65_536 {
        budget.retain(|_, (s, _)| *s == second);
    }
    let (s, n) = budget.entry(stream).or_insert((second, 0));
    if *s != second {
        (*s, *n) = (second, 0);
    }
    *n += 1;
    *n <= crate::RTCP_REPORTS_PER_SECOND
}

/// Whether the RID of `key` (transport, SSRC) may be reported again now.
fn stream_id_due(reported: &mut HashMap<(u32, u32), u64>, key: (u32, u32), now_ns: u64) -> bool {
    if reported.len() > 4096 {
        reported.retain(|_, at| now_ns.saturating_sub(*at) < STREAM_ID_REPORT_NS);
        // Still full (a sender spraying SSRCs): start over rather than sweep every packet; a
        // repeated report changes nothing in the model.
        if reported.len() > 4096 {
            reported.clear();
        }
    }
    match reported.get(&key) {
        Some(at) if now_ns.saturating_sub(*at) < STREAM_ID_REPORT_NS => false,
        _ => {
            reported.insert(key, now_ns);
            true
        }
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use crate::kernel_layers::{KernelLayers, KernelReceived};
    use mediaplane_core::model::{StreamRef, StreamSpec};
    use mediaplane_core::simulcast::{Codec, LayerRewriter, PacketInfo, RewriterState};
    use mediaplane_core::Model;
    use std::collections::HashMap;
    use std::net::{IpAddr, SocketAddr};
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A room where `publisher` sends a two-layer VP8 stream to the SFU address `sfu`:42000 and
    /// `subscriber` (at `sfu`:42002) receives it: the model and the consumer's uid.
    pub(crate) fn simulcast_room(sfu: IpAddr, publisher: SocketAddr, subscriber: SocketAddr) -> (Model, u32) {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "p", SocketAddr::new(sfu, 42000), publisher).unwrap();
        m.add_participant("r", "s", SocketAddr::new(sfu, 42002), subscriber).unwrap();
        let spec = StreamSpec { layers: vec![100, 101], codec: Some(Codec::Vp8), clock_rate: Some(90_000), ..Default::default() };
        m.publish("r", "p", "cam", spec).unwrap();
        let consumer = m.subscribe("r", "s", StreamRef { publisher: "p".into(), stream: "cam".into() }).unwrap();
        (m, consumer)
    }

    /// A consumer's state on layer 1, the top one, as a daemon pinned it before a restart.
    pub(crate) fn state_on_top_layer() -> RewriterState {
        let mut rw = LayerRewriter::new(100, 90_000);
        rw.set_target(Some(1));
        let key = PacketInfo { sequence: 9, timestamp: 900, frame_start: true, keyframe_start: true, picture_id: None, tl0picidx: None, temporal: None };
        rw.on_packet(1, &key, 1);
        assert_eq!(rw.current(), Some(1));
        rw.state()
    }

    /// The kernel's simulcast states, faked: each consumer's as given, every layer stream
    /// received anew at each read; it forwards every stream unless `forwards_nothing`.
    #[derive(Default)]
    pub(crate) struct FakeKernel {
        pub(crate) states: parking_lot::Mutex<HashMap<u32, RewriterState>>,
        pub(crate) reads: AtomicU64,
        /// Calls of `consumers`: reconciling ticks.
        pub(crate) listed: AtomicU64,
        pub(crate) forwards_nothing: std::sync::atomic::AtomicBool,
        /// Calls about one consumer (create, set_target, decide, state, load): each a syscall.
        pub(crate) consumer_calls: AtomicU64,
    }

    impl FakeKernel {
        fn call(&self) {
            self.consumer_calls.fetch_add(1, Ordering::Relaxed);
        }
    }

    impl KernelLayers for FakeKernel {
        fn create(&self, consumer: u32, _: u32, _: u32) {
            self.call();
            self.states.lock().entry(consumer).or_default();
        }
        fn remove(&self, consumer: u32) {
            self.states.lock().remove(&consumer);
        }
        fn judges(&self, _: &mediaplane_core::StreamEntry) -> bool {
            !self.forwards_nothing.load(Ordering::Relaxed)
        }
        fn load(&self, consumer: u32, _: u32, _: u32, state: &RewriterState) -> bool {
            self.call();
            self.states.lock().insert(consumer, state.clone());
            true
        }
        fn set_target(&self, consumer: u32, target: Option<u8>, _: Option<u8>) -> bool {
            self.call();
            self.states.lock().get_mut(&consumer).map(|s| s.target = target).is_some()
        }
        fn consumers(&self) -> Vec<u32> {
            self.listed.fetch_add(1, Ordering::Relaxed);
            self.states.lock().keys().copied().collect()
        }
        fn decide(&self, _: u32, _: u8, _: Codec, _: u64, _: &[u8]) -> Option<Vec<u8>> {
            self.call();
            None
        }
        fn state(&self, consumer: u32) -> Option<RewriterState> {
            self.call();
            self.states.lock().get(&consumer).cloned()
        }
        fn received(&self, _: u32) -> Option<KernelReceived> {
            let n = self.reads.fetch_add(1, Ordering::Relaxed) + 1;
            Some(KernelReceived { packets: n, bytes: n * 1000, last_ns: crate::monotonic_ns(), keyframes: 0 })
        }
    }
}

/// The engine without sockets or threads: datagrams and time passed in, outputs read back.
#[cfg(test)]
mod tests {
    use super::test_support::{simulcast_room, state_on_top_layer, FakeKernel};
    use super::*;
    use mediaplane_core::model::{StreamRef, StreamSpec};
    use mediaplane_core::rtp::build_rtp;
    use mediaplane_core::Model;
    use std::sync::atomic::Ordering;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn at(mono_ns: u64) -> Now {
        Now { limits_ns: mono_ns, mono_ns, wall_us: mono_ns / 1000 }
    }

    /// Hands packets through clear (they are in these tests); protecting under the engine's
    /// lock would be a bug (the driver seals).
    struct UnprotectOnly;
    impl Crypto for UnprotectOnly {
        fn unprotect(&mut self, _: SocketAddr, _: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>> {
            Some(packet.to_vec())
        }
        fn protect(&mut self, _: SocketAddr, _: Option<&SrtpKey>, _: &[u8]) -> Option<Vec<u8>> {
            panic!("the engine protected a packet under its lock");
        }
    }

    /// Room "r" with WebRTC publisher "w" at `local`, nominated at `browser`, keyed, publishing
    /// "video" on SSRC 5.
    fn webrtc_publisher(local: SocketAddr, browser: SocketAddr) -> Model {
        let key = || SrtpKey::new(mediaplane_core::srtp::SrtpSuite::AesCm128HmacSha1_80, vec![7; 30]).unwrap();
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_webrtc_participant("r", "w", local).unwrap();
        m.set_participant_nominated("r", "w", Some(browser)).unwrap();
        m.set_participant_srtp("r", "w", mediaplane_core::srtp::LegSrtp { inbound: Some(key()), outbound: Some(key()) }).unwrap();
        m.publish("r", "w", "video", StreamSpec { ssrc: Some(5), clock_rate: Some(90_000), ..Default::default() }).unwrap();
        m
    }

    /// Every transmit of `out`, reported sent.
    fn send_all(e: &mut Engine, out: Vec<Output<'_>>, now: u64) -> Vec<(SocketAddr, SocketAddr, Vec<u8>)> {
        let mut sent = Vec::new();
        for o in out {
            if let Output::Transmit { from, to, packet, copy, .. } = o {
                e.on_transmitted(copy, packet.len(), true, now);
                sent.push((from, to, packet.into_owned()));
            }
        }
        sent
    }

    /// A sender spraying SSRCs fills the RID report throttle's map with entries all fresh: it is
    /// started over, so it stays bounded and the next packets do not sweep it again each. One
    /// SSRC's RID is reported at most once per interval.
    #[test]
    fn the_rid_report_throttle_stays_bounded_under_a_spray_of_ssrcs() {
        let mut reported = HashMap::new();
        let t0 = 1_000_000_000;
        assert!(stream_id_due(&mut reported, (1, 7), t0));
        assert!(!stream_id_due(&mut reported, (1, 7), t0 + STREAM_ID_REPORT_NS - 1), "within the interval");
        assert!(stream_id_due(&mut reported, (1, 7), t0 + STREAM_ID_REPORT_NS), "the interval over");
        let mut largest = 0;
        for ssrc in 0..20_000u32 {
            // 20,000 SSRCs within 20 µs: every entry is fresh when the map is full.
            assert!(stream_id_due(&mut reported, (2, ssrc), t0 + STREAM_ID_REPORT_NS + ssrc as u64), "{ssrc}: a new SSRC is reported");
            largest = largest.max(reported.len());
        }
        assert!(largest <= 4097, "the map grew to {largest} entries (each packet past 4,096 swept it)");
    }

    /// A publisher's packet becomes one transmit per subscriber, counted once sent; a
    /// subscriber that speaks SRTP without a key yet gets none and is counted `tx_unkeyed`, not
    /// `tx_errors`; reception is measured at the arrival time passed in.
    #[test]
    fn copies_are_decided_and_counted_without_sockets() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "p", a("10.0.0.1:42000"), a("10.0.1.1:5000")).unwrap();
        m.publish("r", "p", "mic", StreamSpec { ssrc: Some(5), clock_rate: Some(8000), ..Default::default() }).unwrap();
        m.add_participant("r", "s", a("10.0.0.1:42002"), a("10.0.1.2:5000")).unwrap();
        m.add_webrtc_participant("r", "w", a("10.0.0.1:42004")).unwrap();
        m.set_participant_nominated("r", "w", Some(a("10.0.1.3:5000"))).unwrap();
        let to = || StreamRef { publisher: "p".into(), stream: "mic".into() };
        let (plain, browser) = (m.subscribe("r", "s", to()).unwrap(), m.subscribe("r", "w", to()).unwrap());
        let table = ForwardingTable::compile(&m, 1);
        let stream = table.streams.values().find(|e| e.label.ends_with("/mic")).unwrap().id;
        let mut e = Engine::new(EngineConfig { forwarded_qos: true, ..Default::default() });
        for seq in 0..5u16 {
            let t = 2_000_000_000 + seq as u64 * 20_000_000;
            let packet = build_rtp(0, seq, seq as u32 * 160, 5, &[7; 160]);
            let mut out = Vec::new();
            let dgram = Datagram { local: Some(a("10.0.0.1:42000")), src: Some(a("10.0.1.1:5000")), truncated: false, payload: &packet, arrived_ns: None };
            e.handle_datagram(at(t), &table, &mut NoCrypto, dgram, &mut out);
            let sent = send_all(&mut e, out, t);
            assert_eq!(sent, vec![(a("10.0.0.1:42002"), a("10.0.1.2:5000"), packet.clone())], "seq {seq}");
        }
        // From a stranger: dropped, counted, nothing out.
        let mut out = Vec::new();
        let stranger =
            Datagram { local: Some(a("10.0.0.1:42000")), src: Some(a("10.9.9.9:5000")), truncated: false, payload: &[0x80, 0, 0, 9], arrived_ns: None };
        e.handle_datagram(at(3_000_000_000), &table, &mut NoCrypto, stranger, &mut out);
        assert!(out.is_empty());
        let mut st = DataplaneStats::default();
        e.stats_into(&mut st);
        let t = &st.total;
        assert_eq!((t.rx_packets, t.tx_copies, t.tx_unkeyed, t.tx_errors), (6, 5, 5, 0), "{t:?}");
        assert_eq!(t.rx_packets - t.tx_copies, 1);
        let s = &st.streams[&stream];
        assert_eq!((s.rx_packets, s.tx_copies, s.tx_unkeyed), (5, 5, 5), "{s:?}");
        assert_eq!(st.reception[&stream].packets, 5);
        let counters = e.consumer_counters(&[plain, browser], 3_000_000_000);
        assert_eq!(counters[&plain].tx_copies, 5);
        assert!(!counters.contains_key(&browser) || counters[&browser].tx_errors == 0, "{counters:?}");
        assert_eq!(e.consumer_reception(&[plain])[&plain].packets, 5, "quality as forwarded");
        // The subscriber leaves: its state goes with it.
        let before = table.clone();
        m.unsubscribe("r", "s", &to()).unwrap();
        let after = ForwardingTable::compile(&m, 2);
        e.forget(&before, &after, None);
        assert!(e.consumer_counters(&[plain], 3_000_000_000).is_empty());
        assert!(e.consumer_reception(&[plain]).is_empty());
    }

    /// A video subscriber's NACK is answered from what the SFU sent it: the copy goes again, as
    /// it went; only what the SFU no longer has is asked of the publisher.
    #[test]
    fn a_subscribers_nack_is_answered_from_the_send_history() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "p", a("10.0.0.1:42000"), a("10.0.1.1:5000")).unwrap();
        m.publish("r", "p", "cam", StreamSpec { ssrc: Some(5), clock_rate: Some(90_000), ..Default::default() }).unwrap();
        m.add_participant("r", "s", a("10.0.0.1:42002"), a("10.0.1.2:5000")).unwrap();
        m.subscribe("r", "s", StreamRef { publisher: "p".into(), stream: "cam".into() }).unwrap();
        let table = ForwardingTable::compile(&m, 1);
        let mut e = Engine::new(EngineConfig { retransmit: true, ..Default::default() });
        let sent_copy = |seq: u16| build_rtp(96, seq, seq as u32 * 3000, 5, &[seq as u8; 900]);
        for seq in 0..5u16 {
            let (packet, mut out) = (sent_copy(seq), Vec::new());
            let dgram = Datagram { local: Some(a("10.0.0.1:42000")), src: Some(a("10.0.1.1:5000")), truncated: false, payload: &packet, arrived_ns: None };
            e.handle_datagram(at(2_000_000_000 + seq as u64 * 33_000_000), &table, &mut NoCrypto, dgram, &mut out);
            send_all(&mut e, out, 0);
        }
        // The subscriber lost 2 and 3, and asks for 9 (never sent).
        let nack = |pid, blp| [vec![0x80, 201, 0, 1, 0, 0, 0, 77], mediaplane_core::feedback::build::nack(77, 5, pid, blp)].concat();
        let feedback = |packet: &[u8], t: u64, e: &mut Engine| {
            let mut out = Vec::new();
            let dgram = Datagram { local: Some(a("10.0.0.1:42002")), src: Some(a("10.0.1.2:5000")), truncated: false, payload: packet, arrived_ns: None };
            e.handle_datagram(at(t), &table, &mut NoCrypto, dgram, &mut out);
            send_all(e, out, t)
        };
        let out = feedback(&[nack(2, 0b1), mediaplane_core::feedback::build::nack(77, 5, 9, 0)].concat(), 2_200_000_000, &mut e);
        let to_subscriber: Vec<&Vec<u8>> = out.iter().filter(|(_, to, _)| *to == a("10.0.1.2:5000")).map(|(_, _, p)| p).collect();
        assert_eq!(to_subscriber, [&sent_copy(2), &sent_copy(3)], "sent again as they went");
        let to_publisher: Vec<&Vec<u8>> = out.iter().filter(|(_, to, _)| *to == a("10.0.1.1:5000")).map(|(_, _, p)| p).collect();
        assert_eq!(to_publisher.len(), 1, "{out:?}");
        assert_eq!(to_publisher[0][8..], mediaplane_core::feedback::build::nack(77, 5, 9, 0)[..], "only what the SFU does not have");
        // Asked again at once: in flight, not sent twice.
        assert!(feedback(&nack(2, 0), 2_205_000_000, &mut e).is_empty());
        let mut st = DataplaneStats::default();
        e.stats_into(&mut st);
        assert_eq!((st.extra["retransmit_sent"], st.extra["retransmit_suppressed"]), (2, 1));
        // Audio is not kept: its NACKs go to the publisher as before (checked by the other tests).
    }

    /// Copies to a subscriber keyed for SRTP leave the engine clear, marked to be sealed by the
    /// driver after the lock is released: the engine never encrypts (its crypto is asked only to
    /// unprotect).
    #[test]
    fn copies_to_an_srtp_subscriber_are_sealed_by_the_driver() {
        let key = || SrtpKey::new(mediaplane_core::srtp::SrtpSuite::AesCm128HmacSha1_80, vec![7; 30]).unwrap();
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "p", a("10.0.0.1:42000"), a("10.0.1.1:5000")).unwrap();
        m.publish("r", "p", "mic", StreamSpec { ssrc: Some(5), ..Default::default() }).unwrap();
        let srtp = mediaplane_core::srtp::LegSrtp { inbound: Some(key()), outbound: Some(key()) };
        m.add_srtp_participant("r", "s", a("10.0.0.1:42002"), a("10.0.1.2:5000"), Some(srtp)).unwrap();
        m.subscribe("r", "s", StreamRef { publisher: "p".into(), stream: "mic".into() }).unwrap();
        let table = ForwardingTable::compile(&m, 1);
        let mut e = Engine::new(EngineConfig::default());
        let packet = build_rtp(0, 1, 160, 5, &[7; 160]);
        let mut out = Vec::new();
        let dgram = Datagram { local: Some(a("10.0.0.1:42000")), src: Some(a("10.0.1.1:5000")), truncated: false, payload: &packet, arrived_ns: None };
        e.handle_datagram(at(2_000_000_000), &table, &mut UnprotectOnly, dgram, &mut out);
        match &out[..] {
            [Output::Transmit { from, to, packet: p, copy: Some(_), seal: true }] => {
                assert_eq!((*from, *to), (a("10.0.0.1:42002"), a("10.0.1.2:5000")));
                assert_eq!(&p[..], &packet[..], "clear until the driver seals it");
            }
            other => panic!("{other:?}"),
        }
    }

    /// A kernel receive time on the wall clock maps onto the monotonic clock by the reading's
    /// offset; one from the future is now, one older than a second is not trusted.
    #[test]
    fn kernel_receive_times_map_onto_the_monotonic_clock() {
        let now = Now { limits_ns: 1, mono_ns: 5_000_000_000, wall_us: 1_700_000_000_000_000 };
        let wall_ns = 1_700_000_000_000_000_000i64;
        assert_eq!(now.arrival(wall_ns - 3_000_000), Some(4_997_000_000));
        assert_eq!(now.arrival(wall_ns + 3_000_000), Some(5_000_000_000));
        assert_eq!(now.arrival(wall_ns - 1_000_000_000), None);
    }

    /// A WebRTC publisher that negotiated transport-cc gets its arrivals fed back every
    /// interval, from the address it sends to, sealed with its key by the driver; the engine's
    /// timer says when; one that did not negotiate it gets nothing.
    #[test]
    fn a_publishers_transport_gets_its_arrivals_fed_back() {
        use mediaplane_core::transport_feedback::FEEDBACK_INTERVAL_NS;
        let (local, browser) = (a("10.0.0.1:42004"), a("10.0.1.3:5000"));
        let run = |negotiated: bool| {
            let mut m = webrtc_publisher(local, browser);
            if negotiated {
                m.set_transport_cc("r", "w", 3).unwrap();
            }
            let table = ForwardingTable::compile(&m, 1);
            let mut e = Engine::new(EngineConfig::default());
            let t0 = 2_000_000_000;
            for seq in [10u16, 11, 13] {
                // RTP with the one-byte header extension: id 3, two bytes of transport-wide number.
                let mut packet = build_rtp(96, seq, 0, 5, &[7; 100]);
                packet[0] |= 0x10;
                let ext = [0xbe, 0xde, 0, 1, 0x31, (seq >> 8) as u8, seq as u8, 0];
                packet.splice(12..12, ext);
                // All read in one batch 10 ms after the last arrived: the kernel's times are fed back.
                let arrived_ns = Some(t0 + u64::from(seq) * 1_000_000);
                let dgram = Datagram { local: Some(local), src: Some(browser), truncated: false, payload: &packet, arrived_ns };
                e.handle_datagram(at(t0 + 23_000_000), &table, &mut UnprotectOnly, dgram, &mut Vec::new());
            }
            let due = e.poll_timeout();
            let mut out = Vec::new();
            e.handle_timeout(at(t0 + 10_000_000 + FEEDBACK_INTERVAL_NS), &table, &mut UnprotectOnly, &KernelReadings::default(), &mut out);
            let mut st = DataplaneStats::default();
            e.stats_into(&mut st);
            (
                due,
                out.into_iter()
                    .map(|o| match o {
                        Output::Transmit { from, to, packet, copy: None, seal: true } => (from, to, packet.into_owned()),
                        other => panic!("{other:?}"),
                    })
                    .collect::<Vec<_>>(),
                st.extra["transport_feedback_sent"],
                e.poll_timeout(),
            )
        };
        let (due, sent, counted, after) = run(true);
        assert_eq!(due, Some(2_000_000_000 + 10_000_000 + FEEDBACK_INTERVAL_NS), "due an interval after the first arrival");
        let [(from, to, fb)] = &sent[..] else { panic!("{sent:?}") };
        assert_eq!((*from, *to, fb[0] & 0x1f, fb[1]), (local, browser, 15, 205));
        assert_eq!((u16::from_be_bytes([fb[12], fb[13]]), u16::from_be_bytes([fb[14], fb[15]])), (10, 4), "10 to 13, 12 lost");
        // One status chunk, then the deltas in 250 µs ticks: 11 came 1 ms after 10, 13 2 ms after 11.
        assert_eq!((fb[23], fb[24]), (4, 8), "the kernel's arrival times, not the batch's");
        assert_eq!((counted, after), (1, Some(2_000_000_000 + 23_000_000 + RR_INTERVAL_NS)), "then a receiver report is next");
        assert_eq!(run(false).1, vec![], "not negotiated: nothing fed back");
    }

    /// A room's ceiling reaches its WebRTC publishers as a REMB at their first packet and every
    /// second after; a new ceiling goes at once, and lifting it sends the uncapped value (a
    /// browser keeps the last REMB's limit); a room without one sends none.
    #[test]
    fn a_rooms_ceiling_reaches_its_publishers_as_remb() {
        let (local, browser) = (a("10.0.0.1:42004"), a("10.0.1.3:5000"));
        let mut m = webrtc_publisher(local, browser);
        let uncapped = ForwardingTable::compile(&m, 1);
        m.set_publisher_max_kbps("r", Some(400)).unwrap();
        let capped = ForwardingTable::compile(&m, 2);
        let mut e = Engine::new(EngineConfig::default());
        // REMBs (bits/s) sent when the timer is run at `t` with `table`.
        let remb_at = |e: &mut Engine, t: u64, table: &ForwardingTable| -> Vec<u64> {
            let mut out = Vec::new();
            e.handle_timeout(at(t), table, &mut UnprotectOnly, &KernelReadings::default(), &mut out);
            out.iter()
                .filter_map(|o| match o {
                    Output::Transmit { to, packet, seal: true, .. } if *to == browser && &packet[12..16] == b"REMB" => {
                        let (exp, mantissa) = (packet[17] >> 2, u32::from_be_bytes([0, packet[17] & 3, packet[18], packet[19]]));
                        assert_eq!(u32::from_be_bytes(packet[20..24].try_into().unwrap()), 5, "it names the publisher's SSRC");
                        Some(u64::from(mantissa) << exp)
                    }
                    _ => None,
                })
                .collect()
        };
        let packet = |e: &mut Engine, t: u64, table: &ForwardingTable| {
            let p = build_rtp(96, (t / 1_000_000) as u16, 0, 5, &[7; 100]);
            let dgram = Datagram { local: Some(local), src: Some(browser), truncated: false, payload: &p, arrived_ns: None };
            e.handle_datagram(at(t), table, &mut UnprotectOnly, dgram, &mut Vec::new());
        };
        let t0 = 2_000_000_000;
        packet(&mut e, t0, &uncapped);
        assert_eq!(remb_at(&mut e, t0 + 10 * REMB_INTERVAL_NS, &uncapped), vec![], "no ceiling, no REMB");
        packet(&mut e, t0 + 1, &capped);
        assert_eq!(e.poll_timeout(), Some(0), "the ceiling goes at once");
        assert_eq!(remb_at(&mut e, t0 + 2, &capped), vec![400_000]);
        assert_eq!(remb_at(&mut e, t0 + REMB_INTERVAL_NS, &capped), vec![], "once a second");
        assert_eq!(remb_at(&mut e, t0 + 2 + REMB_INTERVAL_NS, &capped), vec![400_000]);
        // Lifted: the table says so at the next timer.
        assert_eq!(remb_at(&mut e, t0 + 2 + 2 * REMB_INTERVAL_NS, &uncapped), vec![UNCAPPED_BPS >> 16 << 16]);
        assert_eq!(remb_at(&mut e, t0 + 2 + 3 * REMB_INTERVAL_NS, &uncapped), vec![UNCAPPED_BPS >> 16 << 16], "and goes on saying so");
    }

    /// A publisher without transport-cc whose packets carry abs-send-time gets the SFU's own
    /// estimate of its path as a REMB (about what arrives, growing while the path is clear),
    /// at most its room's ceiling; one whose packets carry no send time gets none.
    #[test]
    fn a_publisher_without_transport_cc_gets_the_sfus_estimate_as_remb() {
        let (local, browser) = (a("10.0.0.1:42004"), a("10.0.1.3:5000"));
        let run = |stamped: bool, ceiling: Option<u32>| -> Vec<u64> {
            let mut m = webrtc_publisher(local, browser);
            m.set_abs_send_time("r", "w", 2).unwrap();
            m.set_publisher_max_kbps("r", ceiling).unwrap();
            let table = ForwardingTable::compile(&m, 1);
            let mut e = Engine::new(EngineConfig::default());
            let mut rembs = Vec::new();
            let t0 = 2_000_000_000u64;
            // 800 kbit/s for 3 s: a 1,000-byte packet every 10 ms, sent as they arrive.
            for i in 0..300u64 {
                let t = t0 + i * 10_000_000;
                let mut packet = build_rtp(96, i as u16, 0, 5, &[7; 976]);
                if stamped {
                    let sent = ((i * 10_000_000) as u128 * (1 << 18) / 1_000_000_000) as u32;
                    packet[0] |= 0x10;
                    packet.splice(12..12, [0xbe, 0xde, 0, 1, 0x22, (sent >> 16) as u8, (sent >> 8) as u8, sent as u8]);
                }
                let dgram = Datagram { local: Some(local), src: Some(browser), truncated: false, payload: &packet, arrived_ns: Some(t) };
                e.handle_datagram(at(t), &table, &mut UnprotectOnly, dgram, &mut Vec::new());
                let mut out = Vec::new();
                e.handle_timeout(at(t), &table, &mut UnprotectOnly, &KernelReadings::default(), &mut out);
                rembs.extend(out.iter().filter_map(|o| match o {
                    Output::Transmit { to, packet, .. } if *to == browser && &packet[12..16] == b"REMB" => {
                        let (exp, mantissa) = (packet[17] >> 2, u32::from_be_bytes([0, packet[17] & 3, packet[18], packet[19]]));
                        Some(u64::from(mantissa) << exp)
                    }
                    _ => None,
                }));
            }
            rembs
        };
        let estimated = run(true, None);
        assert!(estimated.len() >= 2 && estimated.len() <= 3, "about one a second once a rate is known: {estimated:?}");
        assert!(estimated.iter().all(|b| (800_000..1_300_000).contains(b)), "about the 0.8 Mbit/s that arrive, growing: {estimated:?}");
        assert!(estimated.windows(2).all(|w| w[1] > w[0]), "{estimated:?}");
        assert!(run(true, Some(500)).iter().all(|b| *b == 500_000), "the ceiling holds");
        assert_eq!(run(false, None), Vec::<u64>::new(), "no send times, no estimate");
    }

    /// A WebRTC publisher gets a receiver report every second about each of its streams: the
    /// loss of the interval and in all, the highest number, and its latest SR echoed with the
    /// delay since.
    #[test]
    fn a_publisher_gets_receiver_reports() {
        use mediaplane_core::call_quality::parse_reports;
        let (local, browser) = (a("10.0.0.1:42004"), a("10.0.1.3:5000"));
        let table = ForwardingTable::compile(&webrtc_publisher(local, browser), 1);
        let mut e = Engine::new(EngineConfig::default());
        let t0 = 2_000_000_000;
        let send = |e: &mut Engine, t: u64, p: &[u8]| {
            let dgram = Datagram { local: Some(local), src: Some(browser), truncated: false, payload: p, arrived_ns: None };
            e.handle_datagram(at(t), &table, &mut UnprotectOnly, dgram, &mut Vec::new());
        };
        // Ten numbers, 3 lost; an SR in between.
        for seq in (0..10u16).filter(|s| *s != 3) {
            send(&mut e, t0 + u64::from(seq) * 20_000_000, &build_rtp(96, seq, u32::from(seq) * 3000, 5, &[7; 100]));
        }
        send(&mut e, t0 + 300_000_000, &mediaplane_core::call_quality::build_report(5, Some(0x1234_5678), &[]));
        let reports = |e: &mut Engine, t: u64| -> Vec<ReportBlock> {
            let mut out = Vec::new();
            e.handle_timeout(at(t), &table, &mut UnprotectOnly, &KernelReadings::default(), &mut out);
            out.iter()
                .filter_map(|o| match o {
                    Output::Transmit { to, packet, seal: true, .. } if *to == browser && packet[1] == 201 => parse_reports(packet).map(|(_, b)| b),
                    _ => None,
                })
                .flatten()
                .collect()
        };
        assert_eq!(reports(&mut e, t0 + RR_INTERVAL_NS - 1), vec![], "a second after its first packet");
        let now = t0 + 800_000_000 + RR_INTERVAL_NS;
        let blocks = reports(&mut e, now);
        let [b] = &blocks[..] else { panic!("{blocks:?}") };
        // 1 of 10 lost: 25/256; the SR 1.5 s before: 98,304/65,536 s.
        assert_eq!((b.reporter, b.about, b.fraction_lost, b.cumulative_lost, b.highest_seq & 0xffff), (SFU_SSRC, 5, 25, 1, 9));
        assert_eq!((b.lsr, b.dlsr), (0x1234_5678, 98_304));
        // The next second: nothing new, nothing lost in it.
        send(&mut e, now + 1, &build_rtp(96, 10, 30_000, 5, &[7; 100]));
        let blocks = reports(&mut e, now + RR_INTERVAL_NS);
        assert_eq!(blocks.iter().map(|b| (b.fraction_lost, b.cumulative_lost, b.highest_seq & 0xffff)).collect::<Vec<_>>(), vec![(0, 1, 10)]);
    }

    /// Batches decided out of their clocks' order (a worker read its clock, then waited for the
    /// lock behind one that read later) are limited as if at the latest clock seen: a stream
    /// at its rate limit is not cut for a packet that only looked early.
    #[test]
    fn the_limits_clock_does_not_go_back_between_batches() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "p", a("10.0.0.1:42000"), a("10.0.1.1:5000")).unwrap();
        m.add_participant("r", "s", a("10.0.0.1:42002"), a("10.0.1.2:5000")).unwrap();
        m.publish("r", "p", "mic", StreamSpec::default()).unwrap();
        m.subscribe("r", "s", StreamRef { publisher: "p".into(), stream: "mic".into() }).unwrap();
        // 100 packets/s (10 ms apart), 10 ms of burst.
        let rate = mediaplane_core::ratelimit::RateLimit { pps: 100, bps: 0, burst_ms: 10 };
        let table = ForwardingTable::compile_with_rate(&m, 1, Some(rate));
        let mut e = Engine::new(EngineConfig::default());
        let t = 2_000_000_000;
        let mut forwarded = |at_ms: u64, packets: usize| -> usize {
            let now = t + at_ms * 1_000_000;
            let packet = build_rtp(0, 1, 0, 5, &[0; 20]);
            let dgram = Datagram { local: Some(a("10.0.0.1:42000")), src: Some(a("10.0.1.1:5000")), truncated: false, payload: &packet, arrived_ns: None };
            let mut out = Vec::new();
            e.handle_batch(at(now), &table, &mut NoCrypto, std::iter::repeat_n(dgram, packets), &mut out);
            out.len()
        };
        assert_eq!(forwarded(0, 2), 2, "the burst");
        assert_eq!(forwarded(20, 1), 1, "on time");
        // Read at 15 ms, decided after the 20 ms batch: as if at 20 ms, it fits the burst (at
        // 15 ms it would not: 15 ms ahead of its time).
        assert_eq!(forwarded(15, 1), 1, "a packet that only looked early");
        assert_eq!(forwarded(20, 1), 0, "the limit still holds");
    }

    /// Without kernel states the engine has no timer; with them, the tick is due at once and
    /// then every TICK_NS of the time passed in, and only then does it run.
    #[test]
    fn the_tick_follows_the_time_passed_in() {
        assert_eq!(Engine::new(EngineConfig::default()).poll_timeout(), None);
        let kernel = Arc::new(FakeKernel::default());
        let mut e = Engine::new(EngineConfig { kernel_layers: Some(kernel.clone()), ..Default::default() });
        let table = ForwardingTable::compile(&Model::new(), 1);
        assert_eq!(e.poll_timeout(), Some(0));
        let t0 = 5_000_000_000;
        let none = KernelReadings::default();
        e.handle_timeout(at(t0), &table, &mut NoCrypto, &none, &mut Vec::new());
        assert_eq!(e.poll_timeout(), Some(t0 + TICK_NS));
        assert_eq!(kernel.listed.load(Ordering::Relaxed), 1, "the first tick reconciles");
        // Early: nothing runs.
        e.handle_timeout(at(t0 + TICK_NS - 1), &table, &mut NoCrypto, &none, &mut Vec::new());
        assert_eq!(e.poll_timeout(), Some(t0 + TICK_NS));
        // Every RECONCILE_TICKS ticks the next reconciles.
        for k in 1..=RECONCILE_TICKS {
            e.handle_timeout(at(t0 + k * TICK_NS), &table, &mut NoCrypto, &none, &mut Vec::new());
        }
        assert_eq!(kernel.listed.load(Ordering::Relaxed), 2);
    }

    /// The layer streams the tick visits are found once per table, and a new table (a new
    /// map, or the same one changed) is never taken for the last one.
    #[test]
    fn the_layer_streams_follow_the_table() {
        let (m, _) = simulcast_room(a("10.0.0.1:1").ip(), a("10.0.1.1:5000"), a("10.0.1.2:5000"));
        let mut layered = LayeredStreams::default();
        assert!(layered.entries(&ForwardingTable::compile(&Model::new(), 1)).is_empty());
        let table = ForwardingTable::compile(&m, 2);
        let want: Vec<u32> = table.streams.values().filter(|e| e.simulcast.is_some()).map(|e| e.id).collect();
        assert!(want.len() >= 2, "{want:?}");
        let ids = |l: &mut LayeredStreams, t: &ForwardingTable| l.entries(t).iter().map(|e| e.id).collect::<Vec<u32>>();
        assert_eq!(ids(&mut layered, &table), want);
        assert_eq!(ids(&mut layered, &table), want, "the same table again");
        // A copy of the table with one layer gone (the copy shares the map until it changes).
        let mut fewer = table.clone();
        let gone = fewer.streams.values().find(|e| e.simulcast.is_some()).map(|e| e.key).unwrap();
        fewer.streams.remove(&gone);
        assert_eq!(ids(&mut layered, &fewer), want[1..].to_vec());
        assert_eq!(ids(&mut layered, &table), want, "back to the first");
    }

    /// A consumer the tick has not aimed yet is read from the kernel on that first tick: a
    /// restarted daemon's consumer whose pinned state already receives the top layer is taken
    /// for what it is, not for one waiting for that layer (which would ask its publisher for a
    /// keyframe nobody needs). Time passed in: no waiting for a reconciling tick to go by.
    #[test]
    fn the_tick_reads_a_consumer_it_has_not_aimed_yet() {
        let (m, consumer) = simulcast_room(a("10.0.0.1:1").ip(), a("10.0.1.1:5000"), a("10.0.1.2:5000"));
        let kernel = Arc::new(FakeKernel::default());
        let mut e = Engine::new(EngineConfig { kernel_layers: Some(kernel.clone()), ..Default::default() });
        let (empty, table) = (ForwardingTable::compile(&Model::new(), 1), ForwardingTable::compile(&m, 2));
        let t0 = 5_000_000_000;
        // The first (reconciling) tick on the empty table, then the pinned state, then the table.
        e.handle_timeout(at(t0), &empty, &mut NoCrypto, &KernelReadings::default(), &mut Vec::new());
        kernel.states.lock().insert(consumer, state_on_top_layer());
        e.forget(&empty, &table, None);
        let mut requests = Vec::new();
        for k in 1..=5 {
            let mut out = Vec::new();
            e.handle_timeout(at(t0 + k * TICK_NS), &table, &mut NoCrypto, &KernelReadings::read(&*kernel, &table), &mut out);
            requests.extend(send_all(&mut e, out, t0 + k * TICK_NS));
        }
        assert_eq!(kernel.listed.load(Ordering::Relaxed), 1, "no reconciling tick among them");
        let c = e.consumer_counters(&[consumer], t0 + 6 * TICK_NS).remove(&consumer).and_then(|c| c.layer).unwrap();
        assert_eq!((c.current, c.target), (Some(1), Some(1)), "{c:?}");
        assert_eq!(c.stats.keyframe_requests, 0, "{c:?}");
        assert!(requests.is_empty(), "the publisher was asked for a keyframe: {requests:?}");
    }

    /// A consumer on its way to a layer makes the tick ask the publisher for a keyframe, once
    /// per the router's interval however often the tick runs, from the layer stream's SFU
    /// address to the publisher.
    #[test]
    fn a_consumer_waiting_for_a_layer_asks_its_publisher_through_the_tick() {
        let (m, _) = simulcast_room(a("10.0.0.1:1").ip(), a("10.0.1.1:5000"), a("10.0.1.2:5000"));
        let kernel = Arc::new(FakeKernel::default());
        let mut e = Engine::new(EngineConfig { kernel_layers: Some(kernel.clone()), ..Default::default() });
        let table = ForwardingTable::compile(&m, 1);
        let t0 = 5_000_000_000;
        let mut requests = Vec::new();
        for k in 0..10 {
            let mut out = Vec::new();
            e.handle_timeout(at(t0 + k * TICK_NS), &table, &mut NoCrypto, &KernelReadings::read(&*kernel, &table), &mut out);
            requests.extend(send_all(&mut e, out, t0 + k * TICK_NS));
        }
        assert!(!requests.is_empty(), "no keyframe request in 10 ticks");
        for (from, to, pli) in &requests {
            assert_eq!((*from, *to), (a("10.0.0.1:42000"), a("10.0.1.1:5000")));
            // A compound (RR first): one of its packets is a PLI (PT 206, FMT 1).
            let (mut i, mut pli_found) = (0, false);
            while i + 4 <= pli.len() {
                pli_found |= pli[i + 1] == 206 && pli[i] & 0x1f == 1;
                i += 4 * (u16::from_be_bytes([pli[i + 2], pli[i + 3]]) as usize + 1);
            }
            assert!(pli_found, "no PLI in {pli:?}");
        }
        assert!(requests.len() < 10, "coalesced: {} requests in 10 ticks", requests.len());
    }

    /// A keyframe of `layer` of the room's publisher, as the SFU receives it.
    fn layer_keyframe(e: &mut Engine, table: &ForwardingTable, layer: u32, seq: u16, t: u64) -> Vec<(SocketAddr, SocketAddr, Vec<u8>)> {
        let packet = build_rtp(96, seq, 3000 * seq as u32, 100 + layer, &[0x90, 0x80, 0x05, 0x10, 0, 0, 0, 0]);
        let dgram = Datagram { local: Some(a("10.0.0.1:42000")), src: Some(a("10.0.1.1:5000")), truncated: false, payload: &packet, arrived_ns: None };
        let mut out = Vec::new();
        e.handle_datagram(at(t), table, &mut NoCrypto, dgram, &mut out);
        send_all(e, out, t)
    }

    /// A simulcast consumer no stream of which the kernel forwards (an SRTP subscriber's, as in
    /// every WebRTC room on the eBPF plane) is decided here: renumbered onto its SSRC with no
    /// call to the kernel, however many packets and ticks go by.
    #[test]
    fn a_consumer_only_the_slow_path_serves_costs_no_kernel_call() {
        let (m, consumer) = simulcast_room(a("10.0.0.1:1").ip(), a("10.0.1.1:5000"), a("10.0.1.2:5000"));
        let kernel = Arc::new(FakeKernel::default());
        kernel.forwards_nothing.store(true, Ordering::Relaxed);
        let mut e = Engine::new(EngineConfig { kernel_layers: Some(kernel.clone()), ..Default::default() });
        let (empty, table) = (ForwardingTable::compile(&Model::new(), 1), ForwardingTable::compile(&m, 2));
        e.forget(&empty, &table, None);
        let t0 = 5_000_000_000;
        let mut sent = Vec::new();
        for k in 0..10u16 {
            let t = t0 + k as u64 * TICK_NS;
            e.handle_timeout(at(t), &table, &mut NoCrypto, &KernelReadings::read(&*kernel, &table), &mut Vec::new());
            sent.extend(layer_keyframe(&mut e, &table, 1, 1000 + k, t));
        }
        assert_eq!(sent.len(), 10, "every keyframe of layer 1 goes to the subscriber: {sent:?}");
        let seqs: Vec<u16> = sent.iter().map(|(_, _, p)| u16::from_be_bytes([p[2], p[3]])).collect();
        assert!(seqs.windows(2).all(|w| w[1] == w[0].wrapping_add(1)), "{seqs:?}");
        assert!(sent.iter().all(|(_, to, p)| *to == a("10.0.1.2:5000") && p[8..12] == 100u32.to_be_bytes()), "onto the consumer's SSRC");
        assert_eq!(kernel.consumer_calls.load(Ordering::Relaxed), 0, "a call to the kernel about the consumer");
        assert!(kernel.states.lock().get(&consumer).is_none());
        let c = e.consumer_counters(&[consumer], t0 + 10 * TICK_NS).remove(&consumer).and_then(|c| c.layer).unwrap();
        assert_eq!((c.current, c.stats.forwarded), (Some(1), 10), "{c:?}");
    }

    /// When a stream of such a consumer comes to the kernel (its last SRTP subscriber left, say),
    /// the install hands the consumer's state over before the kernel's table changes, so the
    /// kernel's copies continue its numbering; from then on the kernel decides.
    #[test]
    fn a_consumer_the_kernel_comes_to_serve_is_handed_over_at_the_install() {
        let (m, consumer) = simulcast_room(a("10.0.0.1:1").ip(), a("10.0.1.1:5000"), a("10.0.1.2:5000"));
        let kernel = Arc::new(FakeKernel::default());
        kernel.forwards_nothing.store(true, Ordering::Relaxed);
        let mut e = Engine::new(EngineConfig { kernel_layers: Some(kernel.clone()), ..Default::default() });
        let (empty, table) = (ForwardingTable::compile(&Model::new(), 1), ForwardingTable::compile(&m, 2));
        e.forget(&empty, &table, None);
        let t0 = 5_000_000_000;
        for k in 0..3u16 {
            assert_eq!(layer_keyframe(&mut e, &table, 1, 1000 + k, t0 + k as u64).len(), 1);
        }
        kernel.forwards_nothing.store(false, Ordering::Relaxed);
        let next = ForwardingTable::compile(&m, 3);
        e.forget(&table, &next, None);
        let handed = kernel.states.lock().get(&consumer).cloned().expect("the state went to the kernel");
        assert_eq!((handed.forwarded, handed.target, handed.newest[1]), (3, Some(1), Some(1002)), "{handed:?}");
        // The kernel decides now (the fake one forwards nothing).
        let calls = kernel.consumer_calls.load(Ordering::Relaxed);
        assert!(layer_keyframe(&mut e, &next, 1, 1003, t0 + 10).is_empty());
        assert!(kernel.consumer_calls.load(Ordering::Relaxed) > calls);
    }
}
