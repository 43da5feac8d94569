//! A late joiner in a video room gets a keyframe because it asked: a real VP8 encoder
//! (GStreamer's `vp8enc`, no periodic keyframes, behind `rtpbin`, whose RTP session turns a PLI
//! for its SSRC into a keyframe request upstream) publishes through `mediaplane serve`; two
//! subscribers watch from the start; a third subscribes mid-call. The three then ask for a
//! keyframe within a few milliseconds (RR + PLI to their own SFU address, as a browser or
//! `rtpbin` sends them).
//!
//! Held on the user-space and the eBPF plane:
//! - the publisher receives exactly one PLI (three coalesced into one), naming its SSRC;
//! - the late joiner's first keyframe arrives within 500 ms of its PLI, and the stream from there
//!   on has no gap; decoded by GStreamer (`rtpvp8depay ! vp8dec`), every frame from that keyframe
//!   on decodes;
//! - the encoder made exactly two keyframes: its first and the requested one (so the late
//!   joiner's keyframe is the one its PLI caused, not a periodic one);
//! - the SFU's counters: one routed, two coalesced, three receiver reports consumed, split per
//!   consumer.
//!
//! The publisher's RTP session listens on loopback inside its namespace; the test's socket at
//! the publisher's address carries its RTP to the SFU and the SFU's RTCP back to it (GStreamer's
//! `gst-launch` cannot send and receive on one socket, which symmetric RTP needs).
//! MP_KEEP_TMP=1 keeps GStreamer's logs.

mod common;

use common::netns::NetnsServe;
use common::video::{decode, is_pli, vp8_keyframe_start};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::sip;
use mediaplane_core::call_quality::build_report;
use mediaplane_core::feedback::build;
use mediaplane_core::rtp::RtpHeader;
use serde_json::{json, Value};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SFU_PORT: u16 = 40000;
const MEDIA_PORT: u16 = 5004;
const SSRC: u32 = 0x1000;
/// The publisher's pipeline: RTP out to ENC_OUT, RTCP in on RTCP_IN (loopback, its namespace).
const ENC_OUT: u16 = 47010;
const RTCP_IN: u16 = 47011;
/// The replay of what the late joiner received into a decoder (loopback, the test's namespace).
const DEC_IN: u16 = 47020;
/// Subscribers' receiver SSRCs.
const RECEIVER: [u32; 4] = [0, 0xa1, 0xa2, 0xa3];
const KEYFRAME_DEADLINE: Duration = Duration::from_millis(500);

type Log = Arc<Mutex<Vec<(Instant, Vec<u8>)>>>;

/// Receive on `sock` into `log` until `stop`; with `forward`, send each datagram on.
fn collect(sock: UdpSocket, log: Log, stop: Arc<AtomicBool>, forward: Option<(UdpSocket, SocketAddr)>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        sock.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut buf = vec![0u8; 2048];
        while !stop.load(Ordering::Relaxed) {
            if let Ok(n) = sock.recv(&mut buf) {
                log.lock().unwrap().push((Instant::now(), buf[..n].to_vec()));
                if let Some((out, to)) = &forward {
                    let _ = out.send_to(&buf[..n], *to);
                }
            }
        }
    })
}

fn publisher_pipeline(tb: &Testbed, ns: &str, log: &std::path::Path) -> mediaplane_bench::process::Supervised {
    let mut cmd = tb.command(ns, "gst-launch-1.0");
    let pipeline = format!(
        "rtpbin name=rb \
         videotestsrc is-live=true pattern=ball ! video/x-raw,width=320,height=240,framerate=30/1 \
         ! vp8enc deadline=1 keyframe-max-dist=100000 ! rtpvp8pay ssrc={SSRC} pt=96 picture-id-mode=15-bit ! rb.send_rtp_sink_0 \
         rb.send_rtp_src_0 ! udpsink host=127.0.0.1 port={ENC_OUT} sync=false async=false \
         udpsrc address=127.0.0.1 port={RTCP_IN} caps=application/x-rtcp ! rb.recv_rtcp_sink_0 \
         rb.send_rtcp_src_0 ! fakesink sync=false async=false"
    );
    cmd.args(pipeline.split_whitespace()).stdout(Stdio::null()).stderr(std::fs::File::create(log).unwrap());
    let mut gst = sip::spawn_group("gst-launch-1.0", &mut cmd).unwrap_or_else(|e| panic!("{e}"));
    sip::wait_udp_bound(&mut gst, RTCP_IN, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e}\n{}", sip::log_tail(log, 20)));
    gst
}

fn run_plane(tb: &Testbed, plane: &str, dir: &std::path::Path) {
    let serve = NetnsServe::start(tb, plane, &dir.join(format!("{plane}.db")), &["--reset"]);
    serve.api("POST", "/v1/rooms", Some(json!({"id": "v"})));
    for (i, p) in tb.peers.iter().enumerate() {
        let body = json!({"id": format!("p{i}"), "local": SocketAddr::new(p.sfu_ip, SFU_PORT), "remote": SocketAddr::new(p.ip, MEDIA_PORT)});
        serve.api("POST", "/v1/rooms/v/participants", Some(body));
    }
    serve.api("POST", "/v1/rooms/v/participants/p0/streams", Some(json!({"name": "cam", "ssrc": SSRC, "clock_rate": 90000})));
    let subscribe =
        |who: usize| serve.api("POST", &format!("/v1/rooms/v/participants/p{who}/subscriptions"), Some(json!({"publisher": "p0", "stream": "cam"})));
    subscribe(1);
    subscribe(2);

    let sfu = |i: usize| SocketAddr::new(tb.peers[i].sfu_ip, SFU_PORT);
    let socks: Vec<UdpSocket> = tb.peers.iter().map(|p| tb.udp_socket(&p.ns, SocketAddr::new(p.ip, MEDIA_PORT)).unwrap()).collect();
    for (i, s) in socks.iter().enumerate() {
        s.send_to(b"", SocketAddr::new(tb.peers[i].sfu_ip, 9)).unwrap(); // neighbour entries
    }
    let stop = Arc::new(AtomicBool::new(false));
    let logs: Vec<Log> = (0..4).map(|_| Log::default()).collect();
    let mut threads = Vec::new();
    // The publisher's side: its RTP to the SFU from its address, the SFU's RTCP to its session.
    let p0 = &tb.peers[0].ns;
    let enc_out = tb.udp_socket(p0, SocketAddr::from((Ipv4Addr::LOCALHOST, ENC_OUT))).unwrap();
    let rtcp_out = tb.udp_socket(p0, SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
    let rtp_log = Log::default();
    threads.push(collect(enc_out, rtp_log.clone(), stop.clone(), Some((socks[0].try_clone().unwrap(), sfu(0)))));
    threads.push(collect(socks[0].try_clone().unwrap(), logs[0].clone(), stop.clone(), Some((rtcp_out, SocketAddr::from((Ipv4Addr::LOCALHOST, RTCP_IN))))));
    for i in 1..4 {
        threads.push(collect(socks[i].try_clone().unwrap(), logs[i].clone(), stop.clone(), None));
    }
    let gst = publisher_pipeline(tb, p0, &dir.join(format!("publisher-{plane}.log")));

    // Mid-call: p3 joins; then all three ask for a keyframe within a few milliseconds.
    std::thread::sleep(Duration::from_millis(2000));
    subscribe(3);
    std::thread::sleep(Duration::from_millis(100));
    let mut asked = None;
    for who in [3, 1, 2] {
        let packet = [build_report(RECEIVER[who], None, &[]), build::pli(RECEIVER[who], SSRC)].concat();
        socks[who].send_to(&packet, sfu(who)).unwrap();
        asked.get_or_insert(Instant::now());
    }
    let asked = asked.unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    drop(gst);
    stop.store(true, Ordering::Relaxed);
    threads.into_iter().for_each(|t| t.join().unwrap());

    let plis: Vec<(Instant, Vec<u8>)> = logs[0].lock().unwrap().iter().filter(|(_, p)| is_pli(p)).cloned().collect();
    assert_eq!(plis.len(), 1, "[{plane}] one PLI reached the publisher (three coalesced)");
    assert_eq!(plis[0].1[8 + 8..8 + 12], SSRC.to_be_bytes(), "[{plane}] naming its SSRC");

    let sent = rtp_log.lock().unwrap().clone();
    let keyframes_sent: std::collections::BTreeSet<u32> =
        sent.iter().filter(|(_, p)| vp8_keyframe_start(p)).map(|(_, p)| RtpHeader::parse(p).unwrap().timestamp).collect();
    assert_eq!(keyframes_sent.len(), 2, "[{plane}] the encoder's first keyframe and the requested one: {keyframes_sent:?}");

    let late = logs[3].lock().unwrap().clone();
    let first_key = late.iter().position(|(_, p)| vp8_keyframe_start(p)).unwrap_or_else(|| panic!("[{plane}] p3 got no keyframe in {} packets", late.len()));
    let waited = late[first_key].0.duration_since(asked);
    assert!(waited <= KEYFRAME_DEADLINE, "[{plane}] p3's keyframe came {waited:?} after its PLI");
    let from_key: Vec<Vec<u8>> = late[first_key..].iter().map(|(_, p)| p.clone()).collect();
    let seqs: Vec<u16> = from_key.iter().map(|p| RtpHeader::parse(p).unwrap().sequence).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0].wrapping_add(1)), "[{plane}] p3's stream from its keyframe has no gap: {seqs:?}");
    let frames: std::collections::BTreeSet<u32> = from_key.iter().map(|p| RtpHeader::parse(p).unwrap().timestamp).collect();
    let (decoded, log) = decode(&from_key, DEC_IN, dir, plane);
    // Every frame that arrived whole; the last may still be waiting for the next to be pushed.
    assert!(decoded + 1 >= frames.len() && decoded >= 20, "[{plane}] decoded {decoded} of {} frames\n{log}", frames.len());
    assert!(!log.contains("ERROR") && !log.to_lowercase().contains("failed to decode"), "[{plane}] {log}");
    eprintln!("[{plane}] late joiner: keyframe {waited:?} after its PLI, {decoded} of {} frames decoded from it", frames.len());

    let stats = serve.api("GET", "/v1/stats", None);
    let t = &stats["total"];
    let counts = |c: &Value| ["feedback_routed", "feedback_coalesced", "feedback_consumed"].map(|k| c[k].as_u64().unwrap_or(0));
    assert_eq!(counts(t), [1, 2, 3], "[{plane}] {t}");
    let consumers = serve.api("GET", "/v1/rooms/v/consumers", None)["consumers"].as_array().unwrap().clone();
    let sum = |k: &str| consumers.iter().map(|c| c[k].as_u64().unwrap()).sum::<u64>();
    assert_eq!((consumers.len(), sum("feedback_routed"), sum("feedback_coalesced")), (3, 1, 2), "[{plane}] {consumers:?}");
}

#[test]
fn a_late_joiners_pli_brings_a_keyframe_from_a_real_encoder() {
    if !mediaplane_bench::require_root("interop_video_pli") || !sip::ready("interop_video_pli", &["gst-launch-1.0"]) {
        return;
    }
    let tmp = common::TempDir::new("video-pli");
    let tb = Testbed::star(4).unwrap();
    for plane in ["userspace", "ebpf"] {
        run_plane(&tb, plane, &tmp.0);
    }
}
