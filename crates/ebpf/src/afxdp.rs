//! `--dataplane afxdp`: the kernel-bypass plane. The XDP program `xsk_redirect`
//! (bpf/xsk_redirect.bpf.c) hands the datagrams sent to the SFU's addresses to AF_XDP sockets,
//! and the user-space plane's AF_XDP driver ([`mediaplane_dataplane::afxdp`]) runs the engine on
//! them and sends the copies from its UMEM. This module loads the program, attaches it to the
//! configured interfaces, keeps its maps (the SFU addresses, the sockets per queue) in step with
//! the plane, and reports its counters (`xsk_*` in `extra`).

use crate::attach::{self, Attachment};
use libbpf_rs::{MapCore, MapFlags, MapHandle, Object, ObjectBuilder};
use mediaplane_core::reception::ReceptionReport;
use mediaplane_core::table::IngressKey;
use mediaplane_core::ForwardingTable;
use mediaplane_dataplane::afxdp::{XskConfig, XskPortSpec};
use mediaplane_dataplane::{ConsumerCounters, Counters, Dataplane, DataplaneError, DataplaneEvent, DataplaneStats, UserspaceConfig, UserspaceDataplane};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;

/// The compiled program (bpf/xsk_redirect.bpf.c), embedded.
pub const XSK_OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/xsk_redirect.bpf.o"));
pub const XSK_PROGRAM: &str = "xsk_redirect";
/// enum xsk_counter, with their names in `DataplaneStats.extra`.
pub const XSK_COUNTERS: [&str; 4] = ["xsk_redirected", "xsk_pass_fragment", "xsk_fragments", "xsk_pass_no_socket"];

fn bpf_err(context: impl std::fmt::Display, e: libbpf_rs::Error) -> DataplaneError {
    DataplaneError::Other(format!("{context}: {e}"))
}

#[derive(Debug, Clone)]
pub struct AfxdpConfig {
    /// Interfaces media arrives on and leaves by: every receive queue of each gets a socket.
    pub interfaces: Vec<String>,
    /// The socket plane underneath (workers, header policy, ...); its `xsk` is set here.
    pub userspace: UserspaceConfig,
    pub mode: mediaplane_dataplane::afxdp::BindMode,
    /// UMEM frames per interface queue (see [`mediaplane_dataplane::afxdp::XskConfig::frames`]).
    pub frames: u32,
}

pub struct AfxdpDataplane {
    inner: UserspaceDataplane,
    /// Detached on shutdown.
    links: Mutex<Vec<Attachment>>,
    counters: MapHandle,
    /// Keeps the program and its maps loaded.
    _xdp: XskRedirect,
}

/// An `sfu_addrs` key (struct xsk_addr).
fn addr_key(a: &SocketAddr) -> [u8; 20] {
    let mut k = [0u8; 20];
    k[2..4].copy_from_slice(&a.port().to_be_bytes());
    match a {
        SocketAddr::V4(v) => {
            k[0] = 4;
            k[4..8].copy_from_slice(&v.ip().octets());
        }
        SocketAddr::V6(v) => {
            k[0] = 6;
            k[4..20].copy_from_slice(&v.ip().octets());
        }
    }
    k
}

fn queue_key(ifindex: u32, queue: u32) -> [u8; 8] {
    let mut k = [0u8; 8];
    k[..4].copy_from_slice(&ifindex.to_ne_bytes());
    k[4..].copy_from_slice(&queue.to_ne_bytes());
    k
}

/// The MAC of `ifname`.
fn mac_of(ifname: &str) -> Result<[u8; 6], DataplaneError> {
    mediaplane_dataplane::sys::if_mac(ifname).map_err(|e| DataplaneError::Unsupported(format!("{ifname}: {e}: AF_XDP needs Ethernet interfaces")))
}

/// The loaded XDP program (bpf/xsk_redirect.bpf.c) and its maps, not attached anywhere.
pub struct XskRedirect {
    obj: Object,
}

impl XskRedirect {
    pub fn load() -> Result<XskRedirect, DataplaneError> {
        let obj = ObjectBuilder::default()
            .open_memory(XSK_OBJECT)
            .and_then(|o| o.load())
            .map_err(|e| bpf_err("loading the AF_XDP redirect program (needs CAP_BPF and CAP_NET_ADMIN)", e))?;
        Ok(XskRedirect { obj })
    }

    /// An owned handle of one of its maps (usable from any thread).
    pub fn map(&self, name: &str) -> Result<MapHandle, DataplaneError> {
        let m = self.obj.maps().find(|m| m.name() == name).ok_or_else(|| DataplaneError::Other(format!("map {name} missing")))?;
        MapHandle::try_from(&m).map_err(|e| bpf_err(format!("map {name}"), e))
    }

    pub fn program(&self) -> libbpf_rs::Program<'_> {
        self.obj.progs().find(|p| p.name() == XSK_PROGRAM).expect("program in the embedded object")
    }

    /// Datagrams to (interface `ifindex`, queue) go to XSKMAP slot `slot`.
    pub fn set_slot(&self, ifindex: u32, queue: u32, slot: u32) -> Result<(), DataplaneError> {
        self.map("xsk_slots")?.update(&queue_key(ifindex, queue), &slot.to_ne_bytes(), MapFlags::ANY).map_err(|e| bpf_err("xsk_slots", e))
    }

    /// Make `addrs` SFU addresses (their datagrams are handed over).
    pub fn add_addresses(&self, addrs: &[SocketAddr]) -> Result<(), DataplaneError> {
        let m = self.map("sfu_addrs")?;
        addrs.iter().try_for_each(|a| m.update(&addr_key(a), &[1], MapFlags::ANY).map_err(|e| bpf_err(format!("sfu_addrs {a}"), e)))
    }

    /// The program's counters (enum xsk_counter), summed over CPUs.
    pub fn counters(&self) -> Result<BTreeMap<&'static str, u64>, DataplaneError> {
        counters_of(&self.map("xsk_counters")?)
    }

    /// Run the program once on `frame` (`BPF_PROG_TEST_RUN`), as if it arrived on queue 0 of
    /// the calling thread's namespace's loopback device; returns the XDP verdict.
    // ProgramInput is non-exhaustive: no struct literal possible.
    #[allow(clippy::field_reassign_with_default)]
    pub fn test_run(&self, frame: &[u8]) -> Result<u32, DataplaneError> {
        let mut input = libbpf_rs::ProgramInput::default();
        input.data_in = Some(frame);
        let prog = self.obj.progs_mut().find(|p| p.name() == XSK_PROGRAM).expect("program in the embedded object");
        Ok(prog.test_run(input).map_err(|e| bpf_err("BPF_PROG_TEST_RUN (XDP)", e))?.return_value)
    }
}

fn counters_of(map: &MapHandle) -> Result<BTreeMap<&'static str, u64>, DataplaneError> {
    let mut out = BTreeMap::new();
    for (i, name) in XSK_COUNTERS.iter().enumerate() {
        let per_cpu = map.lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY).map_err(|e| bpf_err("xsk_counters", e))?.unwrap_or_default();
        out.insert(*name, per_cpu.iter().map(|v| u64::from_ne_bytes(v[..8].try_into().unwrap_or([0; 8]))).sum());
    }
    Ok(out)
}

impl AfxdpDataplane {
    pub fn new(cfg: AfxdpConfig, events: Option<SyncSender<DataplaneEvent>>) -> Result<AfxdpDataplane, DataplaneError> {
        if cfg.interfaces.is_empty() {
            return Err(DataplaneError::Other("the afxdp data plane needs at least one interface (--interface)".into()));
        }
        let xdp = XskRedirect::load()?;
        let (addrs, xsks, counters) = (xdp.map("sfu_addrs")?, xdp.map("xsks")?, xdp.map("xsk_counters")?);
        let mut ports = Vec::new();
        for ifname in &cfg.interfaces {
            if ifname == "lo" {
                return Err(DataplaneError::Unsupported(
                    "the afxdp data plane cannot run on the loopback interface: give it Ethernet (or veth) interfaces".into(),
                ));
            }
            let ifindex = attach::ifindex_of(ifname)?;
            let mac = mac_of(ifname)?;
            for queue in 0..mediaplane_dataplane::sys::if_rx_queues(ifname) {
                let slot = ports.len() as u32;
                xdp.set_slot(ifindex, queue, slot)?;
                ports.push(XskPortSpec { ifname: ifname.clone(), ifindex, queue, mac });
            }
        }
        let slot_of: BTreeMap<(u32, u32), u32> = ports.iter().enumerate().map(|(i, p)| ((p.ifindex, p.queue), i as u32)).collect();
        let xsks = Arc::new(xsks);
        let register: mediaplane_dataplane::afxdp::RegisterXsk = Arc::new(move |p: &XskPortSpec, fd| {
            let slot = slot_of[&(p.ifindex, p.queue)];
            xsks.update(&slot.to_ne_bytes(), &(fd as u32).to_ne_bytes(), MapFlags::ANY)
                .map_err(|e| bpf_err(format!("registering the AF_XDP socket of {} queue {}", p.ifname, p.queue), e))
        });
        let addrs = Arc::new(Mutex::new(addrs));
        let sync: mediaplane_dataplane::afxdp::SyncAddresses = Arc::new(move |added: &[SocketAddr], removed: &[SocketAddr]| {
            let m = addrs.lock();
            for a in removed {
                let _ = m.delete(&addr_key(a));
            }
            for a in added {
                if let Err(e) = m.update(&addr_key(a), &[1], MapFlags::ANY) {
                    // Not lost: its datagrams take the socket path.
                    tracing::warn!(addr = %a, error = %e, "AF_XDP address map: this address's media stays on the socket path");
                }
            }
        });
        let mut us = cfg.userspace;
        us.steered = false;
        us.xsk = Some(XskConfig { ports, register, addresses: sync, mode: cfg.mode, frames: cfg.frames });
        let inner = UserspaceDataplane::new(us, events)?;
        let prog = xdp.program();
        let mut links = Vec::new();
        for ifname in &cfg.interfaces {
            match attach::attach_xdp(&prog, ifname, None) {
                Ok(l) => links.push(l),
                Err(DataplaneError::Other(e)) => {
                    links.into_iter().for_each(|l: Attachment| drop(l.detach()));
                    let _ = inner.shutdown();
                    let e = e.split(" (another XDP program").next().unwrap_or(&e).to_string();
                    return Err(DataplaneError::Other(format!(
                        "{e}: the afxdp plane needs its XDP program on every media interface (is another XDP program attached there?)"
                    )));
                }
                Err(e) => {
                    links.into_iter().for_each(|l: Attachment| drop(l.detach()));
                    let _ = inner.shutdown();
                    return Err(e);
                }
            }
        }
        Ok(AfxdpDataplane { inner, links: Mutex::new(links), counters, _xdp: xdp })
    }

    /// The XDP program's counters (enum xsk_counter), summed over CPUs.
    fn xsk_counters(&self) -> Vec<(&'static str, u64)> {
        counters_of(&self.counters).map(|c| c.into_iter().collect()).unwrap_or_else(|e| {
            tracing::warn!("reading the AF_XDP program's counters: {e}");
            Vec::new()
        })
    }
}

impl Dataplane for AfxdpDataplane {
    fn name(&self) -> &'static str {
        "afxdp"
    }

    fn apply(&self, table: Arc<ForwardingTable>) -> Result<(), DataplaneError> {
        self.inner.apply(table)
    }

    fn apply_changes(&self, table: Arc<ForwardingTable>, changed: &[IngressKey]) -> Result<(), DataplaneError> {
        self.inner.apply_changes(table, changed)
    }

    fn stats(&self) -> DataplaneStats {
        let mut st = self.inner.stats();
        st.dataplane = self.name().into();
        st.extra.extend(self.xsk_counters().into_iter().map(|(k, v)| (k.to_string(), v)));
        st
    }

    fn consumer_counters(&self, ids: &[u32]) -> BTreeMap<u32, ConsumerCounters> {
        self.inner.consumer_counters(ids)
    }

    fn consumer_reception(&self, ids: &[u32]) -> BTreeMap<u32, ReceptionReport> {
        self.inner.consumer_reception(ids)
    }

    fn stream_reception(&self, ids: &[u32]) -> BTreeMap<u32, ReceptionReport> {
        self.inner.stream_reception(ids)
    }

    fn stream_counters(&self, ids: &[u32]) -> BTreeMap<u32, Counters> {
        self.inner.stream_counters(ids)
    }

    fn send_datagram(&self, from: SocketAddr, to: SocketAddr, payload: &[u8]) -> Result<(), DataplaneError> {
        self.inner.send_datagram(from, to, payload)
    }

    fn shutdown(&self) -> Result<(), DataplaneError> {
        // The program first: datagrams go back to the stack (and the sockets) before the AF_XDP
        // sockets close.
        for l in self.links.lock().drain(..) {
            l.detach()?;
        }
        self.inner.shutdown()
    }
}

impl Drop for AfxdpDataplane {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_keys_are_struct_xsk_addr() {
        let k = addr_key(&"10.1.2.3:40000".parse().unwrap());
        assert_eq!(&k[..8], &[4, 0, 0x9c, 0x40, 10, 1, 2, 3]);
        assert!(k[8..].iter().all(|b| *b == 0));
        let k = addr_key(&"[fd00::1]:5".parse().unwrap());
        assert_eq!(&k[..4], &[6, 0, 0, 5]);
        assert_eq!(k[19], 1);
    }
}
