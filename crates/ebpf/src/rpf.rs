//! Keeps the program's IPv4 reverse-path modes (`rpf_mode`, bpf/rpf.h) equal to the kernel's:
//! per interface, the larger of `net.ipv4.conf.all.rp_filter` and `net.ipv4.conf.<dev>.rp_filter`
//! (as fib_validate_source applies them), read at start and again whenever the next-hop
//! watcher hears of a change (a write is announced on rtnetlink's IPv4 netconf group) or polls
//! (once a second, in case a message was lost).

use crate::maps::{Pod, RpfMode};
use libbpf_rs::{MapCore, MapFlags};
use mediaplane_dataplane::DataplaneError;

/// Write one interface's mode (Off removes its entry).
pub fn write_mode(map: &impl MapCore, ifindex: u32, mode: RpfMode) -> Result<(), DataplaneError> {
    let r = match mode {
        RpfMode::Off => match map.delete(ifindex.as_bytes()) {
            Err(e) if e.kind() == libbpf_rs::ErrorKind::NotFound => Ok(()),
            r => r,
        },
        m => map.update(ifindex.as_bytes(), (m as u32).as_bytes(), MapFlags::ANY),
    };
    r.map_err(|e| crate::loader::bpf_err("writing rpf_mode", e))
}

/// The kernel's reverse-path mode for packets arriving on `ifname` (loopback: never checked).
pub fn host_mode(ifname: &str) -> RpfMode {
    if ifname == "lo" {
        return RpfMode::Off;
    }
    let read =
        |dev: &str| std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{dev}/rp_filter")).ok().and_then(|v| v.trim().parse::<u32>().ok()).unwrap_or(0);
    RpfMode::from_sysctl(read("all").max(read(ifname)))
}

/// The interfaces the program is attached to and the modes last written for them.
pub struct RpfSync<M: MapCore> {
    map: M,
    interfaces: Vec<(String, u32, Option<RpfMode>)>,
}

impl<M: MapCore> RpfSync<M> {
    pub fn new(map: M, interfaces: &[(String, u32)]) -> Self {
        RpfSync { map, interfaces: interfaces.iter().map(|(n, i)| (n.clone(), *i, None)).collect() }
    }

    /// Write every mode that changed since the last call; true if any did (cached passes must
    /// then be renewed: bump the next-hop generation).
    pub fn refresh(&mut self) -> Result<bool, DataplaneError> {
        let mut changed = false;
        for (name, ifindex, last) in &mut self.interfaces {
            let mode = host_mode(name);
            if *last != Some(mode) {
                write_mode(&self.map, *ifindex, mode)?;
                if last.is_some() {
                    tracing::info!(ifname = %name, ?mode, "reverse-path mode changed");
                }
                *last = Some(mode);
                changed = true;
            }
        }
        Ok(changed)
    }
}
