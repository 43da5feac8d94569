//! What SRTP costs per copy on this machine, as the user-space plane pays it: one
//! `srtp::protect` per encrypted copy (a copy of the clear packet into a buffer with room for the
//! tag, then libsrtp on it, through the session's lock) and one `srtp::unprotect` per packet a
//! browser publishes, for each suite the SFU negotiates, on 1,200-byte video and 160-byte audio.
//! Rounds of each suite alternate, so drift hits all alike; the median and spread are over rounds.
//!
//! Run: `cargo test --release -p mediaplane-dataplane --test srtp_cost -- --ignored --nocapture`
//! (both tests; `srtp_cost_per_copy_across_subscribers` protects each packet for N subscribers)
//! (part of `make bench`). A benchmark, not a test: it asserts nothing about speed.

use mediaplane_core::rtp::build_rtp;
use mediaplane_core::srtp::{SrtpKey, SrtpSuite};
use mediaplane_dataplane::srtp::{protect, unprotect, Context};
use std::sync::Arc;
use std::time::Instant;

const ROUNDS: usize = 21;
const PACKETS: usize = 20_000;

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[test]
#[ignore]
fn srtp_cost_per_copy() {
    let suites = [SrtpSuite::AeadAes128Gcm, SrtpSuite::AesCm128HmacSha1_80, SrtpSuite::AesCm128HmacSha1_32];
    println!("payload  suite                     protect ns/copy (p10-p90)   unprotect ns/packet (p10-p90)");
    for payload in [1200usize, 160] {
        // (suite, protect samples, unprotect samples), one sample per round: ns per packet.
        let mut samples: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); suites.len()];
        let packets: Vec<Vec<u8>> = (0..PACKETS).map(|i| build_rtp(96, i as u16, i as u32 * 3000, 0x5eed, &vec![0x5a; payload])).collect();
        for round in 0..ROUNDS {
            for (k, suite) in suites.iter().enumerate() {
                let key = SrtpKey::new(*suite, (0..suite.master_len() as u8).collect()).unwrap();
                // Fresh sessions each round: packet indexes start over, as a new SSRC's would.
                let (tx, rx) = (Arc::new(Context::new(&key, true).unwrap()), Arc::new(Context::new(&key, false).unwrap()));
                let start = Instant::now();
                let sealed: Vec<Vec<u8>> = packets.iter().map(|p| protect(Some(&tx), p).expect("protect")).collect();
                let protect_ns = start.elapsed().as_nanos() as f64 / PACKETS as f64;
                let start = Instant::now();
                for s in &sealed {
                    unprotect(Some(&rx), s).expect("unprotect");
                }
                let unprotect_ns = start.elapsed().as_nanos() as f64 / PACKETS as f64;
                // The first round warms caches and the allocator: not counted.
                if round > 0 {
                    samples[k].0.push(protect_ns);
                    samples[k].1.push(unprotect_ns);
                }
            }
        }
        for (suite, (mut p, mut u)) in suites.iter().zip(samples) {
            p.sort_by(f64::total_cmp);
            u.sort_by(f64::total_cmp);
            println!(
                "{payload:>7}  {:<24}  {:>7.0} ({:.0}-{:.0})            {:>7.0} ({:.0}-{:.0})",
                suite.name(),
                quantile(&p, 0.5),
                quantile(&p, 0.1),
                quantile(&p, 0.9),
                quantile(&u, 0.5),
                quantile(&u, 0.1),
                quantile(&u, 0.9)
            );
        }
    }
}

/// The same protect as a fan-out pays it: each 1,200-byte packet protected once for each of N
/// subscribers, each with a session and key of its own (so N sessions take turns, as the
/// user-space plane's copies do), N = 1, 8, 64; ns per copy, median (p10-p90) over rounds.
#[test]
#[ignore]
fn srtp_cost_per_copy_across_subscribers() {
    const FANOUT_PACKETS: usize = 1_000;
    println!("suite                     subscribers  protect ns/copy (p10-p90)");
    for suite in [SrtpSuite::AeadAes128Gcm, SrtpSuite::AesCm128HmacSha1_80] {
        for n in [1usize, 8, 64] {
            let packets: Vec<Vec<u8>> = (0..FANOUT_PACKETS).map(|i| build_rtp(96, i as u16, i as u32 * 3000, 0x5eed, &[0x5a; 1200])).collect();
            let mut samples = Vec::new();
            for round in 0..ROUNDS {
                let sessions: Vec<Arc<Context>> = (0..n)
                    .map(|s| {
                        let key = SrtpKey::new(suite, (0..suite.master_len() as u8).map(|b| b ^ s as u8).collect()).unwrap();
                        Arc::new(Context::new(&key, true).unwrap())
                    })
                    .collect();
                let start = Instant::now();
                let mut bytes = 0usize;
                for p in &packets {
                    for s in &sessions {
                        bytes += protect(Some(s), p).expect("protect").len();
                    }
                }
                let ns = start.elapsed().as_nanos() as f64 / (FANOUT_PACKETS * n) as f64;
                assert!(bytes > 0);
                if round > 0 {
                    samples.push(ns);
                }
            }
            samples.sort_by(f64::total_cmp);
            println!("{:<24}  {n:>11}  {:>7.0} ({:.0}-{:.0})", suite.name(), quantile(&samples, 0.5), quantile(&samples, 0.1), quantile(&samples, 0.9));
        }
    }
}
