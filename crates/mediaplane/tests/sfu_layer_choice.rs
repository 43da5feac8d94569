//! Automatic simulcast layer choice through `mediaplane serve` on every data plane
//! (`mediaplane_core::layer_choice`). p0 publishes one VP8 stream in three layers and makes a
//! keyframe on a layer only when asked (a PLI for its SSRC); p1 and p2 subscribe with no
//! preference (the top layer). p1 sends receiver reports about what it gets, p2 REMBs. The run,
//! in seconds:
//!
//! * 0: both start on layer 2;
//! * 1: p1 reports 25 % loss, and at 1.2 p2 an estimate below layer 2's bitrate (but above
//!   layer 1's): both step down to layer 1;
//! * 2 to 4: p0 stops sending layer 1 (as a browser drops a layer under congestion): a second
//!   later both fall back to layer 0, and go back to 1 when it returns;
//! * from 1.5: p1 reports 2 % loss every half second; p2 keeps its estimate until 5, then
//!   raises it: 6 s after its step down (the hold) each steps up to layer 2 again.
//!
//! p3 subscribes with `auto_layer` off and reports 25 % loss and a low estimate every half
//! second: it stays on layer 2 (still sent) throughout.
//!
//! Checked at p1 and p2: layers 2, 1, 0, 1, 2 in turn, each from a keyframe, with no gap and no
//! duplicate in its numbering, the step up not before the hold ended; in the API: the steps,
//! the fallbacks, and the absent layer while it was absent. At p3: layer 2 only, no gap, and no
//! step in the API.

mod common;

use common::netns::NetnsServe;
use common::planes;
use common::simulcast::{drain, keyframes_asked, LAYERS};
use mediaplane_bench::netns::Testbed;
use mediaplane_core::call_quality::{build_report, ReportBlock};
use mediaplane_core::feedback::build;
use mediaplane_core::rtp::RtpHeader;
use serde_json::{json, Value};
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

const SFU_PORT: u16 = 40000;
const MEDIA_PORT: u16 = 5004;
const FRAME_MS: u64 = 20;
/// When p1 reports loss and p2 a low estimate: each steps down then.
const STEP_DOWN_MS: [u64; 2] = [1_000, 1_200];
const LAYER1_GONE_MS: (u64, u64) = (2_000, 4_000);
const GOOD_REPORTS_FROM_MS: u64 = 1_500;
/// p2's estimates: below layer 2 (about 500 kbit/s here) and above layer 1 (300) until this,
/// then well above both.
const REMB_RAISED_MS: u64 = 5_000;
/// mediaplane_core::layer_choice::UP_HOLD_NS.
const HOLD_MS: u64 = 6_000;
const RUN_MS: u64 = STEP_DOWN_MS[1] + HOLD_MS + 1_200;

/// Layers of 100, 400 and 700 bytes of payload: about 80, 300 and 500 kbit/s at this pace.
fn vp8(layer: usize, seq: u16, ts: u32, pic: u16, first: bool, key: bool) -> Vec<u8> {
    common::simulcast::vp8(layer, seq, ts, pic, first, key, 100 + 300 * layer)
}

/// Room "s" with every peer of `tb` as p0, p1, ...; p0 publishes "cam" in three layers.
fn start_room<'a>(tb: &'a Testbed, plane: &str, tmp: &common::TempDir) -> NetnsServe<'a> {
    let serve = NetnsServe::start(tb, plane, &tmp.0.join("store.db"), &["--reset"]);
    serve.api("POST", "/v1/rooms", Some(json!({"id": "s"})));
    for (i, p) in tb.peers.iter().enumerate() {
        let body = json!({"id": format!("p{i}"), "local": SocketAddr::new(p.sfu_ip, SFU_PORT), "remote": SocketAddr::new(p.ip, MEDIA_PORT)});
        serve.api("POST", "/v1/rooms/s/participants", Some(body));
    }
    serve.api("POST", "/v1/rooms/s/participants/p0/streams", Some(json!({"name": "cam", "layers": LAYERS, "codec": "vp8", "clock_rate": 90000})));
    serve
}

/// p0's frame `f`: two packets per layer (but `skip`), a keyframe on a layer whose keyframe was
/// asked for (a PLI read from `publisher` since the last frame).
fn publish_frame(publisher: &UdpSocket, sfu: SocketAddr, f: u16, seq: &mut [u16; 3], key_asked: &mut [bool; 3], skip: Option<usize>) {
    let mut at_publisher: Vec<Vec<u8>> = Vec::new();
    drain(publisher, &mut at_publisher);
    keyframes_asked(&at_publisher, key_asked);
    for l in (0..3).filter(|l| Some(*l) != skip) {
        let key = std::mem::take(&mut key_asked[l]);
        let ts = 1_000_000 * l as u32 + 1800 * f as u32;
        for k in 0..2 {
            publisher.send_to(&vp8(l, seq[l].wrapping_add(k), ts, f, k == 0, key), sfu).unwrap();
        }
        seq[l] = seq[l].wrapping_add(2);
    }
}

fn run_plane(tb: &Testbed, plane: &str) {
    let tmp = common::TempDir::new("store");
    let serve = start_room(tb, plane, &tmp);
    let sub = |who: &str, body: Value| serve.api("POST", &format!("/v1/rooms/s/participants/{who}/subscriptions"), Some(body))["consumer"].as_u64().unwrap();
    let consumer = [sub("p1", json!({"publisher": "p0", "stream": "cam"})), sub("p2", json!({"publisher": "p0", "stream": "cam"}))];
    let manual = sub("p3", json!({"publisher": "p0", "stream": "cam", "auto_layer": false}));
    let layers_view = |c: u64| -> Value {
        let all = serve.api("GET", "/v1/rooms/s/consumers", None)["consumers"].as_array().unwrap().clone();
        all.iter().find(|v| v["id"] == c).unwrap()["layers"].clone()
    };

    let socks: Vec<UdpSocket> = tb.peers.iter().map(|p| tb.udp_socket(&p.ns, SocketAddr::new(p.ip, MEDIA_PORT)).unwrap()).collect();
    for s in &socks {
        s.set_nonblocking(true).unwrap();
    }
    let sfu = |i: usize| SocketAddr::new(tb.peers[i].sfu_ip, SFU_PORT);
    let report = |loss: u8| build_report(0xc1, None, &[ReportBlock { about: LAYERS[0], fraction_lost: loss, ..Default::default() }]);
    let remb = |bps: u64| [build_report(0xc2, None, &[]), build::remb(0xc2, bps, &[LAYERS[0]])].concat();

    let mut seq = [1000u16, 30000, 65000];
    let mut key_asked = [false; 3];
    // What p1 and p2 received, with when (ms into the run).
    let mut received: [Vec<(Vec<u8>, u64)>; 3] = Default::default();
    let mut absent_seen: Option<[Value; 2]> = None;
    let (mut stepped, mut next_good_ms) = ([false; 2], GOOD_REPORTS_FROM_MS);
    let start = Instant::now();
    let mut f: u16 = 0;
    loop {
        let ms = start.elapsed().as_millis() as u64;
        if ms >= RUN_MS {
            break;
        }
        let gone = (LAYER1_GONE_MS.0..LAYER1_GONE_MS.1).contains(&ms).then_some(1);
        publish_frame(&socks[0], sfu(0), f, &mut seq, &mut key_asked, gone);
        for who in 0..3 {
            let mut got = Vec::new();
            drain(&socks[who + 1], &mut got);
            received[who].extend(got.into_iter().map(|p| (p, ms)));
        }
        if !stepped[0] && ms >= STEP_DOWN_MS[0] {
            socks[1].send_to(&report(64), sfu(1)).unwrap();
            stepped[0] = true;
        }
        if !stepped[1] && ms >= STEP_DOWN_MS[1] {
            socks[2].send_to(&remb(400_000), sfu(2)).unwrap();
            stepped[1] = true;
        }
        if ms >= next_good_ms {
            socks[1].send_to(&report(5), sfu(1)).unwrap();
            socks[2].send_to(&remb(if ms < REMB_RAISED_MS { 400_000 } else { 2_000_000 }), sfu(2)).unwrap();
            socks[3].send_to(&[report(64), remb(100_000)].concat(), sfu(3)).unwrap();
            next_good_ms += 500;
        }
        if absent_seen.is_none() && ms >= LAYER1_GONE_MS.1 - 300 {
            absent_seen = Some(consumer.map(layers_view));
        }
        f = f.wrapping_add(1);
        std::thread::sleep(Duration::from_millis(FRAME_MS));
    }
    std::thread::sleep(Duration::from_millis(100));
    let absent_seen = absent_seen.unwrap();
    for who in 0..2 {
        let name = format!("p{}", who + 1);
        let mut late = Vec::new();
        drain(&socks[who + 1], &mut late);
        received[who].extend(late.into_iter().map(|p| (p, RUN_MS)));
        check_receiver(plane, &name, &received[who], STEP_DOWN_MS[who] + HOLD_MS);
        // What the API said while layer 1 was not sent, and at the end.
        let mid = &absent_seen[who];
        assert_eq!(mid["absent"], json!([1]), "[{plane}] {name}: {mid}");
        assert_eq!((mid["current"].as_u64(), mid["auto_limit"].as_u64()), (Some(0), Some(1)), "[{plane}] {name}: {mid}");
        let end = layers_view(consumer[who]);
        assert_eq!(end["absent"], json!([]), "[{plane}] {name}: {end}");
        assert_eq!(end["auto_limit"], Value::Null, "[{plane}] {name}: back at its ceiling: {end}");
        let steps = (end["auto_steps_down"].as_u64(), end["auto_steps_up"].as_u64(), end["fallbacks"].as_u64());
        assert_eq!(steps, (Some(1), Some(1), Some(2)), "[{plane}] {name}: {end}");
        assert_eq!((end["current"].as_u64(), end["switches"].as_u64()), (Some(2), Some(4)), "[{plane}] {name}: {end}");
    }
    // p3: its reports moved nothing.
    let mut late = Vec::new();
    drain(&socks[3], &mut late);
    received[2].extend(late.into_iter().map(|p| (p, RUN_MS)));
    let runs = layer_runs(plane, "p3", &received[2]);
    assert_eq!(runs.iter().map(|r| r.0).collect::<Vec<_>>(), [2], "[{plane}] p3 (auto_layer off): layer 2 throughout");
    let end = layers_view(manual);
    assert_eq!(end["auto"], false, "[{plane}] p3: {end}");
    let steps = (end["auto_limit"].as_u64(), end["auto_steps_down"].as_u64(), end["current"].as_u64(), end["switches"].as_u64());
    assert_eq!(steps, (None, Some(0), Some(2), Some(0)), "[{plane}] p3: {end}");
}

/// A receiver's media: one run per layer (2, 1, 0, 1, 2), each from a keyframe, no gap, no
/// duplicate; the last run not before `up_at_ms` (the end of the hold).
fn check_receiver(plane: &str, who: &str, received: &[(Vec<u8>, u64)], up_at_ms: u64) {
    let runs = layer_runs(plane, who, received);
    let layers: Vec<u8> = runs.iter().map(|r| r.0).collect();
    assert_eq!(layers, [2, 1, 0, 1, 2], "[{plane}] {who}: down, fallback while layer 1 was not sent, back, up after the hold");
    let up = runs[4].1;
    assert!(up >= up_at_ms && up < up_at_ms + 1_000, "[{plane}] {who}: stepped up at {up} ms, the hold ended at {up_at_ms} ms");
}

/// The layers a receiver got in turn, with when each run began: all on the first layer's SSRC,
/// no gap and no duplicate in the numbering, each run from a keyframe.
fn layer_runs(plane: &str, who: &str, received: &[(Vec<u8>, u64)]) -> Vec<(u8, u64)> {
    let mut got: Vec<(u16, u8, bool, u32, u64)> = received
        .iter()
        .filter(|(p, _)| p.len() > 12 && !(192..=223).contains(&p[1]))
        .map(|(p, at)| {
            let h = RtpHeader::parse(p).unwrap();
            let d = &p[h.payload_offset..];
            (h.sequence, d[6], d[0] & 0x10 != 0 && d[5] & 1 == 0, h.ssrc, *at)
        })
        .collect();
    assert!(!got.is_empty(), "[{plane}] {who} got nothing");
    assert!(got.iter().all(|g| g.3 == LAYERS[0]), "[{plane}] {who}: every layer on the first layer's SSRC");
    let base = got[0].0.wrapping_sub(1000);
    got.sort_by_key(|g| g.0.wrapping_sub(base));
    for w in got.windows(2) {
        assert_eq!(w[1].0, w[0].0.wrapping_add(1), "[{plane}] {who}: a gap or a duplicate after seq {}", w[0].0);
    }
    let mut runs: Vec<(u8, u64)> = Vec::new();
    for g in &got {
        if runs.last().map(|r| r.0) != Some(g.1) {
            assert!(g.2, "[{plane}] {who}: layer {} starts at seq {} without a keyframe", g.1, g.0);
            runs.push((g.1, g.4));
        }
    }
    runs
}

#[test]
fn simulcast_layers_follow_loss_reports_remb_and_absent_layers_on_every_data_plane() {
    if !mediaplane_bench::require_root("sfu_layer_choice") {
        return;
    }
    let tb = Testbed::star(4).unwrap();
    for plane in planes() {
        run_plane(&tb, &plane);
    }
}

/// A receiver that NACKs what it loses but sends no report blocks (as GStreamer's early
/// feedback does): p1 NACKs every fifth packet it receives (20 %), p2 every 33rd (3 %), each
/// with an empty receiver report, from 1 s on, until p2 has had enough windows judged (at
/// least 3.5 s, at most 8 s). p1's NACKs are judged as its loss and step it down; p2's are
/// below the threshold and move nothing. On every data plane.
#[test]
fn nacks_stand_in_for_the_report_blocks_a_receiver_does_not_send() {
    if !mediaplane_bench::require_root("sfu_layer_choice") {
        return;
    }
    let tb = Testbed::star(3).unwrap();
    for plane in planes() {
        let tmp = common::TempDir::new("store");
        let serve = start_room(&tb, &plane, &tmp);
        let sub = |who: &str| {
            let body = json!({"publisher": "p0", "stream": "cam"});
            serve.api("POST", &format!("/v1/rooms/s/participants/{who}/subscriptions"), Some(body))["consumer"].as_u64().unwrap()
        };
        let consumer = [sub("p1"), sub("p2")];
        let socks: Vec<UdpSocket> = tb.peers.iter().map(|p| tb.udp_socket(&p.ns, SocketAddr::new(p.ip, MEDIA_PORT)).unwrap()).collect();
        for s in &socks {
            s.set_nonblocking(true).unwrap();
        }
        let sfu = |i: usize| SocketAddr::new(tb.peers[i].sfu_ip, SFU_PORT);
        let (mut seq, mut key_asked) = ([1000u16, 30000, 65000], [false; 3]);
        let every = [5usize, 33];
        let mut counted = [0usize; 2];
        let start = Instant::now();
        let mut f: u16 = 0;
        // p2's windows need 100 packets each, its NACKs one in 33: seven NACKs make two.
        while start.elapsed() < Duration::from_millis(3_500) || (counted[1] < 7 * every[1] && start.elapsed() < Duration::from_secs(8)) {
            publish_frame(&socks[0], sfu(0), f, &mut seq, &mut key_asked, None);
            for who in 0..2 {
                let mut got = Vec::new();
                drain(&socks[who + 1], &mut got);
                if start.elapsed() < Duration::from_secs(1) {
                    continue;
                }
                let mut nacks = vec![build_report(0xc1 + who as u32, None, &[])];
                for p in got.iter().filter(|p| p.len() > 12 && !(192..=223).contains(&p[1])) {
                    counted[who] += 1;
                    if counted[who] % every[who] == 0 {
                        nacks.push(build::nack(0xc1 + who as u32, LAYERS[0], RtpHeader::parse(p).unwrap().sequence, 0));
                    }
                }
                if nacks.len() > 1 {
                    socks[who + 1].send_to(&nacks.concat(), sfu(who + 1)).unwrap();
                }
            }
            f = f.wrapping_add(1);
            std::thread::sleep(Duration::from_millis(FRAME_MS));
        }
        let view = |c: u64| -> Value {
            let all = serve.api("GET", "/v1/rooms/s/consumers", None)["consumers"].as_array().unwrap().clone();
            all.iter().find(|v| v["id"] == c).unwrap()["layers"].clone()
        };
        let (p1, p2) = (view(consumer[0]), view(consumer[1]));
        assert!(p1["auto_nack_windows"].as_u64() >= Some(1), "[{plane}] p1's NACKs were judged: {p1}");
        let (steps, limit) = (p1["auto_steps_down"].as_u64().unwrap(), p1["auto_limit"].as_u64());
        assert!(steps >= 1 && limit.is_some_and(|l| l <= 1), "[{plane}] 20 % NACKed: stepped down: {p1}");
        assert!(p2["auto_nack_windows"].as_u64() >= Some(1), "[{plane}] p2's NACKs were judged: {p2}");
        assert_eq!((p2["auto_steps_down"].as_u64(), p2["target"].as_u64()), (Some(0), Some(2)), "[{plane}] 3 % NACKed: no step: {p2}");
    }
}
