//! SRTP participants keyed at join (SDES), end to end through a real `serve` on loopback (the
//! user-space plane): a publisher's SRTP reaches a subscriber protected with the subscriber's
//! key, and the subscriber, which publishes nothing, gets its SRTCP keyframe request to the
//! publisher, protected with the publisher's key. (Its address has no stream entry of its own:
//! only its feedback needs the SRTP context there.)

mod common;

use common::{free_port, Daemon, TempDir};
use mediaplane_core::rtp::build_rtp;
use mediaplane_core::srtp::{SrtpKey, SrtpSuite};
use mediaplane_dataplane::srtp::{protect, unprotect, Context};
use serde_json::json;
use std::net::UdpSocket;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SUITE: SrtpSuite = SrtpSuite::AeadAes128Gcm;
const MEDIA_SSRC: u32 = 0x1000;
const SUBSCRIBER_SSRC: u32 = 0x2000;

fn key(seed: u8) -> SrtpKey {
    SrtpKey::new(SUITE, (0..SUITE.master_len() as u8).map(|b| b ^ seed).collect()).unwrap()
}

fn b64(k: &SrtpKey) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(&k.master)
}

/// The next datagram on `sock` that `open` accepts, within 3 s.
fn receive<T>(sock: &UdpSocket, mut open: impl FnMut(&[u8]) -> Option<T>) -> Option<T> {
    sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let until = Instant::now() + Duration::from_secs(3);
    let mut buf = [0u8; 2048];
    while Instant::now() < until {
        if let Ok(n) = sock.recv(&mut buf) {
            if let Some(t) = open(&buf[..n]) {
                return Some(t);
            }
        }
    }
    None
}

#[test]
fn an_sdes_subscriber_gets_protected_copies_and_its_srtcp_keyframe_request_reaches_the_publisher() {
    let dir = TempDir::new("sdes-room");
    let d = Daemon::start(&dir.0.join("s.db"), &["--dataplane", "userspace"]);
    let (publisher, subscriber) = (UdpSocket::bind("127.0.0.1:0").unwrap(), UdpSocket::bind("127.0.0.1:0").unwrap());
    let (pub_local, sub_local) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    // Each participant: the key it protects with (inbound), the one the SFU protects to it with.
    let (pub_in, pub_out, sub_in, sub_out) = (key(1), key(2), key(3), key(4));
    assert_eq!(d.call("POST", "/v1/rooms", Some(json!({"id": "r"}))).0, 201);
    for (id, local, sock, inbound, outbound) in [("pub", &pub_local, &publisher, &pub_in, &pub_out), ("sub", &sub_local, &subscriber, &sub_in, &sub_out)] {
        let srtp = json!({"suite": SUITE.name(), "inbound": b64(inbound), "outbound": b64(outbound)});
        let body = json!({"id": id, "local": local, "remote": sock.local_addr().unwrap(), "srtp": srtp});
        let (s, v) = d.call("POST", "/v1/rooms/r/participants", Some(body));
        assert_eq!(s, 201, "{v}");
    }
    let (s, v) = d.call("POST", "/v1/rooms/r/participants/pub/streams", Some(json!({"name": "video", "ssrc": MEDIA_SSRC})));
    assert_eq!(s, 201, "{v}");
    let (s, v) = d.call("POST", "/v1/rooms/r/participants/sub/subscriptions", Some(json!({"publisher": "pub", "stream": "video"})));
    assert_eq!(s, 201, "{v}");

    // Media: protected by the publisher with its key, unprotected by the subscriber with its own.
    let seal = Arc::new(Context::new(&pub_in, true).unwrap());
    let open = Arc::new(Context::new(&sub_out, false).unwrap());
    let mut copy = None;
    for seq in 0..20u16 {
        let clear = build_rtp(96, seq, 3000 * u32::from(seq), MEDIA_SSRC, &[seq as u8; 600]);
        publisher.send_to(&protect(Some(&seal), &clear).unwrap(), &pub_local).unwrap();
        copy = receive(&subscriber, |p| unprotect(Some(&open), p).ok().filter(|c| *c == clear));
        if copy.is_some() {
            break;
        }
    }
    assert!(copy.is_some(), "the subscriber received no copy it could unprotect with its key");

    // Feedback: a receiver report and a PLI for the publisher's SSRC, SRTCP under the
    // subscriber's key, from its address.
    let mut rtcp = vec![0x80, 201, 0, 1];
    rtcp.extend_from_slice(&SUBSCRIBER_SSRC.to_be_bytes());
    rtcp.extend_from_slice(&[0x81, 206, 0, 2]);
    rtcp.extend_from_slice(&SUBSCRIBER_SSRC.to_be_bytes());
    rtcp.extend_from_slice(&MEDIA_SSRC.to_be_bytes());
    let sub_seal = Arc::new(Context::new(&sub_in, true).unwrap());
    subscriber.send_to(&protect(Some(&sub_seal), &rtcp).unwrap(), &sub_local).unwrap();
    let pub_open = Arc::new(Context::new(&pub_out, false).unwrap());
    let pli = receive(&publisher, |p| {
        let clear = unprotect(Some(&pub_open), p).ok()?;
        // Walk the compound for a PLI (PT 206, FMT 1) about the publisher's SSRC.
        let mut at = 0;
        while at + 12 <= clear.len() {
            let len = 4 * (usize::from(u16::from_be_bytes([clear[at + 2], clear[at + 3]])) + 1);
            if clear[at + 1] == 206 && clear[at] & 0x1f == 1 && clear[at + 8..at + 12] == MEDIA_SSRC.to_be_bytes() {
                return Some(());
            }
            at += len;
        }
        None
    });
    let (_, stats) = d.call("GET", "/v1/stats", None);
    assert!(pli.is_some(), "no SRTCP PLI reached the publisher; stats: {stats}");
    for k in ["srtp_auth_failed", "srtp_no_key", "srtp_invalid"] {
        assert_eq!(stats["extra"][k], 0, "{k}: {stats}");
    }
}
