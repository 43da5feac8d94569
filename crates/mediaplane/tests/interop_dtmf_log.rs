//! Interop, DTMF reporting: each RFC 4733 event a party sends is reported once, as JSON over UDP
//! to a collector (rtpengine 10.5's `--dtmf-log-dest`, mediaplane's `ng.dtmf_log_dest`), by
//! rtpengine and by `mediaplane serve` on each data plane, in a namespace testbed (caller and
//! callee in namespaces of their own, the collector beside the relay).
//!
//! The caller sends A-law and, between, two events as a phone sends them: '5' (volume 10) and
//! '#' (volume 7), each a start packet with the marker bit, growing durations, and three end
//! packets with the same timestamp; the callee sends A-law too. What the collector receives is
//! compared key by key with what rtpengine sent for the same call: the call-id, the sender's tag,
//! the call's tags, `"type": "DTMF"`, the sender's address, event, duration in ms and volume;
//! the timestamp within a few seconds of the wall clock. The events still reach the callee
//! (reporting takes nothing away) and, on the eBPF plane, the caller's audio stays in the
//! kernel while only the events go up.
//!
//! Needs root and rtpengine; skipped otherwise, except under CI=true, where that is a failure.

mod common;
mod ng_common;

use mediaplane_bench::netns::Testbed;
use mediaplane_bench::sip;
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use mediaplane_harness::bench_relay::{RelayProc, RelaySetup};
use ng_common::*;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const CALL: &str = "dtmf-log-interop@interop_dtmf_log.test";
const CALLER_TAG: &str = "caller-tag";
const CALLEE_TAG: &str = "callee-tag";
const SSRC_CALLER: u32 = 0x1111_1111;
const PCMA: u8 = 8;
const EVENT: u8 = 101;
/// Where the collector listens, in the relay's namespace.
const COLLECTOR: &str = "127.0.0.1:39555";

/// What one packet of the caller is.
#[derive(Clone, Copy)]
enum Send {
    Audio,
    /// An event packet: code, volume, duration so far (8 kHz ticks), end bit; its timestamp is
    /// the event's start.
    Event {
        code: u8,
        volume: u8,
        duration: u16,
        end: bool,
        start_ts: u32,
        marker: bool,
    },
}

/// The caller's packets, 20 ms apart: audio, '5' for 6 packets (3 of them end packets), audio,
/// '#' likewise, audio.
fn script() -> Vec<Send> {
    let mut s = vec![Send::Audio; 10];
    for (code, volume) in [(5u8, 10u8), (11, 7)] {
        let start_ts = s.len() as u32 * 160;
        for i in 0..6u16 {
            let end = i >= 3;
            // Durations 160, 320, 480, then the final 640 three times.
            let duration = 160 * (i.min(3) + 1);
            s.push(Send::Event { code, volume, duration, end, start_ts, marker: i == 0 });
        }
        s.extend([Send::Audio; 10]);
    }
    s
}

#[derive(Debug)]
struct Run {
    /// What the collector received, parsed, and the first as sent.
    reports: Vec<serde_json::Value>,
    first: String,
    /// Event packets and audio packets the callee received.
    callee_events: usize,
    callee_audio: usize,
    /// The caller's address as the relay sees it.
    caller: SocketAddr,
    /// The eBPF plane's kernel counters, read before the call is deleted (None elsewhere).
    kernel: Option<(u64, u64)>,
}

/// An RTP packet, with the marker bit if `marker`.
fn rtp(payload_type: u8, marker: bool, seq: u16, ts: u32, ssrc: u32, payload: &[u8]) -> Vec<u8> {
    let mut p = build_rtp(payload_type, seq, ts, ssrc, payload);
    p[1] |= u8::from(marker) << 7;
    p
}

fn run(relay: &str, tmp: &Path) -> Run {
    let tb = Testbed::star(2).expect("testbed");
    let collector_addr: SocketAddr = COLLECTOR.parse().unwrap();
    let collector = tb.udp_socket(&tb.sfu_ns, collector_addr).expect("collector socket");
    collector.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let setup = RelaySetup { dtmf_log_dest: Some(collector_addr), ..Default::default() };
    let mut relay_proc =
        RelayProc::start_binary(&tb, relay, tmp, Path::new(env!("CARGO_BIN_EXE_mediaplane")), &setup).unwrap_or_else(|e| panic!("starting {relay}: {e:#}"));
    let c = set_up_call(&tb, CALL, CALLER_TAG, CALLEE_TAG);
    let (mut callee_events, mut callee_audio) = (0, 0);
    let mut buf = [0u8; 2048];
    let mut read = |events: &mut usize, audio: &mut usize| {
        while let Ok((n, _)) = c.callee.recv_from(&mut buf) {
            match RtpHeader::parse(&buf[..n]).map(|h| h.payload_type) {
                Ok(EVENT) => *events += 1,
                Ok(PCMA) => *audio += 1,
                _ => {}
            }
        }
        while c.caller.recv_from(&mut buf).is_ok() {}
    };
    let start = Instant::now();
    for (i, p) in script().into_iter().enumerate() {
        std::thread::sleep((start + Duration::from_millis(20) * i as u32).saturating_duration_since(Instant::now()));
        let seq = i as u16;
        let packet = match p {
            Send::Audio => rtp(PCMA, false, seq, seq as u32 * 160, SSRC_CALLER, &[0xd5; 160]),
            Send::Event { code, volume, duration, end, start_ts, marker } => {
                let d = duration.to_be_bytes();
                rtp(EVENT, marker, seq, start_ts, SSRC_CALLER, &[code, volume | if end { 0x80 } else { 0 }, d[0], d[1]])
            }
        };
        c.caller.send_to(&packet, c.to_caller).unwrap();
        c.callee.send_to(&rtp(PCMA, false, seq, seq as u32 * 160, 0x2222_2222, &[0xd5; 160]), c.to_callee).unwrap();
        read(&mut callee_events, &mut callee_audio);
    }
    let (mut reports, mut first) = (Vec::new(), String::new());
    let until = Instant::now() + Duration::from_millis(600);
    while Instant::now() < until {
        read(&mut callee_events, &mut callee_audio);
        let mut report = [0u8; 2048];
        if let Ok((n, _)) = collector.recv_from(&mut report) {
            let text = String::from_utf8_lossy(&report[..n]).to_string();
            reports.push(serde_json::from_str(&text).unwrap_or_else(|e| panic!("[{relay}] not JSON ({e}): {text:?}")));
            if first.is_empty() {
                first = text;
            }
        }
    }
    let kernel = relay_proc.stats(&tb).ok().and_then(|s| Some((s["extra"].get("forwarded")?.as_u64()?, s["extra"].get("pass_dtmf")?.as_u64()?)));
    ng_in(&tb, delete(CALL, CALLER_TAG, CALLEE_TAG));
    relay_proc.stop().unwrap_or_else(|e| panic!("{e:#}"));
    Run { reports, first, callee_events, callee_audio, caller: SocketAddr::new(tb.peers[0].ip, 6000), kernel }
}

/// The keys of a flat JSON object's text, in order (a key is a string followed by a colon).
fn key_order(text: &str) -> Vec<&str> {
    let parts: Vec<&str> = text.split('"').collect();
    parts.windows(2).filter(|w| w[1].starts_with(':')).map(|w| w[0]).collect()
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

#[test]
fn dtmf_events_are_reported_as_by_rtpengine_on_every_plane() {
    if !sip::ready("dtmf_events_are_reported_as_by_rtpengine_on_every_plane", &["rtpengine"]) {
        return;
    }
    let tmp = common::TempDir::new("dtmf-log");
    let runs: Vec<(&str, Run)> =
        ["rtpengine", "mediaplane-userspace", "mediaplane-ebpf", "mediaplane-afxdp"].into_iter().map(|r| (r, run(r, &tmp.0))).collect();
    for (relay, r) in &runs {
        eprintln!("[{relay}] {r:?}");
    }
    let now = unix_now();
    for (relay, r) in &runs {
        assert_eq!(r.reports.len(), 2, "[{relay}] one report per event: {:?}", r.reports);
        for (report, (event, volume)) in r.reports.iter().zip([(5, 10), (11, 7)]) {
            let want = serde_json::json!({
                "callid": CALL,
                "source_tag": CALLER_TAG,
                "type": "DTMF",
                "source_ip": r.caller.ip().to_string(),
                "event": event,
                // 640 ticks at 8 kHz.
                "duration": 80,
                "volume": volume,
            });
            for (k, v) in want.as_object().unwrap() {
                assert_eq!(report.get(k), Some(v), "[{relay}] {k} of {report}");
            }
            let mut tags: Vec<&str> = report["tags"].as_array().unwrap().iter().filter_map(|t| t.as_str()).collect();
            tags.sort_unstable();
            assert_eq!(tags, [CALLEE_TAG, CALLER_TAG], "[{relay}] {report}");
            let ts = report["timestamp"].as_u64().unwrap_or_default();
            assert!(ts <= now && ts + 30 >= now, "[{relay}] timestamp {ts}, now {now}");
        }
        // The same keys as rtpengine's, no more, in its order (a collector may read it as text).
        assert_eq!(key_order(&r.first), key_order(&runs[0].1.first), "[{relay}] {}", r.first);
        assert_eq!(r.callee_events, 12, "[{relay}] every event packet reached the callee");
    }
    for (relay, r) in &runs[1..] {
        assert!(r.callee_audio >= 30, "[{relay}] the caller's audio: {r:?}");
    }
    let (forwarded, pass_dtmf) = runs[2].1.kernel.expect("the eBPF plane's counters");
    assert_eq!(pass_dtmf, 12, "the event packets went up, no more");
    assert!(forwarded >= 50, "the audio both ways stayed in the kernel: {forwarded}");
}
