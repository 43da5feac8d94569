//! Interop, SIP relay features: Kamailio's rtpengine module puts each party of a call on a named
//! interface of the relay (`direction`), bridges an IPv4 caller to an IPv6 callee
//! (`address-family`) and records a call (`record-call=yes`), while SIPp does the SIP signalling
//! and this test is both media endpoints.
//!
//! Testbed: the star of two namespaces around a relay namespace (as `interop_latching`), with
//! IPv6 on every link too. The relay has three addresses, in rtpengine's `--interface` notation
//! (mediaplane's `media.interfaces` takes the same): `internal/10.77.0.1` (the caller's link),
//! `external/10.77.1.1` and `external/fd77:1::1` (the callee's link).
//!
//! Scenarios (concurrent, one call each, 3 s of media each way at 50 packets/s):
//! * I1: `direction=internal direction=external` on the offer; the answer names them the other
//!   way round (rtpengine reads the first as the interface of the SDP's sender). The callee must be
//!   offered the external address, the caller answered with the internal one.
//! * I2: the same, with `address-family=IP6` on the offer: the callee is on IPv6 and must be
//!   offered the external IPv6 address; the caller stays on IPv4. Media crosses families.
//! * R1: I1 with `record-call=yes`: after the BYE, the relay's pcap files (read with the
//!   `pcap-file` crate) hold every RTP packet of R1 that reached the other party, both ways, with
//!   its SSRC, sequence number and payload, and nothing of I1 and I2 (not recorded); mediaplane's
//!   metadata file names the call and its end.
//!
//! Both directions must arrive complete (≤ 2 packets lost, no duplicates) at the party's own
//! socket. rtpengine 10.5 is run first, as the reference; then `mediaplane serve` on the
//! user-space and on the eBPF plane (where mixed-family relays take the slow path).
//!
//! Needs root, kamailio (+ its rtpengine module), sipp, and for the baseline rtpengine; skipped
//! otherwise, except under CI=true, where that is a failure. MP_KEEP_TMP=1 keeps the run's
//! directory.

mod common;

use mediaplane_bench::netns::Testbed;
use mediaplane_bench::sip::{self, Kamailio, KamailioConfig};
use mediaplane_core::rtp::build_rtp;
use mediaplane_harness::bench_relay::{RelayProc, RelaySetup, NG};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

const KAMAILIO: &str = "127.0.0.1:5060";
const BASE_FLAGS: &str = "trust-address replace-origin replace-session-connection ICE=remove";
const PACKET_INTERVAL: Duration = Duration::from_millis(20);
/// Media time per call; the UAC's BYE follows 300 ms later.
const MEDIA: Duration = Duration::from_millis(3000);
const DRAIN: Duration = Duration::from_millis(200);
const CALL_DEADLINE: Duration = Duration::from_secs(30);
const MAX_LOST: usize = 2;

static SERIAL: Mutex<()> = Mutex::new(());

struct Scenario {
    id: &'static str,
    title: &'static str,
    offer_flags: &'static str,
    answer_flags: &'static str,
    /// The callee speaks IPv6.
    callee_v6: bool,
    record: bool,
}

const SCENARIOS: [Scenario; 3] = [
    Scenario {
        id: "I1",
        title: "caller on interface internal, callee on external (both IPv4)",
        offer_flags: "direction=internal direction=external",
        answer_flags: "direction=external direction=internal",
        callee_v6: false,
        record: false,
    },
    Scenario {
        id: "I2",
        title: "IPv4 caller on internal, IPv6 callee on external (address-family=IP6)",
        offer_flags: "direction=internal direction=external address-family=IP6",
        answer_flags: "direction=external direction=internal address-family=IP4",
        callee_v6: true,
        record: false,
    },
    Scenario {
        id: "R1",
        title: "I1, recorded (record-call=yes)",
        offer_flags: "direction=internal direction=external record-call=yes",
        answer_flags: "direction=external direction=internal",
        callee_v6: false,
        record: true,
    },
];

/// One call's addresses.
struct Plan<'a> {
    index: u16,
    sc: &'a Scenario,
    caller: SocketAddr,
    callee: SocketAddr,
    /// What the relay must advertise to each party.
    relay_to_caller: IpAddr,
    relay_to_callee: IpAddr,
}

impl Plan<'_> {
    fn uas_port(&self) -> u16 {
        5200 + 10 * self.index
    }

    fn ssrc(&self, up: bool) -> u32 {
        if up {
            0x1f00_0000 + self.index as u32
        } else {
            0x1e00_0000 + self.index as u32
        }
    }
}

#[derive(Default)]
struct Outcome {
    /// "offered 1" (the callee's view of the relay), "answered 1" (the caller's).
    seen: HashMap<String, SocketAddr>,
    sent: [u16; 2],
    /// Arrivals per direction [up, down] by sequence number.
    arrived: [HashMap<u16, usize>; 2],
    strays: usize,
    sipp: Vec<Result<(), String>>,
}

fn sdp(who: &str, addr: SocketAddr) -> String {
    let family = if addr.is_ipv4() { "IP4" } else { "IP6" };
    format!(
        "v=0\n      o={who} 1 1 IN {family} {ip}\n      s=-\n      c=IN {family} {ip}\n      t=0 0\n      m=audio {port} RTP/AVP 8\n      a=rtpmap:8 PCMA/8000\n      a=ptime:20\n      a=sendrecv",
        ip = addr.ip(),
        port = addr.port()
    )
}

/// The relay's address and port in an SDP, logged as "<event> IP PORT".
fn capture(event: &str) -> String {
    format!(
        r#"<action>
      <ereg regexp="c=IN IP[46] ([0-9a-fA-F.:]+)" search_in="body" check_it="true" assign_to="c_line,relay_ip"/>
      <ereg regexp="m=audio ([0-9]+)" search_in="body" check_it="true" assign_to="m_line,relay_port"/>
      <log message="{event} [$relay_ip] [$relay_port]"/>
    </action>"#
    )
}

fn uac_xml(p: &Plan) -> String {
    let uas = format!("sip:callee@127.0.0.1:{}", p.uas_port());
    let head = |cseq: u32, method: &str, to_tag: &str| {
        format!(
            "{method} {uas} SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: <sip:caller@[local_ip]:[local_port]>;tag=caller[pid]-[call_number]
      To: <{uas}>{to_tag}
      Call-ID: [call_id]
      CSeq: {cseq} {method}
      Contact: <sip:caller@[local_ip]:[local_port]>
      Max-Forwards: 70"
        )
    };
    format!(
        r#"<?xml version="1.0" encoding="ISO-8859-1" ?>
<!DOCTYPE scenario SYSTEM "sipp.dtd">
<scenario name="{id} caller">
  <send retrans="500">
    <![CDATA[

      {invite}
      X-RTP-Flags: {offer_flags}
      X-RTP-Answer-Flags: {answer_flags}
      Content-Type: application/sdp
      Content-Length: [len]

      {sdp}

    ]]>
  </send>
  <recv response="100" optional="true"/>
  <recv response="200">
    {capture}
  </recv>
  <send>
    <![CDATA[

      {ack}
      Content-Length: 0

    ]]>
  </send>
  <pause milliseconds="{pause}"/>
  <send retrans="500">
    <![CDATA[

      {bye}
      Content-Length: 0

    ]]>
  </send>
  <recv response="200"/>
  <Reference variables="c_line,m_line"/>
</scenario>
"#,
        id = p.sc.id,
        invite = head(1, "INVITE", ""),
        offer_flags = p.sc.offer_flags,
        answer_flags = p.sc.answer_flags,
        sdp = sdp("caller", p.caller),
        capture = capture("answered 1"),
        ack = head(1, "ACK", "[peer_tag_param]"),
        pause = (MEDIA + Duration::from_millis(300)).as_millis(),
        bye = head(2, "BYE", "[peer_tag_param]"),
    )
}

fn uas_xml(p: &Plan) -> String {
    format!(
        r#"<?xml version="1.0" encoding="ISO-8859-1" ?>
<!DOCTYPE scenario SYSTEM "sipp.dtd">
<scenario name="{id} callee">
  <recv request="INVITE" crlf="true">
    {capture}
  </recv>
  <send retrans="500">
    <![CDATA[

      SIP/2.0 200 OK
      [last_Via:]
      [last_From:]
      [last_To:];tag=callee[pid]-[call_number]
      [last_Call-ID:]
      [last_CSeq:]
      Contact: <sip:callee@[local_ip]:[local_port]>
      Content-Type: application/sdp
      Content-Length: [len]

      {sdp}

    ]]>
  </send>
  <recv request="ACK" crlf="true"/>
{bye}  <Reference variables="c_line,m_line"/>
</scenario>
"#,
        id = p.sc.id,
        capture = capture("offered 1"),
        sdp = sdp("callee", p.callee),
        bye = sip::UAS_BYE_OK,
    )
}

/// One call: SIPp on both ends, and 3 s of RTP each way to what the relay advertised.
fn run_call(tb: &Testbed, dir: &Path, p: &Plan) -> Outcome {
    let id = p.sc.id;
    std::fs::write(dir.join(format!("{id}-uac.xml")), uac_xml(p)).unwrap();
    std::fs::write(dir.join(format!("{id}-uas.xml")), uas_xml(p)).unwrap();
    let bind = |ns: &str, a: SocketAddr| -> UdpSocket {
        let s = tb.udp_socket(ns, a).unwrap_or_else(|e| panic!("{id}: binding {a}: {e}"));
        s.set_nonblocking(true).unwrap();
        s
    };
    let sockets = [bind(&tb.peers[0].ns, p.caller), bind(&tb.peers[1].ns, p.callee)];
    let mut out = Outcome::default();
    let mut uas = sip::spawn_group("sipp uas", &mut sip::sipp_command(tb, dir, id, "uas", p.uas_port())).unwrap();
    if let Err(e) = sip::wait_udp_bound(&mut uas, p.uas_port(), Duration::from_secs(10)) {
        out.sipp.push(Err(e));
        return out;
    }
    let mut uac = sip::spawn_group("sipp uac", sip::sipp_command(tb, dir, id, "uac", p.uas_port() + 1).arg(KAMAILIO)).unwrap();
    let mut logs = [sip::LogTail::new(dir.join(format!("{id}-uac.log"))), sip::LogTail::new(dir.join(format!("{id}-uas.log")))];
    let deadline = Instant::now() + CALL_DEADLINE;
    let (mut start, mut next) = (None::<Instant>, None::<Instant>);
    let payload = [0xd5u8; 160];
    let mut buf = [0u8; 2048];
    loop {
        let now = Instant::now();
        for log in &mut logs {
            for line in log.lines() {
                if let Some((event, Some(addr))) = sip::parse_sipp_event(&line) {
                    out.seen.insert(event, addr);
                }
            }
        }
        if start.is_none() && out.seen.contains_key("answered 1") && out.seen.contains_key("offered 1") {
            (start, next) = (Some(now), Some(now));
        }
        if let (Some(s), Some(due)) = (start, next) {
            if now >= due && now < s + MEDIA {
                // Up: the caller to what it was answered; down: the callee to what it was offered.
                for (i, (event, up)) in [("answered 1", true), ("offered 1", false)].into_iter().enumerate() {
                    let seq = out.sent[i];
                    let _ = sockets[i].send_to(&build_rtp(8, seq, seq as u32 * 160, p.ssrc(up), &payload), out.seen[event]);
                    out.sent[i] += 1;
                }
                next = Some(due + PACKET_INTERVAL);
            }
        }
        // The callee's socket receives the up direction, the caller's the down one.
        for (socket, dir, ssrc) in [(&sockets[1], 0, p.ssrc(true)), (&sockets[0], 1, p.ssrc(false))] {
            loop {
                match socket.recv_from(&mut buf) {
                    Ok((n, _)) if n >= 12 && u32::from_be_bytes([buf[8], buf[9], buf[10], buf[11]]) == ssrc => {
                        *out.arrived[dir].entry(u16::from_be_bytes([buf[2], buf[3]])).or_default() += 1;
                    }
                    Ok(_) => out.strays += 1,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => panic!("{id}: receiving: {e}"),
                }
            }
        }
        let done = start.is_some_and(|s| now >= s + MEDIA + DRAIN);
        if done || now >= deadline || (start.is_none() && !uac.alive()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    out.sipp.push(sip::sipp_result(&mut uac, dir, id, "uac"));
    out.sipp.push(sip::sipp_result(&mut uas, dir, id, "uas"));
    out
}

fn check(p: &Plan, o: &Outcome, report: &mut String) -> Vec<String> {
    let mut results: Vec<(bool, String)> =
        o.sipp.iter().map(|r| (r.is_ok(), format!("SIPp {}", r.as_ref().err().map_or("completed the call", |e| e)))).collect();
    for (event, want, whom) in [("offered 1", p.relay_to_callee, "callee"), ("answered 1", p.relay_to_caller, "caller")] {
        let got = o.seen.get(event).map(SocketAddr::ip);
        results.push((got == Some(want), format!("the {whom} is given the relay address {want} (got {got:?})")));
    }
    for (dir, label) in [(0, "caller→callee"), (1, "callee→caller")] {
        let sent = o.sent[dir] as usize;
        let received = o.arrived[dir].len();
        let dups: usize = o.arrived[dir].values().map(|n| n - 1).sum();
        let ok = sent >= 100 && sent - received <= MAX_LOST && dups == 0;
        results.push((ok, format!("{label}: {received} of {sent} arrived ({} lost, ≤ {MAX_LOST} allowed), {dups} duplicates", sent - received)));
    }
    results.push((o.strays == 0, format!("{} stray datagrams", o.strays)));
    let _ = writeln!(report, "{}: {}\n  caller {} / callee {}", p.sc.id, p.sc.title, p.caller, p.callee);
    for (ok, what) in &results {
        let _ = writeln!(report, "  {} {what}", if *ok { "ok  " } else { "FAIL" });
    }
    results.into_iter().filter(|(ok, _)| !ok).map(|(_, what)| format!("{}: {what}", p.sc.id)).collect()
}

/// Every pcap under `dir` (rtpengine writes into `pcaps/`).
fn pcaps(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = e.path();
        if path.is_dir() {
            out.extend(pcaps(&path));
        } else if path.extension().is_some_and(|x| x == "pcap") {
            out.push(path);
        }
    }
    out
}

/// The RTP in the recordings, keyed by (SSRC, sequence number), with its payload.
fn recorded_rtp(dir: &Path) -> Result<HashMap<(u32, u16), Vec<u8>>, String> {
    let mut rtp = HashMap::new();
    for path in pcaps(dir) {
        let f = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut reader = pcap_file::pcap::PcapReader::new(f).map_err(|e| format!("{}: {e}", path.display()))?;
        if reader.header().datalink != pcap_file::DataLink::ETHERNET {
            return Err(format!("{}: link type {:?}, not Ethernet", path.display(), reader.header().datalink));
        }
        while let Some(packet) = reader.next_packet() {
            let packet = packet.map_err(|e| format!("{}: {e}", path.display()))?;
            // Ethernet, then IPv4 (IHL) or IPv6 (40 bytes, UDP next), then UDP's 8 bytes.
            let ip = packet.data.get(14..).ok_or("short frame")?;
            let udp = match ip.first().map(|b| b >> 4) {
                Some(4) => (ip[0] & 0x0f) as usize * 4,
                Some(6) => 40,
                _ => return Err(format!("{}: a frame that is neither IPv4 nor IPv6", path.display())),
            };
            let payload = ip.get(udp + 8..).ok_or("short UDP")?;
            if payload.len() >= 12 {
                let (seq, ssrc) = (u16::from_be_bytes([payload[2], payload[3]]), u32::from_be_bytes([payload[8], payload[9], payload[10], payload[11]]));
                rtp.insert((ssrc, seq), payload[12..].to_vec());
            }
        }
    }
    Ok(rtp)
}

/// R1's packets are all in the recordings (those that reached the other party, at least), the
/// others' are not; mediaplane's metadata says which call it was and that it ended.
fn check_recordings(dir: &Path, plans: &[Plan], outcomes: &[Outcome], relay: &str, report: &mut String) -> Vec<String> {
    // The relay writes when the call ends (the BYE): give it a moment.
    std::thread::sleep(Duration::from_millis(500));
    let mut results = Vec::new();
    match recorded_rtp(dir) {
        Err(e) => results.push((false, format!("the recordings could not be read: {e}"))),
        Ok(rtp) => {
            for (p, o) in plans.iter().zip(outcomes) {
                for (dir_ix, up) in [(0, true), (1, false)] {
                    let (ssrc, way) = (p.ssrc(up), if up { "up" } else { "down" });
                    let in_pcap = rtp.keys().filter(|(s, _)| *s == ssrc).count();
                    if p.sc.record {
                        let intact = |seq: &u16| rtp.get(&(ssrc, *seq)).is_some_and(|pl| pl[..] == [0xd5u8; 160][..]);
                        let missing = o.arrived[dir_ix].keys().filter(|seq| !intact(seq)).count();
                        let delivered = o.arrived[dir_ix].len();
                        results.push((
                            missing == 0 && in_pcap > 0,
                            format!("{} {way}: {in_pcap} packets recorded, {missing} of the {delivered} delivered missing or altered", p.sc.id),
                        ));
                    } else {
                        results.push((in_pcap == 0, format!("{} {way}: not recorded ({in_pcap} packets in the recordings)", p.sc.id)));
                    }
                }
            }
        }
    }
    if relay.starts_with("mediaplane") {
        let metas: Vec<serde_json::Value> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok())
            .collect();
        let one = metas.len() == 1;
        let ok = one
            && metas[0]["call-id"].as_str().is_some_and(|c| !c.is_empty())
            && metas[0]["ended"].is_u64()
            && metas[0]["media"].as_array().is_some_and(|m| m.len() == 1);
        let seen = if ok { String::new() } else { format!(": {metas:?}") };
        results.push((ok, format!("one metadata file, for R1's call, ended, one media section{seen}")));
    }
    let _ = writeln!(report, "recordings ({}):", dir.display());
    for (ok, what) in &results {
        let _ = writeln!(report, "  {} {what}", if *ok { "ok  " } else { "FAIL" });
    }
    results.into_iter().filter(|(ok, _)| !ok).map(|(_, what)| format!("recording: {what}")).collect()
}

fn run(relay: &str) {
    let test = format!("sip_relay_{}", relay.replace('-', "_"));
    let tools: &[&str] = if relay == "rtpengine" { &["kamailio", "sipp", "rtpengine"] } else { &["kamailio", "sipp"] };
    if !sip::ready(&test, tools) {
        return;
    }
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let tmp = common::TempDir::new("sip-relay");
    let mut tb = Testbed::star(2).expect("testbed");
    tb.add_ipv6().expect("IPv6 on the testbed's links");
    let (caller_link, callee_link) = (&tb.peers[0], &tb.peers[1]);
    let (internal, external, external6) = (caller_link.sfu_ip, callee_link.sfu_ip, callee_link.sfu_ip6.unwrap());
    let recordings = tmp.0.join("recordings");
    let setup = RelaySetup {
        interfaces: vec![format!("internal/{internal}"), format!("external/{external}"), format!("external/{external6}")],
        recording_dir: Some(recordings.clone()),
        ..Default::default()
    };
    let mut relay_proc =
        RelayProc::start_binary(&tb, relay, &tmp.0, Path::new(env!("CARGO_BIN_EXE_mediaplane")), &setup).unwrap_or_else(|e| panic!("starting {relay}: {e:#}"));
    let modules = sip::kamailio_module_dir().unwrap();
    let kcfg =
        KamailioConfig { listen: KAMAILIO.parse().unwrap(), ng: NG.parse().unwrap(), next_hop: None, flags: BASE_FLAGS, modules: &modules, websocket: None };
    let kamailio =
        Kamailio::start(tb.command(&tb.sfu_ns, sip::which("kamailio").unwrap().to_str().unwrap()), &kcfg, &tmp.0).unwrap_or_else(|e| panic!("kamailio: {e}"));

    let plans: Vec<Plan> = SCENARIOS
        .iter()
        .enumerate()
        .map(|(i, sc)| {
            let i = i as u16;
            let callee_ip = if sc.callee_v6 { tb.peers[1].ip6.unwrap() } else { tb.peers[1].ip };
            Plan {
                index: i,
                sc,
                caller: SocketAddr::new(tb.peers[0].ip, 21000 + 100 * i),
                callee: SocketAddr::new(callee_ip, 31000 + 100 * i),
                relay_to_caller: internal,
                relay_to_callee: if sc.callee_v6 { external6 } else { external },
            }
        })
        .collect();
    let outcomes: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = plans.iter().map(|p| s.spawn(|| run_call(&tb, &tmp.0, p))).collect();
        handles.into_iter().map(|h| h.join().expect("call thread panicked")).collect()
    });
    let mut report = String::new();
    let mut failures: Vec<String> = plans.iter().zip(&outcomes).flat_map(|(p, o)| check(p, o, &mut report)).collect();
    failures.extend(check_recordings(&recordings, &plans, &outcomes, relay, &mut report));
    if relay == "mediaplane-ebpf" {
        // I1 stays in one family: its media crosses the TC programs; I2's goes up (mixed family).
        let stats = common::netns::try_api(&tb, "GET", "/v1/stats", None).unwrap_or_else(|e| panic!("GET /v1/stats: {e}"));
        let forwarded = stats["extra"]["forwarded"].as_u64().unwrap_or(0);
        let i1 = outcomes[0].arrived.iter().map(HashMap::len).sum::<usize>() as u64;
        let ok = forwarded * 10 >= i1 * 9;
        let _ = writeln!(
            report,
            "  {} kernel path: {forwarded} packets forwarded by the BPF program; I1 (one family) delivered {i1}",
            if ok { "ok  " } else { "FAIL" }
        );
        if !ok {
            failures.push(format!("only {forwarded} packets forwarded in the kernel for I1's {i1}"));
        }
    }
    eprintln!("=== {relay} (testbed {}) ===\n{report}", tb.prefix);
    let diag = || format!("\n--- kamailio ---\n{}\n--- {relay} ---\n{}", kamailio.log_tail(15), sip::log_tail(relay_proc.log_path(), 15));
    if std::env::var_os("MP_KEEP_TMP").is_some() {
        eprintln!("kept {}", tmp.0.display());
        std::mem::forget(tmp);
    }
    assert!(failures.is_empty(), "{relay}: {} expectation(s) failed:\n{}{}", failures.len(), failures.join("\n"), diag());
    drop(kamailio);
    relay_proc.stop().unwrap_or_else(|e| panic!("{e:#}"));
}

#[test]
fn sip_relay_rtpengine() {
    run("rtpengine");
}

#[test]
fn sip_relay_mediaplane_userspace() {
    run("mediaplane-userspace");
}

#[test]
fn sip_relay_mediaplane_ebpf() {
    run("mediaplane-ebpf");
}
