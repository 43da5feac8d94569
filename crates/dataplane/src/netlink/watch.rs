//! Hears of every change to what a next hop depends on: a thread listens to rtnetlink (links,
//! addresses, routes, rules, neighbours, nexthop objects, IPv4 per-device settings such as
//! `rp_filter`) and calls its owner's `on_change` once per burst of messages, so a plane that
//! caches next hops (the kernel path's `bpf_fib_lookup` results; a plane that builds its own
//! frames) resolves them again instead of using a MAC or interface that may no longer be right.

use crate::DataplaneError;
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

/// Called once per burst of changes (and when messages were lost, or a refresh found one).
pub type OnChange = Box<dyn FnMut() + Send>;

/// The listener thread; stops (and is joined) on drop.
pub struct RouteWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RouteWatch {
    /// Start listening in the calling thread's network namespace. `on_change` is not called for
    /// what happened before: a caller with a cache fills it after this returns, or invalidates it
    /// once itself.
    pub fn start(on_change: OnChange, refresh: Option<Refresh>) -> Result<RouteWatch, DataplaneError> {
        let fd = open_socket().map_err(|source| DataplaneError::Io { context: "rtnetlink socket".into(), source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("mp-nh-watch".into())
            .spawn(move || run(fd, on_change, stop2, refresh))
            .map_err(|source| DataplaneError::Io { context: "spawning the next-hop watcher".into(), source })?;
        Ok(RouteWatch { stop, thread: Some(thread) })
    }
}

fn run(fd: OwnedFd, mut on_change: OnChange, stop: Arc<AtomicBool>, mut refresh: Option<Refresh>) {
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
                on_change();
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
            on_change();
        }
    }
}

impl Drop for RouteWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
