//! A real conference through a real `mediaplane serve`: participants in network namespaces
//! around an SFU namespace, native RTP senders and receivers, and the direct path (the SFU
//! namespace's kernel routing participant to participant) measured in the same run, with the
//! data plane's hooks attached.
//!
//! The `kernel-forward` run ([`KERNEL_FORWARD`]) is the same conference without an SFU: no
//! `serve`, so no XDP, TC or sk_lookup program in the SFU namespace; every copy the SFU would
//! deliver (publisher i's stream to subscriber j) is sent by i straight to j and routed by the
//! SFU namespace's IP forwarding. Its delay is the floor `bench sfu` computes added delay
//! against.

use anyhow::{bail, Context};
use mediaplane_bench::added_delay::{added_delay, AddedDelay, AddedDelayMethod};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::process::Supervised;
use mediaplane_bench::qos::Summary;
use mediaplane_bench::traffic::{self, Profile, TrafficPlan, TrafficReport};
use mediaplane_core::srtp::{SrtpKey, SrtpSuite};
use mediaplane_dataplane::srtp::Context as SrtpContext;
use serde::Serialize;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// The conference (or relay run) without mediaplane: copies go through the SFU namespace's IP
/// forwarding, the floor the data planes are compared with.
pub const KERNEL_FORWARD: &str = "kernel-forward";

/// SFU port of each participant's transport, and of its optional "high" stream.
pub(crate) const SFU_PORT: u16 = 40000;
const SFU_HIGH_PORT: u16 = 40002;
/// Participant ports: media through the SFU, and the direct-path baseline.
pub(crate) const MEDIA_PORT: u16 = 5004;
const DIRECT_PORT: u16 = 5006;
pub(crate) const API: &str = "127.0.0.1:7580";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// Every participant sends one stream; every other participant receives it.
    OneStream,
    /// Low quality to all, high quality (its own SFU port) to the upper half.
    TwoStreams,
    /// Every participant publishes one VP8 video as three simulcast layers (one SSRC each, on
    /// its transport address); participant i receives j's layer `(i + j) % 3` (`max_layer`),
    /// renumbered onto one SSRC ([`Profile::simulcast_layer`]).
    Simulcast,
    /// The same layers, each published as a plain stream of its own (narrowed to its SSRC), and
    /// the same subscriptions to them: the same copies without the simulcast rewrite.
    SimulcastPlain,
    /// [`Scenario::Simulcast`] with every participant on SRTP (SDES keys at join,
    /// AEAD_AES_128_GCM), as a WebRTC room's browsers: on the eBPF planes every copy is
    /// renumbered and protected by the slow path. No RTCP (the generator sends none on SRTP).
    SimulcastSrtp,
    /// One publisher (p0), every other participant subscribed to it: a webinar, or one browser
    /// seen by N - 1 others. Plain RTP: the encrypted preset's baseline.
    Fanout,
    /// [`Scenario::Fanout`] with every participant speaking SRTP (keys given at join, SDES),
    /// AEAD_AES_128_GCM: the publisher's packets unprotected once, each copy protected with its
    /// subscriber's key.
    FanoutSrtpGcm,
    /// The same with AES_CM_128_HMAC_SHA1_80.
    FanoutSrtpCm,
}

impl Scenario {
    /// Whether participants publish simulcast layers ([`Scenario::Simulcast`], its plain and
    /// its SRTP twins).
    pub fn layered(self) -> bool {
        matches!(self, Scenario::Simulcast | Scenario::SimulcastPlain | Scenario::SimulcastSrtp)
    }

    /// Whether subscribers are simulcast consumers (each copy renumbered for it).
    pub fn rewritten(self) -> bool {
        matches!(self, Scenario::Simulcast | Scenario::SimulcastSrtp)
    }

    /// Whether only p0 publishes (the fan-out scenarios).
    pub fn fanout(self) -> bool {
        matches!(self, Scenario::Fanout | Scenario::FanoutSrtpGcm | Scenario::FanoutSrtpCm)
    }

    /// The SRTP suite every participant speaks, if any.
    pub fn srtp(self) -> Option<SrtpSuite> {
        match self {
            Scenario::FanoutSrtpGcm | Scenario::SimulcastSrtp => Some(SrtpSuite::AeadAes128Gcm),
            Scenario::FanoutSrtpCm => Some(SrtpSuite::AesCm128HmacSha1_80),
            _ => None,
        }
    }
}

/// Participant i's SRTP master key in one direction (`sfu_sends`: what the SFU protects its
/// copies to i with; else what i protects its packets with). Fixed per run: a benchmark in
/// namespaces of its own, not a secret.
fn participant_key(suite: SrtpSuite, i: usize, sfu_sends: bool) -> SrtpKey {
    // Participant and direction in the first three bytes: every key of a run differs.
    let mut master: Vec<u8> = (0..suite.master_len() as u8).map(|b| b.wrapping_mul(13)).collect();
    master[..2].copy_from_slice(&(i as u16).to_be_bytes());
    master[2] = u8::from(sfu_sends);
    SrtpKey::new(suite, master).expect("the suite's length")
}

/// A libsrtp session with participant i's key: `sfu_sends` as above, `outbound` the side that
/// protects.
fn participant_srtp(suite: SrtpSuite, i: usize, sfu_sends: bool, outbound: bool) -> anyhow::Result<std::sync::Arc<SrtpContext>> {
    Ok(std::sync::Arc::new(SrtpContext::new(&participant_key(suite, i, sfu_sends), outbound).map_err(anyhow::Error::msg)?))
}

/// Layers of a simulcast scenario's publishers.
const LAYERS: usize = 3;

/// The layer participant `subscriber` receives of `publisher`'s video in a simulcast scenario:
/// from N = 5 on every layer has consumers (at N = 4 two publishers each have a layer nobody
/// receives: its packets are skipped per consumer with the rewrite, dropped as copy-less plain).
fn layer_for(subscriber: usize, publisher: usize) -> usize {
    (subscriber + publisher) % LAYERS
}

pub struct ConferenceSpec {
    pub dataplane: String,
    pub scenario: Scenario,
    pub profile: Profile,
    pub duration: Duration,
}

/// What one participant received, per data plane run.
#[derive(Debug, Clone, Serialize)]
pub struct ParticipantResult {
    pub participant: String,
    pub streams: usize,
    pub expected: u64,
    pub received: u64,
    pub lost: u64,
    pub duplicates: u64,
    pub unexpected: u64,
    pub delay_ns: Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct ConferenceResult {
    pub dataplane: String,
    pub scenario: Scenario,
    pub participants: Vec<ParticipantResult>,
    pub copies_expected: u64,
    pub copies_received: u64,
    /// UDP payload bytes of copies, as measured at the receivers.
    pub bytes_received: u64,
    pub lost: u64,
    pub duplicates: u64,
    pub unexpected: u64,
    /// One-way delay over all copies through the SFU (`kernel-forward`: sent directly).
    pub delay_ns: Summary,
    /// One-way delay of the direct path in this run (participant to participant through the SFU
    /// namespace's router), with the data plane's hooks attached: a diagnostic, not the floor.
    pub direct_delay_ns: Summary,
    /// (delay ns, cumulative fraction) points of the delay distribution through the SFU.
    pub delay_cdf: Vec<(f64, f64)>,
    /// The floor: `delay_ns` of the `kernel-forward` run at the same N and scenario in the same
    /// invocation (set by `bench sfu`; None for the floor itself and outside `bench sfu`).
    pub floor_delay_ns: Option<Summary>,
    /// Added delay (DESIGN.md): `delay_ns` minus `floor_delay_ns`, quantile by quantile.
    pub added_delay_ns: Option<AddedDelay>,
    /// `delay_ns` minus `direct_delay_ns` (the direct path pays the plane's hooks too, so this
    /// flatters a plane whose hooks slow plain forwarding); what `demo` shows.
    pub added_delay_vs_direct_ns: Option<AddedDelay>,
    /// BPF programs attached in the SFU namespace during the run (XDP, TC, tcx on its
    /// interfaces; sk_lookup on the namespace), as `bpftool` lists them; None if it could not run.
    pub hooks_attached: Option<Vec<String>>,
    /// RFC 3550 jitter (mean over copies) and RFC 4689 delay variation p99 (worst copy), ns.
    pub jitter_ns_mean: f64,
    pub delay_variation_p99_ns: f64,
    /// G.107 E-model MOS per copy as G.711 (Ie = 0, Bpl = 4.3): mean and worst copy.
    pub mos_mean: f64,
    pub mos_min: f64,
    /// CPU time of the `serve` process during the run (user + system, all threads).
    pub serve_cpu_ns: u64,
    /// Run time of the BPF program during the run (kernel BPF statistics; eBPF plane only).
    pub bpf_run_ns: u64,
    /// (serve CPU + BPF run time) per delivered copy.
    pub cpu_per_copy_ns: Option<f64>,
    /// The daemon's own counters after the run (`/v1/stats`).
    pub daemon_stats: Value,
    /// eBPF planes: packets of the SFU's streams the BPF program handled itself during the run
    /// (`forwarded`: fanned out, simulcast copies renumbered or skipped), and those it handed
    /// to the user-space slow path ([`mediaplane_ebpf::maps::SLOW_PATH_PASSES`]).
    #[serde(default)]
    pub kernel_handled: Option<u64>,
    #[serde(default)]
    pub slow_path_packets: Option<u64>,
    /// `kernel_handled` / (`kernel_handled` + `slow_path_packets`): the share Scallop reports
    /// for its switch (96.5 %).
    #[serde(default)]
    pub kernel_share: Option<f64>,
    pub generator_cpu_ns: u64,
    /// RTCP packets the participants sent the SFU during the run (simulcast scenarios: SRs,
    /// RRs, PLIs, NACKs, as browsers send them; 0 elsewhere and on the floor).
    #[serde(default)]
    pub rtcp_sent: u64,
}

/// `mediaplane serve` running inside the SFU namespace; killed on drop if still up.
pub(crate) struct ServeProcess {
    proc: Supervised,
    log: PathBuf,
}

impl ServeProcess {
    pub(crate) fn start(tb: &Testbed, dataplane: &str, store: &std::path::Path, log: PathBuf) -> anyhow::Result<ServeProcess> {
        Self::start_with(tb, dataplane, store, log, API, &[])
    }

    /// [`ServeProcess::start`] with the API on `listen` and more flags.
    pub(crate) fn start_with(
        tb: &Testbed,
        dataplane: &str,
        store: &std::path::Path,
        log: PathBuf,
        listen: &str,
        extra: &[&str],
    ) -> anyhow::Result<ServeProcess> {
        let exe = std::env::current_exe().context("locating the mediaplane binary")?;
        let logf = std::fs::File::create(&log)?;
        let mut cmd = tb.command(&tb.sfu_ns, exe.to_str().unwrap());
        // The pin dir is per run; `ip netns exec` gives serve a private mount namespace, where it
        // mounts its own bpffs, so nothing outlives the run.
        let pin_dir = format!("/sys/fs/bpf/{}-{dataplane}", tb.prefix);
        let (kind, xdp) = plane_variant(dataplane);
        cmd.args(["serve", "--listen", listen, "--store", store.to_str().unwrap(), "--reset", "--dataplane", kind, "--pin-dir", &pin_dir])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(logf);
        if let Some(x) = xdp {
            cmd.args(["--xdp-prefilter", x]);
        }
        if kind == "ebpf" || kind == "afxdp" {
            for p in &tb.peers {
                cmd.args(["--interface", &p.sfu_if]);
            }
        }
        let proc = Supervised::spawn("mediaplane serve", &mut cmd).context("starting mediaplane serve in the SFU namespace")?;
        Ok(ServeProcess { proc, log })
    }

    /// Whether it exited, and the end of its log if so.
    pub(crate) fn exited(&mut self) -> anyhow::Result<Option<String>> {
        Ok(self.proc.exited()?.map(|st| format!("{st}: {}", std::fs::read_to_string(&self.log).unwrap_or_default())))
    }

    pub(crate) fn alive(&mut self) -> bool {
        self.proc.alive()
    }

    /// The `ip netns exec` wrapper execs mediaplane, so the child pid is the daemon's.
    pub(crate) fn pid(&self) -> u32 {
        self.proc.pid()
    }

    pub(crate) fn stop(&mut self) -> anyhow::Result<()> {
        let st = self.proc.terminate(Duration::from_secs(10))?;
        if !st.success() {
            bail!("serve exited with {st}; log: {}", self.log.display());
        }
        Ok(())
    }
}

/// A data plane as the benchmarks name it: (`serve --dataplane`, `--xdp-prefilter`). "ebpf"
/// takes the default (auto: no pre-filter on veth, where it makes veth copy every packet),
/// "ebpf-xdp" puts it on, "ebpf-noxdp" leaves it off (A/Bs of the pre-filter).
pub(crate) fn plane_variant(name: &str) -> (&str, Option<&'static str>) {
    match name {
        "ebpf-xdp" => ("ebpf", Some("on")),
        "ebpf-noxdp" => ("ebpf", Some("off")),
        d => (d, None),
    }
}

/// One API call made from inside the SFU namespace (the daemon listens on its loopback).
pub(crate) fn api(tb: &Testbed, method: &str, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
    api_with_timeout(tb, method, path, body, Duration::from_secs(5))
}

/// [`api`] for requests that may legitimately take long (bulk set-up under load).
pub(crate) fn api_with_timeout(tb: &Testbed, method: &str, path: &str, body: Option<Value>, timeout: Duration) -> anyhow::Result<Value> {
    let (method, url) = (method.to_string(), format!("http://{API}{path}"));
    let r = tb.in_ns(&tb.sfu_ns, move || {
        let req = ureq::request(&method, &url).timeout(timeout);
        let resp = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match resp {
            Ok(r) => r.into_json::<Value>().map_err(|e| e.to_string()),
            Err(ureq::Error::Status(code, r)) => Err(format!("HTTP {code}: {}", r.into_string().unwrap_or_default())),
            Err(e) => Err(e.to_string()),
        }
    })?;
    r.map_err(|e| anyhow::anyhow!("{path}: {e}"))
}

pub(crate) fn wait_ready(tb: &Testbed, serve: &mut ServeProcess) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if api(tb, "GET", "/health", None).is_ok() {
            return Ok(());
        }
        if let Some(st) = serve.proc.exited()? {
            let log = std::fs::read_to_string(&serve.log).unwrap_or_default();
            bail!("serve exited at start ({st}):\n{log}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("serve did not answer within 20 s")
}

/// CPU time of all threads of a process, ns (from /proc/<pid>/task/*/schedstat).
pub(crate) fn process_cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// How much an eBPF plane counter (`/v1/stats` `extra`) grew from `before` to `after`.
pub(crate) fn extra_delta(before: &Value, after: &Value, k: &str) -> u64 {
    let at = |v: &Value| v["extra"][k].as_u64().unwrap_or(0);
    at(after).saturating_sub(at(before))
}

/// The eBPF plane's packets of its own streams from `before` to `after` (`/v1/stats`): those
/// the BPF program fanned out itself (`forwarded`), and those it handed to the user-space slow
/// path ([`mediaplane_ebpf::maps::SLOW_PATH_PASSES`]).
pub(crate) fn kernel_split(before: &Value, after: &Value) -> (u64, u64) {
    (extra_delta(before, after, "forwarded"), mediaplane_ebpf::maps::SLOW_PATH_PASSES.iter().map(|k| extra_delta(before, after, k)).sum())
}

pub(crate) fn flow_main(i: usize) -> u32 {
    1000 + i as u32
}
/// Layer `l` of participant i's simulcast video: 3000..5999 (up to 1,000 participants).
fn flow_layer(i: usize, l: usize) -> u32 {
    3000 + 1000 * l as u32 + i as u32
}
/// Participant i's own SSRC as a receiver (its RTCP's sender SSRC): none of the flows'.
fn receiver_ssrc(i: usize) -> u32 {
    0x4d50_0000 + i as u32
}
fn flow_high(i: usize) -> u32 {
    2000 + i as u32
}
fn flow_direct(i: usize) -> u32 {
    9000 + i as u32
}
/// `kernel-forward`: the copy of i's "main" (or "high") stream sent by i straight to j. Raw flow
/// ids are 16-bit: 10000..=29999 for up to 100 participants.
const MAX_KERNEL_FORWARD: usize = 100;
fn flow_mesh_main(i: usize, j: usize) -> u32 {
    10000 + (MAX_KERNEL_FORWARD * i + j) as u32
}
fn flow_mesh_high(i: usize, j: usize) -> u32 {
    20000 + (MAX_KERNEL_FORWARD * i + j) as u32
}

/// BPF programs attached in the SFU namespace, as "hook program@where": XDP and clsact TC on
/// its interfaces (`bpftool net`), tcx on them (a `BPF_PROG_QUERY` per interface and direction:
/// this bpftool may not list tcx) and the namespace's own links, e.g. sk_lookup (`bpftool link`).
pub(crate) fn attached_hooks(tb: &Testbed) -> anyhow::Result<Vec<String>> {
    let json = |out: std::process::Output| -> anyhow::Result<Value> {
        if !out.status.success() {
            bail!("bpftool: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    let net = json(tb.command(&tb.sfu_ns, "bpftool").args(["-j", "net", "show"]).output().context("running bpftool")?)?;
    let mut hooks = Vec::new();
    for section in net.as_array().into_iter().flatten().filter_map(Value::as_object) {
        for (hook, entries) in section {
            for e in entries.as_array().into_iter().flatten() {
                let kind = e["kind"].as_str().or(e["mode"].as_str()).map(|k| format!("/{k}")).unwrap_or_default();
                let prog = e["name"].as_str().map(str::to_string).unwrap_or_else(|| format!("id {}", e["id"]));
                hooks.push(format!("{hook}{kind} {prog}@{}", e["devname"].as_str().unwrap_or("?")));
            }
        }
    }
    let ifs: Vec<String> = tb.peers.iter().map(|p| p.sfu_if.clone()).collect();
    let tcx = tb.in_ns(&tb.sfu_ns, move || -> std::io::Result<Vec<String>> {
        let mut found = Vec::new();
        for dev in ifs {
            let name = std::ffi::CString::new(dev.as_str()).expect("interface names have no NUL");
            // SAFETY: `name` is a valid NUL-terminated string.
            let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
            for (dir, attach_type) in [("ingress", BPF_TCX_INGRESS), ("egress", BPF_TCX_EGRESS)] {
                let count = tcx_count(ifindex, attach_type)?;
                if count > 0 {
                    found.push(format!("tcx/{dir} {count} program(s)@{dev}"));
                }
            }
        }
        Ok(found)
    })??;
    hooks.extend(tcx);
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(Path::new(mediaplane_bench::netns::NETNS_DIR).join(&tb.sfu_ns))?.ino();
    let links = json(std::process::Command::new("bpftool").args(["-j", "link", "show"]).output().context("running bpftool")?)?;
    for l in links.as_array().into_iter().flatten().filter(|l| l["netns_ino"].as_u64() == Some(ino)) {
        hooks.push(format!("{} id {}@netns", l["attach_type"].as_str().unwrap_or("netns"), l["prog_id"]));
    }
    Ok(hooks)
}

const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;

/// How many programs tcx has at `ifindex` (in this thread's network namespace) for
/// `attach_type`; 0 on a kernel without tcx.
fn tcx_count(ifindex: u32, attach_type: u32) -> std::io::Result<u32> {
    /// The BPF_PROG_QUERY part of `union bpf_attr`.
    #[repr(C)]
    #[derive(Default)]
    struct Query {
        target_ifindex: u32,
        attach_type: u32,
        query_flags: u32,
        attach_flags: u32,
        prog_ids: u64,
        count: u32,
        _pad: u32,
        prog_attach_flags: u64,
        link_ids: u64,
        link_attach_flags: u64,
        revision: u64,
    }
    let mut q = Query { target_ifindex: ifindex, attach_type, ..Default::default() };
    // SAFETY: bpf(2) reads and writes `q` only, within the size given.
    let r = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_QUERY, &mut q as *mut Query, std::mem::size_of::<Query>()) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::EINVAL) { Ok(0) } else { Err(e) };
    }
    Ok(q.count)
}

/// The session on a running daemon: participants p0..p(n-1) (SFU address `sfu_ip:40000`,
/// media at `ip:5004`) publish "main" (narrowed to SSRC 1000+i when RTP); in two-streams also
/// "high" on `sfu_ip:40002`; everyone subscribes to every other's "main", the upper half also
/// to "high".
/// `narrow`: RTP streams are narrowed to their SSRC (as a WebRTC SFU would publish them); else
/// they take any SSRC on their address.
pub(crate) fn setup_room(tb: &Testbed, n: usize, scenario: Scenario, rtp: bool, narrow: bool) -> anyhow::Result<()> {
    api(tb, "POST", "/v1/rooms", Some(json!({"id": "demo"})))?;
    let high_half = |i: usize| i >= n / 2;
    for (i, p) in tb.peers.iter().take(n).enumerate() {
        let local = SocketAddr::new(p.sfu_ip, SFU_PORT);
        let remote = SocketAddr::new(p.ip, MEDIA_PORT);
        let mut participant = json!({"id": format!("p{i}"), "local": local, "remote": remote});
        if let Some(suite) = scenario.srtp() {
            use base64::Engine as _;
            let b64 = |k: SrtpKey| base64::engine::general_purpose::STANDARD.encode(k.master);
            participant["srtp"] =
                json!({"suite": suite.name(), "inbound": b64(participant_key(suite, i, false)), "outbound": b64(participant_key(suite, i, true))});
        }
        api(tb, "POST", "/v1/rooms/demo/participants", Some(participant))?;
        let streams = format!("/v1/rooms/demo/participants/p{i}/streams");
        match scenario {
            Scenario::Fanout | Scenario::FanoutSrtpGcm | Scenario::FanoutSrtpCm => {
                if i == 0 {
                    api(tb, "POST", &streams, Some(json!({"name": "main", "ssrc": flow_main(0)})))?;
                }
            }
            Scenario::Simulcast | Scenario::SimulcastSrtp => {
                let layers: Vec<u32> = (0..LAYERS).map(|l| flow_layer(i, l)).collect();
                api(tb, "POST", &streams, Some(json!({"name": "video", "layers": layers, "codec": "vp8", "clock_rate": 90_000})))?;
            }
            Scenario::SimulcastPlain => {
                for l in 0..LAYERS {
                    api(tb, "POST", &streams, Some(json!({"name": format!("l{l}"), "ssrc": flow_layer(i, l), "clock_rate": 90_000})))?;
                }
            }
            Scenario::OneStream | Scenario::TwoStreams => {
                // RTP streams are narrowed to their SSRC; raw (thesis) streams forward any payload.
                let ssrc = (rtp && narrow).then_some(flow_main(i));
                api(tb, "POST", &streams, Some(json!({"name": "main", "ssrc": ssrc, "rtp": rtp})))?;
                if scenario == Scenario::TwoStreams {
                    let high = SocketAddr::new(p.sfu_ip, SFU_HIGH_PORT);
                    api(tb, "POST", &streams, Some(json!({"name": "high", "local": high, "rtp": rtp})))?;
                }
            }
        }
    }
    for i in 0..n {
        for j in (0..n).filter(|j| *j != i) {
            let path = format!("/v1/rooms/demo/participants/p{i}/subscriptions");
            let publisher = format!("p{j}");
            match scenario {
                Scenario::Fanout | Scenario::FanoutSrtpGcm | Scenario::FanoutSrtpCm => {
                    if j == 0 {
                        api(tb, "POST", &path, Some(json!({"publisher": publisher, "stream": "main"})))?;
                    }
                }
                Scenario::Simulcast | Scenario::SimulcastSrtp => {
                    let l = layer_for(i, j);
                    api(tb, "POST", &path, Some(json!({"publisher": publisher, "stream": "video", "preferred_layer": l, "max_layer": l})))?;
                }
                Scenario::SimulcastPlain => {
                    api(tb, "POST", &path, Some(json!({"publisher": publisher, "stream": format!("l{}", layer_for(i, j))})))?;
                }
                Scenario::OneStream | Scenario::TwoStreams => {
                    api(tb, "POST", &path, Some(json!({"publisher": publisher, "stream": "main"})))?;
                    if scenario == Scenario::TwoStreams && high_half(i) {
                        api(tb, "POST", &path, Some(json!({"publisher": publisher, "stream": "high"})))?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Wait until every simulcast consumer has its layer as its target. On the eBPF planes the
/// slow path's 20 ms tick creates and aims each consumer's kernel state, and a keyframe before
/// that would be skipped (the next comes a second later, and the run would count the gap lost);
/// the user-space plane makes a consumer's state at its stream's first packet, so there is
/// nothing to wait for (and nothing in the view before it).
fn wait_layers_aimed(tb: &Testbed) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = api(tb, "GET", "/v1/rooms/demo/consumers", None)?;
        let consumers = v["consumers"].as_array().cloned().unwrap_or_default();
        let waiting = consumers.iter().filter(|c| c["layers"]["target"] != c["layers"]["max"]).count();
        if waiting == 0 && !consumers.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{waiting} of {} simulcast consumers still without their layer as target after 10 s", consumers.len());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run one conference on an existing testbed through one data plane, or `kernel-forward`.
pub fn run(tb: &Testbed, spec: &ConferenceSpec, workdir: &std::path::Path) -> anyhow::Result<ConferenceResult> {
    let n = tb.peers.len();
    if n < 2 {
        bail!("a conference needs at least 2 participants");
    }
    let floor = spec.dataplane == KERNEL_FORWARD;
    if floor && n > MAX_KERNEL_FORWARD {
        bail!("{KERNEL_FORWARD} takes at most {MAX_KERNEL_FORWARD} participants");
    }
    let store = workdir.join(format!("{}-{}.db", tb.prefix, spec.dataplane));
    let log = workdir.join(format!("{}-{}.log", tb.prefix, spec.dataplane));
    let rtp = spec.profile.format != traffic::PayloadFormat::Raw;
    let ebpf = plane_variant(&spec.dataplane).0 == "ebpf";
    if spec.scenario.layered() && !matches!(spec.profile.format, traffic::PayloadFormat::Vp8 { .. }) {
        bail!("the {:?} scenario sends VP8 simulcast layers: use the simulcast preset", spec.scenario);
    }
    let mut serve = None;
    if !floor {
        let s = serve.insert(ServeProcess::start(tb, &spec.dataplane, &store, log.clone())?);
        wait_ready(tb, s)?;
        setup_room(tb, n, spec.scenario, rtp, true)?;
        if spec.scenario.rewritten() && ebpf {
            wait_layers_aimed(tb)?;
        }
    }
    let hooks = attached_hooks(tb).inspect_err(|e| tracing::warn!("listing the SFU namespace's BPF programs: {e:#}")).ok();
    if floor {
        match &hooks {
            Some(h) if !h.is_empty() => bail!("{KERNEL_FORWARD}: BPF programs still attached in the SFU namespace: {}", h.join(", ")),
            _ => {}
        }
    }

    // Traffic: one socket per participant sends and receives (symmetric RTP); a second socket
    // receives the direct-path flow from the previous participant. kernel-forward: each
    // participant sends every copy itself, straight to its subscriber.
    let high_half = |i: usize| i >= n / 2;
    let two = spec.scenario == Scenario::TwoStreams;
    let layered = spec.scenario.layered();
    let (fanout, srtp) = (spec.scenario.fanout(), spec.scenario.srtp());
    if fanout && !rtp {
        bail!("the {:?} scenario publishes one RTP stream (narrowed to its SSRC): use an RTP preset (voice, video)", spec.scenario);
    }
    let mut plan = TrafficPlan::new(spec.duration);
    let mut expected: Vec<Vec<u32>> = vec![Vec::new(); n];
    for (i, p) in tb.peers.iter().enumerate() {
        let sock = tb.udp_socket(&p.ns, SocketAddr::new(p.ip, MEDIA_PORT))?;
        let profile = spec.profile.clone();
        if fanout {
            // p0 publishes; through the SFU under its own key, on the floor each copy straight
            // to its subscriber under the key the SFU would have protected it with.
            if i == 0 && floor {
                for j in 1..n {
                    let to = SocketAddr::new(tb.peers[j].ip, MEDIA_PORT);
                    plan = match srtp {
                        Some(suite) => plan.srtp_sender(sock.try_clone()?, to, flow_mesh_main(0, j), profile.clone(), participant_srtp(suite, j, true, true)?),
                        None => plan.sender(sock.try_clone()?, to, flow_mesh_main(0, j), profile.clone()),
                    };
                }
            } else if i == 0 {
                let to = SocketAddr::new(p.sfu_ip, SFU_PORT);
                plan = match srtp {
                    Some(suite) => plan.srtp_sender(sock.try_clone()?, to, flow_main(0), profile.clone(), participant_srtp(suite, 0, false, true)?),
                    None => plan.sender(sock.try_clone()?, to, flow_main(0), profile.clone()),
                };
            } else {
                expected[i].push(if floor { flow_mesh_main(0, i) } else { flow_main(0) });
            }
        } else if floor {
            for (j, q) in tb.peers.iter().enumerate().filter(|(j, _)| *j != i) {
                let to = SocketAddr::new(q.ip, MEDIA_PORT);
                // A layered floor sends each subscriber just the layer it receives.
                let main = if layered { Profile::simulcast_layer(layer_for(j, i) as u8) } else { profile.clone() };
                plan = match srtp {
                    // Under the key the SFU would have protected the copy with.
                    Some(suite) => plan.srtp_sender(sock.try_clone()?, to, flow_mesh_main(i, j), main, participant_srtp(suite, j, true, true)?),
                    None => plan.sender(sock.try_clone()?, to, flow_mesh_main(i, j), main),
                };
                if two && high_half(j) {
                    plan = plan.sender(sock.try_clone()?, to, flow_mesh_high(i, j), profile.clone());
                }
            }
        } else if layered {
            // As a browser: an SR a second per layer (see the receivers' RTCP below); on SRTP
            // each layer protected under the participant's key (a session per SSRC).
            for l in 0..LAYERS {
                let (to, flow, layer) = (SocketAddr::new(p.sfu_ip, SFU_PORT), flow_layer(i, l), Profile::simulcast_layer(l as u8));
                plan = match srtp {
                    Some(suite) => plan.srtp_sender(sock.try_clone()?, to, flow, layer, participant_srtp(suite, i, false, true)?),
                    None => plan.sender_with_reports(sock.try_clone()?, to, flow, layer),
                };
            }
        } else {
            plan = plan.sender(sock.try_clone()?, SocketAddr::new(p.sfu_ip, SFU_PORT), flow_main(i), profile.clone());
            if two {
                plan = plan.sender(sock.try_clone()?, SocketAddr::new(p.sfu_ip, SFU_HIGH_PORT), flow_high(i), profile.clone());
            }
        }
        let next = &tb.peers[(i + 1) % n];
        plan = plan.sender(sock.try_clone()?, SocketAddr::new(next.ip, DIRECT_PORT), flow_direct(i), profile);
        for j in (0..n).filter(|j| *j != i && !fanout) {
            expected[i].push(match (floor, layered) {
                (true, _) => flow_mesh_main(j, i),
                (false, true) => flow_layer(j, layer_for(i, j)),
                (false, false) => flow_main(j),
            });
            if two && high_half(i) {
                expected[i].push(if floor { flow_mesh_high(j, i) } else { flow_high(j) });
            }
        }
        // The simulcast scenarios' subscribers send a browser's RTCP to the SFU (an RR a second
        // per received stream, PLI, NACK: traffic::rtcp), which counts in the kernel share: on
        // the eBPF planes RTCP goes to the slow path. Not on the floor: there is no SFU.
        let feedback = (layered && !floor).then(|| traffic::Feedback { ssrc: receiver_ssrc(i), to: SocketAddr::new(p.sfu_ip, SFU_PORT) });
        plan = match (srtp, feedback) {
            (Some(suite), _) => plan.srtp_receiver(format!("p{i}"), sock, expected[i].clone(), participant_srtp(suite, i, true, false)?),
            (None, Some(f)) => plan.receiver_with_feedback(format!("p{i}"), sock, expected[i].clone(), f),
            (None, None) => plan.receiver(format!("p{i}"), sock, expected[i].clone()),
        };
    }
    for (i, p) in tb.peers.iter().enumerate() {
        let prev = (i + n - 1) % n;
        let direct = tb.udp_socket(&p.ns, SocketAddr::new(p.ip, DIRECT_PORT))?;
        plan = plan.receiver(format!("p{i}-direct"), direct, [flow_direct(prev)]);
    }

    let Some(serve) = serve.as_mut() else {
        let report = traffic::run(&plan)?;
        return Ok(summarise(spec, n, &expected, &report, None, Value::Null, hooks));
    };
    let stats0 = api(tb, "GET", "/v1/stats", None)?;
    let cpu0 = process_cpu_ns(serve.pid());
    let report = traffic::run(&plan)?;
    let serve_cpu_ns = process_cpu_ns(serve.pid()).saturating_sub(cpu0);
    let daemon_stats = api(tb, "GET", "/v1/stats", None)?;
    // Both programs every packet runs through: the XDP pre-filter (its pass path) and TC.
    let bpf_run_ns = ["bpf_run_time_ns", "xdp_run_time_ns"].iter().map(|k| extra_delta(&stats0, &daemon_stats, k)).sum();
    let kernel = ebpf.then(|| kernel_split(&stats0, &daemon_stats));
    serve.stop()?;
    // The daemon's log is kept only when something went wrong (the error names it).
    let _ = std::fs::remove_file(&log);
    remove_store(&store);
    let mut result = summarise(spec, n, &expected, &report, Some((serve_cpu_ns, bpf_run_ns)), daemon_stats, hooks);
    if let Some((handled, slow)) = kernel {
        result.kernel_handled = Some(handled);
        result.slow_path_packets = Some(slow);
        result.kernel_share = (handled + slow > 0).then(|| handled as f64 / (handled + slow) as f64);
    }
    Ok(result)
}

fn summarise(
    spec: &ConferenceSpec,
    n: usize,
    expected: &[Vec<u32>],
    report: &TrafficReport,
    serve_cpu: Option<(u64, u64)>,
    daemon_stats: Value,
    hooks_attached: Option<Vec<String>>,
) -> ConferenceResult {
    let (serve_cpu_ns, bpf_run_ns) = serve_cpu.unwrap_or_default();
    let mut participants = Vec::new();
    let mut all = empty_histogram();
    let mut direct = empty_histogram();
    let (mut exp_total, mut recv_total, mut lost, mut dups) = (0, 0, 0, 0);
    let mut bytes = 0u64;
    let (mut jitter_sum, mut dv_p99, mut mos_sum, mut mos_min, mut copies) = (0.0, 0.0f64, 0.0, f64::MAX, 0u64);
    for (i, flows) in expected.iter().enumerate() {
        let mut rec = empty_histogram();
        let (mut e, mut r, mut l, mut d) = (0, 0, 0, 0);
        for f in flows {
            if let Some(c) = report.copy(*f, i) {
                e += c.sent;
                r += c.received;
                l += c.lost;
                d += c.duplicates;
                rec.add(&c.delay_histogram).ok();
                jitter_sum += c.jitter_ns;
                bytes += c.bytes;
                dv_p99 = dv_p99.max(c.delay_variation_ns.p99);
                mos_sum += c.mos_g711;
                mos_min = mos_min.min(c.mos_g711);
                copies += 1;
                all.add(&c.delay_histogram).ok();
            }
        }
        let unexpected = report.receivers[i].unexpected;
        participants.push(ParticipantResult {
            participant: format!("p{i}"),
            streams: flows.len(),
            expected: e,
            received: r,
            lost: l,
            duplicates: d,
            unexpected,
            delay_ns: Summary::of_histogram(&rec),
        });
        exp_total += e;
        recv_total += r;
        lost += l;
        dups += d;
    }
    for i in 0..n {
        if let Some(c) = report.copy(flow_direct((i + n - 1) % n), n + i) {
            direct.add(&c.delay_histogram).ok();
        }
    }
    let delay = Summary::of_histogram(&all);
    let direct_delay = Summary::of_histogram(&direct);
    let unexpected = participants.iter().map(|p| p.unexpected).sum();
    ConferenceResult {
        dataplane: spec.dataplane.clone(),
        scenario: spec.scenario,
        participants,
        copies_expected: exp_total,
        copies_received: recv_total,
        bytes_received: bytes,
        lost,
        duplicates: dups,
        unexpected,
        floor_delay_ns: None,
        added_delay_ns: None,
        added_delay_vs_direct_ns: added_delay(&delay, &direct_delay, AddedDelayMethod::QuantileDifference),
        hooks_attached,
        jitter_ns_mean: if copies > 0 { jitter_sum / copies as f64 } else { 0.0 },
        delay_variation_p99_ns: dv_p99,
        mos_mean: if copies > 0 { mos_sum / copies as f64 } else { 0.0 },
        mos_min: if copies > 0 { mos_min } else { 0.0 },
        delay_cdf: cdf_points(&all),
        delay_ns: delay,
        direct_delay_ns: direct_delay,
        serve_cpu_ns,
        bpf_run_ns,
        cpu_per_copy_ns: serve_cpu.filter(|_| recv_total > 0).map(|(s, b)| (s + b) as f64 / recv_total as f64),
        daemon_stats,
        kernel_handled: None,
        slow_path_packets: None,
        kernel_share: None,
        generator_cpu_ns: report.generator_cpu_ns,
        rtcp_sent: report.totals.rtcp_sent,
    }
}

pub(crate) fn empty_histogram() -> hdrhistogram::Histogram<u64> {
    mediaplane_bench::qos::ValueRecorder::new().histogram
}

/// Points of a histogram's CDF, dense in the tail where SFUs differ.
fn cdf_points(h: &hdrhistogram::Histogram<u64>) -> Vec<(f64, f64)> {
    if h.is_empty() {
        return Vec::new();
    }
    let mut qs: Vec<f64> = (0..=90).step_by(5).map(|q| q as f64 / 100.0).collect();
    qs.extend([0.95, 0.97, 0.99, 0.995, 0.999, 1.0]);
    qs.into_iter().map(|q| (h.value_at_quantile(q) as f64, q)).collect()
}

/// Remove an SQLite store and its WAL and shared-memory files.
pub fn remove_store(store: &Path) {
    for ext in ["db", "db-wal", "db-shm"] {
        let _ = std::fs::remove_file(store.with_extension(ext));
    }
}
