//! SRTP and SRTCP input through mediaplane's libsrtp contexts, every suite, both directions:
//! - bytes from the wire, unprotected as a browser's packet would be: refused, never a panic;
//! - a packet sealed by the sender side, then perhaps altered by the fuzzer: the untouched one
//!   opens to exactly what was sealed, an altered one is refused;
//! - bytes a plain leg relays (any UDP, malformed RTP included), protected per copy: refused or,
//!   if sealed, opened back to the same bytes by the receiving side.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_core::srtp::{SrtpKey, SrtpSuite};
use mediaplane_dataplane::srtp::{protect, unprotect, Context};
use std::sync::Arc;

const SUITES: [SrtpSuite; 3] = [SrtpSuite::AeadAes128Gcm, SrtpSuite::AesCm128HmacSha1_80, SrtpSuite::AesCm128HmacSha1_32];

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let suite = SUITES[usize::from(mode) % 3];
    let key = SrtpKey::new(suite, (0..suite.master_len() as u8).map(|b| b ^ 0x5a).collect()).unwrap();
    let tx = Arc::new(Context::new(&key, true).unwrap());
    let rx = Arc::new(Context::new(&key, false).unwrap());
    match (mode / 3) % 3 {
        0 => {
            assert!(unprotect(Some(&rx), rest).is_err(), "unauthenticated bytes opened");
        }
        1 => {
            // rest = [flip position, flip mask, clear packet...]
            let [at, mask, clear @ ..] = rest else { return };
            let Some(sealed) = protect(Some(&tx), clear) else { return };
            let mut altered = sealed.clone();
            let i = usize::from(*at) % altered.len();
            altered[i] ^= mask;
            let opened = unprotect(Some(&rx), &altered);
            if *mask == 0 {
                assert_eq!(opened.as_deref(), Ok(clear), "the sealed packet opens as it was");
            } else {
                assert!(opened.is_err(), "an altered packet (byte {i}) opened");
            }
        }
        _ => {
            if let Some(sealed) = protect(Some(&tx), rest) {
                assert_eq!(unprotect(Some(&rx), &sealed).as_deref(), Ok(rest), "sealed bytes open to themselves");
            }
        }
    }
});
