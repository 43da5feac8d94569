//! Interop, SDP codec filtering: Kamailio's rtpengine module passes a call's `codec-…` flags
//! (SIPp's `X-RTP-Flags` header) to the relay; the callee (a SIPp UAS) checks the offer it
//! receives lists exactly the codecs that should remain and none of those removed, answers with
//! a kept codec, and the caller (SIPp UAC) checks the answer. Both media endpoints are this test:
//! RTP in the kept codec flows both ways, counted by SSRC and sequence number, and a burst in a
//! removed codec (a phone that sends it anyway) is relayed as sent, as rtpengine 10.5 does: no
//! transcoding, payload types unchanged.
//!
//! Testbed and relays as in `interop_latching` (`common::sipp::Bed`): rtpengine 10.5 (the
//! baseline), then `mediaplane serve` on the user-space and on the eBPF plane, the same
//! expectations for all three. The offer is PCMU, PCMA, G.722 and telephone-event (with fmtp).
//!
//! Needs root, kamailio (+ its rtpengine module), sipp, and for the baseline rtpengine; skipped
//! otherwise, except under CI=true, where that is a failure. MP_KEEP_TMP=1 keeps the run's
//! directory (SIPp's logs and messages, the relay's log).

mod common;

use common::sipp::{parse_sipp_event, recv_answer, recv_offer, sipp_command, sipp_completed, sipp_result, Bed, LogTail, Relay, KAMAILIO};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::sip;
use mediaplane_core::rtp::build_rtp;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

const BASE_FLAGS: &str = "trust-address replace-origin replace-session-connection ICE=remove";
/// Packets each party sends, one per 20 ms.
const PACKETS: u16 = 100;
/// The caller's packets with these sequence numbers carry the removed codec.
const REMOVED_CODEC_BURST: std::ops::Range<u16> = 40..50;
/// Packets a direction may lose (none expected on a quiet testbed).
const MAX_LOST: usize = 2;
/// The UAC waits this long after its ACK before the BYE: the media runs in it.
const CALL_MS: u64 = 3000;
const DEADLINE: Duration = Duration::from_secs(40);

/// One call: its flags, what the callee must be offered, how it answers, the codec spoken.
struct Scenario {
    id: &'static str,
    flags: &'static str,
    /// The payload types of the offer the callee receives.
    offered: &'static [u8],
    /// Codec names that must not reach the callee (no rtpmap, no fmtp).
    removed: &'static [&'static str],
    /// The payload types the callee answers (the caller must receive the same).
    answered: &'static [u8],
    /// The codec both parties send.
    pt: u8,
    /// The removed codec the caller sends a burst of.
    removed_pt: u8,
}

/// A call whose callee answers `answered` and both parties speak its first codec; the caller's
/// burst is in the first codec `removed` names.
fn scenario(id: &'static str, flags: &'static str, offered: &'static [u8], removed: &'static [&'static str], answered: &'static [u8]) -> Scenario {
    let removed_pt = match removed[0] {
        "PCMU" => 0,
        "PCMA" => 8,
        _ => 9,
    };
    Scenario { id, flags, offered, removed, answered, pt: answered[0], removed_pt }
}

fn scenarios() -> Vec<Scenario> {
    vec![
        scenario("C1", "codec-strip-PCMA", &[0, 9, 101], &["PCMA"], &[0, 101]),
        scenario("C2", "codec-strip-all codec-except-G722 codec-except-telephone-event", &[9, 101], &["PCMU", "PCMA"], &[9, 101]),
        scenario("C3", "codec-mask-PCMU codec-mask-G722", &[8, 101], &["PCMU", "G722"], &[8, 101]),
    ]
}

fn rtpmap(pt: u8) -> &'static str {
    match pt {
        0 => "a=rtpmap:0 PCMU/8000",
        8 => "a=rtpmap:8 PCMA/8000",
        9 => "a=rtpmap:9 G722/8000",
        _ => "a=rtpmap:101 telephone-event/8000\n      a=fmtp:101 0-16",
    }
}

/// An SDP body (inside a SIPp message: six spaces of indentation) for `ip:port` and `formats`.
fn sdp(party: &str, ip: IpAddr, port: u16, formats: &[u8]) -> String {
    let list: Vec<String> = formats.iter().map(u8::to_string).collect();
    let maps: Vec<&str> = formats.iter().map(|&pt| rtpmap(pt)).collect();
    format!(
        "v=0\n      o={party} 1 1 IN IP4 {ip}\n      s=-\n      c=IN IP4 {ip}\n      t=0 0\n      m=audio {port} RTP/AVP {}\n      {}\n      a=ptime:20\n      a=sendrecv",
        list.join(" "),
        maps.join("\n      ")
    )
}

/// A regular expression (POSIX, SIPp's) matching an m= line with exactly `formats`; its group
/// is the port.
fn m_line(formats: &[u8]) -> String {
    let list: Vec<String> = formats.iter().map(u8::to_string).collect();
    format!("m=audio ([0-9]+) RTP/AVP {}[[:space:]]", list.join(" "))
}

/// Call `index`'s addresses and identifiers.
struct CallPlan<'a> {
    index: usize,
    sc: &'a Scenario,
    caller: SocketAddr,
    callee: SocketAddr,
}

impl CallPlan<'_> {
    fn uas_sip_port(&self) -> u16 {
        5200 + 10 * self.index as u16
    }

    fn ssrc(&self, up: bool) -> u32 {
        (if up { 0xc0de_0000 } else { 0xc0df_0000 }) + self.index as u32
    }

    /// The caller: INVITE (the flags in X-RTP-Flags), the answer checked and its relay address
    /// logged as "answered 1 IP PORT", ACK, the call, BYE.
    fn uac_xml(&self) -> String {
        let uas = format!("sip:callee@127.0.0.1:{}", self.uas_sip_port());
        let head = |method: &str, cseq: u32, to_tag: &str| {
            format!(
                "{method} {uas} SIP/2.0\n      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]\n      From: <sip:caller@[local_ip]:[local_port]>;tag=c[pid]-[call_number]\n      To: <{uas}>{to_tag}\n      Call-ID: [call_id]\n      CSeq: {cseq} {method}\n      Contact: <sip:caller@[local_ip]:[local_port]>\n      Max-Forwards: 70"
            )
        };
        let invite = format!("{}\n      X-RTP-Flags: {}", head("INVITE", 1, ""), self.sc.flags);
        let offer = sdp("caller", self.caller.ip(), self.caller.port(), &[0, 8, 9, 101]);
        let steps = [
            send(true, &invite, Some(&offer)),
            recv_answer(1, &m_line(self.sc.answered)),
            send(false, &head("ACK", 1, "[peer_tag_param]"), None),
            format!("  <pause milliseconds=\"{CALL_MS}\"/>\n"),
            send(true, &head("BYE", 2, "[peer_tag_param]"), None),
            "  <recv response=\"200\"/>\n".to_string(),
        ];
        scenario_xml(&format!("{} caller", self.sc.id), &steps, "c_line,m_line")
    }

    /// The callee: the offer must list exactly the kept codecs and name none of the removed
    /// ones (or the call fails); its relay address logged as "offered 1 IP PORT"; the answer.
    fn uas_xml(&self) -> String {
        let absent: String = self
            .sc
            .removed
            .iter()
            .enumerate()
            .map(|(i, name)| format!("\n      <ereg regexp=\"{name}/\" search_in=\"body\" check_it_inverse=\"true\" assign_to=\"removed{i}\"/>"))
            .collect();
        let references: Vec<String> =
            ["c_line".to_string(), "m_line".to_string()].into_iter().chain((0..self.sc.removed.len()).map(|i| format!("removed{i}"))).collect();
        let ok = |to_tag: &str| {
            format!("SIP/2.0 200 OK\n      [last_Via:]\n      [last_From:]\n      [last_To:]{to_tag}\n      [last_Call-ID:]\n      [last_CSeq:]")
        };
        let ok_invite = format!("{}\n      Contact: <sip:callee@[local_ip]:[local_port]>", ok(";tag=u[pid]-[call_number]"));
        let answer = sdp("callee", self.callee.ip(), self.callee.port(), self.sc.answered);
        let steps = [
            recv_offer(1, &m_line(self.sc.offered), &absent),
            send(true, &ok_invite, Some(&answer)),
            "  <recv request=\"ACK\" crlf=\"true\"/>\n  <recv request=\"BYE\" timeout=\"30000\"/>\n".to_string(),
            send(false, &ok(""), None),
        ];
        scenario_xml(&format!("{} callee", self.sc.id), &steps, &references.join(","))
    }
}

/// A SIPp `<send>` of a message: its start line and headers, and its SDP body if any.
fn send(retransmit: bool, head: &str, sdp: Option<&str>) -> String {
    let retrans = if retransmit { " retrans=\"500\"" } else { "" };
    let body = match sdp {
        Some(b) => format!("      Content-Type: application/sdp\n      Content-Length: [len]\n\n      {b}\n"),
        None => "      Content-Length: 0\n".to_string(),
    };
    format!("  <send{retrans}><![CDATA[\n\n      {head}\n{body}\n  ]]></send>\n")
}

/// A SIPp scenario of `steps`, which uses the variables `references`.
fn scenario_xml(name: &str, steps: &[String], references: &str) -> String {
    format!(
        "<?xml version=\"1.0\" encoding=\"ISO-8859-1\" ?>\n<!DOCTYPE scenario SYSTEM \"sipp.dtd\">\n<scenario name=\"{name}\">\n{}  <Reference variables=\"{references}\"/>\n</scenario>\n",
        steps.concat()
    )
}

/// What one call did: SIPp's verdicts, the media both ways.
struct CallRecord {
    uac: Result<(), String>,
    uas: Result<(), String>,
    /// (caller → callee?, sequence) → payload types of its arrivals.
    arrivals: HashMap<(bool, u16), Vec<u8>>,
    /// Packets sent per direction (caller → callee first).
    sent: [u16; 2],
    /// Datagrams at the call's sockets that are not its RTP.
    strays: usize,
}

impl CallRecord {
    fn arrived(&self, up: bool, seqs: std::ops::Range<u16>) -> usize {
        seqs.filter(|s| self.arrivals.contains_key(&(up, *s))).count()
    }

    /// Expectations and a table row.
    fn check(&self, plan: &CallPlan, report: &mut String, failures: &mut Vec<String>) {
        let sc = plan.sc;
        let mut checks: Vec<(bool, String)> = sipp_completed(&self.uac, &self.uas).into();
        let removed = sc.removed.join(", ");
        checks.push((self.uas.is_ok(), format!("the callee was offered payload types {:?} and no {removed} (SIPp checks)", sc.offered)));
        for (up, label) in [(true, "caller→callee"), (false, "callee→caller")] {
            let sent = self.sent[usize::from(!up)];
            let arrived = self.arrived(up, 0..sent);
            checks.push((sent == PACKETS && arrived + MAX_LOST >= sent as usize, format!("{label}: {arrived} of {sent} packets arrived (≤ {MAX_LOST} lost)")));
        }
        let burst = self.arrived(true, REMOVED_CODEC_BURST);
        checks.push((
            burst + MAX_LOST >= REMOVED_CODEC_BURST.len(),
            format!("the removed codec (PT {}) is still relayed: {burst} of {} arrived", sc.removed_pt, REMOVED_CODEC_BURST.len()),
        ));
        let changed = self.arrivals.iter().filter(|((up, seq), pts)| pts.iter().any(|&pt| pt != sent_pt(sc, *up, *seq))).count();
        checks.push((changed == 0, format!("payload types unchanged (no transcoding): {changed} packets changed")));
        let _ = writeln!(report, "{} (flags: {}): {} strays", sc.id, sc.flags, self.strays);
        for (ok, what) in checks {
            let _ = writeln!(report, "  {} {what}", if ok { "ok  " } else { "FAIL" });
            if !ok {
                failures.push(format!("{}: {what}", sc.id));
            }
        }
    }
}

/// The payload type of the packet `seq` of a direction.
fn sent_pt(sc: &Scenario, up: bool, seq: u16) -> u8 {
    if up && REMOVED_CODEC_BURST.contains(&seq) {
        sc.removed_pt
    } else {
        sc.pt
    }
}

/// One call: its SIPp UAS and UAC, and both media endpoints, until the media is done and SIPp
/// finished.
fn run_call(tb: &Testbed, dir: &Path, plan: &CallPlan) -> CallRecord {
    let id = plan.sc.id;
    std::fs::write(dir.join(format!("{id}-uac.xml")), plan.uac_xml()).unwrap();
    std::fs::write(dir.join(format!("{id}-uas.xml")), plan.uas_xml()).unwrap();
    let bind = |ns: &str, addr: SocketAddr| {
        let s = tb.udp_socket(ns, addr).unwrap_or_else(|e| panic!("{id}: binding {addr}: {e}"));
        s.set_nonblocking(true).unwrap();
        s
    };
    // [caller, callee]
    let sockets = [bind(&tb.peers[0].ns, plan.caller), bind(&tb.peers[1].ns, plan.callee)];
    let mut record = CallRecord { uac: Ok(()), uas: Ok(()), arrivals: HashMap::new(), sent: [0, 0], strays: 0 };
    let port = plan.uas_sip_port();
    let mut uas = sip::spawn_group("sipp uas", &mut sipp_command(tb, dir, id, "uas", port)).unwrap();
    if let Err(e) = sip::wait_udp_bound(&mut uas, port, Duration::from_secs(10)) {
        record.uas = Err(e);
        return record;
    }
    let mut uac = sip::spawn_group("sipp uac", sipp_command(tb, dir, id, "uac", port + 1).arg(KAMAILIO)).unwrap();
    let mut logs = [LogTail::new(dir.join(format!("{id}-uac.log"))), LogTail::new(dir.join(format!("{id}-uas.log")))];
    // Where each party sends: the relay address in the SDP it received ([caller, callee]).
    let mut targets: [Option<SocketAddr>; 2] = [None, None];
    let mut next_send: Option<Instant> = None;
    let mut seq = 0u16;
    let deadline = Instant::now() + DEADLINE;
    let mut buf = [0u8; 2048];
    let payload = [0x55u8; 160];
    loop {
        let now = Instant::now();
        for (party, log) in logs.iter_mut().enumerate() {
            for line in log.lines() {
                if let Some((event, addr)) = parse_sipp_event(&line) {
                    targets[party] = addr.or(targets[party]);
                    // Media starts once the caller has the answer.
                    if event == "answered 1" {
                        next_send.get_or_insert(now);
                    }
                }
            }
        }
        if let Some(due) = next_send.filter(|due| now >= *due && seq < PACKETS) {
            for (party, up) in [(0, true), (1, false)] {
                if let Some(to) = targets[party] {
                    let rtp = build_rtp(sent_pt(plan.sc, up, seq), seq, u32::from(seq) * 160, plan.ssrc(up), &payload);
                    let _ = sockets[party].send_to(&rtp, to);
                    record.sent[party] += 1;
                }
            }
            seq += 1;
            next_send = Some(due + Duration::from_millis(20));
        }
        for (party, s) in sockets.iter().enumerate() {
            loop {
                match s.recv_from(&mut buf) {
                    Ok((n, _)) => {
                        let ssrc = (n >= 12).then(|| u32::from_be_bytes([buf[8], buf[9], buf[10], buf[11]]));
                        // The callee receives the caller's stream ("up"), the caller the callee's.
                        let up = party == 1;
                        if ssrc == Some(plan.ssrc(up)) {
                            record.arrivals.entry((up, u16::from_be_bytes([buf[2], buf[3]]))).or_default().push(buf[1] & 0x7f);
                        } else {
                            record.strays += 1;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => panic!("{id}: receiving: {e}"),
                }
            }
        }
        let media_done = seq == PACKETS && next_send.is_some_and(|t| now >= t + Duration::from_millis(200));
        if media_done || now >= deadline || (next_send.is_none() && !uac.alive()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    record.uac = sipp_result(&mut uac, dir, id, "uac");
    record.uas = sipp_result(&mut uas, dir, id, "uas");
    record
}

fn run(relay: Relay) {
    let Some(bed) = Bed::start("codecs", relay, BASE_FLAGS) else { return };
    let tb = &bed.tb;
    let scenarios = scenarios();
    let plans: Vec<CallPlan> = scenarios
        .iter()
        .enumerate()
        .map(|(index, sc)| CallPlan {
            index,
            sc,
            caller: SocketAddr::new(tb.peers[0].ip, 22000 + 100 * index as u16),
            callee: SocketAddr::new(tb.peers[1].ip, 32000 + 100 * index as u16),
        })
        .collect();
    let records = bed.run_calls(&plans, run_call);
    let (mut report, mut failures) = (String::new(), Vec::new());
    for (plan, record) in plans.iter().zip(&records) {
        record.check(plan, &mut report, &mut failures);
    }
    bed.finish(records.iter().map(|r| r.arrivals.values().map(Vec::len).sum::<usize>()).sum(), report, failures);
}

relay_tests!(run, codecs_rtpengine, codecs_mediaplane_userspace, codecs_mediaplane_ebpf);
