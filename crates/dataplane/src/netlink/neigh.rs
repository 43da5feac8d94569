//! Resolve a subscriber's next hop when its subscription is installed, not when its first packet
//! needs it: a thread asks the kernel (rtnetlink) for the route to each new copy destination and
//! has the neighbour of that route (the gateway, or the destination on a connected route)
//! resolved (RTM_NEWNEIGH with NTF_USE: an ARP / neighbour solicitation if the entry is not
//! valid, nothing if it is). The kernel path's bpf_fib_lookup then finds the neighbour valid and
//! the stream's first packets are forwarded in the kernel instead of taking the slow path.
//! Best effort: the order hold (bpf/order.h) keeps streams in order whenever a packet must still
//! go up (a neighbour flushed later, a resolution that failed).

use std::collections::HashSet;
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
const RTM_NEWNEIGH: u16 = 28;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_REPLACE: u16 = 0x100;
const NLM_F_CREATE: u16 = 0x400;
const RTA_DST: u16 = 1;
const RTA_SRC: u16 = 2;
const RTA_IIF: u16 = 3;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTN_UNICAST: u8 = 1;
const NDA_DST: u16 = 1;
const NTF_USE: u8 = 0x01;
/// Destinations waiting at most; more are counted as skipped (their first packets take the
/// slow path, in order, as before).
const QUEUE: usize = 65536;

/// Counters of the resolver, for `/v1/stats` `extra`.
#[derive(Debug, Default)]
pub struct ResolveStats {
    pub requested: AtomicU64,
    pub failed: AtomicU64,
    pub skipped: AtomicU64,
}

/// The resolver thread; stops (and is joined) on drop.
pub struct NeighbourResolver {
    tx: Option<SyncSender<IpAddr>>,
    /// Set on drop: the thread leaves what is still queued.
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<ResolveStats>,
}

impl NeighbourResolver {
    /// Start resolving in the calling thread's network namespace.
    pub fn start() -> io::Result<NeighbourResolver> {
        let sock = open()?;
        let (tx, rx) = sync_channel(QUEUE);
        let stats = Arc::new(ResolveStats::default());
        let st = stats.clone();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new().name("mp-neigh".into()).spawn(move || run(sock, rx, st, stop2))?;
        Ok(NeighbourResolver { tx: Some(tx), stop, thread: Some(thread), stats })
    }

    /// Queue destinations (duplicates in one call are sent once). Never blocks.
    pub fn resolve(&self, dsts: impl IntoIterator<Item = IpAddr>) {
        let Some(tx) = &self.tx else { return };
        let mut seen = HashSet::new();
        for d in dsts.into_iter().filter(|d| seen.insert(*d)) {
            match tx.try_send(d) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.stats.skipped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    pub fn stats(&self) -> [(&'static str, u64); 3] {
        let s = &self.stats;
        [
            ("neigh_resolve_requested", s.requested.load(Ordering::Relaxed)),
            ("neigh_resolve_failed", s.failed.load(Ordering::Relaxed)),
            ("neigh_resolve_skipped", s.skipped.load(Ordering::Relaxed)),
        ]
    }
}

impl Drop for NeighbourResolver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.tx.take(); // the thread's recv fails: it ends
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(sock: OwnedFd, rx: Receiver<IpAddr>, stats: Arc<ResolveStats>, stop: Arc<std::sync::atomic::AtomicBool>) {
    let mut seq = 1u32;
    while let Ok(dst) = rx.recv() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        stats.requested.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = resolve_one(&sock, dst, &mut seq) {
            stats.failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%dst, error = %e, "next-hop resolution");
        }
    }
}

fn open() -> io::Result<OwnedFd> {
    // SAFETY: plain syscalls with checked results; the fd is owned from creation on.
    unsafe {
        let fd = libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        // A reply that never comes must not hang the thread.
        let tv = libc::timeval { tv_sec: 1, tv_usec: 0 };
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        );
        Ok(fd)
    }
}

fn family_and_bytes(ip: IpAddr) -> (u8, Vec<u8>) {
    match ip {
        IpAddr::V4(a) => (libc::AF_INET as u8, a.octets().to_vec()),
        IpAddr::V6(a) => (libc::AF_INET6 as u8, a.octets().to_vec()),
    }
}

fn attr(buf: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let len = 4 + data.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(data);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// One request; returns the reply's payload (after the nlmsghdr) of the first message.
fn request(sock: &OwnedFd, kind: u16, flags: u16, seq: &mut u32, body: &[u8]) -> io::Result<(u16, Vec<u8>)> {
    *seq = seq.wrapping_add(1);
    let mut msg = Vec::with_capacity(16 + body.len());
    msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(body);
    // SAFETY: the buffer is valid for its length; the kernel is the destination (zeroed nladdr).
    let r = unsafe {
        let mut sa: libc::sockaddr_nl = std::mem::zeroed();
        sa.nl_family = libc::AF_NETLINK as u16;
        libc::sendto(
            sock.as_raw_fd(),
            msg.as_ptr().cast(),
            msg.len(),
            0,
            (&sa as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; 8192];
    loop {
        // SAFETY: buf is valid for its length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        if n < 16 {
            return Err(io::Error::other("short netlink reply"));
        }
        let len = (u32::from_ne_bytes(buf[0..4].try_into().unwrap()) as usize).min(n);
        if len < 16 {
            return Err(io::Error::other("malformed netlink reply"));
        }
        let rkind = u16::from_ne_bytes(buf[4..6].try_into().unwrap());
        let rseq = u32::from_ne_bytes(buf[8..12].try_into().unwrap());
        if rseq != *seq {
            continue; // a late reply to an earlier request
        }
        let payload = buf[16..len].to_vec();
        if rkind == NLMSG_ERROR {
            let err = i32::from_ne_bytes(payload.get(0..4).ok_or_else(|| io::Error::other("short error"))?.try_into().unwrap());
            if err != 0 {
                return Err(io::Error::from_raw_os_error(-err));
            }
        }
        return Ok((rkind, payload));
    }
}

/// The route to `dst`: its output interface and the address whose neighbour entry a frame to
/// `dst` needs (the gateway, or `dst` on a connected route); None for a route that is not
/// unicast (local, blackhole, unreachable...).
fn route_to(sock: &OwnedFd, dst: IpAddr, seq: &mut u32) -> io::Result<Option<(u32, Vec<u8>)>> {
    let (family, bytes) = family_and_bytes(dst);
    // struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags(u32).
    let mut body = vec![family, (bytes.len() * 8) as u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    attr(&mut body, RTA_DST, &bytes);
    let (kind, reply) = request(sock, RTM_GETROUTE, 0, seq, &body)?;
    if kind != RTM_NEWROUTE || reply.len() < 12 {
        return Err(io::Error::other("no route reply"));
    }
    if reply[7] != RTN_UNICAST {
        return Ok(None);
    }
    let (mut oif, mut gateway) = (None, None);
    for (kind, data) in attrs(&reply[12..]) {
        match kind {
            RTA_OIF if data.len() == 4 => oif = Some(u32::from_ne_bytes(data.try_into().unwrap())),
            RTA_GATEWAY if data.len() == bytes.len() => gateway = Some(data.to_vec()),
            _ => {}
        }
    }
    let oif = oif.ok_or_else(|| io::Error::other("route without an output interface"))?;
    Ok(Some((oif, gateway.unwrap_or(bytes))))
}

/// The (type, data) of each rtnetlink attribute in `buf`.
fn attrs(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at + 4 > buf.len() {
            return None;
        }
        let len = u16::from_ne_bytes(buf[at..at + 2].try_into().unwrap()) as usize;
        let kind = u16::from_ne_bytes(buf[at + 2..at + 4].try_into().unwrap());
        if len < 4 || at + len > buf.len() {
            return None;
        }
        let data = &buf[at + 4..at + len];
        at += len.next_multiple_of(4);
        Some((kind, data))
    })
}

/// Route to `dst`, then have that route's neighbour resolved.
fn resolve_one(sock: &OwnedFd, dst: IpAddr, seq: &mut u32) -> io::Result<()> {
    let Some((oif, neighbour)) = route_to(sock, dst, seq)? else {
        return Ok(()); // local, blackhole...: nothing to resolve
    };
    let (family, _) = family_and_bytes(dst);
    // struct ndmsg: family, pad1, pad2(u16), ifindex(i32), state(u16), flags, type.
    let mut body = vec![family, 0, 0, 0];
    body.extend_from_slice(&(oif as i32).to_ne_bytes());
    body.extend_from_slice(&0u16.to_ne_bytes()); // NUD_NONE: a new entry, resolved on use
    body.push(NTF_USE);
    body.push(0);
    attr(&mut body, NDA_DST, &neighbour);
    request(sock, RTM_NEWNEIGH, NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE, seq, &body).map(drop)
}

/// Where a frame to a destination goes: out of `ifindex`, to the link-layer address `mac`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextHop {
    pub ifindex: u32,
    pub mac: [u8; 6],
}

/// What a plane that builds its own frames asks of the host's routing: the route to a
/// destination and its neighbour's link-layer address, as the host would send a datagram there.
pub struct NextHopLookup {
    sock: OwnedFd,
    seq: u32,
}

/// Neighbour states whose link-layer address can be used (NUD_REACHABLE, STALE, DELAY, PROBE,
/// NOARP, PERMANENT): the same the kernel sends on.
const NUD_VALID: u16 = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80;
const RTM_GETNEIGH: u16 = 30;
const NDA_LLADDR: u16 = 2;

impl NextHopLookup {
    /// In the calling thread's network namespace.
    pub fn open() -> io::Result<NextHopLookup> {
        Ok(NextHopLookup { sock: open()?, seq: 1 })
    }

    /// Whether the host would accept a datagram from `src` to its own `dst` arriving on
    /// `iif`: the input route lookup (`ip route get <dst> from <src> iif <dev>`), which applies
    /// the interface's `rp_filter` as the stack does. Err: the question could not be asked.
    pub fn source_ok(&mut self, src: IpAddr, dst: IpAddr, iif: u32) -> io::Result<bool> {
        let (family, dst_bytes) = family_and_bytes(dst);
        let (_, src_bytes) = family_and_bytes(src);
        if src.is_ipv4() != dst.is_ipv4() {
            return Ok(false);
        }
        let mut body = vec![family, (dst_bytes.len() * 8) as u8, (src_bytes.len() * 8) as u8, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        attr(&mut body, RTA_DST, &dst_bytes);
        attr(&mut body, RTA_SRC, &src_bytes);
        attr(&mut body, RTA_IIF, &iif.to_ne_bytes());
        match request(&self.sock, RTM_GETROUTE, 0, &mut self.seq, &body) {
            Ok((RTM_NEWROUTE, _)) => Ok(true),
            Ok(_) => Err(io::Error::other("no route reply")),
            // What the stack answers a source it drops: a reverse-path failure (EXDEV), a martian
            // (EINVAL), no route back (ENETUNREACH, EHOSTUNREACH).
            Err(e) if matches!(e.raw_os_error(), Some(libc::EXDEV | libc::EINVAL | libc::ENETUNREACH | libc::EHOSTUNREACH)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The next hop of a unicast route to `dst` with a valid Ethernet neighbour; None when there
    /// is none (no route, a local or blackhole route, a neighbour not resolved yet: the host's
    /// own stack must send it, and resolves it meanwhile).
    pub fn lookup(&mut self, dst: IpAddr) -> io::Result<Option<NextHop>> {
        let Some((oif, neighbour)) = route_to(&self.sock, dst, &mut self.seq)? else { return Ok(None) };
        let (family, _) = family_and_bytes(dst);
        let mut body = vec![family, 0, 0, 0];
        body.extend_from_slice(&(oif as i32).to_ne_bytes());
        body.extend_from_slice(&[0, 0, 0, 0]);
        attr(&mut body, NDA_DST, &neighbour);
        let reply = match request(&self.sock, RTM_GETNEIGH, 0, &mut self.seq, &body) {
            Ok((RTM_NEWNEIGH, reply)) if reply.len() >= 12 => reply,
            Ok(_) => return Err(io::Error::other("no neighbour reply")),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            Err(e) => return Err(e),
        };
        let state = u16::from_ne_bytes(reply[8..10].try_into().unwrap());
        if state & NUD_VALID == 0 {
            return Ok(None);
        }
        let mac = attrs(&reply[12..]).find(|(k, d)| *k == NDA_LLADDR && d.len() == 6).map(|(_, d)| <[u8; 6]>::try_from(d).unwrap());
        Ok(mac.map(|mac| NextHop { ifindex: oif, mac }))
    }
}
