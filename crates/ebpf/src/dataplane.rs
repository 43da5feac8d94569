//! [`EbpfDataplane`]: the TC fast path plus the user-space data plane as its slow path.

use crate::attach::{self, AttachMode, Attachment};
use crate::loader::{FastPath, LoadOptions};
use crate::prefilter::Prefilter;
use mediaplane_core::ForwardingTable;
use mediaplane_dataplane::{Dataplane, DataplaneError, DataplaneEvent, DataplaneStats, UserspaceConfig, UserspaceDataplane};
use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
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
    pub attach: AttachMode,
    pub max_streams: u32,
    pub max_copies: u32,
    /// Put the XDP pre-filter (certain strangers dropped before TC) on the same interfaces.
    pub xdp_prefilter: bool,
}

impl EbpfConfig {
    pub fn new(interfaces: Vec<String>, pin_dir: impl Into<PathBuf>) -> Self {
        let d = LoadOptions::default();
        EbpfConfig {
            interfaces,
            pin_dir: pin_dir.into(),
            userspace: UserspaceConfig::default(),
            reset: false,
            attach: AttachMode::Auto,
            max_streams: d.max_streams,
            max_copies: d.max_copies,
            xdp_prefilter: true,
        }
    }
}

/// The kernel fast path (TC eBPF) with the user-space data plane as slow path.
///
/// Both get every table; packets the kernel passes up (`TC_ACT_OK`: STUN, unlatched sources,
/// unresolved neighbours, what it cannot parse) reach the user-space plane's sockets. Stats are
/// merged: the kernel counts only what it decided, the slow path what it received, so every
/// packet is counted once. In front of TC, the XDP pre-filter ([`Prefilter`], on by default)
/// drops certain strangers; it counts them apart (`extra["xdp_drop_stranger"]`).
///
/// The per-source limit ([`ForwardingTable::source_limit`]) has a bucket per source in the
/// kernel, charged by the TC program for what it judges (forwarded, STUN, first packets), and
/// one in the slow path for what reaches user space: a packet the kernel admitted and passed up
/// (STUN, unlatched) is charged in both, so the slow path never admits more than the kernel
/// already did; what the kernel cannot judge (fragments, unresolved neighbours) is limited by
/// the slow path's bucket alone.
///
/// Dropping it without [`Dataplane::shutdown`] leaves the kernel path forwarding from its pins
/// (that is what makes `kill -9` + restart hitless); `shutdown()` detaches and unpins.
pub struct EbpfDataplane {
    fast: FastPath,
    prefilter: Option<Prefilter>,
    slow: UserspaceDataplane,
    attachments: Mutex<Vec<Attachment>>,
    pin_dir: PathBuf,
    /// Bumps the next-hop cache generation on every route/neighbour/link change.
    _nh_watch: Option<crate::nhwatch::NextHopWatch>,
    /// Holding this fd keeps the kernel's BPF run-time accounting on (BPF_ENABLE_STATS): it is
    /// how cost per copy is measured. Closing it (drop) turns accounting back off.
    _run_stats: Option<std::os::fd::OwnedFd>,
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
        return Err(DataplaneError::Io { context: "mounting a bpffs on /sys/fs/bpf".into(), source: std::io::Error::last_os_error() });
    }
    tracing::info!("mounted a bpffs on /sys/fs/bpf");
    Ok(())
}

fn enable_run_stats() -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain syscall wrapper; a non-negative return is an fd we now own.
    let fd = unsafe { libbpf_rs::libbpf_sys::bpf_enable_stats(libbpf_rs::libbpf_sys::BPF_STATS_RUN_TIME) };
    if fd < 0 {
        tracing::warn!("BPF run-time statistics unavailable (errno {}): cost per copy will not be reported", -fd);
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
    let io = |context: String| move |source| DataplaneError::Io { context, source };
    for entry in std::fs::read_dir(pin_dir).map_err(io(format!("reading {}", pin_dir.display())))? {
        let p = entry.map_err(io(format!("reading {}", pin_dir.display())))?.path();
        std::fs::remove_file(&p).map_err(io(format!("removing pin {}", p.display())))?;
    }
    std::fs::remove_dir(pin_dir).map_err(io(format!("removing {}", pin_dir.display())))
}

impl EbpfDataplane {
    pub fn new(cfg: EbpfConfig, events: Option<Sender<DataplaneEvent>>) -> Result<Self, DataplaneError> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(DataplaneError::Unsupported(
                "the ebpf data plane needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN for bpffs pins); \
                 use the userspace data plane instead"
                    .into(),
            ));
        }
        if cfg.interfaces.is_empty() {
            return Err(other("the ebpf data plane needs at least one interface to attach to"));
        }
        for ifname in &cfg.interfaces {
            attach::ifindex_of(ifname)?;
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
        if cfg.reset {
            remove_pins(&cfg.pin_dir)?;
        }
        std::fs::create_dir_all(&cfg.pin_dir)
            .map_err(|source| DataplaneError::Io { context: format!("creating {}", cfg.pin_dir.display()), source })?;

        let fast = FastPath::load(&LoadOptions {
            max_streams: cfg.max_streams,
            max_copies: cfg.max_copies,
            pin_dir: Some(cfg.pin_dir.clone()),
        })?;
        if cfg.reset {
            for ifname in &cfg.interfaces {
                attach::detach_stale_clsact(&fast.program(), ifname);
            }
        }
        let prefilter = if cfg.xdp_prefilter {
            Some(Prefilter::load(&fast)?)
        } else {
            // A previous instance's pre-filter, pinned: unpinning its link detaches it.
            for ifname in &cfg.interfaces {
                let p = attach::xdp_link_pin_path(&cfg.pin_dir, ifname);
                if p.exists() {
                    std::fs::remove_file(&p).map_err(|source| DataplaneError::Io { context: format!("removing {}", p.display()), source })?;
                }
            }
            None
        };
        let slow = UserspaceDataplane::new(cfg.userspace.clone(), events)?;
        let mut attachments = Vec::new();
        let hooks = cfg.interfaces.iter().map(|i| (i, false)).chain(prefilter.iter().flat_map(|_| cfg.interfaces.iter().map(|i| (i, true))));
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
        let nh_watch = match fast.next_hop_generation_map().and_then(crate::nhwatch::NextHopWatch::start) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!("no rtnetlink watcher ({e}): cached next hops are only renewed by expiry");
                None
            }
        };
        Ok(EbpfDataplane {
            fast,
            prefilter,
            slow,
            attachments: Mutex::new(attachments),
            pin_dir: cfg.pin_dir,
            _nh_watch: nh_watch,
            _run_stats: enable_run_stats(),
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

impl Dataplane for EbpfDataplane {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    fn apply(&self, table: Arc<ForwardingTable>) -> Result<(), DataplaneError> {
        // Slow path first: its sockets must be bound before the kernel hands packets up.
        self.slow.apply(table.clone())?;
        self.fast.apply(table)?;
        Ok(())
    }

    fn stats(&self) -> DataplaneStats {
        let mut s = match self.fast.kernel_stats() {
            Ok(k) => k.to_dataplane_stats(self.fast.table_version()),
            Err(e) => {
                tracing::warn!("reading kernel counters: {e}");
                DataplaneStats { dataplane: "ebpf".into(), table_version: self.fast.table_version(), ..Default::default() }
            }
        };
        let u = self.slow.stats();
        s.total.add(&u.total);
        for (id, c) in &u.streams {
            s.streams.entry(*id).or_default().add(c);
        }
        if s.copy_latency.is_none() {
            s.copy_latency = u.copy_latency;
        }
        for (k, v) in u.extra {
            s.extra.insert(format!("userspace.{k}"), v);
        }
        if let Some((run_time_ns, run_count)) = self.fast.run_stats() {
            s.extra.insert("bpf_run_time_ns".into(), run_time_ns);
            s.extra.insert("bpf_run_count".into(), run_count);
        }
        if let Some(pf) = &self.prefilter {
            s.extra.extend(pf.extra());
        }
        s
    }

    fn shutdown(&self) -> Result<(), DataplaneError> {
        let mut first_err = None;
        for a in self.attachments.lock().drain(..) {
            if let Err(e) = a.detach() {
                first_err.get_or_insert(e);
            }
        }
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
