//! Thin, safe wrappers over the batched socket and readiness syscalls the user-space plane needs
//! (`recvmmsg`, `sendmmsg`, epoll, eventfd): std has none of them.

use socket2::SockAddr;
use std::io;
use std::mem::{size_of, zeroed, MaybeUninit};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Control-message space per datagram: room for one IP(V6)_ORIGDSTADDR (a sockaddr_in6), one
/// SO_MARK and one SCM_TIMESTAMPNS (48 + 24 + 32 bytes).
const CTRL_LEN: usize = 128;

/// Receive buffers for up to `batch` datagrams, reused across calls.
pub struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    addrs: Vec<libc::sockaddr_storage>,
    /// u64s: cmsghdr alignment.
    ctrl: Vec<[u64; CTRL_LEN / 8]>,
    iovs: Vec<libc::iovec>,
    hdrs: Vec<libc::mmsghdr>,
}

// The raw pointers inside point into the batch's own vectors.
unsafe impl Send for RecvBatch {}

impl RecvBatch {
    pub fn new(batch: usize, mtu: usize) -> Self {
        RecvBatch {
            bufs: (0..batch).map(|_| vec![0u8; mtu]).collect(),
            addrs: vec![unsafe { zeroed() }; batch],
            ctrl: vec![[0; CTRL_LEN / 8]; batch],
            iovs: Vec::with_capacity(batch),
            hdrs: Vec::with_capacity(batch),
        }
    }

    /// One `recvmmsg` (non-blocking). Returns how many datagrams arrived; read them with `get`.
    pub fn recv(&mut self, fd: RawFd) -> io::Result<usize> {
        let n = self.bufs.len();
        self.iovs.clear();
        self.hdrs.clear();
        for i in 0..n {
            self.iovs.push(libc::iovec { iov_base: self.bufs[i].as_mut_ptr().cast(), iov_len: self.bufs[i].len() });
        }
        for i in 0..n {
            let mut h: libc::mmsghdr = unsafe { zeroed() };
            h.msg_hdr.msg_name = (&mut self.addrs[i] as *mut libc::sockaddr_storage).cast();
            h.msg_hdr.msg_namelen = size_of::<libc::sockaddr_storage>() as u32;
            h.msg_hdr.msg_iov = &mut self.iovs[i];
            h.msg_hdr.msg_iovlen = 1;
            h.msg_hdr.msg_control = self.ctrl[i].as_mut_ptr().cast();
            h.msg_hdr.msg_controllen = CTRL_LEN;
            self.hdrs.push(h);
        }
        let r = unsafe { libc::recvmmsg(fd, self.hdrs.as_mut_ptr(), n as u32, libc::MSG_DONTWAIT, std::ptr::null_mut()) };
        cvt(r).map(|r| r as usize)
    }

    pub fn capacity(&self) -> usize {
        self.bufs.len()
    }

    /// The i-th received datagram: (source, payload, truncated?).
    pub fn get(&self, i: usize) -> (Option<SocketAddr>, &[u8], bool) {
        let h = &self.hdrs[i];
        let len = h.msg_len as usize;
        let truncated = h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
        let storage = self.addrs[i];
        let addr = unsafe { SockAddr::new(storage, h.msg_hdr.msg_namelen) }.as_socket();
        (addr, &self.bufs[i][..len.min(self.bufs[i].len())], truncated)
    }
}

impl RecvBatch {
    /// The first control message of the i-th datagram that `read` makes something of: it gets
    /// each message's (level, type, data).
    fn control<T>(&self, i: usize, mut read: impl FnMut(libc::c_int, libc::c_int, *const u8) -> Option<T>) -> Option<T> {
        let h = &self.hdrs[i].msg_hdr;
        // SAFETY: the CMSG_* macros walk the control buffer the kernel filled, bounded by
        // msg_controllen; `read` copies payloads out unaligned.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(h);
            while !c.is_null() {
                if let Some(v) = read((*c).cmsg_level, (*c).cmsg_type, libc::CMSG_DATA(c)) {
                    return Some(v);
                }
                c = libc::CMSG_NXTHDR(h, c);
            }
        }
        None
    }

    /// Where the i-th datagram was sent to, from its IP(V6)_ORIGDSTADDR control message (only
    /// on sockets with [`set_recv_orig_dst`]: packets steered to a catch-all socket).
    pub fn orig_dst(&self, i: usize) -> Option<SocketAddr> {
        // SAFETY (both reads): the kernel wrote a sockaddr of the type's size after this header.
        self.control(i, |level, kind, data| match (level, kind) {
            (libc::SOL_IP, libc::IP_ORIGDSTADDR) => {
                let sa: libc::sockaddr_in = unsafe { std::ptr::read_unaligned(data.cast()) };
                let ip = std::net::Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr));
                Some(SocketAddr::new(ip.into(), u16::from_be(sa.sin_port)))
            }
            (libc::SOL_IPV6, libc::IPV6_ORIGDSTADDR) => {
                let sa: libc::sockaddr_in6 = unsafe { std::ptr::read_unaligned(data.cast()) };
                let ip = std::net::Ipv6Addr::from(sa.sin6_addr.s6_addr);
                Some(SocketAddr::new(ip.into(), u16::from_be(sa.sin6_port)))
            }
            _ => None,
        })
    }

    /// The i-th datagram's fwmark, from its SO_MARK control message (sockets with
    /// [`set_recv_mark`]; 0 when it carried none).
    pub fn mark(&self, i: usize) -> u32 {
        // SAFETY: SO_MARK's payload is a u32.
        self.control(i, |level, kind, data| {
            (level == libc::SOL_SOCKET && kind == libc::SO_MARK).then(|| unsafe { std::ptr::read_unaligned(data.cast::<u32>()) })
        })
        .unwrap_or(0)
    }

    /// When the kernel received the i-th datagram (CLOCK_REALTIME ns), from its SCM_TIMESTAMPNS
    /// control message (sockets with [`set_recv_timestamps`]).
    pub fn received_realtime_ns(&self, i: usize) -> Option<i64> {
        self.control(i, |level, kind, data| {
            (level == libc::SOL_SOCKET && kind == libc::SCM_TIMESTAMPNS).then(|| {
                // SAFETY: SCM_TIMESTAMPNS's payload is a timespec.
                let ts: libc::timespec = unsafe { std::ptr::read_unaligned(data.cast()) };
                ts.tv_sec * 1_000_000_000 + ts.tv_nsec
            })
        })
    }
}

/// What every datagram sent from `fd` carries in its IP header (see [`crate::HeaderPolicy`]):
/// TTL / hop limit, DSCP (ECN Not-ECT), and on IPv6 no automatic flow label.
pub fn set_header_policy(fd: RawFd, v6: bool, p: &crate::HeaderPolicy) -> io::Result<()> {
    const IPV6_AUTOFLOWLABEL: libc::c_int = 70;
    let set = |level: libc::c_int, opt: libc::c_int, v: libc::c_int| {
        // SAFETY: setsockopt with a pointer to a live c_int of the stated size.
        cvt(unsafe { libc::setsockopt(fd, level, opt, (&v as *const libc::c_int).cast(), size_of::<libc::c_int>() as u32) }).map(drop)
    };
    if v6 {
        set(libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS, p.hop_limit as libc::c_int)?;
        set(libc::IPPROTO_IPV6, libc::IPV6_TCLASS, p.tos() as libc::c_int)?;
        set(libc::IPPROTO_IPV6, IPV6_AUTOFLOWLABEL, 0)
    } else {
        set(libc::IPPROTO_IP, libc::IP_TTL, p.ttl as libc::c_int)?;
        set(libc::IPPROTO_IP, libc::IP_TOS, p.tos() as libc::c_int)
    }
}

/// Ask for each datagram's fwmark (SO_RCVMARK, Linux 5.19+).
pub fn set_recv_mark(fd: RawFd) -> io::Result<()> {
    const SO_RCVMARK: libc::c_int = 75;
    let one: libc::c_int = 1;
    // SAFETY: setsockopt with a pointer to a live c_int of the stated size.
    cvt(unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, SO_RCVMARK, (&one as *const libc::c_int).cast(), size_of::<libc::c_int>() as u32) }).map(drop)
}

/// Ask for each datagram's kernel receive time (SO_TIMESTAMPNS): what a receiver feeds back
/// to a sender's delay-based estimate is when packets arrived, not when a worker got to them.
pub fn set_recv_timestamps(fd: RawFd) -> io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: setsockopt with a pointer to a live c_int of the stated size.
    cvt(unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, (&one as *const libc::c_int).cast(), size_of::<libc::c_int>() as u32) }).map(drop)
}

/// Ask for each datagram's original destination (IP_RECVORIGDSTADDR / IPV6_RECVORIGDSTADDR).
pub fn set_recv_orig_dst(fd: RawFd, v6: bool) -> io::Result<()> {
    let one: libc::c_int = 1;
    let (level, opt) = if v6 { (libc::SOL_IPV6, libc::IPV6_RECVORIGDSTADDR) } else { (libc::SOL_IP, libc::IP_RECVORIGDSTADDR) };
    // SAFETY: setsockopt with a pointer to a live c_int of the stated size.
    cvt(unsafe { libc::setsockopt(fd, level, opt, (&one as *const libc::c_int).cast(), size_of::<libc::c_int>() as u32) }).map(drop)
}

/// Send one complete IP packet (header included) on a raw `IPPROTO_RAW` socket.
pub fn send_raw_ip(fd: RawFd, packet: &[u8], to: &SockAddr) -> io::Result<()> {
    // SAFETY: the buffer and address outlive the call.
    let r = unsafe { libc::sendto(fd, packet.as_ptr().cast(), packet.len(), libc::MSG_DONTWAIT, to.as_ptr().cast(), to.len()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Send one UDP datagram (`udp`: header and payload, checksum filled in) from local address
/// `from` (as IP_PKTINFO / IPV6_PKTINFO) on a raw `IPPROTO_UDP` socket without header inclusion:
/// the kernel builds the IP header from the socket's options and, like for a UDP socket,
/// fragments the packet to the path MTU.
pub fn send_raw_udp(fd: RawFd, from: std::net::IpAddr, udp: &[u8], to: &SockAddr) -> io::Result<()> {
    let mut ctrl = [0u64; 8];
    let mut iov = libc::iovec { iov_base: udp.as_ptr() as *mut _, iov_len: udp.len() };
    let mut h: libc::msghdr = unsafe { zeroed() };
    h.msg_name = to.as_ptr() as *mut _;
    h.msg_namelen = to.len();
    h.msg_iov = &mut iov;
    h.msg_iovlen = 1;
    h.msg_control = ctrl.as_mut_ptr().cast();
    let (level, kind, len) = match from {
        std::net::IpAddr::V4(_) => (libc::SOL_IP, libc::IP_PKTINFO, size_of::<libc::in_pktinfo>()),
        std::net::IpAddr::V6(_) => (libc::SOL_IPV6, libc::IPV6_PKTINFO, size_of::<libc::in6_pktinfo>()),
    };
    // SAFETY: the control buffer (64 bytes, u64-aligned) holds one cmsghdr with either pktinfo;
    // the payload is written unaligned; every buffer outlives the call.
    let r = unsafe {
        h.msg_controllen = libc::CMSG_SPACE(len as u32) as usize;
        let c = libc::CMSG_FIRSTHDR(&h);
        (*c).cmsg_level = level;
        (*c).cmsg_type = kind;
        (*c).cmsg_len = libc::CMSG_LEN(len as u32) as usize;
        match from {
            std::net::IpAddr::V4(ip) => {
                let info =
                    libc::in_pktinfo { ipi_ifindex: 0, ipi_spec_dst: libc::in_addr { s_addr: u32::from(ip).to_be() }, ipi_addr: libc::in_addr { s_addr: 0 } };
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast(), info);
            }
            std::net::IpAddr::V6(ip) => {
                let info = libc::in6_pktinfo { ipi6_addr: libc::in6_addr { s6_addr: ip.octets() }, ipi6_ifindex: 0 };
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast(), info);
            }
        }
        libc::sendmsg(fd, &h, libc::MSG_DONTWAIT)
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// One outgoing datagram: payload borrowed from a receive buffer.
pub struct Outgoing<'a> {
    pub to: SockAddr,
    /// Borrowed from the receive batch, or owned (an SRTP leg's copy, protected or unprotected).
    pub payload: std::borrow::Cow<'a, [u8]>,
}

/// Send `msgs` from socket `fd` with as few `sendmmsg` calls as possible and return the indexes
/// of the messages the kernel refused (full buffer, no route...): each is skipped and counted
/// by the caller, never retried forever.
pub fn send_batch(fd: RawFd, msgs: &[&Outgoing<'_>]) -> Vec<usize> {
    let mut iovs: Vec<libc::iovec> = msgs.iter().map(|m| libc::iovec { iov_base: m.payload.as_ptr() as *mut _, iov_len: m.payload.len() }).collect();
    let mut hdrs: Vec<libc::mmsghdr> = msgs
        .iter()
        .zip(iovs.iter_mut())
        .map(|(m, iov)| {
            let mut h: libc::mmsghdr = unsafe { zeroed() };
            h.msg_hdr.msg_name = m.to.as_ptr() as *mut _;
            h.msg_hdr.msg_namelen = m.to.len();
            h.msg_hdr.msg_iov = iov;
            h.msg_hdr.msg_iovlen = 1;
            h
        })
        .collect();
    let mut failed = Vec::new();
    let mut at = 0;
    while at < hdrs.len() {
        let r = unsafe { libc::sendmmsg(fd, hdrs[at..].as_mut_ptr(), (hdrs.len() - at) as u32, libc::MSG_DONTWAIT) };
        if r > 0 {
            at += r as usize;
        } else if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            failed.push(at);
            at += 1;
        }
    }
    failed
}

/// A minimal epoll instance; tokens are caller-chosen u64s.
pub struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    pub fn new() -> io::Result<Self> {
        let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        Ok(Epoll { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    pub fn add(&self, fd: RawFd, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: token };
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) }).map(drop)
    }

    pub fn remove(&self, fd: RawFd) -> io::Result<()> {
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) }).map(drop)
    }

    /// Wait up to `timeout_ms`; fills `out` with ready tokens.
    pub fn wait(&self, out: &mut Vec<u64>, timeout_ms: i32) -> io::Result<()> {
        let mut evs: [MaybeUninit<libc::epoll_event>; 64] = unsafe { MaybeUninit::uninit().assume_init() };
        let r = unsafe { libc::epoll_wait(self.fd.as_raw_fd(), evs.as_mut_ptr().cast(), evs.len() as i32, timeout_ms) };
        out.clear();
        match cvt(r) {
            Ok(n) => {
                for ev in &evs[..n as usize] {
                    out.push(unsafe { ev.assume_init() }.u64);
                }
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// An eventfd used to wake a worker blocked in epoll.
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    pub fn new() -> io::Result<Self> {
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        Ok(EventFd { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }
    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
    pub fn notify(&self) {
        let one: u64 = 1;
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
    pub fn drain(&self) {
        let mut v: u64 = 0;
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

/// Process CPU time (user + system) in nanoseconds.
pub fn process_cpu_ns() -> u64 {
    let mut ts: libc::timespec = unsafe { zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Resident memory of process `pid` (None: this one), bytes (VmRSS of /proc/<pid>/status).
pub fn rss_bytes(pid: Option<u32>) -> u64 {
    let path = pid.map_or("/proc/self/status".to_string(), |p| format!("/proc/{p}/status"));
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Kernel memory of the BPF maps process `pid` (None: this one) holds open, bytes: the sum of
/// their `memlock` in /proc/<pid>/fdinfo.
pub fn bpf_map_bytes(pid: Option<u32>) -> u64 {
    let dir = pid.map_or("/proc/self/fdinfo".to_string(), |p| format!("/proc/{p}/fdinfo"));
    let Ok(fds) = std::fs::read_dir(dir) else { return 0 };
    let mut total = 0;
    for fd in fds.flatten() {
        let Ok(info) = std::fs::read_to_string(fd.path()) else { continue };
        if !info.contains("map_type:") {
            continue;
        }
        total += info.lines().find(|l| l.starts_with("memlock:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()).unwrap_or(0);
    }
    total
}

/// The host's own counters of packets it drops before any socket sees them, for the causes the
/// kernel path counts itself (`drop_bad_checksum`, `drop_spoofed`): the socket plane cannot see
/// those packets, the namespace's stack counts them (nstat's IpInHdrErrors, UdpInCsumErrors,
/// Udp6InCsumErrors, TcpExtIPReversePathFilter). Namespace-wide: other traffic counts too.
pub fn host_drop_counters() -> Vec<(&'static str, u64)> {
    fn field(text: &str, prefix: &str, name: &str) -> Option<u64> {
        // Pairs of lines "Prefix: names..." / "Prefix: values...".
        let mut lines = text.lines().filter(|l| l.starts_with(prefix));
        while let (Some(names), Some(values)) = (lines.next(), lines.next()) {
            if let Some(i) = names.split_whitespace().position(|n| n == name) {
                return values.split_whitespace().nth(i)?.parse().ok();
            }
        }
        None
    }
    let snmp = std::fs::read_to_string("/proc/net/snmp").unwrap_or_default();
    let netstat = std::fs::read_to_string("/proc/net/netstat").unwrap_or_default();
    let snmp6 = std::fs::read_to_string("/proc/net/snmp6").unwrap_or_default();
    let udp6 = snmp6.lines().find_map(|l| l.strip_prefix("Udp6InCsumErrors")).and_then(|v| v.trim().parse().ok());
    [
        ("host_ip_in_hdr_errors", field(&snmp, "Ip:", "InHdrErrors")),
        ("host_udp_in_csum_errors", field(&snmp, "Udp:", "InCsumErrors")),
        ("host_udp6_in_csum_errors", udp6),
        ("host_ip_reverse_path_filter", field(&netstat, "TcpExt:", "IPReversePathFilter")),
    ]
    .into_iter()
    .filter_map(|(k, v)| Some((k, v?)))
    .collect()
}

/// An interface ioctl on a throwaway socket of the calling thread's network namespace (sysfs may
/// show another namespace's devices, e.g. under `nsenter --net`). `fill` sets the request's
/// union; the answer is read from the returned ifreq.
fn if_ioctl(name: &str, request: libc::c_ulong, fill: impl FnOnce(&mut libc::ifreq)) -> io::Result<libc::ifreq> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad interface name {name:?}")));
    }
    // SAFETY: a zeroed ifreq naming the device, passed to an ioctl that reads and writes only it;
    // the socket is closed before returning.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (d, s) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
            *d = s as libc::c_char;
        }
        fill(&mut ifr);
        let r = libc::ioctl(fd, request, &mut ifr);
        let err = io::Error::last_os_error();
        libc::close(fd);
        if r != 0 {
            return Err(err);
        }
        Ok(ifr)
    }
}

/// The MTU of `name`.
pub fn if_mtu(name: &str) -> io::Result<u32> {
    // SAFETY: SIOCGIFMTU answers in ifr_mtu.
    if_ioctl(name, libc::SIOCGIFMTU, |_| {}).map(|r| unsafe { r.ifr_ifru.ifru_mtu } as u32)
}

/// The Ethernet address of `name`; an error for a device without one (loopback, tun, ...).
pub fn if_mac(name: &str) -> io::Result<[u8; 6]> {
    let r = if_ioctl(name, libc::SIOCGIFHWADDR, |_| {})?;
    // SAFETY: SIOCGIFHWADDR answers in ifr_hwaddr.
    let hw = unsafe { r.ifr_ifru.ifru_hwaddr };
    if hw.sa_family != libc::ARPHRD_ETHER {
        return Err(io::Error::new(io::ErrorKind::Unsupported, format!("{name} is not an Ethernet device (ARPHRD {})", hw.sa_family)));
    }
    let mut mac = [0u8; 6];
    for (m, b) in mac.iter_mut().zip(hw.sa_data.iter()) {
        *m = *b as u8;
    }
    Ok(mac)
}

/// The receive queues of `name` (ETHTOOL_GCHANNELS: rx + combined channels); 1 when the driver
/// does not say.
pub fn if_rx_queues(name: &str) -> u32 {
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    const ETHTOOL_GCHANNELS: u32 = 0x3c;
    // struct ethtool_channels: cmd, max_rx, max_tx, max_other, max_combined, rx_count,
    // tx_count, other_count, combined_count.
    let mut ch = [0u32; 9];
    ch[0] = ETHTOOL_GCHANNELS;
    let ptr = ch.as_mut_ptr();
    let ok = if_ioctl(name, SIOCETHTOOL, |ifr| ifr.ifr_ifru.ifru_data = ptr.cast()).is_ok();
    if ok {
        (ch[5] + ch[8]).max(1)
    } else {
        1
    }
}
