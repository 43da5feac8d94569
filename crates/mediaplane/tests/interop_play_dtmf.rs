//! Interop, `play DTMF`: RFC 4733 events put into what the caller sends, asked of rtpengine 10.5
//! (the call offered and answered with `inject DTMF`, which it needs) and of `mediaplane serve`
//! on each data plane over NG, in a namespace testbed (caller and callee in namespaces of their
//! own).
//!
//! The caller sends A-law for 1.6 s; after 200 ms `play DTMF` asks for '5' (250 ms) and then
//! '#' (400 ms, volume 12). The callee must receive both events, in order, each once, with the
//! end bit and a final duration of at least what was asked (two packet times more at most), and
//! the caller's audio before, between and after; rtpengine is held to the same. mediaplane's
//! events also ride the caller's SSRC, with three end packets each and rtpengine's documented
//! default volume (rtpengine itself sends another SSRC, transcoding, and volume 63).
//!
//! Needs root and rtpengine; skipped otherwise, except under CI=true, where that is a failure.

mod common;
mod ng_common;

use mediaplane_bench::netns::Testbed;
use mediaplane_bench::sip;
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use mediaplane_harness::bench_relay::{RelayProc, RelaySetup};
use mediaplane_ng::bencode::Value;
use ng_common::*;
use std::path::Path;
use std::time::{Duration, Instant};

const CALL: &str = "play-dtmf-interop@interop_play_dtmf.test";
const CALLER_TAG: &str = "caller-tag";
const CALLEE_TAG: &str = "callee-tag";
const PACKETS: u16 = 80;
const SSRC_CALLER: u32 = 0x1111_1111;

/// One event as the callee saw it: (code, volume, the end packets' duration, how many
/// packets carried it, how many had the end bit).
type Event = (u8, u8, u16, usize, usize);

#[derive(Debug)]
struct Run {
    replies: Vec<String>,
    events: Vec<Event>,
    /// Audio packets the callee received before the first event, and in all.
    audio_before: usize,
    audio: usize,
    /// Every event packet carried the caller's SSRC.
    caller_ssrc: bool,
}

fn run(relay: &str, tmp: &Path) -> Run {
    let tb = Testbed::star(2).expect("testbed");
    let mut relay_proc = RelayProc::start_binary(&tb, relay, tmp, Path::new(env!("CARGO_BIN_EXE_mediaplane")), &RelaySetup::default())
        .unwrap_or_else(|e| panic!("starting {relay}: {e:#}"));
    let c = set_up_call_with(&tb, CALL, CALLER_TAG, CALLEE_TAG, &["inject DTMF"]);
    let play = |code: &str, duration: i64, volume: Option<i64>| {
        let mut req = vec![("command", Value::str("play DTMF")), ("call-id", Value::str(CALL)), ("from-tag", Value::str(CALLER_TAG))];
        req.extend([("code", Value::str(code)), ("duration", Value::Int(duration))]);
        req.extend(volume.map(|v| ("volume", Value::Int(v))));
        outcome(&ng_in(&tb, req))
    };
    let mut received: Vec<Vec<u8>> = Vec::new();
    let mut buf = [0u8; 2048];
    let mut read = |received: &mut Vec<Vec<u8>>| {
        while let Ok((n, _)) = c.callee.recv_from(&mut buf) {
            received.push(buf[..n].to_vec());
        }
    };
    let mut replies = Vec::new();
    let start = Instant::now();
    for seq in 0..PACKETS {
        std::thread::sleep((start + Duration::from_millis(20) * seq as u32).saturating_duration_since(Instant::now()));
        if seq == 10 {
            replies.push(play("5", 250, None));
            replies.push(play("#", 400, Some(12)));
        }
        c.caller.send_to(&build_rtp(8, seq, seq as u32 * 160, SSRC_CALLER, &[0xd5; 160]), c.to_caller).unwrap();
        read(&mut received);
    }
    std::thread::sleep(Duration::from_millis(200));
    read(&mut received);
    ng_in(&tb, delete(CALL, CALLER_TAG, CALLEE_TAG));
    relay_proc.stop().unwrap_or_else(|e| panic!("{e:#}"));

    let mut events: Vec<(u32, Event)> = Vec::new();
    let (mut audio, mut audio_before, mut caller_ssrc) = (0, 0, true);
    for p in &received {
        let Ok(h) = RtpHeader::parse(p) else { continue };
        let payload = &p[h.payload_offset..h.payload_offset + h.payload_len];
        match h.payload_type {
            8 => {
                audio += 1;
                audio_before += usize::from(events.is_empty());
            }
            101 if payload.len() >= 4 => {
                caller_ssrc &= h.ssrc == SSRC_CALLER;
                let end = payload[1] & 0x80 != 0;
                let duration = u16::from_be_bytes([payload[2], payload[3]]);
                match events.last_mut().filter(|(ts, _)| *ts == h.timestamp) {
                    Some((_, e)) => {
                        e.3 += 1;
                        e.4 += usize::from(end);
                        if end {
                            e.2 = duration;
                        }
                    }
                    None => events.push((h.timestamp, (payload[0], payload[1] & 0x3f, if end { duration } else { 0 }, 1, usize::from(end)))),
                }
            }
            _ => {}
        }
    }
    Run { replies, events: events.into_iter().map(|(_, e)| e).collect(), audio_before, audio, caller_ssrc }
}

#[test]
fn play_dtmf_reaches_the_callee_as_with_rtpengine_on_both_planes() {
    if !sip::ready("play_dtmf_reaches_the_callee_as_with_rtpengine_on_both_planes", &["rtpengine"]) {
        return;
    }
    let tmp = common::TempDir::new("play-dtmf");
    let runs: Vec<(&str, Run)> = ["rtpengine", "mediaplane-userspace", "mediaplane-ebpf"].into_iter().map(|r| (r, run(r, &tmp.0))).collect();
    for (relay, r) in &runs {
        eprintln!("[{relay}] {r:?}");
    }
    for (relay, r) in &runs {
        assert_eq!(r.replies, ["ok", "ok"], "[{relay}]");
        // '5' for 250 ms at 8 kHz (2000), '#' (11) for 400 ms (3200) at volume 12: at least
        // that long, at most two packet times more (rtpengine's ends were 240 and 160 over,
        // mediaplane's, whole packets of the caller's, 80 and 0).
        let asked = [(5u8, 2000u16), (11, 3200)];
        assert_eq!(r.events.len(), 2, "[{relay}] two events: {:?}", r.events);
        for ((code, _, duration, packets, ends), (want_code, want_duration)) in r.events.iter().zip(asked) {
            assert_eq!(*code, want_code, "[{relay}]");
            assert!(*ends >= 1 && *packets > *ends, "[{relay}] event {code}: {packets} packets, {ends} with the end bit");
            assert!((want_duration..=want_duration + 320).contains(duration), "[{relay}] event {code}: duration {duration}, asked {want_duration}");
        }
        assert_eq!(r.events[1].1, 12, "[{relay}] the volume asked for");
        assert!(r.audio_before >= 9 && r.audio > r.audio_before + 20, "[{relay}] the caller's audio before and after: {r:?}");
    }
    for (relay, r) in &runs[1..] {
        // rtpengine 10.5 sends 63 (-63 dB) when no volume is given, not its documented -8 dB.
        assert_eq!(r.events[0].1, 8, "[{relay}] the documented default volume, -8 dB");
        assert!(r.caller_ssrc, "[{relay}] the events ride the caller's SSRC (rtpengine's, transcoding, another)");
        assert_eq!(r.events.iter().map(|e| e.4).collect::<Vec<_>>(), [3, 3], "[{relay}] three end packets each");
    }
}
