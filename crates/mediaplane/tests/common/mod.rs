//! Helpers shared by the binary's integration tests: a real `mediaplane serve` process.

#![allow(dead_code)]

pub mod browser;
pub mod netns;
pub mod simulcast;
pub mod sipp;
pub mod video;
pub mod wire;

use mediaplane_bench::process::Supervised;
use serde_json::Value;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub struct Daemon {
    pub token: Option<String>,
    pub proc: Supervised,
    pub api: String,
    pub listen: SocketAddr,
    pub store: PathBuf,
}

/// Data planes under test; `MEDIAPLANE_CONFORMANCE_PLANES` narrows it (e.g. "userspace").
pub fn planes() -> Vec<String> {
    std::env::var("MEDIAPLANE_CONFORMANCE_PLANES").unwrap_or_else(|_| "userspace,ebpf,ebpf-xdp,afxdp".into()).split(',').map(String::from).collect()
}

/// Does `plane` make every copy in user space (and so keep what it sent: it answers NACKs, and
/// its forwarded view sees every copy)? The socket plane and the AF_XDP plane do; the eBPF
/// planes' kernel makes plain copies itself.
pub fn copies_in_user_space(plane: &str) -> bool {
    matches!(plane, "userspace" | "afxdp")
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A per-test temporary directory, removed on drop (kept, and named, when MP_KEEP_TMP is set).
pub struct TempDir(pub PathBuf);
impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("mp-{tag}-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("MP_KEEP_TMP").is_some() {
            eprintln!("kept {}", self.0.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Daemon {
    pub fn start(store: &Path, extra: &[&str]) -> Daemon {
        Self::start_on(free_port(), store, extra)
    }

    pub fn start_with_token(store: &Path, extra: &[&str], token: &str) -> Daemon {
        Self::spawn(free_port(), store, extra, Some(token.to_string()))
    }

    pub fn start_on(port: u16, store: &Path, extra: &[&str]) -> Daemon {
        Self::spawn(port, store, extra, None)
    }

    fn spawn(port: u16, store: &Path, extra: &[&str], token: Option<String>) -> Daemon {
        let listen: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_mediaplane"));
        cmd.args(["serve", "--listen", &listen.to_string(), "--store", store.to_str().unwrap(), "--workers", "1"])
            .args(extra)
            .env("RUST_LOG", std::env::var("MP_TEST_LOG").unwrap_or_else(|_| "warn".into()))
            .stdout(Stdio::null());
        let proc = Supervised::spawn("mediaplane serve", &mut cmd).expect("spawn mediaplane serve");
        let d = Daemon { token, proc, api: format!("http://{listen}"), listen, store: store.to_path_buf() };
        d.wait_ready();
        d
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let r = ureq::get(&format!("{}/health", self.api)).timeout(Duration::from_millis(500));
            let r = match &self.token {
                Some(t) => r.set("authorization", &format!("Bearer {t}")),
                None => r,
            };
            if r.call().is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("mediaplane serve did not become ready on {}", self.api);
    }

    /// (status, JSON body) of one request; never panics on HTTP errors.
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut req = ureq::request(method, &format!("{}{path}", self.api)).timeout(Duration::from_secs(10));
        if let Some(t) = &self.token {
            req = req.set("authorization", &format!("Bearer {t}"));
        }
        let r = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match r {
            Ok(resp) => (resp.status(), resp.into_json().unwrap_or(Value::Null)),
            Err(ureq::Error::Status(code, resp)) => (code, resp.into_json().unwrap_or(Value::Null)),
            Err(e) => panic!("{method} {path}: transport error {e}"),
        }
    }

    pub fn alive(&mut self) -> bool {
        self.proc.alive()
    }

    pub fn kill9(&mut self) {
        self.proc.kill();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.proc.terminate(Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// The repository's systemd unit.
pub fn unit_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/systemd/mediaplane.service")
}

/// The values of `key=` in a unit's text (space-separated words of every such line).
pub fn unit_values(unit: &str, key: &str) -> Vec<String> {
    unit.lines().filter_map(|l| l.trim().strip_prefix(key)?.strip_prefix('=')).flat_map(|v| v.split_whitespace().map(String::from)).collect()
}

/// The capabilities the unit grants, lower case without `CAP_` (as setpriv names them).
pub fn unit_capabilities() -> Vec<String> {
    let unit = std::fs::read_to_string(unit_path()).unwrap();
    let ambient = unit_values(&unit, "AmbientCapabilities");
    assert_eq!(ambient, unit_values(&unit, "CapabilityBoundingSet"), "the unit bounds the process to the capabilities it grants");
    ambient.iter().map(|c| c.strip_prefix("CAP_").unwrap_or_else(|| panic!("{c}")).to_lowercase()).collect()
}

/// One of the SRTP failure counters (`srtp_auth_failed`, `srtp_replayed`, ...) from a `GET
/// /v1/stats` answer, whatever the data plane: the user-space plane counts them in `extra`
/// under their own names; the eBPF planes' slow path (which does the crypto) under
/// `extra["userspace.<name>"]` (crates/ebpf/src/dataplane.rs prefixes every slow-path extra).
/// Both are summed when both are present. Panics when the GET failed, or when neither key is
/// there or holds a count: a missing counter must not read as "no failure".
pub fn srtp_counter(stats: &Result<Value, String>, name: &str) -> u64 {
    let stats = stats.as_ref().unwrap_or_else(|e| panic!("GET /v1/stats failed, so {name} is unknown: {e}"));
    let extra = &stats["extra"];
    let found: Vec<u64> = [name.to_string(), format!("userspace.{name}")]
        .iter()
        .filter_map(|k| extra.get(k))
        .map(|v| v.as_u64().unwrap_or_else(|| panic!("stats extra {name}: not a count: {v}")))
        .collect();
    assert!(!found.is_empty(), "stats have no {name} (nor userspace.{name}) in extra: {extra}");
    found.iter().sum()
}
