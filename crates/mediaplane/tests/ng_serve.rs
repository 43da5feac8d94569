//! The real daemon speaking NG: `mediaplane serve --ng-listen` (user-space plane, loopback
//! 127.84.0.0/16), driven like Kamailio's rtpengine module drives rtpengine: ping, offer/answer
//! with SDP, RTP both ways through the allocated ports with real sockets (the first packet of each
//! leg is consumed by latching), query, malformed requests (error replies, the daemon lives on),
//! delete (everything freed: the HTTP relay list is empty and the ports can be bound again).

mod common;
mod ng_common;

use common::{Daemon, TempDir};
use mediaplane_core::rtp::build_rtp;
use mediaplane_ng::bencode::Value;
use ng_common::*;
use serde_json::Value as Json;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

const MEDIA_IP: &str = "127.84.0.1";
const CALLER_IP: &str = "127.84.1.1";
const CALLEE_IP: &str = "127.84.2.1";
const CALL: &str = "a84b4c76e66710@ng-serve.test";

fn send_rtp(from: &UdpSocket, to: SocketAddr, ssrc: u32, seqs: std::ops::Range<u16>) {
    for s in seqs {
        from.send_to(&build_rtp(8, s, s as u32 * 160, ssrc, &[0xd5; 160]), to).unwrap();
    }
}

/// The daemon's view of one relay (HTTP API).
fn relay(d: &Daemon, id: &str) -> Json {
    let (code, v) = d.call("GET", &format!("/v1/relays/{id}"), None);
    assert_eq!(code, 200, "{v}");
    v
}

/// Send the first packet of a leg and wait until the daemon latched its source.
fn latch(d: &Daemon, id: &str, side: &str, from: &UdpSocket, to: SocketAddr, ssrc: u32) {
    from.send_to(&build_rtp(8, 0, 0, ssrc, &[0xd5; 160]), to).unwrap();
    let src = from.local_addr().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if relay(d, id)[side]["latched"].as_str() == Some(src.as_str()) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("leg {side} of {id} never latched {src}: {}", relay(d, id));
}

#[test]
fn ng_call_through_the_real_daemon() {
    let tmp = TempDir::new("ng-serve");
    let cfg = tmp.0.join("mediaplane.toml");
    std::fs::write(&cfg, format!("[media]\nip = \"{MEDIA_IP}\"\nport_min = 42000\nport_max = 42199\n")).unwrap();
    let ng_addr: SocketAddr = format!("127.0.0.1:{}", free_udp_port()).parse().unwrap();
    let mut d = Daemon::start(&tmp.0.join("store.db"), &["--config", cfg.to_str().unwrap(), "--ng-listen", &ng_addr.to_string(), "--reset"]);
    let mut ng = ng_client(ng_addr);

    assert_eq!(text(&ng.cmd(vec![("command", "ping".into())]), "result"), "pong");

    // Caller A receives RTP on 127.84.1.1:6000, callee B on 127.84.2.1:7000.
    let a = udp(&format!("{CALLER_IP}:6000"));
    let b = udp(&format!("{CALLEE_IP}:7000"));
    let offer = ng.cmd(offer_answer("offer", CALL, "tagA", None, &sdp(CALLER_IP, 6000, 1), CALLER_IP));
    let to_b = advertised(&offer); // where B sends
    assert_eq!(to_b.ip().to_string(), MEDIA_IP);
    assert!((42000..=42199).contains(&to_b.port()));
    assert!(text(&offer, "sdp").contains(&format!("o=- 1 1 IN IP4 {MEDIA_IP}\r\n")), "replace origin: {offer:?}");
    let answer = ng.cmd(offer_answer("answer", CALL, "tagA", Some("tagB"), &sdp(CALLEE_IP, 7000, 2), CALLEE_IP));
    let to_a = advertised(&answer); // where A sends
    assert_eq!(to_a.ip().to_string(), MEDIA_IP);
    assert_ne!(to_a, to_b);

    let (_, relays) = d.call("GET", "/v1/relays", None);
    assert_eq!(relays["relays"].as_array().unwrap().len(), 2, "RTP and RTCP relay pairs: {relays}");
    let id = rtp_relay(CALL);
    let r = relay(&d, &id);
    assert_eq!(r["a"]["local"], to_a.to_string(), "{r}");
    assert_eq!(r["a"]["remote"], format!("{CALLER_IP}:6000"));
    assert_eq!(r["b"]["local"], to_b.to_string());
    assert_eq!(r["b"]["remote"], format!("{CALLEE_IP}:7000"));

    // The first packet of each leg latches its source and is relayed; then media flows.
    latch(&d, &id, "a", &a, to_a, 0xa11ce);
    latch(&d, &id, "b", &b, to_b, 0xb0b);
    assert_eq!(
        (drain(&b).iter().map(|x| x.0).collect::<Vec<_>>(), drain(&a).iter().map(|x| x.0).collect::<Vec<_>>()),
        (vec![0], vec![0]),
        "latching packets are relayed"
    );
    send_rtp(&a, to_a, 0xa11ce, 1..51);
    send_rtp(&b, to_b, 0xb0b, 101..151);
    let at_b = drain(&b);
    let at_a = drain(&a);
    assert_eq!(at_b.iter().map(|x| x.0).collect::<Vec<_>>(), (1..51).collect::<Vec<_>>(), "A → B, in order, no loss");
    assert!(at_b.iter().all(|x| x.1 == to_b), "B hears from the address it sends to (symmetric RTP)");
    assert_eq!(at_a.iter().map(|x| x.0).collect::<Vec<_>>(), (101..151).collect::<Vec<_>>(), "B → A");
    assert!(at_a.iter().all(|x| x.1 == to_a));

    // query: both tags, 51 packets each way relayed; the latching packets went to the slow path.
    let q = ng.cmd(vec![("command", "query".into()), ("call-id", CALL.into())]);
    assert_eq!(text(&q, "result"), "ok", "{q:?}");
    let tags = q.get("tags").unwrap().as_dict().unwrap();
    assert!(tags.contains_key(&b"tagA"[..]) && tags.contains_key(&b"tagB"[..]), "{q:?}");
    let rtp = q.get("totals").unwrap().get("RTP").unwrap();
    assert_eq!(rtp.get("packets").and_then(Value::as_int), Some(102), "{q:?}");
    // Per SSRC, what the relay measured in the path: A sent 0..=50 in order; B sent 0, then
    // 101..=150, so 100 sequence numbers never arrived.
    let ssrc = |id: u32, key: &str| q.get("SSRC").and_then(|d| d.get(&id.to_string())).and_then(|s| s.get(key)).and_then(Value::as_int);
    assert_eq!((ssrc(0xa11ce, "packets"), ssrc(0xa11ce, "cumulative loss"), ssrc(0xa11ce, "expected packets")), (Some(51), Some(0), Some(51)), "{q:?}");
    assert_eq!((ssrc(0xb0b, "packets"), ssrc(0xb0b, "cumulative loss"), ssrc(0xb0b, "expected packets")), (Some(51), Some(100), Some(151)), "{q:?}");
    assert!(ssrc(0xa11ce, "jitter").is_some(), "PCMA/8000 gives the clock rate: {q:?}");
    let a_stream = tags[&b"tagA"[..]].get("medias").and_then(|m| m.as_list()).and_then(|m| m[0].get("streams")).and_then(|s| s.as_list()).map(|s| s[0].clone());
    assert_eq!(a_stream.as_ref().and_then(|s| s.get("SSRC")).and_then(Value::as_int), Some(0xa11ce), "{q:?}");
    let (_, stats) = d.call("GET", "/v1/stats", None);
    assert_eq!(stats["total"]["slow_unlatched"], 2, "{stats}");
    let rx = stats["streams"].as_array().unwrap().iter().find_map(|s| s.get("reception").filter(|r| r["ssrc"] == 0xb0b)).cloned();
    assert_eq!(rx.as_ref().map(|r| (r["packets"].clone(), r["lost"].clone())), Some((51.into(), 100.into())), "{stats}");
    assert_eq!(stats["total"]["tx_copies"], 102, "{stats}");

    // Malformed requests: error replies with a reason; no cookie, no reply; the daemon lives on.
    for (bad, why) in [
        (&b"m1 d7:command"[..], "malformed bencode"),
        (b"m2 i5e", "not a bencoded dictionary"),
        (b"m3 d7:command5:xyzzye", "unknown command"),
        (b"m4 d7:command5:offere", "missing key \"call-id\""),
        (b"m5 d7:command5:offer7:call-id3:xyz8:from-tag1:a3:sdp5:helloe", "invalid SDP"),
    ] {
        let reply = ng.reply_to(bad).expect("an error reply");
        let (_, v) = mediaplane_ng::protocol::parse_frame(&reply).unwrap();
        assert_eq!(text(&v, "result"), "error", "{v:?}");
        assert!(text(&v, "error-reason").contains(why), "{why}: {v:?}");
    }
    ng.socket().set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    assert!(ng.reply_to(b"no-cookie-no-space").is_none());
    assert!(ng.reply_to(&[0xff; 3000]).is_none());
    ng.socket().set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(d.alive(), "the daemon survived malformed NG");
    assert_eq!(text(&ng.cmd(vec![("command", "ping".into())]), "result"), "pong");
    send_rtp(&a, to_a, 0xa11ce, 51..56);
    assert_eq!(drain(&b).len(), 5, "and still relays");

    // delete frees everything: relays, and the ports (they can be bound again).
    let del = ng.cmd(delete(CALL, "tagA", "tagB"));
    assert_eq!(text(&del, "result"), "ok", "{del:?}");
    assert!(del.get("warning").is_none(), "{del:?}");
    let (_, relays) = d.call("GET", "/v1/relays", None);
    assert_eq!(relays["relays"], serde_json::json!([]), "{relays}");
    let (code, _) = d.call("GET", &format!("/v1/relays/{id}"), None);
    assert_eq!(code, 404);
    for addr in [to_a, to_b, SocketAddr::new(to_a.ip(), to_a.port() + 1), SocketAddr::new(to_b.ip(), to_b.port() + 1)] {
        UdpSocket::bind(addr).unwrap_or_else(|e| panic!("{addr} still held after delete: {e}"));
    }
    let l = ng.cmd(vec![("command", "list".into())]);
    assert_eq!(l.get("calls").unwrap().as_list().unwrap().len(), 0, "{l:?}");
    send_rtp(&a, to_a, 0xa11ce, 60..65);
    assert!(drain(&b).is_empty(), "nothing relayed after delete");

    // A second call reuses the freed ports.
    let offer = ng.cmd(offer_answer("offer", "second-call", "x", None, &sdp(CALLER_IP, 6002, 3), CALLER_IP));
    assert_eq!(text(&offer, "result"), "ok");
    assert_eq!(text(&ng.cmd(delete("second-call", "x", "")), "result"), "ok");

    assert!(d.terminate().success(), "clean exit on SIGTERM");
}
