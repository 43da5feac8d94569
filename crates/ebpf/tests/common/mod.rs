//! Helpers for the kernel tests: root gate, unique names, network namespaces, a private bpffs,
//! frame capture. Everything created here is removed by Drop guards, on success and on panic.
#![allow(dead_code)]

pub mod layer_gen;
pub mod rig;

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// True when the test may run. Not root: fail under CI=true, else skip with a message.
pub use mediaplane_bench::require_root;

/// A short name unique to this process and call: "mp" + 4 hex of the pid/time + a counter.
/// Interface names built from it stay within 15 characters.
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let seed = std::process::id() ^ (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos() >> 8);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("mp{:04x}{n:x}{tag}", seed & 0xffff)
}

pub fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("running {args:?}: {e}"));
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// A named network namespace (`ip netns add`), deleted on drop (which removes its interfaces).
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(tag: &str) -> Netns {
        let name = unique(tag);
        sh(&["ip", "netns", "add", &name]);
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// `ip -n <ns> <args>`
    pub fn ip(&self, args: &[&str]) {
        let mut v = vec!["ip", "-n", &self.name];
        v.extend_from_slice(args);
        sh(&v);
    }

    /// Move the calling thread into this namespace until the guard drops.
    pub fn enter(&self) -> NetnsGuard {
        let orig = File::open("/proc/thread-self/ns/net").expect("own netns");
        let target = File::open(format!("/run/netns/{}", self.name)).expect("netns file");
        // SAFETY: valid fds; CLONE_NEWNET setns affects only this thread.
        let rc = unsafe { libc::setns(target.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
        NetnsGuard { orig }
    }

    /// Write a sysctl of this namespace (e.g. "net/ipv4/conf/all/forwarding").
    pub fn sysctl(&self, key: &str, value: &str) {
        let _g = self.enter();
        std::fs::write(format!("/proc/sys/{key}"), value).unwrap_or_else(|e| panic!("sysctl {key}: {e}"));
    }

    /// Run `f` on a thread inside this namespace (sockets it creates stay in the namespace).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let name = self.name.clone();
        std::thread::spawn(move || {
            let ns = Netns { name };
            let g = ns.enter();
            let r = f();
            drop(g);
            std::mem::forget(ns); // not ours to delete
            r
        })
        .join()
        .expect("netns thread")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

pub struct NetnsGuard {
    orig: File,
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        // SAFETY: valid fd.
        unsafe { libc::setns(self.orig.as_raw_fd(), libc::CLONE_NEWNET) };
    }
}

/// A private bpffs mounted on a fresh directory, unmounted and removed on drop.
pub struct Bpffs {
    pub dir: PathBuf,
}

impl Bpffs {
    pub fn new() -> Bpffs {
        let dir = std::env::temp_dir().join(unique("bpffs"));
        std::fs::create_dir_all(&dir).unwrap();
        sh(&["mount", "-t", "bpf", "bpf", dir.to_str().unwrap()]);
        Bpffs { dir }
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).output();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

pub fn ifindex(name: &str) -> u32 {
    let c = CString::new(name).unwrap();
    // SAFETY: valid C string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    assert!(i != 0, "no interface {name}");
    i
}

/// An AF_PACKET socket on one interface of the calling thread's namespace.
pub struct Capture {
    fd: OwnedFd,
}

impl Capture {
    pub fn new(ifname: &str) -> Capture {
        let proto = (libc::ETH_P_ALL as u16).to_be() as i32;
        // SAFETY: plain socket calls with checked results.
        unsafe {
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto);
            assert!(fd >= 0, "AF_PACKET socket: {}", std::io::Error::last_os_error());
            let fd = OwnedFd::from_raw_fd(fd);
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = proto as u16;
            sll.sll_ifindex = ifindex(ifname) as i32;
            let rc = libc::bind(fd.as_raw_fd(), &sll as *const _ as *const libc::sockaddr, std::mem::size_of::<libc::sockaddr_ll>() as u32);
            assert_eq!(rc, 0, "bind AF_PACKET: {}", std::io::Error::last_os_error());
            let tv = libc::timeval { tv_sec: 0, tv_usec: 50_000 };
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            );
            let big: libc::c_int = 8 << 20;
            libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &big as *const _ as *const libc::c_void, 4);
            Capture { fd }
        }
    }

    /// Frames that `keep` accepts, until `want` of them or `timeout` (then a short grace period
    /// to catch extra, unexpected frames).
    pub fn collect(&self, want: usize, timeout: Duration, keep: impl Fn(&[u8]) -> bool) -> Vec<Vec<u8>> {
        self.collect_for(want, timeout, Duration::from_millis(100), keep)
    }

    /// [`Capture::collect`] with the grace period given; a zero grace only takes what is
    /// already queued once `want` frames are in (copies sent by `bpf_clone_redirect` inside
    /// BPF_PROG_TEST_RUN are queued before the syscall returns: the veth peer's receive softirq
    /// runs when the transmit path re-enables bottom halves).
    pub fn collect_for(&self, want: usize, timeout: Duration, grace: Duration, keep: impl Fn(&[u8]) -> bool) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let start = Instant::now();
        let mut deadline = start + timeout;
        let mut buf = vec![0u8; 65536];
        let mut extended = false;
        loop {
            if out.len() >= want && !extended {
                if grace.is_zero() {
                    break;
                }
                deadline = Instant::now() + grace;
                extended = true;
            }
            if Instant::now() >= deadline {
                break;
            }
            // SAFETY: buf is valid for its length.
            let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
            if n > 0 && keep(&buf[..n as usize]) {
                out.push(buf[..n as usize].to_vec());
            }
        }
        if grace.is_zero() {
            loop {
                // SAFETY: buf is valid for its length.
                let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), libc::MSG_DONTWAIT) };
                if n < 0 {
                    break;
                }
                if n > 0 && keep(&buf[..n as usize]) {
                    out.push(buf[..n as usize].to_vec());
                }
            }
        }
        out
    }
}

/// A star: one SFU namespace, `n` participant namespaces, each linked by a veth pair
/// (s<i> in the SFU namespace, 10.201.<i>.1/24; p<i> in the participant's, 10.201.<i>.2/24).
pub struct Star {
    pub sfu: Netns,
    pub participants: Vec<Netns>,
    /// SFU-side interface names.
    pub sfu_ifs: Vec<String>,
}

impl Star {
    pub fn new(n: usize) -> Star {
        let sfu = Netns::new("s");
        sfu.sysctl("net/ipv4/conf/all/forwarding", "1");
        let mut participants = Vec::new();
        let mut sfu_ifs = Vec::new();
        for i in 0..n {
            let p = Netns::new(&format!("p{i}"));
            let s_if = format!("{}s{i}", sfu.name);
            let p_if = format!("{}p{i}", sfu.name);
            sfu.ip(&["link", "add", &s_if, "type", "veth", "peer", "name", &p_if]);
            sfu.ip(&["link", "set", &p_if, "netns", &p.name]);
            sfu.ip(&["addr", "add", &format!("10.201.{i}.1/24"), "dev", &s_if]);
            sfu.ip(&["link", "set", &s_if, "up"]);
            p.ip(&["addr", "add", &format!("10.201.{i}.2/24"), "dev", &p_if]);
            p.ip(&["link", "set", &p_if, "up"]);
            participants.push(p);
            sfu_ifs.push(s_if);
        }
        Star { sfu, participants, sfu_ifs }
    }

    pub fn sfu_addr(i: usize) -> std::net::SocketAddr {
        format!("10.201.{i}.1:4000").parse().unwrap()
    }

    pub fn participant_addr(i: usize) -> std::net::SocketAddr {
        format!("10.201.{i}.2:5000").parse().unwrap()
    }

    /// A UDP socket bound in participant `i`'s namespace.
    pub fn socket(&self, i: usize, port: u16) -> std::net::UdpSocket {
        let addr: std::net::SocketAddr = format!("10.201.{i}.2:{port}").parse().unwrap();
        self.participants[i].run(move || {
            let s = std::net::UdpSocket::bind(addr).expect("bind participant socket");
            s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            // Tests read after sending everything: room for thousands of datagrams.
            let big: libc::c_int = 32 << 20;
            // SAFETY: valid fd and option buffer.
            unsafe { libc::setsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &big as *const _ as *const libc::c_void, 4) };
            s
        })
    }
}

/// Everything a socket receives until `quiet` passes without a datagram (or `max` elapses).
pub fn drain(sock: &std::net::UdpSocket, quiet: Duration, max: Duration) -> Vec<(std::net::SocketAddr, Vec<u8>)> {
    let start = Instant::now();
    let mut last = Instant::now();
    let mut out = Vec::new();
    let mut buf = [0u8; 2048];
    while start.elapsed() < max && last.elapsed() < quiet {
        if let Ok((n, from)) = sock.recv_from(&mut buf) {
            out.push((from, buf[..n].to_vec()));
            last = Instant::now();
        }
    }
    out
}

/// splitmix64: small and seedable (random frames, mutations, simulcast scenarios).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        self.below_u64(n as u64) as usize
    }
    pub fn below_u64(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}
