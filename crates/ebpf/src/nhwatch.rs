//! Keeps the kernel's next-hop cache honest: a thread listens to rtnetlink (links, addresses,
//! routes, rules, neighbours, nexthop objects) and bumps the cache generation (`nh_gen`) on
//! every change it hears of, so the program resolves next hops again with `bpf_fib_lookup`
//! instead of using a cached MAC or interface that may no longer be right. The cache entries also
//! expire on their own (NH_CACHE_TTL_NS), which bounds staleness when nobody listens (after
//! `kill -9`, or if netlink messages were lost).

use libbpf_rs::{MapCore, MapFlags, MapHandle};
use mediaplane_dataplane::DataplaneError;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

// rtnetlink multicast groups (linux/rtnetlink.h), as bind() bits (group n is bit n-1).
const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_NEIGH: u32 = 0x4;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV4_RULE: u32 = 0x80;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;
const RTNLGRP_IPV6_RULE: u32 = 19;
/// Announces IPv4 per-device settings as they are written, `rp_filter` among them
/// (RTM_NEWNETCONF with NETCONFA_RP_FILTER, for `conf/all` and each device).
const RTNLGRP_IPV4_NETCONF: u32 = 24;
const RTNLGRP_NEXTHOP: u32 = 32;
const SOL_NETLINK: libc::c_int = 270;

/// Bump the generation in `nh_gen[0]` (wrapping).
pub fn bump(gen_map: &MapHandle) -> Result<u32, DataplaneError> {
    let key = 0u32.to_ne_bytes();
    let cur = gen_map
        .lookup(&key, MapFlags::ANY)
        .map_err(|e| DataplaneError::Other(format!("reading nh_gen: {e}")))?
        .map(|v| u32::from_ne_bytes(v[..4].try_into().unwrap()))
        .unwrap_or(0);
    let next = cur.wrapping_add(1);
    gen_map.update(&key, &next.to_ne_bytes(), MapFlags::ANY).map_err(|e| DataplaneError::Other(format!("writing nh_gen: {e}")))?;
    Ok(next)
}

fn open_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscalls with checked results; the fd is owned from creation on.
    unsafe {
        let fd = libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, libc::NETLINK_ROUTE);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut sa: libc::sockaddr_nl = std::mem::zeroed();
        sa.nl_family = libc::AF_NETLINK as u16;
        sa.nl_groups = RTMGRP_LINK
            | RTMGRP_NEIGH
            | RTMGRP_IPV4_IFADDR
            | RTMGRP_IPV4_ROUTE
            | RTMGRP_IPV4_RULE
            | RTMGRP_IPV6_IFADDR
            | RTMGRP_IPV6_ROUTE
            | (1 << (RTNLGRP_IPV6_RULE - 1))
            | (1 << (RTNLGRP_IPV4_NETCONF - 1));
        let r = libc::bind(fd.as_raw_fd(), &sa as *const _ as *const libc::sockaddr, std::mem::size_of::<libc::sockaddr_nl>() as u32);
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Groups above 31 need NETLINK_ADD_MEMBERSHIP; older kernels lack nexthop objects.
        let g = RTNLGRP_NEXTHOP as libc::c_int;
        let _ = libc::setsockopt(fd.as_raw_fd(), SOL_NETLINK, libc::NETLINK_ADD_MEMBERSHIP, &g as *const _ as *const libc::c_void, 4);
        Ok(fd)
    }
}

/// Something to re-check whenever netlink announces a change, and about once a second beside it
/// (the rp_filter sysctls: a write is announced on RTNLGRP_IPV4_NETCONF, which this watcher
/// hears, so a change applies within milliseconds; the poll covers lost messages): true when it
/// changed something the cached next hops and reverse-path passes depend on.
pub type Refresh = Box<dyn FnMut() -> bool + Send>;

/// The listener thread; stops (and is joined) on drop.
pub struct NextHopWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl NextHopWatch {
    /// Start listening in the calling thread's network namespace.
    pub fn start(gen_map: MapHandle, refresh: Option<Refresh>) -> Result<NextHopWatch, DataplaneError> {
        let fd = open_socket().map_err(|source| DataplaneError::Io { context: "rtnetlink socket".into(), source })?;
        // A change may have happened between the program's first lookups and now.
        bump(&gen_map)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("mp-nh-watch".into())
            .spawn(move || run(fd, gen_map, stop2, refresh))
            .map_err(|source| DataplaneError::Io { context: "spawning the next-hop watcher".into(), source })?;
        Ok(NextHopWatch { stop, thread: Some(thread) })
    }
}

fn run(fd: OwnedFd, gen_map: MapHandle, stop: Arc<AtomicBool>, mut refresh: Option<Refresh>) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut last_refresh = std::time::Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, 200) };
        let mut changed = false;
        if n > 0 || last_refresh.elapsed() >= std::time::Duration::from_secs(1) {
            // Refreshed before the queue is drained: a sysctl write is announced after it took
            // effect, so what is read now is at least as new as what was announced.
            last_refresh = std::time::Instant::now();
            changed |= refresh.as_mut().is_some_and(|r| r());
        }
        if n <= 0 {
            if changed {
                if let Err(e) = bump(&gen_map) {
                    tracing::warn!("next-hop cache invalidation failed: {e}");
                }
            }
            continue;
        }
        // Drain everything queued, then bump once: a burst of changes costs one map update.
        for _ in 0..1024 {
            // SAFETY: buf is valid for its length.
            let r = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
            if r > 0 {
                changed = true;
                continue;
            }
            let err = std::io::Error::last_os_error();
            // ENOBUFS: messages were lost, so something changed that we did not see.
            if r < 0 && err.raw_os_error() == Some(libc::ENOBUFS) {
                changed = true;
                continue;
            }
            break;
        }
        if changed {
            if let Err(e) = bump(&gen_map) {
                tracing::warn!("next-hop cache invalidation failed: {e}");
            }
        }
    }
}

impl Drop for NextHopWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
