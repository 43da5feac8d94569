//! The portable user-space data plane: UDP sockets, batched I/O, one worker thread per core.
//!
//! Every SFU address in the table gets one socket per worker in an `SO_REUSEPORT` group, so the
//! kernel spreads flows over workers and keeps each flow on one worker (no reordering). A worker
//! receives with `recvmmsg`, decides with [`ForwardingTable::classify`], and sends each copy from
//! the socket bound to the copy's `from` address with `sendmmsg`, grouped per socket.
//!
//! Atomic updates: the table and the sockets it needs live in one immutable [`State`] snapshot
//! swapped with `ArcSwap`; a worker loads it once per received batch, so a batch is processed
//! entirely with the old or entirely with the new table.
//!
//! Updates cost what changed: the table and the socket map are persistent maps (O(1) clones),
//! an update with its changed keys ([`Dataplane::apply_changes`]) only counts the addresses
//! those entries use, and workers are told which sockets came and went rather than rescanning.

use crate::kernel_layers::{KernelLayers, KernelReceived};
use crate::srtp::SrtpSlot;
use crate::sys::{self, Epoll, EventFd, Outgoing, RecvBatch};
use crate::{ConsumerCounters, ConsumerReport, Counters, Dataplane, DataplaneError, DataplaneEvent, DataplaneStats, HeaderPolicy, LayerState};
use arc_swap::ArcSwap;
use mediaplane_core::call_quality::SenderReportTimes;
use mediaplane_core::feedback::{FeedbackEntry, FeedbackRouter, LayerMap};
use mediaplane_core::layer_choice::{self, LayerActivity, LayerChoice};
use mediaplane_core::pipeline::{CopyOf, Effect, LayerFanOut, Pipeline, Plane};
use mediaplane_core::ratelimit::{RateLimit, RateParams, RateState};
use mediaplane_core::reception::{ReceptionReport, RtpReception};
use mediaplane_core::rtp::{demux, MediaKind, RtpHeader};
use mediaplane_core::simulcast::{self, Decision, LayerRewriter};
use mediaplane_core::srtp::{Protection, SrtpKey};
use mediaplane_core::table::{IngressKey, SimulcastLayer, SlowReason, SourceRule, StreamEntry};
use mediaplane_core::ForwardingTable;
use parking_lot::Mutex;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Largest UDP payload; anything the kernel has to truncate to fit is counted as malformed.
const MAX_DATAGRAM: usize = 65_535;
const WAKE_TOKEN: u64 = u64::MAX;
/// Batches read from one socket before looking at the others (fairness between sockets).
const BATCHES_PER_TURN: usize = 4;

#[derive(Debug, Clone)]
pub struct UserspaceConfig {
    /// Worker threads; 0 means one per core.
    pub workers: usize,
    /// Datagrams per `recvmmsg`.
    pub batch: usize,
    /// SO_RCVBUF / SO_SNDBUF per socket, bytes.
    pub socket_buffer: usize,
    /// Steered mode (the eBPF plane's slow path): instead of one socket per SFU address, each
    /// worker receives on a catch-all socket per address family that an sk_lookup program
    /// steers packets to (their destination read from IP(V6)_ORIGDSTADDR), and sends copies
    /// as complete IP packets on a raw socket. Sessions then cost no file descriptors.
    pub steered: bool,
    /// The IP header of every copy (see [`HeaderPolicy`]).
    pub header: HeaderPolicy,
    /// Steered mode: called with the fwmark of each received datagram that carried one, once its
    /// copies are sent (the kernel path hands packets up in stream order and waits for these).
    pub mark_ack: Option<MarkAck>,
    /// The eBPF plane's slow path: simulcast consumers are renumbered by the kernel, on its
    /// states; this plane sets their targets, asks for their keyframes and decides what it
    /// forwards itself through them ([`crate::kernel_layers`]).
    pub kernel_layers: Option<crate::kernel_layers::KernelLayersHandle>,
    /// Account each consumer's RTP as forwarded ([`Dataplane::consumer_reception`]); off, a
    /// consumer has none (and the eBPF plane's program saves its per-copy accounting).
    pub forwarded_qos: bool,
}

/// See [`UserspaceConfig::mark_ack`].
#[derive(Clone)]
pub struct MarkAck(pub Arc<dyn Fn(u32) + Send + Sync>);

impl std::fmt::Debug for MarkAck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MarkAck")
    }
}

impl Default for UserspaceConfig {
    fn default() -> Self {
        UserspaceConfig {
            workers: 0,
            batch: 32,
            socket_buffer: 4 << 20,
            steered: false,
            header: HeaderPolicy::default(),
            mark_ack: None,
            kernel_layers: None,
            forwarded_qos: true,
        }
    }
}

/// A worker's sockets in steered mode: catch-all receivers and raw senders per family
/// (IPv6 ones only where the namespace has IPv6).
struct SteerSockets {
    rx4: Socket,
    rx6: Option<Socket>,
    raw4: Socket,
    raw6: Option<Socket>,
    /// Raw `IPPROTO_UDP` senders without header inclusion, for copies too large for their path:
    /// the kernel never fragments a header-included packet, but fragments these as it does UDP.
    big4: Socket,
    big6: Option<Socket>,
    /// What the raw copies' headers carry.
    header: HeaderPolicy,
}

impl SteerSockets {
    fn open(buffer: usize, header: HeaderPolicy) -> Result<SteerSockets, DataplaneError> {
        let rx = |addr: SocketAddr| -> std::io::Result<Socket> {
            let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
            // Loopback, so the port is not reachable from outside; freebind so that a namespace
            // whose lo is still down does not stop the daemon.
            if addr.is_ipv6() {
                s.set_only_v6(true)?;
                s.set_freebind_ipv6(true)?;
            } else {
                s.set_freebind(true)?;
            }
            let _ = s.set_recv_buffer_size(buffer);
            let _ = s.set_send_buffer_size(buffer);
            s.bind(&SockAddr::from(addr))?;
            sys::set_recv_orig_dst(s.as_raw_fd(), addr.is_ipv6())?;
            sys::set_recv_mark(s.as_raw_fd())?;
            s.set_nonblocking(true)?;
            Ok(s)
        };
        let raw = |domain: Domain| -> std::io::Result<Socket> {
            let s = Socket::new(domain, Type::RAW, Some(Protocol::from(libc::IPPROTO_RAW)))?;
            let _ = s.set_send_buffer_size(buffer);
            Ok(s)
        };
        // The kernel builds these packets' headers: the policy goes in socket options. The
        // default path-MTU discovery, the plain plane's UDP sockets' too (IP_PMTUDISC_WANT, or
        // DONT with ip_no_pmtu_disc; IPV6_DONTFRAG off), lets it fragment. Freebind: the source
        // address (IP(V6)_PKTINFO) is checked as a UDP socket's bind would be.
        let big = |domain: Domain| -> std::io::Result<Socket> {
            let s = Socket::new(domain, Type::RAW, Some(Protocol::UDP))?;
            let v6 = domain == Domain::IPV6;
            if v6 {
                s.set_freebind_ipv6(true)?;
            } else {
                s.set_freebind(true)?;
            }
            // A raw UDP socket is handed a clone of every UDP packet the host delivers unless it
            // is bound: bound to an address nothing is sent to (documentation ranges, RFC 5737 /
            // RFC 3849), it gets none. The source of each send comes from IP(V6)_PKTINFO. The
            // smallest receive buffer bounds what arrived before the bind (never read).
            let nowhere: SocketAddr = if v6 { "[2001:db8::1]:0".parse().unwrap() } else { "192.0.2.1:0".parse().unwrap() };
            s.bind(&SockAddr::from(nowhere))?;
            let _ = s.set_recv_buffer_size(0);
            sys::set_header_policy(s.as_raw_fd(), v6, &header)?;
            let _ = s.set_send_buffer_size(buffer);
            Ok(s)
        };
        let ctx = |what: &'static str| move |e| io_err(&format!("slow-path {what} socket"), e);
        let rx4 = rx("127.0.0.1:0".parse().unwrap()).map_err(ctx("IPv4 catch-all"))?;
        let raw4 = raw(Domain::IPV4).map_err(ctx("raw IPv4"))?;
        let big4 = big(Domain::IPV4).map_err(ctx("raw IPv4 UDP"))?;
        let (rx6, raw6) = match (rx("[::1]:0".parse().unwrap()), raw(Domain::IPV6)) {
            (Ok(r), Ok(w)) => (Some(r), Some(w)),
            (r, w) => {
                tracing::warn!(rx = ?r.err(), raw = ?w.err(), "no IPv6 slow-path sockets: IPv6 sessions are kernel-only");
                (None, None)
            }
        };
        let big6 = raw6
            .as_ref()
            .and_then(|_| big(Domain::IPV6).map_err(|e| tracing::warn!(error = %e, "no raw IPv6 UDP socket: IPv6 copies larger than their path fail")).ok());
        Ok(SteerSockets { rx4, rx6, raw4, raw6, big4, big6, header })
    }
}

/// What workers see: the table and, per SFU address, one socket per worker.
struct State {
    table: Arc<ForwardingTable>,
    sockets: imbl::HashMap<SocketAddr, Arc<Vec<Socket>>>,
    /// The SRTP sessions of the table's SRTP legs.
    srtp: crate::srtp::Contexts,
}

/// A change to the socket set, queued for each worker's epoll set.
enum SocketChange {
    Added(SocketAddr, Arc<Vec<Socket>>),
    Removed(SocketAddr),
}

/// Every address an entry needs a socket for: its ingress and the addresses its copies leave from.
fn addresses_of(e: &StreamEntry) -> impl Iterator<Item = SocketAddr> + '_ {
    std::iter::once(e.key.local).chain(e.copies.iter().map(|c| c.from))
}

#[derive(Default)]
struct WorkerCounters {
    total: Counters,
    streams: HashMap<u32, Counters>,
    consumers: HashMap<u32, ConsumerCounters>,
    /// (consumer, SSRC, sequence number, timestamp, clock rate) of each RTP copy sent, in order.
    forwarded: Vec<(u32, u32, u16, u32, u32)>,
    /// `UserspaceConfig::forwarded_qos`.
    account_forwarded: bool,
}

impl WorkerCounters {
    /// A copy was sent: the RTP header it left with, for its consumer's QoS as forwarded.
    fn forwarded(&mut self, c: CopyOf) {
        if let (Some(r), true) = (c.rtp, c.consumer != 0 && self.account_forwarded) {
            self.forwarded.push((c.consumer, r.ssrc, r.sequence, r.timestamp, r.clock_rate));
        }
    }

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

struct Shared {
    state: ArcSwap<State>,
    stop: AtomicBool,
    events: Option<SyncSender<DataplaneEvent>>,
    /// Events not queued because the control plane was behind ([`crate::EVENT_QUEUE`]).
    events_dropped: AtomicU64,
    /// Shared by the workers: one source may send to several SFU addresses, whose flows
    /// SO_REUSEPORT may spread over several workers.
    sources: Mutex<SourceBuckets>,
    mark_ack: Option<MarkAck>,
    /// In-path reception quality per RTP stream. Shared: a stream's packets normally reach one
    /// worker, but a new source may land on another; one lock per batch.
    reception: Mutex<HashMap<u32, RtpReception>>,
    /// The same per consumer over the RTP copies sent to it ([`Dataplane::consumer_reception`]).
    /// Taken alone, one lock per batch.
    forwarded: Mutex<HashMap<u32, RtpReception>>,
    /// Consumers' feedback: shared, so keyframe requests are coalesced whichever worker the
    /// subscribers' flows landed on (a few packets per second per consumer).
    feedback: Mutex<FeedbackRouter>,
    /// Simulcast consumers' layer and renumbering, and what publishers send of each layer.
    /// Shared: a publisher's layers are one flow each, which may land on different workers.
    /// Never held while taking `feedback`.
    layers: Mutex<SimulcastState>,
    /// When each published stream's last sender reports passed (by stream id), for the
    /// round-trip times its consumers' reports give. Taken after `reception` (when both are),
    /// never before another lock.
    sender_reports: Mutex<HashMap<u32, SenderReportTimes>>,
    /// The kernel's simulcast states, when this is the eBPF plane's slow path.
    kernel_layers: Option<Arc<dyn KernelLayers>>,
    /// `UserspaceConfig::forwarded_qos`.
    forwarded_qos: bool,
}

#[derive(Default)]
struct SimulcastState {
    consumers: HashMap<u32, LayerConsumer>,
    /// What each simulcast stream's publisher sends, by the stream's uid (`SimulcastLayer::group`).
    activity: HashMap<u32, LayerActivity>,
    /// With kernel states: what the kernel had received of each layer stream at the last tick,
    /// by stream id.
    kernel_rx: HashMap<u32, KernelReceived>,
}

/// One simulcast consumer: the layer it should get (from the API's ceiling, its reports and
/// what is sent) and the renumbering of what it gets.
struct LayerConsumer {
    /// With kernel states, a mirror of the kernel's: refreshed before a packet, a NACK or the
    /// API reads it; by the tick while the consumer is new or on its way to a layer, and once a
    /// second when settled (see `layers_tick`).
    rewriter: LayerRewriter,
    choice: LayerChoice,
    /// Its stream's uid, for the activity the choice reads.
    group: u32,
    /// With kernel states: the target and temporal ceiling last written there.
    kernel_target: Option<(Option<u8>, Option<u8>)>,
}

impl LayerConsumer {
    fn new(rewriter: LayerRewriter, group: u32) -> LayerConsumer {
        LayerConsumer { rewriter, choice: LayerChoice::default(), group, kernel_target: None }
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

/// What the pipeline ([`mediaplane_core::pipeline`]) asks of this plane for one batch: its
/// shared state behind its locks, and its SRTP contexts.
struct PlaneState<'a> {
    shared: &'a Shared,
    state: &'a State,
}

impl Plane for PlaneState<'_> {
    fn admit_source(&mut self, limit: RateLimit, src: IpAddr, now_ns: u64, bytes: u64) -> bool {
        self.shared.sources.lock().admit(limit, src, now_ns, bytes)
    }

    fn route_feedback(&mut self, entry: &FeedbackEntry, packet: &[u8], now_ns: u64) -> Option<mediaplane_core::feedback::Outcome> {
        let mut feedback = self.shared.feedback.lock();
        let layers = self.shared.layers.lock();
        feedback.route_with(entry, packet, now_ns, &Layers(&layers.consumers, self.shared.kernel_layers.as_deref())).ok()
    }

    fn unprotect(&mut self, at: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>> {
        crate::srtp::unprotect(self.state.srtp.get(SrtpSlot { local: at, outbound: false }, key), packet).ok()
    }

    fn protect(&mut self, from: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>> {
        crate::srtp::protect(self.state.srtp.get(SrtpSlot { local: from, outbound: true }, key), packet)
    }

    fn layer_fan_out(&mut self, entry: &StreamEntry, layer: &SimulcastLayer, src: SocketAddr, packet: &[u8], now_ns: u64) -> LayerFanOut {
        layer_fan_out(self.shared, entry, layer, src, packet, now_ns)
    }
}

/// The copies of one packet of a simulcast layer: to each consumer receiving that layer now,
/// renumbered for it ([`LayerRewriter`]); and a keyframe request to the publisher for each
/// layer a consumer waits for (coalesced with the consumers' own).
fn layer_fan_out(shared: &Shared, entry: &StreamEntry, layer: &SimulcastLayer, src: SocketAddr, payload: &[u8], now_ns: u64) -> LayerFanOut {
    let kind = demux(payload);
    let info = match kind {
        MediaKind::Rtp => simulcast::inspect(layer.codec, payload),
        _ => None,
    };
    let out_ssrc = layer.layers[0].1;
    let count = layer.layers.len() as u8;
    let mut wanted: Vec<u8> = Vec::new();
    let mut fan = LayerFanOut::default();
    {
        let mut guard = shared.layers.lock();
        let SimulcastState { consumers, activity, .. } = &mut *guard;
        if !activity.contains_key(&layer.group) {
            // Only for a stream of the installed table (as for consumers below).
            let latest = shared.state.load();
            if latest.table.streams.get(&entry.key).and_then(|e| e.simulcast.as_ref()).map(|l| l.group) != Some(layer.group) {
                return fan;
            }
        }
        let activity = activity.entry(layer.group).or_default();
        if info.is_some() {
            activity.on_packet(layer.index, payload.len(), now_ns);
        }
        for (i, copy) in entry.copies.iter().enumerate() {
            if copy.to == src || copy.consumer == 0 {
                continue;
            }
            if !consumers.contains_key(&copy.consumer) {
                // Only for a consumer of the installed table: a batch still working with
                // the table before must not bring back one that an apply just forgot.
                let latest = shared.state.load();
                if !latest.table.streams.get(&entry.key).is_some_and(|e| e.copies.iter().any(|c| c.consumer == copy.consumer)) {
                    continue;
                }
            }
            let kernel = shared.kernel_layers.as_deref();
            let c = consumers.entry(copy.consumer).or_insert_with(|| {
                if let Some(k) = kernel {
                    k.create(copy.consumer, out_ssrc, entry.clock_rate);
                }
                LayerConsumer::new(LayerRewriter::new(out_ssrc, entry.clock_rate), layer.group)
            });
            c.group = layer.group;
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
    }
    // A keyframe answers the requests for its layer so far (see FeedbackRouter), once the
    // consumers waiting for it switched on it above: as the tick, before the requests.
    if info.as_ref().is_some_and(|i| i.keyframe_start) {
        if let Some(&(stream, ssrc)) = layer.layers.get(layer.index as usize) {
            shared.feedback.lock().keyframe_arrived(stream, ssrc);
        }
    }
    let SourceRule::Fixed(publisher) = entry.source else { return fan };
    for l in wanted {
        let Some(&(stream, ssrc)) = layer.layers.get(l as usize) else { continue };
        let Some(pli) = shared.feedback.lock().request_keyframe(stream, ssrc, SFU_SSRC, now_ns) else { continue };
        fan.requests.push((entry.key.local, publisher, pli));
    }
    fan
}

/// Refresh `rw` from the kernel's state of `id` (nothing without one).
fn mirror(rw: &mut LayerRewriter, id: u32, kernel: Option<&dyn KernelLayers>) {
    if let Some(s) = kernel.and_then(|k| k.state(id)) {
        rw.load_state(s);
    }
}

/// The sender SSRC of the keyframe requests the SFU makes itself (a simulcast consumer waiting
/// for a layer): "MPLI".
const SFU_SSRC: u32 = 0x4d50_4c49;

/// The simulcast consumers' state as the feedback router asks for it (a NACK names what was
/// just sent: with kernel states, read fresh).
struct Layers<'a>(&'a HashMap<u32, LayerConsumer>, Option<&'a dyn KernelLayers>);

impl LayerMap for Layers<'_> {
    fn layer(&self, consumer: u32) -> Option<u8> {
        self.0.get(&consumer).and_then(|c| c.rewriter.current().or(c.rewriter.target()))
    }
    fn original(&self, consumer: u32, out_seq: u16) -> Option<(u8, u16)> {
        let c = self.0.get(&consumer)?;
        match self.1.and_then(|k| k.state(consumer)) {
            Some(s) => {
                let mut rw = LayerRewriter::new(c.rewriter.ssrc(), c.rewriter.clock_rate());
                rw.load_state(s);
                rw.original(out_seq)
            }
            None => c.rewriter.original(out_seq),
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

struct Worker {
    thread: Option<JoinHandle<()>>,
    wake: Arc<EventFd>,
    counters: Arc<Mutex<WorkerCounters>>,
    changes: Arc<Mutex<Vec<SocketChange>>>,
}

pub struct UserspaceDataplane {
    shared: Arc<Shared>,
    workers: Mutex<Vec<Worker>>,
    cfg: UserspaceConfig,
    /// Serialises `apply` calls (socket set changes must not interleave) and holds how many
    /// table entries use each address (its socket group lives while that is non-zero).
    apply_lock: Mutex<HashMap<SocketAddr, u32>>,
    /// Steered mode: per worker.
    steer: Vec<Arc<SteerSockets>>,
    /// With kernel simulcast states: the thread that keeps them aimed ([`layers_tick`]).
    layer_tick: Mutex<Option<JoinHandle<()>>>,
}

impl Shared {
    /// Queue an event for the control plane; never blocks a worker (a full queue drops it).
    fn report(&self, ev: DataplaneEvent) {
        if let Some(tx) = &self.events {
            if let Err(TrySendError::Full(_)) = tx.try_send(ev) {
                self.events_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl UserspaceDataplane {
    pub fn new(mut cfg: UserspaceConfig, events: Option<SyncSender<DataplaneEvent>>) -> Result<Self, DataplaneError> {
        if cfg.workers == 0 {
            cfg.workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        }
        cfg.batch = cfg.batch.clamp(1, 1024);
        let shared = Arc::new(Shared {
            state: ArcSwap::from_pointee(State { table: Arc::new(ForwardingTable::default()), sockets: Default::default(), srtp: Default::default() }),
            stop: AtomicBool::new(false),
            events,
            events_dropped: AtomicU64::new(0),
            sources: Mutex::new(SourceBuckets::default()),
            mark_ack: cfg.mark_ack.clone(),
            reception: Mutex::new(HashMap::new()),
            forwarded: Mutex::new(HashMap::new()),
            feedback: Mutex::new(FeedbackRouter::default()),
            layers: Mutex::new(SimulcastState::default()),
            sender_reports: Mutex::new(HashMap::new()),
            kernel_layers: cfg.kernel_layers.as_ref().map(|k| k.0.clone()),
            forwarded_qos: cfg.forwarded_qos,
        });
        let steer: Vec<Arc<SteerSockets>> = if cfg.steered {
            (0..cfg.workers).map(|_| SteerSockets::open(cfg.socket_buffer, cfg.header).map(Arc::new)).collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        let mut workers = Vec::new();
        for id in 0..cfg.workers {
            let wake = Arc::new(EventFd::new().map_err(|e| io_err("eventfd", e))?);
            let counters = Arc::new(Mutex::new(WorkerCounters::default()));
            let changes = Arc::new(Mutex::new(Vec::new()));
            let epoll = Epoll::new().map_err(|e| io_err("epoll", e))?;
            epoll.add(wake.raw(), WAKE_TOKEN).map_err(|e| io_err("epoll add", e))?;
            let mut slots = Vec::new();
            if let Some(st) = steer.get(id) {
                for rx in std::iter::once(&st.rx4).chain(st.rx6.as_ref()) {
                    epoll.add(rx.as_raw_fd(), slots.len() as u64).map_err(|e| io_err("epoll add", e))?;
                    slots.push(Some(Slot { addr: None, _group: None, fd: rx.as_raw_fd() }));
                }
            }
            let ctx = WorkerCtx {
                id,
                shared: shared.clone(),
                wake: wake.clone(),
                counters: counters.clone(),
                changes: changes.clone(),
                epoll,
                batch: RecvBatch::new(cfg.batch, MAX_DATAGRAM),
                slots,
                steer: steer.get(id).cloned(),
                slot_of: HashMap::new(),
                free_slots: Vec::new(),
                pipeline: Pipeline::new(),
                rtcp_budget: HashMap::new(),
                stream_ids_reported: HashMap::new(),
            };
            let thread = std::thread::Builder::new().name(format!("mp-worker-{id}")).spawn(move || ctx.run()).map_err(|e| io_err("spawn worker", e))?;
            workers.push(Worker { thread: Some(thread), wake, counters, changes });
        }
        let layer_tick = match &shared.kernel_layers {
            Some(_) => {
                let (shared, steer) = (shared.clone(), steer.first().cloned());
                let t = std::thread::Builder::new()
                    .name("mp-layers".into())
                    .spawn(move || {
                        let mut n: u64 = 0;
                        while !shared.stop.load(Ordering::Relaxed) {
                            n += 1;
                            layers_tick(&shared, steer.as_deref(), crate::monotonic_ns(), n % crate::kernel_layers::RECONCILE_TICKS == 1);
                            std::thread::sleep(std::time::Duration::from_nanos(crate::kernel_layers::TICK_NS));
                        }
                    })
                    .map_err(|e| io_err("spawn the simulcast tick", e))?;
                Some(t)
            }
            None => None,
        };
        Ok(UserspaceDataplane { shared, workers: Mutex::new(workers), cfg, apply_lock: Mutex::new(HashMap::new()), steer, layer_tick: Mutex::new(layer_tick) })
    }

    /// Steered mode: the catch-all receive sockets (IPv4, IPv6) the sk_lookup program must
    /// steer slow-path packets to.
    pub fn steering_fds(&self) -> Option<(Vec<RawFd>, Vec<RawFd>)> {
        if !self.cfg.steered {
            return None;
        }
        let v4 = self.steer.iter().map(|s| s.rx4.as_raw_fd()).collect();
        let v6 = self.steer.iter().filter_map(|s| s.rx6.as_ref().map(|r| r.as_raw_fd())).collect();
        Some((v4, v6))
    }

    /// Install `table`; `changed` lists the keys that differ from the installed table (None:
    /// compare everything). Sockets are opened for addresses that come into use and closed for
    /// those that fall out of use; if a bind fails nothing changes.
    fn install(&self, table: Arc<ForwardingTable>, changed: Option<&[IngressKey]>) -> Result<(), DataplaneError> {
        let mut refs = self.apply_lock.lock();
        let old = self.shared.state.load_full();
        let srtp = old.srtp.update(&old.table, &table, changed);
        self.forget_reception(&old.table, &table, changed);
        self.forget_consumers(&old.table, &table, changed);
        if self.cfg.steered {
            // No per-address sockets: packets are steered to us, copies leave on raw sockets.
            self.shared.state.store(Arc::new(State { table, sockets: old.sockets.clone(), srtp }));
            return Ok(());
        }
        let mut delta: HashMap<SocketAddr, i64> = HashMap::new();
        let mut count = |e: &StreamEntry, d: i64| {
            for a in addresses_of(e) {
                *delta.entry(a).or_default() += d;
            }
        };
        match changed {
            Some(keys) => {
                for k in keys {
                    if let Some(e) = old.table.streams.get(k) {
                        count(e, -1);
                    }
                    if let Some(e) = table.streams.get(k) {
                        count(e, 1);
                    }
                }
            }
            None => {
                old.table.streams.values().for_each(|e| count(e, -1));
                table.streams.values().for_each(|e| count(e, 1));
            }
        }
        let mut sockets = old.sockets.clone();
        let mut changes = Vec::new();
        let mut new_refs = Vec::new();
        for (addr, d) in delta.into_iter().filter(|(_, d)| *d != 0) {
            let cur = refs.get(&addr).copied().unwrap_or(0) as i64;
            let n = (cur + d).max(0);
            if cur == 0 && n > 0 {
                // A failed bind returns here: the groups opened so far are dropped, nothing changed.
                let group = Arc::new(self.open_socket_group(addr)?);
                sockets.insert(addr, group.clone());
                changes.push(SocketChange::Added(addr, group));
            } else if cur > 0 && n == 0 {
                sockets.remove(&addr);
                changes.push(SocketChange::Removed(addr));
            }
            new_refs.push((addr, n as u32));
        }
        for (addr, n) in new_refs {
            if n == 0 {
                refs.remove(&addr);
            } else {
                refs.insert(addr, n);
            }
        }
        self.shared.state.store(Arc::new(State { table, sockets, srtp }));
        if !changes.is_empty() {
            for w in self.workers.lock().iter() {
                w.changes.lock().extend(changes.iter().map(|c| match c {
                    SocketChange::Added(a, g) => SocketChange::Added(*a, g.clone()),
                    SocketChange::Removed(a) => SocketChange::Removed(*a),
                }));
                w.wake.notify();
            }
        }
        Ok(())
    }

    /// Streams that left the table lose their reception state and their sender reports' times
    /// (a stream id is never reused, so this only bounds memory). A full apply keeps only the new
    /// table's streams: it also sweeps what a worker still on the old table put back.
    fn forget_reception(&self, old: &ForwardingTable, new: &ForwardingTable, changed: Option<&[IngressKey]>) {
        let mut reception = self.shared.reception.lock();
        let mut sender_reports = self.shared.sender_reports.lock();
        match changed {
            Some(keys) => {
                for e in keys.iter().filter_map(|k| old.streams.get(k)).filter(|e| new.streams.get(&e.key).map(|n| n.id) != Some(e.id)) {
                    reception.remove(&e.id);
                    sender_reports.remove(&e.id);
                }
            }
            None => {
                let ids: std::collections::HashSet<u32> = new.streams.values().map(|e| e.id).collect();
                reception.retain(|id, _| ids.contains(id));
                sender_reports.retain(|id, _| ids.contains(id));
            }
        }
    }

    /// Consumers that left the table lose their counters (uids are never reused: this only
    /// bounds memory). A worker's batch still in flight may bring one back with its last copies.
    fn forget_consumers(&self, old: &ForwardingTable, new: &ForwardingTable, changed: Option<&[IngressKey]>) {
        let consumers = |t: &ForwardingTable, keys: &mut dyn Iterator<Item = &IngressKey>| -> std::collections::HashSet<u32> {
            keys.filter_map(|k| t.streams.get(k)).flat_map(|e| e.copies.iter().map(|c| c.consumer)).filter(|c| *c != 0).collect()
        };
        let (gone, keep): (Vec<u32>, Option<std::collections::HashSet<u32>>) = match changed {
            Some(keys) => {
                let now = consumers(new, &mut keys.iter());
                (consumers(old, &mut keys.iter()).difference(&now).copied().collect(), None)
            }
            None => (Vec::new(), Some(consumers(new, &mut new.streams.keys()))),
        };
        for w in self.workers.lock().iter() {
            let mut c = w.counters.lock();
            match &keep {
                Some(keep) => c.consumers.retain(|id, _| keep.contains(id)),
                None => gone.iter().for_each(|id| {
                    c.consumers.remove(id);
                }),
            }
        }
        let mut forwarded = self.shared.forwarded.lock();
        match &keep {
            Some(keep) => forwarded.retain(|id, _| keep.contains(id)),
            None => gone.iter().for_each(|id| {
                forwarded.remove(id);
            }),
        }
        drop(forwarded);
        let mut layers = self.shared.layers.lock();
        let kernel = self.shared.kernel_layers.as_deref();
        match &keep {
            Some(keep) => layers.consumers.retain(|id, _| {
                let kept = keep.contains(id);
                if let (false, Some(k)) = (kept, kernel) {
                    k.remove(*id);
                }
                kept
            }),
            None => gone.iter().for_each(|id| {
                if layers.consumers.remove(id).is_some() {
                    if let Some(k) = kernel {
                        k.remove(*id);
                    }
                }
            }),
        }
        // A simulcast stream's activity goes with its entries (one that only changed starts
        // afresh: every layer presumed sent for a second).
        let group = |t: &ForwardingTable, k: &IngressKey| t.streams.get(k).and_then(|e| e.simulcast.as_ref()).map(|l| l.group);
        match changed {
            Some(keys) => keys.iter().filter_map(|k| group(old, k).filter(|g| group(new, k) != Some(*g))).for_each(|g| {
                layers.activity.remove(&g);
            }),
            None => {
                let groups: std::collections::HashSet<u32> = new.streams.keys().filter_map(|k| group(new, k)).collect();
                layers.activity.retain(|g, _| groups.contains(g));
            }
        }
    }

    fn open_socket_group(&self, addr: SocketAddr) -> Result<Vec<Socket>, DataplaneError> {
        (0..self.cfg.workers).map(|_| open_socket(addr, self.cfg.socket_buffer, &self.cfg.header)).collect()
    }

    /// The installed table.
    pub fn table(&self) -> Arc<ForwardingTable> {
        self.shared.state.load().table.clone()
    }
}

fn io_err(context: &str, source: std::io::Error) -> DataplaneError {
    DataplaneError::Io { context: context.to_string(), source }
}

fn open_socket(addr: SocketAddr, buffer: usize, header: &HeaderPolicy) -> Result<Socket, DataplaneError> {
    let bind_err = |source| DataplaneError::Bind { addr, source };
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP)).map_err(bind_err)?;
    s.set_reuse_port(true).map_err(bind_err)?;
    s.set_nonblocking(true).map_err(bind_err)?;
    sys::set_header_policy(s.as_raw_fd(), addr.is_ipv6(), header).map_err(bind_err)?;
    if addr.is_ipv6() {
        s.set_only_v6(true).map_err(bind_err)?;
    } else {
        // Lets the daemon bind an SFU address before the interface carrying it is up.
        s.set_freebind(true).map_err(bind_err)?;
    }
    // Best effort: the kernel caps these at net.core.{r,w}mem_max.
    let _ = s.set_recv_buffer_size(buffer);
    let _ = s.set_send_buffer_size(buffer);
    s.bind(&SockAddr::from(addr)).map_err(bind_err)?;
    Ok(s)
}

impl Dataplane for UserspaceDataplane {
    fn name(&self) -> &'static str {
        "userspace"
    }

    fn send_datagram(&self, from: SocketAddr, to: SocketAddr, payload: &[u8]) -> Result<(), DataplaneError> {
        send_datagram_with(&self.shared, self.steer.first().map(|s| &**s), from, to, payload)
    }

    fn apply(&self, table: Arc<ForwardingTable>) -> Result<(), DataplaneError> {
        self.install(table, None)
    }

    fn apply_changes(&self, table: Arc<ForwardingTable>, changed: &[IngressKey]) -> Result<(), DataplaneError> {
        self.install(table, Some(changed))
    }

    fn stats(&self) -> DataplaneStats {
        let mut st = DataplaneStats { dataplane: self.name().into(), table_version: self.shared.state.load().table.version, ..Default::default() };
        for w in self.workers.lock().iter() {
            let c = w.counters.lock();
            st.total.add(&c.total);
            for (id, sc) in &c.streams {
                st.streams.entry(*id).or_default().add(sc);
            }
        }
        st.extra.extend(sys::host_drop_counters().into_iter().map(|(k, v)| (k.to_string(), v)));
        // Process-wide (one recorder per daemon): recorded streams' packets relayed but not
        // recorded because the writer fell behind.
        st.extra.insert("not_recorded".into(), crate::record::not_recorded());
        st.extra.insert("events_dropped".into(), self.shared.events_dropped.load(Ordering::Relaxed));
        st.extra.extend(crate::srtp::failures().into_iter().map(|(k, v)| (k.to_string(), v)));
        st.reception = self.shared.reception.lock().iter().map(|(id, r)| (*id, r.report())).collect();
        st
    }

    fn consumer_counters(&self, ids: &[u32]) -> BTreeMap<u32, ConsumerCounters> {
        let mut out = BTreeMap::<u32, ConsumerCounters>::new();
        for w in self.workers.lock().iter() {
            let c = w.counters.lock();
            for id in ids {
                if let Some(cc) = c.consumers.get(id) {
                    out.entry(*id).or_default().add(cc);
                }
            }
        }
        let mut layers = self.shared.layers.lock();
        let now = crate::monotonic_ns();
        for id in ids {
            // Fresh counters from the kernel (the tick leaves a settled consumer's).
            if let Some(c) = layers.consumers.get_mut(id) {
                mirror(&mut c.rewriter, *id, self.shared.kernel_layers.as_deref());
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
                    absent: activity.map_or(0, |a| a.absent_mask(now)),
                });
            }
        }
        out
    }

    fn consumer_reception(&self, ids: &[u32]) -> BTreeMap<u32, ReceptionReport> {
        let r = self.shared.forwarded.lock();
        ids.iter().filter_map(|id| r.get(id).map(|s| (*id, s.report()))).collect()
    }

    fn stream_reception(&self, ids: &[u32]) -> BTreeMap<u32, ReceptionReport> {
        let r = self.shared.reception.lock();
        ids.iter().filter_map(|id| r.get(id).map(|s| (*id, s.report()))).collect()
    }

    fn shutdown(&self) -> Result<(), DataplaneError> {
        self.shared.stop.store(true, Ordering::SeqCst);
        let mut workers = self.workers.lock();
        for w in workers.iter() {
            w.wake.notify();
        }
        for w in workers.iter_mut() {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
        if let Some(t) = self.layer_tick.lock().take() {
            let _ = t.join();
        }
        self.shared.state.store(Arc::new(State { table: Arc::new(ForwardingTable::default()), sockets: Default::default(), srtp: Default::default() }));
        self.apply_lock.lock().clear();
        Ok(())
    }
}

impl Drop for UserspaceDataplane {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

struct Slot {
    /// The SFU address the socket is bound to; None for a steered catch-all socket (each
    /// datagram carries its destination).
    addr: Option<SocketAddr>,
    /// Keeps the socket (and so `fd`) open until this worker has taken it out of its epoll set
    /// (catch-all sockets are kept open by `WorkerCtx::steer`).
    _group: Option<Arc<Vec<Socket>>>,
    fd: RawFd,
}

struct WorkerCtx {
    id: usize,
    shared: Arc<Shared>,
    wake: Arc<EventFd>,
    counters: Arc<Mutex<WorkerCounters>>,
    changes: Arc<Mutex<Vec<SocketChange>>>,
    epoll: Epoll,
    batch: RecvBatch,
    /// Sockets this worker receives on; the index is the epoll token.
    slots: Vec<Option<Slot>>,
    slot_of: HashMap<SocketAddr, usize>,
    free_slots: Vec<usize>,
    /// Steered mode: this worker's catch-all and raw sockets.
    steer: Option<Arc<SteerSockets>>,
    /// The per-packet pipeline, with this worker's state: the rate-limit buckets of the streams
    /// it has seen. Per worker: only a stream's registered source passes the source check, and
    /// one source address sending to one SFU address is one flow, which SO_REUSEPORT keeps on
    /// one socket, hence one worker.
    pipeline: Pipeline,
    /// RTCP reports this worker handed to the control plane per stream in the current second:
    /// (second, count).
    rtcp_budget: HashMap<u32, (u64, u32)>,
    /// When this worker last reported the RID of (transport, SSRC): a layer's packets name it
    /// until the control plane has learned it, and one report per [`STREAM_ID_REPORT_NS`] is
    /// enough.
    stream_ids_reported: HashMap<(u32, u32), u64>,
}

/// How often a worker reports the RID of one SSRC while no stream claims it.
const STREAM_ID_REPORT_NS: u64 = 100_000_000;

/// Steered mode: send one copy from `from` as a complete IP packet on the raw socket (the slow
/// path is rare traffic: the first packet of a relay leg, STUN, unresolved next hops, copies
/// larger than their path MTU, fragmented datagrams).
///
/// A header-included packet is never fragmented: the kernel refuses one larger than the egress
/// link or route MTU (EMSGSIZE, DF set). Such a copy goes, UDP header and payload, to the
/// family's raw UDP socket, where the kernel builds the IP header (same policy, from socket
/// options) and fragments it as the host fragments UDP; its fragments carry a non-zero IPv4 ID.
/// One datagram from `from` (one of this plane's addresses) to `to`, outside any batch.
fn send_datagram_with(shared: &Shared, steer: Option<&SteerSockets>, from: SocketAddr, to: SocketAddr, payload: &[u8]) -> Result<(), DataplaneError> {
    let state = shared.state.load();
    if let Some(group) = state.sockets.get(&from) {
        return group[0].send_to(payload, &SockAddr::from(to)).map(|_| ()).map_err(|e| io_err(&format!("sending from {from} to {to}"), e));
    }
    match steer {
        Some(steer) if send_raw_copy(steer, from, to, payload) => Ok(()),
        Some(_) => Err(DataplaneError::Other(format!("sending from {from} to {to} on the raw socket failed"))),
        None => Err(DataplaneError::Other(format!("{from} is no address of this data plane"))),
    }
}

/// With kernel simulcast states (the kernel forwards the layers, so no packet of them may reach
/// this plane for a while), every [`crate::kernel_layers::TICK_NS`]: what the kernel received
/// of each layer feeds the streams' activity; each consumer of the installed table gets its
/// state, its target (the API's ceiling as its reports and the activity lower it) and, while
/// it waits for a layer, a keyframe request to the publisher (coalesced with the consumers' own).
/// With `reconcile`, states of consumers the table no longer has are deleted.
fn layers_tick(shared: &Shared, steer: Option<&SteerSockets>, now_ns: u64, reconcile: bool) {
    let Some(kernel) = shared.kernel_layers.as_deref() else { return };
    let state = shared.state.load();
    // One pass over the table; nothing more when it has no simulcast stream (a relay's).
    let layered: Vec<&StreamEntry> = state.table.streams.values().filter(|e| e.simulcast.is_some()).collect();
    if layered.is_empty() && !reconcile {
        return;
    }
    // (stream entry, layer) whose keyframe someone waits for.
    let mut wanted: Vec<(&StreamEntry, u8)> = Vec::new();
    // (stream, SSRC) of layers the kernel forwarded a keyframe of since the last tick.
    let mut answered: Vec<(u32, u32)> = Vec::new();
    {
        let mut guard = shared.layers.lock();
        let SimulcastState { consumers, activity, kernel_rx } = &mut *guard;
        let mut seen = std::collections::HashSet::new();
        for entry in layered.iter().copied() {
            let Some(layer) = &entry.simulcast else { continue };
            let act = activity.entry(layer.group).or_default();
            if let Some(now) = kernel.received(entry.id) {
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
                let c = consumers.entry(copy.consumer).or_insert_with(|| LayerConsumer::new(LayerRewriter::new(out_ssrc, entry.clock_rate), layer.group));
                // Every tick: a state a failed create or a reconcile left missing comes back.
                if c.kernel_target.is_none() {
                    kernel.create(copy.consumer, out_ssrc, entry.clock_rate);
                }
                c.group = layer.group;
                // A settled consumer (receiving the layer it is aimed at) changes in the kernel
                // only by its counters: the kernel switches a consumer only towards a target
                // this plane set. Those are read where they are used (NACK windows, the API)
                // and on reconciling ticks; a consumer on its way to a layer every tick.
                if reconcile || c.kernel_target.is_none() || c.rewriter.current() != c.rewriter.target() {
                    mirror(&mut c.rewriter, copy.consumer, Some(kernel));
                }
                let target = copy.layer.map(|ceiling| c.choice.choose(ceiling, copy.max_layer, copy.auto_layer, count, act, now_ns));
                c.set_target(copy.consumer, target, copy.temporal_layer, Some(kernel));
                // Asked only once the publisher sends (as a packet's arrival asks on the user-space
                // plane): a request before its socket is up is lost, and the next one would wait
                // out the retry interval.
                if let Some(l) = act.started().then(|| c.rewriter.keyframe_wanted(now_ns)).flatten() {
                    let of = layer.layers.get(l as usize).and_then(|(stream, _)| layered.iter().copied().find(|e| e.id == *stream));
                    if let Some(e) = of.filter(|e| !wanted.iter().any(|(w, _)| w.id == e.id)) {
                        wanted.push((e, l));
                    }
                }
            }
        }
        let ids: std::collections::HashSet<u32> = layered.iter().map(|e| e.id).collect();
        kernel_rx.retain(|id, _| ids.contains(id));
        // Not before a table was installed (version 0: the plane's empty start): a restarted
        // daemon's first tick would delete the pinned states of every consumer it restores.
        if reconcile && state.table.version > 0 {
            // Consumers no longer in the table (`seen` holds every simulcast consumer it has):
            // their states go, here and in the kernel.
            consumers.retain(|id, _| seen.contains(id));
            for id in kernel.consumers().into_iter().filter(|id| !seen.contains(id)) {
                kernel.remove(id);
            }
        }
    }
    // Before this tick's requests: one for a layer whose keyframe just went by is a new need.
    if !answered.is_empty() {
        let mut feedback = shared.feedback.lock();
        answered.into_iter().for_each(|(stream, ssrc)| feedback.keyframe_arrived(stream, ssrc));
    }
    for (entry, l) in wanted {
        let (SourceRule::Fixed(publisher), Some(layer)) = (entry.source, &entry.simulcast) else { continue };
        let Some(&(stream, ssrc)) = layer.layers.get(l as usize) else { continue };
        let Some(pli) = shared.feedback.lock().request_keyframe(stream, ssrc, SFU_SSRC, now_ns) else { continue };
        // A WebRTC publisher's: SRTCP with its key (not sent without one).
        let pli = match &entry.reverse {
            Protection::Clear => pli,
            Protection::Srtp(key) => match crate::srtp::protect(state.srtp.get(SrtpSlot { local: entry.key.local, outbound: true }, key.as_ref()), &pli) {
                Some(sealed) => sealed,
                None => continue,
            },
        };
        if let Err(e) = send_datagram_with(shared, steer, entry.key.local, publisher, &pli) {
            tracing::debug!(error = %e, "keyframe request to a publisher");
        }
    }
}

fn send_raw_copy(steer: &SteerSockets, from: SocketAddr, to: SocketAddr, payload: &[u8]) -> bool {
    use mediaplane_core::packet::{build_frame, FrameSpec, ETH_HLEN};
    let (raw, big, ip_hlen) = if to.is_ipv4() { (Some(&steer.raw4), Some(&steer.big4), 20) } else { (steer.raw6.as_ref(), steer.big6.as_ref(), 40) };
    let Some(raw) = raw.filter(|_| from.is_ipv4() == to.is_ipv4()) else { return false };
    let mut spec = FrameSpec::new(from, to);
    spec.ttl = if to.is_ipv4() { steer.header.ttl } else { steer.header.hop_limit };
    spec.tos = steer.header.tos();
    spec.ident = next_ip_id();
    let frame = build_frame(&spec, payload);
    // Raw IP sockets take the packet without its Ethernet header; the port must be 0 (IPv6).
    let dst = SockAddr::from(SocketAddr::new(to.ip(), 0));
    let packet = &frame[ETH_HLEN..];
    let err = match sys::send_raw_ip(raw.as_raw_fd(), packet, &dst) {
        Ok(()) => return true,
        Err(e) => e,
    };
    let err = match big {
        // The UDP header and payload, checksum included (build_frame filled it in).
        Some(big) if err.raw_os_error() == Some(libc::EMSGSIZE) => match sys::send_raw_udp(big.as_raw_fd(), from.ip(), &packet[ip_hlen..], &dst) {
            Ok(()) => return true,
            Err(e) => e,
        },
        _ => err,
    };
    tracing::debug!(%from, %to, len = packet.len(), error = %err, "raw send failed");
    false
}

/// An IPv4 ID for a raw copy, as the kernel path and the host's UDP sockets give one (DF is set:
/// an atomic datagram's ID means nothing, but a constant one would set the slow path apart).
fn next_ip_id() -> u16 {
    thread_local!(static STATE: std::cell::Cell<u32> = std::cell::Cell::new(mono_ns() as u32 | 1));
    STATE.with(|s| {
        // xorshift32
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        s.set(x);
        (x >> 16) as u16
    })
}

/// Monotonic nanoseconds (the buckets' clock).
fn mono_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    // +1 s: a zero theoretical arrival time is "idle", never "in the future".
    EPOCH.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64 + 1_000_000_000
}

impl WorkerCtx {
    fn run(mut self) {
        let mut ready = Vec::with_capacity(64);
        self.reconcile();
        while !self.shared.stop.load(Ordering::Relaxed) {
            if let Err(e) = self.epoll.wait(&mut ready, 200) {
                tracing::error!(worker = self.id, error = %e, "epoll_wait failed");
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
            for &tok in &ready {
                if tok == WAKE_TOKEN {
                    self.wake.drain();
                    self.reconcile();
                } else {
                    self.serve_socket(tok as usize);
                }
            }
        }
        for slot in self.slots.drain(..).flatten() {
            let _ = self.epoll.remove(slot.fd);
        }
    }

    /// Apply the queued socket changes to this worker's epoll set.
    fn reconcile(&mut self) {
        let changes = std::mem::take(&mut *self.changes.lock());
        for c in changes {
            match c {
                SocketChange::Removed(addr) => {
                    if let Some(idx) = self.slot_of.remove(&addr) {
                        if let Some(s) = self.slots[idx].take() {
                            let _ = self.epoll.remove(s.fd);
                        }
                        self.free_slots.push(idx);
                    }
                }
                SocketChange::Added(addr, group) => {
                    if let Some(idx) = self.slot_of.remove(&addr) {
                        // Re-added before this worker saw the removal: drop the old socket.
                        if let Some(s) = self.slots[idx].take() {
                            let _ = self.epoll.remove(s.fd);
                        }
                        self.free_slots.push(idx);
                    }
                    let fd = group[self.id].as_raw_fd();
                    let idx = self.free_slots.pop().unwrap_or_else(|| {
                        self.slots.push(None);
                        self.slots.len() - 1
                    });
                    match self.epoll.add(fd, idx as u64) {
                        Ok(()) => {
                            self.slots[idx] = Some(Slot { addr: Some(addr), _group: Some(group), fd });
                            self.slot_of.insert(addr, idx);
                        }
                        Err(e) => {
                            self.free_slots.push(idx);
                            tracing::error!(%addr, error = %e, "cannot watch socket");
                        }
                    }
                }
            }
        }
    }

    fn serve_socket(&mut self, idx: usize) {
        let Some(Some(slot)) = self.slots.get(idx) else { return };
        let (local, fd) = (slot.addr, slot.fd);
        for _ in 0..BATCHES_PER_TURN {
            let n = match self.batch.recv(fd) {
                Ok(0) => return,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!(?local, error = %e, "recvmmsg failed");
                    return;
                }
            };
            self.forward_batch(local, n);
            if n < self.batch.capacity() {
                return; // drained
            }
        }
    }

    /// Decide and send one received batch. `local`: the address the socket is bound to, None
    /// on a catch-all socket (each datagram's destination comes from its control message).
    /// Whether another RTCP report of `stream` may go to the control plane this second.
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
            // Still full (a sender spraying SSRCs): start over rather than sweep every packet;
            // a repeated report changes nothing in the model.
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

    /// Send `payload` from the SFU address `from` to `to`: queued for this worker's socket of
    /// `from` (sent with the batch, counted then), or, in steered mode, at once as a raw packet.
    /// `of`: the copy it is (counted per stream and consumer); None for RTCP the SFU sends a
    /// publisher, where only a failure is counted.
    #[allow(clippy::too_many_arguments)]
    fn send_from<'p>(
        &self,
        state: &State,
        from: SocketAddr,
        to: SocketAddr,
        payload: Cow<'p, [u8]>,
        of: Option<CopyOf>,
        out: &mut Vec<(RawFd, Option<CopyOf>, Outgoing<'p>)>,
        delta: &mut WorkerCounters,
    ) {
        if let Some(group) = state.sockets.get(&from) {
            out.push((group[self.id].as_raw_fd(), of, Outgoing { to: SockAddr::from(to), payload }));
            return;
        }
        let sent = self.steer.as_ref().is_some_and(|steer| send_raw_copy(steer, from, to, &payload));
        match of {
            Some(c) => {
                delta.count_copy(c.stream, c.consumer, payload.len(), sent);
                if sent {
                    delta.forwarded(c);
                }
            }
            None => delta.total.tx_errors += u64::from(!sent),
        }
    }

    /// A simulcast consumer's reports, NACKs and REMBs lower (or let rise) the layer it gets.
    fn feed_layer_choice(&self, outcome: &mediaplane_core::feedback::Outcome, now_ns: u64) {
        if outcome.reports.is_empty() && outcome.remb.is_empty() && outcome.nacks.is_empty() {
            return;
        }
        let mut guard = self.shared.layers.lock();
        let SimulcastState { consumers, activity, .. } = &mut *guard;
        for r in &outcome.reports {
            if let Some(c) = consumers.get_mut(&r.consumer) {
                c.choice.on_loss(r.block.fraction_lost, c.rewriter.current(), now_ns);
            }
        }
        for (id, seqs) in &outcome.nacks {
            if let Some(c) = consumers.get_mut(id) {
                // What was sent it so far, fresh (the tick leaves a settled consumer's counters).
                mirror(&mut c.rewriter, *id, self.shared.kernel_layers.as_deref());
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

    /// A consumer's feedback, routed: its tallies, what its reports and REMBs said, and what
    /// they mean for its layer.
    fn count_feedback(&self, outcome: &mediaplane_core::feedback::Outcome, received_at: u64, delta: &mut WorkerCounters) {
        delta.total.count_feedback(&outcome.total);
        for (id, t) in &outcome.per_stream {
            delta.streams.entry(*id).or_default().count_feedback(t);
        }
        for (id, t) in &outcome.per_consumer {
            let cc = delta.consumers.entry(*id).or_default();
            cc.feedback_routed += t.routed;
            cc.feedback_coalesced += t.coalesced;
        }
        for r in &outcome.reports {
            let b = &r.block;
            let cc = delta.consumers.entry(r.consumer).or_default();
            cc.report = Some(ConsumerReport {
                fraction_lost: b.fraction_lost,
                cumulative_lost: b.cumulative_lost,
                highest_seq: b.highest_seq,
                jitter: b.jitter,
                at_ns: received_at,
            });
            let rtt = self.shared.sender_reports.lock().get(&r.stream).and_then(|t| t.rtt_us(b.lsr, b.dlsr, received_at));
            if rtt.is_some() {
                (cc.rtt_us, cc.rtt_at_ns) = (rtt, received_at);
            }
        }
        for remb in &outcome.remb {
            for id in &remb.consumers {
                let cc = delta.consumers.entry(*id).or_default();
                (cc.remb_bps, cc.remb_at_ns) = (Some(remb.bps), received_at);
            }
        }
        self.feed_layer_choice(outcome, received_at);
    }

    fn forward_batch(&mut self, local: Option<SocketAddr>, n: usize) {
        let state = self.shared.state.load();
        let now = mono_ns();
        // One reading per batch: its datagrams were all waiting in the socket by now.
        let received_at = crate::monotonic_ns();
        let mut delta = WorkerCounters { account_forwarded: self.shared.forwarded_qos, ..Default::default() };
        // (egress fd, what it is a copy of, message) for every packet the batch sends.
        let mut out: Vec<(RawFd, Option<CopyOf>, Outgoing<'_>)> = Vec::new();
        // Marks of datagrams the kernel handed up in stream order: acknowledged once the batch's
        // copies are sent.
        let mut marks: Vec<u32> = Vec::new();
        // (stream id, header, clock rate) of every RTP packet accepted, in arrival order.
        let mut arrivals: Vec<(u32, RtpHeader, u32)> = Vec::new();
        // (stream id, source, clear RTCP) for the control plane's report evaluation.
        let mut rtcp_reports: Vec<(u32, SocketAddr, Vec<u8>)> = Vec::new();
        let mut effects: Vec<Effect<'_>> = Vec::new();
        let mut plane = PlaneState { shared: &self.shared, state: &state };
        for i in 0..n {
            if local.is_none() && self.shared.mark_ack.is_some() {
                let m = self.batch.mark(i);
                if m != 0 {
                    marks.push(m);
                }
            }
            let (src, payload, truncated) = self.batch.get(i);
            delta.total.rx_packets += 1;
            delta.total.rx_bytes += payload.len() as u64;
            let Some(src) = src else {
                delta.total.drop_malformed += 1;
                continue;
            };
            if truncated {
                delta.total.drop_malformed += 1;
                continue;
            }
            let Some(local) = local.or_else(|| self.batch.orig_dst(i)) else {
                delta.total.drop_no_stream += 1;
                continue;
            };
            // The decision is core's (mediaplane_core::pipeline); this plane carries it out.
            self.pipeline.process(&state.table, local, src, payload, now, received_at, &mut plane, &mut effects);
            for effect in effects.drain(..) {
                match effect {
                    Effect::Dropped { why, stream, received } => {
                        delta.total.count_dropped(why);
                        if let Some(id) = stream {
                            let sc = delta.streams.entry(id).or_default();
                            if let Some(bytes) = received {
                                sc.rx_packets += 1;
                                sc.rx_bytes += bytes as u64;
                            }
                            sc.count_dropped(why);
                        }
                    }
                    Effect::SlowPath { reason, stream, handshake } => {
                        delta.total.count_slow(reason);
                        if let Some(id) = stream {
                            delta.streams.entry(id).or_default().count_slow(reason);
                        }
                        if let Some(stream) = handshake {
                            // An ICE leg's connectivity check or DTLS: the control plane answers it.
                            self.shared.report(DataplaneEvent::Handshake { stream, local, source: src, at_ns: received_at, packet: payload.to_vec() });
                        }
                    }
                    Effect::Feedback(outcome) => self.count_feedback(&outcome, received_at, &mut delta),
                    Effect::Received { stream, bytes } => {
                        let sc = delta.streams.entry(stream).or_default();
                        sc.rx_packets += 1;
                        sc.rx_bytes += bytes as u64;
                    }
                    Effect::Unlatched { stream, source } => {
                        // Relayed like any packet; its source goes to the control plane, which
                        // decides whether the leg follows it.
                        delta.streams.entry(stream).or_default().count_slow(SlowReason::Unlatched);
                        delta.total.count_slow(SlowReason::Unlatched);
                        self.shared.report(DataplaneEvent::Unlatched { stream, source });
                    }
                    Effect::Accepted { stream } => delta.streams.entry(stream).or_default().last_rx_ns = received_at,
                    Effect::Rtp { stream, header, clock_rate } => arrivals.push((stream, header, clock_rate)),
                    // When a publisher's sender report passed, for its consumers' round-trip times.
                    Effect::SenderReport { stream, ntp_middle } => {
                        self.shared.sender_reports.lock().entry(stream).or_default().on_sender_report(ntp_middle, received_at)
                    }
                    Effect::RelayRtcp { stream, packet } => {
                        if self.shared.events.is_some()
                            && packet.len() <= crate::MAX_RTCP_REPORT
                            && Self::rtcp_admit(&mut self.rtcp_budget, stream, received_at)
                        {
                            rtcp_reports.push((stream, src, packet.into_owned()));
                        }
                    }
                    Effect::StreamId { transport, ssrc, mid, rid } => {
                        if self.shared.events.is_some() && Self::stream_id_due(&mut self.stream_ids_reported, (transport, ssrc), received_at) {
                            self.shared.report(DataplaneEvent::StreamId { transport, ssrc, mid, rid });
                        }
                    }
                    Effect::Record { stream, label, packet } => crate::record::tap(stream, &label, src, local, &packet),
                    Effect::Send { from, to, packet, copy } => self.send_from(&state, from, to, packet, copy, &mut out, &mut delta),
                    Effect::CopyFailed { copy } => delta.count_copy(copy.stream, copy.consumer, 0, false),
                    Effect::CopyUnkeyed { copy } => delta.count_unkeyed(copy.stream),
                }
            }
        }
        // Group copies per egress socket, keeping their order within a socket.
        out.sort_by_key(|(fd, _, _)| *fd);
        let mut start = 0;
        while start < out.len() {
            let fd = out[start].0;
            let end = start + out[start..].iter().take_while(|(f, _, _)| *f == fd).count();
            let msgs: Vec<&Outgoing<'_>> = out[start..end].iter().map(|(_, _, m)| m).collect();
            let failed = sys::send_batch(fd, &msgs);
            for (k, (_, copy, m)) in out[start..end].iter().enumerate() {
                match copy {
                    Some(c) => {
                        let sent = !failed.contains(&k);
                        delta.count_copy(c.stream, c.consumer, m.payload.len(), sent);
                        if sent {
                            delta.forwarded(*c);
                        }
                    }
                    // Feedback to a publisher: only a failure is counted (as any send's).
                    None => delta.total.tx_errors += failed.contains(&k) as u64,
                }
            }
            start = end;
        }
        if let Some(ack) = &self.shared.mark_ack {
            marks.iter().for_each(|m| (ack.0)(*m));
        }
        if !rtcp_reports.is_empty() {
            let wall_us = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
            for (stream, source, packet) in rtcp_reports {
                self.shared.report(DataplaneEvent::Rtcp { stream, source, at_ns: received_at, wall_us, packet });
            }
        }
        if !arrivals.is_empty() {
            // One time for the batch: its datagrams were all waiting by `received_at`.
            let mut reception = self.shared.reception.lock();
            for (id, h, rate) in arrivals {
                reception.entry(id).or_default().on_packet(h.ssrc, h.sequence, h.timestamp, received_at, rate);
            }
        }
        if !delta.forwarded.is_empty() {
            // At the arrival time, as the kernel does (jitter of the stream as the consumer got it).
            // (A batch still on the table before an apply may bring back the entry of a consumer
            // it forgot, as with the counters: ids are never reused, a full apply sweeps them.)
            let mut forwarded = self.shared.forwarded.lock();
            for (consumer, ssrc, seq, ts, rate) in delta.forwarded.drain(..) {
                forwarded.entry(consumer).or_default().on_packet(ssrc, seq, ts, received_at, rate);
            }
        }
        let mut c = self.counters.lock();
        c.total.add(&delta.total);
        for (id, sc) in delta.streams {
            c.streams.entry(id).or_default().add(&sc);
        }
        for (id, cc) in delta.consumers {
            c.consumers.entry(id).or_default().add(&cc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mediaplane_core::model::{StreamRef, StreamSpec};
    use mediaplane_core::rtp::build_rtp;
    use mediaplane_core::simulcast::{Codec, PacketInfo, RewriterState};
    use mediaplane_core::Model;
    use std::net::UdpSocket;
    use std::time::Duration;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// Datagrams `sock` receives until `quiet` passes without one (bounded: 5 s).
    fn received(sock: &UdpSocket, quiet: Duration) -> Vec<Vec<u8>> {
        sock.set_read_timeout(Some(quiet)).unwrap();
        let (mut got, mut buf) = (Vec::new(), [0u8; 2048]);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            match sock.recv(&mut buf) {
                Ok(n) => got.push(buf[..n].to_vec()),
                Err(_) => break,
            }
        }
        got
    }

    /// A sender spraying SSRCs fills the RID report throttle's map with entries all fresh: it is
    /// started over, so it stays bounded and the next packets do not sweep it again each. One
    /// SSRC's RID is reported at most once per interval.
    #[test]
    fn the_rid_report_throttle_stays_bounded_under_a_spray_of_ssrcs() {
        let mut reported = HashMap::new();
        let t0 = 1_000_000_000;
        assert!(WorkerCtx::stream_id_due(&mut reported, (1, 7), t0));
        assert!(!WorkerCtx::stream_id_due(&mut reported, (1, 7), t0 + STREAM_ID_REPORT_NS - 1), "within the interval");
        assert!(WorkerCtx::stream_id_due(&mut reported, (1, 7), t0 + STREAM_ID_REPORT_NS), "the interval over");
        let mut largest = 0;
        for ssrc in 0..20_000u32 {
            // 20,000 SSRCs within 20 µs: every entry is fresh when the map is full.
            assert!(WorkerCtx::stream_id_due(&mut reported, (2, ssrc), t0 + STREAM_ID_REPORT_NS + ssrc as u64), "{ssrc}: a new SSRC is reported");
            largest = largest.max(reported.len());
        }
        assert!(largest <= 4097, "the map grew to {largest} entries (each packet past 4,096 swept it)");
    }

    /// The kernel's simulcast states, faked: each consumer's as given, every layer stream
    /// received anew at each read.
    #[derive(Default)]
    struct FakeKernel {
        states: parking_lot::Mutex<HashMap<u32, RewriterState>>,
        reads: AtomicU64,
        /// Calls of `consumers`: reconciling ticks.
        listed: AtomicU64,
    }

    impl KernelLayers for FakeKernel {
        fn create(&self, consumer: u32, _: u32, _: u32) {
            self.states.lock().entry(consumer).or_default();
        }
        fn remove(&self, consumer: u32) {
            self.states.lock().remove(&consumer);
        }
        fn set_target(&self, consumer: u32, target: Option<u8>, _: Option<u8>) -> bool {
            self.states.lock().get_mut(&consumer).map(|s| s.target = target).is_some()
        }
        fn consumers(&self) -> Vec<u32> {
            self.listed.fetch_add(1, Ordering::Relaxed);
            self.states.lock().keys().copied().collect()
        }
        fn decide(&self, _: u32, _: u8, _: Codec, _: u64, _: &[u8]) -> Option<Vec<u8>> {
            None
        }
        fn state(&self, consumer: u32) -> Option<RewriterState> {
            self.states.lock().get(&consumer).cloned()
        }
        fn received(&self, _: u32) -> Option<KernelReceived> {
            let n = self.reads.fetch_add(1, Ordering::Relaxed) + 1;
            Some(KernelReceived { packets: n, bytes: n * 1000, last_ns: crate::monotonic_ns(), keyframes: 0 })
        }
    }

    /// A consumer the tick has not aimed yet is read from the kernel on that first tick: a
    /// restarted daemon's consumer whose pinned state already receives the top layer is taken
    /// for what it is, not for one waiting for that layer (which would ask its publisher for a
    /// keyframe nobody needs).
    #[test]
    fn the_tick_reads_a_consumer_it_has_not_aimed_yet() {
        let (publisher, subscriber) = (UdpSocket::bind("127.79.1.10:5000").unwrap(), UdpSocket::bind("127.79.1.11:5000").unwrap());
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "p", a("127.79.1.1:42000"), publisher.local_addr().unwrap()).unwrap();
        m.add_participant("r", "s", a("127.79.1.1:42002"), subscriber.local_addr().unwrap()).unwrap();
        let spec = StreamSpec { layers: vec![100, 101], codec: Some(Codec::Vp8), clock_rate: Some(90_000), ..Default::default() };
        m.publish("r", "p", "cam", spec).unwrap();
        let consumer = m.subscribe("r", "s", StreamRef { publisher: "p".into(), stream: "cam".into() }).unwrap();
        // Its state in the kernel, pinned across the restart: on layer 1, the top one.
        let mut rw = LayerRewriter::new(100, 90_000);
        rw.set_target(Some(1));
        let key = PacketInfo { sequence: 9, timestamp: 900, frame_start: true, keyframe_start: true, picture_id: None, tl0picidx: None, temporal: None };
        rw.on_packet(1, &key, 1);
        assert_eq!(rw.current(), Some(1));
        let kernel = Arc::new(FakeKernel::default());
        let handle = crate::kernel_layers::KernelLayersHandle(kernel.clone());
        let dp = UserspaceDataplane::new(UserspaceConfig { workers: 1, kernel_layers: Some(handle), ..Default::default() }, None).unwrap();
        // The consumer must first be met by a tick that does not reconcile (a reconciling one
        // reads every consumer anyway): its table comes right after one that did (the next is
        // RECONCILE_TICKS, 1 s, away).
        dp.apply(Arc::new(ForwardingTable::compile(&Model::new(), 1))).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while kernel.listed.load(Ordering::Relaxed) == 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(kernel.listed.load(Ordering::Relaxed) > 0, "no reconciling tick in 5 s");
        kernel.states.lock().insert(consumer, rw.state());
        dp.apply(Arc::new(ForwardingTable::compile(&m, 2))).unwrap();
        // 15 ticks at least.
        let pli = received(&publisher, Duration::from_millis(300));
        assert!(kernel.reads.load(Ordering::Relaxed) >= 2 * 5, "the tick ran");
        let c = dp.consumer_counters(&[consumer]).remove(&consumer).and_then(|c| c.layer).unwrap();
        dp.shutdown().unwrap();
        assert_eq!((c.current, c.target), (Some(1), Some(1)), "{c:?}");
        assert_eq!(c.stats.keyframe_requests, 0, "{c:?}");
        assert!(pli.is_empty(), "the publisher was asked for a keyframe: {pli:?}");
    }

    /// Copies for a subscriber that speaks SRTP but is not keyed yet (a browser nominated by ICE,
    /// its DTLS not done) are not sent and are counted `tx_unkeyed`, per stream and in total,
    /// not `tx_errors` (which a send-error alert reads), nor the consumer's.
    #[test]
    fn copies_to_a_subscriber_not_keyed_yet_are_no_send_errors() {
        let publisher = UdpSocket::bind("127.79.2.10:5000").unwrap();
        let (browser, plain) = (UdpSocket::bind("127.79.2.11:5000").unwrap(), UdpSocket::bind("127.79.2.12:5000").unwrap());
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "p", a("127.79.2.1:42000"), publisher.local_addr().unwrap()).unwrap();
        m.publish("r", "p", "mic", StreamSpec { ssrc: Some(5), ..Default::default() }).unwrap();
        m.add_webrtc_participant("r", "w", a("127.79.2.1:42002")).unwrap();
        m.set_participant_nominated("r", "w", Some(browser.local_addr().unwrap())).unwrap();
        m.add_participant("r", "plain", a("127.79.2.1:42004"), plain.local_addr().unwrap()).unwrap();
        let to = || StreamRef { publisher: "p".into(), stream: "mic".into() };
        let (unkeyed, keyed) = (m.subscribe("r", "w", to()).unwrap(), m.subscribe("r", "plain", to()).unwrap());
        let table = ForwardingTable::compile(&m, 1);
        let stream = table.streams.values().find(|e| e.label.ends_with("/mic")).unwrap().id;

        let dp = UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, None).unwrap();
        dp.apply(Arc::new(table)).unwrap();
        for seq in 0..5 {
            publisher.send_to(&build_rtp(0, seq, seq as u32 * 160, 5, &[7; 160]), "127.79.2.1:42000").unwrap();
        }
        let got = received(&plain, Duration::from_millis(200));
        let to_browser = received(&browser, Duration::from_millis(50));
        let (st, consumers) = (dp.stats(), dp.consumer_counters(&[unkeyed, keyed]));
        dp.shutdown().unwrap();
        assert_eq!((got.len(), to_browser.len()), (5, 0), "the plain subscriber gets every packet, the browser none");
        let t = &st.total;
        assert_eq!((t.tx_copies, t.tx_unkeyed, t.tx_errors), (5, 5, 0), "{t:?}");
        let s = &st.streams[&stream];
        assert_eq!((s.tx_copies, s.tx_unkeyed, s.tx_errors), (5, 5, 0), "{s:?}");
        assert_eq!(consumers.get(&unkeyed).map_or((0, 0), |c| (c.tx_copies, c.tx_errors)), (0, 0), "{consumers:?}");
        assert_eq!((consumers[&keyed].tx_copies, consumers[&keyed].tx_errors), (5, 0));
    }
}
