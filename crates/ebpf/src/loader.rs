//! Loading the TC program and its maps, installing tables into them, reading them back.
//!
//! [`FastPath`] is the kernel half of the eBPF data plane without any attachment: tests drive it
//! with `BPF_PROG_TEST_RUN` ([`FastPath::test_run`]), [`crate::EbpfDataplane`] attaches it.

use crate::install::{ApplyReport, Installer, KernelMaps};
use crate::maps::{
    ConsumerCountersRaw, CopyRaw, FastConfigRaw, KeyRaw, LatencyHistRaw, Pod, RateRaw, ReceptionRaw, RpfMode, SourceLimitRaw, StreamCountersRaw, StreamPathRaw,
    StreamValueRaw, GLOBAL_COUNTERS,
};
use crate::path::StreamPaths;
use libbpf_rs::{MapCore, MapFlags, MapHandle, MapType, Object, ObjectBuilder, Program, ProgramInput};
use mediaplane_core::reception::RtpReception;
use mediaplane_core::{ForwardingTable, IngressKey};
use mediaplane_dataplane::{Counters, DataplaneError, DataplaneStats, LatencySummary, MapFill};
use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet};
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

/// The compiled BPF object (bpf/sfu_tc.bpf.c), embedded.
pub const SFU_TC_OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sfu_tc.bpf.o"));
/// Name of the TC ingress program in [`SFU_TC_OBJECT`].
pub const SFU_TC_PROGRAM: &str = "sfu_ingress";

/// Maps that carry state worth keeping across a restart: pinned when a pin dir is given.
/// (The per-source limit and its buckets too: a restarted instance keeps limiting without a gap.)
const PINNED_MAPS: [&str; 9] =
    ["streams", "copies", "stream_stats", "consumer_stats", "layer_state", "counters", "copy_latency", "source_limit", "source_rate"];

#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Capacity of the stream table (also the number of per-stream counter slots).
    pub max_streams: u32,
    /// Capacity of the fan-out array: total copies over all streams.
    pub max_copies: u32,
    /// Pin (or adopt already pinned) maps in this bpffs directory.
    pub pin_dir: Option<PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { max_streams: 16384, max_copies: 65536, pin_dir: None }
    }
}

/// Outcome of one `BPF_PROG_TEST_RUN`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestRun {
    /// The program's verdict: `TC_ACT_OK` (0) = to the stack, `TC_ACT_SHOT` (2) = consumed,
    /// `TC_ACT_REDIRECT` (7) = the packet itself leaves as the last copy of a fan-out
    /// (BPF_PROG_TEST_RUN does not carry the redirect out: that copy is `data_out`).
    pub retval: u32,
    /// The packet as the program left it.
    pub data_out: Vec<u8>,
    /// Run time of the program as measured by the kernel (includes the helpers it called,
    /// e.g. every `bpf_clone_redirect` transmission).
    pub duration_ns: u64,
    /// skb->mark as the program left it (packets handed up in stream order carry one).
    pub mark: u32,
}

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;

/// Everything the kernel counted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KernelStats {
    /// Every global counter by name (see [`GLOBAL_COUNTERS`]).
    pub global: BTreeMap<&'static str, u64>,
    /// Per stream id.
    pub streams: BTreeMap<u32, StreamCountersRaw>,
    pub latency: LatencyHistRaw,
    /// Per stream id, of the RTP streams the kernel forwarded packets of.
    pub reception: BTreeMap<u32, RtpReception>,
    /// Per consumer uid ([`FastPath::kernel_stats`] only).
    pub consumers: BTreeMap<u32, ConsumerCountersRaw>,
}

impl KernelStats {
    pub fn get(&self, name: &str) -> u64 {
        self.global.get(name).copied().unwrap_or(0)
    }

    /// In the shape every data plane reports. Kernel-only verdicts go to `extra`.
    pub fn to_dataplane_stats(&self, table_version: u64) -> DataplaneStats {
        let g = |n| self.get(n);
        let total = Counters {
            rx_packets: g("rx_packets"),
            rx_bytes: g("rx_bytes"),
            tx_copies: g("tx_copies"),
            tx_bytes: g("tx_bytes"),
            tx_errors: g("tx_errors"),
            // The kernel makes no copy for a subscriber without its SRTP key: SRTP streams are
            // the slow path's, which counts these.
            tx_unkeyed: 0,
            drop_no_stream: g("drop_no_stream"),
            drop_stranger: g("drop_stranger"),
            drop_malformed: g("drop_malformed"),
            slow_stun: 0,
            slow_unlatched: 0,
            slow_handshake: 0,
            drop_rate_limited: g("drop_rate_limited"),
            drop_source_limited: g("drop_source_limited"),
            drop_bad_checksum: g("drop_bad_checksum"),
            drop_spoofed: g("drop_spoofed"),
            // Call control is the slow path's (such streams are handed up whole).
            drop_blocked: 0,
            // Decided by the slow path, which routes the feedback the kernel hands up.
            feedback_routed: 0,
            feedback_coalesced: 0,
            feedback_consumed: 0,
            feedback_unroutable: 0,
            last_rx_ns: 0, // kept per stream only
        };
        let streams = self.streams.iter().map(|(id, s)| (*id, s.to_counters())).collect();
        let in_total = ["drop_rate_limited", "drop_source_limited", "drop_bad_checksum", "drop_spoofed"];
        let extra = GLOBAL_COUNTERS[8..].iter().filter(|n| !in_total.contains(*n)).map(|n| (n.to_string(), g(n))).collect();
        let l = &self.latency;
        let copy_latency = (l.count > 0).then(|| LatencySummary {
            count: l.count,
            min_ns: l.min,
            p50_ns: l.quantile(0.5),
            mean_ns: l.sum as f64 / l.count as f64,
            p99_ns: l.quantile(0.99),
            max_ns: l.max,
        });
        let copy_latency_histogram = (l.count > 0).then(|| l.cumulative(&mediaplane_dataplane::COPY_LATENCY_BOUNDS_NS));
        let reception = self.reception.iter().map(|(id, r)| (*id, r.report())).collect();
        DataplaneStats {
            dataplane: "ebpf".into(),
            table_version,
            total,
            streams,
            copy_latency,
            copy_latency_histogram,
            extra,
            maps: BTreeMap::new(),
            reception,
        }
    }
}

/// libbpf prints to stderr by default; send it to tracing instead (verifier logs included).
fn route_libbpf_logs() {
    fn log(level: libbpf_rs::PrintLevel, msg: String) {
        let msg = msg.trim_end();
        match level {
            libbpf_rs::PrintLevel::Warn => tracing::warn!(target: "libbpf", "{msg}"),
            libbpf_rs::PrintLevel::Info => tracing::info!(target: "libbpf", "{msg}"),
            libbpf_rs::PrintLevel::Debug => tracing::debug!(target: "libbpf", "{msg}"),
        }
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Info, log)));
    });
}

/// Sum a per-CPU map's value at `key` over the CPUs with `add`.
pub(crate) fn percpu_sum<T: Pod>(map: &libbpf_rs::Map<'_>, key: u32, add: impl Fn(&mut T, &T)) -> Result<T, DataplaneError> {
    let mut acc = T::default();
    if let Some(per_cpu) = map.lookup_percpu(key.as_bytes(), MapFlags::ANY).map_err(|e| bpf_err("reading counters", e))? {
        for v in per_cpu {
            add(&mut acc, &T::from_bytes(&v));
        }
    }
    Ok(acc)
}

/// [`percpu_sum`] of each of `slots` of the per-CPU array `map`, read with
/// `BPF_MAP_LOOKUP_BATCH` over runs of neighbouring slots (one syscall a run rather than one a
/// slot; the slots in a run that were not asked for are read and dropped, so a run breaks
/// where the gap exceeds [`MAX_SLOT_GAP`]).
pub(crate) fn percpu_sum_slots<T: Pod>(map: &libbpf_rs::Map<'_>, slots: &[u32], add: impl Fn(&mut T, &T)) -> Result<BTreeMap<u32, T>, DataplaneError> {
    const MAX_SLOT_GAP: u32 = 64;
    let mut wanted: Vec<u32> = slots.to_vec();
    wanted.sort_unstable();
    wanted.dedup();
    let ncpu = libbpf_rs::num_possible_cpus().map_err(|e| bpf_err("counting CPUs", e))?;
    // The kernel lays out each element's per-CPU values 8-byte aligned.
    let stride = size_of::<T>().next_multiple_of(8);
    let mut out = BTreeMap::new();
    let mut i = 0;
    while i < wanted.len() {
        let (lo, mut hi) = (wanted[i], wanted[i]);
        let mut j = i + 1;
        while j < wanted.len() && wanted[j] - hi <= MAX_SLOT_GAP {
            hi = wanted[j];
            j += 1;
        }
        let mut count = hi - lo + 1;
        let mut keys = vec![0u32; count as usize];
        let mut values = vec![0u8; count as usize * ncpu * stride];
        // An array's batch starts after the key given (none: at 0) and ends after `out`.
        let start = lo.wrapping_sub(1);
        let mut next = 0u32;
        let opts = libbpf_rs::libbpf_sys::bpf_map_batch_opts { sz: size_of::<libbpf_rs::libbpf_sys::bpf_map_batch_opts>() as _, ..Default::default() };
        // SAFETY: keys and values hold `count` elements of the map's key size (u32) and per-CPU
        // value size; the kernel writes at most `count` and says how many.
        let r = unsafe {
            libbpf_rs::libbpf_sys::bpf_map_lookup_batch(
                map.as_fd().as_raw_fd(),
                if lo == 0 { std::ptr::null_mut() } else { (&start as *const u32).cast_mut().cast() },
                (&mut next as *mut u32).cast(),
                keys.as_mut_ptr().cast(),
                values.as_mut_ptr().cast(),
                &mut count,
                &opts,
            )
        };
        // ENOENT: the map ended within the run (what was read is still given).
        if r < 0 && -r != libc::ENOENT {
            return Err(DataplaneError::Other(format!("reading counters in a batch: {}", std::io::Error::from_raw_os_error(-r))));
        }
        for (k, key) in keys.iter().take(count as usize).enumerate() {
            if wanted[i..j].binary_search(key).is_err() {
                continue;
            }
            let mut acc = T::default();
            for cpu in 0..ncpu {
                let at = (k * ncpu + cpu) * stride;
                add(&mut acc, &T::from_bytes(&values[at..at + size_of::<T>()]));
            }
            out.insert(*key, acc);
        }
        i = j;
    }
    Ok(out)
}

/// (total run time ns, runs) of `prog`, as accounted by the kernel while BPF run-time statistics
/// are enabled; `None` if the kernel does not report them.
pub(crate) fn prog_run_stats(prog: &Program<'_>) -> Option<(u64, u64)> {
    use std::os::fd::AsRawFd;
    let mut info: libbpf_rs::libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: info is a zeroed bpf_prog_info of the size we pass.
    let r = unsafe { libbpf_rs::libbpf_sys::bpf_prog_get_info_by_fd(prog.as_fd().as_raw_fd(), &mut info, &mut len) };
    (r == 0).then_some((info.run_time_ns, info.run_cnt))
}

/// Remove the pins `names` under `dir` (the maps live on while a process holds them).
pub(crate) fn unpin(dir: Option<&Path>, names: &[&str]) -> Result<(), DataplaneError> {
    for p in dir.into_iter().flat_map(|d| names.iter().map(move |n| d.join(n))) {
        if p.exists() {
            std::fs::remove_file(&p).map_err(|source| DataplaneError::Io { context: format!("unpinning {}", p.display()), source })?;
        }
    }
    Ok(())
}

pub(crate) fn bpf_err(context: impl std::fmt::Display, e: libbpf_rs::Error) -> DataplaneError {
    DataplaneError::Other(format!("{context}: {e}"))
}

/// The RCU barrier (see bpf/maps.h `rcu_barrier`): updating a map-in-map waits for an RCU
/// grace period before returning.
struct RcuBarrier {
    /// `rcu_barrier`, the map-in-map.
    outer: MapHandle,
    /// An inner map to put in it.
    inner: MapHandle,
}

impl RcuBarrier {
    /// Return once no program run that started before the call is still running.
    fn wait(&self) -> Result<(), DataplaneError> {
        let fd = self.inner.as_fd().as_raw_fd() as u32;
        self.outer.update(0u32.as_bytes(), fd.as_bytes(), MapFlags::ANY).map_err(|e| bpf_err("RCU barrier", e))
    }
}

/// Frees what applies retired (see [`crate::install`]) off the apply path: woken after an apply
/// that retired something, it runs one RCU barrier for everything retired so far (applies in
/// the meantime add to the next batch) and then reclaims it.
struct Reclaimer {
    wake: mpsc::Sender<()>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Reclaimer {
    fn start(installer: Arc<Mutex<Installer>>, barrier: Arc<RcuBarrier>) -> Result<Reclaimer, DataplaneError> {
        let (wake, woken) = mpsc::channel::<()>();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("mp-rcu-reclaim".into())
            .spawn(move || {
                while woken.recv().is_ok() && !stopped.load(Ordering::Relaxed) {
                    while woken.try_recv().is_ok() {}
                    let Some(mark) = installer.lock().reclaim_mark() else { continue };
                    match barrier.wait() {
                        Ok(()) => installer.lock().reclaim(mark),
                        // Kept retired: the next wake-up (or an apply short of room) tries again.
                        Err(e) => tracing::warn!("freeing retired fan-out ranges: {e}"),
                    }
                }
            })
            .map_err(|source| DataplaneError::Io { context: "starting the RCU reclaim thread".into(), source })?;
        Ok(Reclaimer { wake, stop, thread })
    }

    fn wake(&self) {
        let _ = self.wake.send(());
    }

    /// Stop and join the thread (after the barrier it may be waiting for). What is still
    /// retired stays so: applies short of room reclaim it themselves.
    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        drop(self.wake);
        if self.thread.join().is_err() {
            tracing::error!("the RCU reclaim thread panicked");
        }
    }
}

/// The loaded program and maps, and the mirror of what is installed in them.
pub struct FastPath {
    obj: Object,
    installer: Arc<Mutex<Installer>>,
    barrier: Arc<RcuBarrier>,
    /// Frees retired ranges and slots after the grace period (None once stopped).
    reclaimer: Mutex<Option<Reclaimer>>,
    pin_dir: Option<PathBuf>,
    adopted: bool,
    /// The per-source limit last written to `source_limit` (None: not written yet).
    source_limit: Mutex<Option<SourceLimitRaw>>,
    /// `stream_path`, mapped: the slow path acknowledges packets handed up in order.
    paths: Arc<StreamPaths>,
    /// The consumers that have an entry in `consumer_stats`.
    consumers: Mutex<BTreeSet<u32>>,
}

impl Drop for FastPath {
    fn drop(&mut self) {
        self.stop_reclaimer();
    }
}

impl std::fmt::Debug for FastPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPath").field("pin_dir", &self.pin_dir).field("adopted", &self.adopted).finish()
    }
}

impl FastPath {
    /// Load (verify) the program and create its maps, or adopt the maps pinned in
    /// `opts.pin_dir` by a previous instance (their content is kept and mirrored).
    pub fn load(opts: &LoadOptions) -> Result<FastPath, DataplaneError> {
        Self::load_object(opts, SFU_TC_OBJECT)
    }

    /// [`FastPath::load`] with another build of bpf/sfu_tc.bpf.c (A/B measurements).
    #[doc(hidden)]
    pub fn load_object(opts: &LoadOptions, object: &[u8]) -> Result<FastPath, DataplaneError> {
        route_libbpf_logs();
        let adopted = opts.pin_dir.as_ref().is_some_and(|d| d.join("streams").exists());
        let mut open = ObjectBuilder::default().open_memory(object).map_err(|e| bpf_err("opening the BPF object", e))?;
        for mut m in open.maps_mut() {
            let name = m.name().to_string_lossy().into_owned();
            let entries = match name.as_str() {
                "streams" | "stream_stats" | "stream_rate" | "stream_path" | "stream_reception" => Some(opts.max_streams),
                "copies" | "consumer_stats" | "consumer_reception" | "layer_state" => Some(opts.max_copies),
                _ => None,
            };
            if let Some(n) = entries {
                m.set_max_entries(n).map_err(|e| bpf_err(format!("sizing map {name}"), e))?;
            }
            if let Some(dir) = &opts.pin_dir {
                if PINNED_MAPS.contains(&name.as_str()) {
                    m.set_pin_path(dir.join(&name)).map_err(|e| bpf_err(format!("pin path of map {name}"), e))?;
                }
            }
        }
        // libbpf attaches tcx links with the program's expected attach type (SEC("tc") has none).
        for mut p in open.progs_mut() {
            p.set_attach_type(libbpf_rs::ProgramAttachType::TcxIngress);
        }
        let obj = open.load().map_err(|e| {
            bpf_err(
                "loading the BPF program (needs CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN, and a kernel >= 6.6 with BTF; \
                 pinned maps from an incompatible version need a reset)",
                e,
            )
        })?;
        let barrier_inner = MapHandle::create(
            MapType::Array,
            Some("mp_barrier"),
            4,
            4,
            1,
            &libbpf_rs::libbpf_sys::bpf_map_create_opts { sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_map_create_opts>() as _, ..Default::default() },
        )
        .map_err(|e| bpf_err("creating the RCU barrier map", e))?;
        let counters_len = obj.maps().find(|m| m.name() == "counters").map(|m| m.max_entries());
        if counters_len != Some(GLOBAL_COUNTERS.len() as u32) {
            return Err(DataplaneError::Other(format!("BPF counter enum ({counters_len:?}) and maps::GLOBAL_COUNTERS ({}) disagree", GLOBAL_COUNTERS.len())));
        }
        let paths = Arc::new(StreamPaths::map(&obj.maps().find(|m| m.name() == "stream_path").expect("stream_path map"))?);
        let outer = obj.maps().find(|m| m.name() == "rcu_barrier").expect("rcu_barrier map");
        let barrier = Arc::new(RcuBarrier { outer: MapHandle::try_from(&outer).map_err(|e| bpf_err("rcu_barrier handle", e))?, inner: barrier_inner });
        let me = FastPath {
            paths,
            obj,
            installer: Arc::new(Mutex::new(Installer::new(opts.max_copies, opts.max_streams))),
            barrier,
            reclaimer: Mutex::new(None),
            pin_dir: opts.pin_dir.clone(),
            adopted,
            source_limit: Mutex::new(None),
            consumers: Mutex::new(BTreeSet::new()),
        };
        if adopted {
            // The consumers' counters live on in their pinned map; what was forwarded to them
            // (like the streams' reception, not pinned) is counted afresh.
            let adopted: BTreeSet<u32> = me.map("consumer_stats").keys().filter_map(|k| k.get(..4).map(u32::from_bytes)).collect();
            let reception = me.map("consumer_reception");
            for id in &adopted {
                reception
                    .update(id.as_bytes(), ReceptionRaw::default().as_bytes(), MapFlags::NO_EXIST)
                    .map_err(|e| bpf_err(format!("adopting consumer {id}"), e))?;
            }
            *me.consumers.lock() = adopted;
            let existing = me.read_installed()?;
            tracing::info!(streams = existing.len(), "adopted pinned kernel forwarding state");
            *me.installer.lock() = Installer::adopt(opts.max_copies, opts.max_streams, existing)?;
        }
        *me.reclaimer.lock() = Some(Reclaimer::start(me.installer.clone(), me.barrier.clone())?);
        Ok(me)
    }

    /// True when the maps were adopted from a previous instance's pins.
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    pub fn program(&self) -> Program<'_> {
        self.obj.progs().find(|p| p.name() == SFU_TC_PROGRAM).expect("program in the embedded object")
    }

    /// One of the object's programs, to run with `BPF_PROG_TEST_RUN`.
    pub(crate) fn program_named(&self, name: &str) -> libbpf_rs::ProgramMut<'_> {
        self.obj.progs_mut().find(|p| p.name() == name).unwrap_or_else(|| panic!("program {name} in the embedded object"))
    }

    pub(crate) fn map(&self, name: &str) -> libbpf_rs::Map<'_> {
        self.obj.maps().find(|m| m.name() == name).unwrap_or_else(|| panic!("map {name} in the embedded object"))
    }

    /// The stream map (shared with the slow-path steering program).
    pub fn streams_map(&self) -> libbpf_rs::Map<'_> {
        self.map("streams")
    }

    /// A handle on the next-hop generation map (see [`crate::nhwatch`]).
    pub fn next_hop_generation_map(&self) -> Result<MapHandle, DataplaneError> {
        MapHandle::try_from(&self.map("nh_gen")).map_err(|e| bpf_err("nh_gen handle", e))
    }

    /// Make the program resolve every next hop again (after a route or neighbour change).
    pub fn invalidate_next_hops(&self) -> Result<(), DataplaneError> {
        crate::nhwatch::bump(&self.next_hop_generation_map()?).map(|_| ())
    }

    /// Set what copies' headers carry and which checks the program runs (fast_config[0]).
    pub fn configure(&self, cfg: &FastConfigRaw) -> Result<(), DataplaneError> {
        self.map("fast_config").update(0u32.as_bytes(), cfg.as_bytes(), MapFlags::ANY).map_err(|e| bpf_err("writing fast_config", e))
    }

    /// The reverse-path mode for IPv4 packets arriving on `ifindex` (Off removes the entry).
    /// Cached passes are renewed only when the next-hop generation changes: bump it after.
    pub fn set_rpf_mode(&self, ifindex: u32, mode: RpfMode) -> Result<(), DataplaneError> {
        crate::rpf::write_mode(&self.map("rpf_mode"), ifindex, mode)
    }

    /// A handle on `rpf_mode` (for [`crate::rpf::RpfSync`]).
    pub fn rpf_mode_map(&self) -> Result<MapHandle, DataplaneError> {
        MapHandle::try_from(&self.map("rpf_mode")).map_err(|e| bpf_err("rpf_mode handle", e))
    }

    /// The mapped per-stream path state (order acknowledgements).
    pub fn stream_paths(&self) -> Arc<StreamPaths> {
        self.paths.clone()
    }

    /// The stats slot of an installed stream (index into the per-stream maps).
    pub fn stats_slot(&self, stream_id: u32) -> Option<u32> {
        self.installer.lock().stats_slot(stream_id)
    }

    /// Remove the map pins (the maps live on while this process holds them).
    pub fn unpin_maps(&self) -> Result<(), DataplaneError> {
        unpin(self.pin_dir.as_deref(), &PINNED_MAPS)
    }

    pub fn pin_dir(&self) -> Option<&Path> {
        self.pin_dir.as_deref()
    }

    /// Stop the thread that frees retired fan-out ranges and stats slots (done on drop). Applies
    /// still work: one short of room waits for the grace period itself.
    pub fn stop_reclaimer(&self) {
        if let Some(r) = self.reclaimer.lock().take() {
            r.stop();
        }
    }

    /// Whether fan-out ranges or stats slots wait to be freed after a grace period.
    pub fn has_retired(&self) -> bool {
        self.installer.lock().has_retired()
    }

    /// Install `table` (atomically per packet, see [`crate::install`]). Returns once the new
    /// entries are live; what they replaced is freed in the background after an RCU grace period.
    pub fn apply(&self, table: Arc<ForwardingTable>) -> Result<ApplyReport, DataplaneError> {
        self.apply_changes(table, None)
    }

    /// Install `table`, which differs from the last installed one only at `changed`.
    pub fn apply_changes(&self, table: Arc<ForwardingTable>, changed: Option<&[IngressKey]>) -> Result<ApplyReport, DataplaneError> {
        let limit = SourceLimitRaw::new(table.source_limit.as_ref());
        let mut installer = self.installer.lock();
        // Consumers get their counters before the first copy for them is written; the counters
        // of those gone go once their copies are.
        let (new_consumers, gone_consumers) = self.consumer_changes(installer.table().map(|t| &**t), &table, changed);
        self.create_consumers(&new_consumers)?;
        let mut io = MapsIo { fp: self };
        let report = installer.apply_changes(table, changed, &mut io)?;
        drop(installer);
        self.delete_consumers(&gone_consumers);
        // The new table is live: what it replaced is freed after the grace period, meanwhile.
        if report.retired > 0 {
            if let Some(r) = &*self.reclaimer.lock() {
                r.wake();
            }
        }
        // The per-source limit is one global setting: written when it changes. Buckets are kept
        // (a bucket's state is a time, meaningful under any limit).
        let mut cur = self.source_limit.lock();
        if *cur != Some(limit) {
            self.map("source_limit").update(0u32.as_bytes(), limit.as_bytes(), MapFlags::ANY).map_err(|e| bpf_err("writing the per-source limit", e))?;
            *cur = Some(limit);
        }
        Ok(report)
    }

    /// Consumers of `table` that have no counters yet, and consumers with counters that `table`
    /// no longer has: among the entries at `changed` (each consumer belongs to one stream), or
    /// all of them.
    fn consumer_changes(&self, old: Option<&ForwardingTable>, table: &ForwardingTable, changed: Option<&[IngressKey]>) -> (Vec<u32>, Vec<u32>) {
        let consumers_of = |t: &ForwardingTable, keys: &mut dyn Iterator<Item = &IngressKey>| -> BTreeSet<u32> {
            keys.filter_map(|k| t.streams.get(k)).flat_map(crate::maps::kernel_consumers).collect()
        };
        let have = self.consumers.lock();
        match (old, changed) {
            (Some(old), Some(changed)) => {
                let now = consumers_of(table, &mut changed.iter());
                let before = consumers_of(old, &mut changed.iter());
                (now.iter().filter(|c| !have.contains(c)).copied().collect(), before.difference(&now).filter(|c| have.contains(c)).copied().collect())
            }
            _ => {
                let now = consumers_of(table, &mut table.streams.keys());
                (now.difference(&have).copied().collect(), have.difference(&now).copied().collect())
            }
        }
    }

    fn create_consumers(&self, ids: &[u32]) -> Result<(), DataplaneError> {
        if ids.is_empty() {
            return Ok(());
        }
        let ncpu = libbpf_rs::num_possible_cpus().map_err(|e| bpf_err("counting CPUs", e))?;
        let zero = vec![ConsumerCountersRaw::default().as_bytes().to_vec(); ncpu];
        let map = self.map("consumer_stats");
        let reception = self.map("consumer_reception");
        let mut have = self.consumers.lock();
        for (i, id) in ids.iter().enumerate() {
            let made = map.update_percpu(id.as_bytes(), &zero, MapFlags::ANY).and_then(|()| {
                reception.update(id.as_bytes(), ReceptionRaw::default().as_bytes(), MapFlags::ANY).inspect_err(|_| {
                    let _ = map.delete(id.as_bytes());
                })
            });
            if let Err(e) = made {
                // Nothing of the apply is installed: neither are these counters.
                for made in &ids[..i] {
                    let _ = map.delete(made.as_bytes());
                    let _ = reception.delete(made.as_bytes());
                    have.remove(made);
                }
                return Err(DataplaneError::Full(format!(
                    "no room for the counters of consumer {id} (consumer_stats holds {}; raise dataplane.max_copies): {e}",
                    have.len()
                )));
            }
            have.insert(*id);
        }
        Ok(())
    }

    fn delete_consumers(&self, ids: &[u32]) {
        let map = self.map("consumer_stats");
        let reception = self.map("consumer_reception");
        let mut have = self.consumers.lock();
        for id in ids {
            if let Err(e) = map.delete(id.as_bytes()) {
                tracing::warn!(consumer = id, error = %e, "deleting a consumer's counters");
            }
            if let Err(e) = reception.delete(id.as_bytes()) {
                tracing::warn!(consumer = id, error = %e, "deleting what was forwarded to a consumer");
            }
            have.remove(id);
        }
    }

    /// The kernel's counters of just these consumers (those it has counters for).
    pub fn kernel_consumer_counters(&self, ids: &[u32]) -> Result<BTreeMap<u32, ConsumerCountersRaw>, DataplaneError> {
        let map = self.map("consumer_stats");
        // Not held across the reads: an apply waits for this lock.
        let known: Vec<u32> = {
            let have = self.consumers.lock();
            ids.iter().filter(|id| have.contains(id)).copied().collect()
        };
        let mut out = BTreeMap::new();
        for id in known {
            out.insert(id, percpu_sum::<ConsumerCountersRaw>(&map, id, |a, b| a.add(b))?);
        }
        Ok(out)
    }

    /// How many entries map `name` holds, counted key by key (tests, diagnostics).
    pub fn map_keys(&self, name: &str) -> usize {
        self.map(name).keys().count()
    }

    /// The consumers that have an entry in the kernel's `consumer_stats`, read from the map
    /// itself (one syscall per entry: tests, diagnostics).
    pub fn kernel_consumer_ids(&self) -> Vec<u32> {
        self.map("consumer_stats").keys().filter_map(|k| k.get(..4).map(u32::from_bytes)).collect()
    }

    pub fn table_version(&self) -> u64 {
        self.installer.lock().table().map_or(0, |t| t.version)
    }

    /// Every stream entry in the kernel with its fan-out.
    pub fn read_installed(&self) -> Result<Vec<(KeyRaw, StreamValueRaw, Vec<CopyRaw>)>, DataplaneError> {
        let streams = self.map("streams");
        let copies = self.map("copies");
        let mut out = Vec::new();
        for k in streams.keys() {
            let Some(v) = streams.lookup(&k, MapFlags::ANY).map_err(|e| bpf_err("reading streams", e))? else { continue };
            let key = KeyRaw::from_bytes(&k);
            let value = StreamValueRaw::from_bytes(&v);
            let mut list = Vec::with_capacity(value.copies_count as usize);
            for i in 0..value.copies_count {
                let idx = value.copies_base + i;
                let c = copies
                    .lookup(idx.as_bytes(), MapFlags::ANY)
                    .map_err(|e| bpf_err("reading copies", e))?
                    .ok_or_else(|| DataplaneError::Other(format!("copy slot {idx} out of range")))?;
                list.push(CopyRaw::from_bytes(&c));
            }
            out.push((key, value, list));
        }
        Ok(out)
    }

    /// (total run time ns, runs) of the program, as accounted by the kernel while BPF run-time
    /// statistics are enabled; `None` if the kernel does not report them.
    pub fn run_stats(&self) -> Option<(u64, u64)> {
        prog_run_stats(&self.program())
    }

    /// The kernel's counters of just these streams (one map read per stream, where
    /// [`FastPath::kernel_stats`] reads every installed stream).
    ///
    /// Read in batches of neighbouring slots ([`percpu_sum_slots`]): a media-timeout sweep reads
    /// every call's streams each second, and one syscall per stream was most of what an idle
    /// relay of 1,000 calls cost.
    pub fn kernel_stream_counters(&self, ids: &[u32]) -> Result<BTreeMap<u32, Counters>, DataplaneError> {
        let slot_of: Vec<(u32, u32)> = {
            let inst = self.installer.lock();
            ids.iter().filter_map(|id| Some((*id, inst.stats_slot(*id)?))).collect()
        };
        let slots: Vec<u32> = slot_of.iter().map(|(_, s)| *s).collect();
        let sums = percpu_sum_slots::<StreamCountersRaw>(&self.map("stream_stats"), &slots, |a, b| a.add(b))?;
        Ok(slot_of.into_iter().filter_map(|(id, slot)| Some((id, sums.get(&slot)?.to_counters()))).collect())
    }

    /// The kernel's counters of stream `id` as the map holds them, summed over CPUs (None: not
    /// installed).
    pub fn kernel_stream_raw(&self, id: u32) -> Result<Option<StreamCountersRaw>, DataplaneError> {
        let Some(slot) = self.installer.lock().stats_slot(id) else { return Ok(None) };
        Ok(Some(percpu_sum::<StreamCountersRaw>(&self.map("stream_stats"), slot, |a, b| a.add(b))?))
    }

    /// Fill of the maps that bound what can be installed: entries in use and capacity. Copies
    /// retired but not yet reclaimed (waiting for a grace period) count as in use.
    pub fn map_fill(&self) -> BTreeMap<String, MapFill> {
        let inst = self.installer.lock();
        let cap = |name: &str| u64::from(self.map(name).max_entries());
        let copies = cap("copies");
        [
            ("streams", inst.installed_len() as u64, cap("streams")),
            ("stream_stats", inst.slots_len() as u64, cap("stream_stats")),
            ("copies", copies.saturating_sub(u64::from(inst.free_copy_slots())), copies),
            ("consumer_stats", self.consumers.lock().len() as u64, cap("consumer_stats")),
        ]
        .into_iter()
        .map(|(n, entries, capacity)| (n.to_string(), MapFill { entries, capacity }))
        .collect()
    }

    /// Everything the kernel counted, every consumer's counters included (read from the map
    /// itself: tests, diagnostics; the data plane reads consumers on demand).
    pub fn kernel_stats(&self) -> Result<KernelStats, DataplaneError> {
        let mut s = self.kernel_stats_with(true)?;
        let map = self.map("consumer_stats");
        for id in self.kernel_consumer_ids() {
            s.consumers.insert(id, percpu_sum::<ConsumerCountersRaw>(&map, id, |a, b| a.add(b))?);
        }
        Ok(s)
    }

    /// [`FastPath::kernel_stats`]; `per_stream` false leaves `streams` empty (no read per stream).
    pub fn kernel_stats_with(&self, per_stream: bool) -> Result<KernelStats, DataplaneError> {
        let counters = self.map("counters");
        let mut global = BTreeMap::new();
        for (i, name) in GLOBAL_COUNTERS.iter().enumerate() {
            global.insert(*name, percpu_sum::<u64>(&counters, i as u32, |a, b| *a += b)?);
        }
        let mut streams = BTreeMap::new();
        let mut reception = BTreeMap::new();
        if per_stream {
            let stats = self.map("stream_stats");
            let slots: Vec<(u32, u32)> = self.installer.lock().stats_slots().collect();
            for (id, slot) in slots {
                streams.insert(id, percpu_sum::<StreamCountersRaw>(&stats, slot, |a, b| a.add(b))?);
                if let Some(r) = self.reception_of(slot)? {
                    reception.insert(id, r);
                }
            }
        }
        let latency = percpu_sum::<LatencyHistRaw>(&self.map("copy_latency"), 0, |a, b| a.add(b))?;
        Ok(KernelStats { global, streams, latency, reception, consumers: BTreeMap::new() })
    }

    /// The reception state in `stream_reception[slot]`, read whole under its lock; None until
    /// the kernel forwarded an RTP packet of the stream.
    fn reception_of(&self, slot: u32) -> Result<Option<RtpReception>, DataplaneError> {
        let raw = self.map("stream_reception").lookup(slot.as_bytes(), MapFlags::LOCK).map_err(|e| bpf_err("reading reception state", e))?;
        Ok(raw.filter(|b| b.len() == size_of::<ReceptionRaw>()).map(|b| ReceptionRaw::from_bytes(&b).to_reception()).filter(|r| r.started))
    }

    /// What the kernel forwarded to just these consumers (those it has sent an RTP copy), as
    /// they were sent: their RTP as forwarded.
    pub fn kernel_consumer_reception(&self, ids: &[u32]) -> Result<BTreeMap<u32, RtpReception>, DataplaneError> {
        let known: Vec<u32> = {
            let have = self.consumers.lock();
            ids.iter().filter(|id| have.contains(id)).copied().collect()
        };
        let map = self.map("consumer_reception");
        let mut out = BTreeMap::new();
        for id in known {
            let raw = map.lookup(id.as_bytes(), MapFlags::LOCK).map_err(|e| bpf_err("reading what was forwarded to a consumer", e))?;
            if let Some(r) = raw.filter(|b| b.len() == size_of::<ReceptionRaw>()).map(|b| ReceptionRaw::from_bytes(&b).to_reception()).filter(|r| r.started) {
                out.insert(id, r);
            }
        }
        Ok(out)
    }

    /// The kernel's reception state of just these streams.
    pub fn kernel_stream_reception(&self, ids: &[u32]) -> Result<BTreeMap<u32, RtpReception>, DataplaneError> {
        let slots: Vec<(u32, u32)> = {
            let inst = self.installer.lock();
            ids.iter().filter_map(|id| inst.stats_slot(*id).map(|s| (*id, s))).collect()
        };
        let mut out = BTreeMap::new();
        for (id, slot) in slots {
            if let Some(r) = self.reception_of(slot)? {
                out.insert(id, r);
            }
        }
        Ok(out)
    }

    /// Run the program once on `frame` with `BPF_PROG_TEST_RUN`. `ifindex` is the device the
    /// packet pretends to arrive on (fib lookups use it; needs forwarding enabled on it);
    /// copies really leave through `bpf_clone_redirect`, in the calling thread's netns.
    // ProgramInput is non-exhaustive: no struct literal possible.
    #[allow(clippy::field_reassign_with_default)]
    pub fn test_run(&self, frame: &[u8], ifindex: Option<u32>) -> Result<TestRun, DataplaneError> {
        // struct __sk_buff: only ifindex (offset 40) may be set besides mark/priority.
        let mut ctx = vec![0u8; std::mem::size_of::<crate::skel::types::__sk_buff>()];
        if let Some(i) = ifindex {
            ctx[40..44].copy_from_slice(&i.to_ne_bytes());
        }
        // Room for what the program may do to the frame (it only ever shrinks it: VLAN pop).
        let mut out = vec![0u8; frame.len() + 64];
        let mut ctx_out = vec![0u8; ctx.len()];
        let mut input = ProgramInput::default();
        input.data_in = Some(frame);
        input.data_out = Some(&mut out);
        input.context_in = Some(&mut ctx);
        input.context_out = Some(&mut ctx_out);
        let prog = self.obj.progs_mut().find(|p| p.name() == SFU_TC_PROGRAM).expect("program in the embedded object");
        let res = prog.test_run(input).map_err(|e| bpf_err("BPF_PROG_TEST_RUN", e))?;
        let (retval, duration_ns) = (res.return_value, res.duration.as_nanos() as u64);
        let data_out = res.data.map(|d| d.to_vec()).unwrap_or_default();
        let mark_at = std::mem::offset_of!(crate::skel::types::__sk_buff, mark);
        let mark = u32::from_ne_bytes(ctx_out[mark_at..mark_at + 4].try_into().expect("4 bytes"));
        Ok(TestRun { retval, data_out, duration_ns, mark })
    }

    /// Zero every counter and the latency histogram (tests, benchmarks).
    pub fn reset_counters(&self) -> Result<(), DataplaneError> {
        let ncpu = libbpf_rs::num_possible_cpus().map_err(|e| bpf_err("counting CPUs", e))?;
        let counters = self.map("counters");
        for i in 0..GLOBAL_COUNTERS.len() as u32 {
            counters.update_percpu(i.as_bytes(), &vec![0u64.as_bytes().to_vec(); ncpu], MapFlags::ANY).map_err(|e| bpf_err("zeroing counters", e))?;
        }
        let z = LatencyHistRaw::default();
        self.map("copy_latency")
            .update_percpu(0u32.as_bytes(), &vec![z.as_bytes().to_vec(); ncpu], MapFlags::ANY)
            .map_err(|e| bpf_err("zeroing latency", e))?;
        let zero = vec![ConsumerCountersRaw::default().as_bytes().to_vec(); ncpu];
        for id in self.consumers.lock().iter() {
            self.map("consumer_stats").update_percpu(id.as_bytes(), &zero, MapFlags::EXIST).map_err(|e| bpf_err("zeroing consumer counters", e))?;
        }
        let slots: Vec<u32> = self.installer.lock().stats_slots().map(|(_, s)| s).collect();
        let mut io = MapsIo { fp: self };
        for s in slots {
            io.zero_stats(s)?;
        }
        Ok(())
    }
}

/// [`KernelMaps`] over the real maps.
struct MapsIo<'a> {
    fp: &'a FastPath,
}

impl KernelMaps for MapsIo<'_> {
    fn write_copies(&mut self, base: u32, copies: &[CopyRaw]) -> Result<(), DataplaneError> {
        let map = self.fp.map("copies");
        for (i, c) in copies.iter().enumerate() {
            let idx = base + i as u32;
            map.update(idx.as_bytes(), c.as_bytes(), MapFlags::ANY).map_err(|e| bpf_err("writing copies", e))?;
        }
        Ok(())
    }

    fn write_stream(&mut self, key: &KeyRaw, value: &StreamValueRaw) -> Result<(), DataplaneError> {
        self.fp.map("streams").update(key.as_bytes(), value.as_bytes(), MapFlags::ANY).map_err(|e| bpf_err(format!("writing stream {:?}", key.local()), e))
    }

    fn delete_stream(&mut self, key: &KeyRaw) -> Result<(), DataplaneError> {
        self.fp.map("streams").delete(key.as_bytes()).map_err(|e| bpf_err(format!("deleting stream {:?}", key.local()), e))
    }

    fn zero_stats(&mut self, slot: u32) -> Result<(), DataplaneError> {
        let ncpu = libbpf_rs::num_possible_cpus().map_err(|e| bpf_err("counting CPUs", e))?;
        let zero = StreamCountersRaw::default();
        self.fp
            .map("stream_stats")
            .update_percpu(slot.as_bytes(), &vec![zero.as_bytes().to_vec(); ncpu], MapFlags::ANY)
            .map_err(|e| bpf_err("zeroing stream counters", e))?;
        // Nor the reception state of a previous owner.
        self.fp
            .map("stream_reception")
            .update(slot.as_bytes(), ReceptionRaw::default().as_bytes(), MapFlags::LOCK)
            .map_err(|e| bpf_err("zeroing reception state", e))?;
        // A fresh slot has no cached reverse-path pass and no order hold of a previous owner.
        self.fp
            .map("stream_path")
            .update(slot.as_bytes(), StreamPathRaw::default().as_bytes(), MapFlags::ANY)
            .map_err(|e| bpf_err("zeroing stream path state", e))
    }

    fn write_rate(&mut self, slot: u32, rate: &RateRaw) -> Result<(), DataplaneError> {
        self.fp.map("stream_rate").update(slot.as_bytes(), rate.as_bytes(), MapFlags::LOCK).map_err(|e| bpf_err("writing a rate limit", e))
    }

    fn rcu_barrier(&mut self) -> Result<(), DataplaneError> {
        self.fp.barrier.wait()
    }
}
