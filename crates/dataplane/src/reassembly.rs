//! IP reassembly for a driver that receives raw frames (AF_XDP): what the host stack does for the
//! socket plane. Sans-I/O: fragments and the time go in, whole IP payloads come out.
//!
//! Bounded as the kernel bounds it (`ipfrag_high_thresh`, `ipfrag_time`): at most
//! [`MAX_PENDING_BYTES`] held, a datagram not complete within [`TIMEOUT_NS`] is dropped, and so is
//! one whose fragments overlap (RFC 5722; Linux drops overlapping IPv4 fragments too) or exceed
//! 65,535 bytes. Every drop is counted.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

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

/// An IP fragment of a UDP datagram in an (untagged) Ethernet frame.
pub struct Fragment<'f> {
    pub key: FragmentKey,
    /// Offset of `data` in the datagram's IP payload.
    pub offset: usize,
    /// More fragments follow.
    pub more: bool,
    pub data: &'f [u8],
}

/// The fragment in `f`, when it is one of a UDP datagram: IPv4 without options, or IPv6 with
/// the fragment header right after the base header.
pub fn parse_fragment(f: &[u8]) -> Option<Fragment<'_>> {
    let be16 = |at: usize| Some(u16::from_be_bytes([*f.get(at)?, *f.get(at + 1)?]));
    let l3 = mediaplane_core::packet::ETH_HLEN;
    match be16(12)? {
        0x0800 => {
            let ip = f.get(l3..l3 + 20)?;
            let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
            if ip[0] != 0x45 || ip[9] != 17 || total < 20 {
                return None;
            }
            let frag = u16::from_be_bytes([ip[6], ip[7]]);
            let key = FragmentKey {
                src: IpAddr::from(<[u8; 4]>::try_from(&ip[12..16]).ok()?),
                dst: IpAddr::from(<[u8; 4]>::try_from(&ip[16..20]).ok()?),
                id: u32::from(u16::from_be_bytes([ip[4], ip[5]])),
            };
            Some(Fragment { key, offset: usize::from(frag & 0x1fff) * 8, more: frag & 0x2000 != 0, data: f.get(l3 + 20..l3 + total)? })
        }
        0x86dd => {
            let ip = f.get(l3..l3 + 48)?;
            let payload_len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            // The fragment header right after the base header, carrying UDP.
            if ip[6] != 44 || ip[40] != 17 || payload_len < 8 {
                return None;
            }
            let frag = u16::from_be_bytes([ip[42], ip[43]]);
            let key = FragmentKey {
                src: IpAddr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?),
                dst: IpAddr::from(<[u8; 16]>::try_from(&ip[24..40]).ok()?),
                id: u32::from_be_bytes(ip[44..48].try_into().ok()?),
            };
            Some(Fragment { key, offset: usize::from(frag & 0xfff8), more: frag & 1 != 0, data: f.get(l3 + 48..l3 + 40 + payload_len)? })
        }
        _ => None,
    }
}

/// The source and destination of a reassembled UDP datagram whose length and checksum are right.
pub fn whole_datagram(key: FragmentKey, udp: &[u8]) -> Option<(SocketAddr, SocketAddr)> {
    if udp.len() < mediaplane_core::packet::UDP_HLEN || usize::from(u16::from_be_bytes([udp[4], udp[5]])) != udp.len() {
        return None;
    }
    let stored = u16::from_be_bytes([udp[6], udp[7]]);
    if !(stored == 0 && key.src.is_ipv4()) && mediaplane_core::packet::udp_checksum(key.src, key.dst, udp) != stored {
        return None;
    }
    let port = |at: usize| u16::from_be_bytes([udp[at], udp[at + 1]]);
    Some((SocketAddr::new(key.src, port(0)), SocketAddr::new(key.dst, port(2))))
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

    /// `udp` (header + payload) as IPv4 fragments of at most `mtu` bytes of IP packet.
    fn fragment_v4(src: std::net::Ipv4Addr, dst: std::net::Ipv4Addr, id: u16, udp: &[u8], mtu: usize) -> Vec<Vec<u8>> {
        let per = (mtu - 20) / 8 * 8;
        udp.chunks(per)
            .enumerate()
            .map(|(i, piece)| {
                let more = (i + 1) * per < udp.len();
                let frag = ((i * per / 8) as u16) | if more { 0x2000 } else { 0 };
                let mut f = vec![0u8; 12];
                f.extend_from_slice(&0x0800u16.to_be_bytes());
                f.extend_from_slice(&[0x45, 0]);
                f.extend_from_slice(&((20 + piece.len()) as u16).to_be_bytes());
                f.extend_from_slice(&id.to_be_bytes());
                f.extend_from_slice(&frag.to_be_bytes());
                f.extend_from_slice(&[64, 17, 0, 0]);
                f.extend_from_slice(&src.octets());
                f.extend_from_slice(&dst.octets());
                f.extend_from_slice(piece);
                f
            })
            .collect()
    }

    #[test]
    fn fragment_frames_make_the_datagram_with_its_addresses() {
        use mediaplane_core::packet::{build_frame, parse_frame, FrameSpec};
        let (src, dst): (SocketAddr, SocketAddr) = ("10.1.0.2:5004".parse().unwrap(), "10.1.0.1:40000".parse().unwrap());
        let payload: Vec<u8> = (0..2500u32).map(|i| (i * 7) as u8).collect();
        let whole = build_frame(&FrameSpec::new(src, dst), &payload);
        let udp = &whole[parse_frame(&whole).unwrap().l4..];
        let (IpAddr::V4(s4), IpAddr::V4(d4)) = (src.ip(), dst.ip()) else { unreachable!() };
        let frames = fragment_v4(s4, d4, 0x1234, udp, 1500);
        assert_eq!(frames.len(), 2);
        let mut r = Reassembler::default();
        let mut out = None;
        for f in frames.iter().rev() {
            let frag = parse_fragment(f).expect("a fragment");
            assert_eq!(frag.key, FragmentKey { src: src.ip(), dst: dst.ip(), id: 0x1234 });
            out = out.or(r.offer(frag.key, frag.offset, frag.more, frag.data, 0));
        }
        let out = out.expect("reassembled");
        assert_eq!(whole_datagram(FragmentKey { src: src.ip(), dst: dst.ip(), id: 0x1234 }, &out), Some((src, dst)));
        assert_eq!(&out[8..], &payload[..]);
        // A flipped payload bit fails the UDP checksum of the whole.
        let mut bad = out.clone();
        bad[100] ^= 1;
        assert_eq!(whole_datagram(FragmentKey { src: src.ip(), dst: dst.ip(), id: 0x1234 }, &bad), None);
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
