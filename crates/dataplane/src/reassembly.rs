//! IP reassembly for a driver that receives raw frames (AF_XDP): what the host stack does for the
//! socket plane. Sans-I/O: fragments and the time go in, whole IP payloads come out.
//!
//! Bounded as the kernel bounds it (`ipfrag_high_thresh`, `ipfrag_time`): at most
//! [`MAX_PENDING_BYTES`] held, a datagram not complete within [`TIMEOUT_NS`] is dropped, and so is
//! one whose fragments overlap (RFC 5722; Linux drops overlapping IPv4 fragments too) or exceed
//! 65,535 bytes. Every drop is counted.

use std::collections::HashMap;
use std::net::IpAddr;

/// Bytes of fragments held at most; a fragment that would exceed it is dropped.
pub const MAX_PENDING_BYTES: usize = 4 << 20;
/// A datagram not complete this long after its first fragment arrived is dropped.
pub const TIMEOUT_NS: u64 = 5_000_000_000;
/// The largest IP payload (an IPv4 datagram's total length is 16 bits).
const MAX_PAYLOAD: usize = 65_535;

/// A datagram's fragments share this (the protocol is always UDP here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FragmentKey {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub id: u32,
}

/// What became of fragments that did not make a datagram.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReassemblyDrops {
    pub timeouts: u64,
    pub overlaps: u64,
    pub too_big: u64,
    pub over_budget: u64,
}

#[derive(Debug, Default)]
struct Partial {
    first_ns: u64,
    /// (offset, bytes), kept sorted by offset.
    pieces: Vec<(usize, Vec<u8>)>,
    /// Known once the last fragment (more = false) arrived.
    total: Option<usize>,
    held: usize,
}

#[derive(Debug, Default)]
pub struct Reassembler {
    pending: HashMap<FragmentKey, Partial>,
    held: usize,
    pub drops: ReassemblyDrops,
}

impl Reassembler {
    /// One fragment: `offset` into the IP payload, `more` = more fragments follow. Returns the
    /// whole IP payload once the last missing piece arrived.
    pub fn offer(&mut self, key: FragmentKey, offset: usize, more: bool, data: &[u8], now_ns: u64) -> Option<Vec<u8>> {
        self.expire(now_ns);
        let end = offset + data.len();
        if end > MAX_PAYLOAD || (more && !data.len().is_multiple_of(8)) {
            self.drop_datagram(&key);
            self.drops.too_big += 1;
            return None;
        }
        if self.held + data.len() > MAX_PENDING_BYTES {
            self.drop_datagram(&key);
            self.drops.over_budget += 1;
            return None;
        }
        let p = self.pending.entry(key).or_insert_with(|| Partial { first_ns: now_ns, ..Default::default() });
        let overlaps = p.pieces.iter().any(|(o, d)| offset < o + d.len() && *o < end)
            || (!more && p.total.is_some_and(|t| t != end))
            || (!more && p.pieces.iter().any(|(o, d)| o + d.len() > end))
            || p.total.is_some_and(|t| end > t);
        if overlaps {
            self.drop_datagram(&key);
            self.drops.overlaps += 1;
            return None;
        }
        if !more {
            p.total = Some(end);
        }
        let at = p.pieces.partition_point(|(o, _)| *o < offset);
        p.pieces.insert(at, (offset, data.to_vec()));
        p.held += data.len();
        self.held += data.len();
        let total = p.total?;
        // Complete when the sorted pieces tile [0, total) (no overlaps, so the sizes add up).
        if p.held != total {
            return None;
        }
        let p = self.pending.remove(&key).expect("just updated");
        self.held -= p.held;
        let mut whole = Vec::with_capacity(total);
        for (_, d) in p.pieces {
            whole.extend_from_slice(&d);
        }
        Some(whole)
    }

    /// Drop what has waited longer than [`TIMEOUT_NS`].
    pub fn expire(&mut self, now_ns: u64) {
        let before = self.pending.len();
        let held = &mut self.held;
        self.pending.retain(|_, p| {
            let keep = now_ns.saturating_sub(p.first_ns) < TIMEOUT_NS;
            if !keep {
                *held -= p.held;
            }
            keep
        });
        self.drops.timeouts += (before - self.pending.len()) as u64;
    }

    fn drop_datagram(&mut self, key: &FragmentKey) {
        if let Some(p) = self.pending.remove(key) {
            self.held -= p.held;
        }
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: u32) -> FragmentKey {
        FragmentKey { src: "10.0.0.1".parse().unwrap(), dst: "10.0.0.2".parse().unwrap(), id }
    }

    #[test]
    fn fragments_in_any_order_make_the_datagram() {
        let payload: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let pieces = [(0, &payload[..1480]), (1480, &payload[1480..2960]), (2960, &payload[2960..])];
        for order in [[0, 1, 2], [2, 1, 0], [1, 2, 0]] {
            let mut r = Reassembler::default();
            let mut out = None;
            for (n, i) in order.iter().enumerate() {
                let (off, d) = pieces[*i];
                let got = r.offer(key(7), off, *i != 2, d, 0);
                assert_eq!(got.is_some(), n == 2, "complete only with the last missing piece");
                out = out.or(got);
            }
            assert_eq!(out.unwrap(), payload);
            assert_eq!(r.held(), 0);
        }
    }

    #[test]
    fn overlaps_timeouts_and_sizes_are_dropped_and_counted() {
        let mut r = Reassembler::default();
        assert!(r.offer(key(1), 0, true, &[0; 16], 0).is_none());
        assert!(r.offer(key(1), 8, false, &[0; 16], 0).is_none(), "overlaps the first");
        assert_eq!(r.drops.overlaps, 1);
        assert!(r.offer(key(1), 16, false, &[0; 8], 0).is_none(), "the datagram was dropped: this one starts anew");
        assert_eq!(r.held(), 8);
        r.expire(TIMEOUT_NS);
        assert_eq!((r.drops.timeouts, r.held()), (1, 0));
        assert!(r.offer(key(2), 65_528, false, &[0; 16], 0).is_none());
        assert_eq!(r.drops.too_big, 1);
        assert!(r.offer(key(3), 0, true, &[0; 7], 0).is_none(), "a fragment that is not the last is a multiple of 8");
        assert_eq!(r.drops.too_big, 2);
    }

    #[test]
    fn the_budget_bounds_what_is_held() {
        let mut r = Reassembler::default();
        let chunk = vec![0u8; 60_000];
        let mut id = 0;
        while r.held() + chunk.len() <= MAX_PENDING_BYTES {
            assert!(r.offer(key(id), 0, true, &chunk, 0).is_none());
            id += 1;
        }
        assert!(r.offer(key(id), 0, true, &chunk, 0).is_none());
        assert_eq!(r.drops.over_budget, 1);
        assert!(r.held() <= MAX_PENDING_BYTES);
    }
}
