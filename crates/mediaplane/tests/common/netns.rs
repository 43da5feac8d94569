//! `mediaplane serve` running inside a testbed's SFU namespace, and API calls made from there.

use mediaplane_bench::netns::Testbed;
use mediaplane_bench::process::Supervised;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub const API: &str = "127.0.0.1:7580";

pub struct NetnsServe<'t> {
    pub tb: &'t Testbed,
    pub proc: Supervised,
    /// Its API address (inside the SFU namespace).
    pub listen: String,
}

impl<'t> NetnsServe<'t> {
    /// `ip netns exec` (private mount namespace: a bpffs of its own, gone with the process).
    pub fn start(tb: &'t Testbed, plane: &str, store: &std::path::Path, extra: &[&str]) -> NetnsServe<'t> {
        let mut cmd = tb.command(&tb.sfu_ns, env!("CARGO_BIN_EXE_mediaplane"));
        Self::args(&mut cmd, tb, plane, store, API, extra);
        Self::spawn(tb, cmd, API)
    }

    /// [`NetnsServe::start`] with more of the daemon's environment (its own, not this process's:
    /// tests of one binary run side by side).
    pub fn start_with_env(tb: &'t Testbed, plane: &str, store: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> NetnsServe<'t> {
        let mut cmd = tb.command(&tb.sfu_ns, env!("CARGO_BIN_EXE_mediaplane"));
        Self::args(&mut cmd, tb, plane, store, API, extra);
        cmd.envs(env.iter().copied());
        Self::spawn(tb, cmd, API)
    }

    /// [`NetnsServe::start`] with its API on `listen`.
    pub fn start_on(tb: &'t Testbed, listen: &str, plane: &str, store: &std::path::Path, extra: &[&str]) -> NetnsServe<'t> {
        let mut cmd = tb.command(&tb.sfu_ns, env!("CARGO_BIN_EXE_mediaplane"));
        Self::args(&mut cmd, tb, plane, store, listen, extra);
        Self::spawn(tb, cmd, listen)
    }

    /// `nsenter --net` only: the root mount namespace's /sys/fs/bpf, so pins outlive the process
    /// (what hitless restart needs).
    pub fn start_shared_bpffs(tb: &'t Testbed, plane: &str, store: &std::path::Path, extra: &[&str]) -> NetnsServe<'t> {
        Self::start_shared_bpffs_on(tb, API, plane, store, extra)
    }

    /// [`NetnsServe::start_shared_bpffs`] with its API on `listen` (a second daemon beside one on [`API`]).
    pub fn start_shared_bpffs_on(tb: &'t Testbed, listen: &str, plane: &str, store: &std::path::Path, extra: &[&str]) -> NetnsServe<'t> {
        Self::spawn(tb, Self::shared_bpffs_command(tb, listen, plane, store, extra), listen)
    }

    /// Run a daemon like [`NetnsServe::start_shared_bpffs_on`] that is expected to refuse to
    /// start: its exit status and stderr (killed, and a panic, if it is still up after `timeout`).
    pub fn run_to_exit(
        tb: &Testbed,
        listen: &str,
        plane: &str,
        store: &std::path::Path,
        extra: &[&str],
        timeout: Duration,
    ) -> (std::process::ExitStatus, String) {
        let mut cmd = Self::shared_bpffs_command(tb, listen, plane, store, extra);
        let mut p = Supervised::spawn("mediaplane serve", cmd.stderr(Stdio::piped())).unwrap();
        let Some(status) = p.wait_timeout(timeout).unwrap() else {
            p.kill();
            panic!("serve was expected to exit but still ran after {timeout:?}");
        };
        let mut err = String::new();
        std::io::Read::read_to_string(p.child_mut().stderr.as_mut().unwrap(), &mut err).unwrap();
        (status, err)
    }

    fn shared_bpffs_command(tb: &Testbed, listen: &str, plane: &str, store: &std::path::Path, extra: &[&str]) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/var/run/netns/{}", tb.sfu_ns)).arg("--").arg(env!("CARGO_BIN_EXE_mediaplane"));
        Self::args(&mut cmd, tb, plane, store, listen, extra);
        cmd
    }

    /// `plane`: userspace, ebpf (its defaults: no XDP pre-filter on veth), or ebpf-xdp (the
    /// pre-filter on).
    fn args(cmd: &mut Command, tb: &Testbed, plane: &str, store: &std::path::Path, listen: &str, extra: &[&str]) {
        let (plane, xdp) = match plane {
            "ebpf-xdp" => ("ebpf", Some("on")),
            p => (p, None),
        };
        cmd.args(["serve", "--listen", listen, "--store", store.to_str().unwrap(), "--dataplane", plane, "--workers", "1"])
            .args(xdp.map(|x| ["--xdp-prefilter", x]).into_iter().flatten())
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null());
        for p in &tb.peers {
            cmd.args(["--interface", &p.sfu_if]);
        }
    }

    fn spawn(tb: &'t Testbed, mut cmd: Command, listen: &str) -> NetnsServe<'t> {
        // Dropped alive: SIGTERM first, so an eBPF plane detaches cleanly.
        let proc = Supervised::spawn("mediaplane serve", &mut cmd).unwrap().terminate_on_drop(Duration::from_secs(10));
        let mut s = NetnsServe { tb, proc, listen: listen.to_string() };
        let deadline = Instant::now() + Duration::from_secs(20);
        // Up when it answers: with an API token, 401 to this tokenless probe.
        while try_api_at(tb, listen, "GET", "/health", None).is_err_and(|e| !e.starts_with("HTTP 401")) {
            assert!(Instant::now() < deadline, "serve did not start");
            assert!(s.proc.alive(), "serve exited instead of starting");
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    pub fn api(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        try_api_at(self.tb, &self.listen, method, path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// Room "r": every peer `p{i}` joins at its SFU address `:40000` and receives on its own
    /// `:5004`; p0 publishes "main" and p1 subscribes to it.
    pub fn two_party_room(&self) {
        self.api("POST", "/v1/rooms", Some(json!({"id": "r"})));
        for (i, p) in self.tb.peers.iter().enumerate() {
            let body = json!({"id": format!("p{i}"), "local": SocketAddr::new(p.sfu_ip, 40000), "remote": SocketAddr::new(p.ip, 5004)});
            self.api("POST", "/v1/rooms/r/participants", Some(body));
        }
        self.api("POST", "/v1/rooms/r/participants/p0/streams", Some(json!({"name": "main"})));
        self.api("POST", "/v1/rooms/r/participants/p1/subscriptions", Some(json!({"publisher": "p0", "stream": "main"})));
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    pub fn kill9(&mut self) {
        self.proc.kill();
    }

    /// SIGTERM and wait; true when it exited 0.
    pub fn terminate(&mut self) -> bool {
        self.proc.terminate(Duration::from_secs(10)).is_ok_and(|st| st.success())
    }
}

pub fn try_api(tb: &Testbed, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
    try_api_at(tb, API, method, path, body)
}

pub fn try_api_at(tb: &Testbed, listen: &str, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
    try_api_as(tb, listen, None, method, path, body)
}

/// [`try_api_at`] with the API's bearer `token`, if it has one.
pub fn try_api_as(tb: &Testbed, listen: &str, token: Option<&str>, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
    let (m, url, auth) = (method.to_string(), format!("http://{listen}{path}"), token.map(|t| format!("Bearer {t}")));
    tb.in_ns(&tb.sfu_ns, move || {
        let mut req = ureq::request(&m, &url).timeout(Duration::from_secs(5));
        if let Some(a) = &auth {
            req = req.set("Authorization", a);
        }
        let r = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match r {
            Ok(resp) => resp.into_json::<Value>().map_err(|e| e.to_string()),
            Err(ureq::Error::Status(c, resp)) => Err(format!("HTTP {c}: {}", resp.into_string().unwrap_or_default())),
            Err(e) => Err(e.to_string()),
        }
    })
    .map_err(|e| e.to_string())?
}
