//! Interop: Kamailio's rtpengine module drives mediaplane over NG while SIPp places calls that
//! carry real RTP both ways (G.711 A-law pcap playback on both sides).
//!
//! UAC (sipp -sn uac_pcap) → Kamailio (rtpengine_offer on INVITE, rtpengine_answer on 200,
//! rtpengine_delete on BYE) → UAS (a scenario that checks PCMA is offered, answers PCMA, and
//! plays the pcap back). The relay runs in-process (SessionManager + user-space data plane +
//! serve_ng). Needs root, kamailio and sipp; skipped otherwise, except under CI=true where
//! that is a failure. Everything on loopback, bounded in time, every process killed by PID.

mod common;

use common::Relay;
use mediaplane_bench::process::Supervised;
use mediaplane_ng::calls::parse_relay_id;
use std::collections::BTreeMap;
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MEDIA_IP: &str = "127.83.0.1";
const UAC_MEDIA_IP: &str = "127.83.1.1";
const UAS_MEDIA_IP: &str = "127.83.2.1";
const CALLS: u32 = 3;

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(bin))
        .chain(["/usr/sbin", "/sbin"].map(|d| Path::new(d).join(bin)))
        .find(|p| p.is_file())
}

fn module_dir() -> Option<PathBuf> {
    ["/usr/lib/x86_64-linux-gnu/kamailio/modules", "/usr/lib/aarch64-linux-gnu/kamailio/modules", "/usr/lib/kamailio/modules", "/usr/lib64/kamailio/modules"]
        .iter()
        .map(PathBuf::from)
        .find(|d| d.join("rtpengine.so").is_file())
}

/// Why this test cannot run here, if it cannot.
fn missing() -> Option<String> {
    if !mediaplane_bench::is_root() {
        return Some("not root".into());
    }
    for bin in ["kamailio", "sipp"] {
        if which(bin).is_none() {
            return Some(format!("{bin} not installed (apt-get install -y kamailio sip-tester)"));
        }
    }
    if module_dir().is_none() {
        return Some("kamailio rtpengine module not found".into());
    }
    if !Path::new("/usr/share/sip-tester/g711a.pcap").is_file() {
        return Some("/usr/share/sip-tester/g711a.pcap not found".into());
    }
    None
}

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A child in its own process group (the signals reach what it forks, kamailio's children);
/// terminated (then killed) on drop.
type Proc = Supervised;

fn spawn(name: &'static str, cmd: &mut Command) -> Proc {
    Supervised::spawn_group(name, cmd.stdin(Stdio::null())).unwrap_or_else(|e| panic!("{e}")).terminate_on_drop(Duration::from_secs(3))
}

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let p = std::env::temp_dir().join(format!("mp-ng-interop-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("MP_KEEP_TMP").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn kamailio_cfg(sip_port: u16, ng_port: u16, uas_port: u16, modules: &Path) -> String {
    let flags = "trust-address replace-origin replace-session-connection ICE=remove";
    format!(
        r#"#!KAMAILIO
debug=2
log_stderror=yes
children=1
disable_tcp=yes
auto_aliases=no
listen=udp:127.0.0.1:{sip_port}
mpath="{modules}/"
loadmodule "tm.so"
loadmodule "sl.so"
loadmodule "pv.so"
loadmodule "maxfwd.so"
loadmodule "textops.so"
loadmodule "siputils.so"
loadmodule "xlog.so"
loadmodule "rtpengine.so"
modparam("rtpengine", "rtpengine_sock", "udp:127.0.0.1:{ng_port}")

# Every request goes to the UAS; media is anchored on mediaplane.
request_route {{
    if (!mf_process_maxfwd_header("10")) {{
        sl_send_reply("483", "Too Many Hops");
        exit;
    }}
    if (is_method("INVITE") && !has_totag()) {{
        if (!rtpengine_offer("{flags}")) {{
            sl_send_reply("500", "Media relay failed");
            exit;
        }}
        t_on_reply("MEDIA");
    }}
    if (is_method("BYE")) {{
        rtpengine_delete();
    }}
    $du = "sip:127.0.0.1:{uas_port}";
    if (!t_relay()) {{
        sl_reply_error();
    }}
    exit;
}}

onreply_route[MEDIA] {{
    if (status =~ "^2[0-9][0-9]$" && has_body("application/sdp")) {{
        if (!rtpengine_answer("{flags}")) {{
            xlog("L_ERR", "rtpengine_answer failed\n");
        }}
    }}
}}
"#,
        modules = modules.display()
    )
}

/// Answers the INVITE with PCMA (failing the call if PCMA was not offered) and plays the pcap
/// back towards the address in the (relay-rewritten) offer.
const UAS_XML: &str = r#"<?xml version="1.0" encoding="ISO-8859-1" ?>
<!DOCTYPE scenario SYSTEM "sipp.dtd">
<scenario name="UAS answering PCMA with media">
  <recv request="INVITE" crlf="true">
    <action>
      <ereg regexp="PCMA/8000" search_in="body" check_it="true" assign_to="pcma"/>
    </action>
  </recv>
  <Reference variables="pcma"/>
  <send>
    <![CDATA[

      SIP/2.0 180 Ringing
      [last_Via:]
      [last_From:]
      [last_To:];tag=[pid]SIPpTag01[call_number]
      [last_Call-ID:]
      [last_CSeq:]
      Contact: <sip:[local_ip]:[local_port];transport=[transport]>
      Content-Length: 0

    ]]>
  </send>
  <send retrans="500">
    <![CDATA[

      SIP/2.0 200 OK
      [last_Via:]
      [last_From:]
      [last_To:];tag=[pid]SIPpTag01[call_number]
      [last_Call-ID:]
      [last_CSeq:]
      Contact: <sip:[local_ip]:[local_port];transport=[transport]>
      Content-Type: application/sdp
      Content-Length: [len]

      v=0
      o=user2 53655765 2353687637 IN IP[media_ip_type] [media_ip]
      s=-
      c=IN IP[media_ip_type] [media_ip]
      t=0 0
      m=audio [auto_media_port] RTP/AVP 8
      a=rtpmap:8 PCMA/8000
      a=ptime:20

    ]]>
  </send>
  <recv request="ACK" crlf="true"/>
  <nop>
    <action>
      <exec play_pcap_audio="pcap/g711a.pcap"/>
    </action>
  </nop>
  <recv request="BYE" timeout="30000"/>
  <send>
    <![CDATA[

      SIP/2.0 200 OK
      [last_Via:]
      [last_From:]
      [last_To:]
      [last_Call-ID:]
      [last_CSeq:]
      Contact: <sip:[local_ip]:[local_port];transport=[transport]>
      Content-Length: 0

    ]]>
  </send>
</scenario>
"#;

fn wait_listening(port: u16, p: &mut Proc, t: Duration) {
    let deadline = Instant::now() + t;
    while Instant::now() < deadline {
        if let Some(s) = p.exited().unwrap() {
            panic!("{} exited early: {s}", p.name());
        }
        if UdpSocket::bind(("127.0.0.1", port)).is_err() {
            // Give its workers a moment to finish child_init (the rtpengine ping).
            std::thread::sleep(Duration::from_millis(500));
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{} not listening on {port} after {t:?}", p.name());
}

fn log_tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

#[test]
fn kamailio_sipp_calls_through_mediaplane() {
    if let Some(why) = missing() {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("interop test cannot run under CI: {why}");
        }
        eprintln!("SKIPPED kamailio_sipp_calls_through_mediaplane: {why}");
        return;
    }
    let dir = TempDir::new();
    std::os::unix::fs::symlink("/usr/share/sip-tester", dir.0.join("pcap")).unwrap();
    std::fs::write(dir.0.join("uas.xml"), UAS_XML).unwrap();

    let relay = Relay::start(MEDIA_IP, 42000, 42199, std::time::Duration::from_secs(60));
    let (sip_port, uas_port, uac_port) = (free_udp_port(), free_udp_port(), free_udp_port());
    let (uas_cp, uac_cp) = (free_udp_port(), free_udp_port());
    let cfg = dir.0.join("kamailio.cfg");
    std::fs::write(&cfg, kamailio_cfg(sip_port, relay.ng.port(), uas_port, &module_dir().unwrap())).unwrap();
    let klog = dir.0.join("kamailio.log");
    let mut kam = spawn(
        "kamailio",
        Command::new(which("kamailio").unwrap())
            .args(["-DD", "-E", "-m", "32", "-M", "8", "-f"])
            .arg(&cfg)
            .arg("-Y")
            .arg(&dir.0)
            .arg("-P")
            .arg(dir.0.join("kamailio.pid"))
            .arg("-w")
            .arg(&dir.0)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&klog).unwrap()),
    );
    wait_listening(sip_port, &mut kam, Duration::from_secs(10));

    let sipp = which("sipp").unwrap();
    let timeout = "60s";
    let mut uas = spawn(
        "sipp uas",
        Command::new(&sipp)
            .current_dir(&dir.0)
            .args(["-sf", "uas.xml", "-i", "127.0.0.1", "-mi", UAS_MEDIA_IP, "-nostdin", "-trace_err", "-timeout", timeout, "-timeout_error"])
            .args(["-p", &uas_port.to_string(), "-cp", &uas_cp.to_string(), "-m", &CALLS.to_string()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.0.join("uas.err")).unwrap()),
    );
    wait_listening(uas_port, &mut uas, Duration::from_secs(10));
    let mut uac = spawn(
        "sipp uac",
        Command::new(&sipp)
            .current_dir(&dir.0)
            .arg(format!("127.0.0.1:{sip_port}"))
            .args(["-sn", "uac_pcap", "-s", "4711", "-i", "127.0.0.1", "-mi", UAC_MEDIA_IP, "-nostdin", "-trace_err", "-timeout", timeout, "-timeout_error"])
            .args(["-p", &uac_port.to_string(), "-cp", &uac_cp.to_string(), "-m", &CALLS.to_string(), "-l", &CALLS.to_string(), "-r", "2"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.0.join("uac.err")).unwrap()),
    );

    // While the calls run: per RTP relay, the copies each leg forwarded (max seen).
    let mut copies: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut max_calls = 0;
    let deadline = Instant::now() + Duration::from_secs(90);
    let uac_status = loop {
        let stats = relay.mgr.stats();
        relay.mgr.read(|m, _| {
            let calls = m.relays.keys().filter_map(|id| parse_relay_id(id)).map(|(k, _, _)| k).collect::<std::collections::BTreeSet<_>>();
            max_calls = max_calls.max(calls.len());
            for (id, r) in &m.relays {
                if parse_relay_id(id).is_some_and(|(_, _, rtcp)| !rtcp) {
                    let get = |uid| stats.streams.get(&uid).map_or(0, |c| c.tx_copies);
                    let e = copies.entry(id.clone()).or_default();
                    e.0 = e.0.max(get(r.a.uid));
                    e.1 = e.1.max(get(r.b.uid));
                }
            }
        });
        if let Some(s) = uac.exited().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "UAC still running after 90 s");
        std::thread::sleep(Duration::from_millis(200));
    };
    let uas_status = uas.wait_timeout(Duration::from_secs(15)).unwrap();
    let diag = || {
        format!("\n--- kamailio ---\n{}\n--- uac ---\n{}\n--- uas ---\n{}", log_tail(&klog), log_tail(&dir.0.join("uac.err")), log_tail(&dir.0.join("uas.err")))
    };
    assert!(uac_status.success(), "UAC failed: {uac_status}{}", diag());
    assert!(uas_status.is_some_and(|s| s.success()), "UAS failed: {uas_status:?}{}", diag());

    // Every call was relayed both ways: copies on both legs of its RTP relay.
    assert_eq!(copies.len(), CALLS as usize, "one RTP relay per call: {copies:?}{}", diag());
    for (id, (a, b)) in &copies {
        assert!(*a > 50 && *b > 50, "relay {id}: caller→callee {a} copies, callee→caller {b}{}", diag());
    }
    assert!(max_calls >= 1);
    // BYE → rtpengine_delete: nothing left.
    let deadline = Instant::now() + Duration::from_secs(5);
    while relay.relays() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(relay.relays(), 0, "relays left after BYE{}", diag());
    assert_eq!(relay.mgr.read(|m, _| m.local_addresses().count()), 0);
    eprintln!("interop: {} calls, copies per relay (caller→callee, callee→caller): {copies:?}", copies.len());
    if let Err(e) = kam.terminate(Duration::from_secs(3)) {
        eprintln!("{e}");
    }
}
