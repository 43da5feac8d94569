//! Automatic simulcast layer choice through `mediaplane serve` on every data plane
//! (`mediaplane_core::layer_choice`). p0 publishes one VP8 stream in three layers and makes a
//! keyframe on a layer only when asked (a PLI for its SSRC); p1 subscribes with no preference
//! (the top layer) and sends receiver reports about what it gets. The run, in seconds:
//!
//! * 0: p1 starts on layer 2;
//! * 1: p1 reports 25 % loss: it steps down to layer 1;
//! * 2 to 4: p0 stops sending layer 1 (as a browser drops a layer under congestion): a second
//!   later p1 falls back to layer 0, and goes back to 1 when it returns;
//! * from 1.5: p1 reports no loss every half second: 6 s after the lossy report it steps up
//!   to layer 2 again.
//!
//! Checked at p1: layers 2, 1, 0, 1, 2 in turn, each from a keyframe, with no gap and no
//! duplicate in its numbering; in the API: the steps, the fallbacks, and the absent layer while
//! it was absent.

mod common;

use common::netns::NetnsServe;
use mediaplane_bench::netns::Testbed;
use mediaplane_core::call_quality::{build_report, ReportBlock};
use mediaplane_core::rtp::{build_rtp, parse_rtcp_compound, RtpHeader};
use serde_json::{json, Value};
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

const SFU_PORT: u16 = 40000;
const MEDIA_PORT: u16 = 5004;
const LAYERS: [u32; 3] = [0x100, 0x101, 0x102];
const FRAME_MS: u64 = 20;
const LOSSY_REPORT_MS: u64 = 1_000;
const LAYER1_GONE_MS: (u64, u64) = (2_000, 4_000);
const GOOD_REPORTS_FROM_MS: u64 = 1_500;
/// mediaplane_core::layer_choice::UP_HOLD_NS after the lossy report, and time to switch.
const RUN_MS: u64 = LOSSY_REPORT_MS + 6_000 + 1_200;

fn planes() -> Vec<String> {
    std::env::var("MEDIAPLANE_CONFORMANCE_PLANES").unwrap_or_else(|_| "userspace,ebpf,ebpf-xdp".into()).split(',').map(String::from).collect()
}

/// One packet of a VP8 frame (15-bit picture id, TL0PICIDX), the layer's number after the
/// payload header so the receiver can tell.
fn vp8(layer: usize, seq: u16, ts: u32, pic: u16, first: bool, key: bool) -> Vec<u8> {
    let mut payload = vec![if first { 0x90 } else { 0x80 }, 0xc0, 0x80 | (pic >> 8) as u8, pic as u8, pic as u8];
    payload.push(if first && key { 0x10 } else { 0x11 });
    payload.push(layer as u8);
    payload.resize(100 + 300 * layer, 0xee);
    build_rtp(96, seq, ts, LAYERS[layer], &payload)
}

fn drain(s: &UdpSocket, into: &mut Vec<Vec<u8>>) {
    let mut buf = [0u8; 2048];
    while let Ok((n, _)) = s.recv_from(&mut buf) {
        into.push(buf[..n].to_vec());
    }
}

fn run_plane(tb: &Testbed, plane: &str) {
    let tmp = common::TempDir::new("store");
    let serve = NetnsServe::start(tb, plane, &tmp.0.join("store.db"), &["--reset"]);
    serve.api("POST", "/v1/rooms", Some(json!({"id": "s"})));
    for (i, p) in tb.peers.iter().enumerate() {
        let body = json!({"id": format!("p{i}"), "local": SocketAddr::new(p.sfu_ip, SFU_PORT), "remote": SocketAddr::new(p.ip, MEDIA_PORT)});
        serve.api("POST", "/v1/rooms/s/participants", Some(body));
    }
    serve.api("POST", "/v1/rooms/s/participants/p0/streams", Some(json!({"name": "cam", "layers": LAYERS, "codec": "vp8", "clock_rate": 90000})));
    let c1 = serve.api("POST", "/v1/rooms/s/participants/p1/subscriptions", Some(json!({"publisher": "p0", "stream": "cam"})))["consumer"].as_u64().unwrap();
    let layers_view = || -> Value {
        let all = serve.api("GET", "/v1/rooms/s/consumers", None)["consumers"].as_array().unwrap().clone();
        all.iter().find(|c| c["id"] == c1).unwrap()["layers"].clone()
    };

    let socks: Vec<UdpSocket> = tb.peers.iter().map(|p| tb.udp_socket(&p.ns, SocketAddr::new(p.ip, MEDIA_PORT)).unwrap()).collect();
    for s in &socks {
        s.set_nonblocking(true).unwrap();
    }
    let sfu = |i: usize| SocketAddr::new(tb.peers[i].sfu_ip, SFU_PORT);
    let report =
        |loss: u8, highest: u32| build_report(0xc1, None, &[ReportBlock { about: LAYERS[0], fraction_lost: loss, highest_seq: highest, ..Default::default() }]);

    let mut seq = [1000u16, 30000, 65000];
    let mut key_asked = [false; 3];
    let mut received: Vec<Vec<u8>> = Vec::new();
    let mut absent_seen: Option<Value> = None;
    let (mut lossy_sent, mut next_good_ms) = (false, GOOD_REPORTS_FROM_MS);
    let start = Instant::now();
    let mut f: u16 = 0;
    loop {
        let ms = start.elapsed().as_millis() as u64;
        if ms >= RUN_MS {
            break;
        }
        let mut at_publisher: Vec<Vec<u8>> = Vec::new();
        drain(&socks[0], &mut at_publisher);
        for p in &at_publisher {
            for m in parse_rtcp_compound(p).unwrap_or_default() {
                if m.packet_type == 206 && m.count == 1 {
                    let media = u32::from_be_bytes(m.bytes[8..12].try_into().unwrap());
                    if let Some(l) = LAYERS.iter().position(|s| *s == media) {
                        key_asked[l] = true;
                    }
                }
            }
        }
        for l in 0..3 {
            if l == 1 && (LAYER1_GONE_MS.0..LAYER1_GONE_MS.1).contains(&ms) {
                continue;
            }
            let key = std::mem::take(&mut key_asked[l]);
            let ts = 1_000_000 * l as u32 + 1800 * f as u32;
            for k in 0..2 {
                socks[0].send_to(&vp8(l, seq[l].wrapping_add(k), ts, f, k == 0, key), sfu(0)).unwrap();
            }
            seq[l] = seq[l].wrapping_add(2);
        }
        drain(&socks[1], &mut received);
        let highest = received.iter().filter_map(|p| RtpHeader::parse(p).ok()).map(|h| h.sequence as u32).max().unwrap_or(0);
        if !lossy_sent && ms >= LOSSY_REPORT_MS {
            socks[1].send_to(&report(64, highest), sfu(1)).unwrap();
            lossy_sent = true;
        }
        if ms >= next_good_ms {
            socks[1].send_to(&report(0, highest), sfu(1)).unwrap();
            next_good_ms += 500;
        }
        if absent_seen.is_none() && ms >= LAYER1_GONE_MS.1 - 300 {
            absent_seen = Some(layers_view());
        }
        f = f.wrapping_add(1);
        std::thread::sleep(Duration::from_millis(FRAME_MS));
    }
    std::thread::sleep(Duration::from_millis(100));
    drain(&socks[1], &mut received);

    // p1's media: one run per layer, each from a keyframe, no gap, no duplicate.
    let mut got: Vec<(u16, u8, bool, u32)> = received
        .iter()
        .filter(|p| p.len() > 12 && !(192..=223).contains(&p[1]))
        .map(|p| {
            let h = RtpHeader::parse(p).unwrap();
            let d = &p[h.payload_offset..];
            (h.sequence, d[6], d[0] & 0x10 != 0 && d[5] & 1 == 0, h.ssrc)
        })
        .collect();
    assert!(!got.is_empty(), "[{plane}] p1 got nothing");
    assert!(got.iter().all(|g| g.3 == LAYERS[0]), "[{plane}] every layer on the first layer's SSRC");
    let base = got[0].0.wrapping_sub(1000);
    got.sort_by_key(|g| g.0.wrapping_sub(base));
    for w in got.windows(2) {
        assert_eq!(w[1].0, w[0].0.wrapping_add(1), "[{plane}] a gap or a duplicate after seq {}", w[0].0);
    }
    let mut runs: Vec<u8> = Vec::new();
    for g in &got {
        if runs.last() != Some(&g.1) {
            assert!(g.2, "[{plane}] layer {} starts at seq {} without a keyframe", g.1, g.0);
            runs.push(g.1);
        }
    }
    assert_eq!(runs, [2, 1, 0, 1, 2], "[{plane}] down on loss, fallback while layer 1 was not sent, back, up after the hold");

    // What the API said while layer 1 was not sent, and at the end.
    let mid = absent_seen.unwrap();
    assert_eq!(mid["absent"], json!([1]), "[{plane}] {mid}");
    assert_eq!((mid["current"].as_u64(), mid["auto_limit"].as_u64()), (Some(0), Some(1)), "[{plane}] {mid}");
    let end = layers_view();
    assert_eq!(end["absent"], json!([]), "[{plane}] {end}");
    assert_eq!(end["auto_limit"], Value::Null, "[{plane}] back at its ceiling: {end}");
    assert_eq!((end["auto_steps_down"].as_u64(), end["auto_steps_up"].as_u64(), end["fallbacks"].as_u64()), (Some(1), Some(1), Some(2)), "[{plane}] {end}");
    assert_eq!((end["current"].as_u64(), end["switches"].as_u64()), (Some(2), Some(4)), "[{plane}] {end}");
}

#[test]
fn simulcast_layers_follow_loss_reports_and_absent_layers_on_every_data_plane() {
    if !mediaplane_bench::require_root("sfu_layer_choice") {
        return;
    }
    let tb = Testbed::star(2).unwrap();
    for plane in planes() {
        run_plane(&tb, &plane);
    }
}
