//! The reference forwarding decision on arbitrary payloads and sources: never panic, and never
//! forward anything the model does not allow (the same oracle the data planes are tested by).
//! Feedback it finds is routed: never a panic, only valid compound packets, only to publishers.
//! Core's per-packet pipeline (`mediaplane_core::pipeline::reference`) runs on the same input.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_core::feedback::FeedbackRouter;
use mediaplane_core::model::{StreamRef, StreamSpec};
use mediaplane_core::rtp::parse_rtcp_compound;
use mediaplane_core::table::{SourceRule, Verdict};
use mediaplane_core::{ForwardingTable, Model};
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};

fn table() -> &'static ForwardingTable {
    static T: OnceLock<ForwardingTable> = OnceLock::new();
    T.get_or_init(|| {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let mut m = Model::new();
        m.create_room("r").unwrap();
        for i in 0..3u16 {
            m.add_participant("r", &format!("p{i}"), a(&format!("10.0.0.1:{}", 4000 + 2 * i)), a(&format!("10.0.1.{}:5000", i + 1))).unwrap();
        }
        m.publish("r", "p0", "main", StreamSpec::default()).unwrap();
        m.publish("r", "p0", "video", StreamSpec { ssrc: Some(9), ..Default::default() }).unwrap();
        m.publish("r", "p1", "low", StreamSpec { ssrc: Some(7), ..Default::default() }).unwrap();
        m.publish("r", "p2", "raw", StreamSpec { rtp: false, ..Default::default() }).unwrap();
        for (s, p, n) in [("p1", "p0", "main"), ("p2", "p0", "main"), ("p0", "p1", "low"), ("p0", "p2", "raw"), ("p1", "p0", "video"), ("p2", "p0", "video")] {
            m.subscribe("r", s, StreamRef { publisher: p.into(), stream: n.into() }).unwrap();
        }
        ForwardingTable::compile(&m, 1)
    })
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let local: SocketAddr = format!("10.0.0.1:{}", 4000 + 2 * (data[0] % 4) as u16).parse().unwrap();
    let src: SocketAddr = format!("10.0.1.{}:{}", data[1] % 4 + 1, 5000 + (data[1] >> 7) as u16).parse().unwrap();
    let verdict = table().classify(local, src, &data[2..]);
    // Core's per-packet pipeline on the same input (as the data planes' oracle): no panic, and
    // copies only of what classify forwards (a feedback compound's sender report included),
    // never back to the sender.
    let forwards = matches!(verdict, Verdict::Forward(_) | Verdict::Learn(_) | Verdict::Feedback { stream: Some(_), .. });
    for e in mediaplane_core::pipeline::reference(table(), local, src, &data[2..]) {
        if let mediaplane_core::pipeline::Effect::Send { to, copy: Some(_), .. } = e {
            assert!(forwards && to != src, "a copy to {to} of what classify does not forward");
        }
    }
    match verdict {
        Verdict::Forward(e) => {
            assert_eq!(e.source, SourceRule::Fixed(src));
            assert!(e.copies.iter().all(|c| c.to != src));
        }
        Verdict::Feedback { entry, stream } => {
            assert_eq!(entry.source, src);
            static ROUTER: OnceLock<Mutex<FeedbackRouter>> = OnceLock::new();
            let mut router = ROUTER.get_or_init(Default::default).lock().unwrap();
            let now = u64::from(data[0]) * 100_000_000;
            if let Ok(o) = router.route(entry, &data[2..], now) {
                for r in &o.routed {
                    assert!(parse_rtcp_compound(&r.packet).is_ok(), "routed feedback is a valid compound");
                    assert!(r.to != src && entry.routes.iter().any(|x| x.to == r.to && x.from == r.from));
                }
                if let (Some(f), Some(_)) = (&o.forward, stream) {
                    assert!(parse_rtcp_compound(f).is_ok(), "the forwarded sender report is a valid compound");
                }
            }
        }
        _ => {}
    }
});
