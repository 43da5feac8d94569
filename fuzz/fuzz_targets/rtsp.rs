//! The RTSP proxy's parsers on what viewers and upstreams send: a byte stream cut into messages
//! and interleaved frames (`decode`), the Transport header of each request, and a body as the
//! presentation description an upstream answers DESCRIBE with. Never panics; every item takes
//! at least one byte and no more than there is; a message re-encoded decodes to itself; a
//! description the proxy serves parses again with the same tracks.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_rtsp::describe::Presentation;
use mediaplane_rtsp::message::{decode, Message};
use mediaplane_rtsp::transport::TransportSpec;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((msg, used))) = decode(rest) {
        assert!(used > 0 && used <= rest.len());
        rest = &rest[used..];
        match &msg {
            Message::Request(r) => {
                for t in TransportSpec::parse_list(r.headers.get("Transport").unwrap_or("")) {
                    assert_eq!(TransportSpec::parse(&t.to_header()).as_ref(), Ok(&t));
                }
                let (again, n) = decode(&r.to_bytes()).unwrap().unwrap();
                assert_eq!(n, r.to_bytes().len());
                if r.headers.get("Content-Length").is_none_or(|v| v.trim().parse() == Ok(r.body.len())) {
                    assert_eq!(again, msg);
                }
            }
            Message::Response(r) => {
                if let Ok(p) = Presentation::parse(&r.body) {
                    let served = Presentation::parse(p.served("192.0.2.1".parse().unwrap(), 1).as_bytes()).unwrap();
                    assert_eq!(served.tracks.len(), p.tracks.len());
                    for (a, b) in served.tracks.iter().zip(&p.tracks) {
                        assert_eq!((&a.kind, &a.payload_types, a.clock_rate), (&b.kind, &b.payload_types, b.clock_rate));
                    }
                }
            }
            Message::Interleaved { data, .. } => assert!(data.len() <= u16::MAX as usize),
        }
    }
    let _ = Presentation::parse(data);
});
