//! The NG protocol's bencode and cookie framing: never panic; what decodes re-encodes to a
//! document that decodes to the same value.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_ng::bencode::decode;
use mediaplane_ng::protocol::parse_frame;

fuzz_target!(|data: &[u8]| {
    let _ = parse_frame(data);
    if let Ok(v) = decode(data) {
        let again = decode(&v.encode()).expect("our own encoding decodes");
        assert_eq!(again, v);
    }
});
