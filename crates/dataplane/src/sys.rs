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

/// Receive buffers for up to `batch` datagrams, reused across calls.
pub struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    addrs: Vec<libc::sockaddr_storage>,
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

/// One outgoing datagram: payload borrowed from a receive buffer.
pub struct Outgoing<'a> {
    pub to: SockAddr,
    pub payload: &'a [u8],
}

/// Send `msgs` from socket `fd` with as few `sendmmsg` calls as possible and return the indexes
/// of the messages the kernel refused (full buffer, no route...): each is skipped and counted
/// by the caller, never retried forever.
pub fn send_batch(fd: RawFd, msgs: &[&Outgoing<'_>]) -> Vec<usize> {
    let mut iovs: Vec<libc::iovec> =
        msgs.iter().map(|m| libc::iovec { iov_base: m.payload.as_ptr() as *mut _, iov_len: m.payload.len() }).collect();
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
