//! SRTP and SRTCP as mediaplane keys them, held against reference packets and against an
//! independent implementation.
//!
//! - Reference packets: libsrtp's validation packets (`srtp_validate`, `srtp_validate_gcm`),
//!   made with RFC 3711 Appendix B.3's master key and salt for AES-CM and with libsrtp's GCM
//!   test key. RFC 7714 §16's own vectors start from session keys, after key derivation, which
//!   no master-key API (libsrtp's, ours) takes, so they are not used here.
//! - Independent implementation: webrtc-rs's `webrtc-srtp` (pure Rust, RustCrypto ciphers, its
//!   own key derivation and rollover-counter logic). Whatever one protects the other must
//!   unprotect, RTP and RTCP, every suite, across a sequence-number wrap (the ROC).

use mediaplane_core::rtp::build_rtp;
use mediaplane_core::srtp::{SrtpKey, SrtpSuite};
use mediaplane_dataplane::srtp::{protect, unprotect, Context};
use std::sync::Arc;
use webrtc_srtp::context::Context as Independent;
use webrtc_srtp::protection_profile::ProtectionProfile;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// RFC 3711 B.3: master key E1F9… and master salt 0EC6….
const RFC3711_MASTER: &str = "e1f97a0d3e018be0d64fa32c06de4139 0ec675ad498afeebb6960b3aabe6";
const GCM_MASTER: &str = "000102030405060708090a0b0c0d0e0f a0a1a2a3a4a5a6a7a8a9aaab";
/// SSRC 0xcafebabe, sequence 0x1234, payload sixteen 0xab.
const RTP_CLEAR: &str = "800f1234decafbadcafebabe abababababababababababababababab";
/// A sender report header of SSRC 0xcafebabe, then sixteen 0xab.
const RTCP_CLEAR: &str = "81c8000bcafebabe abababababababababababababababab";

struct Reference {
    suite: SrtpSuite,
    master: &'static str,
    srtp: &'static str,
    srtcp: &'static str,
}

const REFERENCES: [Reference; 3] = [
    Reference {
        suite: SrtpSuite::AesCm128HmacSha1_80,
        master: RFC3711_MASTER,
        srtp: "800f1234decafbadcafebabe 4e55dc4ce79978d88ca4d215949d2402 b78d6acc99ea179b8dbb",
        srtcp: "81c8000bcafebabe 7128035be487b9bdbef89041f977a5a8 80000001 993e08cd54d6c1230798",
    },
    // The 32-bit RTP tag is the 80-bit one cut short; SRTCP keeps its 80-bit tag (RFC 5764 §4.1.2).
    Reference {
        suite: SrtpSuite::AesCm128HmacSha1_32,
        master: RFC3711_MASTER,
        srtp: "800f1234decafbadcafebabe 4e55dc4ce79978d88ca4d215949d2402 b78d6acc",
        srtcp: "81c8000bcafebabe 7128035be487b9bdbef89041f977a5a8 80000001 993e08cd54d6c1230798",
    },
    Reference {
        suite: SrtpSuite::AeadAes128Gcm,
        master: GCM_MASTER,
        srtp: "800f1234decafbadcafebabe c5002ede04cfdd2eb91159e0880aa06e d2976826f796b201df3131a127e8a392",
        srtcp: "81c8000bcafebabe c98b8b5df0392a55852b6c21ac8e7025 c52c6fbea2b3b446ea31123ba88ce61e 80000001",
    },
];

fn contexts(key: &SrtpKey) -> (Arc<Context>, Arc<Context>) {
    (Arc::new(Context::new(key, true).unwrap()), Arc::new(Context::new(key, false).unwrap()))
}

#[test]
fn every_suite_protects_and_unprotects_the_reference_packets_bit_for_bit() {
    for r in &REFERENCES {
        let key = SrtpKey::new(r.suite, hex(r.master)).unwrap();
        let (tx, rx) = contexts(&key);
        let name = r.suite.name();
        assert_eq!(protect(Some(&tx), &hex(RTP_CLEAR)).unwrap(), hex(r.srtp), "{name}: SRTP");
        assert_eq!(protect(Some(&tx), &hex(RTCP_CLEAR)).unwrap(), hex(r.srtcp), "{name}: SRTCP (index 1)");
        assert_eq!(unprotect(Some(&rx), &hex(r.srtp)).unwrap(), hex(RTP_CLEAR), "{name}: SRTP back");
        assert_eq!(unprotect(Some(&rx), &hex(r.srtcp)).unwrap(), hex(RTCP_CLEAR), "{name}: SRTCP back");
        // One bit off anywhere in the authenticated part and the packet is refused.
        for at in [1, 13, hex(r.srtp).len() - 1] {
            let mut bad = hex(r.srtp);
            bad[at] ^= 0x10;
            assert!(unprotect(Some(&contexts(&key).1), &bad).is_err(), "{name}: byte {at} altered");
        }
    }
}

fn profile(suite: SrtpSuite) -> ProtectionProfile {
    match suite {
        SrtpSuite::AesCm128HmacSha1_80 => ProtectionProfile::Aes128CmHmacSha1_80,
        SrtpSuite::AesCm128HmacSha1_32 => ProtectionProfile::Aes128CmHmacSha1_32,
        SrtpSuite::AeadAes128Gcm => ProtectionProfile::AeadAes128Gcm,
        SrtpSuite::Aes256CmHmacSha1_80 => ProtectionProfile::Aes256CmHmacSha1_80,
        SrtpSuite::Aes256CmHmacSha1_32 => ProtectionProfile::Aes256CmHmacSha1_32,
        SrtpSuite::AeadAes256Gcm => ProtectionProfile::AeadAes256Gcm,
        // webrtc-srtp has no AES-192 (libsrtp's own round trip covers it: src/srtp.rs).
        SrtpSuite::Aes192CmHmacSha1_80 | SrtpSuite::Aes192CmHmacSha1_32 => unreachable!("no independent AES-192"),
    }
}

fn independent(key: &SrtpKey) -> Independent {
    let key_len = key.master.len() - if key.suite.is_aead() { 12 } else { 14 };
    Independent::new(&key.master[..key_len], &key.master[key_len..], profile(key.suite), None, None).unwrap()
}

/// A receiver report with one block, then an SDES chunk: a compound as browsers send it.
fn rtcp_rr(ssrc: u32, n: u8) -> Vec<u8> {
    let mut p = vec![0x81, 201, 0, 7];
    p.extend_from_slice(&ssrc.to_be_bytes());
    p.extend_from_slice(&[n; 24]);
    p.extend_from_slice(&[0x81, 202, 0, 2]);
    p.extend_from_slice(&ssrc.to_be_bytes());
    p.extend_from_slice(&[1, 2, b'm', b'p']);
    p
}

/// Packets of two SSRCs whose sequence numbers wrap (65,530 → 9 and 65,528 → 7): past the wrap the rollover
/// counter is 1 and both sides must agree on it; payloads from 1 to 1,200 bytes.
fn media() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for i in 0..16u16 {
        let seq = 65_530u16.wrapping_add(i);
        let len = 1 + (usize::from(i) * 97) % 1200;
        out.push(build_rtp(96, seq, 3000 * u32::from(i), 0x1111_0000, &vec![i as u8; len]));
        out.push(build_rtp(111, seq.wrapping_sub(2), 960 * u32::from(i), 0x2222_0000, &vec![!(i as u8); 1200 - len + 1]));
        if i % 4 == 0 {
            out.push(rtcp_rr(0x3333_0000, i as u8));
        }
    }
    out
}

fn is_rtcp(p: &[u8]) -> bool {
    (200..=206).contains(&p[1])
}

#[test]
fn what_mediaplane_protects_an_independent_implementation_unprotects_and_back() {
    for suite in SrtpSuite::ALL.into_iter().filter(|s| !s.name().starts_with("AES_192")) {
        let key = SrtpKey::new(suite, (0..suite.master_len() as u8).map(|b| b.wrapping_mul(37).wrapping_add(5)).collect()).unwrap();
        let name = suite.name();

        let (ours_tx, _) = contexts(&key);
        let mut theirs_rx = independent(&key);
        for (i, clear) in media().iter().enumerate() {
            let sealed = protect(Some(&ours_tx), clear).unwrap();
            let opened = if is_rtcp(clear) { theirs_rx.decrypt_rtcp(&sealed) } else { theirs_rx.decrypt_rtp(&sealed) };
            assert_eq!(opened.unwrap_or_else(|e| panic!("{name}: packet {i}: webrtc-srtp refused ours: {e}")).as_ref(), &clear[..], "{name}: packet {i}");
        }

        let (_, ours_rx) = contexts(&key);
        let mut theirs_tx = independent(&key);
        for (i, clear) in media().iter().enumerate() {
            let sealed = if is_rtcp(clear) { theirs_tx.encrypt_rtcp(clear) } else { theirs_tx.encrypt_rtp(clear) }.unwrap();
            let opened = unprotect(Some(&ours_rx), &sealed).unwrap_or_else(|e| panic!("{name}: packet {i}: we refused webrtc-srtp's: {e:?}"));
            assert_eq!(opened, *clear, "{name}: packet {i}");
        }
    }
}

#[test]
fn a_packet_sealed_under_another_key_by_the_independent_side_is_refused() {
    for suite in [SrtpSuite::AesCm128HmacSha1_80, SrtpSuite::AeadAes128Gcm] {
        let key = SrtpKey::new(suite, vec![7; suite.master_len()]).unwrap();
        let other = SrtpKey::new(suite, vec![8; suite.master_len()]).unwrap();
        let sealed = independent(&other).encrypt_rtp(&build_rtp(96, 1, 0, 5, &[1; 100])).unwrap();
        assert!(unprotect(Some(&contexts(&key).1), &sealed).is_err(), "{}", suite.name());
    }
}
