//! Ethernet / IPv4 / IPv6 / UDP parsing, building and checksums.
//!
//! The parser is strict on purpose: it is the oracle the kernel fast path is tested against, so
//! anything it cannot judge (IP options, fragments, IPv6 extension headers, bad lengths) is
//! reported as such instead of being guessed at.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IPV4: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;
pub const IPPROTO_UDP: u8 = 17;
pub const UDP_HLEN: usize = 8;

/// Why a frame is not a plain UDP datagram the fast path can forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame shorter than its headers")]
    Truncated,
    #[error("not IPv4 or IPv6 (ethertype {0:#06x})")]
    NotIp(u16),
    #[error("not UDP (protocol {0})")]
    NotUdp(u8),
    #[error("IPv4 header with options")]
    IpOptions,
    #[error("IP fragment")]
    Fragment,
    #[error("IP header inconsistent (version, IHL or total length)")]
    BadIpHeader,
    #[error("UDP length field inconsistent with the IP payload")]
    BadUdpLength,
}

/// A parsed UDP datagram inside an Ethernet frame (offsets into the frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpFrame {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub vlan: Option<u16>,
    /// Offset of the IP header.
    pub l3: usize,
    /// Offset of the UDP header.
    pub l4: usize,
    /// Offset and length of the UDP payload.
    pub payload: usize,
    pub payload_len: usize,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// Parse an Ethernet frame (optionally one 802.1Q/802.1ad tag) carrying IPv4 or IPv6 + UDP.
pub fn parse_frame(frame: &[u8]) -> Result<UdpFrame, FrameError> {
    if frame.len() < ETH_HLEN {
        return Err(FrameError::Truncated);
    }
    let mut ethertype = be16(frame, 12);
    let mut l3 = ETH_HLEN;
    let mut vlan = None;
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        if frame.len() < ETH_HLEN + 4 {
            return Err(FrameError::Truncated);
        }
        vlan = Some(be16(frame, 14) & 0x0fff);
        ethertype = be16(frame, 16);
        l3 += 4;
    }
    let ip = &frame[l3..];
    let (src_ip, dst_ip, l4_off, ip_end) = match ethertype {
        ETH_P_IPV4 => {
            if ip.len() < 20 {
                return Err(FrameError::Truncated);
            }
            if ip[0] >> 4 != 4 {
                return Err(FrameError::BadIpHeader);
            }
            let ihl = (ip[0] & 0x0f) as usize * 4;
            if ihl < 20 {
                return Err(FrameError::BadIpHeader);
            }
            let total = be16(ip, 2) as usize;
            if total < ihl || total > ip.len() {
                return Err(FrameError::BadIpHeader);
            }
            if ihl > 20 {
                return Err(FrameError::IpOptions);
            }
            let frag = be16(ip, 6);
            if frag & 0x3fff != 0 {
                // MF set or a non-zero offset.
                return Err(FrameError::Fragment);
            }
            if ip[9] != IPPROTO_UDP {
                return Err(FrameError::NotUdp(ip[9]));
            }
            let s = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
            let d = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
            (IpAddr::V4(s), IpAddr::V4(d), ihl, total)
        }
        ETH_P_IPV6 => {
            if ip.len() < 40 {
                return Err(FrameError::Truncated);
            }
            if ip[0] >> 4 != 6 {
                return Err(FrameError::BadIpHeader);
            }
            let plen = be16(ip, 4) as usize;
            if 40 + plen > ip.len() {
                return Err(FrameError::BadIpHeader);
            }
            // Extension headers (including fragment headers) are left to the slow path.
            if ip[6] != IPPROTO_UDP {
                return Err(FrameError::NotUdp(ip[6]));
            }
            let s: [u8; 16] = ip[8..24].try_into().unwrap();
            let d: [u8; 16] = ip[24..40].try_into().unwrap();
            (IpAddr::V6(Ipv6Addr::from(s)), IpAddr::V6(Ipv6Addr::from(d)), 40, 40 + plen)
        }
        other => return Err(FrameError::NotIp(other)),
    };
    let l4 = l3 + l4_off;
    let ip_end = l3 + ip_end;
    if l4 + UDP_HLEN > ip_end {
        return Err(FrameError::Truncated);
    }
    let udp_len = be16(frame, l4 + 4) as usize;
    if udp_len < UDP_HLEN || l4 + udp_len != ip_end {
        return Err(FrameError::BadUdpLength);
    }
    Ok(UdpFrame {
        src: SocketAddr::new(src_ip, be16(frame, l4)),
        dst: SocketAddr::new(dst_ip, be16(frame, l4 + 2)),
        vlan,
        l3,
        l4,
        payload: l4 + UDP_HLEN,
        payload_len: udp_len - UDP_HLEN,
    })
}

/// One's-complement sum over `data`, folded into 16 bits (not inverted).
fn csum_add(mut sum: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        sum += u16::from_be_bytes([c[0], c[1]]) as u32;
    }
    if let [last] = chunks.remainder() {
        sum += (*last as u32) << 8;
    }
    sum
}

fn csum_fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The Internet checksum (RFC 1071) of `data`.
pub fn internet_checksum(data: &[u8]) -> u16 {
    !csum_fold(csum_add(0, data))
}

fn pseudo_header_sum(src: IpAddr, dst: IpAddr, udp_len: usize) -> u32 {
    let mut sum = 0;
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            sum = csum_add(sum, &s.octets());
            sum = csum_add(sum, &d.octets());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            sum = csum_add(sum, &s.octets());
            sum = csum_add(sum, &d.octets());
        }
        _ => panic!("pseudo header over mixed address families"),
    }
    sum + IPPROTO_UDP as u32 + udp_len as u32
}

/// The UDP checksum for a UDP header+payload (`udp`, with its checksum field taken as zero).
pub fn udp_checksum(src: IpAddr, dst: IpAddr, udp: &[u8]) -> u16 {
    let mut sum = pseudo_header_sum(src, dst, udp.len());
    sum = csum_add(sum, &udp[..6]);
    sum = csum_add(sum, &udp[8..]);
    let c = !csum_fold(sum);
    // RFC 768: a computed zero is sent as all ones (zero means "no checksum" on IPv4).
    if c == 0 {
        0xffff
    } else {
        c
    }
}

/// What a UDP checksum field holds when the sender left the checksum to its NIC (Linux's
/// CHECKSUM_PARTIAL: the folded pseudo-header sum, not complemented) and the frame never went
/// through one: a local sender over veth. A driver that reads raw frames without the kernel's
/// `ip_summed` sees these (AF_XDP on veth); on a wire every checksum is complete.
pub fn udp_checksum_partial(src: IpAddr, dst: IpAddr, udp_len: usize) -> u16 {
    csum_fold(pseudo_header_sum(src, dst, udp_len))
}

/// Checks of a frame's checksums: IPv4 header checksum and UDP checksum (zero is accepted on IPv4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChecksumReport {
    pub ip_ok: bool,
    pub udp_ok: bool,
}

impl ChecksumReport {
    pub fn ok(&self) -> bool {
        self.ip_ok && self.udp_ok
    }
}

pub fn verify_checksums(frame: &[u8], f: &UdpFrame) -> ChecksumReport {
    let ip_ok = match f.src {
        SocketAddr::V4(_) => internet_checksum(&frame[f.l3..f.l4]) == 0,
        SocketAddr::V6(_) => true,
    };
    let udp = &frame[f.l4..f.payload + f.payload_len];
    let stored = be16(udp, 6);
    let udp_ok = if stored == 0 { f.src.is_ipv4() } else { udp_checksum(f.src.ip(), f.dst.ip(), udp) == stored };
    ChecksumReport { ip_ok, udp_ok }
}

/// Parameters for building a test or generator frame.
#[derive(Debug, Clone)]
pub struct FrameSpec {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub vlan: Option<u16>,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    /// IPv4 TTL / IPv6 hop limit.
    pub ttl: u8,
    /// IPv4 TOS / IPv6 traffic class (DSCP << 2 | ECN).
    pub tos: u8,
    /// IPv4 identification (DF is always set).
    pub ident: u16,
}

impl FrameSpec {
    pub fn new(src: SocketAddr, dst: SocketAddr) -> Self {
        FrameSpec { src_mac: [0x02, 0, 0, 0, 0, 1], dst_mac: [0x02, 0, 0, 0, 0, 2], vlan: None, src, dst, ttl: 64, tos: 0, ident: 0 }
    }
}

/// The length of the frame [`write_frame`] makes around a payload of `payload_len` bytes.
pub fn frame_len(spec: &FrameSpec, payload_len: usize) -> usize {
    let vlan = if spec.vlan.is_some() { 4 } else { 0 };
    let ip = if spec.dst.is_ipv4() { 20 } else { 40 };
    ETH_HLEN + vlan + ip + UDP_HLEN + payload_len
}

/// Build an Ethernet + IP + UDP frame with valid checksums around `payload`.
pub fn build_frame(spec: &FrameSpec, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0; frame_len(spec, payload.len())];
    write_frame(spec, payload, &mut f);
    f
}

/// [`build_frame`] into `out` (a data plane's own frame buffer): the frame's length, or None
/// when it does not fit. Panics if source and destination are of different families.
pub fn write_frame(spec: &FrameSpec, payload: &[u8], out: &mut [u8]) -> Option<usize> {
    let len = frame_len(spec, payload.len());
    let udp_len = UDP_HLEN + payload.len();
    if len > out.len() || udp_len > u16::MAX as usize {
        return None;
    }
    let f = &mut out[..len];
    f[0..6].copy_from_slice(&spec.dst_mac);
    f[6..12].copy_from_slice(&spec.src_mac);
    let mut at = 12;
    if let Some(v) = spec.vlan {
        f[12..14].copy_from_slice(&ETH_P_8021Q.to_be_bytes());
        f[14..16].copy_from_slice(&(v & 0x0fff).to_be_bytes());
        at = 16;
    }
    let l4 = match (spec.src, spec.dst) {
        (SocketAddr::V4(s), SocketAddr::V4(d)) => {
            f[at..at + 2].copy_from_slice(&ETH_P_IPV4.to_be_bytes());
            let l3 = at + 2;
            let ip = &mut f[l3..l3 + 20];
            ip[0] = 0x45;
            ip[1] = spec.tos;
            ip[2..4].copy_from_slice(&((20 + udp_len) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&spec.ident.to_be_bytes());
            ip[6..12].copy_from_slice(&[0x40, 0, spec.ttl, IPPROTO_UDP, 0, 0]);
            ip[12..16].copy_from_slice(&s.ip().octets());
            ip[16..20].copy_from_slice(&d.ip().octets());
            let c = internet_checksum(ip);
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            l3 + 20
        }
        (SocketAddr::V6(s), SocketAddr::V6(d)) => {
            f[at..at + 2].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
            let l3 = at + 2;
            let ip = &mut f[l3..l3 + 40];
            ip[0..4].copy_from_slice(&[0x60 | (spec.tos >> 4), spec.tos << 4, 0, 0]);
            ip[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
            ip[6..8].copy_from_slice(&[IPPROTO_UDP, spec.ttl]);
            ip[8..24].copy_from_slice(&s.ip().octets());
            ip[24..40].copy_from_slice(&d.ip().octets());
            l3 + 40
        }
        _ => panic!("write_frame: source and destination must be the same address family"),
    };
    let udp = &mut f[l4..];
    udp[0..2].copy_from_slice(&spec.src.port().to_be_bytes());
    udp[2..4].copy_from_slice(&spec.dst.port().to_be_bytes());
    udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    udp[6..8].copy_from_slice(&[0, 0]);
    udp[8..].copy_from_slice(payload);
    let c = udp_checksum(spec.src.ip(), spec.dst.ip(), udp);
    udp[6..8].copy_from_slice(&c.to_be_bytes());
    Some(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn build_then_parse_ipv4_roundtrip_with_valid_checksums() {
        let spec = FrameSpec::new(v4("10.0.0.1:5000"), v4("10.0.0.2:6363"));
        let frame = build_frame(&spec, b"hello");
        let f = parse_frame(&frame).unwrap();
        assert_eq!(f.src, spec.src);
        assert_eq!(f.dst, spec.dst);
        assert_eq!(&frame[f.payload..f.payload + f.payload_len], b"hello");
        assert!(verify_checksums(&frame, &f).ok());
    }

    #[test]
    fn build_then_parse_ipv6_and_vlan() {
        let mut spec = FrameSpec::new("[fd00::1]:5000".parse().unwrap(), "[fd00::2]:6363".parse().unwrap());
        spec.vlan = Some(42);
        let frame = build_frame(&spec, &[1, 2, 3]);
        let f = parse_frame(&frame).unwrap();
        assert_eq!(f.vlan, Some(42));
        assert_eq!(f.payload_len, 3);
        assert!(verify_checksums(&frame, &f).ok());
    }

    #[test]
    fn corrupted_payload_fails_udp_checksum() {
        let spec = FrameSpec::new(v4("10.0.0.1:5000"), v4("10.0.0.2:6363"));
        let mut frame = build_frame(&spec, b"hello");
        let n = frame.len();
        frame[n - 1] ^= 0xff;
        let f = parse_frame(&frame).unwrap();
        assert!(!verify_checksums(&frame, &f).udp_ok);
    }

    #[test]
    fn rejects_what_the_fast_path_cannot_judge() {
        let spec = FrameSpec::new(v4("10.0.0.1:5000"), v4("10.0.0.2:6363"));
        let good = build_frame(&spec, b"abcd");
        // Truncated at every length below the full headers.
        for n in 0..ETH_HLEN + 28 {
            assert!(parse_frame(&good[..n]).is_err(), "len {n}");
        }
        let mut frag = good.clone();
        frag[ETH_HLEN + 6] = 0x20; // MF
        assert_eq!(parse_frame(&frag), Err(FrameError::Fragment));
        let mut opts = good.clone();
        opts[ETH_HLEN] = 0x46;
        opts[ETH_HLEN + 3] += 4;
        opts.splice(ETH_HLEN + 20..ETH_HLEN + 20, [1, 1, 1, 0]);
        assert_eq!(parse_frame(&opts), Err(FrameError::IpOptions));
        let mut tcp = good.clone();
        tcp[ETH_HLEN + 9] = 6;
        assert_eq!(parse_frame(&tcp), Err(FrameError::NotUdp(6)));
        let mut badlen = good.clone();
        badlen[ETH_HLEN + 20 + 5] += 1;
        assert_eq!(parse_frame(&badlen), Err(FrameError::BadUdpLength));
        let mut arp = good;
        arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
        assert_eq!(parse_frame(&arp), Err(FrameError::NotIp(0x0806)));
    }

    #[test]
    fn checksum_matches_rfc1071_example() {
        // RFC 1071 section 3 example bytes: sum 0xddf2, checksum !0xddf2.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(internet_checksum(&data), !0xddf2);
    }
}
