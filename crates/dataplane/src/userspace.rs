//! The portable user-space data plane: UDP sockets, batched I/O, one worker thread per core.
//! A driver of the per-packet [`Engine`]: it only moves packets and carries out what the engine
//! decides.
//!
//! Every SFU address in the table gets one socket per worker in an `SO_REUSEPORT` group, so the
//! kernel spreads flows over workers and keeps each flow on one worker (no reordering). A worker
//! receives with `recvmmsg`, has the engine decide the batch, and sends each copy from the socket
//! bound to the copy's `from` address with `sendmmsg`, grouped per socket. Worker 0 also runs the
//! engine's timers ([`Engine::poll_timeout`]).
//!
//! Atomic updates: the table and the sockets it needs live in one immutable [`State`] snapshot
//! swapped with `ArcSwap`; a worker loads it under the engine's lock, and an install swaps it and
//! has the engine forget what left the table under the same lock, so a batch is decided entirely
//! with the old or entirely with the new table. (Only the booking of what a batch sent, after its
//! sends, may bring back the counters of a consumer an install forgot meanwhile: ids are never
//! reused, and the next full apply sweeps them.)
//!
//! Updates cost what changed: the table and the socket map are persistent maps (O(1) clones),
//! an update with its changed keys ([`Dataplane::apply_changes`]) only counts the addresses
//! those entries use, and workers are told which sockets came and went rather than rescanning.

use crate::engine::{Crypto, Datagram, Engine, EngineConfig, KernelReadings, LayeredStreams, Now, Output};
use crate::kernel_layers::KernelLayers;
use crate::srtp::SrtpSlot;
use crate::sys::{self, Epoll, EventFd, Outgoing, RecvBatch};
use crate::{ConsumerCounters, Dataplane, DataplaneError, DataplaneEvent, DataplaneStats, HeaderPolicy};
use arc_swap::ArcSwap;
use mediaplane_core::pipeline::CopyOf;
use mediaplane_core::reception::ReceptionReport;
use mediaplane_core::srtp::SrtpKey;
use mediaplane_core::table::{IngressKey, StreamEntry};
use mediaplane_core::ForwardingTable;
use parking_lot::Mutex;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

pub use crate::engine::SourceBuckets;

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
    /// Answer video consumers' NACKs from what was sent them ([`EngineConfig::retransmit`]).
    pub retransmit: bool,
    /// The AF_XDP plane: also receive and send on these AF_XDP sockets, whose XDP program
    /// hands them the SFU's datagrams; the sockets then carry only what that program passes to
    /// the host stack ([`crate::afxdp`]).
    pub xsk: Option<crate::afxdp::XskConfig>,
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
            retransmit: true,
            xsk: None,
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
            sys::set_recv_timestamps(s.as_raw_fd())?;
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
pub(crate) struct State {
    pub(crate) table: Arc<ForwardingTable>,
    pub(crate) sockets: imbl::HashMap<SocketAddr, Arc<Vec<Socket>>>,
    /// The SRTP sessions of the table's SRTP legs.
    pub(crate) srtp: crate::srtp::Contexts,
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

pub(crate) struct Shared {
    pub(crate) state: ArcSwap<State>,
    pub(crate) stop: AtomicBool,
    events: Option<SyncSender<DataplaneEvent>>,
    /// Events not queued because the control plane was behind ([`crate::EVENT_QUEUE`]).
    events_dropped: AtomicU64,
    mark_ack: Option<MarkAck>,
    /// Every decision's state. Taken per batch to decide it and once more for what it sent;
    /// never held across a send. (Under it, the eBPF plane's simulcast fan-out and tick read and
    /// aim the kernel's per-consumer states: map calls that take no lock of the eBPF plane's.)
    /// The installed `state` is swapped under it.
    pub(crate) engine: Mutex<Engine>,
    /// When the engine's next timer is due ([`Engine::poll_timeout`]; u64::MAX: none), for
    /// worker 0 to read without the lock.
    pub(crate) timer_due: AtomicU64,
    /// The kernel's simulcast states, read outside the engine's lock for its tick.
    kernel_layers: Option<Arc<dyn KernelLayers>>,
}

/// `packet` as it leaves `from`: as it is, or sealed with `from`'s outbound SRTP context of
/// `state` (the snapshot it was decided with: its contexts are the table's keys); None: it could
/// not be (counted by the contexts).
pub(crate) fn sealed<'p>(state: &State, from: SocketAddr, packet: Cow<'p, [u8]>, seal: bool) -> Option<Cow<'p, [u8]>> {
    if !seal {
        return Some(packet);
    }
    crate::srtp::protect(state.srtp.slot(SrtpSlot { local: from, outbound: true }), &packet).map(Cow::Owned)
}

/// The SRTP contexts of the installed table, as the engine asks for them.
pub(crate) struct SrtpCrypto<'a>(pub(crate) &'a crate::srtp::Contexts);

impl Crypto for SrtpCrypto<'_> {
    fn unprotect(&mut self, at: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>> {
        crate::srtp::unprotect(self.0.get(SrtpSlot { local: at, outbound: false }, key), packet).ok()
    }

    fn protect(&mut self, from: SocketAddr, key: Option<&SrtpKey>, packet: &[u8]) -> Option<Vec<u8>> {
        crate::srtp::protect(self.0.get(SrtpSlot { local: from, outbound: true }, key), packet)
    }
}

struct Worker {
    thread: Option<JoinHandle<()>>,
    wake: Arc<EventFd>,
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
    /// The AF_XDP thread ([`UserspaceConfig::xsk`]) and what it counts.
    xsk: Mutex<Option<(JoinHandle<()>, Arc<EventFd>)>>,
    xsk_stats: Option<Arc<crate::afxdp::XskStats>>,
}

impl Shared {
    /// Queue an event for the control plane; never blocks a worker (a full queue drops it).
    pub(crate) fn report(&self, ev: DataplaneEvent) {
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
            engine: Mutex::new(Engine::new(EngineConfig {
                forwarded_qos: cfg.forwarded_qos,
                retransmit: cfg.retransmit,
                events: events.is_some(),
                kernel_layers: cfg.kernel_layers.as_ref().map(|k| k.0.clone()),
            })),
            events,
            events_dropped: AtomicU64::new(0),
            mark_ack: cfg.mark_ack.clone(),
            // A plane with kernel states ticks from the start (the engine's first tick is due at once).
            timer_due: AtomicU64::new(if cfg.kernel_layers.is_some() { 0 } else { u64::MAX }),
            kernel_layers: cfg.kernel_layers.as_ref().map(|k| k.0.clone()),
        });
        let steer: Vec<Arc<SteerSockets>> = if cfg.steered {
            (0..cfg.workers).map(|_| SteerSockets::open(cfg.socket_buffer, cfg.header).map(Arc::new)).collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        let mut workers = Vec::new();
        for id in 0..cfg.workers {
            let wake = Arc::new(EventFd::new().map_err(|e| io_err("eventfd", e))?);
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
                changes: changes.clone(),
                epoll,
                batch: RecvBatch::new(cfg.batch, MAX_DATAGRAM),
                slots,
                steer: steer.get(id).cloned(),
                slot_of: HashMap::new(),
                free_slots: Vec::new(),
                layered: LayeredStreams::default(),
            };
            let thread = std::thread::Builder::new().name(format!("mp-worker-{id}")).spawn(move || ctx.run()).map_err(|e| io_err("spawn worker", e))?;
            workers.push(Worker { thread: Some(thread), wake, changes });
        }
        let (xsk, xsk_stats) = match cfg.xsk.clone() {
            Some(xcfg) => {
                let stats = Arc::new(crate::afxdp::XskStats::default());
                let wake = Arc::new(EventFd::new().map_err(|e| io_err("eventfd", e))?);
                let started = crate::afxdp::start(xcfg, shared.clone(), cfg.header, stats.clone(), wake.clone());
                let thread = match started {
                    Ok(t) => t,
                    Err(e) => {
                        // The socket workers started above must not outlive a failed start.
                        shared.stop.store(true, Ordering::SeqCst);
                        for w in &mut workers {
                            w.wake.notify();
                            if let Some(t) = w.thread.take() {
                                let _ = t.join();
                            }
                        }
                        return Err(e);
                    }
                };
                (Some((thread, wake)), Some(stats))
            }
            None => (None, None),
        };
        Ok(UserspaceDataplane { shared, workers: Mutex::new(workers), cfg, apply_lock: Mutex::new(HashMap::new()), steer, xsk: Mutex::new(xsk), xsk_stats })
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
        if self.cfg.steered {
            // No per-address sockets: packets are steered to us, copies leave on raw sockets.
            self.swap_state(&old.table, State { table, sockets: old.sockets.clone(), srtp }, changed);
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
        // Kernel receive times where a publisher's transport is fed back or estimated: a control
        // message on every packet, so only those addresses' sockets ask (idempotent for the ones
        // that did).
        let entries: Vec<&StreamEntry> = match changed {
            Some(keys) => keys.iter().filter_map(|k| table.streams.get(k)).collect(),
            None => table.streams.values().collect(),
        };
        for e in entries.into_iter().filter(|e| e.publisher_feedback.is_some_and(|f| f.transport_cc.is_some() || f.abs_send_time.is_some())) {
            for s in sockets.get(&e.key.local).map_or(&[][..], |g| &g[..]) {
                if let Err(error) = sys::set_recv_timestamps(s.as_raw_fd()) {
                    tracing::warn!(%error, local = %e.key.local, "SO_TIMESTAMPNS refused: transport feedback uses the batch's time");
                }
            }
        }
        self.swap_state(&old.table, State { table, sockets, srtp }, changed);
        if let Some(x) = self.cfg.xsk.as_ref().filter(|_| !changes.is_empty()) {
            // The XDP program hands over datagrams to addresses that have their socket now.
            let (mut added, mut removed) = (Vec::new(), Vec::new());
            for c in &changes {
                match c {
                    SocketChange::Added(a, _) => added.push(*a),
                    SocketChange::Removed(a) => removed.push(*a),
                }
            }
            (x.addresses)(&added, &removed);
        }
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

    /// Make `new` the installed state, and have the engine forget what left the table, under the
    /// engine's lock: no batch is decided in between (see the module documentation).
    fn swap_state(&self, old: &ForwardingTable, new: State, changed: Option<&[IngressKey]>) {
        let mut engine = self.shared.engine.lock();
        engine.forget(old, &new.table, changed);
        self.shared.state.store(Arc::new(new));
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
        if self.cfg.xsk.is_some() {
            "afxdp"
        } else {
            "userspace"
        }
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
        self.shared.engine.lock().stats_into(&mut st);
        st.extra.extend(sys::host_drop_counters().into_iter().map(|(k, v)| (k.to_string(), v)));
        // Process-wide (one recorder per daemon): recorded streams' packets relayed but not
        // recorded because the writer fell behind.
        st.extra.insert("not_recorded".into(), crate::record::not_recorded());
        st.extra.insert("events_dropped".into(), self.shared.events_dropped.load(Ordering::Relaxed));
        st.extra.extend(crate::srtp::failures().into_iter().map(|(k, v)| (k.to_string(), v)));
        if let Some(x) = &self.xsk_stats {
            st.extra.extend(x.fields().into_iter().map(|(k, v)| (k.to_string(), v)));
        }
        st
    }

    fn consumer_counters(&self, ids: &[u32]) -> BTreeMap<u32, ConsumerCounters> {
        self.shared.engine.lock().consumer_counters(ids, crate::monotonic_ns())
    }

    fn consumer_reception(&self, ids: &[u32]) -> BTreeMap<u32, ReceptionReport> {
        self.shared.engine.lock().consumer_reception(ids)
    }

    fn stream_reception(&self, ids: &[u32]) -> BTreeMap<u32, ReceptionReport> {
        self.shared.engine.lock().stream_reception(ids)
    }

    fn shutdown(&self) -> Result<(), DataplaneError> {
        // The locks in the order an apply takes them (apply_lock, then workers): a change being
        // installed while the daemon stops (an RTSP session ending) finishes first instead of
        // deadlocking against this.
        let mut applied = self.apply_lock.lock();
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
        if let Some((thread, wake)) = self.xsk.lock().take() {
            wake.notify();
            let _ = thread.join();
        }
        self.shared.state.store(Arc::new(State { table: Arc::new(ForwardingTable::default()), sockets: Default::default(), srtp: Default::default() }));
        applied.clear();
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
    changes: Arc<Mutex<Vec<SocketChange>>>,
    epoll: Epoll,
    batch: RecvBatch,
    /// Sockets this worker receives on; the index is the epoll token.
    slots: Vec<Option<Slot>>,
    slot_of: HashMap<SocketAddr, usize>,
    free_slots: Vec<usize>,
    /// Steered mode: this worker's catch-all and raw sockets.
    steer: Option<Arc<SteerSockets>>,
    /// Worker 0: the installed table's layer streams, for the kernel readings of the timers.
    layered: LayeredStreams,
}

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

/// Steered mode: send one copy from `from` as a complete IP packet on the raw socket (the slow
/// path is rare traffic: the first packet of a relay leg, STUN, unresolved next hops, copies
/// larger than their path MTU, fragmented datagrams).
///
/// A header-included packet is never fragmented: the kernel refuses one larger than the egress
/// link or route MTU (EMSGSIZE, DF set). Such a copy goes, UDP header and payload, to the
/// family's raw UDP socket, where the kernel builds the IP header (same policy, from socket
/// options) and fragments it as the host fragments UDP; its fragments carry a non-zero IPv4 ID.
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
pub(crate) fn next_ip_id() -> u16 {
    thread_local!(static STATE: std::cell::Cell<u32> = std::cell::Cell::new(crate::engine::limits_clock_ns() as u32 | 1));
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

impl WorkerCtx {
    fn run(mut self) {
        let mut ready = Vec::with_capacity(64);
        self.reconcile();
        while !self.shared.stop.load(Ordering::Relaxed) {
            if let Err(e) = self.epoll.wait(&mut ready, self.wait_ms()) {
                tracing::error!(worker = self.id, error = %e, "epoll_wait failed");
                std::thread::sleep(std::time::Duration::from_millis(10));
                ready.clear();
            }
            for &tok in &ready {
                if tok == WAKE_TOKEN {
                    self.wake.drain();
                    self.reconcile();
                } else {
                    self.serve_socket(tok as usize);
                }
            }
            if self.id == 0 {
                self.run_timers();
            }
        }
        for slot in self.slots.drain(..).flatten() {
            let _ = self.epoll.remove(slot.fd);
        }
    }

    /// How long to wait for packets: 200 ms (so a stop is seen), less when worker 0 has an
    /// engine timer due sooner.
    fn wait_ms(&self) -> i32 {
        const IDLE_MS: u64 = 200;
        match self.shared.timer_due.load(Ordering::Relaxed) {
            u64::MAX => IDLE_MS as i32,
            _ if self.id != 0 => IDLE_MS as i32,
            at => at.saturating_sub(crate::monotonic_ns()).div_ceil(1_000_000).min(IDLE_MS) as i32,
        }
    }

    /// Worker 0: what the engine's timers ask for, sent outside the engine's lock.
    fn run_timers(&mut self) {
        let now = Now::read();
        if now.mono_ns < self.shared.timer_due.load(Ordering::Relaxed) {
            return;
        }
        // The kernel's counters first, without the lock (see KernelReadings).
        let readings = match &self.shared.kernel_layers {
            Some(k) => KernelReadings::read_with(k.as_ref(), &self.shared.state.load().table, &mut self.layered),
            None => KernelReadings::default(),
        };
        let mut out = Vec::new();
        let state = {
            let mut engine = self.shared.engine.lock();
            let state = self.shared.state.load_full();
            engine.handle_timeout(now, &state.table, &mut SrtpCrypto(&state.srtp), &readings, &mut out);
            self.shared.timer_due.store(engine.poll_timeout().unwrap_or(u64::MAX), Ordering::Relaxed);
            state
        };
        let mut sent = Vec::with_capacity(out.len());
        for o in out {
            if let Output::Transmit { from, to, packet, copy, seal } = o {
                let Some(packet) = sealed(&state, from, packet, seal) else {
                    sent.extend(copy.map(|c| (Some(c), 0, false)));
                    continue;
                };
                let ok = send_datagram_with(&self.shared, self.steer.as_deref(), from, to, &packet);
                if let Err(e) = &ok {
                    tracing::debug!(error = %e, "keyframe request to a publisher");
                }
                sent.push((copy, packet.len(), ok.is_ok()));
            }
        }
        let mut engine = self.shared.engine.lock();
        for (copy, bytes, ok) in sent {
            engine.on_transmitted(copy, bytes, ok, now.mono_ns);
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
    fn forward_batch(&mut self, local: Option<SocketAddr>, n: usize) {
        // One reading per batch: its datagrams were all waiting in the socket by now.
        let now = Now::read();
        // Marks of datagrams the kernel handed up in stream order: acknowledged once the batch's
        // copies are sent.
        let mut marks: Vec<u32> = Vec::new();
        if local.is_none() && self.shared.mark_ack.is_some() {
            marks.extend((0..n).map(|i| self.batch.mark(i)).filter(|m| *m != 0));
        }
        let mut outputs: Vec<Output<'_>> = Vec::new();
        let state = {
            let mut engine = self.shared.engine.lock();
            // Loaded under the engine's lock: an install swaps it and forgets under the same one.
            let state = self.shared.state.load_full();
            let batch = &self.batch;
            let dgrams = (0..n).map(|i| {
                let (src, payload, truncated) = batch.get(i);
                let arrived_ns = batch.received_realtime_ns(i).and_then(|t| now.arrival(t));
                Datagram { local: local.or_else(|| batch.orig_dst(i)), src, truncated, payload, arrived_ns }
            });
            engine.handle_batch(now, &state.table, &mut SrtpCrypto(&state.srtp), dgrams, &mut outputs);
            // A packet can bring a timer forward (a publisher's first transport feedback).
            if let Some(due) = engine.poll_timeout() {
                self.shared.timer_due.fetch_min(due, Ordering::Relaxed);
            }
            state
        };
        // (egress fd, what it is a copy of, message) for every packet queued on a socket; the
        // raw sends of steered mode go at once, in order. (copy, bytes, sent) for the engine.
        let mut queued: Vec<(RawFd, Option<CopyOf>, Outgoing<'_>)> = Vec::new();
        let mut sent: Vec<(Option<CopyOf>, usize, bool)> = Vec::new();
        for o in outputs {
            match o {
                Output::Transmit { from, to, packet, copy, seal } => {
                    let Some(packet) = sealed(&state, from, packet, seal) else {
                        sent.extend(copy.map(|c| (Some(c), 0, false)));
                        continue;
                    };
                    match state.sockets.get(&from) {
                        Some(group) => queued.push((group[self.id].as_raw_fd(), copy, Outgoing { to: SockAddr::from(to), payload: packet })),
                        None => {
                            let ok = self.steer.as_ref().is_some_and(|steer| send_raw_copy(steer, from, to, &packet));
                            sent.push((copy, packet.len(), ok));
                        }
                    }
                }
                Output::Event(ev) => self.shared.report(ev),
                Output::Record { stream, label, src, local, packet } => crate::record::tap(stream, &label, src, local, &packet),
            }
        }
        // Group copies per egress socket, keeping their order within a socket.
        queued.sort_by_key(|(fd, _, _)| *fd);
        let mut start = 0;
        while start < queued.len() {
            let fd = queued[start].0;
            let end = start + queued[start..].iter().take_while(|(f, _, _)| *f == fd).count();
            let msgs: Vec<&Outgoing<'_>> = queued[start..end].iter().map(|(_, _, m)| m).collect();
            let failed = sys::send_batch(fd, &msgs);
            for (k, (_, copy, m)) in queued[start..end].iter().enumerate() {
                sent.push((*copy, m.payload.len(), !failed.contains(&k)));
            }
            start = end;
        }
        if let Some(ack) = &self.shared.mark_ack {
            marks.iter().for_each(|m| (ack.0)(*m));
        }
        if !sent.is_empty() {
            let mut engine = self.shared.engine.lock();
            for (copy, bytes, ok) in sent {
                engine.on_transmitted(copy, bytes, ok, now.mono_ns);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_support::{simulcast_room, state_on_top_layer, FakeKernel};
    use mediaplane_core::model::{StreamRef, StreamSpec};
    use mediaplane_core::rtp::build_rtp;
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

    /// A consumer the tick has not aimed yet is read from the kernel on that first tick: a
    /// restarted daemon's consumer whose pinned state already receives the top layer is taken
    /// for what it is, not for one waiting for that layer (which would ask its publisher for a
    /// keyframe nobody needs).
    #[test]
    fn the_tick_reads_a_consumer_it_has_not_aimed_yet() {
        let (publisher, subscriber) = (UdpSocket::bind("127.79.1.10:5000").unwrap(), UdpSocket::bind("127.79.1.11:5000").unwrap());
        let (m, consumer) = simulcast_room(a("127.79.1.1:1").ip(), publisher.local_addr().unwrap(), subscriber.local_addr().unwrap());
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
        // Its state in the kernel, pinned across the restart: on layer 1, the top one.
        kernel.states.lock().insert(consumer, state_on_top_layer());
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
    /// Only the sockets of an address whose publisher's transport is fed back ask for kernel
    /// receive times (a control message on every packet): a browser publisher's that negotiated
    /// transport-cc, not a plain participant's.
    #[test]
    fn only_fed_back_transports_ask_for_receive_times() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "plain", a("127.79.3.1:42000"), a("127.79.3.10:5000")).unwrap();
        m.publish("r", "plain", "mic", StreamSpec { ssrc: Some(5), ..Default::default() }).unwrap();
        m.add_webrtc_participant("r", "w", a("127.79.3.1:42002")).unwrap();
        m.set_transport_cc("r", "w", 3).unwrap();
        let dp = UserspaceDataplane::new(UserspaceConfig { workers: 2, ..Default::default() }, None).unwrap();
        dp.apply(Arc::new(ForwardingTable::compile(&m, 1))).unwrap();
        let asks = |addr: &str| -> Vec<bool> {
            let state = dp.shared.state.load();
            state.sockets[&a(addr)]
                .iter()
                .map(|s| {
                    let (mut v, mut len): (libc::c_int, libc::socklen_t) = (0, size_of::<libc::c_int>() as u32);
                    // SAFETY: getsockopt into a live c_int of the stated size.
                    let r = unsafe { libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, (&mut v as *mut libc::c_int).cast(), &mut len) };
                    assert_eq!(r, 0);
                    v != 0
                })
                .collect()
        };
        // Fed back once nominated (before, its media may come from a checked address): the
        // table that nominates it turns them on.
        let before = asks("127.79.3.1:42002");
        m.set_participant_nominated("r", "w", Some(a("127.79.3.11:5000"))).unwrap();
        dp.apply(Arc::new(ForwardingTable::compile(&m, 2))).unwrap();
        let (browser, plain) = (asks("127.79.3.1:42002"), asks("127.79.3.1:42000"));
        dp.shutdown().unwrap();
        assert_eq!((before, browser, plain), (vec![false, false], vec![true, true], vec![false, false]));
    }
}
