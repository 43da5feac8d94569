//! SDP parsing and rewriting (codec filtering and the loop-protection mark included): never
//! panic; a rewritten SDP parses again with the same number of media sections, every payload
//! type it advertises is one the filter kept, and the mark is there once.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_ng::codecs::{CodecFilter, CodecSpec, Filtered};
use mediaplane_ng::sdp::{crypto_line, MediaRewrite, Rewrite, Sdp};

fuzz_target!(|data: &[u8]| {
    let Ok(sdp) = Sdp::parse(data) else { return };
    // Strip by name, by payload type or all (then keep one by name), chosen by the input.
    let spec = |s: &str| CodecSpec::parse(s).unwrap();
    let filter = match data.len() % 4 {
        0 => CodecFilter { strip: vec![spec("PCMA"), spec("telephone-event/8000")], ..Default::default() },
        1 => CodecFilter { strip: vec![spec("all")], except: vec![spec("pcmu")], offer: vec![spec("opus")] },
        2 => CodecFilter { strip: vec![CodecSpec::Pt(data.first().map_or(0, |b| b % 128))], ..Default::default() },
        _ => CodecFilter::default(),
    };
    let formats: Vec<Option<Vec<u8>>> = sdp
        .media
        .iter()
        .map(|m| match filter.apply(&m.formats) {
            Filtered::Narrowed { keep, .. } => Some(keep),
            Filtered::Unchanged | Filtered::Refused => None,
        })
        .collect();
    let rw = Rewrite {
        addr: "203.0.113.7".parse().unwrap(),
        origin: data.len() % 2 == 0,
        session_connection: data.len() % 3 == 0,
        remove_ice: true,
        media: (0..sdp.media.len())
            .map(|i| MediaRewrite {
                port: Some(30000 + 2 * i as u16),
                rtcp_port: 30001 + 2 * i as u16,
                strip_rtcp_mux: i % 2 == 1,
                // Asked of the others, as toward the muxing party of `rtcp-mux-demux`.
                add_rtcp_mux: i % 2 == 0,
                hold: i % 3 == 2,
                formats: formats[i].clone(),
                // Every fourth section turns SDES: a new protocol and one key line.
                proto: (i % 4 == 1).then(|| "RTP/SAVP".to_string()),
                crypto: (i % 4 == 1).then(|| vec![crypto_line(1, "AES_CM_128_HMAC_SHA1_80", &[7; 30], false)]),
                // Every fourth section (another one) gets the relay's ICE and DTLS instead of
                // its own, as toward a WebRTC party.
                transport: (i % 4 == 3).then(|| vec!["ice-ufrag:fuzz".to_string(), "setup:passive".to_string()]),
            })
            .collect(),
        mark: Some("fuzz1".into()),
        session_attrs: vec!["ice-lite".into(), "group:BUNDLE 0 1".into()],
        remove_dtls: true,
        remove_bundle: data.len() % 5 == 0,
    };
    let out = sdp.rewrite(&rw);
    let back = Sdp::parse(&out).expect("a rewritten SDP parses");
    assert_eq!(back.media.len(), sdp.media.len());
    assert!(back.marked("fuzz1"));
    // The relay's group only, when the offerer's are removed.
    if rw.remove_bundle {
        assert_eq!(back.bundle_groups, vec![vec!["0".to_string(), "1".to_string()]]);
    }
    let marks = |b: &[u8]| b.split(|&c| c == b'\n').filter(|l| l.strip_suffix(b"\r").unwrap_or(l) == b"a=rtpengine:fuzz1").count();
    assert_eq!(marks(&out), marks(data) + usize::from(!sdp.marked("fuzz1")), "marked once");
    for (i, m) in back.media.iter().enumerate().filter(|(i, _)| i % 4 == 3) {
        let attrs: Vec<(&str, &str)> = m.transport_attrs.iter().filter(|(n, _)| n != "mid").map(|(n, v)| (n.as_str(), v.as_str())).collect();
        assert_eq!(attrs, vec![("ice-ufrag", "fuzz"), ("setup", "passive")], "section {i}: only the relay's ICE and DTLS");
    }
    for (i, m) in back.media.iter().enumerate().filter(|(i, _)| i % 4 == 1) {
        assert_eq!(m.proto, "RTP/SAVP", "section {i}");
        assert_eq!(m.crypto.iter().map(|c| (c.tag, c.key.clone())).collect::<Vec<_>>(), vec![(1, Some(vec![7; 30]))], "section {i}: only the new key");
    }
    for (i, m) in back.media.iter().enumerate() {
        if let (Some(keep), false) = (&formats[i], sdp.media[i].formats.is_empty()) {
            assert_eq!(m.formats.iter().map(|f| f.pt).collect::<Vec<_>>(), *keep, "section {i} advertises what the filter kept");
        }
    }
});
