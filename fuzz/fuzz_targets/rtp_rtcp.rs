//! RTP header (CSRCs, RFC 8285 extensions, padding), RTCP compound and STUN detection.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_core::rtp::{demux, parse_rtcp_compound, RtpHeader};

fuzz_target!(|data: &[u8]| {
    let _ = demux(data);
    if let Ok(h) = RtpHeader::parse(data) {
        assert_eq!(h.payload_offset + h.payload_len + h.padding_len, data.len());
        let _ = h.extension_elements(data);
    }
    if let Ok(p) = parse_rtcp_compound(data) {
        assert_eq!(p.iter().map(|x| x.bytes.len()).sum::<usize>(), data.len());
    }
});
