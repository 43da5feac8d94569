//! Interop, call control: `block media`, `silence media` and `block DTMF` (and their ends), the
//! whole call's and one participant's, sent to rtpengine 10.5 and to `mediaplane serve` on each
//! data plane over NG, in a namespace testbed (caller and callee in namespaces of their own).
//!
//! The same commands come from Kamailio's rtpengine module too (`block_media("directional")`
//! and the like in its script, on a SIP request of the call), as a SIP server sends them.
//!
//! Each phase the caller sends G.711 A-law with an RFC 4733 event every fifth packet, the
//! callee plain A-law; what each receives is compared with what rtpengine's documentation says
//! the command does, and printed beside what rtpengine itself did with the same requests:
//! rtpengine 10.5 must act as documented (else the reference is wrong), and mediaplane the same.
//!
//! Needs root, kamailio (+ its rtpengine module) and rtpengine; skipped otherwise, except under CI=true, where that is a failure.
//! MP_KEEP_TMP=1 keeps the run's directory.

mod common;
mod ng_common;

use mediaplane_bench::netns::Testbed;
use mediaplane_bench::sip;
use mediaplane_core::rtp::build_rtp;
use mediaplane_harness::bench_relay::{RelayProc, RelaySetup, NG};
use mediaplane_ng::bencode::Value;
use ng_common::*;
use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

const CALL: &str = "call-control-interop@interop_call_control.test";
const CALLER_TAG: &str = "caller-tag";
const CALLEE_TAG: &str = "callee-tag";
const KAMAILIO: &str = "127.0.0.1:5060";
/// Packets each party sends per phase (20 ms apart), and every how many the caller's is an event.
const PER_PHASE: u16 = 25;
const EVENT_EVERY: u16 = 5;
const PCMA: u8 = 8;
const EVENT: u8 = 101;
const MEDIA_BYTE: u8 = 0x2a;
const PCMA_SILENCE: u8 = 0xd5;

/// What the parties received in one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Heard {
    /// A-law packets the callee received from the caller, and how many of them were silence.
    callee_media: usize,
    callee_silent: usize,
    /// RFC 4733 events the callee received.
    callee_events: usize,
    /// A-law packets the caller received from the callee.
    caller_media: usize,
}

const MEDIA: usize = (PER_PHASE - PER_PHASE / EVENT_EVERY) as usize;
const EVENTS: usize = (PER_PHASE / EVENT_EVERY) as usize;
const ALL: usize = PER_PHASE as usize;

/// How a phase's command reaches the relay: straight over NG (the request besides `call-id`),
/// or from Kamailio's script (the function it calls on a SIP MESSAGE from the caller).
enum Via {
    Nothing,
    Ng(Vec<(&'static str, Value)>),
    Kamailio(&'static str),
}

/// The phases: how the command is sent before the phase's media, and what the parties hear, as
/// rtpengine's NG documentation has it.
fn phases() -> Vec<(&'static str, Via, Heard)> {
    let ng = |c: &str, more: Vec<(&'static str, Value)>| {
        let mut pairs = vec![("command", Value::str(c))];
        pairs.extend(more);
        Via::Ng(pairs)
    };
    let from = |t: &str| vec![("from-tag", Value::str(t))];
    let all = vec![("flags", Value::List(vec![Value::str("all")]))];
    let normal = Heard { callee_media: MEDIA, callee_silent: 0, callee_events: EVENTS, caller_media: ALL };
    vec![
        ("no control", Via::Nothing, normal),
        // The caller's media blocked; its DTMF still passes; the callee is heard.
        ("block media from the caller", ng("block media", from(CALLER_TAG)), Heard { callee_media: 0, ..normal }),
        ("unblock media from the caller", ng("unblock media", from(CALLER_TAG)), normal),
        ("block media of the call", ng("block media", vec![]), Heard { callee_media: 0, caller_media: 0, ..normal }),
        ("unblock media of the call", ng("unblock media", vec![]), normal),
        // The callee's media blocked, then the whole call's unblocked with `all`: both flow.
        ("block media from the callee", ng("block media", from(CALLEE_TAG)), Heard { caller_media: 0, ..normal }),
        ("unblock media of the call, all", ng("unblock media", all), normal),
        ("silence media from the caller", ng("silence media", from(CALLER_TAG)), Heard { callee_silent: MEDIA, ..normal }),
        ("unsilence media from the caller", ng("unsilence media", from(CALLER_TAG)), normal),
        ("block DTMF from the caller", ng("block DTMF", from(CALLER_TAG)), Heard { callee_events: 0, ..normal }),
        ("unblock DTMF from the caller", ng("unblock DTMF", from(CALLER_TAG)), normal),
        // Kamailio sends `directional` in the flags and the From tag of the request (the caller's).
        ("Kamailio block_media(directional)", Via::Kamailio("block_media"), Heard { callee_media: 0, ..normal }),
        ("Kamailio unblock_media(directional)", Via::Kamailio("unblock_media"), normal),
        ("Kamailio silence_media()", Via::Kamailio("silence_media"), Heard { callee_silent: MEDIA, ..normal }),
        ("Kamailio unsilence_media()", Via::Kamailio("unsilence_media"), normal),
        ("Kamailio block_dtmf(directional)", Via::Kamailio("block_dtmf"), Heard { callee_events: 0, ..normal }),
        ("Kamailio unblock_dtmf(directional)", Via::Kamailio("unblock_dtmf"), normal),
    ]
}

fn kamailio_cfg(modules: &Path) -> String {
    // Each function of the module, called on a MESSAGE whose X-Control header names it.
    let call =
        |f: &str, args: &str| format!("        if ($hdr(X-Control) == \"{f}\") {{ if (!{f}({args})) {{ sl_send_reply(\"500\", \"{f} failed\"); exit; }} }}\n");
    let calls: String = ["block_media", "unblock_media", "block_dtmf", "unblock_dtmf"]
        .iter()
        .map(|f| call(f, "\"directional\""))
        .chain(["silence_media", "unsilence_media"].iter().map(|f| call(f, "")))
        .collect();
    let route = format!("    if (is_method(\"MESSAGE\")) {{\n{calls}        sl_send_reply(\"200\", \"OK\");\n    }}");
    sip::script(KAMAILIO.parse().unwrap(), NG.parse().unwrap(), modules, "", &route)
}

/// A MESSAGE of the call from the caller through Kamailio, naming the function its script
/// calls; Kamailio's status line.
fn through_kamailio(tb: &Testbed, function: &str, cseq: usize) -> String {
    let function = function.to_string();
    tb.in_ns(&tb.sfu_ns, move || {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let port = s.local_addr().unwrap().port();
        let msg = format!(
            "MESSAGE sip:callee@{KAMAILIO} SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{port};branch=z9hG4bK-cc-{cseq}\r\nMax-Forwards: 70\r\n\
             From: <sip:caller@127.0.0.1>;tag={CALLER_TAG}\r\nTo: <sip:callee@127.0.0.1>;tag={CALLEE_TAG}\r\nCall-ID: {CALL}\r\n\
             CSeq: {cseq} MESSAGE\r\nX-Control: {function}\r\nContent-Length: 0\r\n\r\n"
        );
        s.send_to(msg.as_bytes(), KAMAILIO).unwrap();
        let mut buf = [0u8; 4096];
        match s.recv_from(&mut buf) {
            Ok((n, _)) => String::from_utf8_lossy(&buf[..n]).lines().next().unwrap_or_default().to_string(),
            Err(e) => format!("no reply: {e}"),
        }
    })
    .unwrap()
}

/// One phase of media: the caller's A-law (every fifth packet an event), the callee's A-law;
/// what each received, read until 200 ms after the last was sent.
fn media(caller: (&UdpSocket, SocketAddr), callee: (&UdpSocket, SocketAddr), seq0: u16) -> Heard {
    let start = Instant::now();
    let mut heard = Heard { callee_media: 0, callee_silent: 0, callee_events: 0, caller_media: 0 };
    let mut buf = [0u8; 2048];
    let mut read = |heard: &mut Heard| {
        while let Ok((n, _)) = callee.0.recv_from(&mut buf) {
            match (buf.get(1).map(|b| b & 0x7f), &buf[12.min(n)..n]) {
                (Some(PCMA), payload) => {
                    heard.callee_media += 1;
                    heard.callee_silent += usize::from(!payload.is_empty() && payload.iter().all(|b| *b == PCMA_SILENCE));
                }
                (Some(EVENT), _) => heard.callee_events += 1,
                _ => {}
            }
        }
        while let Ok((n, _)) = caller.0.recv_from(&mut buf) {
            heard.caller_media += usize::from(n > 12 && buf[1] & 0x7f == PCMA);
        }
    };
    for i in 0..PER_PHASE {
        std::thread::sleep((start + Duration::from_millis(20) * i as u32).saturating_duration_since(Instant::now()));
        let seq = seq0 + i;
        let ts = seq as u32 * 160;
        let from_caller = if i % EVENT_EVERY == EVENT_EVERY - 1 {
            // Digit 5, end bit clear, volume 10, duration 160.
            build_rtp(EVENT, seq, ts, 0x1111_1111, &[5, 10, 0, 160])
        } else {
            build_rtp(PCMA, seq, ts, 0x1111_1111, &[MEDIA_BYTE; 160])
        };
        caller.0.send_to(&from_caller, caller.1).unwrap();
        callee.0.send_to(&build_rtp(PCMA, seq, ts, 0x2222_2222, &[MEDIA_BYTE; 160]), callee.1).unwrap();
        read(&mut heard);
    }
    let until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < until {
        read(&mut heard);
        std::thread::sleep(Duration::from_millis(5));
    }
    heard
}

/// Per phase: its name, the relay's reply, what the parties heard.
type Run = Vec<(&'static str, String, Heard)>;

fn run(relay: &str, tmp: &Path) -> Run {
    let tb = Testbed::star(2).expect("testbed");
    let mut relay_proc = RelayProc::start_binary(&tb, relay, tmp, Path::new(env!("CARGO_BIN_EXE_mediaplane")), &RelaySetup::default())
        .unwrap_or_else(|e| panic!("starting {relay}: {e:#}"));
    let TestCall { caller: a, callee: b, to_caller, to_callee } = set_up_call(&tb, CALL, CALLER_TAG, CALLEE_TAG);
    // Both parties heard once (the relays latch), what arrives meanwhile read and dropped.
    media((&a, to_caller), (&b, to_callee), 0);
    let dir = tmp.join(relay);
    std::fs::create_dir_all(&dir).unwrap();
    let launcher = tb.command(&tb.sfu_ns, sip::which("kamailio").unwrap().to_str().unwrap());
    let mut kamailio = sip::Kamailio::start_script(launcher, &kamailio_cfg(&sip::kamailio_module_dir().unwrap()), 5060, &dir)
        .unwrap_or_else(|e| panic!("starting kamailio: {e}"));

    let mut out = Vec::new();
    for (i, (name, via, _)) in phases().into_iter().enumerate() {
        let reply = match via {
            Via::Nothing => "-".to_string(),
            Via::Ng(request) => {
                let mut pairs = vec![("call-id", Value::str(CALL))];
                pairs.extend(request);
                let r = ng_in(&tb, pairs);
                let mut reply = text(&r, "result");
                for k in ["error-reason", "warning"] {
                    if let Some(v) = r.get(k).and_then(Value::as_str) {
                        reply += &format!(" ({k}: {v})");
                    }
                }
                reply
            }
            Via::Kamailio(function) => through_kamailio(&tb, function, i + 1),
        };
        let heard = media((&a, to_caller), (&b, to_callee), 1000 + PER_PHASE * i as u16);
        out.push((name, reply, heard));
    }
    let _ = kamailio.proc.terminate(Duration::from_secs(3));
    // What the relay told Kamailio, beside its requests: a warning is logged, never seen else.
    let logged = std::fs::read_to_string(&kamailio.log).unwrap_or_default();
    for line in logged.lines().filter(|l| l.contains("ERROR") || l.contains("proxy")) {
        eprintln!("[{relay}] kamailio: {line}");
    }
    ng_in(&tb, delete(CALL, CALLER_TAG, CALLEE_TAG));
    relay_proc.stop().unwrap_or_else(|e| panic!("{e:#}"));
    out
}

#[test]
fn call_control_acts_as_rtpengine_documents_on_both_planes() {
    if !sip::ready("call_control_acts_as_rtpengine_documents_on_both_planes", &["kamailio", "rtpengine"]) {
        return;
    }
    let tmp = common::TempDir::new("call-control");
    let runs: Vec<(&str, Run)> = ["rtpengine", "mediaplane-userspace", "mediaplane-ebpf"].into_iter().map(|r| (r, run(r, &tmp.0))).collect();
    let expected = phases();
    let mut report = String::new();
    for (i, (name, _, want)) in expected.iter().enumerate() {
        report += &format!("{name}: documented {want:?}\n");
        for (relay, r) in &runs {
            report += &format!("  {relay:22} reply {:50} heard {:?}\n", r[i].1, r[i].2);
        }
    }
    eprintln!("{report}");
    for (relay, r) in &runs {
        for (i, (name, _, want)) in expected.iter().enumerate() {
            let (_, reply, heard) = &r[i];
            assert!(matches!(reply.as_str(), "-" | "ok" | "SIP/2.0 200 OK"), "[{relay}] {name}: reply {reply}\n{report}");
            assert_eq!(heard, want, "[{relay}] {name}\n{report}");
        }
    }
}
