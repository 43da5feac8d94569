//! `mediaplane bench relay`: the P4 RTP-relay experiment (seed 002) on a Linux box. N concurrent
//! G.711 calls are set up over the NG protocol at a fixed rate, each call = two legs of
//! 50 packets/s of 172-byte RTP, through three relays in turn on the same testbed and the same
//! traffic: mediaplane's user-space plane, mediaplane's eBPF plane, and rtpengine (user space).
//!
//! Topology: a star of two (caller namespace, callee namespace) around a relay namespace that
//! runs the relay process and the NG client (the SIP proxy's place). The relay advertises one
//! media address (its address on the caller's link); the callee reaches it through the relay
//! namespace's routing.
//!
//! Per run: NG set-up latency (offer, answer) and achieved set-up rate, latching, then a paced
//! media run measuring per leg one-way delay, RFC 4689 delay variation, RFC 3550 jitter, loss and
//! G.107 MOS; the relay's CPU (all threads, /proc schedstat) and, for eBPF, the BPF program's run
//! time; the generator's own CPU; then every call is deleted over NG.
//!
//! A capacity phase then measures the API layer: NG calls/s and HTTP `POST /v1/relays`/s into a
//! mediaplane eBPF daemon, installing relay sessions up to a target (1,000,000 by default) or the
//! first error or the time budget, with the daemon's VmRSS and the BPF maps' memlock along the
//! way, and an in-process breakdown of what one mutation costs (model clone, table compile,
//! store write) at growing model sizes.

use crate::conference::process_cpu_ns;
use crate::conference::{extra_delta, kernel_split, KERNEL_FORWARD};
use crate::relay_report;
use anyhow::{bail, Context};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::process::Supervised;
use mediaplane_bench::qos::{Summary, ValueRecorder};
use mediaplane_bench::traffic::{self, Profile, TrafficPlan};
use mediaplane_core::srtp::{SrtpKey, SrtpSuite};
use mediaplane_dataplane::srtp::Context as SrtpContext;
use mediaplane_ng::client::{advertised, delete, g711_sdp, offer_answer, text, NgClient};
use mediaplane_ng::sdp::{crypto_line, Sdp};
use serde_json::{json, Value as Json};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The relay's NG address inside the relay namespace (where a SIP proxy there reaches it).
pub const NG: &str = "127.0.0.1:2223";
const API: &str = "127.0.0.1:7580";
/// Relay media ports (4 per call: two RTP legs and their RTCP neighbours): 12,500 calls.
const RELAY_PORT_MIN: u16 = 10000;
const RELAY_PORT_MAX: u16 = 59999;
/// Party media ports: call i uses PARTY_PORT_BASE + 2i on both sides.
const PARTY_PORT_BASE: u16 = 10000;
const MAX_CALLS: usize = 12_000;

/// `mediaplane-ebpf` is the eBPF plane as it starts by default (no XDP pre-filter on veth);
/// `mediaplane-ebpf-xdp` has the pre-filter on and `mediaplane-ebpf-noxdp` off (an A/B of what
/// the pre-filter costs relayed media: on veth, XDP copies every packet into a page first).
/// `kernel-forward` is no relay at all: the parties send to each other through the relay
/// namespace's IP forwarding, the floor every relay's machine CPU per packet is compared with.
pub const RELAYS: [&str; 7] =
    ["mediaplane-userspace", "mediaplane-afxdp", "mediaplane-ebpf", "mediaplane-ebpf-xdp", "mediaplane-ebpf-noxdp", "rtpengine", KERNEL_FORWARD];

#[derive(clap::Args)]
pub struct BenchRelayArgs {
    /// A seconds-long smoke run: 20 and 50 calls, 1 s of media, a small capacity phase.
    #[arg(long)]
    quick: bool,
    /// Concurrent calls per run (default 750,1500,1800,5000,10000; quick: 20,50).
    #[arg(long, value_delimiter = ',')]
    calls: Option<Vec<usize>>,
    /// Relays to compare: mediaplane-userspace, mediaplane-afxdp, mediaplane-ebpf, mediaplane-ebpf-xdp, mediaplane-ebpf-noxdp, rtpengine,
    /// and kernel-forward (no relay: the baseline of machine CPU per packet).
    #[arg(long, value_delimiter = ',', default_value = "kernel-forward,mediaplane-userspace,mediaplane-ebpf,mediaplane-ebpf-xdp,rtpengine")]
    relays: Vec<String>,
    /// What the calls' legs speak: `rtp` (plain RTP on both), `sdes-rtp` (the caller SDES-SRTP,
    /// AES_CM_128_HMAC_SHA1_80, bridged by the relay to the callee's plain RTP: the relay
    /// decrypts one direction and encrypts the other). kernel-forward runs `rtp` only.
    #[arg(long, value_delimiter = ',', default_value = "rtp")]
    media: Vec<Media>,
    /// Calls set up per second over NG (the seed: 30/s; quick: 100/s).
    #[arg(long)]
    setup_rate: Option<f64>,
    /// Seconds of media once every call is up (default 30; quick 1).
    #[arg(long)]
    seconds: Option<f64>,
    /// Seconds the relay's CPU is measured with every call up and latched but silent, before
    /// the media (default 10; quick 1; 0 skips it): what calls on hold cost.
    #[arg(long)]
    idle_seconds: Option<f64>,
    /// Relay sessions to install in the capacity phase (default 1,000,000; quick 2,000).
    #[arg(long)]
    capacity: Option<usize>,
    /// Time budget of each capacity measurement, seconds (default 300; quick 3).
    #[arg(long)]
    capacity_seconds: Option<f64>,
    /// Skip the capacity phase.
    #[arg(long)]
    skip_capacity: bool,
    /// Concurrent HTTP clients in the capacity phase.
    #[arg(long, default_value_t = 4)]
    capacity_clients: usize,
    /// Relays per request of the batch ramp (`POST /v1/batch/relays`); 0 or 1 skips it.
    #[arg(long, default_value_t = 1000)]
    capacity_batch: usize,
    /// Directory for results.json, results.csv, report.html and plots.
    #[arg(long, default_value = "bench-results/relay")]
    out: PathBuf,
}

// ---------------------------------------------------------------------------------------------
// Results
// ---------------------------------------------------------------------------------------------

pub use crate::relay_results::{Capacity, CapacityRamp, CapacitySample, MutationCost, RelayRun};

// ---------------------------------------------------------------------------------------------
// Small system helpers
// ---------------------------------------------------------------------------------------------

/// Raise RLIMIT_NOFILE to 1,048,576 (children inherit it): a relay holds a socket per port.
fn raise_nofile() {
    let want: libc::rlim_t = 1 << 20;
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls on a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        let new = libc::rlimit { rlim_cur: want.max(r.rlim_cur), rlim_max: want.max(r.rlim_max) };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &new) != 0 {
            let fallback = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
            libc::setrlimit(libc::RLIMIT_NOFILE, &fallback);
        }
    }
}

pub fn rss_kib(pid: u32) -> u64 {
    mediaplane_dataplane::sys::rss_bytes(Some(pid)) / 1024
}

/// Sum of `memlock` over the BPF maps a process holds open.
pub fn bpf_memlock(pid: u32) -> u64 {
    mediaplane_dataplane::sys::bpf_map_bytes(Some(pid))
}

fn summary(r: &ValueRecorder) -> Summary {
    r.summary()
}

/// The benchmark's calls: G.711 µ-law (PCMU), as in the seed.
fn sdp(ip: IpAddr, port: u16, session: usize) -> String {
    g711_sdp(ip, port, session, 0)
}

/// What a call's two legs speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Media {
    /// Plain RTP on both legs: the relay forwards.
    Rtp,
    /// The caller speaks SDES-SRTP, the callee plain RTP: the relay terminates SRTP toward the
    /// caller (unprotects what it sends, protects what it gets) as a SIP-to-WebRTC gateway does.
    SdesRtp,
}

impl Media {
    pub fn name(self) -> &'static str {
        match self {
            Media::Rtp => "rtp",
            Media::SdesRtp => "sdes-rtp",
        }
    }
}

/// The suite the bench's SRTP caller offers (the one every SDES party speaks).
const SUITE: SrtpSuite = SrtpSuite::AesCm128HmacSha1_80;

/// A fresh master key and salt from the kernel's random source.
fn random_key() -> anyhow::Result<SrtpKey> {
    let mut master = vec![0u8; SUITE.master_len()];
    // SAFETY: getrandom writes at most `len` bytes into the buffer it is given.
    let got = unsafe { libc::getrandom(master.as_mut_ptr().cast(), master.len(), 0) };
    if got != master.len() as isize {
        bail!("getrandom: {}", std::io::Error::last_os_error());
    }
    SrtpKey::new(SUITE, master).map_err(anyhow::Error::msg)
}

/// The caller's SDES offer: the plain SDP as RTP/SAVP with its key (tag 1).
fn sdes_sdp(ip: IpAddr, port: u16, session: usize, key: &SrtpKey) -> String {
    let plain = sdp(ip, port, session).replace(" RTP/AVP ", " RTP/SAVP ");
    format!("{plain}a={}\r\n", crypto_line(1, SUITE.name(), &key.master, false))
}

/// The first media section of a reply's SDP: its protocol and the key of its first `a=crypto`
/// line the bench speaks (None without one).
fn reply_media(reply: &mediaplane_ng::bencode::Value) -> anyhow::Result<(String, Option<SrtpKey>)> {
    let sdp = Sdp::parse(text(reply, "sdp").as_bytes()).map_err(|e| anyhow::anyhow!("the reply's SDP: {e}"))?;
    let m = sdp.media.first().context("the reply's SDP has no media section")?;
    let key = m.crypto.iter().find_map(|c| SrtpKey::new(SrtpSuite::from_name(&c.suite)?, c.key.clone()?).ok());
    Ok((m.proto.clone(), key))
}

// ---------------------------------------------------------------------------------------------
// Relay processes
// ---------------------------------------------------------------------------------------------

/// How a relay is started beyond its name.
#[derive(Debug, Clone, Default)]
pub struct RelaySetup {
    /// mediaplane worker threads (None = default).
    pub workers: Option<usize>,
    /// Size mediaplane's kernel maps and relay limit for that many relay sessions.
    pub sessions: Option<usize>,
    /// Media interfaces in rtpengine's `--interface` notation (`name/address[!advertised]`),
    /// given to either relay; empty: one, on peer 0's link.
    pub interfaces: Vec<String>,
    /// Record calls that ask for it into this directory (rtpengine: pcap, Ethernet frames).
    pub recording_dir: Option<PathBuf>,
    /// Report each DTMF event a party sends, as JSON over UDP to this address (rtpengine's
    /// `--dtmf-log-dest`, mediaplane's `ng.dtmf_log_dest`).
    pub dtmf_log_dest: Option<std::net::SocketAddr>,
    /// mediaplane's `ng.forward_to` (NG `start forwarding`; rtpengine hands that command to its
    /// recording daemon, which the bench does not run).
    pub forward_to: Option<std::net::SocketAddr>,
}

/// A relay running in the relay namespace; SIGTERM then SIGKILL by PID on stop, SIGKILL on drop.
pub struct RelayProc {
    pub name: String,
    proc: Supervised,
    log: PathBuf,
    pub mediaplane: bool,
    /// How it was started (program, arguments, environment): [`RelayProc::restart`] runs it
    /// again.
    command: (std::ffi::OsString, Vec<std::ffi::OsString>, Vec<(std::ffi::OsString, std::ffi::OsString)>),
}

impl RelayProc {
    /// `name`: one of [`RELAYS`]. `workers`: mediaplane worker threads (None = default).
    /// `sessions`: size mediaplane's kernel maps and relay limit for that many relay sessions.
    pub fn start(tb: &Testbed, name: &str, dir: &Path, workers: Option<usize>, sessions: Option<usize>) -> anyhow::Result<RelayProc> {
        let exe = std::env::current_exe().context("locating the mediaplane binary")?;
        Self::start_binary(tb, name, dir, &exe, &RelaySetup { workers, sessions, ..Default::default() })
    }

    /// [`RelayProc::start`] with `mediaplane` as the mediaplane binary (a test passes
    /// `CARGO_BIN_EXE_mediaplane`: its own executable is not the daemon).
    pub fn start_binary(tb: &Testbed, name: &str, dir: &Path, mediaplane: &Path, setup: &RelaySetup) -> anyhow::Result<RelayProc> {
        let RelaySetup { workers, sessions, interfaces, recording_dir, dtmf_log_dest, forward_to } = setup;
        let (workers, sessions) = (*workers, *sessions);
        let media_ip = tb.peers[0].sfu_ip;
        // rtpengine's notation, which mediaplane's media.interfaces takes too.
        let interfaces = if interfaces.is_empty() { vec![media_ip.to_string()] } else { interfaces.clone() };
        let log = dir.join(format!("{}-{name}.log", tb.prefix));
        let logf = std::fs::File::create(&log)?;
        let mut cmd;
        match name {
            "mediaplane-userspace" | "mediaplane-afxdp" | "mediaplane-ebpf" | "mediaplane-ebpf-noxdp" | "mediaplane-ebpf-xdp" => {
                let (plane, xdp) = crate::conference::plane_variant(name.trim_start_matches("mediaplane-"));
                let cfg = dir.join(format!("{}-{name}.toml", tb.prefix));
                // Debug quoting is a TOML basic string for these (ASCII, no control characters).
                let quoted: Vec<String> = interfaces.iter().map(|i| format!("{i:?}")).collect();
                let mut toml =
                    format!("[media]\nip = \"{media_ip}\"\nport_min = {RELAY_PORT_MIN}\nport_max = {RELAY_PORT_MAX}\ninterfaces = [{}]\n", quoted.join(", "));
                if recording_dir.is_some() || dtmf_log_dest.is_some() || forward_to.is_some() {
                    toml += "[ng]\n";
                }
                if let Some(dir) = recording_dir {
                    toml += &format!("recording_dir = {:?}\n", dir.display().to_string());
                }
                if let Some(dest) = dtmf_log_dest {
                    toml += &format!("dtmf_log_dest = \"{dest}\"\n");
                }
                if let Some(to) = forward_to {
                    toml += &format!("forward_to = \"{to}\"\n");
                }
                if let Some(n) = sessions {
                    // Two stream entries and two copies per relay session, plus headroom.
                    let entries = (2 * n + 1024).min(u32::MAX as usize);
                    toml += &format!("[dataplane]\nmax_streams = {entries}\nmax_copies = {entries}\n[limits]\nmax_relays = {}\n", n + 16);
                }
                std::fs::write(&cfg, toml)?;
                let store = dir.join(format!("{}-{name}.db", tb.prefix));
                cmd = tb.command(&tb.sfu_ns, mediaplane.to_str().context("mediaplane binary path")?);
                let pin = format!("/sys/fs/bpf/{}-relay", tb.prefix);
                cmd.args(["serve", "--config", cfg.to_str().unwrap(), "--listen", API, "--store", store.to_str().unwrap(), "--reset"])
                    .args(["--dataplane", plane, "--pin-dir", &pin, "--ng-listen", NG, "--ng-media-timeout", "86400"])
                    .env("RUST_LOG", "warn");
                if let Some(w) = workers {
                    cmd.args(["--workers", &w.to_string()]);
                }
                if plane == "ebpf" || plane == "afxdp" {
                    for p in &tb.peers {
                        cmd.args(["--interface", &p.sfu_if]);
                    }
                }
                if let Some(x) = xdp {
                    cmd.args(["--xdp-prefilter", x]);
                }
            }
            "rtpengine" => {
                cmd = tb.command(&tb.sfu_ns, "rtpengine");
                cmd.args([
                    "--config-file=none",
                    "--table=-1",
                    "--foreground",
                    "--log-stderr",
                    "--log-level=4",
                    "--delete-delay=0",
                    "--timeout=86400",
                    "--silent-timeout=86400",
                    "--offer-timeout=86400",
                ])
                .args(interfaces.iter().map(|i| format!("--interface={i}")))
                .args(
                    recording_dir
                        .iter()
                        .flat_map(|d| [format!("--recording-dir={}", d.display()), "--recording-method=pcap".into(), "--recording-format=eth".into()]),
                )
                .args(dtmf_log_dest.iter().map(|d| format!("--dtmf-log-dest={d}")))
                .arg(format!("--listen-ng={NG}"))
                .arg(format!("--port-min={RELAY_PORT_MIN}"))
                .arg(format!("--port-max={RELAY_PORT_MAX}"));
            }
            other => bail!("unknown relay {other:?}: use {}", RELAYS.join(", ")),
        }
        let command = (
            cmd.get_program().to_owned(),
            cmd.get_args().map(|a| a.to_owned()).collect(),
            cmd.get_envs().filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned()))).collect(),
        );
        let proc = Supervised::spawn(name, cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(logf))?;
        let mut me = RelayProc { name: name.to_string(), proc, log, mediaplane: name.starts_with("mediaplane"), command };
        me.wait_ready(tb)?;
        Ok(me)
    }

    /// Stop mediaplane (SIGTERM, as systemd does) and start it again on its store, as it was
    /// started but for `--reset`: what it held comes back from the store. Its log goes on in
    /// the same file.
    pub fn restart(&mut self, tb: &Testbed) -> anyhow::Result<()> {
        if !self.mediaplane {
            bail!("{}: only mediaplane restarts on its store", self.name);
        }
        if self.proc.exited()?.is_some() {
            bail!("{} died before the restart: {}", self.name, self.log_tail());
        }
        self.proc.terminate(Duration::from_secs(15))?;
        let (program, args, envs) = &self.command;
        let mut cmd = std::process::Command::new(program);
        cmd.args(args.iter().filter(|a| a.as_os_str() != "--reset")).envs(envs.iter().map(|(k, v)| (k, v)));
        let logf = std::fs::OpenOptions::new().append(true).open(&self.log)?;
        self.proc = Supervised::spawn(&self.name, cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(logf))?;
        self.wait_ready(tb)
    }

    /// `ip netns exec` execs the relay: the child's pid is the relay's.
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// mediaplane's `GET /v1/stats` (an error for rtpengine, which has no such API).
    pub fn stats(&self, tb: &Testbed) -> anyhow::Result<Json> {
        if !self.mediaplane {
            bail!("{} has no /v1/stats", self.name);
        }
        api(tb, "GET", "/v1/stats", None)
    }

    fn wait_ready(&mut self, tb: &Testbed) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let ok = tb.in_ns(&tb.sfu_ns, || -> anyhow::Result<()> {
                let mut c = NgClient::new(NG.parse().unwrap(), "ready")?;
                c.socket().set_read_timeout(Some(Duration::from_millis(200)))?;
                Ok(c.request(vec![("command", "ping".into())]).map(|_| ())?)
            })?;
            if ok.is_ok() {
                return Ok(());
            }
            if let Some(st) = self.proc.exited()? {
                bail!("{} exited at start ({st}): {}", self.name, self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!("{} did not answer NG ping within 20 s: {}", self.name, self.log_tail())
    }

    /// The relay's stderr log (removed by a clean [`RelayProc::stop`]).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(5)..].join("\n")
    }

    pub fn stop(&mut self) -> anyhow::Result<()> {
        if self.proc.exited()?.is_some() {
            bail!("{} died during the run: {}", self.name, self.log_tail());
        }
        self.proc.terminate(Duration::from_secs(15))?;
        let _ = std::fs::remove_file(&self.log);
        Ok(())
    }
}

/// One HTTP call to the mediaplane daemon, from inside the relay namespace.
fn api(tb: &Testbed, method: &str, path: &str, body: Option<Json>) -> anyhow::Result<Json> {
    crate::conference::api_with_timeout(tb, method, path, body, Duration::from_secs(60))
}

// ---------------------------------------------------------------------------------------------
// One run
// ---------------------------------------------------------------------------------------------

struct CallUp {
    index: usize,
    call_id: String,
    /// Where the caller sends (leg A's relay address) and where the callee sends (leg B's).
    to_from_caller: SocketAddr,
    to_from_callee: SocketAddr,
    /// SDES-SRTP calls: the caller's session protecting what it sends, and the one unprotecting
    /// what it gets (with the key of the relay's answer).
    caller_srtp: Option<(Arc<SrtpContext>, Arc<SrtpContext>)>,
}

struct Setup {
    up: Vec<CallUp>,
    failures: Vec<String>,
    offer: ValueRecorder,
    answer: ValueRecorder,
    seconds: f64,
}

/// Set up `n` calls at `rate` per second; a call that fails (an NG error, or a relay that did not
/// bridge as asked) is a failure with its reason, not a stop.
fn setup_calls(tb: &Testbed, tag: &str, n: usize, rate: f64, media: Media) -> anyhow::Result<Setup> {
    let (cip, eip) = (tb.peers[0].ip, tb.peers[1].ip);
    let tag = tag.to_string();
    tb.in_ns(&tb.sfu_ns, move || -> anyhow::Result<Setup> {
        let mut ng = NgClient::new(NG.parse().unwrap(), &format!("{tag}-setup"))?;
        let mut s = Setup { up: Vec::new(), failures: Vec::new(), offer: ValueRecorder::new(), answer: ValueRecorder::new(), seconds: 0.0 };
        let t0 = Instant::now();
        for i in 0..n {
            let due = t0 + Duration::from_secs_f64(i as f64 / rate);
            if let Some(d) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(d);
            }
            let call_id = format!("{tag}-{i}@bench");
            let port = PARTY_PORT_BASE + 2 * i as u16;
            let caller_key = match media {
                Media::Rtp => None,
                Media::SdesRtp => Some(random_key()?),
            };
            let mut offer = match &caller_key {
                None => offer_answer("offer", &call_id, &format!("c{i}"), None, &sdp(cip, port, i), cip),
                Some(key) => offer_answer("offer", &call_id, &format!("c{i}"), None, &sdes_sdp(cip, port, i, key), cip),
            };
            if caller_key.is_some() {
                offer.push(("transport-protocol", "RTP/AVP".into()));
            }
            let t = Instant::now();
            let offer = ng.request(offer);
            let offer_ns = t.elapsed().as_nanos() as u64;
            let to_from_callee = match offer.map_err(anyhow::Error::from).and_then(|v| {
                let (proto, key) = reply_media(&v)?;
                // SDES-SRTP bridging: the callee must be offered plain RTP without keys.
                if caller_key.is_some() && (proto != "RTP/AVP" || key.is_some()) {
                    bail!("the callee was offered {proto}{}, not plain RTP/AVP", if key.is_some() { " with a key" } else { "" });
                }
                Ok(advertised(&v)?)
            }) {
                Ok(a) => a,
                Err(e) => {
                    s.failures.push(format!("call {i} offer: {e:#}"));
                    continue;
                }
            };
            s.offer.record(offer_ns);
            let t = Instant::now();
            let answer = ng.request(offer_answer("answer", &call_id, &format!("c{i}"), Some(&format!("e{i}")), &sdp(eip, port, i), eip));
            let answer_ns = t.elapsed().as_nanos() as u64;
            let up = answer.map_err(anyhow::Error::from).and_then(|v| {
                let to_from_caller = advertised(&v)?;
                let caller_srtp = match &caller_key {
                    None => None,
                    Some(ours) => {
                        let (proto, relays) = reply_media(&v)?;
                        let Some(relays) = relays.filter(|_| proto == "RTP/SAVP") else {
                            bail!("the caller was answered {proto} without a key it speaks, not RTP/SAVP with one");
                        };
                        let out = SrtpContext::new(ours, true).map_err(anyhow::Error::msg)?;
                        let inbound = SrtpContext::new(&relays, false).map_err(anyhow::Error::msg)?;
                        Some((Arc::new(out), Arc::new(inbound)))
                    }
                };
                Ok(CallUp { index: i, call_id: call_id.clone(), to_from_caller, to_from_callee, caller_srtp })
            });
            match up {
                Ok(up) => {
                    s.answer.record(answer_ns);
                    s.up.push(up);
                }
                Err(e) => s.failures.push(format!("call {i} answer: {e:#}")),
            }
        }
        s.seconds = t0.elapsed().as_secs_f64();
        Ok(s)
    })?
}

fn delete_calls(tb: &Testbed, tag: &str, calls: Vec<(usize, String)>) -> anyhow::Result<(ValueRecorder, usize)> {
    let tag = tag.to_string();
    tb.in_ns(&tb.sfu_ns, move || -> anyhow::Result<(ValueRecorder, usize)> {
        let mut ng = NgClient::new(NG.parse().unwrap(), &format!("{tag}-delete"))?;
        let mut lat = ValueRecorder::new();
        let mut failures = 0;
        for (i, call_id) in calls {
            let t = Instant::now();
            let r = ng.request(delete(&call_id, &format!("c{i}"), &format!("e{i}")));
            match r {
                Ok(v) if v.get("warning").is_none() => lat.record(t.elapsed().as_nanos() as u64),
                _ => failures += 1,
            }
        }
        Ok((lat, failures))
    })?
}

/// Bind `ports` on `ip` inside namespace `ns`, in one thread.
fn bind_many(tb: &Testbed, ns: &str, ip: IpAddr, ports: Vec<u16>) -> anyhow::Result<Vec<UdpSocket>> {
    tb.in_ns(ns, move || ports.into_iter().map(|p| UdpSocket::bind(SocketAddr::new(ip, p))).collect::<std::io::Result<Vec<_>>>())?
        .context("binding party sockets")
}

fn caller_flow(i: usize) -> u32 {
    0x1000_0000 + i as u32
}
fn callee_flow(i: usize) -> u32 {
    0x2000_0000 + i as u32
}

/// Legs of mediaplane RTP relays still waiting for their first packet (`/v1/table`: a learning
/// source rule that follows no source yet, `{"learn": null}`).
fn unlatched_rtp_legs(tb: &Testbed) -> anyhow::Result<usize> {
    let t = api(tb, "GET", "/v1/table", None)?;
    Ok(t["streams"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|s| {
                    s["source"] == serde_json::json!({ "learn": null }) && s["label"].as_str().is_some_and(|l| l.ends_with("-0/a") || l.ends_with("-0/b"))
                })
                .count()
        })
        .unwrap_or(0))
}

pub struct RunSpec {
    pub calls: usize,
    pub setup_rate: f64,
    pub seconds: f64,
    /// Seconds of the silent phase ([`RelayRun::idle_cpu_ms_per_s`]); 0: none.
    pub idle_seconds: f64,
    pub media: Media,
}

pub fn run_one(tb: &Testbed, relay_name: &str, spec: &RunSpec, dir: &Path) -> anyhow::Result<RelayRun> {
    let n = spec.calls;
    if n == 0 || n > MAX_CALLS {
        bail!("calls must be between 1 and {MAX_CALLS}");
    }
    // The kernel-forward baseline has no relay: each party sends straight to the other, routed
    // by the relay namespace's IP forwarding.
    let baseline = relay_name == KERNEL_FORWARD;
    if baseline && spec.media != Media::Rtp {
        bail!("kernel-forward has no relay to bridge {} media", spec.media.name());
    }
    let mut relay = if baseline { None } else { Some(RelayProc::start(tb, relay_name, dir, None, Some(2 * n))?) };
    let mediaplane = relay.as_ref().is_some_and(|r| r.mediaplane);
    let tag = format!("{}-{relay_name}-{}-{n}", tb.prefix, spec.media.name());
    let setup = if baseline {
        let (cip, eip) = (tb.peers[0].ip, tb.peers[1].ip);
        let up = (0..n)
            .map(|i| {
                let port = PARTY_PORT_BASE + 2 * i as u16;
                CallUp {
                    index: i,
                    call_id: String::new(),
                    to_from_caller: SocketAddr::new(eip, port),
                    to_from_callee: SocketAddr::new(cip, port),
                    caller_srtp: None,
                }
            })
            .collect();
        Setup { up, failures: Vec::new(), offer: ValueRecorder::new(), answer: ValueRecorder::new(), seconds: f64::INFINITY }
    } else {
        setup_calls(tb, &tag, n, spec.setup_rate, spec.media)?
    };
    if setup.up.is_empty() {
        let first = setup.failures.first().cloned().unwrap_or_default();
        if let Some(r) = relay.as_mut() {
            r.stop().ok();
        }
        bail!("no call could be set up ({} failures; first: {first})", setup.failures.len());
    }

    // Party sockets for the calls that are up.
    let (caller, callee) = (&tb.peers[0], &tb.peers[1]);
    let ports: Vec<u16> = setup.up.iter().map(|c| PARTY_PORT_BASE + 2 * c.index as u16).collect();
    let caller_socks = bind_many(tb, &caller.ns, caller.ip, ports.clone())?;
    let callee_socks = bind_many(tb, &callee.ns, callee.ip, ports)?;

    // Latching: one packet per leg, paced, then wait for the relay to have learnt every leg.
    let t_latch = Instant::now();
    let latch_pkt = mediaplane_core::rtp::build_rtp(0, 0, 0, 0x1a7c4, &[0xff; 160]);
    for (k, c) in setup.up.iter().enumerate() {
        match &c.caller_srtp {
            None => caller_socks[k].send_to(&latch_pkt, c.to_from_caller).ok(),
            Some((out, _)) => {
                let mut p = latch_pkt.clone();
                out.protect(&mut p).map_err(|e| anyhow::anyhow!("protecting a latching packet: {e}"))?;
                caller_socks[k].send_to(&p, c.to_from_caller).ok()
            }
        };
        callee_socks[k].send_to(&latch_pkt, c.to_from_callee).ok();
        if k % 100 == 99 {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let legs = 2 * setup.up.len();
    let legs_latched = if mediaplane {
        let deadline = Instant::now() + Duration::from_secs_f64((30.0 + legs as f64 * 0.05).min(900.0));
        let mut left = unlatched_rtp_legs(tb)?;
        while left > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(250));
            left = unlatched_rtp_legs(tb)?;
        }
        Some(legs - left)
    } else {
        std::thread::sleep(Duration::from_millis(500));
        None
    };
    let latch_seconds = t_latch.elapsed().as_secs_f64();

    // Silence: every call up and latched, nothing sent. What the relay's process uses now is
    // what its calls cost while nobody speaks (timers, polling), not media.
    let idle_cpu_ms_per_s = match relay.as_ref().map(RelayProc::pid) {
        Some(pid) if spec.idle_seconds > 0.0 => {
            // Let the latching packets' work settle first, and the learning windows (3 s from
            // the last answer; mediaplane and rtpengine alike) lock what they heard: that is
            // set-up work, not what a call on hold costs.
            std::thread::sleep(Duration::from_secs(4));
            let (cpu0, t0) = (process_cpu_ns(pid), Instant::now());
            std::thread::sleep(Duration::from_secs_f64(spec.idle_seconds));
            Some(process_cpu_ns(pid).saturating_sub(cpu0) as f64 / 1e6 / t0.elapsed().as_secs_f64())
        }
        _ => None,
    };

    // Media.
    let profile = Profile::voice();
    let mut plan = TrafficPlan::new(Duration::from_secs_f64(spec.seconds));
    plan.drain = Duration::from_secs(2);
    // No busy-wait before each send: the machine's busy time must be work, not waiting. Delay
    // is stamped at the send itself, so pacing slack does not enter it.
    plan.spin = Duration::ZERO;
    // One fd per party port, shared by its sender and receiver: 5,000 calls need 10,000, not 20,000.
    let caller_socks: Vec<Arc<UdpSocket>> = caller_socks.into_iter().map(Into::into).collect();
    let callee_socks: Vec<Arc<UdpSocket>> = callee_socks.into_iter().map(Into::into).collect();
    for (k, c) in setup.up.iter().enumerate() {
        plan = match &c.caller_srtp {
            None => plan.sender(caller_socks[k].clone(), c.to_from_caller, caller_flow(c.index), profile.clone()),
            Some((out, _)) => plan.srtp_sender(caller_socks[k].clone(), c.to_from_caller, caller_flow(c.index), profile.clone(), out.clone()),
        };
        plan = plan.sender(callee_socks[k].clone(), c.to_from_callee, callee_flow(c.index), profile.clone());
    }
    for (k, (a, b)) in caller_socks.into_iter().zip(callee_socks).enumerate() {
        let c = &setup.up[k];
        let i = c.index;
        plan = match &c.caller_srtp {
            None => plan.receiver(format!("caller{i}"), a, [callee_flow(i)]),
            Some((_, inbound)) => plan.srtp_receiver(format!("caller{i}"), a, [callee_flow(i)], inbound.clone()),
        };
        plan = plan.receiver(format!("callee{i}"), b, [caller_flow(i)]);
    }
    let stats0 = if mediaplane { Some(api(tb, "GET", "/v1/stats", None)?) } else { None };
    let pid = relay.as_ref().map(RelayProc::pid);
    let cpu0 = pid.map_or(0, process_cpu_ns);
    let report = traffic::run(&plan)?;
    let relay_cpu_ns = pid.map_or(0, |p| process_cpu_ns(p).saturating_sub(cpu0));
    let stats1 = if mediaplane { Some(api(tb, "GET", "/v1/stats", None)?) } else { None };
    let rss = pid.map_or(0, rss_kib);
    let memlock = pid.map_or(0, bpf_memlock);
    drop(plan);

    let delta = |k: &str| match (&stats0, &stats1) {
        (Some(a), Some(b)) => Some(extra_delta(a, b, k)),
        _ => None,
    };
    // TC and the XDP pre-filter's pass path: every relayed packet runs through both.
    let bpf_run_ns = delta("bpf_run_time_ns").unwrap_or(0) + delta("xdp_run_time_ns").unwrap_or(0);
    let ebpf = relay_name.starts_with("mediaplane-ebpf");
    // The eBPF plane's slow path sees what the TC programs hand up of the relay's own streams
    // (SRTP legs, unlatched legs, RTCP, unresolved neighbours...), not other traffic.
    let split = match (&stats0, &stats1) {
        (Some(a), Some(b)) if ebpf => Some(kernel_split(a, b)),
        _ => None,
    };
    let kernel_forwarded = split.map(|(forwarded, _)| forwarded);
    let slow_path_rx = match (split, &stats0, &stats1) {
        (Some((_, slow)), _, _) => Some(slow),
        (None, Some(a), Some(b)) => Some(b["total"]["rx_packets"].as_u64().unwrap_or(0).saturating_sub(a["total"]["rx_packets"].as_u64().unwrap_or(0))),
        _ => None,
    };

    // Delete every call, then check what is left.
    let calls: Vec<(usize, String)> = setup.up.iter().map(|c| (c.index, c.call_id.clone())).collect();
    let (del_lat, delete_failures) = if baseline { (ValueRecorder::new(), 0) } else { delete_calls(tb, &tag, calls)? };
    let left_after_delete = if mediaplane { api(tb, "GET", "/health", None).ok().and_then(|h| h["relays"].as_u64()) } else { None };
    if let Some(r) = relay.as_mut() {
        r.stop()?;
    }
    for ext in ["db", "db-wal", "db-shm", "toml"] {
        let _ = std::fs::remove_file(dir.join(format!("{}-{relay_name}.{ext}", tb.prefix)));
    }

    // Per leg QoS.
    let mut all = ValueRecorder::new().histogram;
    let (mut dv_p99, mut jitter, mut mos) = (Vec::new(), 0.0, Vec::new());
    let mut legs_with_loss = 0;
    for c in &report.copies {
        all.add(&c.delay_histogram).ok();
        dv_p99.push(c.delay_variation_ns.p99);
        jitter += c.jitter_ns;
        mos.push(c.mos_g711);
        legs_with_loss += (c.lost > 0) as usize;
    }
    let dv = Summary::of(&mut dv_p99);
    let ncopies = report.copies.len().max(1) as f64;
    let t = &report.totals;
    let planned: u64 = report.senders.iter().map(|s| s.planned).sum();
    let cpu_total = relay_cpu_ns + bpf_run_ns;
    let media_ns = (report.send_duration_ns as f64).max(spec.seconds * 1e9);
    let mos_s = Summary::of(&mut mos);
    let protect: Vec<f64> = report.senders.iter().filter_map(|s| s.srtp_protect_ns.map(|p| p.p50)).collect();
    Ok(RelayRun {
        relay: relay_name.to_string(),
        media: spec.media.name().to_string(),
        srtp_failed: t.srtp_failed,
        srtp_replayed: t.srtp_replayed,
        generator_srtp_protect_p50_ns: (!protect.is_empty()).then(|| Summary::of(&mut protect.clone()).p50),
        calls: n,
        calls_up: setup.up.len(),
        setup_failures: setup.failures.len(),
        setup_errors: setup.failures.iter().take(5).cloned().collect(),
        setup_rate_target: spec.setup_rate,
        setup_rate_achieved: setup.up.len() as f64 / setup.seconds.max(1e-9),
        offer_ns: summary(&setup.offer),
        answer_ns: summary(&setup.answer),
        legs,
        legs_latched,
        idle_cpu_ms_per_s,
        latch_seconds,
        seconds: spec.seconds,
        planned,
        sent: t.sent,
        send_errors: t.send_errors,
        received: t.received,
        lost: t.lost,
        loss_pct: if t.expected_copies > 0 { 100.0 * t.lost as f64 / t.expected_copies as f64 } else { 0.0 },
        duplicates: t.duplicates,
        unexpected: t.unexpected,
        legs_with_loss,
        delay_ns: Summary::of_histogram(&all),
        delay_variation_p99_median_ns: dv.p50,
        delay_variation_p99_max_ns: dv.max,
        jitter_mean_ns: jitter / ncopies,
        mos_mean: mos_s.mean,
        mos_min: mos_s.min,
        relay_cpu_ns,
        bpf_run_ns,
        cpu_pct: 100.0 * cpu_total as f64 / media_ns,
        cpu_per_packet_ns: (t.received > 0).then(|| cpu_total as f64 / t.received as f64),
        added_delay_p50_ns: None,
        added_delay_p99_ns: None,
        machine_cpu_per_packet_ns: (t.received > 0).then(|| report.machine_busy_ns as f64 / t.received as f64),
        kernel_forwarded,
        slow_path_rx,
        relay_rss_kib: rss,
        relay_bpf_memlock_bytes: memlock,
        generator_cpu_ns: report.generator_cpu_ns,
        receiver_cpu_ns: report.receiver_cpu_ns,
        delete_failures,
        delete_ns: summary(&del_lat),
        left_after_delete,
    })
}

// ---------------------------------------------------------------------------------------------
// Capacity: how fast and how many sessions the API layer installs
// ---------------------------------------------------------------------------------------------

struct Ramp {
    samples: Vec<CapacitySample>,
    window: ValueRecorder,
    t0: Instant,
    last: (Instant, usize),
    every: usize,
    /// The daemon's CPU time when the ramp started.
    cpu0: (u32, u64),
}

impl Ramp {
    fn new(every: usize, pid: u32) -> Ramp {
        let now = Instant::now();
        Ramp { samples: Vec::new(), window: ValueRecorder::new(), t0: now, last: (now, 0), every, cpu0: (pid, process_cpu_ns(pid)) }
    }

    fn record(&mut self, sessions: usize, request_ns: u64, pid: u32, force: bool) {
        self.window.record(request_ns);
        if !force && sessions < self.last.1 + self.every {
            return;
        }
        let now = Instant::now();
        let dt = now.duration_since(self.last.0).as_secs_f64().max(1e-9);
        self.samples.push(CapacitySample {
            sessions,
            elapsed_s: now.duration_since(self.t0).as_secs_f64(),
            rate: (sessions - self.last.1) as f64 / dt,
            request_ns: self.window.summary(),
            rss_kib: rss_kib(pid),
            bpf_memlock_bytes: bpf_memlock(pid),
        });
        self.window = ValueRecorder::new();
        self.last = (now, sessions);
    }
}

/// NG calls as fast as one client goes: each call = 2 relay sessions (RTP + RTCP).
fn ramp_ng(tb: &Testbed, relay: &RelayProc, target: usize, budget: Duration) -> anyhow::Result<CapacityRamp> {
    let (cip, eip, pid) = (tb.peers[0].ip, tb.peers[1].ip, relay.pid());
    let tag = format!("{}-cap", tb.prefix);
    let every = (target / 50).clamp(50, 5000);
    tb.in_ns(&tb.sfu_ns, move || -> anyhow::Result<CapacityRamp> {
        let mut ng = NgClient::new(NG.parse().unwrap(), &tag)?;
        let mut ramp = Ramp::new(every, pid);
        let mut sessions = 0;
        let mut stopped_by = format!("target of {target} sessions");
        let mut i = 0usize;
        while sessions < target {
            if ramp.t0.elapsed() > budget {
                stopped_by = format!("time budget of {} s", budget.as_secs());
                break;
            }
            let call_id = format!("{tag}-{i}");
            let port = 1000 + (i % 30000) as u16 * 2;
            let t = Instant::now();
            let r = ng
                .request(offer_answer("offer", &call_id, "c", None, &sdp(cip, port, i), cip))
                .and_then(|_| ng.request(offer_answer("answer", &call_id, "c", Some("e"), &sdp(eip, port, i), eip)));
            if let Err(e) = r {
                stopped_by = format!("error at {sessions} sessions: {e:#}");
                break;
            }
            sessions += 2;
            i += 1;
            ramp.record(sessions, t.elapsed().as_nanos() as u64, pid, false);
        }
        ramp.record(sessions, 0, pid, true);
        Ok(finish_ramp("ng", "ebpf", target, sessions, stopped_by, ramp))
    })?
}

/// HTTP `POST /v1/relays` (`batch` = 1) or `POST /v1/batch/relays` with `batch` relays per
/// request, with explicit local addresses on many IPs (10.78.x.y, bound with IP_FREEBIND by the
/// slow path), so the port range of one media IP is no limit. `clients` keep-alive connections
/// send requests concurrently (as a SIP server's workers would).
fn ramp_http(tb: &Testbed, relay: &RelayProc, target: usize, budget: Duration, clients: usize, batch: usize) -> anyhow::Result<CapacityRamp> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let pid = relay.pid();
    let batch = batch.max(1);
    let every = (target / 50).clamp(50, 5000).max(batch);
    tb.in_ns(&tb.sfu_ns, move || -> anyhow::Result<CapacityRamp> {
        let url = if batch == 1 { format!("http://{API}/v1/relays") } else { format!("http://{API}/v1/batch/relays") };
        let ramp = parking_lot::Mutex::new(Ramp::new(every, pid));
        let next = AtomicUsize::new(0);
        let done = AtomicUsize::new(0);
        let stopped = parking_lot::Mutex::new(None::<String>);
        // 25,000 even ports per IP (2,000..51,998), two legs per relay.
        let local = |k: usize| {
            let ip = 0x0a4e_0000u32 + (k / 25_000) as u32 + 1;
            SocketAddr::new(IpAddr::from(ip.to_be_bytes()), 2000 + 2 * (k % 25_000) as u16)
        };
        let relay_body = |k: usize| {
            json!({
                "id": format!("cap-{k}"),
                "a": {"local": local(2 * k), "remote": "10.77.0.2:4000"},
                "b": {"local": local(2 * k + 1), "remote": "10.77.1.2:4000"},
            })
        };
        // Threads spawned here inherit this thread's network namespace.
        std::thread::scope(|s| {
            for _ in 0..clients.max(1) {
                s.spawn(|| {
                    let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(120)).build();
                    let t0 = ramp.lock().t0;
                    loop {
                        if stopped.lock().is_some() {
                            return;
                        }
                        if t0.elapsed() > budget {
                            stopped.lock().get_or_insert(format!("time budget of {} s", budget.as_secs()));
                            return;
                        }
                        let k = next.fetch_add(batch, Ordering::Relaxed);
                        if k >= target {
                            return;
                        }
                        let n = batch.min(target - k);
                        let body = if batch == 1 { relay_body(k) } else { json!({"create": (k..k + n).map(relay_body).collect::<Vec<_>>()}) };
                        let t = Instant::now();
                        let err = match agent.post(&url).send_json(body) {
                            Ok(_) => None,
                            Err(ureq::Error::Status(code, r)) => {
                                Some(format!("HTTP {code} at {} sessions: {}", done.load(Ordering::Relaxed), r.into_string().unwrap_or_default()))
                            }
                            Err(e) => Some(format!("error at {} sessions: {e}", done.load(Ordering::Relaxed))),
                        };
                        if let Some(e) = err {
                            stopped.lock().get_or_insert(e);
                            return;
                        }
                        let total = done.fetch_add(n, Ordering::Relaxed) + n;
                        ramp.lock().record(total, t.elapsed().as_nanos() as u64, pid, false);
                    }
                });
            }
        });
        let sessions = done.load(Ordering::Relaxed);
        let mut ramp = ramp.into_inner();
        ramp.record(sessions, 0, pid, true);
        let stopped_by = stopped.into_inner().unwrap_or_else(|| format!("target of {target} sessions"));
        let api = if batch == 1 { "http".to_string() } else { format!("http-batch{batch}") };
        Ok(finish_ramp(&api, "ebpf", target, sessions, stopped_by, ramp))
    })?
}

fn finish_ramp(api: &str, dp: &str, target: usize, installed: usize, stopped_by: String, ramp: Ramp) -> CapacityRamp {
    let seconds = ramp.t0.elapsed().as_secs_f64();
    let cpu_ns = process_cpu_ns(ramp.cpu0.0).saturating_sub(ramp.cpu0.1);
    CapacityRamp {
        daemon_cpu_ns_per_session: cpu_ns as f64 / installed.max(1) as f64,
        api: api.into(),
        dataplane: dp.into(),
        target,
        installed,
        seconds,
        rate_mean: installed as f64 / seconds.max(1e-9),
        stopped_by,
        samples: ramp.samples,
    }
}

/// In-process: what one session-manager mutation costs at a model size (clone the model,
/// recompile what it touched, write one relay to a file-backed store), and for comparison a
/// whole-table compile.
fn mutation_costs(sizes: &[usize], dir: &Path) -> anyhow::Result<Vec<MutationCost>> {
    use mediaplane_control::store::{Change, Store};
    use mediaplane_core::model::LegSpec;
    use mediaplane_core::{ForwardingTable, Model};
    let mut out = Vec::new();
    let mut model = Model::new();
    let db = dir.join("mutation-cost.db");
    let _ = std::fs::remove_file(&db);
    let mut store = Store::open(&db)?;
    let local = |k: usize| {
        let ip = 0x0a4f_0000u32 + (k / 25_000) as u32 + 1;
        SocketAddr::new(IpAddr::from(ip.to_be_bytes()), 2000 + 2 * (k % 25_000) as u16)
    };
    let mut have = 0;
    for &n in sizes {
        while have < n {
            let leg = |k| LegSpec { local: local(k), remote: Some("10.77.0.2:4000".parse().unwrap()), strict: false, rtp: true, follow: Default::default() };
            model.create_relay(&format!("r{have}"), leg(2 * have), leg(2 * have + 1)).map_err(|e| anyhow::anyhow!("{e}"))?;
            have += 1;
        }
        let reps = (200_000 / n.max(1)).clamp(3, 50);
        let t = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(model.clone());
        }
        let clone_ns = t.elapsed().as_nanos() as f64 / reps as f64;
        let table = ForwardingTable::compile(&model, 0);
        let update_reps = 1000;
        let t = Instant::now();
        for k in 0..update_reps {
            let mut next = model.clone();
            let leg =
                |p| LegSpec { local: local(2 * n + p), remote: Some("10.77.0.2:4000".parse().unwrap()), strict: false, rtp: true, follow: Default::default() };
            let id = format!("new{k}");
            next.create_relay(&id, leg(0), leg(1)).map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut t2 = table.clone();
            std::hint::black_box(t2.update(&model, &next, [mediaplane_core::table::Owner::Relay(&id)]));
        }
        let update_ns = t.elapsed().as_nanos() as f64 / update_reps as f64;
        drop(table);
        let t = Instant::now();
        for v in 0..reps {
            std::hint::black_box(ForwardingTable::compile(&model, v as u64));
        }
        let compile_ns = t.elapsed().as_nanos() as f64 / reps as f64;
        let save_reps = 500;
        let t = Instant::now();
        for k in 0..save_reps {
            store.save(&model, &[Change::Relay(format!("r{}", k % n.max(1)))])?;
        }
        let save_ns = t.elapsed().as_nanos() as f64 / save_reps as f64;
        out.push(MutationCost { relays: n, model_clone_ns: clone_ns, table_update_ns: update_ns, table_compile_ns: compile_ns, store_save_ns: save_ns });
    }
    drop(store);
    for ext in ["db", "db-wal", "db-shm"] {
        let _ = std::fs::remove_file(db.with_extension(ext));
    }
    Ok(out)
}

/// How the install-capacity ramps are run (`--capacity*` options).
#[derive(Clone, Copy)]
struct CapacityPlan {
    target: usize,
    budget: Duration,
    clients: usize,
    batch: usize,
    quick: bool,
}

fn capacity(tb: &Testbed, plan: &CapacityPlan, dir: &Path, failures: &mut Vec<String>) -> Capacity {
    let CapacityPlan { target, budget, clients, batch, quick } = *plan;
    let mut ramps = Vec::new();
    // NG: at most a tenth of the target, in a third of the budget (every call = 2 sessions).
    let ng_target = (target / 10).clamp(100, 24_000);
    let apis: &[&str] = if batch > 1 { &["ng", "http", "http-batch"] } else { &["ng", "http"] };
    for &api_kind in apis {
        let sized = if api_kind == "ng" { 2 * ng_target } else { target };
        let r = RelayProc::start(tb, "mediaplane-ebpf", dir, Some(1), Some(sized)).and_then(|mut relay| {
            let r = match api_kind {
                "ng" => ramp_ng(tb, &relay, ng_target, budget / 3),
                "http" => ramp_http(tb, &relay, target, budget, clients, 1),
                _ => ramp_http(tb, &relay, target, budget, clients, batch),
            };
            let stop = relay.stop();
            let r = r?;
            stop?;
            Ok(r)
        });
        match r {
            Ok(r) => ramps.push(r),
            Err(e) => failures.push(format!("capacity ({api_kind}): {e:#}")),
        }
    }
    for ext in ["db", "db-wal", "db-shm", "toml"] {
        let _ = std::fs::remove_file(dir.join(format!("{}-mediaplane-ebpf.{ext}", tb.prefix)));
    }
    let sizes: &[usize] = if quick { &[100, 1000] } else { &[1000, 10_000, 100_000, 1_000_000] };
    let mutation_cost = mutation_costs(sizes, dir).unwrap_or_else(|e| {
        failures.push(format!("mutation cost: {e:#}"));
        Vec::new()
    });
    Capacity { ramps, mutation_cost }
}

// ---------------------------------------------------------------------------------------------
// Entry point
// ---------------------------------------------------------------------------------------------

/// Added delay of every run that has a `kernel-forward` run at its call count.
fn set_added_delay(runs: &mut [RelayRun]) {
    let floor: Vec<(usize, Summary)> = runs.iter().filter(|r| r.relay == KERNEL_FORWARD && r.received > 0).map(|r| (r.calls, r.delay_ns)).collect();
    for r in runs.iter_mut().filter(|r| r.relay != KERNEL_FORWARD && r.received > 0) {
        if let Some((_, f)) = floor.iter().find(|(n, _)| *n == r.calls) {
            r.added_delay_p50_ns = Some(r.delay_ns.p50 - f.p50);
            r.added_delay_p99_ns = Some(r.delay_ns.p99 - f.p99);
        }
    }
}

pub fn run(a: BenchRelayArgs) -> anyhow::Result<()> {
    mediaplane_bench::ensure_root("bench relay")?;
    raise_nofile();
    let calls = a.calls.clone().unwrap_or_else(|| if a.quick { vec![20, 50] } else { vec![750, 1500, 1800, 5000, 10000] });
    if calls.iter().any(|&n| n == 0 || n > MAX_CALLS) {
        bail!("calls must be between 1 and {MAX_CALLS}");
    }
    for r in &a.relays {
        if !RELAYS.contains(&r.as_str()) {
            bail!("unknown relay {r:?}: use {}", RELAYS.join(", "));
        }
    }
    let setup_rate = a.setup_rate.unwrap_or(if a.quick { 100.0 } else { 30.0 });
    if !(setup_rate > 0.0 && setup_rate <= 100_000.0) {
        bail!("--setup-rate must be in (0, 100000]");
    }
    let seconds = a.seconds.unwrap_or(if a.quick { 1.0 } else { 30.0 });
    let idle_seconds = a.idle_seconds.unwrap_or(if a.quick { 1.0 } else { 10.0 });
    if !(seconds > 0.0 && seconds <= 3600.0) {
        bail!("--seconds must be in (0, 3600]");
    }
    let cap_target = a.capacity.unwrap_or(if a.quick { 2_000 } else { 1_000_000 });
    // --quick: 2,000 sessions take about 3 s on a loaded 2-core machine; the budget only bounds
    // a stuck run (the ramp stops at its target).
    let cap_budget = Duration::from_secs_f64(a.capacity_seconds.unwrap_or(if a.quick { 10.0 } else { 300.0 }).clamp(1.0, 7200.0));
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let dir = std::fs::canonicalize(&a.out)?;

    let tb = Testbed::star(2).context("building the testbed")?;
    let mut runs: Vec<RelayRun> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let have_rtpengine = std::process::Command::new("rtpengine").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok();
    for &media in &a.media {
        for &n in &calls {
            for r in &a.relays {
                if r == KERNEL_FORWARD && media != Media::Rtp {
                    eprintln!("bench relay: {r} has no relay to bridge {} media: its runs are the rtp ones", media.name());
                    continue;
                }
                if r == "rtpengine" && !have_rtpengine {
                    failures.push(format!("N={n} rtpengine: not installed (apt-get install rtpengine-daemon)"));
                    continue;
                }
                eprintln!("bench relay: {r}, {n} calls ({}) at {setup_rate}/s, {seconds} s of media ...", media.name());
                let spec = RunSpec { calls: n, setup_rate, seconds, idle_seconds, media };
                match run_one(&tb, r, &spec, &dir) {
                    Ok(run) => {
                        eprintln!(
                            "  {} of {n} calls up ({:.1}/s), loss {:.3} %, relay CPU {:.1} %, {} set-up failures",
                            run.calls_up, run.setup_rate_achieved, run.loss_pct, run.cpu_pct, run.setup_failures
                        );
                        runs.push(run);
                    }
                    Err(e) => {
                        eprintln!("  failed: {e:#}");
                        failures.push(format!("N={n} {r} ({}): {e:#}", media.name()));
                    }
                }
            }
        }
    }
    set_added_delay(&mut runs);
    let cap = if a.skip_capacity {
        None
    } else {
        eprintln!("bench relay: capacity phase (target {cap_target} sessions, {} s budget) ...", cap_budget.as_secs());
        Some(capacity(
            &tb,
            &CapacityPlan {
                target: cap_target,
                budget: cap_budget,
                clients: a.capacity_clients.clamp(1, 64),
                batch: a.capacity_batch.min(10_000),
                quick: a.quick,
            },
            &dir,
            &mut failures,
        ))
    };
    drop(tb);

    relay_report::print_table(&runs, cap.as_ref());
    let meta = crate::report::RunMeta::collect(
        &format!("mediaplane bench relay {}", std::env::args().skip(3).collect::<Vec<_>>().join(" ")),
        &Profile::voice(),
        seconds,
    );
    relay_report::write_all(&a.out, &meta, setup_rate, &runs, cap.as_ref(), &failures)?;
    println!("\nresults: {0}/results.json, {0}/results.csv, report: {0}/report.html", a.out.display());
    if !failures.is_empty() {
        bail!("{} run(s) failed:\n{}", failures.len(), failures.join("\n"));
    }
    Ok(())
}
