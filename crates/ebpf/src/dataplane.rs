//! [`EbpfDataplane`]: the TC fast path plus the user-space data plane as its slow path.

use crate::attach::{self, AttachMode, Attachment};
use crate::loader::{FastPath, LoadOptions};
use crate::maps::{config_flags, FastConfigRaw, RpfMode};
use crate::pinlock::{PinDirLock, PinLockError};
use crate::prefilter::Prefilter;
use mediaplane_core::reception::ReceptionReport;
use mediaplane_core::{ForwardingTable, IngressKey};
use mediaplane_dataplane::{Dataplane, DataplaneError, DataplaneEvent, DataplaneStats, UserspaceConfig, UserspaceDataplane};
use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

#[derive(Debug, Clone)]
pub struct EbpfConfig {
    /// Interfaces whose TC ingress gets the program (where media arrives).
    pub interfaces: Vec<String>,
    /// Per-instance directory on a bpffs (e.g. `/sys/fs/bpf/mediaplane-<instance>`): pinned maps
    /// and links live there, so a restarted process adopts them without losing a packet.
    pub pin_dir: PathBuf,
    /// The slow path.
    pub userspace: UserspaceConfig,
    /// Remove stale pins (and our clsact filters) of a previous instance instead of adopting.
    pub reset: bool,
    /// Start even when a live instance holds `pin_dir` (see [`crate::pinlock`]), sharing its
    /// maps and links. Dangerous: two daemons then write the same maps, each undoing the other's
    /// tables, and either one's graceful shutdown detaches both. Without it, a live holder is a
    /// start-up error; a dead instance's pins are adopted either way.
    pub adopt_live_pins: bool,
    pub attach: AttachMode,
    pub max_streams: u32,
    pub max_copies: u32,
    /// Steer slow-path packets to a few catch-all sockets (sk_lookup) instead of binding one
    /// socket per SFU address: sessions then cost no file descriptors (see [`crate::steer`]).
    pub steer_slow_path: bool,
    /// Where the XDP pre-filter (certain strangers dropped before TC) goes.
    pub xdp_prefilter: XdpPrefilter,
    /// Verify checksums the device did not (bad ones: `drop_bad_checksum`).
    pub verify_checksums: bool,
    /// Reverse-path check of IPv6 sources (IPv4 follows the interfaces' rp_filter).
    pub rpf_v6: RpfMode,
    /// Keep a stream in the slow path while packets it handed up there are not sent yet, so no
    /// packet overtakes another (off only for A/B measurements).
    pub hold_order: bool,
}

impl EbpfConfig {
    pub fn new(interfaces: Vec<String>, pin_dir: impl Into<PathBuf>) -> Self {
        let d = LoadOptions::default();
        EbpfConfig {
            interfaces,
            pin_dir: pin_dir.into(),
            userspace: UserspaceConfig::default(),
            reset: false,
            adopt_live_pins: false,
            attach: AttachMode::Auto,
            max_streams: d.max_streams,
            max_copies: d.max_copies,
            steer_slow_path: true,
            xdp_prefilter: XdpPrefilter::Auto,
            verify_checksums: true,
            rpf_v6: RpfMode::Off,
            hold_order: true,
        }
    }
}

/// Where the XDP pre-filter goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpPrefilter {
    /// On every interface whose driver is not veth. An XDP program on a veth makes it copy every
    /// packet it passes into a page of its own first: measured on this path, +0.4 µs of added
    /// delay per packet at the median and up to +4 µs (BENCHMARKS.md), paid by all media to save
    /// work only under a stranger flood. A NIC with native XDP runs it before any skb exists, at
    /// no such cost.
    Auto,
    On,
    Off,
}

impl XdpPrefilter {
    /// Does `ifname` get the pre-filter?
    pub fn wants(self, ifname: &str) -> bool {
        match self {
            XdpPrefilter::On => true,
            XdpPrefilter::Off => false,
            XdpPrefilter::Auto => attach::driver_of(ifname).is_none_or(|d| d != "veth"),
        }
    }
}

/// The kernel fast path (TC eBPF) with the user-space data plane as slow path.
///
/// Both get every table; packets the kernel passes up (`TC_ACT_OK`: STUN, unlatched sources,
/// unresolved neighbours, what it cannot parse) reach the user-space plane's sockets. Stats are
/// merged: the kernel counts only what it decided, the slow path what it received, so every
/// packet is counted once. In front of TC, the XDP pre-filter ([`Prefilter`], where
/// [`XdpPrefilter`] puts it) drops certain strangers; its drops are in the totals too, with the
/// breakdown in `extra["xdp_drop_stranger"]` and `extra["xdp_drop_no_stream"]`.
///
/// The per-source limit ([`ForwardingTable::source_limit`]) has a bucket per source in the
/// kernel, charged by the TC program for what it judges (forwarded, STUN, first packets), and
/// one in the slow path for what reaches user space: a packet the kernel admitted and passed up
/// (STUN, unlatched) is charged in both, so the slow path never admits more than the kernel
/// already did; what the kernel cannot judge (fragments, unresolved neighbours) is limited by
/// the slow path's bucket alone.
///
/// Dropping it without [`Dataplane::shutdown`] leaves the kernel path forwarding from its pins
/// (that is what makes `kill -9` + restart hitless); `shutdown()` detaches and unpins. While it
/// lives it holds the pin dir's lock ([`crate::pinlock`]): no second instance starts over it.
pub struct EbpfDataplane {
    /// Shared with the slow path, which reaches the kernel's simulcast states through it.
    fast: Arc<FastPath>,
    prefilter: Option<Prefilter>,
    slow: UserspaceDataplane,
    attachments: Mutex<Vec<Attachment>>,
    pin_dir: PathBuf,
    /// Bumps the next-hop cache generation on every route/neighbour/link change.
    _nh_watch: Option<crate::nhwatch::NextHopWatch>,
    /// Resolves new copies' next hops when they are installed.
    resolver: Option<mediaplane_dataplane::netlink::NeighbourResolver>,
    /// Slow-path steering (sk_lookup), detached when dropped.
    steering: Mutex<Option<crate::steer::SlowPathSteering>>,
    /// Holding this fd keeps the kernel's BPF run-time accounting on (BPF_ENABLE_STATS): it is
    /// how cost per copy is measured. Closing it (drop) turns accounting back off.
    _run_stats: Option<std::os::fd::OwnedFd>,
    /// Exclusive use of `pin_dir` while this process lives (`None` only under `adopt_live_pins`
    /// with a live holder).
    _lock: Option<PinDirLock>,
}

/// What the eBPF plane needs, and why (`crates/mediaplane/tests/capabilities.rs` runs it as an
/// unprivileged user with exactly these, and with each one missing):
/// CAP_BPF: maps and programs (`bpf()`); CAP_PERFMON: the verifier accepts the program's
/// pointer arithmetic and packet access only with it; CAP_NET_ADMIN: loading a TC/XDP program,
/// attaching TC (tcx), XDP and sk_lookup, netlink route/neighbour requests; CAP_NET_RAW: the
/// slow path's raw sockets. CAP_SYS_ADMIN is not needed: only for mounting a missing bpffs on
/// /sys/fs/bpf (systemd mounts it at boot) and for BPF run-time statistics (cost per copy in the
/// benchmarks), which are then reported as unavailable.
pub const REQUIRED_CAPS: [(&str, u32); 4] = [("CAP_BPF", 39), ("CAP_NET_ADMIN", 12), ("CAP_PERFMON", 38), ("CAP_NET_RAW", 13)];

/// Which of [`REQUIRED_CAPS`] this process lacks in its effective set.
pub fn missing_capabilities() -> Vec<&'static str> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|v| u64::from_str_radix(v.trim(), 16).ok()).unwrap_or(0);
    REQUIRED_CAPS.iter().filter(|(_, bit)| eff & (1 << bit) == 0).map(|(n, _)| *n).collect()
}

/// IFF_LOOPBACK in the interface's flags.
fn is_loopback(ifname: &str) -> bool {
    std::fs::read_to_string(format!("/sys/class/net/{ifname}/flags"))
        .ok()
        .and_then(|f| u32::from_str_radix(f.trim().trim_start_matches("0x"), 16).ok())
        .is_some_and(|f| f & libc::IFF_LOOPBACK as u32 != 0)
}

/// Mount a bpffs on /sys/fs/bpf when none is mounted there, as systemd does at boot and as the
/// daemon does for a pin directory under it. For whoever prepares a pin directory for a daemon
/// that may lack CAP_SYS_ADMIN (the systemd unit's `ExecStartPre=`, tests that run it so): on a
/// fresh machine without systemd nothing else has mounted it.
pub fn mount_bpffs_if_missing() -> Result<(), DataplaneError> {
    ensure_bpffs(Path::new("/sys/fs/bpf"))
}

/// Mount a bpffs at the standard place when nothing is mounted there (as systemd would).
fn ensure_bpffs(parent: &Path) -> Result<(), DataplaneError> {
    if is_on_bpffs(parent) || parent != Path::new("/sys/fs/bpf") || !parent.is_dir() {
        return Ok(());
    }
    let (src, target, fstype) = (c"bpf", c"/sys/fs/bpf", c"bpf");
    // SAFETY: static NUL-terminated strings; no data argument.
    let r = unsafe { libc::mount(src.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if r != 0 {
        return Err(DataplaneError::Io {
            context: "mounting a bpffs on /sys/fs/bpf (CAP_SYS_ADMIN; systemd mounts it at boot)".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    tracing::info!("mounted a bpffs on /sys/fs/bpf");
    Ok(())
}

fn enable_run_stats() -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain syscall wrapper; a non-negative return is an fd we now own.
    let fd = unsafe { libbpf_rs::libbpf_sys::bpf_enable_stats(libbpf_rs::libbpf_sys::BPF_STATS_RUN_TIME) };
    if fd < 0 {
        tracing::warn!("BPF run-time statistics unavailable (errno {}; BPF_ENABLE_STATS needs CAP_SYS_ADMIN): cost per copy will not be reported", -fd);
        return None;
    }
    Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

fn other(msg: impl Into<String>) -> DataplaneError {
    DataplaneError::Other(msg.into())
}

fn is_on_bpffs(dir: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: statfs on a valid path into a zeroed struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == BPF_FS_MAGIC }
}

/// Remove a pin dir left by a dead instance: unpinning its links detaches them.
pub fn remove_pins(pin_dir: &Path) -> Result<(), DataplaneError> {
    if !pin_dir.exists() {
        return Ok(());
    }
    remove_pin_files(pin_dir)?;
    std::fs::remove_dir(pin_dir).map_err(|source| DataplaneError::Io { context: format!("removing {}", pin_dir.display()), source })
}

/// Remove every pin in `pin_dir`, keeping the directory (and so our lock on it).
fn remove_pin_files(pin_dir: &Path) -> Result<(), DataplaneError> {
    let io = |context: String| move |source| DataplaneError::Io { context, source };
    for entry in std::fs::read_dir(pin_dir).map_err(io(format!("reading {}", pin_dir.display())))? {
        let p = entry.map_err(io(format!("reading {}", pin_dir.display())))?.path();
        std::fs::remove_file(&p).map_err(io(format!("removing pin {}", p.display())))?;
    }
    Ok(())
}

/// Take `pin_dir` for this process: a live holder is an error unless `adopt_live` says to share.
fn lock_pin_dir(pin_dir: &Path, adopt_live: bool) -> Result<Option<PinDirLock>, DataplaneError> {
    match PinDirLock::acquire(pin_dir) {
        Ok(lock) => Ok(Some(lock)),
        Err(PinLockError::Held { dir, holder }) if adopt_live => {
            tracing::warn!(
                pin_dir = %dir.display(),
                holder,
                "--adopt-live-pins: sharing the pins of a LIVE instance; both daemons now write the same maps"
            );
            Ok(None)
        }
        Err(e @ PinLockError::Held { .. }) => Err(other(e.to_string())),
        Err(PinLockError::Io { dir, source }) => Err(DataplaneError::Io { context: format!("locking pin dir {}", dir.display()), source }),
    }
}

impl EbpfDataplane {
    pub fn new(cfg: EbpfConfig, events: Option<SyncSender<DataplaneEvent>>) -> Result<Self, DataplaneError> {
        // Said, not enforced: the kernel's refusal follows (and a kernel that needs less, or a
        // capability granted some other way, is not second-guessed).
        let missing = missing_capabilities();
        if !missing.is_empty() {
            tracing::warn!(
                missing = %missing.join(","),
                "the ebpf data plane needs {}: expect the kernel to refuse (or use the userspace data plane)",
                REQUIRED_CAPS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            );
        }
        if cfg.interfaces.is_empty() {
            return Err(other("the ebpf data plane needs at least one interface to attach to"));
        }
        for ifname in &cfg.interfaces {
            attach::ifindex_of(ifname)?;
            if is_loopback(ifname) {
                tracing::warn!(
                    ifname,
                    "loopback interface: the kernel path forwards nothing here (every packet goes to the slow path); \
                     it forwards between real or veth interfaces (README, \"The kernel fast path\")"
                );
            }
            let fwd = std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{ifname}/forwarding")).unwrap_or_default();
            if fwd.trim() == "0" {
                tracing::warn!(
                    ifname,
                    "IPv4 forwarding is off on this interface: bpf_fib_lookup refuses, every packet takes the slow path \
                     (sysctl net.ipv4.conf.{ifname}.forwarding=1)"
                );
            }
        }
        let parent = cfg.pin_dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        ensure_bpffs(parent)?;
        if !is_on_bpffs(parent) {
            return Err(DataplaneError::Unsupported(format!(
                "{} is not on a bpffs (mount -t bpf bpf /sys/fs/bpf): the ebpf data plane pins its state there",
                parent.display()
            )));
        }
        // Before anything touches the pins (--reset included): a live holder keeps them.
        let lock = lock_pin_dir(&cfg.pin_dir, cfg.adopt_live_pins)?;
        if cfg.reset {
            remove_pin_files(&cfg.pin_dir)?;
        }

        let fast = Arc::new(FastPath::load(&LoadOptions { max_streams: cfg.max_streams, max_copies: cfg.max_copies, pin_dir: Some(cfg.pin_dir.clone()) })?);
        if cfg.reset {
            for ifname in &cfg.interfaces {
                attach::detach_stale_clsact(&fast.program(), ifname);
            }
        }
        let xdp_ifs: Vec<&String> = cfg.interfaces.iter().filter(|i| cfg.xdp_prefilter.wants(i)).collect();
        // A previous instance's pre-filter where this one puts none, pinned: unpinning its link
        // detaches it.
        for ifname in cfg.interfaces.iter().filter(|i| !xdp_ifs.contains(i)) {
            let p = attach::xdp_link_pin_path(&cfg.pin_dir, ifname);
            if p.exists() {
                std::fs::remove_file(&p).map_err(|source| DataplaneError::Io { context: format!("removing {}", p.display()), source })?;
            }
        }
        let prefilter = if xdp_ifs.is_empty() { None } else { Some(Prefilter::load(&fast)?) };
        let mut slow_cfg = cfg.userspace.clone();
        slow_cfg.steered = cfg.steer_slow_path;
        let paths = fast.stream_paths();
        slow_cfg.mark_ack = Some(mediaplane_dataplane::MarkAck(Arc::new(move |mark| paths.ack_mark(mark))));
        slow_cfg.kernel_layers = Some(mediaplane_dataplane::kernel_layers::KernelLayersHandle(Arc::new(crate::layers::KernelStates(fast.clone()))));
        let mut flags = 0;
        if cfg.verify_checksums {
            flags |= config_flags::VERIFY_CSUM;
        }
        // The hold waits for the steered slow path's acknowledgements: without steering
        // nothing would acknowledge, and every hold would last its full timeout.
        if cfg.hold_order && cfg.steer_slow_path {
            flags |= config_flags::HOLD_ORDER;
        }
        if cfg.userspace.forwarded_qos {
            flags |= config_flags::FORWARDED_QOS;
        }
        let h = slow_cfg.header;
        fast.configure(&FastConfigRaw { flags, ttl: h.ttl, hop_limit: h.hop_limit, dscp: h.dscp, rpf_v6: cfg.rpf_v6 as u8 })?;
        let ifindexes: Vec<(String, u32)> = cfg.interfaces.iter().map(|i| attach::ifindex_of(i).map(|x| (i.clone(), x))).collect::<Result<_, _>>()?;
        let mut rpf = crate::rpf::RpfSync::new(fast.rpf_mode_map()?, &ifindexes);
        rpf.refresh()?;
        let slow = UserspaceDataplane::new(slow_cfg, events)?;
        let steering = match slow.steering_fds() {
            Some((v4, v6)) => Some(crate::steer::SlowPathSteering::attach(&fast.streams_map(), &v4, &v6).inspect_err(|_| {
                let _ = slow.shutdown();
            })?),
            None => None,
        };
        let mut attachments = Vec::new();
        let hooks = cfg.interfaces.iter().map(|i| (i, false)).chain(prefilter.iter().flat_map(|_| xdp_ifs.iter().map(|i| (*i, true))));
        for (ifname, xdp) in hooks {
            let attached = match (&prefilter, xdp) {
                (Some(pf), true) => attach::attach_xdp(&pf.program(), ifname, Some(&cfg.pin_dir)),
                _ => attach::attach_ingress(&fast.program(), ifname, cfg.attach, Some(&cfg.pin_dir)),
            };
            match attached {
                Ok(a) => attachments.push(a),
                Err(e) => {
                    for a in attachments {
                        let _ = a.detach();
                    }
                    let _ = slow.shutdown();
                    return Err(e);
                }
            }
        }
        tracing::info!(?attachments, adopted = fast.adopted(), "ebpf data plane attached");
        // Without the watcher cached next hops still expire on their own (NH_CACHE_TTL_NS).
        let refresh: mediaplane_dataplane::netlink::Refresh = Box::new(move || {
            rpf.refresh().unwrap_or_else(|e| {
                tracing::warn!("updating reverse-path modes: {e}");
                false
            })
        });
        let nh_watch = match fast.next_hop_generation_map().and_then(|m| crate::nhwatch::NextHopWatch::start(m, Some(refresh))) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!("no rtnetlink watcher ({e}): cached next hops are only renewed by expiry");
                None
            }
        };
        let resolver = mediaplane_dataplane::netlink::NeighbourResolver::start()
            .inspect_err(|e| tracing::warn!("no next-hop resolver ({e}): new subscribers' first packets take the slow path"))
            .ok();
        Ok(EbpfDataplane {
            resolver,
            fast,
            prefilter,
            slow,
            attachments: Mutex::new(attachments),
            pin_dir: cfg.pin_dir,
            _nh_watch: nh_watch,
            steering: Mutex::new(steering),
            _run_stats: enable_run_stats(),
            _lock: lock,
        })
    }

    pub fn fast_path(&self) -> &FastPath {
        &self.fast
    }

    pub fn slow_path(&self) -> &UserspaceDataplane {
        &self.slow
    }

    /// The XDP pre-filter, when configured.
    pub fn prefilter(&self) -> Option<&Prefilter> {
        self.prefilter.as_ref()
    }

    /// (interface, "tcx" | "clsact" | "xdp") of every hook.
    pub fn hooks(&self) -> Vec<(String, &'static str)> {
        self.attachments.lock().iter().map(|a| (a.ifname().to_string(), a.kind())).collect()
    }
}

impl EbpfDataplane {
    /// Have the next hops of these entries' copies resolved now (in the background), before
    /// their first packets need them.
    fn resolve_next_hops<'a>(&self, entries: impl Iterator<Item = &'a mediaplane_core::StreamEntry>) {
        if let Some(r) = &self.resolver {
            r.resolve(entries.flat_map(|e| e.copies.iter().map(|c| c.to.ip())));
        }
    }
}

impl Dataplane for EbpfDataplane {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    /// The control plane's own packets leave as the slow path's copies do.
    fn send_datagram(&self, from: std::net::SocketAddr, to: std::net::SocketAddr, payload: &[u8]) -> Result<(), DataplaneError> {
        self.slow.send_datagram(from, to, payload)
    }

    fn apply(&self, table: Arc<ForwardingTable>) -> Result<(), DataplaneError> {
        // Slow path first: its sockets must be bound before the kernel hands packets up.
        self.slow.apply(table.clone())?;
        self.fast.apply(table.clone())?;
        self.resolve_next_hops(table.streams.values());
        Ok(())
    }

    fn apply_changes(&self, table: Arc<ForwardingTable>, changed: &[IngressKey]) -> Result<(), DataplaneError> {
        let before = self.slow.table();
        self.slow.apply_changes(table.clone(), changed)?;
        if let Err(e) = self.fast.apply_changes(table.clone(), Some(changed)) {
            // The kernel kept its table (the installer writes nothing unless everything fits):
            // put the slow path back on it too.
            if let Err(e2) = self.slow.apply_changes(before, changed) {
                tracing::error!(error = %e2, "could not restore the slow path's table");
            }
            return Err(e);
        }
        self.resolve_next_hops(changed.iter().filter_map(|k| table.streams.get(k)));
        Ok(())
    }

    fn stats(&self) -> DataplaneStats {
        self.stats_with(true)
    }

    fn stats_totals(&self) -> DataplaneStats {
        self.stats_with(false)
    }

    fn stream_counters(&self, ids: &[u32]) -> std::collections::BTreeMap<u32, mediaplane_dataplane::Counters> {
        let mut out = self.fast.kernel_stream_counters(ids).unwrap_or_else(|e| {
            tracing::warn!("reading kernel stream counters: {e}");
            Default::default()
        });
        for (id, c) in self.slow.stream_counters(ids) {
            out.entry(id).or_default().add(&c);
        }
        out
    }

    fn consumer_counters(&self, ids: &[u32]) -> std::collections::BTreeMap<u32, mediaplane_dataplane::ConsumerCounters> {
        let mut out: std::collections::BTreeMap<u32, mediaplane_dataplane::ConsumerCounters> = self
            .fast
            .kernel_consumer_counters(ids)
            .unwrap_or_else(|e| {
                tracing::warn!("reading kernel consumer counters: {e}");
                Default::default()
            })
            .into_iter()
            .map(|(id, c)| (id, c.to_counters()))
            .collect();
        for (id, c) in self.slow.consumer_counters(ids) {
            out.entry(id).or_default().add(&c);
        }
        out
    }

    fn consumer_reception(&self, ids: &[u32]) -> std::collections::BTreeMap<u32, ReceptionReport> {
        both_views(self.fast.kernel_consumer_reception(ids), self.slow.consumer_reception(ids), "what the kernel forwarded to consumers")
    }

    fn stream_reception(&self, ids: &[u32]) -> std::collections::BTreeMap<u32, ReceptionReport> {
        both_views(self.fast.kernel_stream_reception(ids), self.slow.stream_reception(ids), "kernel reception state")
    }

    fn shutdown(&self) -> Result<(), DataplaneError> {
        let mut first_err = None;
        self.steering.lock().take(); // detaches the sk_lookup program
        for a in self.attachments.lock().drain(..) {
            if let Err(e) = a.detach() {
                first_err.get_or_insert(e);
            }
        }
        // Nothing left to reclaim for: the maps go when the last holder does.
        self.fast.stop_reclaimer();
        if let Err(e) = self.fast.unpin_maps() {
            first_err.get_or_insert(e);
        }
        if let Some(Err(e)) = self.prefilter.as_ref().map(Prefilter::unpin_maps) {
            first_err.get_or_insert(e);
        }
        if let Err(e) = remove_pins(&self.pin_dir) {
            first_err.get_or_insert(e);
        }
        if let Err(e) = self.slow.shutdown() {
            first_err.get_or_insert(e);
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl EbpfDataplane {
    fn stats_with(&self, per_stream: bool) -> DataplaneStats {
        let mut s = match self.fast.kernel_stats_with(per_stream) {
            Ok(k) => k.to_dataplane_stats(self.fast.table_version()),
            Err(e) => {
                tracing::warn!("reading kernel counters: {e}");
                DataplaneStats { dataplane: "ebpf".into(), table_version: self.fast.table_version(), ..Default::default() }
            }
        };
        let u = if per_stream { self.slow.stats() } else { self.slow.stats_totals() };
        s.total.add(&u.total);
        for (id, c) in &u.streams {
            s.streams.entry(*id).or_default().add(c);
        }
        merge_reception(&mut s.reception, u.reception);
        if s.copy_latency.is_none() {
            s.copy_latency = u.copy_latency;
            s.copy_latency_histogram = u.copy_latency_histogram;
        }
        s.maps = self.fast.map_fill();
        for (k, v) in u.extra {
            s.extra.insert(format!("userspace.{k}"), v);
        }
        if let Some(st) = &*self.steering.lock() {
            let (steered, failed) = st.stats();
            s.extra.insert("slow_path_steered".into(), steered);
            s.extra.insert("slow_path_steer_failed".into(), failed);
        }
        if let Some(r) = &self.resolver {
            s.extra.extend(r.stats().into_iter().map(|(k, v)| (k.to_string(), v)));
        }
        if let Some((run_time_ns, run_count)) = self.fast.run_stats() {
            s.extra.insert("bpf_run_time_ns".into(), run_time_ns);
            s.extra.insert("bpf_run_count".into(), run_count);
        }
        if let Some(pf) = &self.prefilter {
            // One set of counters: the pre-filter's drops are the model's drops, counted once
            // in `total` (received and dropped there); `extra` keeps the breakdown by hook.
            let x = pf.extra();
            let get = |k: &str| x.get(k).copied().unwrap_or(0);
            s.total.rx_packets += get("xdp_drop_stranger") + get("xdp_drop_no_stream");
            s.total.rx_bytes += get("xdp_drop_bytes");
            s.total.drop_stranger += get("xdp_drop_stranger");
            s.total.drop_no_stream += get("xdp_drop_no_stream");
            s.extra.extend(x);
        }
        s
    }
}

/// The kernel's reception states (read as `what`: a failed read is logged and shows none) merged
/// with the slow path's reports ([`merge_reception`]).
fn both_views(
    kernel: Result<std::collections::BTreeMap<u32, mediaplane_core::reception::RtpReception>, DataplaneError>,
    slow: std::collections::BTreeMap<u32, ReceptionReport>,
    what: &str,
) -> std::collections::BTreeMap<u32, ReceptionReport> {
    let mut out: std::collections::BTreeMap<u32, ReceptionReport> = kernel
        .unwrap_or_else(|e| {
            tracing::warn!("reading {what}: {e}");
            Default::default()
        })
        .into_iter()
        .map(|(id, r)| (id, r.report()))
        .collect();
    merge_reception(&mut out, slow);
    out
}

/// A stream whose packets took both paths (the slow path's while it learnt its source or its
/// next hop, the kernel's after) has two partial views of its reception, and a consumer of it
/// two of what it was forwarded: the one that saw more packets is reported (sequence state
/// cannot be summed).
fn merge_reception(into: &mut std::collections::BTreeMap<u32, ReceptionReport>, slow: std::collections::BTreeMap<u32, ReceptionReport>) {
    for (id, r) in slow {
        let e = into.entry(id).or_insert(r);
        if r.packets > e.packets {
            *e = r;
        }
    }
}
