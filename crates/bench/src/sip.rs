//! Kamailio and SIPp for the interop tests: finding them, skipping (or failing under CI=true)
//! when they are missing, one Kamailio configuration (the rtpengine module anchoring every
//! INVITE's media on an NG relay), starting a process in a process group of its own, waiting
//! until it has bound its SIP port, and log tails for assertion messages.

use crate::process::Supervised;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `bin` on PATH, or in /usr/sbin or /sbin (kamailio lives there; a test's PATH may lack them).
pub fn which(bin: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':').map(|d| Path::new(d).join(bin)).chain(["/usr/sbin", "/sbin"].map(|d| Path::new(d).join(bin))).find(|p| p.is_file())
}

/// Kamailio's module directory, if it holds the rtpengine module.
pub fn kamailio_module_dir() -> Option<PathBuf> {
    ["/usr/lib/x86_64-linux-gnu/kamailio/modules", "/usr/lib/aarch64-linux-gnu/kamailio/modules", "/usr/lib/kamailio/modules", "/usr/lib64/kamailio/modules"]
        .iter()
        .map(PathBuf::from)
        .find(|d| d.join("rtpengine.so").is_file())
}

/// Why an interop test needing root and the programs `bins` cannot run here, if it cannot.
/// Naming "kamailio" also requires its rtpengine module.
pub fn missing(bins: &[&str]) -> Option<String> {
    if !crate::is_root() {
        return Some("not root".into());
    }
    for bin in bins {
        if which(bin).is_none() {
            return Some(format!("{bin} not installed (apt-get install -y kamailio sip-tester rtpengine-daemon)"));
        }
    }
    if bins.contains(&"kamailio") && kamailio_module_dir().is_none() {
        return Some("kamailio rtpengine module not found".into());
    }
    None
}

/// True when `test` can run (root, `bins` installed). Otherwise prints why and returns false,
/// except under CI=true, where a missing tool is a failure (CI installs them).
pub fn ready(test: &str, bins: &[&str]) -> bool {
    let Some(why) = missing(bins) else { return true };
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{test} cannot run under CI: {why}");
    }
    eprintln!("SKIPPED {test}: {why}");
    false
}

/// What the generated Kamailio configuration does.
pub struct KamailioConfig<'a> {
    /// Kamailio's SIP address (UDP).
    pub listen: SocketAddr,
    /// The relay's NG address.
    pub ng: SocketAddr,
    /// Where every request goes; None: to its Request-URI (one UAS per call, each on its port).
    pub next_hop: Option<SocketAddr>,
    /// rtpengine flags of every offer and answer; a request's `X-RTP-Flags` header is appended,
    /// so the scenario chooses a call's flags and one Kamailio serves them all.
    pub flags: &'a str,
    pub modules: &'a Path,
}

impl KamailioConfig<'_> {
    /// Every INVITE with SDP (initial or re-INVITE) → rtpengine_offer; its 2xx with SDP →
    /// rtpengine_answer with the same flags (kept in an AVP of the transaction); BYE →
    /// rtpengine_delete. No record-routing: only the UAC sends requests, always to Kamailio.
    pub fn render(&self) -> String {
        let next_hop = self.next_hop.map(|a| format!("$du = \"sip:{a}\";")).unwrap_or_default();
        format!(
            r#"#!KAMAILIO
debug=2
log_stderror=yes
children=1
disable_tcp=yes
auto_aliases=no
listen=udp:{listen}
mpath="{modules}/"
loadmodule "tm.so"
loadmodule "sl.so"
loadmodule "pv.so"
loadmodule "maxfwd.so"
loadmodule "textops.so"
loadmodule "siputils.so"
loadmodule "xlog.so"
loadmodule "rtpengine.so"
modparam("rtpengine", "rtpengine_sock", "udp:{ng}")

request_route {{
    if (!mf_process_maxfwd_header("10")) {{
        sl_send_reply("483", "Too Many Hops");
        exit;
    }}
    if (is_method("INVITE") && has_body("application/sdp")) {{
        $avp(rtp_flags) = "{flags}";
        if (is_present_hf("X-RTP-Flags")) {{
            $avp(rtp_flags) = $avp(rtp_flags) + " " + $hdr(X-RTP-Flags);
        }}
        if (!rtpengine_offer("$avp(rtp_flags)")) {{
            sl_send_reply("500", "Media relay failed");
            exit;
        }}
        t_on_reply("MEDIA");
    }}
    if (is_method("BYE")) {{
        rtpengine_delete();
    }}
    {next_hop}
    if (!t_relay()) {{
        sl_reply_error();
    }}
    exit;
}}

onreply_route[MEDIA] {{
    if (status =~ "^2[0-9][0-9]$" && has_body("application/sdp")) {{
        if (!rtpengine_answer("$avp(rtp_flags)")) {{
            xlog("L_ERR", "rtpengine_answer failed\n");
        }}
    }}
}}
"#,
            listen = self.listen,
            ng = self.ng,
            flags = self.flags,
            modules = self.modules.display()
        )
    }
}

/// A Kamailio started from a [`KamailioConfig`], logging to `kamailio.log` in its directory.
pub struct Kamailio {
    pub proc: Supervised,
    pub log: PathBuf,
}

impl Kamailio {
    /// Write the configuration into `dir` and run `launcher` (`kamailio` itself, or e.g.
    /// `ip netns exec NS kamailio`, which execs it) in the foreground with it, in a process group
    /// of its own; returns once it has bound its SIP port and its workers pinged the relay.
    pub fn start(mut launcher: Command, cfg: &KamailioConfig, dir: &Path) -> Result<Kamailio, String> {
        let path = dir.join("kamailio.cfg");
        std::fs::write(&path, cfg.render()).map_err(|e| format!("writing {}: {e}", path.display()))?;
        let log = dir.join("kamailio.log");
        let logf = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        launcher.args(["-DD", "-E", "-m", "32", "-M", "8", "-f"]).arg(&path).arg("-Y").arg(dir).arg("-P").arg(dir.join("kamailio.pid")).arg("-w").arg(dir);
        let mut proc = spawn_group("kamailio", launcher.stdout(Stdio::null()).stderr(logf))?;
        wait_udp_bound(&mut proc, cfg.listen.port(), Duration::from_secs(10)).map_err(|e| format!("{e}\n{}", log_tail(&log, 20)))?;
        // Its workers ping the relay in child_init, after the main process bound the port.
        std::thread::sleep(Duration::from_millis(500));
        Ok(Kamailio { proc, log })
    }

    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }
}

/// Spawn `cmd` (stdin from /dev/null) in a process group of its own (signals reach what it
/// forks, Kamailio's children), terminated by PID (then killed) on drop.
pub fn spawn_group(name: &str, cmd: &mut Command) -> Result<Supervised, String> {
    Ok(Supervised::spawn_group(name, cmd.stdin(Stdio::null())).map_err(|e| e.to_string())?.terminate_on_drop(Duration::from_secs(3)))
}

/// Whether the process `pid` has a UDP socket bound to `port` in its network namespace (its
/// /proc/PID/net/udp lists that namespace's sockets, so this also works for a process that was
/// started in another namespace).
pub fn udp_bound(pid: u32, port: u16) -> bool {
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/udp")).unwrap_or_default();
    let want = format!(":{port:04X}");
    table.lines().skip(1).filter_map(|l| l.split_whitespace().nth(1)).any(|local| local.ends_with(&want))
}

/// Wait until `proc` has bound UDP `port`; an error if it exits or the time runs out.
pub fn wait_udp_bound(proc: &mut Supervised, port: u16, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = proc.exited().map_err(|e| e.to_string())? {
            return Err(format!("{} exited early: {status}", proc.name()));
        }
        if udp_bound(proc.pid(), port) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("{} not bound to UDP port {port} after {timeout:?}", proc.name()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The last `lines` lines of a log file (empty if it cannot be read).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = s.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
