//! Kamailio and SIPp for the interop tests: finding them, skipping (or failing under CI=true)
//! when they are missing, one Kamailio configuration (the rtpengine module anchoring every
//! INVITE's media on an NG relay), starting a process in a process group of its own, waiting
//! until it has bound its SIP port, and log tails for assertion messages.

use crate::netns::Testbed;
use crate::process::Supervised;
use std::io::{Read, Seek, SeekFrom};
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
    if crate::in_ci() {
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
    /// so the scenario chooses a call's flags and one Kamailio serves them all. An
    /// `X-RTP-Answer-Flags` header replaces them for the answer (e.g. `direction` names the SDP
    /// sender's interface first, so an answer names them the other way round).
    pub flags: &'a str,
    pub modules: &'a Path,
    /// Also SIP over WebSocket (RFC 7118) on this TCP address, as a WebRTC deployment runs it:
    /// REGISTER is saved in memory, INVITEs are record-routed, and an INVITE that came over
    /// WebSocket is offered with `RTP/AVP ICE=remove rtcp-mux-demux` (plain RTP, RTCP on its own
    /// port, toward the SIP side; an `X-Callee-Protocol` header names another, e.g. `RTP/SAVP`
    /// for an SDES-SRTP callee) and its
    /// answer gets `UDP/TLS/RTP/SAVPF ICE=force` (DTLS-SRTP and ICE back toward the browser),
    /// after the flags above. In-dialog requests then follow the route set (`loose_route`).
    pub websocket: Option<SocketAddr>,
}

impl KamailioConfig<'_> {
    /// Every INVITE with SDP (initial or re-INVITE) → rtpengine_offer; its 2xx with SDP →
    /// rtpengine_answer with the same flags or the answer's (kept in AVPs of the transaction); BYE →
    /// rtpengine_delete. Without `websocket`, no record-routing: only the UAC sends requests,
    /// always to Kamailio. With it, in-dialog requests follow the route set, re-INVITEs through
    /// the relay too.
    pub fn render(&self) -> String {
        let next_hop = self.next_hop.map(|a| format!("$du = \"sip:{a}\";")).unwrap_or_default();
        let (transport, ws_modules, ws_request, ws_flags, ws_http) = match self.websocket {
            None => ("disable_tcp=yes".to_string(), "", "", "", ""),
            Some(ws) => (format!("tcp_accept_no_cl=yes\ntcp_children=1\nlisten=tcp:{ws}"), WS_MODULES, WS_REQUEST, WS_FLAGS, WS_HTTP),
        };
        format!(
            r#"#!KAMAILIO
debug=2
log_stderror=yes
children=1
auto_aliases=no
{transport}
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
{ws_modules}
request_route {{
    if (!mf_process_maxfwd_header("10")) {{
        sl_send_reply("483", "Too Many Hops");
        exit;
    }}{ws_request}
    route(OFFER);
    if (is_method("BYE")) {{
        rtpengine_delete();
    }}
    {next_hop}
    if (!t_relay()) {{
        sl_reply_error();
    }}
    exit;
}}

route[OFFER] {{
    if (is_method("INVITE") && has_body("application/sdp")) {{
        $avp(rtp_flags) = "{flags}";
        $avp(rtp_answer_flags) = $avp(rtp_flags);
        if (is_present_hf("X-RTP-Flags")) {{
            $avp(rtp_flags) = $avp(rtp_flags) + " " + $hdr(X-RTP-Flags);
            $avp(rtp_answer_flags) = $avp(rtp_flags);
        }}
        if (is_present_hf("X-RTP-Answer-Flags")) {{
            $avp(rtp_answer_flags) = "{flags}" + " " + $hdr(X-RTP-Answer-Flags);
        }}{ws_flags}
        if (!rtpengine_offer("$avp(rtp_flags)")) {{
            sl_send_reply("500", "Media relay failed");
            exit;
        }}
        t_on_reply("MEDIA");
    }}
}}

onreply_route[MEDIA] {{
    if (status =~ "^2[0-9][0-9]$" && has_body("application/sdp")) {{
        if (!rtpengine_answer("$avp(rtp_answer_flags)")) {{
            xlog("L_ERR", "rtpengine_answer failed\n");
        }}
    }}
}}
{ws_http}"#,
            listen = self.listen,
            ng = self.ng,
            flags = self.flags,
            modules = self.modules.display()
        )
    }
}

// The WebSocket part of the configuration (KamailioConfig::websocket), after Kamailio's own
// websocket module documentation and the usual WebRTC gateway setups.
const WS_MODULES: &str = r#"loadmodule "xhttp.so"
loadmodule "websocket.so"
loadmodule "nathelper.so"
loadmodule "rr.so"
loadmodule "usrloc.so"
loadmodule "registrar.so"
modparam("usrloc", "db_mode", 0)
"#;

// A WebSocket client's Contact (`…@….invalid;transport=ws`) is unreachable: the alias makes the
// route set lead back over its connection. An in-dialog INVITE with SDP goes through the relay
// (route OFFER); the WebSocket flags fit one from the WebSocket client.
const WS_REQUEST: &str = r#"
    if (nat_uac_test("64")) {
        force_rport();
        if (!is_method("REGISTER")) {
            add_contact_alias();
        }
    }
    if (has_totag()) {
        if (loose_route()) {
            handle_ruri_alias();
            route(OFFER);
            if (is_method("BYE")) {
                rtpengine_delete();
            }
            t_relay();
            exit;
        }
        if (is_method("ACK") && t_check_trans()) {
            t_relay();
        }
        exit;
    }
    if (is_method("REGISTER")) {
        if (!save("location")) {
            sl_reply_error();
        }
        exit;
    }
    if (is_method("INVITE")) {
        record_route();
    }"#;

const WS_FLAGS: &str = r#"
        if (nat_uac_test("64")) {
            if (is_present_hf("X-Callee-Protocol")) {
                $avp(rtp_flags) = $avp(rtp_flags) + " " + $hdr(X-Callee-Protocol);
            } else {
                $avp(rtp_flags) = $avp(rtp_flags) + " RTP/AVP";
            }
            $avp(rtp_flags) = $avp(rtp_flags) + " ICE=remove rtcp-mux-demux";
            $avp(rtp_answer_flags) = $avp(rtp_answer_flags) + " UDP/TLS/RTP/SAVPF ICE=force";
        }"#;

const WS_HTTP: &str = r#"
event_route[xhttp:request] {
    if ($hdr(Upgrade) =~ "websocket" && $hdr(Connection) =~ "Upgrade" && $rm =~ "GET") {
        if (ws_handle_handshake()) {
            exit;
        }
    }
    xhttp_reply("404", "Not Found", "", "");
}
"#;

/// A Kamailio script of one worker on UDP `listen`, stateless (sl, textops, pv, xlog) with the
/// rtpengine module talking NG to `ng`: `modparams` (more of the module's, e.g. MOS AVPs) and
/// `request_route` (its body) are the test's.
pub fn script(listen: SocketAddr, ng: SocketAddr, modules: &Path, modparams: &str, request_route: &str) -> String {
    format!(
        r#"#!KAMAILIO
debug=2
log_stderror=yes
children=1
disable_tcp=yes
auto_aliases=no
listen=udp:{listen}
mpath="{modules}/"
loadmodule "sl.so"
loadmodule "textops.so"
loadmodule "siputils.so"
loadmodule "pv.so"
loadmodule "xlog.so"
loadmodule "rtpengine.so"
modparam("rtpengine", "rtpengine_sock", "udp:{ng}")
{modparams}
request_route {{
{request_route}
    exit;
}}
"#,
        modules = modules.display()
    )
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
    pub fn start(launcher: Command, cfg: &KamailioConfig, dir: &Path) -> Result<Kamailio, String> {
        Kamailio::start_script(launcher, &cfg.render(), cfg.listen.port(), dir)
    }

    /// [`Kamailio::start`] with a script of the test's own (e.g. [`script`]'s) listening on
    /// UDP `port`.
    pub fn start_script(mut launcher: Command, script: &str, port: u16, dir: &Path) -> Result<Kamailio, String> {
        let path = dir.join("kamailio.cfg");
        std::fs::write(&path, script).map_err(|e| format!("writing {}: {e}", path.display()))?;
        let log = dir.join("kamailio.log");
        let logf = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        launcher.args(["-DD", "-E", "-m", "32", "-M", "8", "-f"]).arg(&path).arg("-Y").arg(dir).arg("-P").arg(dir.join("kamailio.pid")).arg("-w").arg(dir);
        let mut proc = spawn_group("kamailio", launcher.stdout(Stdio::null()).stderr(logf))?;
        wait_udp_bound(&mut proc, port, Duration::from_secs(10)).map_err(|e| format!("{e}\n{}", log_tail(&log, 20)))?;
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

/// The end of a SIPp callee scenario: wait (up to 30 s) for the caller's BYE and answer it 200 OK.
pub const UAS_BYE_OK: &str = r#"  <recv request="BYE" timeout="30000"/>
  <send>
    <![CDATA[

      SIP/2.0 200 OK
      [last_Via:]
      [last_From:]
      [last_To:]
      [last_Call-ID:]
      [last_CSeq:]
      Content-Length: 0

    ]]>
  </send>
"#;

/// New lines of a log file another process appends to (SIPp's `<log>` messages, read as a call
/// goes on).
pub struct LogTail {
    path: PathBuf,
    offset: u64,
    partial: String,
}

impl LogTail {
    pub fn new(path: PathBuf) -> LogTail {
        LogTail { path, offset: 0, partial: String::new() }
    }

    /// The complete lines appended since the last call.
    pub fn lines(&mut self) -> Vec<String> {
        let Ok(mut f) = std::fs::File::open(&self.path) else { return Vec::new() };
        let mut buf = String::new();
        if f.seek(SeekFrom::Start(self.offset)).is_err() || f.read_to_string(&mut buf).is_err() {
            return Vec::new();
        }
        self.offset += buf.len() as u64;
        self.partial.push_str(&buf);
        let Some(last_newline) = self.partial.rfind('\n') else { return Vec::new() };
        let complete: String = self.partial.drain(..=last_newline).collect();
        complete.lines().map(str::to_string).collect()
    }
}

/// A line a SIPp scenario logged: "answered 2 10.77.0.1 10004" → ("answered 2", the address);
/// "inviting 2" → ("inviting 2", None).
pub fn parse_sipp_event(line: &str) -> Option<(String, Option<SocketAddr>)> {
    let mut w = line.split_whitespace();
    let (kind, n) = (w.next()?, w.next()?);
    let addr = match (w.next(), w.next()) {
        (Some(ip), Some(port)) => Some(SocketAddr::new(ip.parse().ok()?, port.parse().ok()?)),
        _ => None,
    };
    Some((format!("{kind} {n}"), addr))
}

/// SIPp in the testbed's relay namespace running `<id>-<role>.xml` from `dir` for one call on SIP
/// port `port` (its control port next to it), logging to `<id>-<role>*.log` there.
pub fn sipp_command(tb: &Testbed, dir: &Path, id: &str, role: &str, port: u16) -> Command {
    let mut cmd = tb.command(&tb.sfu_ns, which("sipp").expect("sipp").to_str().unwrap());
    cmd.current_dir(dir)
        .args(["-sf", &format!("{id}-{role}.xml"), "-i", "127.0.0.1", "-p", &port.to_string(), "-cp", &(port + 5).to_string()])
        .args(["-m", "1", "-nostdin", "-trace_err", "-trace_logs", "-timeout", "40s", "-timeout_error"])
        .args(["-log_file", &format!("{id}-{role}.log"), "-error_file", &format!("{id}-{role}-errors.log")])
        .args(["-trace_msg", "-message_file", &format!("{id}-{role}-messages.log")])
        .stdout(Stdio::null());
    if let Ok(f) = std::fs::File::create(dir.join(format!("{id}-{role}.stderr"))) {
        cmd.stderr(f);
    }
    cmd
}

/// How a SIPp process of [`sipp_command`] ended: Ok if it completed its call, else why (with
/// the first of its error log).
pub fn sipp_result(p: &mut Supervised, dir: &Path, id: &str, role: &str) -> Result<(), String> {
    // SIPp can take seconds to exit after its last message when the machine is busy.
    let why = match p.wait_timeout(Duration::from_secs(15)) {
        Ok(Some(st)) if st.success() => return Ok(()),
        Ok(Some(st)) => format!("exited {st}"),
        Ok(None) => {
            p.kill();
            "still running (killed)".to_string()
        }
        Err(e) => e.to_string(),
    };
    // SIPp's error log quotes whole SDP bodies: one line, cut short, is enough to tell why.
    let errors = std::fs::read_to_string(dir.join(format!("{id}-{role}-errors.log"))).unwrap_or_default();
    let errors: String = errors.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("The following events")).collect::<Vec<_>>().join(" | ");
    let errors: String = errors.chars().take(300).collect();
    Err(format!("SIPp {role} of {id} {why}: {errors} (see {id}-{role}-errors.log, MP_KEEP_TMP=1 keeps it)"))
}
