//! Ethernet/IP/UDP parsing and checksum verification: never panic, offsets stay in bounds.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_core::packet::{parse_frame, verify_checksums};

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = parse_frame(data) {
        assert!(f.l3 < f.l4 && f.l4 < f.payload && f.payload + f.payload_len <= data.len());
        let _ = verify_checksums(data, &f);
    }
});
