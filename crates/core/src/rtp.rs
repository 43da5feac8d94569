//! RTP (RFC 3550, header extensions per RFC 8285), RTCP compound packets and STUN detection.
//!
//! Only what forwarding needs is decoded; payload bytes are never touched.

/// Why a datagram is not a well-formed RTP or RTCP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RtpError {
    #[error("shorter than its header")]
    Truncated,
    #[error("version is not 2")]
    BadVersion,
    #[error("padding length invalid")]
    BadPadding,
    #[error("header extension invalid")]
    BadExtension,
    #[error("RTCP length field inconsistent")]
    BadRtcpLength,
}

/// A parsed RTP fixed header plus the location of its extension and payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtpHeader {
    pub marker: bool,
    pub payload_type: u8,
    pub sequence: u16,
    pub timestamp: u32,
    pub ssrc: u32,
    pub csrc_count: u8,
    /// (profile, offset of extension data, length in bytes) when the X bit is set.
    pub extension: Option<(u16, usize, usize)>,
    pub payload_offset: usize,
    pub payload_len: usize,
    pub padding_len: usize,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// What a datagram on a media port is, by RFC 7983 / RFC 5761 demultiplexing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaKind {
    Stun,
    Rtp,
    Rtcp,
    Other,
}

/// Classify a datagram's first bytes (RFC 7983: 0-3 STUN, 128-191 RTP/RTCP; RFC 5761: RTCP
/// packet types 192-223 in the second byte).
pub fn demux(d: &[u8]) -> MediaKind {
    match d.first() {
        Some(0..=3) if is_stun(d) => MediaKind::Stun,
        Some(128..=191) if d.len() >= 2 => {
            if (192..=223).contains(&d[1]) {
                MediaKind::Rtcp
            } else {
                MediaKind::Rtp
            }
        }
        _ => MediaKind::Other,
    }
}

/// STUN (RFC 5389): top two bits zero, length a multiple of 4, the magic cookie.
pub fn is_stun(d: &[u8]) -> bool {
    d.len() >= 20 && d[0] & 0xc0 == 0 && be16(d, 2).is_multiple_of(4) && be32(d, 4) == 0x2112_a442
}

impl RtpHeader {
    /// [`RtpHeader::parse`] of an SRTP packet: its header and extension are in the clear, the
    /// rest is not. The padding count (the payload's last byte) is ciphertext, or the
    /// authentication tag's last byte, so it is not read: `padding_len` is 0 and
    /// `payload_len` runs to the end (what unprotecting it gives has the real ones).
    pub fn parse_srtp(d: &[u8]) -> Result<RtpHeader, RtpError> {
        RtpHeader::parse_with(d, false)
    }

    pub fn parse(d: &[u8]) -> Result<RtpHeader, RtpError> {
        RtpHeader::parse_with(d, true)
    }

    fn parse_with(d: &[u8], read_padding: bool) -> Result<RtpHeader, RtpError> {
        if d.len() < 12 {
            return Err(RtpError::Truncated);
        }
        if d[0] >> 6 != 2 {
            return Err(RtpError::BadVersion);
        }
        let padding = d[0] & 0x20 != 0;
        let has_ext = d[0] & 0x10 != 0;
        let cc = d[0] & 0x0f;
        let mut off = 12 + 4 * cc as usize;
        if d.len() < off {
            return Err(RtpError::Truncated);
        }
        let extension = if has_ext {
            if d.len() < off + 4 {
                return Err(RtpError::Truncated);
            }
            let profile = be16(d, off);
            let len = be16(d, off + 2) as usize * 4;
            let data = off + 4;
            if d.len() < data + len {
                return Err(RtpError::BadExtension);
            }
            off = data + len;
            Some((profile, data, len))
        } else {
            None
        };
        let padding_len = if padding && read_padding {
            let p = *d.last().unwrap() as usize;
            if p == 0 || off + p > d.len() {
                return Err(RtpError::BadPadding);
            }
            p
        } else {
            0
        };
        Ok(RtpHeader {
            marker: d[1] & 0x80 != 0,
            payload_type: d[1] & 0x7f,
            sequence: be16(d, 2),
            timestamp: be32(d, 4),
            ssrc: be32(d, 8),
            csrc_count: cc,
            extension,
            payload_offset: off,
            payload_len: d.len() - off - padding_len,
            padding_len,
        })
    }

    /// RFC 8285 extension elements (id, data) for the one-byte (0xBEDE) and two-byte (0x100x)
    /// forms. Other profiles yield nothing.
    pub fn extension_elements<'a>(&self, d: &'a [u8]) -> Result<Vec<(u8, &'a [u8])>, RtpError> {
        let Some((profile, start, len)) = self.extension else {
            return Ok(Vec::new());
        };
        let ext = &d[start..start + len];
        let two_byte = profile & 0xfff0 == 0x1000;
        if profile != 0xbede && !two_byte {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        let mut i = 0;
        while i < ext.len() {
            if ext[i] == 0 {
                i += 1; // padding byte
                continue;
            }
            let (id, elen, hdr) = if two_byte {
                if i + 2 > ext.len() {
                    return Err(RtpError::BadExtension);
                }
                (ext[i], ext[i + 1] as usize, 2)
            } else {
                let id = ext[i] >> 4;
                if id == 15 {
                    break; // reserved: stop processing (RFC 8285 4.2)
                }
                (id, (ext[i] & 0x0f) as usize + 1, 1)
            };
            if i + hdr + elen > ext.len() {
                return Err(RtpError::BadExtension);
            }
            out.push((id, &ext[i + hdr..i + hdr + elen]));
            i += hdr + elen;
        }
        Ok(out)
    }
}

/// One packet of an RTCP compound packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtcpPacket<'a> {
    pub packet_type: u8,
    /// Reception report count or feedback message type (the 5-bit field).
    pub count: u8,
    /// SSRC of the packet's sender (the first word after the header).
    pub sender_ssrc: u32,
    pub bytes: &'a [u8],
}

impl RtcpPacket<'_> {
    /// Transport-layer (205) and payload-specific (206) feedback: NACK, PLI, FIR, REMB...
    pub fn is_feedback(&self) -> bool {
        self.packet_type == 205 || self.packet_type == 206
    }
}

/// Split an RTCP compound packet into its packets, validating every length field.
pub fn parse_rtcp_compound(d: &[u8]) -> Result<Vec<RtcpPacket<'_>>, RtpError> {
    if d.len() < 8 {
        return Err(RtpError::Truncated);
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < d.len() {
        if d.len() - i < 4 {
            return Err(RtpError::BadRtcpLength);
        }
        if d[i] >> 6 != 2 {
            return Err(RtpError::BadVersion);
        }
        let len = (be16(d, i + 2) as usize + 1) * 4;
        if i + len > d.len() || len < 8 {
            return Err(RtpError::BadRtcpLength);
        }
        out.push(RtcpPacket { packet_type: d[i + 1], count: d[i] & 0x1f, sender_ssrc: be32(d, i + 4), bytes: &d[i..i + len] });
        i += len;
    }
    Ok(out)
}

/// Build a minimal RTP packet (no CSRC, no extension): used by generators and tests.
pub fn build_rtp(payload_type: u8, sequence: u16, timestamp: u32, ssrc: u32, payload: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(12 + payload.len());
    p.push(0x80);
    p.push(payload_type & 0x7f);
    p.extend_from_slice(&sequence.to_be_bytes());
    p.extend_from_slice(&timestamp.to_be_bytes());
    p.extend_from_slice(&ssrc.to_be_bytes());
    p.extend_from_slice(payload);
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_minimal_rtp() {
        let p = build_rtp(8, 1000, 160, 0xdead_beef, &[0xd5; 160]);
        let h = RtpHeader::parse(&p).unwrap();
        assert_eq!((h.payload_type, h.sequence, h.timestamp, h.ssrc), (8, 1000, 160, 0xdead_beef));
        assert_eq!((h.payload_offset, h.payload_len), (12, 160));
        assert_eq!(demux(&p), MediaKind::Rtp);
    }

    #[test]
    fn parses_csrcs_one_byte_extension_and_padding() {
        let mut p = vec![0x80 | 0x20 | 0x10 | 2, 0x80 | 96, 0, 7, 0, 0, 0, 1, 0, 0, 0, 9];
        p.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 2]); // two CSRCs
                                                        // 0xBEDE, length 1 word: element id 1, len 2 (0x11), data aa bb, one padding byte.
        p.extend_from_slice(&[0xbe, 0xde, 0, 1, 0x11, 0xaa, 0xbb, 0]);
        p.extend_from_slice(&[1, 2, 3]); // payload
        p.extend_from_slice(&[0, 0, 3]); // 3 bytes padding
        let h = RtpHeader::parse(&p).unwrap();
        assert!(h.marker);
        assert_eq!(h.csrc_count, 2);
        assert_eq!(h.payload_offset, 12 + 8 + 8);
        assert_eq!(h.payload_len, 3);
        assert_eq!(h.padding_len, 3);
        let els = h.extension_elements(&p).unwrap();
        assert_eq!(els, vec![(1u8, &[0xaa, 0xbb][..])]);
    }

    #[test]
    fn two_byte_extension_elements() {
        let mut p = build_rtp(96, 1, 1, 1, &[]);
        p[0] |= 0x10;
        p.extend_from_slice(&[0x10, 0x00, 0, 1, 5, 2, 0xca, 0xfe]);
        let h = RtpHeader::parse(&p).unwrap();
        assert_eq!(h.extension_elements(&p).unwrap(), vec![(5u8, &[0xca, 0xfe][..])]);
    }

    #[test]
    fn rejects_malformed_rtp() {
        assert_eq!(RtpHeader::parse(&[0x80; 11]), Err(RtpError::Truncated));
        assert_eq!(RtpHeader::parse(&[0x40; 12]), Err(RtpError::BadVersion));
        let mut cc = build_rtp(0, 0, 0, 0, &[]);
        cc[0] |= 3; // three CSRCs promised, none present
        assert_eq!(RtpHeader::parse(&cc), Err(RtpError::Truncated));
        let mut pad = build_rtp(0, 0, 0, 0, &[1, 2]);
        pad[0] |= 0x20;
        *pad.last_mut().unwrap() = 200;
        assert_eq!(RtpHeader::parse(&pad), Err(RtpError::BadPadding));
        let mut ext = build_rtp(0, 0, 0, 0, &[]);
        ext[0] |= 0x10;
        ext.extend_from_slice(&[0xbe, 0xde, 0, 9]);
        assert_eq!(RtpHeader::parse(&ext), Err(RtpError::BadExtension));
    }

    #[test]
    fn rtcp_compound_sr_plus_pli() {
        // SR with no report blocks (7 words + header = len 6), then PLI (len 2).
        let mut sr = vec![0x80, 200, 0, 6];
        sr.extend_from_slice(&0x1111_1111u32.to_be_bytes());
        sr.extend_from_slice(&[0; 20]);
        let mut pli = vec![0x81, 206, 0, 2];
        pli.extend_from_slice(&0x2222_2222u32.to_be_bytes());
        pli.extend_from_slice(&0x1111_1111u32.to_be_bytes());
        let compound = [sr, pli].concat();
        assert_eq!(demux(&compound), MediaKind::Rtcp);
        let pkts = parse_rtcp_compound(&compound).unwrap();
        assert_eq!(pkts.len(), 2);
        assert_eq!(pkts[0].packet_type, 200);
        assert_eq!(pkts[0].sender_ssrc, 0x1111_1111);
        assert!(pkts[1].is_feedback());
        assert_eq!(pkts[1].count, 1);
        // A length field running past the end is rejected.
        let mut bad = compound.clone();
        bad[3] = 60;
        assert_eq!(parse_rtcp_compound(&bad), Err(RtpError::BadRtcpLength));
    }

    #[test]
    fn detects_stun_binding_request() {
        let mut s = vec![0x00, 0x01, 0x00, 0x00, 0x21, 0x12, 0xa4, 0x42];
        s.extend_from_slice(&[7; 12]);
        assert!(is_stun(&s));
        assert_eq!(demux(&s), MediaKind::Stun);
        s[5] = 0;
        assert!(!is_stun(&s));
        assert_eq!(demux(b""), MediaKind::Other);
    }
}
