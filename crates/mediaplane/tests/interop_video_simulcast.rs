//! A video conference of real GStreamer peers through `mediaplane serve`, on the user-space and
//! the eBPF plane (issue 14's acceptance). Six participants in namespaces:
//!
//! * p0, p1 and p2 publish one camera each as three VP8 simulcast layers (128x72 at 100 kbit/s,
//!   256x144 at 300, 512x288 at 800; `vp8enc` behind one `rtpbin` with a session per layer,
//!   keyframes only when a PLI asks, as browsers do);
//! * everyone watches every publisher but itself (15 consumers), each through a GStreamer
//!   receiver (`rtpbin` in AVPF, `rtpvp8depay ! vp8dec`) that sends its own receiver reports and
//!   feedback;
//! * p4's link loses 5 % of its RTP for the whole run, p5's 20 % for the first 8 s; every
//!   receiver NACKs and asks for keyframes after a loss. This
//!   kernel has no `sch_netem`, so the loss is the test's: the bridge at the participant's
//!   address drops the packets, seeded, before its receivers see them.
//!
//! The run, in seconds from the publishers' start: from 3 to 7 p1 withholds its top layer (as a
//! browser does under congestion); at 4 p3's consumer of p0 gets `max_layer` 0, at 8 none again;
//! at 6 p3 joins p2 mid-call; at 8 p5's loss ends; from 13 on, the run waits for a report of
//! each of p5's receivers made after that. Held:
//! - the late joiner's first keyframe arrives within 500 ms of its subscription, after a PLI
//!   reached the publisher: the SFU's own, or one it was coalesced with (p4's and p5's requests
//!   keep that publisher's interval busy: the SFU's own request for a waiting consumer goes
//!   once the last keyframe passed);
//! - every consumer on a clean link (p0 to p3) receives one stream with no gap and no duplicate
//!   in its numbering from its first keyframe on, through its switches (by hand: down to layer
//!   0 and back; automatic: to layer 1 while the top layer is away, and back), told apart by the
//!   picture size its keyframes announce; at least 99 % of the frames its publisher sent in
//!   that time (but for those sent while the SFU notices a layer is gone); and GStreamer decodes
//!   at least 99 % of them;
//! - the publishers receive p4's NACKs, each naming a packet they sent on the layer it names;
//! - what p5's receivers report lost is within 1.5 percentage points of what their link lost (the
//!   gaps in what the bridge passed them), and each report of more than 10 % GStreamer sent
//!   stepped its consumer down (at least one such report must come, of p5's three consumers).
//!   GStreamer 1.22 sends no report blocks in the early feedback packets that carry its NACKs,
//!   so under loss its reports are rare: the SFU judges its NACKs as its loss instead
//!   (`layer_choice`): p5's are judged, and its consumers step down (p4's
//!   NACKs, the 5 % link's, are printed against what its link lost); what the SFU measured of
//!   them as forwarded passed on no loss (the publishers' links are clean) and no duplicate.
//!
//! GStreamer's `gst-launch` cannot send and receive on one socket (symmetric RTP): its pipelines
//! use loopback ports inside each participant's namespace, and the test's bridge at the
//! participant's address carries their packets to and from the SFU and logs them.
//! The SFU's own answers to NACKs are off here (`dataplane.retransmit = false`): they would hide
//! the loss this test holds the SFU's reactions to. MP_KEEP_TMP=1 keeps GStreamer's logs.

// Indices are participants' numbers (p0, p1, ...), which the bridges and pipelines share.
#![allow(clippy::needless_range_loop)]

mod common;

use common::netns::NetnsServe;
use common::video::{decode, is_pli, vp8_keyframe_size, vp8_keyframe_start};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::process::Supervised;
use mediaplane_bench::sip;
use mediaplane_core::rtp::{parse_rtcp_compound, RtpHeader};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const SFU_PORT: u16 = 40000;
const MEDIA_PORT: u16 = 5004;
/// On loopback in each participant's namespace: where its pipelines send RTP and RTCP (the
/// bridge carries it to the SFU), where a publisher's three sessions take RTCP (+ layer), where
/// its receivers take RTP and RTCP (+ publisher). Below the kernel's ephemeral range (32768 on):
/// the bridge's and GStreamer's own sockets bind port 0 in the same namespaces, and one once got
/// 47032, which a receiver then could not bind (a CI run failed so).
const GST_OUT: u16 = 27010;
const PUB_RTCP_IN: u16 = 27011;
const SUB_RTP_IN: u16 = 27020;
const SUB_RTCP_IN: u16 = 27030;
/// The test's own decoder, in its namespace.
const DECODE_PORT: u16 = 27050;

const PUBLISHERS: usize = 3;
const PARTICIPANTS: usize = 6;
/// The layers' picture sizes and bitrates, lowest first.
const SIZES: [(u16, u16); 3] = [(128, 72), (256, 144), (512, 288)];
const BITRATES: [u32; 3] = [100_000, 300_000, 800_000];

const EXPLICIT_DOWN_MS: u64 = 4_000;
const LATE_JOIN_MS: u64 = 6_000;
const EXPLICIT_UP_MS: u64 = 8_000;
/// p1 stops sending its top layer (a browser does under congestion) from the first to the second.
const WITHHELD_MS: (u64, u64) = (3_000, 7_000);
const WITHHOLDING: usize = 1;
/// p5's loss ends then.
const LOSS_ENDS_MS: u64 = 8_000;
/// The shortest run.
const RUN_MS: u64 = 13_000;
/// A report from each of p5's receivers after its loss ended comes by then.
const REPORT_DEADLINE: Duration = Duration::from_secs(30);
/// Frames the absent layer's consumers miss: until the SFU sees it absent and the lower layer's
/// keyframe comes (mediaplane_core::layer_choice::ABSENT_AFTER_NS and the way of a keyframe).
const ABSENCE_NOTICED: Duration = Duration::from_millis(1_500);
/// The participant who joins mid-call, the publisher it joins, and the one switched by hand.
const LATE: (usize, usize) = (3, 2);
const SWITCHED: (usize, usize) = (3, 0);
const NACKING: usize = 4;
const REPORTING: usize = 5;
const LOSS: [f64; PARTICIPANTS] = [0.0, 0.0, 0.0, 0.0, 0.05, 0.20];
const KEYFRAME_DEADLINE: Duration = Duration::from_millis(500);
/// The SFU's keyframe-request coalescing interval.
const COALESCING: Duration = Duration::from_nanos(mediaplane_core::feedback::KEYFRAME_REQUEST_INTERVAL_NS);

fn layer_ssrc(publisher: usize, layer: usize) -> u32 {
    0x1000 * (publisher as u32 + 1) + layer as u32
}

/// A consumer receives every layer on the lowest layer's SSRC: which publisher an SSRC at a
/// subscriber is.
fn publisher_of(ssrc: u32) -> Option<usize> {
    (0..PUBLISHERS).find(|p| layer_ssrc(*p, 0) == ssrc)
}

fn is_rtcp(packet: &[u8]) -> bool {
    packet.get(1).is_some_and(|pt| (200..=206).contains(pt))
}

type Log = Arc<Mutex<Vec<(Instant, Vec<u8>)>>>;

/// What passed a participant's address: from the SFU (after the link's loss) and to it, and the
/// RTP the link lost.
#[derive(Default, Clone)]
struct Bridge {
    inbound: Log,
    outbound: Log,
    lost: Log,
}

/// The RTP of `ssrc` in `log`.
fn rtp(log: &Log, ssrc: u32) -> Vec<(Instant, Vec<u8>)> {
    let log = log.lock().unwrap();
    log.iter().filter(|(_, p)| !is_rtcp(p) && RtpHeader::parse(p).is_ok_and(|h| h.ssrc == ssrc)).cloned().collect()
}

impl Bridge {
    fn rtp_in(&self, ssrc: u32) -> Vec<(Instant, Vec<u8>)> {
        rtp(&self.inbound, ssrc)
    }
    fn rtp_out(&self, ssrc: u32) -> Vec<(Instant, Vec<u8>)> {
        rtp(&self.outbound, ssrc)
    }
}

/// The bridge at participant `i`'s media address: RTP from the SFU to its receiver for that
/// publisher (losing `LOSS[i]` of it while `lossy`), a consumer's sender reports to that
/// receiver, other RTCP (feedback about its layers) to a publisher's sessions; what its
/// pipelines send, to the SFU, but for its top layer while `withhold` (logged all the same).
fn bridge(tb: &Testbed, i: usize, lossy: Arc<AtomicBool>, withhold: Arc<AtomicBool>, stop: Arc<AtomicBool>) -> (Bridge, Vec<JoinHandle<()>>) {
    let peer = &tb.peers[i];
    let sfu = SocketAddr::new(peer.sfu_ip, SFU_PORT);
    let media = tb.udp_socket(&peer.ns, SocketAddr::new(peer.ip, MEDIA_PORT)).unwrap();
    let big: libc::c_int = 8 << 20;
    // SAFETY: setsockopt on an open socket with a valid int.
    let rc = unsafe {
        libc::setsockopt(media.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF, (&big as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>() as u32)
    };
    assert_eq!(rc, 0, "SO_RCVBUF");
    media.send_to(b"", SocketAddr::new(peer.sfu_ip, 9)).unwrap(); // a neighbour entry
    let gst_out = tb.udp_socket(&peer.ns, SocketAddr::from((Ipv4Addr::LOCALHOST, GST_OUT))).unwrap();
    let to_gst = tb.udp_socket(&peer.ns, SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
    let b = Bridge::default();
    let publisher = i < PUBLISHERS;
    let local = |port: u16| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let (from_sfu, to_sfu) = (media.try_clone().unwrap(), media);
    let (log, lost, halt) = (b.inbound.clone(), b.lost.clone(), stop.clone());
    let inbound = std::thread::spawn(move || {
        from_sfu.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ i as u64;
        let mut buf = vec![0u8; 2048];
        while !halt.load(Ordering::Relaxed) {
            let Ok(n) = from_sfu.recv(&mut buf) else { continue };
            let (now, p) = (Instant::now(), buf[..n].to_vec());
            if !is_rtcp(&p) {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                if lossy.load(Ordering::Relaxed) && (rng >> 11) as f64 / (1u64 << 53) as f64 <= LOSS[i] {
                    lost.lock().unwrap().push((now, p));
                    continue;
                }
                if let Some(k) = RtpHeader::parse(&p).ok().and_then(|h| publisher_of(h.ssrc)) {
                    let _ = to_gst.send_to(&p, local(SUB_RTP_IN + k as u16));
                }
            } else {
                let first = parse_rtcp_compound(&p).ok().and_then(|ps| ps.first().map(|f| (f.packet_type, f.sender_ssrc)));
                match first {
                    Some((200, ssrc)) if publisher_of(ssrc).is_some() => {
                        let _ = to_gst.send_to(&p, local(SUB_RTCP_IN + publisher_of(ssrc).unwrap() as u16));
                    }
                    _ if publisher => (0..3).for_each(|l| drop(to_gst.send_to(&p, local(PUB_RTCP_IN + l)))),
                    _ => {}
                }
            }
            log.lock().unwrap().push((now, p));
        }
    });
    let (log, halt) = (b.outbound.clone(), stop);
    let outbound = std::thread::spawn(move || {
        gst_out.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut buf = vec![0u8; 2048];
        while !halt.load(Ordering::Relaxed) {
            if let Ok(n) = gst_out.recv(&mut buf) {
                let p = buf[..n].to_vec();
                let top = publisher && !is_rtcp(&p) && RtpHeader::parse(&p).is_ok_and(|h| h.ssrc == layer_ssrc(i, 2));
                if !(top && withhold.load(Ordering::Relaxed)) {
                    let _ = to_sfu.send_to(&p, sfu);
                }
                log.lock().unwrap().push((Instant::now(), p));
            }
        }
    });
    (b, vec![inbound, outbound])
}

fn launch(tb: &Testbed, ns: &str, pipeline: &str, log: &Path, last_port: u16) -> Supervised {
    let mut cmd = tb.command(ns, "gst-launch-1.0");
    cmd.args(pipeline.split_whitespace()).stdout(Stdio::null()).stderr(std::fs::File::create(log).unwrap());
    let mut gst = sip::spawn_group("gst-launch-1.0", &mut cmd).unwrap_or_else(|e| panic!("{e}"));
    sip::wait_udp_bound(&mut gst, last_port, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e}\n{}", sip::log_tail(log, 20)));
    gst
}

/// Publisher `p`: one camera, three encoders, one RTP session per layer; RTP and RTCP out to the
/// bridge, RTCP in per session.
fn publisher(tb: &Testbed, p: usize, log: &Path) -> Supervised {
    let (w, h) = SIZES[2];
    let mut pipeline = format!(
        "rtpbin name=rb rtp-profile=avpf videotestsrc is-live=true pattern=ball \
         ! video/x-raw,width={w},height={h},framerate=30/1 ! tee name=cam"
    );
    for (l, (w, h)) in SIZES.iter().enumerate() {
        pipeline += &format!(
            " cam. ! queue ! videoscale ! video/x-raw,width={w},height={h} \
             ! vp8enc deadline=1 cpu-used=16 threads=1 target-bitrate={} keyframe-max-dist=100000 \
             ! rtpvp8pay ssrc={} pt=96 picture-id-mode=15-bit ! rb.send_rtp_sink_{l} \
             rb.send_rtp_src_{l} ! udpsink host=127.0.0.1 port={GST_OUT} sync=false async=false \
             rb.send_rtcp_src_{l} ! udpsink host=127.0.0.1 port={GST_OUT} sync=false async=false \
             udpsrc address=127.0.0.1 port={} caps=application/x-rtcp ! rb.recv_rtcp_sink_{l}",
            BITRATES[l],
            layer_ssrc(p, l),
            PUB_RTCP_IN + l as u16
        );
    }
    launch(tb, &tb.peers[p].ns, &pipeline, log, PUB_RTCP_IN + 2)
}

/// Participant `i`'s receivers, one `rtpbin` per publisher it watches (or will): the jitter
/// buffer NACKs and the depayloader asks for keyframes after a loss, as browsers do.
fn receivers(tb: &Testbed, i: usize, log: &Path) -> Supervised {
    let mut pipeline = String::new();
    for k in (0..PUBLISHERS).filter(|k| *k != i) {
        pipeline += &format!(
            " rtpbin name=rb{k} rtp-profile=avpf do-retransmission=true latency=200 \
             udpsrc address=127.0.0.1 port={} buffer-size=8388608 \
             caps=application/x-rtp,media=video,encoding-name=VP8,clock-rate=90000,payload=96,rtcp-fb-nack=(boolean)true,rtcp-fb-nack-pli=(boolean)true \
             ! rb{k}.recv_rtp_sink_0 \
             udpsrc address=127.0.0.1 port={} caps=application/x-rtcp ! rb{k}.recv_rtcp_sink_0 \
             rb{k}. ! rtpvp8depay request-keyframe=true wait-for-keyframe=true ! vp8dec max-errors=-1 ! fakesink sync=false \
             rb{k}.send_rtcp_src_0 ! udpsink host=127.0.0.1 port={GST_OUT} sync=false async=false",
            SUB_RTP_IN + k as u16,
            SUB_RTCP_IN + k as u16
        );
    }
    let last = (0..PUBLISHERS).rev().find(|k| *k != i).unwrap();
    launch(tb, &tb.peers[i].ns, &pipeline, log, SUB_RTCP_IN + last as u16)
}

/// The picture sizes of the keyframes in `packets`, consecutive repeats folded.
fn sizes(packets: &[(Instant, Vec<u8>)]) -> Vec<(u16, u16)> {
    let mut out: Vec<(u16, u16)> = Vec::new();
    for s in packets.iter().filter_map(|(_, p)| vp8_keyframe_size(p)) {
        if out.last() != Some(&s) {
            out.push(s);
        }
    }
    out
}

/// Checks one consumer's stream from its first keyframe at or after `from` on: no gap, no
/// duplicate; the frames it got against those its publisher sent meanwhile (on its top layer:
/// every layer has every frame), but for those `excused`; what GStreamer decodes of them.
/// Returns the folded keyframe sizes.
fn check_stream(
    what: &str,
    got: &[(Instant, Vec<u8>)],
    from: Instant,
    sent: &[(Instant, Vec<u8>)],
    excused: Option<(Instant, Instant)>,
    dir: &Path,
) -> Vec<(u16, u16)> {
    let start = got.iter().position(|(t, p)| *t >= from && vp8_keyframe_start(p)).unwrap_or_else(|| panic!("{what}: no keyframe in {} packets", got.len()));
    let got = &got[start..];
    let seqs: Vec<u16> = got.iter().map(|(_, p)| RtpHeader::parse(p).unwrap().sequence).collect();
    let breaks: Vec<(u16, u16)> = seqs.windows(2).filter(|w| w[1] != w[0].wrapping_add(1)).map(|w| (w[0], w[1])).collect();
    assert!(breaks.is_empty(), "{what}: gaps or duplicates in its numbering (from, to): {breaks:?}");
    let frames: BTreeSet<u32> = got.iter().map(|(_, p)| RtpHeader::parse(p).unwrap().timestamp).collect();
    let (first, last) = (got[0].0, got.last().unwrap().0);
    // The SFU's hop takes well under 20 ms here.
    let lead = Duration::from_millis(20);
    let counted = |t: Instant| t + lead >= first && t + lead <= last && !excused.is_some_and(|(a, b)| t >= a && t < b);
    let sent_frames: BTreeSet<u32> = sent.iter().filter(|(t, _)| counted(*t)).map(|(_, p)| RtpHeader::parse(p).unwrap().timestamp).collect();
    assert!(
        frames.len() as f64 >= 0.99 * sent_frames.len() as f64 - 2.0,
        "{what}: received {} frames, its publisher sent {} meanwhile",
        frames.len(),
        sent_frames.len()
    );
    let packets: Vec<Vec<u8>> = got.iter().map(|(_, p)| p.clone()).collect();
    let (decoded, log) = decode(&packets, DECODE_PORT, dir, &what.replace(['/', ' ', '<'], "_"));
    assert!(decoded as f64 >= 0.99 * frames.len() as f64 - 1.0, "{what}: decoded {decoded} of {} frames\n{log}", frames.len());
    eprintln!("{what}: {} packets, {} frames ({} sent), {decoded} decoded, sizes {:?}", got.len(), frames.len(), sent_frames.len(), sizes(got));
    sizes(got)
}

fn consumer(consumers: &[Value], subscriber: usize, publisher: usize) -> &Value {
    let (s, p) = (format!("p{subscriber}"), format!("p{publisher}"));
    consumers.iter().find(|c| c["subscriber"] == s.as_str() && c["publisher"] == p.as_str()).unwrap_or_else(|| panic!("no consumer {s}<-{p}"))
}

fn run_plane(tb: &Testbed, plane: &str, dir: &Path) {
    // The SFU's own answers to NACKs (`dataplane.retransmit`) off: this test holds what the
    // consumers' loss does (their reports and NACKs step them down, their NACKs reach the
    // publishers), which copies sent again would hide. interop_webrtc_nack and sfu_feedback
    // hold the answers.
    let config = dir.join(format!("{plane}.toml"));
    std::fs::write(&config, "[dataplane]\nretransmit = false\n").unwrap();
    let serve = NetnsServe::start(tb, plane, &dir.join(format!("{plane}.db")), &["--reset", "-c", config.to_str().unwrap()]);
    serve.api("POST", "/v1/rooms", Some(json!({"id": "v"})));
    for (i, p) in tb.peers.iter().enumerate() {
        let body = json!({"id": format!("p{i}"), "local": SocketAddr::new(p.sfu_ip, SFU_PORT), "remote": SocketAddr::new(p.ip, MEDIA_PORT)});
        serve.api("POST", "/v1/rooms/v/participants", Some(body));
    }
    for p in 0..PUBLISHERS {
        let layers: Vec<u32> = (0..3).map(|l| layer_ssrc(p, l)).collect();
        serve.api(
            "POST",
            &format!("/v1/rooms/v/participants/p{p}/streams"),
            Some(json!({"name": "cam", "layers": layers, "codec": "vp8", "clock_rate": 90000})),
        );
    }
    let subscribe = |who: usize, to: usize| {
        serve.api("POST", &format!("/v1/rooms/v/participants/p{who}/subscriptions"), Some(json!({"publisher": format!("p{to}"), "stream": "cam"})));
    };
    for who in 0..PARTICIPANTS {
        for to in (0..PUBLISHERS).filter(|to| *to != who && (who, *to) != LATE) {
            subscribe(who, to);
        }
    }

    let stop = Arc::new(AtomicBool::new(false));
    let lossy: Vec<Arc<AtomicBool>> = LOSS.iter().map(|l| Arc::new(AtomicBool::new(*l > 0.0))).collect();
    let withhold: Vec<Arc<AtomicBool>> = (0..PARTICIPANTS).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let mut bridges = Vec::new();
    let mut threads = Vec::new();
    for i in 0..PARTICIPANTS {
        let (b, t) = bridge(tb, i, lossy[i].clone(), withhold[i].clone(), stop.clone());
        bridges.push(b);
        threads.extend(t);
    }
    let log = |what: String| dir.join(format!("{what}-{plane}.log"));
    let watching: Vec<Supervised> = (0..PARTICIPANTS).map(|i| receivers(tb, i, &log(format!("receivers-p{i}")))).collect();
    let publishing: Vec<Supervised> = (0..PUBLISHERS).map(|p| publisher(tb, p, &log(format!("publisher-p{p}")))).collect();
    let t0 = Instant::now();
    let at = |ms: u64| std::thread::sleep((t0 + Duration::from_millis(ms)).saturating_duration_since(Instant::now()));

    let consumers = serve.api("GET", "/v1/rooms/v/consumers", None)["consumers"].as_array().unwrap().clone();
    let switched = consumer(&consumers, SWITCHED.0, SWITCHED.1)["id"].as_u64().unwrap();
    let layers_path = format!("/v1/rooms/v/consumers/{switched}/layers");
    at(WITHHELD_MS.0);
    withhold[WITHHOLDING].store(true, Ordering::Relaxed);
    let withheld = Instant::now();
    at(EXPLICIT_DOWN_MS);
    serve.api("PUT", &layers_path, Some(json!({"max": 0})));
    let down_at = Instant::now();
    at(LATE_JOIN_MS);
    // Before the call: the SFU may ask for the keyframe before the API answers.
    let joined = Instant::now();
    subscribe(LATE.0, LATE.1);
    at(WITHHELD_MS.1);
    withhold[WITHHOLDING].store(false, Ordering::Relaxed);
    at(EXPLICIT_UP_MS);
    serve.api("PUT", &layers_path, Some(json!({"max": null})));
    let up_at = Instant::now();
    at(LOSS_ENDS_MS);
    lossy[REPORTING].store(false, Ordering::Relaxed);
    let loss_ended = Instant::now();
    at(RUN_MS);
    // GStreamer reports when it pleases (a few seconds apart, and not in the early feedback
    // packets it sends while it loses packets): wait for a report of each of p5's consumers
    // made after the loss, so it covers all of it.
    let reported_after = |c: &Value| c["report"]["age_ms"].as_u64().is_some_and(|age| Duration::from_millis(age) < loss_ended.elapsed());
    loop {
        let consumers = serve.api("GET", "/v1/rooms/v/consumers", None)["consumers"].as_array().unwrap().clone();
        let waiting: Vec<usize> = (0..PUBLISHERS).filter(|to| !reported_after(consumer(&consumers, REPORTING, *to))).collect();
        if waiting.is_empty() {
            break;
        }
        assert!(loss_ended.elapsed() < REPORT_DEADLINE, "[{plane}] no report from p{REPORTING} about p{waiting:?} since its loss ended");
        std::thread::sleep(Duration::from_millis(100));
    }

    let consumers = serve.api("GET", "/v1/rooms/v/consumers", None)["consumers"].as_array().unwrap().clone();
    let stats = serve.api("GET", "/v1/stats", None)["total"].clone();
    drop(publishing);
    drop(watching);
    stop.store(true, Ordering::Relaxed);
    threads.into_iter().for_each(|t| t.join().unwrap());
    for i in 0..PARTICIPANTS {
        let text = std::fs::read_to_string(log(format!("receivers-p{i}"))).unwrap_or_default();
        let errors: Vec<&str> = text.lines().filter(|l| l.contains("ERROR")).collect();
        assert!(errors.is_empty(), "[{plane}] p{i}'s receivers: {errors:?}");
    }
    let sent = |p: usize| bridges[p].rtp_out(layer_ssrc(p, 2));

    // The late joiner: a PLI reached its publisher, and its first keyframe came in time.
    let late = bridges[LATE.0].rtp_in(layer_ssrc(LATE.1, 0));
    let key = late.iter().find(|(_, p)| vp8_keyframe_start(p)).unwrap_or_else(|| panic!("[{plane}] the late joiner got no keyframe"));
    let waited = key.0.duration_since(joined);
    assert!(waited <= KEYFRAME_DEADLINE, "[{plane}] the late joiner's first keyframe came {waited:?} after it joined");
    // The keyframe answers a request: the SFU's for the joiner, or one the joiner's was
    // coalesced with (another receiver's, at most the coalescing interval before the join).
    let since = joined - COALESCING;
    let asked = bridges[LATE.1].inbound.lock().unwrap().iter().any(|(t, p)| *t >= since && *t <= key.0 && is_pli(p));
    assert!(asked, "[{plane}] no PLI reached p{} in the {COALESCING:?} before the join or since, up to the keyframe", LATE.1);
    eprintln!("[{plane}] late joiner: first keyframe {waited:?} after joining");

    // Clean links: every consumer's stream whole and decoded, through its switches: p3's of p0
    // by hand, every consumer's of p1 while p1 withheld its top layer.
    for who in 0..NACKING {
        for to in (0..PUBLISHERS).filter(|to| *to != who) {
            let what = format!("[{plane}] p{who}<-p{to}");
            let excused = (to == WITHHOLDING).then_some((withheld, withheld + ABSENCE_NOTICED));
            let sizes = check_stream(&what, &bridges[who].rtp_in(layer_ssrc(to, 0)), t0, &sent(to), excused, dir);
            let expected = match (who, to) {
                SWITCHED => vec![SIZES[2], SIZES[0], SIZES[2]],
                (_, WITHHOLDING) => vec![SIZES[2], SIZES[1], SIZES[2]],
                _ => vec![SIZES[2]],
            };
            assert_eq!(sizes, expected, "{what}: the layers its keyframes announce (by hand: down at {down_at:?}, up at {up_at:?})");
        }
    }
    let c = consumer(&consumers, SWITCHED.0, SWITCHED.1);
    assert!(c["layers"]["switches"].as_u64().unwrap() >= 2, "[{plane}] {c}");
    for who in (0..NACKING).filter(|w| *w != WITHHOLDING) {
        let c = consumer(&consumers, who, WITHHOLDING);
        assert!(c["layers"]["fallbacks"].as_u64().unwrap() >= 2, "[{plane}] p{who}<-p{WITHHOLDING} fell back and returned: {c}");
    }

    // p5: what it reported lost against what its link lost; a report of more than 10 % (when
    // GStreamer sent one) stepped its consumer down.
    let (mut nack_windows, mut steps_down, mut lossy_total) = (0, 0, 0);
    for to in 0..PUBLISHERS {
        let what = format!("[{plane}] p{REPORTING}<-p{to}");
        let c = consumer(&consumers, REPORTING, to);
        let got = bridges[REPORTING].rtp_in(layer_ssrc(to, 0));
        let lossy_reports = bridges[REPORTING]
            .outbound
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, x)| is_rtcp(x))
            .flat_map(|(_, x)| parse_rtcp_compound(x).unwrap_or_default().into_iter().map(|m| (m.packet_type, m.count, m.bytes.to_vec())).collect::<Vec<_>>())
            .filter(|(pt, n, b)| *pt == 201 && *n > 0 && b[8..12] == layer_ssrc(to, 0).to_be_bytes() && b[12] > mediaplane_core::layer_choice::LOSS_DOWN)
            .count();
        let (down, judged) = (c["layers"]["auto_steps_down"].as_u64().unwrap(), c["layers"]["auto_nack_windows"].as_u64().unwrap());
        assert!(lossy_reports == 0 || down >= 1, "{what}: {lossy_reports} reports of more than 10 % lost, no step down: {c}");
        lossy_total += lossy_reports;
        nack_windows += judged;
        steps_down += down;
        eprintln!("{what}: {lossy_reports} reports of more than 10 % lost, {judged} NACK windows, {down} steps down, {} up", c["layers"]["auto_steps_up"]);

        let report = &c["report"];
        let (cumulative, highest) = (report["cumulative_lost"].as_i64().unwrap(), report["highest_seq"].as_u64().unwrap());
        let mut ext = Vec::new();
        let mut last: Option<u64> = None;
        for (_, p) in &got {
            let seq = u64::from(RtpHeader::parse(p).unwrap().sequence);
            let e = match last {
                None => seq,
                Some(prev) => {
                    let base = prev & !0xffff;
                    [base.wrapping_sub(0x10000), base, base + 0x10000].into_iter().map(|b| b + seq).min_by_key(|c| c.abs_diff(prev)).unwrap()
                }
            };
            ext.push(e);
            last = Some(e);
        }
        // RFC 3550 A.1, as GStreamer counts: a source is valid after two packets in sequence,
        // and its count starts at the second.
        let base = ext.windows(2).find(|w| w[1] == w[0] + 1).map(|w| w[1]).unwrap();
        let expected = highest + 1 - base;
        let received = ext.iter().filter(|e| (base..=highest).contains(*e)).collect::<BTreeSet<_>>().len() as u64;
        let actual = (expected - received) as f64 / expected as f64 * 100.0;
        let reported = cumulative as f64 / expected as f64 * 100.0;
        // Within 1.5 points: measured within 1 on a quiet machine, 1.35 once in a fresh-clone CI
        // run on the eBPF plane (11.83 % reported, 10.48 % by the link: five packets of 420).
        // The SFU's own view (`forwarded`, below) holds that it passed on no loss.
        assert!((actual - reported).abs() <= 1.5, "{what}: reported {reported:.2} % lost, the link lost {actual:.2} %: {report}");
        // What the SFU measured in the path as it sent (`forwarded`): the publishers' links are
        // clean, so the loss is the last hop's, not passed on.
        let f = &c["forwarded"];
        let (sent, passed_on) = (f["packets"].as_u64().unwrap_or(0), f["lost"].as_i64().unwrap_or(i64::MAX));
        assert!(sent > 0 && passed_on * 100 <= sent as i64 && f["duplicates"] == 0, "{what}: forwarded {f}");
        eprintln!("{what}: reported {reported:.2} % lost, the link lost {actual:.2} %; the SFU sent {sent}, passed on {passed_on} lost");
    }
    // At least one of p5's consumers got a report of more than 10 % (else "each such report
    // stepped its consumer down" held nothing). Not each: GStreamer's regular reports come about
    // 5 s apart and give way to the early feedback carrying its NACKs (measured: 0, 1 and 1 for
    // p5's three consumers on one plane, 1, 2 and 1 on the other), so one consumer may have none.
    assert!(lossy_total >= 1, "[{plane}] no report of more than 10 % lost from p{REPORTING}, whose link lost 20 % for {LOSS_ENDS_MS} ms");
    // The NACKs of a receiver that rarely reports were judged as its loss. (Not every window
    // shows more than 10 %: one that spans the end of the loss, or a consumer that fell back to
    // a lower layer and receives fewer packets, may not; sfu_layer_choice holds the thresholds.)
    assert!(nack_windows >= 1 && steps_down >= 1, "[{plane}] p{REPORTING}'s NACKs judged in {nack_windows} windows, {steps_down} steps down");
    let dropped = bridges[REPORTING].lost.lock().unwrap().len();
    assert!(dropped > 0, "[{plane}] p{REPORTING}'s link lost nothing");

    // The lossy links' NACKs (p4's and p5's) reached the publishers, naming what they sent.
    for p in 0..PUBLISHERS {
        let sent: BTreeMap<u32, BTreeSet<u16>> = (0..3)
            .map(|l| (layer_ssrc(p, l), bridges[p].rtp_out(layer_ssrc(p, l)).iter().map(|(_, x)| RtpHeader::parse(x).unwrap().sequence).collect()))
            .collect();
        let mut nacked = 0;
        for (_, rtcp) in bridges[p].inbound.lock().unwrap().iter().filter(|(_, x)| is_rtcp(x)) {
            for m in parse_rtcp_compound(rtcp).unwrap().iter().filter(|m| m.packet_type == 205 && m.count == 1) {
                let media = u32::from_be_bytes(m.bytes[8..12].try_into().unwrap());
                let pid = u16::from_be_bytes(m.bytes[12..14].try_into().unwrap());
                let seqs = sent.get(&media).unwrap_or_else(|| panic!("[{plane}] p{p} got a NACK for {media:#x}, not one of its layers"));
                assert!(seqs.contains(&pid), "[{plane}] p{p} got a NACK for {pid} on {media:#x}, which it never sent");
                nacked += 1;
            }
        }
        assert!(nacked > 0, "[{plane}] no NACK reached p{p}");
        // What p4 NACKed of this publisher's stream (its numbers), against what its link lost.
        let lost: BTreeSet<u16> = rtp(&bridges[NACKING].lost, layer_ssrc(p, 0)).iter().map(|(_, x)| RtpHeader::parse(x).unwrap().sequence).collect();
        let mut named = BTreeSet::new();
        for (_, rtcp) in bridges[NACKING].outbound.lock().unwrap().iter().filter(|(_, x)| is_rtcp(x)) {
            for m in
                parse_rtcp_compound(rtcp).unwrap().iter().filter(|m| m.packet_type == 205 && m.count == 1 && m.bytes[8..12] == layer_ssrc(p, 0).to_be_bytes())
            {
                for fci in m.bytes[12..].chunks_exact(4) {
                    let (pid, blp) = (u16::from_be_bytes([fci[0], fci[1]]), u16::from_be_bytes([fci[2], fci[3]]));
                    named.insert(pid);
                    named.extend((0..16).filter(|b| blp & (1 << b) != 0).map(|b| pid.wrapping_add(b + 1)));
                }
            }
        }
        let received = bridges[NACKING].rtp_in(layer_ssrc(p, 0)).len();
        eprintln!(
            "[{plane}] p{NACKING}<-p{p}: {received} received, {} lost, {} NACKed ({} of them not lost)",
            lost.len(),
            named.len(),
            named.difference(&lost).count()
        );
        let c = &consumer(&consumers, NACKING, p)["layers"];
        eprintln!(
            "[{plane}] p{p} received {nacked} NACKs; p{NACKING}'s consumer: {} NACK windows, {} steps down",
            c["auto_nack_windows"], c["auto_steps_down"]
        );
    }
    assert!(stats["feedback_routed"].as_u64().unwrap() > 0 && stats["feedback_coalesced"].as_u64().unwrap() > 0, "[{plane}] {stats}");
}

#[test]
fn a_simulcast_conference_of_gstreamer_peers_switches_layers_and_routes_feedback() {
    if !mediaplane_bench::require_root("interop_video_simulcast") || !sip::ready("interop_video_simulcast", &["gst-launch-1.0"]) {
        return;
    }
    let tmp = common::TempDir::new("video-simulcast");
    let tb = Testbed::star(PARTICIPANTS).unwrap();
    for plane in ["userspace", "ebpf"] {
        run_plane(&tb, plane, &tmp.0);
    }
}
