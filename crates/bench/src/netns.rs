//! A star testbed in network namespaces: one SFU namespace, `n` participant namespaces, each
//! participant linked to the SFU namespace by a veth pair.
//!
//! ```text
//!   <prefix>-p0  10.77.0.2/24  <prefix>p0 ══ <prefix>s0  10.77.0.1/24 ┐
//!   <prefix>-p1  10.77.1.2/24  <prefix>p1 ══ <prefix>s1  10.77.1.1/24 ├ <prefix>-sfu (ip_forward=1)
//!   ...                                                                 ┘
//! ```
//!
//! Participants route everything via the SFU side of their link, and the SFU namespace forwards
//! in the kernel, so participant → participant packets addressed to the peer's own IP take the
//! **direct path** (no SFU process) — the baseline of "added delay". Packets addressed to a
//! `sfu_ip` reach whatever SFU process listens in the SFU namespace.
//!
//! Safety: every name carries a per-run random prefix that did not exist before; the testbed only
//! ever deletes namespaces it created itself; addresses (10.77.0.0/16) live only inside them.

use std::fs::File;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context};
use socket2::{Domain, Protocol, Socket, Type};

/// Where `ip netns` keeps its named namespaces.
pub const NETNS_DIR: &str = "/var/run/netns";

/// Largest star: participant i uses 10.77.i.0/24.
pub const MAX_PEERS: usize = 250;

/// One participant namespace of a star.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Namespace name.
    pub ns: String,
    /// The participant's address (10.77.i.2).
    pub ip: IpAddr,
    /// The SFU namespace's address on this participant's link (10.77.i.1), also its gateway.
    pub sfu_ip: IpAddr,
    /// The veth name inside the SFU namespace for this participant's link.
    pub sfu_if: String,
    /// The veth name inside the participant namespace.
    pub peer_if: String,
    /// IPv6 on the link, after [`Testbed::add_ipv6`]: the participant's (fd77:i::2) and the SFU
    /// side's (fd77:i::1).
    pub ip6: Option<IpAddr>,
    pub sfu_ip6: Option<IpAddr>,
}

/// Interface counters (see [`Testbed::link_counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LinkCounters {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub rx_dropped: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub tx_dropped: u64,
}

/// A star of network namespaces, deleted on drop (also when a test panics).
///
/// Processes started with [`Testbed::command`] keep their namespace alive after deletion of its
/// name: kill them before the testbed drops.
#[derive(Debug)]
pub struct Testbed {
    /// Per-run unique prefix ("mp" + 6 hex digits) of every namespace and interface name.
    pub prefix: String,
    pub sfu_ns: String,
    pub peers: Vec<Peer>,
    /// Namespaces this testbed created, in creation order: exactly what Drop deletes.
    created: Vec<String>,
}

impl Testbed {
    /// Build a star of `n` participants around one SFU namespace. Needs root.
    pub fn star(n: usize) -> anyhow::Result<Testbed> {
        if n > MAX_PEERS {
            bail!("star({n}): at most {MAX_PEERS} participants");
        }
        let prefix = unused_prefix()?;
        let mut bed = Testbed { sfu_ns: format!("{prefix}-sfu"), prefix, peers: Vec::new(), created: Vec::new() };
        // From here on, an early return drops `bed`, which deletes whatever was created.
        bed.add_netns(&bed.sfu_ns.clone())?;
        for i in 0..n {
            let peer = Peer {
                ns: format!("{}-p{i}", bed.prefix),
                ip: IpAddr::V4(Ipv4Addr::new(10, 77, i as u8, 2)),
                sfu_ip: IpAddr::V4(Ipv4Addr::new(10, 77, i as u8, 1)),
                sfu_if: format!("{}s{i}", bed.prefix),
                peer_if: format!("{}p{i}", bed.prefix),
                ip6: None,
                sfu_ip6: None,
            };
            debug_assert!(peer.sfu_if.len() <= 15 && peer.peer_if.len() <= 15, "IFNAMSIZ");
            bed.add_netns(&peer.ns)?;
            bed.peers.push(peer);
        }

        // One `ip -batch` per namespace keeps setup at n + 2 processes plus the netns adds.
        let mut sfu_batch = String::from("link set lo up\n");
        for p in &bed.peers {
            // Create the pair directly in its two namespaces: nothing ever appears in the root ns.
            sfu_batch += &format!("link add {} type veth peer name {} netns {}\n", p.sfu_if, p.peer_if, p.ns);
            sfu_batch += &format!("addr add {}/24 dev {}\n", p.sfu_ip, p.sfu_if);
            sfu_batch += &format!("link set {} up\n", p.sfu_if);
        }
        ip_batch(&bed.sfu_ns, &sfu_batch)?;
        for p in &bed.peers {
            let batch = format!(
                "link set lo up\naddr add {ip}/24 dev {dev}\nlink set {dev} up\nroute add default via {gw}\n",
                ip = p.ip,
                dev = p.peer_if,
                gw = p.sfu_ip
            );
            ip_batch(&p.ns, &batch)?;
        }
        // /proc/sys/net is per network namespace: opened from inside the SFU namespace, it is
        // the SFU namespace's.
        bed.in_ns(&bed.sfu_ns, || std::fs::write("/proc/sys/net/ipv4/ip_forward", "1"))?.context("enabling ip_forward in the SFU namespace")?;
        tracing::debug!(prefix = %bed.prefix, peers = n, "testbed up");
        Ok(bed)
    }

    /// Give every link IPv6 as well: fd77:i::1/64 on the SFU side, fd77:i::2/64 in participant
    /// i, routed via the SFU side, which forwards IPv6 too. Without duplicate address detection,
    /// so the addresses can be bound at once.
    pub fn add_ipv6(&mut self) -> anyhow::Result<()> {
        let mut sfu_batch = String::new();
        for (i, p) in self.peers.iter_mut().enumerate() {
            let (peer, sfu) = (IpAddr::V6(Ipv6Addr::new(0xfd77, i as u16, 0, 0, 0, 0, 0, 2)), IpAddr::V6(Ipv6Addr::new(0xfd77, i as u16, 0, 0, 0, 0, 0, 1)));
            sfu_batch += &format!("addr add {sfu}/64 dev {} nodad\n", p.sfu_if);
            ip_batch(&p.ns, &format!("addr add {peer}/64 dev {dev} nodad\nroute add default via {sfu} dev {dev}\n", dev = p.peer_if))?;
            (p.ip6, p.sfu_ip6) = (Some(peer), Some(sfu));
        }
        ip_batch(&self.sfu_ns, &sfu_batch)?;
        self.in_ns(&self.sfu_ns, || std::fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1"))?.context("enabling IPv6 forwarding in the SFU namespace")?;
        Ok(())
    }

    /// Names of namespaces whose name starts with `prefix` (for tests: expect none after drop).
    pub fn leftovers(prefix: &str) -> Vec<String> {
        let Ok(dir) = std::fs::read_dir(NETNS_DIR) else {
            return Vec::new();
        };
        let mut names: Vec<String> = dir.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|name| name.starts_with(prefix)).collect();
        names.sort();
        names
    }

    /// Every namespace of this testbed (SFU first).
    pub fn namespaces(&self) -> impl Iterator<Item = &str> {
        self.created.iter().map(String::as_str)
    }

    /// Run `f` on a short-lived thread that has entered namespace `ns` (one of this testbed's).
    /// Sockets created by `f` stay in `ns` for their whole life.
    pub fn in_ns<T: Send>(&self, ns: &str, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
        self.check_ours(ns)?;
        in_netns(ns, f)
    }

    /// A UDP socket bound to `bind` inside namespace `ns`. Blocking, as std creates them.
    pub fn udp_socket(&self, ns: &str, bind: SocketAddr) -> io::Result<UdpSocket> {
        self.in_ns(ns, || -> io::Result<UdpSocket> {
            let socket = Socket::new(Domain::for_address(bind), Type::DGRAM, Some(Protocol::UDP))?;
            socket.bind(&bind.into())?;
            Ok(socket.into())
        })
        .map_err(io::Error::other)?
    }

    /// `ip netns exec <ns> <program>`; add arguments to the returned command. Panics if `ns` is
    /// not one of this testbed's namespaces (a programming error, and a safety net).
    pub fn command(&self, ns: &str, program: &str) -> Command {
        if let Err(e) = self.check_ours(ns) {
            panic!("{e}");
        }
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns, program]);
        cmd
    }

    /// Interface counters of `dev` in namespace `ns` (`ip -s -j link show`), e.g. to prove which
    /// path packets took.
    pub fn link_counters(&self, ns: &str, dev: &str) -> anyhow::Result<LinkCounters> {
        self.check_ours(ns)?;
        let out = Command::new("ip").args(["-n", ns, "-s", "-j", "link", "show", "dev", dev]).output()?;
        if !out.status.success() {
            bail!("ip -n {ns} -s link show dev {dev}: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let stats = &json[0]["stats64"];
        let get = |dir: &str, key: &str| stats[dir][key].as_u64().with_context(|| format!("no stats64.{dir}.{key} for {dev}"));
        Ok(LinkCounters {
            rx_packets: get("rx", "packets")?,
            rx_bytes: get("rx", "bytes")?,
            rx_dropped: get("rx", "dropped")?,
            tx_packets: get("tx", "packets")?,
            tx_bytes: get("tx", "bytes")?,
            tx_dropped: get("tx", "dropped")?,
        })
    }

    /// The participant whose namespace is `ns`.
    pub fn peer(&self, ns: &str) -> Option<&Peer> {
        self.peers.iter().find(|p| p.ns == ns)
    }

    fn check_ours(&self, ns: &str) -> anyhow::Result<()> {
        if !self.created.iter().any(|c| c == ns) {
            bail!("namespace {ns:?} does not belong to testbed {}", self.prefix);
        }
        Ok(())
    }

    fn add_netns(&mut self, name: &str) -> anyhow::Result<()> {
        run_ip(&["netns", "add", name])?;
        self.created.push(name.to_string());
        Ok(())
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        // Deleting a namespace destroys its end of every veth pair, which destroys the pair.
        for ns in self.created.iter().rev() {
            if let Err(e) = run_ip(&["netns", "del", ns]) {
                // Drop must not panic (it may run during unwinding): report and go on.
                tracing::warn!(%ns, "testbed teardown: {e:#}");
                eprintln!("mediaplane-bench: testbed teardown of {ns} failed: {e:#}");
            }
        }
    }
}

/// Run `f` on a short-lived thread inside the named namespace (`/var/run/netns/<ns>`).
pub(crate) fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
    let path = Path::new(NETNS_DIR).join(ns);
    let ns_file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    std::thread::scope(|scope| {
        scope
            .spawn(move || -> anyhow::Result<T> {
                // setns(CLONE_NEWNET) affects only the calling thread; the thread ends after `f`.
                // SAFETY: plain syscall on a valid open fd.
                if unsafe { libc::setns(ns_file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(io::Error::last_os_error()).with_context(|| format!("setns into {ns}"));
                }
                Ok(f())
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// A prefix "mp" + 6 hex digits no existing namespace starts with. Random (getrandom) mixed with
/// the pid and a per-process counter, so parallel tests and concurrent runs do not collide.
fn unused_prefix() -> anyhow::Result<String> {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    for _ in 0..100 {
        let mut random = [0u8; 4];
        // SAFETY: writes at most 4 bytes into `random`.
        let got = unsafe { libc::getrandom(random.as_mut_ptr().cast(), random.len(), 0) };
        let mut x = if got == 4 { u32::from_ne_bytes(random) } else { 0 };
        x ^= std::process::id().wrapping_mul(0x9e37_79b9) ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x85eb_ca6b);
        let prefix = format!("mp{:06x}", x & 0xff_ffff);
        if Testbed::leftovers(&prefix).is_empty() {
            return Ok(prefix);
        }
    }
    bail!("no unused namespace prefix found")
}

fn run_ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output().context("running ip (iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn ip_batch(ns: &str, batch: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut child = Command::new("ip")
        .args(["-n", ns, "-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running ip (iproute2)")?;
    child.stdin.take().expect("piped stdin").write_all(batch.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("ip -n {ns} -batch failed: {}\nbatch:\n{batch}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}
