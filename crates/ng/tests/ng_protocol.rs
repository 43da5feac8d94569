//! The NG protocol over real UDP against serve_ng with a real SessionManager and the user-space
//! data plane: offer/answer, RTP and RTCP both ways through the allocated ports, re-INVITE,
//! retransmissions, malformed input, delete, media timeout. Loopback only (127.82.0.0/16).

mod common;

use common::*;
use mediaplane_core::call_quality::{build_report, ReportBlock};
use mediaplane_core::rtp::build_rtp;
use mediaplane_ng::bencode::Value;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

const CALL: &str = "3c26700fba4b-ng-protocol@127.82.0.1";

fn sdp(ip: &str, port: u16, sess: u32) -> String {
    g711_sdp(ip, port, sess, 8)
}

fn req(cmd: &str, from: &str, to: Option<&str>, body: &str) -> Vec<(&'static str, Value)> {
    offer_answer(cmd, CALL, from, to, body, "127.0.0.1")
}

/// Send one packet so the relay latches the sender, and wait until it did.
fn latch(relay: &Relay, from: &UdpSocket, to: SocketAddr, payload: &[u8]) {
    from.send_to(payload, to).unwrap();
    let src = from.local_addr().unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        let done = relay.mgr.read(|m, _| m.relays.values().any(|r| r.a.latched == Some(src) || r.b.latched == Some(src)));
        if done {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{src} never latched");
}

fn send_rtp(from: &UdpSocket, to: SocketAddr, seqs: std::ops::Range<u16>) {
    for s in seqs {
        from.send_to(&build_rtp(8, s, s as u32 * 160, 0xabc, &[0xd5; 160]), to).unwrap();
    }
}

fn rtcp_rr(ssrc: u32) -> Vec<u8> {
    let mut p = vec![0x80, 201, 0, 1];
    p.extend_from_slice(&ssrc.to_be_bytes());
    p
}

/// An SR of `ssrc` whose NTP time has `ntp_middle` as its middle 32 bits, or (`None`) an RR,
/// with a report block (about, fraction lost, cumulative lost, jitter, LSR, DLSR) or none.
fn rtcp_report(ssrc: u32, ntp_middle: Option<u32>, block: Option<(u32, u8, i32, u32, u32, u32)>) -> Vec<u8> {
    let blocks: Vec<ReportBlock> = block
        .map(|(about, fraction_lost, cumulative_lost, jitter, lsr, dlsr)| ReportBlock {
            about,
            fraction_lost,
            cumulative_lost,
            jitter,
            lsr,
            dlsr,
            ..Default::default()
        })
        .into_iter()
        .collect();
    build_report(ssrc, ntp_middle, &blocks)
}

#[test]
fn call_flow_over_real_sockets() {
    let relay = Relay::start("127.82.0.1", 41000, 41099, Duration::from_secs(60));
    let mut ng = ng_client(relay.ng);
    assert_eq!(text(&ng.cmd(vec![("command", "ping".into())]), "result"), "pong");

    // Caller A at 127.82.1.1:6000 (RTCP 6001), callee B at 127.82.2.1:7000 (RTCP 7001).
    let a = udp("127.82.1.1:6000");
    let a_rtcp = udp("127.82.1.1:6001");
    let b = udp("127.82.2.1:7000");
    let b_rtcp = udp("127.82.2.1:7001");

    let offer = ng.cmd(req("offer", "tagA", None, &sdp("127.82.1.1", 6000, 1)));
    let to_b = advertised(&offer); // where B sends
    assert_eq!(to_b.ip().to_string(), "127.82.0.1");
    assert!(text(&offer, "sdp").contains("o=- 1 1 IN IP4 127.82.0.1\r\n"), "replace origin");
    let answer = ng.cmd(req("answer", "tagA", Some("tagB"), &sdp("127.82.2.1", 7000, 2)));
    let to_a = advertised(&answer); // where A sends
    assert_ne!(to_a, to_b);
    assert_eq!(relay.relays(), 2, "RTP and RTCP relay pairs");

    // The first packet of each leg latches its source and is relayed; then media flows.
    latch(&relay, &a, to_a, &build_rtp(8, 0, 0, 0xabc, &[0; 160]));
    latch(&relay, &b, to_b, &build_rtp(8, 0, 0, 0xdef, &[0; 160]));
    send_rtp(&a, to_a, 1..21);
    send_rtp(&b, to_b, 101..121);
    let at_b = drain(&b);
    let at_a = drain(&a);
    assert_eq!(at_b.iter().map(|x| x.0).collect::<Vec<_>>(), (0..21).collect::<Vec<_>>());
    assert!(at_b.iter().all(|x| x.1 == to_b), "B hears from the address it sends to (symmetric RTP)");
    assert_eq!(at_a.iter().map(|x| x.0).collect::<Vec<_>>(), std::iter::once(0).chain(101..121).collect::<Vec<_>>());
    assert!(at_a.iter().all(|x| x.1 == to_a));

    // RTCP on the odd ports.
    let rtcp_a = SocketAddr::new(to_a.ip(), to_a.port() + 1);
    let rtcp_b = SocketAddr::new(to_b.ip(), to_b.port() + 1);
    latch(&relay, &a_rtcp, rtcp_a, &rtcp_rr(0xabc));
    latch(&relay, &b_rtcp, rtcp_b, &rtcp_rr(0xdef));
    a_rtcp.send_to(&rtcp_rr(0xabc), rtcp_a).unwrap();
    b_rtcp.send_to(&rtcp_rr(0xdef), rtcp_b).unwrap();
    assert_eq!(drain(&b_rtcp).len(), 2, "the latching report and this one");
    assert_eq!(drain(&a_rtcp).len(), 2);

    // query reports both tags and the packets.
    let q = ng.cmd(vec![("command", "query".into()), ("call-id", CALL.into())]);
    let rtp_packets = q.get("totals").unwrap().get("RTP").unwrap().get("packets").unwrap().as_int().unwrap();
    // 21 each way: the latching packets are relayed too.
    assert_eq!(rtp_packets, 42, "{q:?}");

    // re-INVITE from A: A moves to port 6010; the relay keeps its ports, in one model change.
    let a2 = udp("127.82.1.1:6010");
    let version = relay.mgr.read(|_, t| t.version);
    let (reinvite, re_offer) = ng.call(req("offer", "tagA", Some("tagB"), &sdp("127.82.1.1", 6010, 3)));
    assert_eq!(advertised(&re_offer), to_b);
    assert_eq!(relay.mgr.read(|_, t| t.version), version + 1, "one atomic mutation");
    let re_answer = ng.cmd(req("answer", "tagA", Some("tagB"), &sdp("127.82.2.1", 7000, 4)));
    assert_eq!(advertised(&re_answer), to_a);
    latch(&relay, &a2, to_a, &build_rtp(8, 200, 0, 0xabc, &[0; 160]));
    send_rtp(&a2, to_a, 201..206);
    send_rtp(&b, to_b, 301..306);
    assert_eq!(drain(&b).len(), 6);
    assert_eq!(drain(&a2).iter().map(|x| x.0).collect::<Vec<_>>(), (301..306).collect::<Vec<_>>(), "B's media goes to A's new port");
    assert!(drain(&a).is_empty(), "and no longer to the old one");

    // A retransmitted request (same cookie) gets the same reply and is not executed again.
    let version = relay.mgr.read(|_, t| t.version);
    let first = ng.reply_to(&reinvite).unwrap();
    let again = ng.reply_to(&reinvite).unwrap();
    assert_eq!(first, again);
    assert_eq!(relay.mgr.read(|_, t| t.version), version);

    // Malformed input: error replies with reasons; no cookie, no reply; the server survives.
    for (bad, why) in [(&b"x1 d7:command"[..], "malformed bencode"), (b"x2 i5e", "not a bencoded dictionary"), (b"x3 d7:command5:xyzzye", "unknown command")] {
        let (_, v) = mediaplane_ng::protocol::parse_frame(&ng.reply_to(bad).unwrap()).unwrap();
        assert_eq!(text(&v, "result"), "error");
        assert!(text(&v, "error-reason").contains(why), "{v:?}");
    }
    ng.socket().set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    assert!(ng.reply_to(b"no-space-no-cookie").is_none());
    ng.socket().set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    assert_eq!(text(&ng.cmd(vec![("command", "ping".into())]), "result"), "pong");

    // delete frees everything: relays, model addresses, and the sockets themselves.
    let d = ng.cmd(vec![("command", "delete".into()), ("call-id", CALL.into()), ("from-tag", "tagA".into()), ("to-tag", "tagB".into())]);
    assert_eq!(text(&d, "result"), "ok", "{d:?}");
    assert_eq!(relay.relays(), 0);
    assert_eq!(relay.mgr.read(|m, _| m.local_addresses().count()), 0);
    for addr in [to_a, to_b, rtcp_a, rtcp_b] {
        UdpSocket::bind(addr).unwrap_or_else(|e| panic!("{addr} still held after delete: {e}"));
    }
    let l = ng.cmd(vec![("command", "list".into())]);
    assert_eq!(l.get("calls").unwrap().as_list().unwrap().len(), 0);
}

#[test]
fn idle_calls_time_out() {
    let relay = Relay::start("127.82.0.2", 41100, 41199, Duration::from_secs(2));
    let mut ng = ng_client(relay.ng);
    let created = Instant::now();
    let o = ng.cmd(req("offer", "tagA", None, &sdp("127.82.3.1", 6000, 1)));
    assert_eq!(text(&o, "result"), "ok");
    assert_eq!(relay.relays(), 2);
    let deadline = Instant::now() + Duration::from_secs(8);
    while relay.relays() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = created.elapsed();
    assert_eq!(relay.relays(), 0, "deleted after 2 s without media");
    // Never early; late by at most one sweep (500 ms for a 2 s timeout) and some slack.
    assert!(took >= Duration::from_secs(2) && took < Duration::from_millis(2800), "a 2 s media timeout fired after {took:?}");
    let s = ng.cmd(vec![("command", "statistics".into())]);
    let total = s.get("statistics").unwrap().get("totalstatistics").unwrap();
    assert_eq!(total.get("timeoutsessions"), Some(&Value::Int(1)), "{s:?}");
}

fn path<'v>(v: &'v Value, keys: &[&str]) -> &'v Value {
    keys.iter().fold(v, |v, k| v.get(k).unwrap_or_else(|| panic!("no {k:?} in {v:?}")))
}

fn int_at(v: &Value, keys: &[&str]) -> i64 {
    path(v, keys).as_int().unwrap_or_else(|| panic!("{keys:?} is not an integer in {v:?}"))
}

/// `query`, `delete` and `statistics` replies carry every key path rtpengine 10.5's do (the
/// captured reference, tests/data), with the same types, filled from a real call with RTP and
/// RTCP both ways (SRs and reports, so that an SSRC has a MOS): nothing is left out.
#[test]
fn replies_carry_rtpengines_key_sets() {
    let relay = Relay::start("127.82.0.3", 41200, 41299, Duration::from_secs(60));
    let mut ng = ng_client(relay.ng);
    let call = "keysets@127.82.0.3";
    let (a, a_rtcp, b, b_rtcp) = (udp("127.82.6.1:6000"), udp("127.82.6.1:6001"), udp("127.82.7.1:7000"), udp("127.82.7.1:7001"));
    let offer = ng.cmd(offer_answer("offer", call, "tagA", None, &sdp("127.82.6.1", 6000, 1), "127.0.0.1"));
    let to_b = advertised(&offer);
    let answer = ng.cmd(offer_answer("answer", call, "tagA", Some("tagB"), &sdp("127.82.7.1", 7000, 2), "127.0.0.1"));
    let to_a = advertised(&answer);
    latch(&relay, &a, to_a, &build_rtp(8, 0, 0, 0xabc, &[0; 160]));
    latch(&relay, &b, to_b, &build_rtp(8, 0, 0, 0xdef, &[0; 160]));
    send_rtp(&a, to_a, 1..50);
    send_rtp(&b, to_b, 1..30);
    let (rtcp_a, rtcp_b) = (SocketAddr::new(to_a.ip(), to_a.port() + 1), SocketAddr::new(to_b.ip(), to_b.port() + 1));
    latch(&relay, &a_rtcp, rtcp_a, &rtcp_rr(0xabc));
    latch(&relay, &b_rtcp, rtcp_b, &rtcp_rr(0xdef));
    // Each party's SR, and the other's report echoing it 20 ms later: the round-trip time of
    // both legs, so a MOS for A (B reported before A's leg was known: no MOS for B yet, and its
    // next report within a second is not taken).
    a_rtcp.send_to(&rtcp_report(0xabc, Some(0x0001_0000), None), rtcp_a).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    b_rtcp.send_to(&rtcp_report(0xdef, None, Some((0xabc, 26, 3, 80, 0x0001_0000, 1))), rtcp_b).unwrap();
    b_rtcp.send_to(&rtcp_report(0xdef, Some(0x0002_0000), Some((0xabc, 26, 3, 80, 0x0001_0000, 1))), rtcp_b).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    a_rtcp.send_to(&rtcp_report(0xabc, None, Some((0xdef, 0, 0, 16, 0x0002_0000, 1))), rtcp_a).unwrap();
    assert_eq!((drain(&b_rtcp).len(), drain(&a_rtcp).len()), (3, 3), "RTCP relayed both ways");
    let sent_at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    assert_eq!((drain(&b).len(), drain(&a).len()), (50, 30));

    // The reports reach the evaluation through the control plane's event thread: wait for it.
    let query = |ng: &mut NgClient| ng.cmd(vec![("command", "query".into()), ("call-id", call.into())]);
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut q = query(&mut ng);
    while q.get("SSRC").and_then(|s| s.get("2748")).and_then(|a| a.get("average MOS")).is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        q = query(&mut ng);
    }
    let missing = missing_key_paths(&rtpengine_key_paths("query"), &q, &[]);
    assert!(missing.is_empty(), "query lacks rtpengine's {missing:#?}\n{q:?}");
    // The values: A's RTP stream is what A sent to the relay's port for A.
    let a_media = &path(&q, &["tags", "tagA", "medias"]).as_list().unwrap()[0];
    assert_eq!(text(a_media, "codec"), "PCMA/8000");
    let a_rtp = &path(a_media, &["streams"]).as_list().unwrap()[0];
    assert_eq!((int_at(a_rtp, &["local port"]), text(a_rtp, "local address")), (to_a.port() as i64, "127.82.0.3".to_string()));
    assert_eq!((text(path(a_rtp, &["endpoint"]), "address"), int_at(a_rtp, &["endpoint", "port"])), ("127.82.6.1".to_string(), 6000));
    assert_eq!((int_at(a_rtp, &["stats", "packets"]), int_at(a_rtp, &["stats", "bytes"])), (50, 50 * 172));
    assert!((sent_at - 1..=sent_at + 1).contains(&int_at(a_rtp, &["last packet"])), "last packet of A's RTP: {a_rtp:?}, sent at {sent_at}");
    assert_eq!(text(path(&q, &["tags", "tagA"]), "in dialogue with"), "tagB");
    assert_eq!((int_at(&q, &["totals", "RTP", "packets"]), int_at(&q, &["totals", "RTCP", "packets"])), (80, 6));
    // A's MOS (SSRC 0xabc = 2748): both legs' round-trip times (≥ 20 ms each), the jitter of
    // B's last report on A in ms, its loss in %; rtpengine's formula on those.
    let a_mos = path(&q, &["SSRC", "2748", "average MOS"]);
    let (rtt, leg) = (int_at(a_mos, &["round-trip time"]), int_at(a_mos, &["round-trip time leg"]));
    assert!((40_000..2_000_000).contains(&rtt) && (20_000..rtt).contains(&leg), "{a_mos:?}");
    assert_eq!((int_at(a_mos, &["jitter"]), int_at(a_mos, &["packet loss"]), int_at(a_mos, &["samples"])), (2, 0, 1), "{a_mos:?}");
    assert_eq!(int_at(a_mos, &["MOS"]), mediaplane_core::call_quality::mos_x10(rtt as u64, 2, 0) as i64);
    assert_eq!(path(&q, &["SSRC", "2748", "lowest MOS"]).get("MOS"), a_mos.get("MOS"));
    // B (SSRC 0xdef = 3567) sent no RTP, and its only kept report came before A's leg was known.
    assert!(path(&q, &["SSRC"]).get("3567").is_none(), "{q:?}");

    let s = ng.cmd(vec![("command", "statistics".into())]);
    let missing = missing_key_paths(&rtpengine_key_paths("statistics"), &s, &[]);
    assert!(missing.is_empty(), "statistics lacks rtpengine's {missing:#?}\n{s:?}");
    let proxy = &path(&s, &["statistics", "controlstatistics", "proxies"]).as_list().unwrap()[0];
    assert_eq!((text(proxy, "proxy"), int_at(proxy, &["offercount"]), int_at(proxy, &["querycount"])), ("127.0.0.1".to_string(), 1, 1));
    assert_eq!(int_at(&s, &["statistics", "currentstatistics", "sessionsown"]), 1);
    // Every MOS computed: A's one.
    assert_eq!(int_at(&s, &["statistics", "mos", "mos_samples_total"]), 1, "{s:?}");
    assert_eq!(text(path(&s, &["statistics", "mos"]), "mos_average"), format!("{:.6}", int_at(a_mos, &["MOS"]) as f64 / 10.0));
    let interface = &path(&s, &["statistics", "interfaces"]).as_list().unwrap()[0];
    assert_eq!(
        (text(interface, "address"), int_at(interface, &["ports", "used"]), int_at(interface, &["ports", "totals"])),
        ("127.82.0.3".to_string(), 4, 100)
    );

    let d = ng.cmd(vec![("command", "delete".into()), ("call-id", call.into()), ("from-tag", "tagA".into())]);
    let missing = missing_key_paths(&rtpengine_key_paths("delete"), &d, &[]);
    assert!(missing.is_empty(), "delete lacks rtpengine's {missing:#?}\n{d:?}");
    assert_eq!(int_at(&d, &["totals", "RTP", "packets"]), 80, "the call's final counters");
    let s = ng.cmd(vec![("command", "statistics".into())]);
    let total = path(&s, &["statistics", "totalstatistics"]);
    assert_eq!((int_at(total, &["regularterminatedsessions"]), int_at(total, &["managedsessions"])), (1, 1));
    assert_eq!(int_at(total, &["relayedpackets"]), 86, "every packet relayed, the ended call's included: {total:?}");
    assert_eq!(int_at(total, &["onewaystreams"]) + int_at(total, &["zerowaystreams"]), 0);
}
