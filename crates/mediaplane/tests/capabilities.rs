//! The capability set the systemd unit grants (`deploy/systemd/mediaplane.service`), proved
//! here: `mediaplane serve --dataplane ebpf` run as an unprivileged user (a uid of no account,
//! no groups) with exactly those capabilities — ambient, inheritable and bounding set, as
//! `AmbientCapabilities=` and `CapabilityBoundingSet=` give it — starts, tells systemd it is
//! ready, and forwards a stream through the kernel path; and without any one of them it does
//! not. Inside a test-made star of network namespaces (`nsenter --net`, so the host's bpffs,
//! as under systemd), with the pin directory made for that user beforehand, as the unit's
//! `ExecStartPre=+install -d ...` does.

mod common;

use mediaplane_bench::netns::Testbed;
use mediaplane_bench::process::Supervised;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const API: &str = "127.0.0.1:7580";
const PACKETS: u64 = 200;

/// Removes the pin directory (which detaches pinned links), on success and failure.
struct PinGuard(PathBuf);
impl Drop for PinGuard {
    fn drop(&mut self) {
        let _ = mediaplane_ebpf::remove_pins(&self.0);
    }
}

#[derive(Debug)]
enum Outcome {
    /// Did not become ready: its log.
    Refused(String),
    /// Ready; its uid and effective capability mask, packets received by the subscriber and
    /// counted as forwarded by the kernel program.
    Forwarded { uid: u32, cap_eff: u64, received: u64, kernel_forwarded: u64 },
}

fn status_field(pid: u32, field: &str) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix(field)).unwrap_or("").trim().to_string()
}

fn api(tb: &Testbed, method: &str, path: &str, body: Option<Value>) -> Value {
    common::netns::try_api_at(tb, API, method, path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// Start serve as `uid` with `caps`, wait for READY=1, and push a stream through it.
/// `plane`: "ebpf" (its counter of kernel-forwarded packets is `forwarded`) or "afxdp" (copies
/// sent from its rings, `afxdp_tx_frames`). `env`: more of the daemon's environment.
#[allow(clippy::too_many_arguments)]
fn attempt(tb: &Testbed, dir: &Path, bin: &Path, uid: u32, caps: &[String], tag: &str, plane: &str, env: &[(&str, &str)]) -> Outcome {
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/{}-caps-{tag}", tb.prefix));
    let _pins = PinGuard(pin_dir.clone());
    // As systemd does at boot: the unprivileged daemon cannot mount it (no CAP_SYS_ADMIN), and on
    // a fresh machine without systemd nothing has.
    mediaplane_ebpf::mount_bpffs_if_missing().unwrap();
    std::fs::create_dir(&pin_dir).unwrap_or_else(|e| panic!("create {}: {e}", pin_dir.display()));
    std::os::unix::fs::chown(&pin_dir, Some(uid), Some(uid)).unwrap();
    let run = dir.join(tag);
    std::fs::create_dir(&run).unwrap();
    std::os::unix::fs::chown(&run, Some(uid), Some(uid)).unwrap();
    let notify_path = run.join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    std::os::unix::fs::chown(&notify_path, Some(uid), Some(uid)).unwrap();
    notify.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let log = run.join("serve.log");

    let set = caps.iter().map(|c| format!(",+{c}")).collect::<String>();
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/var/run/netns/{}", tb.sfu_ns))
        .args(["--", "setpriv", &format!("--reuid={uid}"), &format!("--regid={uid}"), "--clear-groups"])
        .args([format!("--inh-caps=-all{set}"), format!("--ambient-caps=-all{set}"), format!("--bounding-set=-all{set}")])
        .arg("--")
        .arg(bin)
        .args(["serve", "--listen", API, "--dataplane", plane, "--workers", "1", "--reset"])
        .args(if plane == "ebpf" { &["--xdp-prefilter", "on"][..] } else { &[] })
        .args(["--store", run.join("store.db").to_str().unwrap(), "--pin-dir", pin_dir.to_str().unwrap()])
        .args(tb.peers.iter().flat_map(|p| ["--interface".to_string(), p.sfu_if.clone()]))
        .envs(env.iter().copied())
        .env("NOTIFY_SOCKET", &notify_path)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut serve = Supervised::spawn("mediaplane serve", &mut cmd).unwrap().terminate_on_drop(Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [0u8; 512];
    let ready = loop {
        if let Ok(n) = notify.recv(&mut buf) {
            if String::from_utf8_lossy(&buf[..n]).lines().any(|l| l == "READY=1") {
                break true;
            }
        }
        if !serve.alive() || Instant::now() > deadline {
            break false;
        }
    };
    let tail = || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(6)..].join("\n")
    };
    if !ready {
        serve.kill();
        return Outcome::Refused(std::fs::read_to_string(&log).unwrap_or_default());
    }
    let (uid_now, cap_eff) = (status_field(serve.pid(), "Uid:"), status_field(serve.pid(), "CapEff:"));
    let uid_now: u32 = uid_now.split_whitespace().nth(1).unwrap().parse().unwrap();
    let cap_eff = u64::from_str_radix(&cap_eff, 16).unwrap();

    // p0 publishes to its SFU address, p1 subscribes.
    api(tb, "POST", "/v1/rooms", Some(json!({"id": "r"})));
    for (i, p) in tb.peers.iter().enumerate() {
        let body = json!({"id": format!("p{i}"), "local": SocketAddr::new(p.sfu_ip, 40000), "remote": SocketAddr::new(p.ip, 5004)});
        api(tb, "POST", "/v1/rooms/r/participants", Some(body));
    }
    api(tb, "POST", "/v1/rooms/r/participants/p0/streams", Some(json!({"name": "main"})));
    api(tb, "POST", "/v1/rooms/r/participants/p1/subscriptions", Some(json!({"publisher": "p0", "stream": "main"})));
    let (p0, p1) = (&tb.peers[0], &tb.peers[1]);
    let tx = tb.udp_socket(&p0.ns, SocketAddr::new(p0.ip, 5004)).unwrap();
    let rx = tb.udp_socket(&p1.ns, SocketAddr::new(p1.ip, 5004)).unwrap();
    rx.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    // Warm-up: neighbours resolved, so what follows takes the kernel path.
    let to = SocketAddr::new(p0.sfu_ip, 40000);
    for seq in 0..5u16 {
        tx.send_to(&mediaplane_core::rtp::build_rtp(0, seq, 0, 1, &[0; 160]), to).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    while rx.recv(&mut buf).is_ok() {}
    let key = if plane == "ebpf" { "forwarded" } else { "afxdp_tx_frames" };
    let forwarded = |s: &Value| s["extra"][key].as_u64().unwrap_or_else(|| panic!("no extra.{key}: {s}"));
    let before = forwarded(&api(tb, "GET", "/v1/stats", None));
    let mut received = 0;
    for seq in 0..PACKETS as u16 {
        tx.send_to(&mediaplane_core::rtp::build_rtp(0, 100 + seq, 0, 1, &[0; 160]), to).unwrap();
        if rx.recv(&mut buf).is_ok() {
            received += 1;
        }
    }
    let kernel_forwarded = forwarded(&api(tb, "GET", "/v1/stats", None)) - before;
    let st = serve.terminate(Duration::from_secs(10)).expect("stops on SIGTERM");
    assert!(st.success(), "clean exit: {st}; {}", tail());
    // What it could not do with these capabilities, if anything (e.g. BPF run-time statistics).
    for l in std::fs::read_to_string(&log).unwrap_or_default().lines().filter(|l| l.contains("WARN")) {
        eprintln!("{tag}: {l}");
    }
    Outcome::Forwarded { uid: uid_now, cap_eff, received, kernel_forwarded }
}

fn cap_bit(name: &str) -> u64 {
    1 << match name {
        "net_admin" => 12,
        "net_raw" => 13,
        "sys_admin" => 21,
        "perfmon" => 38,
        "bpf" => 39,
        other => panic!("{other}"),
    }
}

/// A uid with no account and no process: the daemon's files and pins are its alone.
fn unused_uid() -> u32 {
    (0..1000)
        .map(|i| 61000 + (std::process::id() + i) % 4000)
        // SAFETY: getpwuid with any uid; only the null check is read.
        .find(|&u| {
            unsafe { libc::getpwuid(u) }.is_null()
                && !std::fs::read_dir("/proc")
                    .unwrap()
                    .flatten()
                    .any(|e| status_field(e.file_name().to_str().unwrap_or("x").parse().unwrap_or(0), "Uid:").split_whitespace().next() == Some(&u.to_string()))
        })
        .expect("a free uid")
}

#[test]
fn serve_forwards_through_the_kernel_with_exactly_the_units_capabilities() {
    if !mediaplane_bench::require_root("capabilities") {
        return;
    }
    let tb = Testbed::star(2).unwrap();
    let tmp = common::TempDir::new("caps");
    std::fs::set_permissions(&tmp.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    // A copy the uid may execute wherever the build tree is.
    let bin = tmp.0.join("mediaplane");
    std::fs::copy(env!("CARGO_BIN_EXE_mediaplane"), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let uid = unused_uid();
    // What the unit grants (README "Capabilities" says why each).
    let caps = common::unit_capabilities();
    assert_eq!(caps, ["bpf", "net_admin", "perfmon", "net_raw"], "the set this test and the README describe");

    match attempt(&tb, &tmp.0, &bin, uid, &caps, "all", "ebpf", &[]) {
        Outcome::Forwarded { uid: u, cap_eff, received, kernel_forwarded } => {
            assert_eq!(u, uid, "not root");
            assert_eq!(cap_eff, caps.iter().map(|c| cap_bit(c)).sum::<u64>(), "exactly the unit's capabilities, effective");
            assert_eq!(received, PACKETS, "the subscriber received every packet");
            assert_eq!(kernel_forwarded, PACKETS, "every one forwarded by the kernel program");
        }
        refused => panic!("with {caps:?}: {refused:?}"),
    }
    for drop in &caps {
        let fewer: Vec<String> = caps.iter().filter(|c| *c != drop).cloned().collect();
        let outcome = attempt(&tb, &tmp.0, &bin, uid, &fewer, &format!("no-{drop}"), "ebpf", &[]);
        if let Outcome::Refused(log) = &outcome {
            let last = log.lines().last().unwrap_or("");
            eprintln!("without {drop}: {last}");
            // It warned of what it lacks, then the kernel refused (EPERM or EACCES).
            assert!(log.contains(&format!("missing=CAP_{}", drop.to_uppercase())), "{log}");
            assert!(last.contains("not permitted") || last.contains("denied"), "{log}");
        }
        assert!(
            !matches!(outcome, Outcome::Forwarded { received, kernel_forwarded, .. } if received == PACKETS && kernel_forwarded == PACKETS),
            "CAP_{} is not needed: drop it from the unit and README",
            drop.to_uppercase()
        );
    }
}

/// The AF_XDP plane under the unit's capabilities, as an unprivileged uid: its sockets bind
/// (CAP_NET_RAW), its program attaches, and a stream's copies leave by its rings. Its packet
/// memory counts against the locked-memory limit, which root here cannot raise (no
/// CAP_SYS_RESOURCE; systemd sets the unit's LimitMEMLOCK=infinity): at the default 8 MiB per
/// queue the second interface's is refused with an error naming the limit and the fix; with
/// `dataplane.afxdp_frames` at 1,024 (2 MiB) per queue it runs.
#[test]
fn the_afxdp_plane_runs_with_the_units_capabilities() {
    if !mediaplane_bench::require_root("capabilities") {
        return;
    }
    let tb = Testbed::star(2).unwrap();
    let tmp = common::TempDir::new("caps-afxdp");
    std::fs::set_permissions(&tmp.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = tmp.0.join("mediaplane");
    std::fs::copy(env!("CARGO_BIN_EXE_mediaplane"), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let uid = unused_uid();
    let caps = common::unit_capabilities();
    let unit = std::fs::read_to_string(common::unit_path()).unwrap();
    assert_eq!(common::unit_values(&unit, "LimitMEMLOCK"), ["infinity"], "the unit lifts the locked-memory limit for the AF_XDP plane");
    let mut memlock = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid out-parameter.
    unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut memlock) };
    if memlock.rlim_max != libc::RLIM_INFINITY && memlock.rlim_max < 16 << 20 {
        match attempt(&tb, &tmp.0, &bin, uid, &caps, "afxdp-default", "afxdp", &[]) {
            Outcome::Refused(log) => assert!(log.contains("RLIMIT_MEMLOCK") && log.contains("LimitMEMLOCK=infinity"), "{log}"),
            other => panic!("16 MiB of UMEM under a {} KiB limit: {other:?}", memlock.rlim_max >> 10),
        }
    }
    match attempt(&tb, &tmp.0, &bin, uid, &caps, "afxdp", "afxdp", &[("MEDIAPLANE_DATAPLANE_AFXDP_FRAMES", "1024")]) {
        Outcome::Forwarded { uid: u, received, kernel_forwarded, .. } => {
            assert_eq!(u, uid, "not root");
            assert_eq!(received, PACKETS, "the subscriber received every packet");
            assert_eq!(kernel_forwarded, PACKETS, "every copy left by an AF_XDP ring");
        }
        refused => panic!("with {caps:?}: {refused:?}"),
    }
}
