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
use mediaplane_bench::sip::{self, Kamailio, KamailioConfig};
use mediaplane_ng::calls::parse_relay_id;
use std::collections::BTreeMap;
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MEDIA_IP: &str = "127.83.0.1";
const UAC_MEDIA_IP: &str = "127.83.1.1";
const UAS_MEDIA_IP: &str = "127.83.2.1";
const CALLS: u32 = 3;

/// Why this test cannot run here, if it cannot.
fn missing() -> Option<String> {
    if let Some(why) = sip::missing(&["kamailio", "sipp"]) {
        return Some(why);
    }
    if !Path::new("/usr/share/sip-tester/g711a.pcap").is_file() {
        return Some("/usr/share/sip-tester/g711a.pcap not found".into());
    }
    None
}

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A child in its own process group, terminated (then killed) on drop.
type Proc = Supervised;

fn spawn(name: &'static str, cmd: &mut Command) -> Proc {
    sip::spawn_group(name, cmd).unwrap_or_else(|e| panic!("{e}"))
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
    sip::wait_udp_bound(p, port, t).unwrap_or_else(|e| panic!("{e}"));
}

fn log_tail(path: &Path) -> String {
    sip::log_tail(path, 40)
}

#[test]
fn kamailio_sipp_calls_through_mediaplane() {
    if let Some(why) = missing() {
        if mediaplane_bench::in_ci() {
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
    let modules = sip::kamailio_module_dir().unwrap();
    let cfg = KamailioConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], sip_port)),
        ng: relay.ng,
        next_hop: Some(SocketAddr::from(([127, 0, 0, 1], uas_port))),
        flags: "trust-address replace-origin replace-session-connection ICE=remove",
        modules: &modules,
        websocket: None,
    };
    let mut kam = Kamailio::start(Command::new(sip::which("kamailio").unwrap()), &cfg, &dir.0).unwrap_or_else(|e| panic!("{e}"));
    let klog = kam.log.clone();

    let sipp = sip::which("sipp").unwrap();
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
    if let Err(e) = kam.proc.terminate(Duration::from_secs(3)) {
        eprintln!("{e}");
    }
}
