//! `mediaplane bench rtsp`: one camera, N viewers, through mediaplane's RTSP proxy on each data
//! plane and, in the same run, through gst-rtsp-server restreaming the same camera (what users
//! of GStreamer run for this job).
//!
//! The camera (gst-rtsp-server: H.264 + Opus, the tests' `camera.py`) is in namespace p0, the
//! proxy under test in the SFU namespace, the viewers in p1: native RTSP clients (this module),
//! UDP or TCP (interleaved), plus one *anchor* viewer that watches the camera directly through
//! the SFU namespace's IP forwarding. A packet's added delay is its arrival at a viewer minus the
//! arrival of the same payload at the anchor (matched by payload, since gst-rtsp-server
//! re-payloads and so renumbers). The camera sends each of its clients its copy in turn, so a
//! few microseconds of that skew are in every number, the same for every subject.
//!
//! CPU per copy is the subject's process CPU (and, on the eBPF planes, the BPF programs' run
//! time) over the measuring window, divided by the copies the viewers received: the
//! measurement definitions of `bench sfu`.

use crate::conference::{api, extra_delta, kernel_split, process_cpu_ns, ServeProcess, API};
use anyhow::{bail, Context};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::process::Supervised;
use mediaplane_bench::qos::Summary;
use mediaplane_rtsp::describe::{control_url, Presentation};
use mediaplane_rtsp::message::{decode, Message, Request, Response};
use mediaplane_rtsp::transport::TransportSpec;
use serde::Serialize;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CAMERA_PY: &str = include_str!("../../rtsp/tests/peers/camera.py");
const CAMERA_PORT: u16 = 8554;
const PROXY_PORT: u16 = 8555;

#[derive(clap::Args)]
pub struct BenchRtspArgs {
    /// A seconds-long smoke run: 1 and 3 UDP viewers and 2 TCP ones, 2 s each.
    #[arg(long)]
    quick: bool,
    /// What serves the viewers: gst (gst-rtsp-server restreaming the camera), userspace, ebpf,
    /// ebpf-xdp, afxdp (mediaplane's RTSP proxy on that data plane).
    #[arg(long, value_delimiter = ',', default_value = "gst,userspace,ebpf")]
    subjects: Vec<String>,
    /// UDP viewer counts (default 1, 10, 100).
    #[arg(long, value_delimiter = ',')]
    viewers: Option<Vec<usize>>,
    /// TCP (interleaved) viewers in a run of their own; 0: none.
    #[arg(long)]
    tcp_viewers: Option<usize>,
    /// Seconds of media measured per run (default 10).
    #[arg(long)]
    seconds: Option<f64>,
    /// Directory for results.json.
    #[arg(long, default_value = "bench-results/rtsp")]
    out: PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct RtspRun {
    pub subject: String,
    pub transport: &'static str,
    pub viewers: usize,
    /// Packets the anchor received in the window, and the copies the viewers received.
    pub anchor_packets: u64,
    pub copies: u64,
    /// Copies whose payload the anchor did not receive in the window (edges of the window).
    pub unmatched: u64,
    /// 1 - copies / (viewers x anchor packets).
    pub loss: f64,
    /// Added delay, µs (viewer arrival - anchor arrival of the same payload).
    pub added_delay_us: Summary,
    pub cpu_ns: u64,
    pub bpf_run_ns: u64,
    pub cpu_per_copy_ns: Option<f64>,
    /// Share of one core per viewer.
    pub cpu_per_viewer: f64,
    /// The measuring window, ns.
    pub window_ns: u64,
    /// eBPF planes: camera packets fanned out by the kernel, and passed to the slow path.
    pub kernel_forwarded: Option<u64>,
    pub slow_path: Option<u64>,
}

pub fn run(a: BenchRtspArgs) -> anyhow::Result<()> {
    mediaplane_bench::ensure_root("mediaplane bench rtsp")?;
    let udp = a.viewers.clone().unwrap_or(if a.quick { vec![1, 3] } else { vec![1, 10, 100] });
    let tcp = a.tcp_viewers.unwrap_or(if a.quick { 2 } else { 10 });
    let secs = Duration::from_secs_f64(a.seconds.unwrap_or(if a.quick { 2.0 } else { 10.0 }));
    let tb = Testbed::star(2)?;
    let work = std::env::temp_dir().join(format!("{}-rtsp", tb.prefix));
    std::fs::create_dir_all(&work)?;
    let result = run_on(&tb, &work, &a.subjects, &udp, tcp, secs);
    let _ = std::fs::remove_dir_all(&work);
    let runs = result?;
    std::fs::create_dir_all(&a.out)?;
    std::fs::write(a.out.join("results.json"), serde_json::to_string_pretty(&runs)?)?;
    println!("{}", table(&runs));
    println!("results: {}", a.out.join("results.json").display());
    Ok(())
}

fn run_on(tb: &Testbed, work: &std::path::Path, subjects: &[String], udp: &[usize], tcp: usize, secs: Duration) -> anyhow::Result<Vec<RtspRun>> {
    let script = work.join("camera.py");
    std::fs::write(&script, CAMERA_PY)?;
    let cam = &tb.peers[0];
    let camera = Peer::start(tb.command(&cam.ns, "/usr/bin/python3").args([script.to_str().unwrap(), &CAMERA_PORT.to_string(), "25", &cam.ip.to_string()]))?;
    let camera_url = format!("rtsp://{}:{CAMERA_PORT}/cam", cam.ip);
    let mut cases: Vec<(usize, bool)> = udp.iter().map(|&n| (n, false)).collect();
    if tcp > 0 {
        cases.push((tcp, true));
    }
    let mut runs = Vec::new();
    for subject in subjects {
        for &(n, over_tcp) in &cases {
            eprintln!("bench rtsp: {subject}, {n} {} viewers", if over_tcp { "TCP" } else { "UDP" });
            let r = measure(tb, work, &script, subject, &camera_url, n, over_tcp, secs).with_context(|| format!("{subject} with {n} viewers"))?;
            runs.push(r);
        }
    }
    drop(camera);
    Ok(runs)
}

/// A process that prints `ready` when it serves (camera.py).
struct Peer {
    proc: Supervised,
}

impl Peer {
    fn start(cmd: &mut Command) -> anyhow::Result<Peer> {
        let mut proc = Supervised::spawn("camera.py", cmd.stdout(Stdio::piped()).stderr(Stdio::null()))?;
        let out = proc.child_mut().stdout.take().unwrap();
        let ready = Arc::new(Mutex::new(false));
        let r = ready.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if l == "ready" {
                    *r.lock().unwrap() = true;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(15);
        while !*ready.lock().unwrap() {
            if Instant::now() > deadline || !proc.alive() {
                bail!("camera.py did not start");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Peer { proc })
    }
}

#[allow(clippy::too_many_arguments)]
fn measure(
    tb: &Testbed,
    work: &std::path::Path,
    script: &std::path::Path,
    subject: &str,
    camera_url: &str,
    n: usize,
    over_tcp: bool,
    secs: Duration,
) -> anyhow::Result<RtspRun> {
    let sfu_ip = tb.peers[0].sfu_ip;
    let mut serve = None;
    let mut restreamer = None;
    let url = if subject == "gst" {
        let mut cmd = tb.command(&tb.sfu_ns, "/usr/bin/python3");
        cmd.env("CAMERA_SOURCE", camera_url).args([script.to_str().unwrap(), &PROXY_PORT.to_string(), "25", &sfu_ip.to_string()]);
        restreamer = Some(Peer::start(&mut cmd)?);
        format!("rtsp://{sfu_ip}:{PROXY_PORT}/cam")
    } else {
        let cfg = work.join("mediaplane.toml");
        // Every viewer connects from the viewers' one namespace address.
        std::fs::write(&cfg, format!("[media]\nip = \"{sfu_ip}\"\n[rtsp]\nmax_connections_per_client = {}\nmax_sessions_per_client = {}\n", n + 2, n + 2))?;
        let store = work.join(format!("{subject}-{n}.db"));
        let listen = format!("{sfu_ip}:{PROXY_PORT}");
        let path = format!("cam={camera_url}");
        let extra = ["--config", cfg.to_str().unwrap(), "--rtsp-listen", &listen, "--rtsp-path", &path];
        let s = ServeProcess::start_with(tb, subject, &store, work.join(format!("{subject}-{n}.log")), API, &extra)?;
        serve = Some(s);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !api(tb, "GET", "/v1/rtsp/paths/cam", None).is_ok_and(|v| v["upstream"]["playing"] == true) {
            if Instant::now() > deadline {
                bail!("the proxy did not pull the camera");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        format!("rtsp://{listen}/cam")
    };
    let pid = match (&serve, &restreamer) {
        (Some(s), _) => Some(s.pid()),
        (_, Some(r)) => Some(r.proc.pid()),
        _ => None,
    };
    let cpu = || pid.map_or(0, process_cpu_ns);
    let viewer_ns = tb.peers[1].ns.clone();
    let (cam, proxied) = (camera_url.to_string(), url.clone());
    let mut watchers = tb.in_ns(&viewer_ns, move || -> anyhow::Result<Watchers> {
        let anchor = Watcher::connect(&cam, false)?;
        let mut viewers = Vec::new();
        for _ in 0..n {
            viewers.push(Watcher::connect(&proxied, over_tcp)?);
        }
        Ok(Watchers { anchor, viewers })
    })??;
    // Every viewer plays: let the first packets through, then measure.
    std::thread::sleep(Duration::from_millis(500));
    watchers.drain();
    let stats0 = if serve.is_some() { api(tb, "GET", "/v1/stats", None)? } else { serde_json::Value::Null };
    let cpu0 = cpu();
    let heard = watchers.receive(secs)?;
    let cpu_ns = cpu().saturating_sub(cpu0);
    let stats1 = if serve.is_some() { api(tb, "GET", "/v1/stats", None)? } else { serde_json::Value::Null };
    drop(watchers);
    if let Some(mut s) = serve {
        s.stop()?;
    }
    drop(restreamer);

    let bpf_run_ns = extra_delta(&stats0, &stats1, "bpf_run_time_ns");
    let ebpf = subject.starts_with("ebpf");
    let (forwarded, slow) = kernel_split(&stats0, &stats1);
    let mut delays = heard.delays_us.clone();
    let copies = heard.copies;
    let expected = (heard.anchor_packets * n as u64).max(1);
    Ok(RtspRun {
        subject: subject.to_string(),
        transport: if over_tcp { "tcp" } else { "udp" },
        viewers: n,
        anchor_packets: heard.anchor_packets,
        copies,
        unmatched: heard.unmatched,
        loss: 1.0 - (copies.min(expected) as f64 / expected as f64),
        added_delay_us: Summary::of(&mut delays),
        cpu_ns,
        bpf_run_ns,
        cpu_per_copy_ns: (copies > 0).then(|| (cpu_ns + bpf_run_ns) as f64 / copies as f64),
        cpu_per_viewer: (cpu_ns + bpf_run_ns) as f64 / secs.as_nanos() as f64 / n.max(1) as f64,
        window_ns: secs.as_nanos() as u64,
        kernel_forwarded: ebpf.then_some(forwarded),
        slow_path: ebpf.then_some(slow),
    })
}

/// One native RTSP viewer: its RTSP connection and its tracks' sockets (UDP), or the
/// connection its media comes interleaved on (TCP).
struct Watcher {
    control: TcpStream,
    udp: Vec<UdpSocket>,
    tcp_buf: Option<Vec<u8>>,
}

impl Watcher {
    /// DESCRIBE, SETUP of every track, PLAY.
    fn connect(url: &str, over_tcp: bool) -> anyhow::Result<Watcher> {
        let parsed = url::Url::parse(url)?;
        let addr = SocketAddr::new(parsed.host_str().unwrap_or("").parse()?, parsed.port().unwrap_or(554));
        let mut control = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        control.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut cseq = 0;
        let mut session: Option<String> = None;
        let mut ask = |control: &mut TcpStream, method: &str, uri: &str, headers: &[(&str, String)], session: &Option<String>| -> anyhow::Result<Response> {
            cseq += 1;
            let mut req = Request::new(method, uri, cseq);
            for (k, v) in headers {
                req.headers.set(k, v.clone());
            }
            if let Some(s) = session {
                req.headers.set("Session", s.clone());
            }
            control.write_all(&req.to_bytes())?;
            let mut buf = Vec::new();
            let mut byte = [0u8; 1];
            // Byte by byte: nothing after the answer (interleaved media) is taken from the stream.
            loop {
                if let Some((Message::Response(r), _)) = decode(&buf)? {
                    if r.status != 200 {
                        bail!("{method} {uri}: {} {}", r.status, r.reason);
                    }
                    return Ok(r);
                }
                if control.read(&mut byte)? == 0 {
                    bail!("{method} {uri}: connection closed");
                }
                buf.push(byte[0]);
            }
        };
        let r = ask(&mut control, "DESCRIBE", url, &[("Accept", "application/sdp".into())], &session)?;
        let p = Presentation::parse(&r.body)?;
        let base = r.headers.get("Content-Base").and_then(|b| url::Url::parse(b).ok()).unwrap_or(parsed.clone());
        let mut udp = Vec::new();
        for (i, t) in p.tracks.iter().enumerate() {
            let transport = if over_tcp {
                format!("RTP/AVP/TCP;unicast;interleaved={}-{}", 2 * i, 2 * i + 1)
            } else {
                let s = UdpSocket::bind("0.0.0.0:0")?;
                s.set_nonblocking(true)?;
                let _ = socket2::SockRef::from(&s).set_recv_buffer_size(1 << 20);
                let port = s.local_addr()?.port();
                udp.push(s);
                TransportSpec::udp((port, port + 1)).to_header()
            };
            let at = control_url(&base, t.control.as_deref()).ok_or_else(|| anyhow::anyhow!("bad control URL"))?;
            let r = ask(&mut control, "SETUP", at.as_str(), &[("Transport", transport)], &session)?;
            session = session.or(r.headers.session().map(String::from));
        }
        ask(&mut control, "PLAY", base.as_str(), &[("Range", "npt=0.000-".into())], &session)?;
        if over_tcp {
            control.set_nonblocking(true)?;
        }
        Ok(Watcher { control, udp, tcp_buf: over_tcp.then(Vec::new) })
    }
}

struct Watchers {
    anchor: Watcher,
    viewers: Vec<Watcher>,
}

/// What the viewers heard in a window.
struct Heard {
    anchor_packets: u64,
    copies: u64,
    unmatched: u64,
    delays_us: Vec<f64>,
}

impl Watchers {
    /// Read and forget whatever is queued.
    fn drain(&mut self) {
        let _ = self.poll_for(Duration::from_millis(50), &mut |_, _, _| {});
    }

    fn receive(&mut self, window: Duration) -> anyhow::Result<Heard> {
        let start = Instant::now();
        // A payload may recur (a test tone's identical audio frames, a still picture's slices):
        // a copy is matched to the anchor's arrival of that payload nearest in time.
        let mut anchor: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut anchor_packets = 0u64;
        let mut copies: Vec<(u64, u64)> = Vec::new();
        self.poll_for(window, &mut |who, key, at| match who {
            None => {
                anchor.entry(key).or_default().push(at);
                anchor_packets += 1;
            }
            Some(_) => copies.push((key, at)),
        })?;
        // Copies still on their way to a late anchor packet: the anchor keeps listening briefly.
        let _ = self.poll_anchor_only(Duration::from_millis(100), &mut |key, at| anchor.entry(key).or_default().push(at));
        let _ = start;
        let mut delays = Vec::with_capacity(copies.len());
        let mut unmatched = 0;
        for (key, at) in &copies {
            let nearest = anchor.get(key).and_then(|times| times.iter().min_by_key(|a| a.abs_diff(*at)));
            match nearest {
                Some(a) => delays.push((*at as f64 - *a as f64) / 1000.0),
                None => unmatched += 1,
            }
        }
        Ok(Heard { anchor_packets, copies: copies.len() as u64, unmatched, delays_us: delays })
    }

    fn poll_anchor_only(&mut self, window: Duration, on: &mut dyn FnMut(u64, u64)) -> anyhow::Result<()> {
        let deadline = Instant::now() + window;
        let t0 = clock_ns();
        let mut buf = vec![0u8; 65536];
        while Instant::now() < deadline {
            for s in &self.anchor.udp {
                while let Ok(n) = s.recv(&mut buf) {
                    if let Some(k) = payload_key(&buf[..n]) {
                        on(k, clock_ns().max(t0));
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// poll(2) over every socket until `window` has passed; `on(viewer or None for the anchor,
    /// payload key, arrival ns)` per RTP packet.
    fn poll_for(&mut self, window: Duration, on: &mut dyn FnMut(Option<usize>, u64, u64)) -> anyhow::Result<()> {
        let mut fds: Vec<(libc::pollfd, Option<usize>, Source)> = Vec::new();
        let mut add = |fd: i32, who: Option<usize>, src: Source| fds.push((libc::pollfd { fd, events: libc::POLLIN, revents: 0 }, who, src));
        for (t, s) in self.anchor.udp.iter().enumerate() {
            add(s.as_raw_fd(), None, Source::Udp(t));
        }
        for (v, w) in self.viewers.iter().enumerate() {
            match w.tcp_buf {
                Some(_) => add(w.control.as_raw_fd(), Some(v), Source::Tcp),
                None => {
                    for (t, s) in w.udp.iter().enumerate() {
                        add(s.as_raw_fd(), Some(v), Source::Udp(t));
                    }
                }
            }
        }
        let deadline = Instant::now() + window;
        let mut buf = vec![0u8; 65536];
        let mut pfds: Vec<libc::pollfd> = fds.iter().map(|f| f.0).collect();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            // SAFETY: pfds is a valid array of pollfd of the length given.
            let ready = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, left.as_millis().min(100) as i32) };
            if ready <= 0 {
                continue;
            }
            let now = clock_ns();
            for (i, p) in pfds.iter_mut().enumerate() {
                if p.revents == 0 {
                    continue;
                }
                p.revents = 0;
                let (_, who, src) = &fds[i];
                let w = match who {
                    None => &mut self.anchor,
                    Some(v) => &mut self.viewers[*v],
                };
                match src {
                    Source::Udp(t) => {
                        while let Ok(n) = w.udp[*t].recv(&mut buf) {
                            if let Some(k) = payload_key(&buf[..n]) {
                                on(*who, k, now);
                            }
                        }
                    }
                    Source::Tcp => {
                        let tb = w.tcp_buf.as_mut().unwrap();
                        loop {
                            match w.control.read(&mut buf) {
                                Ok(0) => bail!("a TCP viewer's connection closed"),
                                Ok(n) => tb.extend_from_slice(&buf[..n]),
                                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                                Err(e) => return Err(e.into()),
                            }
                        }
                        while let Some((m, used)) = decode(tb)? {
                            tb.drain(..used);
                            if let Message::Interleaved { channel, data } = m {
                                if channel % 2 == 0 {
                                    if let Some(k) = payload_key(&data) {
                                        on(*who, k, now);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

enum Source {
    Udp(usize),
    Tcp,
}

fn clock_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// What identifies a packet's content across a re-payloading restreamer: a hash of its RTP
/// payload and marker bit (RTCP and non-RTP: none).
fn payload_key(d: &[u8]) -> Option<u64> {
    if d.len() < 12 || d[0] >> 6 != 2 || (200..=204).contains(&d[1]) {
        return None;
    }
    let cc = (d[0] & 0x0f) as usize;
    let mut off = 12 + 4 * cc;
    if d[0] & 0x10 != 0 {
        let len = u16::from_be_bytes([*d.get(off + 2)?, *d.get(off + 3)?]) as usize;
        off += 4 + 4 * len;
    }
    let payload = d.get(off..)?;
    // FNV-1a.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in payload.iter().chain(std::iter::once(&(d[1] & 0x80))) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    Some(h)
}

fn table(runs: &[RtspRun]) -> String {
    let mut s = String::from(
        "| subject | viewers | copies | loss | unmatched | added delay p50 / p99 (µs) | CPU per copy (µs) | CPU per viewer (% of a core) | kernel-forwarded / slow path |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        s += &format!(
            "| {} | {} {} | {} | {:.2} % | {} | {:.0} / {:.0} | {} | {:.3} | {} |\n",
            r.subject,
            r.viewers,
            r.transport.to_uppercase(),
            r.copies,
            r.loss * 100.0,
            r.unmatched,
            r.added_delay_us.p50,
            r.added_delay_us.p99,
            r.cpu_per_copy_ns.map_or("-".into(), |c| format!("{:.2}", c / 1000.0)),
            r.cpu_per_viewer * 100.0,
            match (r.kernel_forwarded, r.slow_path) {
                (Some(f), Some(p)) => format!("{f} / {p}"),
                _ => "-".into(),
            },
        );
    }
    s
}
