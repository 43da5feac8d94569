//! Slow-path steering: an sk_lookup program (bpf/slow_path_sk_lookup.bpf.c) that gives every
//! UDP packet the TC program passes up for an SFU address to one of the slow path's catch-all
//! sockets. The slow path then needs a handful of sockets instead of one per SFU address, so
//! the number of sessions is bounded by the kernel maps, not by file descriptors.

use crate::loader::bpf_err;
use libbpf_rs::{Link, MapCore, MapFlags, Object, ObjectBuilder};
use mediaplane_dataplane::DataplaneError;
use std::os::fd::{AsFd, AsRawFd, RawFd};

pub const SK_LOOKUP_OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/slow_path_sk_lookup.bpf.o"));
const PROGRAM: &str = "mp_slow_path_steer";
/// Sockets per family the program can choose from (MP_STEER_MAX in the C).
pub const MAX_SOCKETS: usize = 64;

/// The loaded program, attached to the calling thread's network namespace while this lives.
pub struct SlowPathSteering {
    obj: Object,
    _link: Link,
}

impl std::fmt::Debug for SlowPathSteering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlowPathSteering").finish_non_exhaustive()
    }
}

impl SlowPathSteering {
    /// Load the program over the fast path's `streams` map and steer to `v4` / `v6` sockets
    /// (unconnected UDP sockets with IP(V6)_RECVORIGDSTADDR on).
    pub fn attach(streams: &libbpf_rs::Map<'_>, v4: &[RawFd], v6: &[RawFd]) -> Result<SlowPathSteering, DataplaneError> {
        if v4.len() > MAX_SOCKETS || v6.len() > MAX_SOCKETS {
            return Err(DataplaneError::Other(format!("at most {MAX_SOCKETS} slow-path sockets per address family")));
        }
        let mut open = ObjectBuilder::default().open_memory(SK_LOOKUP_OBJECT).map_err(|e| bpf_err("opening the sk_lookup object", e))?;
        for mut m in open.maps_mut() {
            if m.name() == "streams" {
                m.reuse_fd(streams.as_fd()).map_err(|e| bpf_err("sharing the streams map with sk_lookup", e))?;
            }
        }
        let obj = open.load().map_err(|e| bpf_err("loading the sk_lookup program", e))?;
        {
            let map = |name: &str| obj.maps().find(|m| m.name() == name).expect("map in the embedded object");
            let sockets = map("steer_sockets");
            let count = map("steer_count");
            for (base, fds) in [(0, v4), (MAX_SOCKETS, v6)] {
                for (i, fd) in fds.iter().enumerate() {
                    let key = ((base + i) as u32).to_ne_bytes();
                    sockets.update(&key, &(*fd as u64).to_ne_bytes(), MapFlags::ANY).map_err(|e| bpf_err("adding a slow-path socket to the sockmap", e))?;
                }
            }
            for (fam, n) in [(0u32, v4.len()), (1, v6.len())] {
                count.update(&fam.to_ne_bytes(), &(n as u32).to_ne_bytes(), MapFlags::ANY).map_err(|e| bpf_err("writing the slow-path socket count", e))?;
            }
        }
        // This thread's namespace: the daemon (or a test thread) may have entered another one.
        let netns = std::fs::File::open("/proc/thread-self/ns/net")
            .map_err(|source| DataplaneError::Io { context: "opening /proc/thread-self/ns/net".into(), source })?;
        let link = {
            let prog = obj.progs_mut().find(|p| p.name() == PROGRAM).expect("program in the embedded object");
            prog.attach_netns(netns.as_raw_fd()).map_err(|e| bpf_err("attaching the sk_lookup program to the network namespace", e))?
        };
        Ok(SlowPathSteering { obj, _link: link })
    }

    /// (packets steered to a slow-path socket, packets that could not be assigned).
    pub fn stats(&self) -> (u64, u64) {
        let Some(map) = self.obj.maps().find(|m| m.name() == "steer_stats") else { return (0, 0) };
        let read = |k: u32| crate::loader::percpu_sum::<u64>(&map, k, |a, b| *a += b).unwrap_or(0);
        (read(0), read(1))
    }
}
