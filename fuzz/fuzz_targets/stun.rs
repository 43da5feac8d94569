//! STUN (RFC 8489) and the ICE-lite agent that answers it on WebRTC legs: never panic on any
//! datagram; every reply the agent sends parses back, carries a FINGERPRINT that matches, and,
//! for an answered check, a MESSAGE-INTEGRITY under our password. Half of the inputs are turned
//! into a correctly signed binding request first (the fuzzer's bytes become its attributes), so
//! the paths behind the integrity check are reached too.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_webrtc::ice::{CheckOutcome, Credentials, LiteAgent};
use mediaplane_webrtc::stun::{attr, Builder, Class, Message, BINDING};
use std::net::SocketAddr;

const LOCAL_UFRAG: &str = "fuzzlocl";
const LOCAL_PWD: &str = "fuzz-local-password-0123";
const REMOTE_UFRAG: &str = "fuzzremt";

fn creds(ufrag: &str, pwd: &str) -> Credentials {
    Credentials { ufrag: ufrag.into(), pwd: pwd.into() }
}

/// A binding request signed with our password: USERNAME, then attributes cut from `data`
/// (type u16, length u8, value), then MESSAGE-INTEGRITY and FINGERPRINT.
fn signed_request(data: &[u8]) -> Vec<u8> {
    let mut b = Builder::new(BINDING, Class::Request, [7; 12]).attribute(attr::USERNAME, format!("{LOCAL_UFRAG}:{REMOTE_UFRAG}").as_bytes());
    let mut rest = data;
    while rest.len() >= 3 {
        let kind = u16::from_be_bytes([rest[0], rest[1]]);
        let len = (rest[2] as usize).min(rest.len() - 3);
        // Integrity and fingerprint are the builder's to add, last.
        if kind != attr::MESSAGE_INTEGRITY && kind != attr::FINGERPRINT {
            b = b.attribute(kind, &rest[3..3 + len]);
        }
        rest = &rest[3 + len..];
    }
    b.integrity(LOCAL_PWD.as_bytes()).fingerprint()
}

fn check_reply(reply: &[u8], integrity: bool) {
    let m = Message::parse(reply).expect("the agent's reply parses");
    assert_eq!(m.check_fingerprint().map(|r| r.is_ok()), Some(true), "the agent's reply has a matching FINGERPRINT");
    if integrity {
        m.check_integrity(LOCAL_PWD.as_bytes()).expect("an answered check is signed with our password");
    }
}

fuzz_target!(|data: &[u8]| {
    let (packet, remote_known) = match data.split_first() {
        Some((&k, rest)) if k & 1 == 1 => (signed_request(rest), k & 2 == 2),
        Some((&k, rest)) => (rest.to_vec(), k & 2 == 2),
        None => return,
    };
    if let Ok(m) = Message::parse(&packet) {
        let _ = (m.username(), m.priority(), m.xor_mapped_address(), m.check_fingerprint(), m.check_integrity(LOCAL_PWD.as_bytes()));
    }
    let remote = remote_known.then(|| creds(REMOTE_UFRAG, "fuzz-remote-password-0123"));
    let mut agent = LiteAgent::new(creds(LOCAL_UFRAG, LOCAL_PWD), remote);
    let source: SocketAddr = "192.0.2.1:5000".parse().unwrap();
    match agent.on_stun(&packet, source, 1) {
        CheckOutcome::Answered { reply, nominated } => {
            check_reply(&reply, true);
            assert!(agent.valid_source(source));
            assert_eq!(nominated, agent.selected() == Some(source));
        }
        CheckOutcome::Refused { reply, .. } => check_reply(&reply, false),
        CheckOutcome::Ignored { .. } => {}
    }
});
