//! AF_XDP I/O: the kernel-bypass driver of the per-packet [`Engine`](crate::engine::Engine).
//!
//! An XDP program (mediaplane-ebpf's `xsk_redirect`) hands the datagrams sent to the SFU's
//! addresses to one AF_XDP socket per interface queue ([`XskPortSpec`]); one thread here reads
//! them from the sockets' rings, has the engine (the same one, under the same lock, as the socket
//! workers of the plane it belongs to) decide each batch, builds every copy's Ethernet, IP and UDP
//! headers into a frame of its egress port's UMEM and puts it on that port's TX ring: no system
//! call per packet, one wake-up per batch and port.
//!
//! The socket plane stays underneath: what the XDP program passes to the host stack (fragments,
//! frames too large for a UMEM frame, sources whose reverse path is not the ingress interface) is
//! judged by the stack and delivered to the plane's socket on that address; copies this thread
//! cannot frame (no valid neighbour yet, a local destination, larger than the egress MTU, a full
//! ring) leave by that socket, where the kernel resolves, routes and fragments as it does for the
//! socket plane. The same counters count both paths.
//!
//! Library: `xdpilone` (pure Rust rings over libc, no libbpf or libxdp): the XDP program and its
//! maps are mediaplane's own and loaded with libbpf-rs by the eBPF crate, so only the rings are
//! needed here, and xdpilone is those rings and nothing else.

use crate::engine::{Datagram, Now, Output};
use crate::netlink::{NextHopLookup, RouteWatch};
use crate::reassembly::{parse_fragment, whole_datagram, Reassembler};
use crate::userspace::{sealed, Shared, SrtpCrypto};
use crate::{DataplaneError, HeaderPolicy};
use mediaplane_core::packet::{frame_len, parse_frame, udp_checksum_partial, verify_checksums, write_frame, FrameSpec, UdpFrame, UDP_HLEN};
use mediaplane_core::pipeline::CopyOf;
use mediaplane_core::table::DropReason;
use socket2::SockAddr;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use xdpilone::xdp::XdpDesc;
use xdpilone::{DeviceQueue, IfInfo, RingRx, RingTx, Socket, SocketConfig, Umem, UmemConfig, User};

/// Bytes per UMEM frame: one Ethernet frame of a 1500-byte MTU with room to spare. Larger frames
/// take the socket path (the XDP program passes them to the stack).
pub const FRAME_SIZE: u32 = 2048;
/// Frames per port by default (8 MiB): half are the receive fill, half carry copies out.
pub const DEFAULT_FRAMES: u32 = 4096;
/// Descriptors read from one port before looking at the others.
const BATCH: u32 = 64;
/// sockaddr_xdp flags (linux/if_xdp.h): wake-ups only when the kernel asks; frames larger than
/// one UMEM frame arrive in several (descriptors with XDP_PKT_CONTD).
const XDP_COPY: u16 = 1 << 1;
const XDP_ZEROCOPY: u16 = 1 << 2;
const XDP_USE_NEED_WAKEUP: u16 = 1 << 3;
const XDP_USE_SG: u16 = 1 << 4;
/// getsockopt(SOL_XDP, XDP_OPTIONS): struct xdp_options { u32 flags }, XDP_OPTIONS_ZEROCOPY.
const SOL_XDP: libc::c_int = 283;
const XDP_OPTIONS: libc::c_int = 8;
const XDP_OPTIONS_ZEROCOPY: u32 = 1;
const XDP_PKT_CONTD: u32 = 1;
/// A destination whose neighbour is not resolved is asked for again after this long (its copies
/// take the socket path meanwhile, which has the kernel resolve it).
const UNRESOLVED_RETRY_NS: u64 = 50_000_000;

/// One interface queue to receive on and send from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XskPortSpec {
    pub ifname: String,
    pub ifindex: u32,
    pub queue: u32,
    /// The interface's own MAC: the source of the frames it sends.
    pub mac: [u8; 6],
}

/// Puts a bound socket's fd in the XDP program's XSKMAP for its (interface, queue).
pub type RegisterXsk = Arc<dyn Fn(&XskPortSpec, RawFd) -> Result<(), DataplaneError> + Send + Sync>;

/// Told which SFU addresses came (their socket is open) and went, so that the XDP program
/// hands over exactly the datagrams to the plane's addresses. Best effort: what it does not hand
/// over reaches the address's socket.
pub type SyncAddresses = Arc<dyn Fn(&[SocketAddr], &[SocketAddr]) + Send + Sync>;

/// How the sockets bind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BindMode {
    /// Zero-copy where the driver supports it, copy mode otherwise.
    #[default]
    Auto,
    Copy,
    /// Zero-copy or a start-up error.
    ZeroCopy,
}

/// The AF_XDP driver's configuration (see [`crate::UserspaceConfig::xsk`]).
#[derive(Clone)]
pub struct XskConfig {
    pub ports: Vec<XskPortSpec>,
    pub register: RegisterXsk,
    pub addresses: SyncAddresses,
    pub mode: BindMode,
    /// UMEM frames per port (a power of two, 64 to 65,536; [`DEFAULT_FRAMES`]): each is
    /// [`FRAME_SIZE`] of locked memory.
    pub frames: u32,
}

impl std::fmt::Debug for XskConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XskConfig").field("ports", &self.ports).finish_non_exhaustive()
    }
}

/// What the AF_XDP thread did, for `DataplaneStats::extra` (`afxdp_*`).
#[derive(Debug, Default)]
pub struct XskStats {
    pub rx_frames: AtomicU64,
    /// Copies put on a TX ring.
    pub tx_frames: AtomicU64,
    /// Copies sent by the socket instead (see the module documentation), by why.
    pub tx_socket_no_neighbour: AtomicU64,
    pub tx_socket_too_big: AtomicU64,
    pub tx_socket_ring_full: AtomicU64,
    pub tx_socket_errors: AtomicU64,
    /// Frames whose IPv4 header or UDP checksum is wrong (also `drop_bad_checksum`).
    pub rx_bad_checksum: AtomicU64,
    /// Datagrams whose source fails the ingress interface's reverse-path check (also
    /// `drop_spoofed`), and the kernel lookups made to know (once per source and routing change).
    pub rx_spoofed: AtomicU64,
    pub source_lookups: AtomicU64,
    /// Frames accepted with a local sender's unfinished UDP checksum (see `checksums_ok`).
    pub rx_checksum_partial: AtomicU64,
    /// Route or neighbour lookups (once per destination and routing change).
    pub next_hop_lookups: AtomicU64,
    /// Queues whose socket is bound in zero-copy mode (the rest: copy mode).
    pub zero_copy_queues: AtomicU64,
    /// 1 once the AF_XDP thread failed (the plane then runs on its sockets).
    pub thread_failed: Arc<AtomicU64>,
    /// IP fragments received, and the datagrams reassembled from them.
    pub rx_fragments: AtomicU64,
    pub rx_reassembled: AtomicU64,
    /// Frames larger than one UMEM frame, gathered from several descriptors.
    pub rx_gathered: AtomicU64,
    /// Fragments that made no datagram (see [`crate::reassembly`]), and reassembled datagrams
    /// whose UDP header or checksum is wrong.
    pub reassembly_timeouts: AtomicU64,
    pub reassembly_dropped: AtomicU64,
}

impl XskStats {
    pub fn fields(&self) -> [(&'static str, u64); 18] {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("afxdp_rx_frames", g(&self.rx_frames)),
            ("afxdp_tx_frames", g(&self.tx_frames)),
            ("afxdp_tx_socket_no_neighbour", g(&self.tx_socket_no_neighbour)),
            ("afxdp_tx_socket_too_big", g(&self.tx_socket_too_big)),
            ("afxdp_tx_socket_ring_full", g(&self.tx_socket_ring_full)),
            ("afxdp_tx_socket_errors", g(&self.tx_socket_errors)),
            ("afxdp_rx_bad_checksum", g(&self.rx_bad_checksum)),
            ("afxdp_rx_spoofed", g(&self.rx_spoofed)),
            ("afxdp_source_lookups", g(&self.source_lookups)),
            ("afxdp_rx_checksum_partial", g(&self.rx_checksum_partial)),
            ("afxdp_next_hop_lookups", g(&self.next_hop_lookups)),
            ("afxdp_zero_copy_queues", g(&self.zero_copy_queues)),
            ("afxdp_thread_failed", g(&self.thread_failed)),
            ("afxdp_rx_fragments", g(&self.rx_fragments)),
            ("afxdp_rx_reassembled", g(&self.rx_reassembled)),
            ("afxdp_rx_gathered", g(&self.rx_gathered)),
            ("afxdp_reassembly_timeouts", g(&self.reassembly_timeouts)),
            ("afxdp_reassembly_dropped", g(&self.reassembly_dropped)),
        ]
    }
}

/// An anonymous, page-aligned mapping: a port's UMEM.
struct Area {
    ptr: NonNull<u8>,
    len: usize,
}

impl Area {
    fn new(len: usize) -> std::io::Result<Area> {
        // SAFETY: a fresh anonymous private mapping; checked for failure.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Area { ptr: NonNull::new(p.cast()).expect("mmap returned null"), len })
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        // SAFETY: our own mapping; the rings and sockets using it are dropped before (field order
        // of Port).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// One bound AF_XDP socket and its UMEM. Field order is drop order: rings, then the socket,
/// then the memory they point into.
struct Port {
    rx: RingRx,
    tx: RingTx,
    fq_cq: DeviceQueue,
    _user: User,
    _sock: Socket,
    _umem: Umem,
    area: Area,
    spec: XskPortSpec,
    /// Frame addresses free to carry a copy.
    free_tx: Vec<u64>,
    /// Copies on the TX ring not yet handed to the kernel with a wake-up.
    unsent: bool,
    /// A frame larger than one UMEM frame, gathered from its descriptors so far.
    gathering: Option<Vec<u8>>,
    /// Received frames to give back to the fill ring (it may show less room than the kernel
    /// took: its consumer index is published lazily).
    to_fill: Vec<u64>,
    /// Bound in zero-copy mode (the driver's own rings), not copy mode.
    zero_copy: bool,
    mtu: usize,
}

fn errno(context: &str, e: xdpilone::Errno) -> DataplaneError {
    DataplaneError::Io { context: context.into(), source: std::io::Error::from_raw_os_error(e.get_raw()) }
}

/// Whether a bound AF_XDP socket runs in zero-copy mode.
fn zero_copy(fd: RawFd) -> bool {
    let mut flags: u32 = 0;
    let mut len = std::mem::size_of::<u32>() as libc::socklen_t;
    // SAFETY: a u32 out-parameter of its size (struct xdp_options).
    let r = unsafe { libc::getsockopt(fd, SOL_XDP, XDP_OPTIONS, (&mut flags as *mut u32).cast(), &mut len) };
    r == 0 && flags & XDP_OPTIONS_ZEROCOPY != 0
}

fn mtu_of(ifname: &str) -> usize {
    crate::sys::if_mtu(ifname).map_or(1500, |m| m as usize)
}

impl Port {
    fn open(spec: &XskPortSpec, register: &RegisterXsk, mode: BindMode, frames: u32) -> Result<Port, DataplaneError> {
        if !frames.is_power_of_two() || !(64..=65_536).contains(&frames) {
            return Err(DataplaneError::Other(format!("AF_XDP frames per queue must be a power of two from 64 to 65536, not {frames}")));
        }
        let ring = frames / 2;
        let ctx = |what: &str| format!("AF_XDP {what} on {} queue {}", spec.ifname, spec.queue);
        let area = Area::new((frames * FRAME_SIZE) as usize).map_err(|source| DataplaneError::Io { context: ctx("UMEM"), source })?;
        let slice = NonNull::slice_from_raw_parts(area.ptr, area.len);
        let cfg = UmemConfig { fill_size: ring, complete_size: ring, frame_size: FRAME_SIZE, headroom: 0, flags: 0 };
        // SAFETY: the area is page aligned, frames * FRAME_SIZE long, and outlives the UMEM (Port's
        // field order).
        let umem = unsafe { Umem::new(cfg, slice) }.map_err(|e| match e.get_raw() {
            libc::ENOBUFS | libc::EPERM | libc::ENOMEM => errno(
                &ctx(&format!(
                    "UMEM registration ({} MiB per queue counts against the locked-memory limit, RLIMIT_MEMLOCK: raise it, e.g. LimitMEMLOCK=infinity in the systemd unit or ulimit -l)",
                    (frames * FRAME_SIZE) >> 20
                )),
                e,
            ),
            _ => errno(&ctx("UMEM registration"), e),
        })?;
        let mut info = IfInfo::invalid();
        info.from_ifindex(spec.ifindex).map_err(|e| errno(&ctx("interface"), e))?;
        info.set_queue(spec.queue);
        let sock = Socket::with_shared(&info, &umem).map_err(|e| errno(&ctx("socket"), e))?;
        let mut fq_cq = umem.fq_cq(&sock).map_err(|e| errno(&ctx("fill/completion rings"), e))?;
        let mode_flag = match mode {
            BindMode::Auto => 0,
            BindMode::Copy => XDP_COPY,
            BindMode::ZeroCopy => XDP_ZEROCOPY,
        };
        let sc = SocketConfig { rx_size: NonZeroU32::new(ring), tx_size: NonZeroU32::new(ring), bind_flags: XDP_USE_NEED_WAKEUP | XDP_USE_SG | mode_flag };
        let user = umem.rx_tx(&sock, &sc).map_err(|e| errno(&ctx("rx/tx rings"), e))?;
        let rx = user.map_rx().map_err(|e| errno(&ctx("rx ring"), e))?;
        let tx = user.map_tx().map_err(|e| errno(&ctx("tx ring"), e))?;
        umem.bind(&user).map_err(|e| match mode {
            BindMode::ZeroCopy => errno(&ctx("zero-copy bind (the driver cannot: set dataplane.afxdp_mode = \"auto\" or \"copy\")"), e),
            _ => errno(&ctx("bind (does the driver support AF_XDP? the kernel needs CONFIG_XDP_SOCKETS, and another program may own the queue)"), e),
        })?;
        let zero_copy = zero_copy(rx.as_raw_fd());
        tracing::info!(ifname = spec.ifname, queue = spec.queue, zero_copy, "AF_XDP socket bound");
        {
            let mut fill = fq_cq.fill(ring);
            let n = fill.insert((0..ring).map(|i| u64::from(i * FRAME_SIZE)));
            fill.commit();
            if n != ring {
                return Err(DataplaneError::Other(format!("{}: the fill ring took {n} of {ring} frames", ctx("setup"))));
            }
        }
        register(spec, rx.as_raw_fd())?;
        let free_tx = (ring..frames).map(|i| u64::from(i * FRAME_SIZE)).collect();
        Ok(Port {
            rx,
            tx,
            fq_cq,
            _user: user,
            _sock: sock,
            _umem: umem,
            area,
            spec: spec.clone(),
            free_tx,
            unsent: false,
            gathering: None,
            to_fill: Vec::new(),
            zero_copy,
            mtu: mtu_of(&spec.ifname),
        })
    }

    fn frame_mut(&mut self, addr: u64) -> &mut [u8] {
        let base = (addr - addr % u64::from(FRAME_SIZE)) as usize;
        // SAFETY: addr is one of this UMEM's frame addresses (we only use those we handed out), so
        // [base, base + FRAME_SIZE) lies inside the area; a free frame is not referenced elsewhere.
        unsafe { std::slice::from_raw_parts_mut(self.area.ptr.as_ptr().add(base), FRAME_SIZE as usize) }
    }

    /// Give received frames back to the kernel to fill.
    fn refill(&mut self) {
        if self.to_fill.is_empty() {
            return;
        }
        let mut fill = self.fq_cq.fill(self.to_fill.len() as u32);
        let n = fill.insert(self.to_fill.iter().copied()) as usize;
        fill.commit();
        drop(fill);
        self.to_fill.drain(..n);
    }

    /// Take back frames the kernel has sent.
    fn reap(&mut self) {
        let mut done = self.fq_cq.complete(u32::MAX);
        while let Some(addr) = done.read() {
            self.free_tx.push(addr - addr % u64::from(FRAME_SIZE));
        }
        done.release();
    }

    /// Hand what is on the TX ring to the kernel (copy mode sends in this call).
    fn flush(&mut self) {
        if std::mem::take(&mut self.unsent) && self.tx.needs_wakeup() {
            self.tx.wake();
        }
    }
}

/// The frame's IPv4 header and UDP checksums are right, or its UDP checksum is a local sender's
/// unfinished one (see [`udp_checksum_partial`]; counted): on veth the peer's stack leaves it to
/// an offload that never happens, and the kernel, which knows (`CHECKSUM_PARTIAL`), accepts it;
/// AF_XDP does not say, so the partial value is taken as the kernel takes it. A corrupted
/// datagram then passes with twice a checksum's 1 in 65,536 chance.
fn checksums_ok(frame: &[u8], u: &UdpFrame, stats: &XskStats) -> bool {
    let report = verify_checksums(frame, u);
    if report.ok() {
        return true;
    }
    let udp_len = UDP_HLEN + u.payload_len;
    let stored = u16::from_be_bytes([frame[u.l4 + 6], frame[u.l4 + 7]]);
    let partial = report.ip_ok && stored == udp_checksum_partial(u.src.ip(), u.dst.ip(), udp_len);
    if partial {
        stats.rx_checksum_partial.fetch_add(1, Ordering::Relaxed);
    }
    partial
}

/// The host's verdict on sources, per (source, SFU address, ingress interface), asked of the
/// kernel's input route lookup ([`NextHopLookup::source_ok`]: rp_filter as the stack applies it)
/// and kept until routing or an rp_filter setting changes (the route watch's generation).
#[derive(Default)]
struct SourceCheck {
    verdicts: HashMap<(IpAddr, IpAddr, u32), bool>,
    generation: u64,
}

impl SourceCheck {
    fn admits(&mut self, lookup: &mut NextHopLookup, generation: &AtomicU64, stats: &XskStats, src: IpAddr, dst: IpAddr, iif: u32) -> bool {
        let g = generation.load(Ordering::Relaxed);
        if g != self.generation {
            self.generation = g;
            self.verdicts.clear();
        }
        if let Some(ok) = self.verdicts.get(&(src, dst, iif)) {
            return *ok;
        }
        stats.source_lookups.fetch_add(1, Ordering::Relaxed);
        match lookup.source_ok(src, dst, iif) {
            Ok(ok) => {
                // Bounded: a spoofing flood of random sources must not grow it without end.
                if self.verdicts.len() >= 65_536 {
                    self.verdicts.clear();
                }
                self.verdicts.insert((src, dst, iif), ok);
                ok
            }
            Err(e) => {
                // The question could not be asked: let it through, as the kernel path does when
                // its lookup fails (not cached: asked again).
                tracing::debug!(%src, error = %e, "reverse-path lookup");
                true
            }
        }
    }
}

/// Where copies to a destination go: out of a port to a MAC, or by the socket.
#[derive(Clone, Copy)]
struct Route {
    port: Option<(usize, [u8; 6])>,
    /// For an unresolved one: when to ask again (monotonic ns).
    retry_at: u64,
}

/// The AF_XDP thread's state.
pub(crate) struct XskWorker {
    shared: Arc<Shared>,
    ports: Vec<Port>,
    header: HeaderPolicy,
    stats: Arc<XskStats>,
    lookup: NextHopLookup,
    routes: HashMap<IpAddr, Route>,
    /// Bumped by the route watcher on every routing or neighbour change: the cache is dropped.
    generation: Arc<AtomicU64>,
    seen_generation: u64,
    /// The generation the ports' MTUs were read at.
    mtu_generation: u64,
    _watch: RouteWatch,
    wake: Arc<crate::sys::EventFd>,
    reassembly: Reassembler,
    sources: SourceCheck,
}

/// Start the AF_XDP thread; returns once its sockets are bound (or with why they could not be).
pub(crate) fn start(
    cfg: XskConfig,
    shared: Arc<Shared>,
    header: HeaderPolicy,
    stats: Arc<XskStats>,
    wake: Arc<crate::sys::EventFd>,
) -> Result<std::thread::JoinHandle<()>, DataplaneError> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let failed = stats.thread_failed.clone();
    let thread = std::thread::Builder::new()
        .name("mp-afxdp".into())
        .spawn(move || {
            // Built on this thread: the UMEM and rings are not Send.
            let worker = (|| -> Result<XskWorker, DataplaneError> {
                let ports = cfg.ports.iter().map(|p| Port::open(p, &cfg.register, cfg.mode, cfg.frames)).collect::<Result<Vec<_>, _>>()?;
                stats.zero_copy_queues.store(ports.iter().filter(|p| p.zero_copy).count() as u64, Ordering::Relaxed);
                let generation = Arc::new(AtomicU64::new(0));
                let g = generation.clone();
                let watch = RouteWatch::start(
                    Box::new(move || {
                        g.fetch_add(1, Ordering::Relaxed);
                    }),
                    None,
                )?;
                let lookup = NextHopLookup::open().map_err(|source| DataplaneError::Io { context: "rtnetlink socket".into(), source })?;
                Ok(XskWorker {
                    shared,
                    ports,
                    header,
                    stats,
                    lookup,
                    routes: HashMap::new(),
                    generation,
                    seen_generation: 0,
                    mtu_generation: 0,
                    _watch: watch,
                    wake,
                    reassembly: Reassembler::default(),
                    sources: SourceCheck::default(),
                })
            })();
            match worker {
                Ok(w) => {
                    let _ = tx.send(Ok(()));
                    // A failure of this thread must not take the media with it: its sockets close
                    // as it unwinds, which empties their XSKMAP slots, and the XDP program's
                    // redirect then passes every datagram to the stack and the plane's sockets.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.run())).is_err() {
                        failed.store(1, Ordering::Relaxed);
                        tracing::error!(
                            "the AF_XDP thread failed: the plane carries on by its sockets (the socket plane's costs); restart the daemon to use AF_XDP again"
                        );
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        })
        .map_err(|source| DataplaneError::Io { context: "spawn AF_XDP thread".into(), source })?;
    match rx.recv() {
        Ok(Ok(())) => Ok(thread),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => Err(DataplaneError::Other("the AF_XDP thread ended during setup".into())),
    }
}

impl XskWorker {
    fn run(mut self) {
        let mut fds: Vec<libc::pollfd> = self.ports.iter().map(|p| libc::pollfd { fd: p.rx.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
        fds.push(libc::pollfd { fd: self.wake.raw(), events: libc::POLLIN, revents: 0 });
        while !self.shared.stop.load(Ordering::Relaxed) {
            // SAFETY: fds is a valid array of pollfd for its length.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 200) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!(error = %e, "AF_XDP poll failed");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                continue;
            }
            if fds.last().is_some_and(|w| w.revents != 0) {
                self.wake.drain();
            }
            let g = self.generation.load(Ordering::Relaxed);
            if g != self.mtu_generation {
                // A link changed (its MTU among what netlink announces).
                self.mtu_generation = g;
                for p in &mut self.ports {
                    p.mtu = mtu_of(&p.spec.ifname);
                }
            }
            let ready: Vec<usize> = fds[..self.ports.len()].iter().enumerate().filter(|(_, f)| f.revents != 0).map(|(i, _)| i).collect();
            for i in ready {
                self.serve(i);
            }
            for p in &mut self.ports {
                p.reap();
                p.refill();
            }
        }
    }

    /// Read, decide and send what port `i` received.
    fn serve(&mut self, i: usize) {
        // Debug builds only: a deliberate failure after this many frames, so that tests can show
        // what a failure of this thread costs (MEDIAPLANE_AFXDP_FAIL_AFTER).
        #[cfg(debug_assertions)]
        {
            static FAIL_AFTER: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
            if let Some(n) = *FAIL_AFTER.get_or_init(|| std::env::var("MEDIAPLANE_AFXDP_FAIL_AFTER").ok().and_then(|v| v.parse().ok())) {
                assert!(self.stats.rx_frames.load(Ordering::Relaxed) < n, "MEDIAPLANE_AFXDP_FAIL_AFTER={n}: a deliberate failure");
            }
        }
        loop {
            let mut descs: Vec<XdpDesc> = Vec::with_capacity(BATCH as usize);
            {
                let mut rx = self.ports[i].rx.receive(BATCH);
                while let Some(d) = rx.read() {
                    descs.push(d);
                }
                rx.release();
            }
            if descs.is_empty() {
                return;
            }
            self.stats.rx_frames.fetch_add(descs.len() as u64, Ordering::Relaxed);
            // Frames in arrival order: in their UMEM frame, or gathered from several.
            let mut frames: Vec<Received> = Vec::with_capacity(descs.len());
            let mut gathered: Vec<Vec<u8>> = Vec::new();
            for d in &descs {
                let port = &mut self.ports[i];
                let more = d.options & XDP_PKT_CONTD != 0;
                if port.gathering.is_none() && !more {
                    frames.push(Received::InUmem(*d));
                    continue;
                }
                let buf = port.gathering.get_or_insert_with(Vec::new);
                // SAFETY: as in `frame_bytes`.
                buf.extend_from_slice(unsafe { std::slice::from_raw_parts(port.area.ptr.as_ptr().add(d.addr as usize), d.len as usize) });
                if !more {
                    self.stats.rx_gathered.fetch_add(1, Ordering::Relaxed);
                    frames.push(Received::Gathered(gathered.len()));
                    gathered.push(port.gathering.take().expect("gathering"));
                }
            }
            self.forward(i, &frames, &gathered);
            let port = &mut self.ports[i];
            port.to_fill.extend(descs.iter().map(|d| d.addr - d.addr % u64::from(FRAME_SIZE)));
            port.refill();
            for p in &mut self.ports {
                p.flush();
            }
            if descs.len() < BATCH as usize {
                return;
            }
        }
    }

    /// Decide one batch of frames of port `i` and send its copies.
    fn forward(&mut self, i: usize, frames: &[Received], gathered: &[Vec<u8>]) {
        let now = Now::read();
        let base = self.ports[i].area.ptr.as_ptr();
        let bytes = |r: &Received| -> &[u8] {
            match r {
                // SAFETY: the kernel hands out descriptors inside our UMEM; these frames are ours
                // until they go back on the fill ring after this call, and no copy is written
                // into them (copies go into free TX frames).
                Received::InUmem(d) => unsafe { std::slice::from_raw_parts(base.add(d.addr as usize), d.len as usize) },
                Received::Gathered(g) => &gathered[*g],
            }
        };
        // First what each frame is (reassembly keeps what it completes), then the datagrams.
        let mut whole: Vec<Vec<u8>> = Vec::new();
        let mut items: Vec<Item> = Vec::with_capacity(frames.len());
        let mut bad_checksums = 0;
        for (n, r) in frames.iter().enumerate() {
            let f = bytes(r);
            match parse_frame(f) {
                Ok(u) if checksums_ok(f, &u, &self.stats) => items.push(Item::Frame(n, u.src, u.dst, u.payload..u.payload + u.payload_len)),
                Ok(_) => bad_checksums += 1,
                Err(mediaplane_core::packet::FrameError::Fragment) => {
                    self.stats.rx_fragments.fetch_add(1, Ordering::Relaxed);
                    let Some(frag) = parse_fragment(f) else {
                        items.push(Item::Malformed(n));
                        continue;
                    };
                    let before = self.reassembly.drops;
                    let done = self.reassembly.offer(frag.key, frag.offset, frag.more, frag.data, now.mono_ns);
                    let after = self.reassembly.drops;
                    self.stats.reassembly_timeouts.fetch_add(after.timeouts - before.timeouts, Ordering::Relaxed);
                    let dropped = (after.overlaps + after.too_big + after.over_budget) - (before.overlaps + before.too_big + before.over_budget);
                    self.stats.reassembly_dropped.fetch_add(dropped, Ordering::Relaxed);
                    let Some(udp) = done else { continue };
                    match whole_datagram(frag.key, &udp) {
                        Some((src, dst)) => {
                            self.stats.rx_reassembled.fetch_add(1, Ordering::Relaxed);
                            items.push(Item::Whole(whole.len(), src, dst));
                            whole.push(udp);
                        }
                        None => {
                            self.stats.reassembly_dropped.fetch_add(1, Ordering::Relaxed);
                            bad_checksums += 1;
                        }
                    }
                }
                // The XDP program only hands over what parses: anything else is malformed.
                Err(_) => items.push(Item::Malformed(n)),
            }
        }
        // The reverse-path check the stack makes before a socket sees a datagram.
        let ingress = self.ports[i].spec.ifindex;
        let mut spoofed = 0;
        items.retain(|item| {
            let (src, dst) = match item {
                Item::Frame(_, src, dst, _) | Item::Whole(_, src, dst) => (src.ip(), dst.ip()),
                Item::Malformed(_) => return true,
            };
            let ok = self.sources.admits(&mut self.lookup, &self.generation, &self.stats, src, dst, ingress);
            spoofed += u64::from(!ok);
            ok
        });
        self.stats.rx_spoofed.fetch_add(spoofed, Ordering::Relaxed);
        let dgrams = items.iter().map(|item| match item {
            Item::Frame(n, src, dst, range) => {
                Datagram { local: Some(*dst), src: Some(*src), truncated: false, payload: &bytes(&frames[*n])[range.clone()], arrived_ns: None }
            }
            Item::Whole(w, src, dst) => Datagram { local: Some(*dst), src: Some(*src), truncated: false, payload: &whole[*w][UDP_HLEN..], arrived_ns: None },
            Item::Malformed(n) => Datagram { local: None, src: None, truncated: true, payload: bytes(&frames[*n]), arrived_ns: None },
        });
        let mut outputs: Vec<Output<'_>> = Vec::new();
        let state = {
            let mut engine = self.shared.engine.lock();
            let state = self.shared.state.load_full();
            engine.count_driver_drops(DropReason::BadChecksum, bad_checksums);
            engine.count_driver_drops(DropReason::Spoofed, spoofed);
            engine.handle_batch(now, &state.table, &mut SrtpCrypto(&state.srtp), dgrams, &mut outputs);
            if let Some(due) = engine.poll_timeout() {
                self.shared.timer_due.fetch_min(due, Ordering::Relaxed);
            }
            state
        };
        self.stats.rx_bad_checksum.fetch_add(bad_checksums, Ordering::Relaxed);
        let mut sent: Vec<(Option<CopyOf>, usize, bool)> = Vec::with_capacity(outputs.len());
        for o in outputs {
            match o {
                Output::Transmit { from, to, packet, copy, seal } => {
                    let Some(packet) = sealed(&state, from, packet, seal) else {
                        sent.extend(copy.map(|c| (Some(c), 0, false)));
                        continue;
                    };
                    let ok = self.transmit(&state, from, to, &packet, now.mono_ns);
                    sent.push((copy, packet.len(), ok));
                }
                Output::Event(ev) => self.shared.report(ev),
                Output::Record { stream, label, src, local, packet } => crate::record::tap(stream, &label, src, local, &packet),
            }
        }
        if !sent.is_empty() {
            let mut engine = self.shared.engine.lock();
            for (copy, bytes, ok) in sent {
                engine.on_transmitted(copy, bytes, ok, now.mono_ns);
            }
        }
    }

    /// One copy: onto its egress port's TX ring, or by the socket bound to `from`.
    fn transmit(&mut self, state: &crate::userspace::State, from: SocketAddr, to: SocketAddr, payload: &[u8], now_ns: u64) -> bool {
        let why = match self.onto_ring(from, to, payload, now_ns) {
            Ok(()) => {
                self.stats.tx_frames.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            Err(why) => why,
        };
        why.fetch_add(1, Ordering::Relaxed);
        // What is on the rings goes first: a copy by the socket must not overtake the copies
        // before it (copy mode sends in the wake-up call, the socket in sendto).
        for p in &mut self.ports {
            p.flush();
        }
        let ok = state.sockets.get(&from).is_some_and(|g| g[0].send_to(payload, &SockAddr::from(to)).is_ok());
        if !ok {
            self.stats.tx_socket_errors.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// Frame a copy into a free TX frame of its egress port and queue it; Err: the counter of
    /// why it must go by the socket instead.
    fn onto_ring(&mut self, from: SocketAddr, to: SocketAddr, payload: &[u8], now_ns: u64) -> Result<(), &AtomicU64> {
        let stats = &*self.stats;
        if from.is_ipv4() != to.is_ipv4() {
            return Err(&stats.tx_socket_errors);
        }
        let Some((pi, mac)) = route(&mut self.routes, &mut self.lookup, &self.ports, &self.generation, &mut self.seen_generation, stats, to.ip(), now_ns)
        else {
            return Err(&stats.tx_socket_no_neighbour);
        };
        let port = &mut self.ports[pi];
        let mut spec = FrameSpec::new(from, to);
        spec.dst_mac = mac;
        spec.src_mac = port.spec.mac;
        spec.ttl = if to.is_ipv4() { self.header.ttl } else { self.header.hop_limit };
        spec.tos = self.header.tos();
        spec.ident = crate::userspace::next_ip_id();
        let len = frame_len(&spec, payload.len());
        if len > FRAME_SIZE as usize || len > port.mtu + mediaplane_core::packet::ETH_HLEN {
            return Err(&stats.tx_socket_too_big);
        }
        if port.free_tx.is_empty() {
            port.reap();
        }
        let Some(addr) = port.free_tx.pop() else { return Err(&stats.tx_socket_ring_full) };
        let written = write_frame(&spec, payload, port.frame_mut(addr)).expect("checked against FRAME_SIZE");
        let queued = {
            let mut w = port.tx.transmit(1);
            let n = w.insert(std::iter::once(XdpDesc { addr, len: written as u32, options: 0 }));
            w.commit();
            n == 1
        };
        if !queued {
            port.free_tx.push(addr);
            return Err(&stats.tx_socket_ring_full);
        }
        port.unsent = true;
        Ok(())
    }
}

/// The port and MAC of `dst`'s next hop, when it leaves by one of our ports with a valid
/// neighbour (cached per destination until routing changes; an unresolved one is asked again
/// after [`UNRESOLVED_RETRY_NS`]).
#[allow(clippy::too_many_arguments)]
fn route(
    routes: &mut HashMap<IpAddr, Route>,
    lookup: &mut NextHopLookup,
    ports: &[Port],
    generation: &AtomicU64,
    seen_generation: &mut u64,
    stats: &XskStats,
    dst: IpAddr,
    now_ns: u64,
) -> Option<(usize, [u8; 6])> {
    let g = generation.load(Ordering::Relaxed);
    if g != *seen_generation {
        *seen_generation = g;
        routes.clear();
    }
    if let Some(r) = routes.get(&dst) {
        if r.port.is_some() || now_ns < r.retry_at {
            return r.port;
        }
    }
    stats.next_hop_lookups.fetch_add(1, Ordering::Relaxed);
    let port = match lookup.lookup(dst) {
        Ok(Some(hop)) => ports.iter().position(|p| p.spec.ifindex == hop.ifindex).map(|i| (i, hop.mac)),
        Ok(None) => None,
        Err(e) => {
            tracing::debug!(%dst, error = %e, "next-hop lookup");
            None
        }
    };
    routes.insert(dst, Route { port, retry_at: now_ns + UNRESOLVED_RETRY_NS });
    port
}

/// A received frame: in its UMEM frame, or gathered from several (an index into the batch's).
enum Received {
    InUmem(XdpDesc),
    Gathered(usize),
}

/// What one frame of a batch turned out to be.
enum Item {
    /// A datagram: frame index, source, destination, its payload's range in the frame.
    Frame(usize, SocketAddr, SocketAddr, std::ops::Range<usize>),
    /// A reassembled datagram: index of its UDP header + payload, source, destination.
    Whole(usize, SocketAddr, SocketAddr),
    Malformed(usize),
}
