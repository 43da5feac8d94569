//! SDP parsing and rewriting: never panic; a rewritten SDP parses again with the same number of
//! media sections.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_ng::sdp::{MediaRewrite, Rewrite, Sdp};

fuzz_target!(|data: &[u8]| {
    let Ok(sdp) = Sdp::parse(data) else { return };
    let rw = Rewrite {
        addr: "203.0.113.7".parse().unwrap(),
        origin: data.len() % 2 == 0,
        session_connection: data.len() % 3 == 0,
        remove_ice: true,
        media: (0..sdp.media.len())
            .map(|i| MediaRewrite { port: Some(30000 + 2 * i as u16), rtcp_port: 30001 + 2 * i as u16, strip_rtcp_mux: i % 2 == 1, hold: i % 3 == 2 })
            .collect(),
    };
    let out = sdp.rewrite(&rw);
    let back = Sdp::parse(&out).expect("a rewritten SDP parses");
    assert_eq!(back.media.len(), sdp.media.len());
});
