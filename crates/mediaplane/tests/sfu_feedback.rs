//! RTCP feedback in a room, through `mediaplane serve` on every data plane: subscribers' PLI,
//! FIR and NACK sent to their own SFU address reach the publisher of the SSRC they name (from
//! the address the publisher sends to), keyframe requests coalesced; receiver reports and REMB
//! stop at the SFU; a NACK of a video copy the SFU made in user space is answered from its send
//! history; other NACKs ask each number once and within the stream's budget, however a
//! subscriber floods them; a publisher-subscriber's sender report still reaches its subscribers, without
//! the feedback it carried; spoofed, unroutable and malformed feedback goes nowhere, counted.
//! Each subscription's consumer counts its copies and feedback and keeps its latest report, and
//! the round-trip time a report echoing a sender report the SFU forwarded it gives.

mod common;

use common::netns::NetnsServe;
use common::planes;
use mediaplane_bench::netns::Testbed;
use mediaplane_core::call_quality::{build_report, ReportBlock};
use mediaplane_core::feedback::build;
use mediaplane_core::rtp::build_rtp;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

const SFU_PORT: u16 = 40000;
const MEDIA_PORT: u16 = 5004;
const STRANGER_PORT: u16 = 5999;
const N: usize = 5;
const P0_SSRC: u32 = 0x1000;
const P1_SSRC: u32 = 0x2000;
const P3_SSRC: u32 = 0x3000;
/// SSRCs the subscribers report from (their receivers').
const RECEIVER: [u32; N] = [0xa0, 0xa1, 0xa2, 0xa3, 0xa4];
/// Middle 32 bits of the NTP timestamp of p1's sender report.
const SR_P1_NTP: u32 = 0x0a0b_0c0d;

/// p0 publishes SSRC 0x1000 on its transport; p1 SSRC 0x2000 on a port of its own; p3 SSRC
/// 0x3000 on its transport. p2 (publishes nothing), p3 and p4 subscribe to p0; p2 and p3 to p1;
/// p0 to p3.
fn setup(s: &NetnsServe) {
    let tb = s.tb;
    s.api("POST", "/v1/rooms", Some(json!({"id": "f"})));
    for (i, p) in tb.peers.iter().enumerate() {
        let body = json!({"id": format!("p{i}"), "local": SocketAddr::new(p.sfu_ip, SFU_PORT), "remote": SocketAddr::new(p.ip, MEDIA_PORT)});
        s.api("POST", "/v1/rooms/f/participants", Some(body));
    }
    let publish = |p: &str, body: Value| s.api("POST", &format!("/v1/rooms/f/participants/{p}/streams"), Some(body));
    publish("p0", json!({"name": "v", "ssrc": P0_SSRC, "clock_rate": 90000}));
    publish("p1", json!({"name": "v", "ssrc": P1_SSRC, "local": SocketAddr::new(tb.peers[1].sfu_ip, SFU_PORT + 2)}));
    publish("p3", json!({"name": "v", "ssrc": P3_SSRC}));
    for (who, publisher) in [(2, 0), (3, 0), (4, 0), (2, 1), (3, 1), (0, 3)] {
        let body = json!({"publisher": format!("p{publisher}"), "stream": "v"});
        s.api("POST", &format!("/v1/rooms/f/participants/p{who}/subscriptions"), Some(body));
    }
}

fn rr(who: usize) -> Vec<u8> {
    build_report(RECEIVER[who], None, &[])
}

/// A receiver report of subscriber `who` about p0's stream, then `message`: what it sends.
fn feedback(who: usize, message: Vec<u8>) -> Vec<u8> {
    let block = ReportBlock { about: P0_SSRC, fraction_lost: 12, highest_seq: 2, jitter: 40, ..Default::default() };
    [build_report(RECEIVER[who], None, &[block]), message].concat()
}

/// What the routed feedback of subscriber `who` looks like at the publisher: an empty receiver
/// report from the subscriber (its own report stopped at the SFU), then the message.
fn routed(who: usize, message: Vec<u8>) -> Vec<u8> {
    [rr(who), message].concat()
}

type Received = BTreeMap<usize, Vec<(SocketAddr, Vec<u8>)>>;

fn drain(socks: &[UdpSocket]) -> Received {
    let mut got = Received::new();
    let mut buf = vec![0u8; 2048];
    for (i, s) in socks.iter().enumerate() {
        s.set_nonblocking(true).unwrap();
        let v = got.entry(i).or_default();
        while let Ok((n, from)) = s.recv_from(&mut buf) {
            v.push((from, buf[..n].to_vec()));
        }
    }
    got
}

fn run_plane(tb: &Testbed, plane: &str) {
    let tmp = common::TempDir::new("store");
    let serve = NetnsServe::start(tb, plane, &tmp.0.join("store.db"), &["--reset"]);
    setup(&serve);
    let socks: Vec<UdpSocket> = tb.peers.iter().map(|p| tb.udp_socket(&p.ns, SocketAddr::new(p.ip, MEDIA_PORT)).unwrap()).collect();
    let stranger = tb.udp_socket(&tb.peers[2].ns, SocketAddr::new(tb.peers[2].ip, STRANGER_PORT)).unwrap();
    // Neighbour entries first, as a real participant's signalling would have made them.
    for (i, s) in socks.iter().enumerate() {
        s.send_to(b"", SocketAddr::new(tb.peers[i].sfu_ip, 9)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    let sfu = |i: usize, port: u16| SocketAddr::new(tb.peers[i].sfu_ip, port);
    let send = |who: usize, packet: Vec<u8>| {
        socks[who].send_to(&packet, sfu(who, SFU_PORT)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    };

    let media: Vec<Vec<u8>> = (0..3u16).map(|seq| build_rtp(96, seq, 3000 * seq as u32, P0_SSRC, &[seq as u8; 400])).collect();
    media.iter().for_each(|m| send(0, m.clone()));
    // p1 publishes only (on a port of its own): its sender report reaches p2 and p3 (on the eBPF
    // planes through the slow path, which times it for their round-trip times).
    let sr_p1 = build_report(P1_SSRC, Some(SR_P1_NTP), &[]);
    socks[1].send_to(&sr_p1, sfu(1, SFU_PORT + 2)).unwrap();
    let sr_sent = Instant::now();
    std::thread::sleep(Duration::from_millis(5));
    // Three subscribers ask p0 for a keyframe at once: one request reaches it.
    send(2, feedback(2, build::pli(RECEIVER[2], P0_SSRC)));
    send(3, feedback(3, build::pli(RECEIVER[3], P0_SSRC)));
    send(4, feedback(4, build::fir(RECEIVER[4], &[(P0_SSRC, 1)])));
    // A NACK to p1, whose stream has its own port.
    let nack_p1 = build::nack(RECEIVER[2], P1_SSRC, 17, 0b11);
    send(2, feedback(2, nack_p1.clone()));
    // p3 publishes and subscribes on one address: its SR (and SDES) go to its subscriber p0,
    // the NACK in the same compound to p0 as the publisher of what it names.
    // Its SR's report block (about p0's stream) stops at the SFU too.
    let sr = build_report(P3_SSRC, Some(0x0102_0304), &[ReportBlock { about: P0_SSRC, ..Default::default() }]);
    let sdes = vec![0x81, 202, 0, 2, 0, 0, 0x30, 0, 0, 0, 0, 0];
    let nack_p0 = build::nack(P3_SSRC, P0_SSRC, 1, 0);
    send(3, [sr, sdes.clone(), nack_p0.clone()].concat());
    let sr_p3_sent = Instant::now();
    // Someone else's PLI to p2's address: spoofed.
    stranger.send_to(&feedback(2, build::pli(RECEIVER[2], P0_SSRC)), sfu(2, SFU_PORT)).unwrap();
    // An SSRC p2 does not receive; a bandwidth estimate; a NACK without its FCI (malformed).
    send(2, feedback(2, build::pli(RECEIVER[2], 0x9999)));
    send(2, feedback(2, build::remb(RECEIVER[2], 800_000, &[P0_SSRC])));
    send(2, feedback(2, vec![0x81, 205, 0, 2, 0, 0, 0, 0xa2, 0, 0, 0x10, 0]));
    // Past the coalescing interval, the next keyframe request goes through.
    std::thread::sleep(Duration::from_millis(600));
    send(3, feedback(3, build::pli(RECEIVER[3], P0_SSRC)));
    // p2 reports on p1's stream, echoing its SR held 500 ms (DLSR): the round-trip time is what
    // is left of the time since the SR passed. A report echoing an SR that never passed gives none.
    let dlsr = 0x8000;
    let echo = |lsr: u32| build_report(RECEIVER[2], None, &[ReportBlock { about: P1_SSRC, lsr, dlsr, ..Default::default() }]);
    let echoed_after = sr_sent.elapsed();
    send(2, echo(SR_P1_NTP));
    // p0 echoes p3's SR, which reached the SFU inside p3's feedback compound.
    let p3_echoed_after = sr_p3_sent.elapsed();
    send(0, build_report(RECEIVER[0], None, &[ReportBlock { about: P3_SSRC, lsr: 0x0102_0304, dlsr, ..Default::default() }]));
    send(4, build_report(RECEIVER[4], None, &[ReportBlock { about: P0_SSRC, lsr: 0x0bad_0bad, dlsr, ..Default::default() }]));
    std::thread::sleep(Duration::from_millis(300));

    let got = drain(&socks);
    // The user-space plane makes p0's video copies itself and keeps them: p3's NACK of one it
    // was sent is answered by the SFU (the copy again), not routed to p0. The eBPF planes'
    // kernel makes these copies (plain RTP): the NACK goes to p0.
    let answered = common::copies_in_user_space(plane);
    let mut want_p0 = vec![
        (sfu(0, SFU_PORT), routed(2, build::pli(RECEIVER[2], P0_SSRC))),
        (sfu(0, SFU_PORT), [build_report(P3_SSRC, Some(0x0102_0304), &[]), sdes].concat()),
        (sfu(0, SFU_PORT), routed(3, build::pli(RECEIVER[3], P0_SSRC))),
    ];
    if !answered {
        // Behind an empty report from the compound's sender (p3's media SSRC here).
        want_p0.push((sfu(0, SFU_PORT), [build_report(P3_SSRC, None, &[]), nack_p0].concat()));
    }
    want_p0.sort();
    let mut got_p0 = got[&0].clone();
    got_p0.sort();
    assert_eq!(got_p0, want_p0, "[{plane}] p0: one of the three keyframe requests, p3's report and NACK, the late PLI");
    assert_eq!(got[&1], vec![(sfu(1, SFU_PORT + 2), routed(2, nack_p1))], "[{plane}] p1: the NACK, from the port it sends to");
    for who in [2, 3, 4] {
        let mut want: Vec<_> = media.iter().map(|m| (sfu(who, SFU_PORT), m.clone())).collect();
        if who != 4 {
            want.push((sfu(who, SFU_PORT), sr_p1.clone()));
        }
        if who == 3 && answered {
            want.push((sfu(who, SFU_PORT), media[1].clone()));
        }
        assert_eq!(got[&who], want, "[{plane}] p{who}: p0's media (and p1's sender report) and nothing else");
    }

    let stats = serve.api("GET", "/v1/stats", None);
    let t = &stats["total"];
    let counts = |c: &Value| ["feedback_routed", "feedback_coalesced", "feedback_consumed", "feedback_unroutable"].map(|k| c[k].as_u64().unwrap_or(0));
    // Routed: p2's PLI, p2's NACK, p3's NACK (unless answered: consumed), p3's late PLI.
    // Coalesced: p3's PLI, p4's FIR. Consumed: ten receiver reports and the REMB. Unroutable:
    // the PLI for 0x9999.
    let (nack_routed, nack_consumed) = if answered { (0, 1) } else { (1, 0) };
    assert_eq!(counts(t), [3 + nack_routed, 2, 11 + nack_consumed, 1], "[{plane}] {t}");
    assert_eq!((t["drop_stranger"].as_u64(), t["drop_malformed"].as_u64()), (Some(1), Some(1)), "[{plane}] {t} {}", stats["extra"]);
    if plane.starts_with("ebpf") {
        assert_eq!(stats["extra"]["pass_feedback"].as_u64(), Some(12), "[{plane}] every consumer's RTCP went up: {}", stats["extra"]);
        assert_eq!(stats["extra"]["pass_rtcp"].as_u64(), Some(1), "[{plane}] the publisher's sender report went up: {}", stats["extra"]);
    }
    // Per published stream: what its subscribers asked of it.
    let streams = &stats["streams"];
    let by_label = |label: &str| streams.as_array().unwrap().iter().find(|s| s["label"] == label).unwrap_or_else(|| panic!("{label} in {streams}")).clone();
    assert_eq!(counts(&by_label("f/p0/v")), [2 + nack_routed, 2, nack_consumed, 0], "[{plane}]");
    assert_eq!(counts(&by_label("f/p1/v")), [1, 0, 0, 0], "[{plane}]");

    // Per consumer (one per subscription): the copies it was sent, what it asked for, what its
    // receiver reports and REMB said.
    let consumers = serve.api("GET", "/v1/rooms/f/consumers", None)["consumers"].as_array().unwrap().clone();
    assert_eq!(consumers.len(), 6, "[{plane}] {consumers:?}");
    let consumer = |sub: usize, publisher: usize| {
        let c = consumers.iter().find(|c| c["subscriber"] == format!("p{sub}") && c["publisher"] == format!("p{publisher}"));
        c.unwrap_or_else(|| panic!("p{sub}<-p{publisher} in {consumers:?}")).clone()
    };
    let sent = |c: &Value| ["tx_copies", "tx_bytes", "tx_errors", "feedback_routed", "feedback_coalesced"].map(|k| c[k].as_u64().unwrap());
    // p0's three 412-byte packets to each of its subscribers; p3's report (SR + SDES) to p0.
    assert_eq!(sent(&consumer(2, 0)), [3, 3 * 412, 0, 1, 0], "[{plane}] p2<-p0: its PLI went");
    assert_eq!(
        sent(&consumer(3, 0)),
        [3, 3 * 412, 0, 1 + nack_routed, 1],
        "[{plane}] p3<-p0: its NACK (unless answered) and late PLI went, its first PLI was coalesced"
    );
    assert_eq!(sent(&consumer(4, 0)), [3, 3 * 412, 0, 0, 1], "[{plane}] p4<-p0: its FIR was coalesced");
    assert_eq!(sent(&consumer(2, 1)), [1, 28, 0, 1, 0], "[{plane}] p2<-p1: p1's SR, its NACK");
    assert_eq!(sent(&consumer(3, 1)), [1, 28, 0, 0, 0], "[{plane}] p3<-p1: p1's SR");
    assert_eq!(sent(&consumer(0, 3)), [1, 28 + 12, 0, 0, 0], "[{plane}] p0<-p3: p3's SR and SDES");
    let p2 = consumer(2, 0);
    let report = &p2["report"];
    assert_eq!(
        (report["fraction_lost_pct"].as_f64(), report["highest_seq"].as_u64(), report["jitter"].as_u64()),
        (Some(12.0 * 100.0 / 256.0), Some(2), Some(40)),
        "[{plane}] {p2}"
    );
    assert!((report["jitter_ms"].as_f64().unwrap() - 40.0 / 90.0).abs() < 1e-9, "[{plane}] 90 kHz clock: {p2}");
    let remb = p2["remb_bps"].as_u64().unwrap();
    assert!((799_000..=800_000).contains(&remb), "[{plane}] {p2}");
    assert!(consumer(4, 0)["remb_bps"].is_null() && consumer(3, 1)["report"].is_null(), "[{plane}] REMB and reports belong to the consumer they name");
    // A consumer's round-trip time to the SFU: the time from the SR passing to the echo arriving,
    // less the 500 ms the consumer says it held it (loopback-fast here, so about what the test
    // waited beyond; 50 ms of slack for a loaded machine, well below the 500 ms a forgotten DLSR
    // would add).
    for (sub, publisher, waited) in [(2, 1, echoed_after), (0, 3, p3_echoed_after)] {
        let c = consumer(sub, publisher);
        let rtt = c["rtt_ms"].as_f64().unwrap_or_else(|| panic!("[{plane}] p{sub}<-p{publisher}: no RTT: {c}"));
        let expect = waited.as_secs_f64() * 1000.0 - 500.0;
        assert!((rtt - expect).abs() < 50.0, "[{plane}] p{sub}<-p{publisher}: RTT {rtt} ms, expected about {expect:.1} ms: {c}");
        assert!(c["rtt_age_ms"].as_u64().is_some(), "[{plane}] {c}");
    }
    for (sub, publisher) in [(2, 0), (3, 1), (4, 0)] {
        assert!(
            consumer(sub, publisher)["rtt_ms"].is_null(),
            "[{plane}] p{sub}<-p{publisher}: no report echoed an SR that passed: {}",
            consumer(sub, publisher)
        );
    }
    let one = serve.api("GET", &format!("/v1/rooms/f/consumers/{}", p2["id"]), None);
    assert_eq!(sent(&one), sent(&p2), "[{plane}] {one}");

    // A subscriber on a thin link NACKs everything: 40 NACKs of 17 numbers each, 5 ms apart,
    // and another subscriber asks at once for the first 17 again. p0 is asked each number once,
    // and no more of them than its stream's NACK budget: a burst of 64, then 20 a second (the
    // SFU sees none of p0's packets meanwhile).
    let t_flood = Instant::now();
    for k in 0..40u16 {
        send(4, feedback(4, build::nack(RECEIVER[4], P0_SSRC, 1000 + 17 * k, 0xffff)));
        if k == 0 {
            send(2, feedback(2, build::nack(RECEIVER[2], P0_SSRC, 1000, 0xffff)));
        }
    }
    let flood_secs = t_flood.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(300));
    let mut asked: Vec<u16> = Vec::new();
    for (from, p) in &drain(&socks)[&0] {
        // An empty receiver report, then the NACK: its FCI entries (packet id, bitmask).
        assert_eq!((*from, p[9]), (sfu(0, SFU_PORT), 205), "[{plane}] {p:?}");
        for e in p[20..].chunks_exact(4) {
            let (pid, blp) = (u16::from_be_bytes([e[0], e[1]]), u16::from_be_bytes([e[2], e[3]]));
            asked.push(pid);
            asked.extend((0..16).filter(|b| blp & (1 << b) != 0).map(|b| pid + b + 1));
        }
    }
    let n = asked.len();
    asked.sort();
    asked.dedup();
    assert_eq!(asked.len(), n, "[{plane}] a number asked twice");
    let bound = 64 + (20.0 * (flood_secs + 0.3)).ceil() as usize;
    assert!((63..=bound).contains(&n), "[{plane}] p0 asked for {n} of 680 numbers in {flood_secs:.2} s; the budget allows 64 + 20/s = {bound}");
}

#[test]
fn subscribers_feedback_reaches_publishers_on_every_data_plane() {
    if !mediaplane_bench::require_root("sfu_feedback") {
        return;
    }
    let tb = Testbed::star(N).unwrap();
    for plane in planes() {
        run_plane(&tb, &plane);
    }
}
