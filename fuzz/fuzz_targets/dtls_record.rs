//! DTLS record framing as a WebRTC leg meets it: two mediaplane sessions (relay as server, peer
//! as client) handshake while the fuzzer tampers with every datagram in flight (pass, drop,
//! repeat, flip a byte, cut short, or replace with its own bytes), then throws its remaining bytes
//! at both as stray datagrams. Never a panic; sessions that both connect hold mirrored keys
//! (a tampered flight is refused, never keyed differently); a closed session stays closed.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_webrtc::dtls::{DtlsContext, DtlsSession, Progress, Role, SrtpKeys, State};
use std::sync::OnceLock;

fn contexts() -> &'static (DtlsContext, DtlsContext) {
    static CONTEXTS: OnceLock<(DtlsContext, DtlsContext)> = OnceLock::new();
    CONTEXTS.get_or_init(|| (DtlsContext::generate().unwrap(), DtlsContext::generate().unwrap()))
}

/// The fuzzer's bytes, taken one decision at a time (zeros once they run out).
struct Tape<'a>(&'a [u8]);

impl Tape<'_> {
    fn byte(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }

    fn take(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (a, rest) = self.0.split_at(n);
        self.0 = rest;
        a.to_vec()
    }
}

/// What one datagram becomes on its way: none, one or two datagrams.
fn tamper(d: Vec<u8>, tape: &mut Tape) -> Vec<Vec<u8>> {
    match tape.byte() % 8 {
        0 => vec![],
        1 => vec![d.clone(), d],
        2 if !d.is_empty() => {
            let mut d = d;
            let at = usize::from(tape.byte()) * 7 % d.len();
            d[at] ^= tape.byte() | 1;
            vec![d]
        }
        3 => {
            let keep = usize::from(tape.byte()) * d.len() / 256;
            vec![d[..keep].to_vec()]
        }
        4 => {
            let n = usize::from(tape.byte());
            vec![tape.take(n)]
        }
        _ => vec![d],
    }
}

fn deliver(to: &mut DtlsSession, d: &[u8], keys: &mut Option<SrtpKeys>) {
    let was_closed = matches!(to.state(), State::Closed(_));
    match to.on_datagram(d) {
        Progress::Connected(k) => {
            assert!(keys.is_none(), "a session connects once");
            *keys = Some(k);
        }
        Progress::Closed(_) => assert!(!was_closed, "closing is reported once"),
        Progress::Pending => {}
    }
    if was_closed {
        assert!(matches!(to.state(), State::Closed(_)), "a closed session stays closed");
    }
}

fuzz_target!(|data: &[u8]| {
    let (relay, peer) = contexts();
    let mut tape = Tape(data);
    let mut server = relay.session(Role::Server, peer.fingerprint().clone()).unwrap();
    let mut client = peer.session(Role::Client, relay.fingerprint().clone()).unwrap();
    let (mut server_keys, mut client_keys) = (None, None);
    for round in 0..12 {
        let mut moved = false;
        while let Some(d) = client.poll_output() {
            for d in tamper(d, &mut tape) {
                deliver(&mut server, &d, &mut server_keys);
            }
            moved = true;
        }
        while let Some(d) = server.poll_output() {
            for d in tamper(d, &mut tape) {
                deliver(&mut client, &d, &mut client_keys);
            }
            moved = true;
        }
        if !moved {
            // What a lost flight waits for: the retransmission timer (OpenSSL's, 1 s at first,
            // so mostly nothing happens here; the client's own first flight is resent below).
            client.on_timer();
            server.on_timer();
            if round > 6 {
                break;
            }
        }
    }
    if let (Some(s), Some(c)) = (&server_keys, &client_keys) {
        assert_eq!(s.inbound, c.outbound, "what the peer protects with, the relay unprotects with");
        assert_eq!(s.outbound, c.inbound);
    }
    // Whatever is left: stray datagrams at both, each cut by a length byte.
    while !tape.0.is_empty() {
        let n = usize::from(tape.byte());
        let d = tape.take(n);
        deliver(&mut server, &d, &mut server_keys);
        deliver(&mut client, &d, &mut client_keys);
        let _ = mediaplane_webrtc::dtls::is_dtls(&d);
    }
});
