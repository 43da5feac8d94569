//! Simulcast through `mediaplane serve` on every data plane. p0 publishes one VP8 stream in
//! three layers (SSRCs 0x100, 0x101, 0x102) and makes a keyframe on a layer only when asked
//! (a PLI for its SSRC), as an encoder without periodic keyframes does. p1 subscribes to the
//! lowest layer and is switched up through the API mid-stream; p2 gets the top layer and is
//! capped down. Checked at the receivers: one SSRC, sequence numbers with no gap and no
//! duplicate (a reordered and a duplicated packet are injected), VP8 picture ids and timestamps
//! that continue across each switch, each switch at a keyframe of the new layer; at the
//! publisher: the SFU's keyframe requests for the layers the consumers wait for, a consumer's
//! NACK mapped back to the layer and sequence number it was sent from (on the eBPF planes; the
//! user-space plane answers it from what it sent); sender reports reach
//! only the consumers of their layer, renumbered. On the eBPF planes the kernel renumbers the
//! layers' copies itself: at least 95 % of the media packets are forwarded there.

mod common;

use common::netns::NetnsServe;
use common::planes;
use common::simulcast::{drain, keyframes_asked, LAYERS};
use mediaplane_bench::netns::Testbed;
use mediaplane_core::call_quality::{build_report, ReportBlock};
use mediaplane_core::feedback::build;
use mediaplane_core::rtp::{parse_rtcp_compound, RtpHeader};
use serde_json::{json, Value};
use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

const SFU_PORT: u16 = 40000;
const MEDIA_PORT: u16 = 5004;
const FRAMES: u16 = 170;
const FRAME_MS: u64 = 8;
/// The frames after which p1 is switched up and p2 capped down.
const P1_UP_AT: u16 = 40;
const P2_DOWN_AT: u16 = 90;
/// The non-key frame of layer 2 whose two packets are sent swapped, the second twice.
const SHUFFLED: u16 = 70;

/// What a receiver got, as far as the checks need.
#[derive(Debug, Clone)]
struct Got {
    ssrc: u32,
    seq: u16,
    ts: u32,
    pic: u16,
    key: bool,
    layer: u8,
}

fn parse(p: &[u8]) -> Got {
    let h = RtpHeader::parse(p).unwrap();
    let d = &p[h.payload_offset..];
    Got { ssrc: h.ssrc, seq: h.sequence, ts: h.timestamp, pic: u16::from_be_bytes([d[2] & 0x7f, d[3]]), key: d[0] & 0x10 != 0 && d[5] & 1 == 0, layer: d[6] }
}

fn vp8(layer: usize, seq: u16, ts: u32, pic: u16, first: bool, key: bool) -> Vec<u8> {
    common::simulcast::vp8(layer, seq, ts, pic, first, key, 100 + 100 * layer)
}

fn rtp_of(all: &[Vec<u8>]) -> Vec<Got> {
    all.iter().filter(|p| p.len() > 1 && !(192..=223).contains(&p[1])).map(|p| parse(p)).collect()
}

/// The receiver's packets in sequence order are one run per layer, `layers` in turn, each run
/// starting at a keyframe; no gap, no duplicate; picture ids and timestamps continue.
fn check_receiver(plane: &str, who: &str, got: &[Got], layers: &[u8]) {
    assert!(!got.is_empty(), "[{plane}] {who} got nothing");
    assert!(got.iter().all(|g| g.ssrc == LAYERS[0]), "[{plane}] {who}: every layer on the first layer's SSRC");
    let mut by_seq = got.to_vec();
    let base = by_seq[0].seq.wrapping_sub(1000);
    by_seq.sort_by_key(|g| g.seq.wrapping_sub(base));
    for w in by_seq.windows(2) {
        assert_eq!(w[1].seq, w[0].seq.wrapping_add(1), "[{plane}] {who}: a gap or a duplicate after seq {}", w[0].seq);
        let pic_step = w[1].pic.wrapping_sub(w[0].pic) & 0x7fff;
        assert!(pic_step <= 1, "[{plane}] {who}: picture id {} -> {}", w[0].pic, w[1].pic);
        assert!(w[1].ts.wrapping_sub(w[0].ts) < 1 << 31, "[{plane}] {who}: timestamp went back at seq {}", w[1].seq);
    }
    let mut runs: Vec<u8> = Vec::new();
    for g in &by_seq {
        if runs.last() != Some(&g.layer) {
            assert!(g.key, "[{plane}] {who}: layer {} starts at seq {} without a keyframe", g.layer, g.seq);
            runs.push(g.layer);
        }
    }
    assert_eq!(runs, layers, "[{plane}] {who}: the layers received, in turn");
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
    let sub = |who: &str, body: Value| serve.api("POST", &format!("/v1/rooms/s/participants/{who}/subscriptions"), Some(body))["consumer"].as_u64().unwrap();
    let c1 = sub("p1", json!({"publisher": "p0", "stream": "cam", "preferred_layer": 0}));
    let c2 = sub("p2", json!({"publisher": "p0", "stream": "cam"}));

    let socks: Vec<UdpSocket> = tb.peers.iter().map(|p| tb.udp_socket(&p.ns, SocketAddr::new(p.ip, MEDIA_PORT)).unwrap()).collect();
    for (i, s) in socks.iter().enumerate() {
        s.set_nonblocking(true).unwrap();
        s.send_to(b"", SocketAddr::new(tb.peers[i].sfu_ip, 9)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    let sfu = |i: usize| SocketAddr::new(tb.peers[i].sfu_ip, SFU_PORT);

    // The publisher: per layer its next sequence number, and whether a keyframe was asked for.
    let mut seq = [1000u16, 30000, 65500];
    let mut key_asked = [false; 3];
    let mut at_publisher: Vec<Vec<u8>> = Vec::new();
    let mut received: [Vec<Vec<u8>>; 3] = Default::default();
    for f in 0..FRAMES {
        let before = at_publisher.len();
        drain(&socks[0], &mut at_publisher);
        keyframes_asked(&at_publisher[before..], &mut key_asked);
        for l in 0..3 {
            let key = std::mem::take(&mut key_asked[l]);
            let ts = 1_000_000 * l as u32 + 720 * f as u32;
            let mut packets: Vec<Vec<u8>> = (0..2).map(|k| vp8(l, seq[l].wrapping_add(k), ts, f, k == 0, key)).collect();
            seq[l] = seq[l].wrapping_add(2);
            if l == 2 && f == SHUFFLED {
                assert!(!key, "the shuffled frame must not be a keyframe: move SHUFFLED");
                packets.swap(0, 1);
                packets.insert(1, packets[0].clone());
            }
            for p in packets {
                socks[0].send_to(&p, sfu(0)).unwrap();
            }
        }
        for who in [1, 2] {
            drain(&socks[who], &mut received[who]);
        }
        if f == P1_UP_AT {
            serve.api("PUT", &format!("/v1/rooms/s/consumers/{c1}/layers"), Some(json!({"preferred": 2})));
        }
        if f == P2_DOWN_AT {
            serve.api("PUT", &format!("/v1/rooms/s/consumers/{c2}/layers"), Some(json!({"max": 1})));
        }
        std::thread::sleep(Duration::from_millis(FRAME_MS));
    }
    std::thread::sleep(Duration::from_millis(100));
    for who in [1, 2] {
        drain(&socks[who], &mut received[who]);
    }

    let got1 = rtp_of(&received[1]);
    let got2 = rtp_of(&received[2]);
    check_receiver(plane, "p1", &got1, &[0, 2]);
    check_receiver(plane, "p2", &got2, &[2, 1]);
    // p2 got the shuffled frame's two packets once each, in the order they came.
    let shuffled: Vec<&Got> = got2.iter().filter(|g| g.layer == 2 && g.pic == SHUFFLED).collect();
    assert_eq!(shuffled.len(), 2, "[{plane}] the duplicate stopped at the SFU");
    assert_eq!(shuffled[1].seq, shuffled[0].seq.wrapping_sub(1), "[{plane}] the reordered packet kept its place");

    // The publisher was asked for keyframes of every layer a consumer waited for, by the SFU.
    let mut asked: Vec<u32> = Vec::new();
    for p in &at_publisher {
        let msgs = parse_rtcp_compound(p).unwrap();
        assert_eq!(msgs[0].packet_type, 201, "[{plane}] a compound starting with a receiver report");
        for m in msgs.iter().filter(|m| m.packet_type == 206 && m.count == 1) {
            asked.push(u32::from_be_bytes(m.bytes[8..12].try_into().unwrap()));
        }
    }
    for l in LAYERS {
        assert!(asked.contains(&l), "[{plane}] a keyframe of {l:#x} was asked for: {asked:x?}");
    }
    assert!(asked.len() <= 6, "[{plane}] keyframe requests coalesced: {asked:x?}");

    // p2 NACKs two numbers of what it got from layer 1: p0 hears of layer 1's own numbers (or
    // the SFU sends them again).
    let last1: Vec<&Got> = got2.iter().filter(|g| g.layer == 1).collect();
    let (out_a, out_b) = (last1[3].seq, last1[5].seq);
    let orig = |out: u16| {
        let g = last1.iter().find(|g| g.seq == out).unwrap();
        // Layer 1's packet with this picture id and position (first or second of its frame).
        let first = last1.iter().filter(|x| x.pic == g.pic).map(|x| x.seq).min().unwrap();
        30000u16.wrapping_add(2 * g.pic).wrapping_add(out.wrapping_sub(first))
    };
    let nack = build::nack(0xb2, LAYERS[0], out_a, 1 << (out_b.wrapping_sub(out_a) - 1));
    socks[2].send_to(&[build_report(0xb2, None, &[]), nack].concat(), sfu(2)).unwrap();
    // Sender reports of every layer: each consumer gets its own layer's, on its SSRC.
    for (l, ssrc) in LAYERS.iter().enumerate() {
        socks[0].send_to(&build_report(*ssrc, Some(0x0102_0304 + l as u32), &[]), sfu(0)).unwrap();
    }
    let srs_sent = std::time::Instant::now();
    std::thread::sleep(Duration::from_millis(200));
    let mut after: Vec<Vec<u8>> = Vec::new();
    drain(&socks[0], &mut after);
    let nacks: Vec<(u32, Vec<u16>)> = after
        .iter()
        .flat_map(|p| parse_rtcp_compound(p).unwrap().into_iter().filter(|m| m.packet_type == 205).map(|m| m.bytes.to_vec()).collect::<Vec<_>>())
        .map(|b| {
            let (pid, blp) = (u16::from_be_bytes([b[12], b[13]]), u16::from_be_bytes([b[14], b[15]]));
            let seqs = std::iter::once(pid).chain((0..16).filter(|i| blp & (1 << i) != 0).map(|i| pid.wrapping_add(i + 1))).collect();
            (u32::from_be_bytes(b[8..12].try_into().unwrap()), seqs)
        })
        .collect();
    // The user-space plane made p2's copies itself and kept them: it answers the NACK by
    // sending them again. The eBPF planes' kernel renumbered them: the NACK goes to the
    // publisher, in layer 1's numbers.
    let answered = common::copies_in_user_space(plane);
    if answered {
        assert!(nacks.is_empty(), "[{plane}] the NACK was answered by the SFU, not sent on: {nacks:?}");
    } else {
        assert_eq!(nacks, vec![(LAYERS[1], vec![orig(out_a), orig(out_b)])], "[{plane}] the NACK, in layer 1's numbers");
    }
    for (who, layer) in [(1usize, 2u32), (2, 1)] {
        let mut rtcp: Vec<Vec<u8>> = Vec::new();
        drain(&socks[who], &mut rtcp);
        let resent: Vec<u16> = rtcp.iter().filter(|p| !(200..=206).contains(&p[1])).map(|p| u16::from_be_bytes([p[2], p[3]])).collect();
        let want: Vec<u16> = if answered && who == 2 { vec![out_a, out_b] } else { Vec::new() };
        assert_eq!(resent, want, "[{plane}] p{who}: the copies it NACKed, sent again by the SFU (on the user-space plane)");
        let srs: Vec<(u32, Vec<u8>)> =
            rtcp.iter().filter(|p| p[1] == 200).map(|p| (u32::from_be_bytes(p[4..8].try_into().unwrap()), p[8..16].to_vec())).collect();
        let ntp = build_report(0, Some(0x0102_0304 + layer), &[])[8..16].to_vec();
        assert_eq!(srs, vec![(LAYERS[0], ntp)], "[{plane}] p{who}: the sender report of its layer only, on its SSRC");
    }
    // p1 echoes the sender report of its layer (2) it received, held 62.5 ms: its round-trip time.
    // p2 echoes layer 0's, which it never received: none.
    let echo = |reporter: u32, layer: u32| {
        let block = ReportBlock { about: LAYERS[0], lsr: 0x0102_0304 + layer, dlsr: 0x1000, ..Default::default() };
        build_report(reporter, None, &[block])
    };
    let echoed_after = srs_sent.elapsed();
    socks[1].send_to(&echo(0xb1, 2), sfu(1)).unwrap();
    socks[2].send_to(&echo(0xb2, 0), sfu(2)).unwrap();
    std::thread::sleep(Duration::from_millis(50));

    // On the eBPF planes the kernel renumbered the layers' packets itself (bpf/layer_rewrite.h):
    // of the publisher's media packets, what the BPF program forwarded, against what it handed
    // to the slow path (the sender reports go up by design; a first packet before the
    // neighbours were resolved may too).
    let mut handed_up = 0;
    if plane == "afxdp" {
        // Every media packet reached the engine by an AF_XDP socket, not the sockets underneath.
        let stats = serve.api("GET", "/v1/stats", None);
        let redirected = stats["extra"]["xsk_redirected"].as_u64().unwrap_or(0);
        let sent = FRAMES as u64 * 3 * 2 + 1;
        assert!(redirected >= sent, "[{plane}] {redirected} of {sent} media packets came by AF_XDP: {}", stats["extra"]);
    } else if plane != "userspace" {
        let stats = serve.api("GET", "/v1/stats", None);
        let counter = |k: &str| stats["extra"][k].as_u64().unwrap_or(0);
        let sent = FRAMES as u64 * 3 * 2 + 1;
        let in_kernel = counter("forwarded");
        handed_up = counter("pass_slow_stream") + counter("pass_no_neigh") + counter("pass_in_order");
        println!("[{plane}] {in_kernel} of {sent} media packets decided in the kernel, {handed_up} handed up");
        assert!(in_kernel * 100 >= sent * 95, "[{plane}] only {in_kernel} of {sent} media packets were decided in the kernel ({handed_up} handed up)");
        // What the receivers got above (renumbered, checked) came from the kernel then: the slow
        // path saw at most the few handed up.
        assert!(handed_up * 100 <= sent * 5, "[{plane}] {handed_up} of {sent} media packets were handed up to the slow path");
    }

    // What the API says of them.
    let consumers = serve.api("GET", "/v1/rooms/s/consumers", None)["consumers"].as_array().unwrap().clone();
    let view = |id: u64| consumers.iter().find(|c| c["id"] == id).unwrap_or_else(|| panic!("{id} in {consumers:?}")).clone();
    let (v1, v2) = (view(c1), view(c2));
    let l = |v: &Value, k: &str| v["layers"][k].as_u64();
    assert_eq!((l(&v1, "current"), l(&v1, "wanted"), l(&v1, "switches")), (Some(2), Some(2), Some(1)), "[{plane}] {v1}");
    assert_eq!((l(&v2, "current"), l(&v2, "max"), l(&v2, "switches")), (Some(1), Some(1), Some(1)), "[{plane}] {v2}");
    assert_eq!(l(&v2, "duplicates_dropped"), Some(1), "[{plane}] {v2}");
    // Their RTP as forwarded (in-path, per consumer): what the receivers got, on one SSRC, no
    // loss passed on, the duplicate stopped, the shuffled frame's reordered packet forwarded as
    // it came (both were on layer 2 then). On eBPF the view is the kernel's, which missed what
    // went through the slow path (see above).
    for (v, got) in [(&v1, &got1), (&v2, &got2)] {
        let f = &v["forwarded"];
        let n = |k: &str| f[k].as_u64().unwrap_or_else(|| panic!("[{plane}] forwarded.{k}: {v}"));
        assert_eq!((n("ssrc"), f["lost"].as_i64(), n("duplicates"), n("reordered")), (u64::from(LAYERS[0]), Some(0), 0, 1), "[{plane}] {v}");
        let missed = if common::copies_in_user_space(plane) { 0 } else { handed_up };
        assert!(n("packets") <= got.len() as u64 && n("packets") + missed >= got.len() as u64, "[{plane}] {} of {} forwarded: {v}", n("packets"), got.len());
    }
    assert_eq!(v1["tx_copies"].as_u64(), Some(got1.len() as u64 + 1), "[{plane}] its packets and its sender report: {v1}");
    let rtt = v1["rtt_ms"].as_f64().unwrap_or_else(|| panic!("[{plane}] no RTT from p1's echo: {v1}"));
    let expect = echoed_after.as_secs_f64() * 1000.0 - 62.5;
    assert!((rtt - expect).abs() < 50.0, "[{plane}] RTT {rtt} ms, expected about {expect:.1} ms: {v1}");
    assert!(v2["rtt_ms"].is_null(), "[{plane}] an echo of another layer's sender report: {v2}");
    // A layer that does not exist is refused, and changes nothing.
    let bad = common::netns::try_api(tb, "PUT", &format!("/v1/rooms/s/consumers/{c1}/layers"), Some(json!({"preferred": 3})));
    assert!(bad.as_ref().is_err_and(|e| e.contains("layer 3 does not exist")), "[{plane}] {bad:?}");
    // `auto` is a boolean, nothing else; the answer says what was set.
    let bad = common::netns::try_api(tb, "PUT", &format!("/v1/rooms/s/consumers/{c1}/layers"), Some(json!({"auto": "no"})));
    assert!(bad.is_err(), "[{plane}] {bad:?}");
    // VP8's temporal layers are 0 to 3.
    let bad = common::netns::try_api(tb, "PUT", &format!("/v1/rooms/s/consumers/{c1}/layers"), Some(json!({"temporal": 4})));
    assert!(bad.as_ref().is_err_and(|e| e.contains("temporal layer 4 does not exist")), "[{plane}] {bad:?}");
    let set = serve.api("PUT", &format!("/v1/rooms/s/consumers/{c1}/layers"), Some(json!({"preferred": 1, "auto": false})));
    assert_eq!((set["preferred"].as_u64(), set["auto"].as_bool(), set["temporal"].as_u64()), (Some(1), Some(false), None), "[{plane}] {set}");
    let set = serve.api("PUT", &format!("/v1/rooms/s/consumers/{c1}/layers"), Some(json!({"preferred": 1, "temporal": 2})));
    assert_eq!(set["temporal"].as_u64(), Some(2), "[{plane}] {set}");
    let view = serve.api("GET", &format!("/v1/rooms/s/consumers/{c1}"), None);
    assert_eq!(view["layers"]["temporal"].as_u64(), Some(2), "[{plane}] {view}");
}

#[test]
fn simulcast_consumers_switch_layers_exactly_on_every_data_plane() {
    if !mediaplane_bench::require_root("sfu_simulcast") {
        return;
    }
    let tb = Testbed::star(3).unwrap();
    for plane in planes() {
        run_plane(&tb, &plane);
    }
}
