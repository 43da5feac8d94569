//! The XDP pre-filter (bpf/prefilter_xdp.bpf.c): drops packets the forwarding model would
//! certainly drop — sent to an address whose streams all have one fixed source, from another
//! source — before the kernel builds an skb for them, in front of the TC fast path on the same
//! interfaces. It shares the TC program's `streams` map (by fd: one table, no second install)
//! and has its own per-CPU counters, reported as `xdp_*` in
//! [`mediaplane_dataplane::DataplaneStats::extra`]. Everything it cannot decide cheaply passes.
//!
//! Its drops are counted only there, under classify()'s reason: `xdp_drop_stranger` (what TC
//! would count as `drop_stranger`) and `xdp_drop_no_stream` (an SSRC no stream on an
//! SSRC-narrowed address has, from a source that is not the address's one source: TC's
//! `drop_no_stream`). Not in `total` (which counts what TC and the user-space plane dropped):
//! every dropped packet is counted once, in one of the two.

use crate::loader::{percpu_sum, FastPath};
use libbpf_rs::{MapCore, MapFlags, Object, ObjectBuilder, Program, ProgramInput};
use mediaplane_dataplane::DataplaneError;
use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

/// The compiled pre-filter (bpf/prefilter_xdp.bpf.c), embedded.
pub const PREFILTER_OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/prefilter_xdp.bpf.o"));
pub const PREFILTER_PROGRAM: &str = "xdp_prefilter";

/// XDP verdicts (enum xdp_action).
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;

/// enum mp_xdp_counter (bpf/common.h), with their names in `DataplaneStats.extra`.
pub const XDP_COUNTERS: [&str; 4] = ["xdp_drop_stranger", "xdp_drop_bytes", "xdp_pass", "xdp_drop_no_stream"];

/// Pinned (kept across a restart) when a pin dir is given.
const PINNED_MAPS: [&str; 1] = ["xdp_counters"];

fn bpf_err(context: impl std::fmt::Display, e: libbpf_rs::Error) -> DataplaneError {
    DataplaneError::Other(format!("{context}: {e}"))
}

/// The loaded pre-filter, bound to one [`FastPath`]'s stream map.
pub struct Prefilter {
    obj: Object,
    pin_dir: Option<PathBuf>,
}

impl std::fmt::Debug for Prefilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefilter").field("pin_dir", &self.pin_dir).finish()
    }
}

impl Prefilter {
    /// Load (verify) the program with `fast`'s `streams` map as its own. Its counters are
    /// pinned in (or adopted from) `fast`'s pin dir.
    pub fn load(fast: &FastPath) -> Result<Prefilter, DataplaneError> {
        let streams = fast.map("streams");
        let mut open = ObjectBuilder::default().open_memory(PREFILTER_OBJECT).map_err(|e| bpf_err("opening the XDP pre-filter object", e))?;
        for mut m in open.maps_mut() {
            let name = m.name().to_string_lossy().into_owned();
            if name == "streams" {
                m.set_max_entries(streams.max_entries()).map_err(|e| bpf_err("sizing the shared streams map", e))?;
                m.reuse_fd(streams.as_fd()).map_err(|e| bpf_err("sharing the streams map", e))?;
            } else if let Some(dir) = fast.pin_dir().filter(|_| PINNED_MAPS.contains(&name.as_str())) {
                m.set_pin_path(dir.join(&name)).map_err(|e| bpf_err(format!("pin path of map {name}"), e))?;
            }
        }
        let obj = open.load().map_err(|e| bpf_err("loading the XDP pre-filter", e))?;
        let me = Prefilter { obj, pin_dir: fast.pin_dir().map(Path::to_path_buf) };
        let len = me.map("xdp_counters").max_entries();
        if len != XDP_COUNTERS.len() as u32 {
            return Err(DataplaneError::Other(format!("XDP counter enum ({len}) and XDP_COUNTERS ({}) disagree", XDP_COUNTERS.len())));
        }
        Ok(me)
    }

    pub fn program(&self) -> Program<'_> {
        self.obj.progs().find(|p| p.name() == PREFILTER_PROGRAM).expect("program in the embedded object")
    }

    fn map(&self, name: &str) -> libbpf_rs::Map<'_> {
        self.obj.maps().find(|m| m.name() == name).unwrap_or_else(|| panic!("map {name} in the pre-filter object"))
    }

    /// Every counter by name (see [`XDP_COUNTERS`]), summed over CPUs.
    pub fn counters(&self) -> Result<BTreeMap<&'static str, u64>, DataplaneError> {
        let map = self.map("xdp_counters");
        let mut out = BTreeMap::new();
        for (i, name) in XDP_COUNTERS.iter().enumerate() {
            out.insert(*name, percpu_sum::<u64>(&map, i as u32, |a, b| *a += b)?);
        }
        Ok(out)
    }

    /// (total run time ns, runs) while BPF run-time statistics are on.
    pub fn run_stats(&self) -> Option<(u64, u64)> {
        crate::loader::prog_run_stats(&self.program())
    }

    /// Run the program once on `frame` (`BPF_PROG_TEST_RUN`); returns the XDP verdict.
    // ProgramInput is non-exhaustive: no struct literal possible.
    #[allow(clippy::field_reassign_with_default)]
    pub fn test_run(&self, frame: &[u8]) -> Result<u32, DataplaneError> {
        let mut input = ProgramInput::default();
        input.data_in = Some(frame);
        let prog = self.obj.progs_mut().find(|p| p.name() == PREFILTER_PROGRAM).expect("program in the embedded object");
        Ok(prog.test_run(input).map_err(|e| bpf_err("BPF_PROG_TEST_RUN (XDP)", e))?.return_value)
    }

    /// Zero the counters (tests, benchmarks).
    pub fn reset_counters(&self) -> Result<(), DataplaneError> {
        let ncpu = libbpf_rs::num_possible_cpus().map_err(|e| bpf_err("counting CPUs", e))?;
        let map = self.map("xdp_counters");
        for i in 0..XDP_COUNTERS.len() as u32 {
            map.update_percpu(&i.to_ne_bytes(), &vec![0u64.to_ne_bytes().to_vec(); ncpu], MapFlags::ANY).map_err(|e| bpf_err("zeroing XDP counters", e))?;
        }
        Ok(())
    }

    /// Remove the map pins (the maps live on while this process holds them).
    pub fn unpin_maps(&self) -> Result<(), DataplaneError> {
        crate::loader::unpin(self.pin_dir.as_deref(), &PINNED_MAPS)
    }

    /// The counters and run time as `DataplaneStats.extra` entries.
    pub fn extra(&self) -> BTreeMap<String, u64> {
        let mut out: BTreeMap<String, u64> = match self.counters() {
            Ok(c) => c.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            Err(e) => {
                tracing::warn!("reading XDP counters: {e}");
                BTreeMap::new()
            }
        };
        if let Some((t, n)) = self.run_stats() {
            out.insert("xdp_run_time_ns".into(), t);
            out.insert("xdp_run_count".into(), n);
        }
        out
    }
}
