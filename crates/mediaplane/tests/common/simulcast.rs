//! A simulcast publisher's packets and its receivers' sockets, for the simulcast tests.

use mediaplane_core::rtp::build_rtp;
use std::net::UdpSocket;

/// The publisher's layers, lowest first.
pub const LAYERS: [u32; 3] = [0x100, 0x101, 0x102];

/// One packet of a VP8 frame of `layer`, `size` bytes of payload: descriptor with a 15-bit
/// picture id and TL0PICIDX, the payload header's key frame bit on the first packet of a
/// keyframe, then the layer's number (so receivers can tell).
pub fn vp8(layer: usize, seq: u16, ts: u32, pic: u16, first: bool, key: bool, size: usize) -> Vec<u8> {
    let mut payload = vec![if first { 0x90 } else { 0x80 }, 0xc0, 0x80 | (pic >> 8) as u8, pic as u8, pic as u8];
    payload.push(if first && key { 0x10 } else { 0x11 });
    payload.push(layer as u8);
    payload.resize(size, 0xee);
    build_rtp(96, seq, ts, LAYERS[layer], &payload)
}

/// Everything waiting on a non-blocking socket.
pub fn drain(s: &UdpSocket, into: &mut Vec<Vec<u8>>) {
    let mut buf = [0u8; 2048];
    while let Ok((n, _)) = s.recv_from(&mut buf) {
        into.push(buf[..n].to_vec());
    }
}

/// Marks in `asked` each layer whose SSRC a PLI among `packets` (RTCP at the publisher) names.
pub fn keyframes_asked(packets: &[Vec<u8>], asked: &mut [bool; 3]) {
    for p in packets {
        for m in mediaplane_core::rtp::parse_rtcp_compound(p).unwrap() {
            if m.packet_type == 206 && m.count == 1 {
                let media = u32::from_be_bytes(m.bytes[8..12].try_into().unwrap());
                if let Some(l) = LAYERS.iter().position(|s| *s == media) {
                    asked[l] = true;
                }
            }
        }
    }
}
