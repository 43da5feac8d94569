//! Randomised robustness on stable Rust (the coverage-guided fuzz targets live in `fuzz/`):
//! hundreds of thousands of random and mutated inputs through every parser and through
//! `classify`, which must never panic and must never forward what the model would not.

use mediaplane_core::model::{StreamRef, StreamSpec};
use mediaplane_core::packet::{build_frame, parse_frame, verify_checksums, FrameSpec};
use mediaplane_core::rtp::{build_rtp, parse_rtcp_compound, RtpHeader};
use mediaplane_core::table::{SourceRule, Verdict};
use mediaplane_core::{ForwardingTable, Model};
use std::net::SocketAddr;

/// xorshift64*: deterministic, so a failure reproduces with its seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Up to `max - 1` random bytes.
    fn bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max);
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn mutate(rng: &mut Rng, mut v: Vec<u8>) -> Vec<u8> {
    for _ in 0..1 + rng.below(4) {
        match rng.below(4) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            2 => v.truncate(rng.below(v.len() + 1)),
            _ => {
                let extra = rng.bytes(8);
                v.extend(extra);
            }
        }
    }
    v
}

fn a(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn parsers_never_panic_on_random_or_mutated_input() {
    let mut rng = Rng(0x6d65_6469_6170_6c6e);
    let seeds: Vec<Vec<u8>> = vec![
        build_frame(&FrameSpec::new(a("10.0.0.1:5000"), a("10.0.0.2:6000")), &build_rtp(0, 1, 2, 3, &[0; 160])),
        build_frame(&FrameSpec::new(a("[fd00::1]:5000"), a("[fd00::2]:6000")), b"x"),
        {
            let mut sr = vec![0x80, 200, 0, 6];
            sr.extend_from_slice(&[0; 24]);
            sr
        },
    ];
    for i in 0..300_000 {
        let input = if i % 3 == 0 { rng.bytes(128) } else { mutate(&mut rng, seeds[i % seeds.len()].clone()) };
        if let Ok(f) = parse_frame(&input) {
            // Offsets the parser returns are always inside the frame.
            assert!(f.payload + f.payload_len <= input.len());
            let _ = verify_checksums(&input, &f);
        }
        if let Ok(h) = RtpHeader::parse(&input) {
            assert!(h.payload_offset + h.payload_len + h.padding_len == input.len());
            let _ = h.extension_elements(&input);
        }
        if let Ok(pkts) = parse_rtcp_compound(&input) {
            assert_eq!(pkts.iter().map(|p| p.bytes.len()).sum::<usize>(), input.len());
        }
    }
}

#[test]
fn classify_never_forwards_what_the_model_would_not() {
    let mut m = Model::new();
    m.create_room("r").unwrap();
    for i in 0..4 {
        m.add_participant("r", &format!("p{i}"), a(&format!("10.0.0.1:{}", 4000 + 2 * i)), a(&format!("10.0.1.{}:5000", i + 1))).unwrap();
    }
    m.publish("r", "p0", "main", StreamSpec::default()).unwrap();
    m.publish("r", "p1", "low", StreamSpec { ssrc: Some(7), ..Default::default() }).unwrap();
    m.publish("r", "p2", "raw", StreamSpec { rtp: false, ..Default::default() }).unwrap();
    for (sub, publ, s) in [("p1", "p0", "main"), ("p2", "p0", "main"), ("p0", "p1", "low"), ("p3", "p2", "raw")] {
        m.subscribe("r", sub, StreamRef { publisher: publ.into(), stream: s.into() }).unwrap();
    }
    let t = ForwardingTable::compile(&m, 1);
    let locals: Vec<SocketAddr> = (0..5).map(|i| a(&format!("10.0.0.1:{}", 4000 + 2 * i))).collect();
    let sources: Vec<SocketAddr> = (1..=5).map(|i| a(&format!("10.0.1.{i}:5000"))).chain([a("10.0.1.1:5001")]).collect();
    let mut rng = Rng(42);
    let mut forwarded = 0;
    for i in 0..200_000 {
        let local = locals[rng.below(locals.len())];
        let src = sources[rng.below(sources.len())];
        let ssrc = if rng.below(2) == 0 { 7 } else { 9 };
        let payload = if i % 2 == 0 { mutate(&mut rng, build_rtp(0, 1, 1, ssrc, &[0; 20])) } else { rng.bytes(40) };
        if let Verdict::Forward(e) = t.classify(local, src, &payload) {
            forwarded += 1;
            assert_eq!(e.key.local, local);
            assert_eq!(e.source, SourceRule::Fixed(src), "only the registered source injects");
            assert!(e.copies.iter().all(|c| c.to != src), "never back to the sender");
            if e.rtp {
                assert!(RtpHeader::parse(&payload).is_ok() || parse_rtcp_compound(&payload).is_ok());
            }
        }
    }
    assert!(forwarded > 1000, "the generator reaches the forwarding path ({forwarded})");
}
