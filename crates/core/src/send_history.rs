//! What the SFU sent each consumer lately, to send again when the consumer NACKs it. Asking the
//! publisher instead makes every subscriber's loss the publisher's uplink load: one subscriber
//! on a lossy link then costs every other subscriber of that publisher (measured: a 500 kbit/s
//! encoder sending 2.9 Mbit/s for one thin subscriber's NACKs). Sans-I/O: time is passed in.
//!
//! Kept per consumer: the copies as they left the SFU's pipeline (renumbered, in the clear when
//! the driver protects them: see [`Sent::seal`]), for [`HISTORY_NS`] and at most
//! [`HISTORY_PACKETS`] per consumer and [`MAX_BYTES`] in all. A copy is sent again at most
//! [`MAX_RESENDS`] times, [`RESEND_INTERVAL_NS`] apart (a receiver NACKs again until the packet
//! arrives; a retransmission in flight is not asked for twice).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;

/// How long a copy is kept: NACKs come within a round trip or two.
pub const HISTORY_NS: u64 = 1_000_000_000;
/// Copies kept per consumer (a 720p video layer sends ~200 packets a second).
pub const HISTORY_PACKETS: usize = 512;
/// Bytes kept in all; past it, new copies are not kept until old ones expire.
pub const MAX_BYTES: usize = 64 << 20;
pub const MAX_RESENDS: u8 = 3;
pub const RESEND_INTERVAL_NS: u64 = 20_000_000;

/// One copy as it was sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    pub seq: u16,
    pub from: SocketAddr,
    pub to: SocketAddr,
    pub packet: Vec<u8>,
    /// The driver protects it as it sends it (so again when it is sent again).
    pub seal: bool,
    at_ns: u64,
    resends: u8,
    resent_ns: u64,
}

#[derive(Debug, Default)]
pub struct SendHistory {
    consumers: HashMap<u32, VecDeque<Sent>>,
    bytes: usize,
    /// Copies sent again, and NACKed ones not (too soon after the last time, or too often).
    pub resent: u64,
    pub suppressed: u64,
}

impl SendHistory {
    /// Keep what was sent to `consumer` as `seq` at `now_ns`, `(from, to)`.
    pub fn record(&mut self, consumer: u32, seq: u16, now_ns: u64, (from, to): (SocketAddr, SocketAddr), packet: &[u8], seal: bool) {
        let q = self.consumers.entry(consumer).or_default();
        while q.front().is_some_and(|s| now_ns.saturating_sub(s.at_ns) > HISTORY_NS) || q.len() >= HISTORY_PACKETS {
            let old = q.pop_front().expect("checked");
            self.bytes -= old.packet.len();
        }
        if self.bytes + packet.len() > MAX_BYTES {
            return;
        }
        self.bytes += packet.len();
        q.push_back(Sent { seq, from, to, packet: packet.to_vec(), seal, at_ns: now_ns, resends: 0, resent_ns: 0 });
    }

    fn find(&self, consumer: u32, seq: u16) -> Option<&Sent> {
        // The newest copy with that number (the number space wraps in ~20 s of video).
        self.consumers.get(&consumer)?.iter().rev().find(|s| s.seq == seq)
    }

    /// It has `consumer`'s `seq`: the NACK is the SFU's to answer, whether it sends the copy
    /// again now or not ([`SendHistory::resend`]). The publisher could only send the same packet:
    /// asking it too would load its uplink with one receiver's repeated NACKs (a receiver on a
    /// short round trip NACKs again every few ms while a copy is on its way; measured under
    /// load: half of one subscriber's NACKs reached the publisher once its copies' resends ran
    /// out). Only what the SFU never sent (lost before it) goes to the publisher.
    pub fn holds(&self, consumer: u32, seq: u16) -> bool {
        self.find(consumer, seq).is_some()
    }

    /// The copy to send again for a NACK of `consumer`'s `seq` at `now_ns`; None when it has
    /// none, or it went again less than [`RESEND_INTERVAL_NS`] ago.
    pub fn resend(&mut self, consumer: u32, seq: u16, now_ns: u64) -> Option<&Sent> {
        let s = self.consumers.get_mut(&consumer)?.iter_mut().rev().find(|s| s.seq == seq)?;
        if s.resends >= MAX_RESENDS || (s.resends > 0 && now_ns.saturating_sub(s.resent_ns) < RESEND_INTERVAL_NS) {
            self.suppressed += 1;
            return None;
        }
        s.resends += 1;
        s.resent_ns = now_ns;
        self.resent += 1;
        Some(s)
    }

    /// Keep only the consumers `keep` says (the others left the table).
    pub fn retain(&mut self, keep: impl Fn(u32) -> bool) {
        let bytes = &mut self.bytes;
        self.consumers.retain(|id, q| {
            let kept = keep(*id);
            if !kept {
                *bytes -= q.iter().map(|s| s.packet.len()).sum::<usize>();
            }
            kept
        });
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_nacked_copy_goes_again_as_it_went_a_bounded_number_of_times() {
        let mut h = SendHistory::default();
        for seq in 0..10u16 {
            h.record(7, seq, u64::from(seq) * 1_000_000, (a("10.0.0.1:4000"), a("10.0.1.1:5000")), &[seq as u8; 100], true);
        }
        assert!(h.holds(7, 3) && !h.holds(7, 10) && !h.holds(8, 3));
        let s = h.resend(7, 3, 20_000_000).unwrap();
        assert_eq!((s.packet.clone(), s.to, s.seal), (vec![3; 100], a("10.0.1.1:5000"), true));
        // Asked again at once: it is in flight.
        assert!(h.resend(7, 3, 25_000_000).is_none());
        assert!(h.resend(7, 3, 45_000_000).is_some());
        assert!(h.resend(7, 3, 70_000_000).is_some());
        assert!(h.holds(7, 3) && h.resend(7, 3, 200_000_000).is_none(), "three times at most, and still the SFU's to answer");
        assert_eq!((h.resent, h.suppressed), (3, 2));
    }

    #[test]
    fn copies_are_kept_for_a_second_and_within_their_bounds() {
        let mut h = SendHistory::default();
        let path = (a("10.0.0.1:4000"), a("10.0.1.1:5000"));
        h.record(1, 1, 0, path, &[0; 1000], false);
        h.record(1, 2, HISTORY_NS + 1, path, &[0; 1000], false);
        assert!(!h.holds(1, 1) && h.holds(1, 2), "older than a second: gone");
        for seq in 0..HISTORY_PACKETS as u16 + 5 {
            h.record(2, seq, HISTORY_NS, path, &[0; 10], false);
        }
        assert!(!h.holds(2, 4) && h.holds(2, 5), "the oldest beyond the count: gone");
        assert_eq!(h.bytes(), 1000 + HISTORY_PACKETS * 10);
        h.retain(|id| id == 2);
        assert_eq!(h.bytes(), HISTORY_PACKETS * 10);
        // The byte bound: nothing more is kept past it.
        let mut h = SendHistory::default();
        let big = vec![0u8; 1 << 20];
        for seq in 0..70u16 {
            h.record(u32::from(seq), seq, 0, path, &big, false);
        }
        assert!(h.bytes() <= MAX_BYTES && h.holds(63, 63) && !h.holds(64, 64));
    }
}
