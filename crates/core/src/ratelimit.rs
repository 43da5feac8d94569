//! Rate limits: an SFU multiplies what a publisher sends by its number of subscribers, so a
//! publisher (or whoever spoofs its address) must not be able to send faster than the stream is
//! meant to (per-stream limits), nor one source address across all its streams and the slow path
//! (per-source limits, [`crate::ForwardingTable::source_limit`]). Sans-I/O: the limit, its integer parameters and the admission
//! decision, shared by every data plane (the kernel program does the same arithmetic).
//!
//! Each limit is a GCRA (virtual scheduling form of a token bucket): a packet conforms when the
//! stream is not more than `burst_ms` ahead of its rate; a conforming packet advances the
//! theoretical arrival time by its cost (1/pps for the packet rate, payload bits/bps for the bit
//! rate). A packet must conform to both; a dropped packet costs nothing. So over any interval T
//! at most `pps * T + pps * burst_ms / 1000 + 1` packets pass.

use serde::{Deserialize, Serialize};

fn default_burst_ms() -> u32 {
    RateLimit::DEFAULT_BURST_MS
}

/// Limits of one stream (UDP payload; headers are not counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RateLimit {
    /// Packets per second; 0 = no packet-rate limit.
    #[serde(default)]
    pub pps: u32,
    /// Payload bits per second; 0 = no bit-rate limit.
    #[serde(default)]
    pub bps: u64,
    /// How far ahead of its rates a stream may run, in milliseconds (the bucket depth: a burst of
    /// `pps * burst_ms / 1000 + 1` packets passes at once).
    #[serde(default = "default_burst_ms")]
    pub burst_ms: u32,
}

/// [`RateLimit`] as integers, as the data planes use it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateParams {
    /// ns per packet, 0 = none.
    pub interval_ns: u64,
    /// ns per payload byte in 1/65536 ns, 0 = none.
    pub byte_cost_q16: u64,
    /// Tolerance (bucket depth) in ns.
    pub tau_ns: u64,
}

/// The state of one stream's buckets: theoretical arrival times, ns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateState {
    pub tat_packets: u64,
    pub tat_bytes: u64,
}

impl RateLimit {
    pub const DEFAULT_BURST_MS: u32 = 50;

    pub fn packets(pps: u32) -> RateLimit {
        RateLimit { pps, bps: 0, burst_ms: Self::DEFAULT_BURST_MS }
    }

    /// True when it limits nothing.
    pub fn is_unlimited(&self) -> bool {
        self.pps == 0 && self.bps == 0
    }

    pub fn params(&self) -> RateParams {
        RateParams {
            interval_ns: if self.pps == 0 { 0 } else { 1_000_000_000 / self.pps as u64 },
            // 8e9 ns per bit-second * 2^16; saturates for absurdly small rates.
            byte_cost_q16: if self.bps == 0 { 0 } else { ((8_000_000_000u128 << 16) / self.bps as u128).min(u64::MAX as u128 >> 16) as u64 },
            tau_ns: self.burst_ms as u64 * 1_000_000,
        }
    }
}

impl RateParams {
    /// Admit (and charge) a packet of `bytes` payload bytes arriving at `now_ns`?
    pub fn admit(&self, st: &mut RateState, now_ns: u64, bytes: u64) -> bool {
        let tp = st.tat_packets.max(now_ns);
        if self.interval_ns != 0 && tp - now_ns > self.tau_ns {
            return false;
        }
        let tb = st.tat_bytes.max(now_ns);
        if self.byte_cost_q16 != 0 && tb - now_ns > self.tau_ns {
            return false;
        }
        st.tat_packets = tp + self.interval_ns;
        st.tat_bytes = tb + ((bytes * self.byte_cost_q16) >> 16);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flood at `every_ns` intervals for `secs` seconds: how many pass.
    fn flood(limit: RateLimit, every_ns: u64, bytes: u64, secs: u64) -> u64 {
        let p = limit.params();
        let mut st = RateState::default();
        let start = 1_000_000_000;
        (0..secs * 1_000_000_000 / every_ns).filter(|i| p.admit(&mut st, start + i * every_ns, bytes)).count() as u64
    }

    #[test]
    fn packet_rate_holds_under_a_flood() {
        // 100 pps limit, 10 000 pps flood for 10 s: 1000 + at most the burst (5 + 1).
        let n = flood(RateLimit::packets(100), 100_000, 160, 10);
        assert!((1000..=1006).contains(&n), "{n}");
        // Under the limit everything passes.
        assert_eq!(flood(RateLimit::packets(100), 20_000_000, 160, 10), 500);
    }

    #[test]
    fn bit_rate_holds_under_a_flood() {
        // 64 kbit/s = 8000 B/s; 160-byte payloads every 1 ms for 10 s -> ~500/s pass.
        let l = RateLimit { pps: 0, bps: 64_000, burst_ms: 20 };
        let n = flood(l, 1_000_000, 160, 10);
        assert!((500..=502).contains(&n), "{n}");
        // Both limits: the stricter one wins.
        let l = RateLimit { pps: 50, bps: 64_000, burst_ms: 20 };
        assert!((500..=503).contains(&flood(l, 1_000_000, 160, 10)));
    }

    #[test]
    fn unlimited_and_serde_defaults() {
        assert!(RateLimit { pps: 0, bps: 0, burst_ms: 1 }.is_unlimited());
        assert_eq!(flood(RateLimit { pps: 0, bps: 0, burst_ms: 0 }, 1_000, 1, 1), 1_000_000);
        let l: RateLimit = serde_json::from_str(r#"{"pps": 10}"#).unwrap();
        assert_eq!(l, RateLimit::packets(10));
    }
}
