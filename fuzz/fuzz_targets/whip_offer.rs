//! WHIP/WHEP offers: any text read as an offer never panics; an offer that parses gets an
//! answer that parses back (one format per answered section, every section in order), whose
//! lines are all `x=value` with nothing the offer smuggled in (no line break, no control).
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_webrtc::dtls::Fingerprint;
use mediaplane_webrtc::ice::Credentials;
use mediaplane_webrtc::sdp::{
    choose_format, Answer, AnsweredMedia, Direction, Offer, Sending, SimulcastAnswer, ABS_SEND_TIME_URI, RTP_STREAM_ID, SDES_MID, TRANSPORT_CC_URI,
};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(offer) = Offer::parse(text) else { return };
    let _ = offer.answer_role();
    let media: Vec<AnsweredMedia> = offer
        .media
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let sending = (i % 2 == 0).then(|| Sending { ssrc: 7, cname: "pub".into(), msid: ("pub".into(), "video".into()) });
            // A simulcast section is answered as WHIP does: its RIDs, and the extensions naming them.
            let extmaps: Vec<(u8, String)> = m.extmaps.iter().filter(|(_, u)| u == RTP_STREAM_ID || u == SDES_MID).cloned().collect();
            let simulcast = (!m.rids.is_empty()).then(|| SimulcastAnswer { rids: m.rids.clone(), extmaps });
            // The congestion-control extensions as WHIP answers them: transport-cc when offered,
            // else abs-send-time.
            let transport_cc = m.extmap(TRANSPORT_CC_URI);
            let abs_send_time = m.extmap(ABS_SEND_TIME_URI).filter(|_| transport_cc.is_none());
            AnsweredMedia { format: choose_format(m).cloned(), direction: Direction::SendOnly, sending, simulcast, transport_cc, abs_send_time }
        })
        .collect();
    // The handlers refuse an offer of which nothing is taken; any other answer must parse.
    let answered = media.iter().any(|a| a.format.is_some());
    let ice = Credentials { ufrag: "sfuufrag".into(), pwd: "sfu-password-0123456789".into() };
    let fingerprint = Fingerprint::parse("sha-256 0F:74:31:25:CB:A2:13:EC:28:6F:6D:2C:61:FF:5D:C2:BC:B9:DB:3D:98:14:8D:1A:BB:EA:33:0C:A4:60:A8:8E").unwrap();
    let answer_media = media.clone();
    let answer = Answer { offer: &offer, ice: &ice, fingerprint: &fingerprint, setup: "passive", candidate: "192.0.2.1:40000".parse().unwrap(), media }.write();
    for line in answer.split("\r\n").filter(|l| !l.is_empty()) {
        assert!(line.len() >= 2 && line.as_bytes()[1] == b'=' && !line.chars().any(|c| c.is_control()), "answer line {line:?}");
    }
    assert!(answer.ends_with("\r\n"));
    if !answered {
        return;
    }
    // Read back as a browser would: every section, in order.
    let back = Offer::parse(&answer).unwrap_or_else(|e| panic!("the answer does not parse: {e}\n{answer}"));
    assert_eq!(back.media.iter().map(|m| m.mid.as_str()).collect::<Vec<_>>(), offer.media.iter().map(|m| m.mid.as_str()).collect::<Vec<_>>());
    // What a simulcast section echoes reads back as it was given.
    for (b, (o, a)) in back.media.iter().zip(offer.media.iter().zip(&answer_media)) {
        if let (Some(s), Some(_)) = (&a.simulcast, &a.format) {
            assert!(b.simulcast && s.extmaps.iter().all(|e| b.extmaps.contains(e)), "section {:?}: {s:?} read back as {:?}", o.mid, b.extmaps);
        }
    }
});
