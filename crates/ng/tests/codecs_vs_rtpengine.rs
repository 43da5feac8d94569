//! Codec filtering and `loop-protect` over NG, mediaplane beside rtpengine 10.5: the same offers
//! and answers go to mediaplane (in-process relay: SessionManager + user-space plane + serve_ng)
//! and to rtpengine-daemon (user space, on loopback), and what comes back must agree: the
//! payload types of every `m=` line, and in offers the `a=rtpmap`/`a=fmtp`/`a=rtcp-fb` lines
//! kept (rtpengine regenerates the SDP, mediaplane keeps its bytes: lines are compared as sets).
//! The cases where they differ on purpose are in `mediaplane_ng::codecs`' unit tests (a payload
//! type number; a filter leaving only telephone-event, where rtpengine emits an empty format list).
//!
//! loop-protect: both mark their SDP with `a=rtpengine:<instance>` at session level, and return
//! an offer or answer carrying their own mark unchanged without creating or changing a call.
//!
//! Loopback only (127.86.0.0/16). Needs root and rtpengine for the rtpengine half (skipped
//! otherwise, a failure under CI=true); the mediaplane half always runs.

mod common;

use common::*;
use mediaplane_bench::process::Supervised;
use mediaplane_bench::sip;
use mediaplane_ng::bencode::Value;
use mediaplane_ng::client::NgClient;
use std::collections::BTreeSet;
use std::net::{SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MEDIAPLANE_IP: &str = "127.86.0.1";
const RTPENGINE_IP: &str = "127.86.0.2";

/// PCMU, PCMA (with rtcp-fb), G.722 and telephone-event (with fmtp).
const FOUR: &str = "v=0\r\no=caller 1 1 IN IP4 127.86.1.1\r\ns=-\r\nc=IN IP4 127.86.1.1\r\nt=0 0\r\nm=audio 20000 RTP/AVP 0 8 9 101\r\n\
a=rtpmap:0 PCMU/8000\r\na=rtpmap:8 PCMA/8000\r\na=rtcp-fb:8 nack\r\na=rtpmap:9 G722/8000\r\na=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-16\r\na=ptime:20\r\na=sendrecv\r\n";

/// Opus and two telephone-events (8 and 48 kHz) beside PCMU and G.722; VP8 and H.264 video.
const AUDIO_VIDEO: &str = "v=0\r\no=caller 1 1 IN IP4 127.86.1.1\r\ns=-\r\nc=IN IP4 127.86.1.1\r\nt=0 0\r\n\
m=audio 20000 RTP/AVP 0 9 111 101 102\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:9 G722/8000\r\na=rtpmap:111 opus/48000/2\r\n\
a=fmtp:111 minptime=10;useinbandfec=1\r\na=rtcp-fb:111 transport-cc\r\na=rtpmap:101 telephone-event/8000\r\na=rtpmap:102 telephone-event/48000\r\na=sendrecv\r\n\
m=video 20002 RTP/AVP 96 97\r\na=rtpmap:96 VP8/90000\r\na=rtcp-fb:96 nack\r\na=rtcp-fb:* ccm fir\r\na=rtpmap:97 H264/90000\r\na=fmtp:97 profile-level-id=42e01f\r\na=sendrecv\r\n";

/// Static payload types without rtpmap (rtpengine adds rtpmap lines for them: formats only).
const STATIC: &str = "v=0\r\no=caller 1 1 IN IP4 127.86.1.1\r\ns=-\r\nc=IN IP4 127.86.1.1\r\nt=0 0\r\nm=audio 20000 RTP/AVP 0 8 18 9\r\na=sendrecv\r\n";

fn answer_sdp(formats: &[u8]) -> String {
    let name = |pt: u8| match pt {
        0 => "PCMU/8000",
        8 => "PCMA/8000",
        9 => "G722/8000",
        _ => "telephone-event/8000",
    };
    let rtpmaps: String = formats.iter().map(|&pt| format!("a=rtpmap:{pt} {}\r\n", name(pt))).collect();
    let list: Vec<String> = formats.iter().map(u8::to_string).collect();
    format!(
        "v=0\r\no=callee 1 1 IN IP4 127.86.2.1\r\ns=-\r\nc=IN IP4 127.86.2.1\r\nt=0 0\r\nm=audio 30000 RTP/AVP {}\r\n{rtpmaps}a=sendrecv\r\n",
        list.join(" ")
    )
}

/// One offer (and, with `answer`, its answer) of a call of its own.
struct Case {
    what: &'static str,
    sdp: &'static str,
    flags: &'static [&'static str],
    codec: Option<fn() -> Value>,
    /// Compare the codec attributes too, not only the format lists.
    attrs: bool,
    /// (the answer's formats, its flags)
    answer: Option<(&'static [u8], &'static [&'static str])>,
}

fn offer_case(what: &'static str, sdp: &'static str, flags: &'static [&'static str]) -> Case {
    Case { what, sdp, flags, codec: None, attrs: true, answer: None }
}

fn cases() -> Vec<Case> {
    vec![
        offer_case("strip PCMA", FOUR, &["codec-strip-PCMA"]),
        offer_case("strip, lower case", FOUR, &["codec-strip-pcma"]),
        offer_case("strip name/clock", FOUR, &["codec-strip-PCMA/8000"]),
        offer_case("strip another clock rate: nothing", FOUR, &["codec-strip-PCMA/16000"]),
        offer_case("mask", FOUR, &["codec-mask-PCMA"]),
        offer_case("strip telephone-event", FOUR, &["codec-strip-telephone-event"]),
        offer_case("strip all except", FOUR, &["codec-strip-all", "codec-except-PCMU"]),
        offer_case("mask all except two", FOUR, &["codec-mask-all", "codec-except-telephone-event", "codec-except-PCMA"]),
        offer_case("strip all, offer reorders", FOUR, &["codec-strip-all", "codec-offer-G722", "codec-offer-PCMU"]),
        offer_case("except keeps order, offer follows", FOUR, &["codec-strip-all", "codec-except-PCMU", "codec-offer-G722"]),
        offer_case("a name beats except", FOUR, &["codec-strip-PCMA", "codec-except-PCMA"]),
        offer_case("except alone: nothing", FOUR, &["codec-except-PCMU"]),
        offer_case("strip all alone: unchanged", FOUR, &["codec-strip-all"]),
        offer_case("every codec named: unchanged", FOUR, &["codec-strip-PCMU", "codec-strip-PCMA", "codec-strip-G722", "codec-strip-telephone-event"]),
        offer_case("orphaned telephone-event/8000 goes", AUDIO_VIDEO, &["codec-strip-PCMU", "codec-strip-G722"]),
        offer_case("audio and video", AUDIO_VIDEO, &["codec-strip-opus", "codec-strip-vp8"]),
        offer_case("channels", AUDIO_VIDEO, &["codec-strip-opus/48000/2"]),
        offer_case("one channel by default: no match", AUDIO_VIDEO, &["codec-strip-opus/48000"]),
        offer_case("strip all except across sections", AUDIO_VIDEO, &["codec-strip-all", "codec-except-H264", "codec-except-opus"]),
        Case { attrs: false, ..offer_case("static types by RFC 3551 name", STATIC, &["codec-strip-G729", "codec-strip-PCMU"]) },
        Case { codec: Some(|| Value::dict([("strip", list(&["PCMA", "telephone-event"]))])), ..offer_case("the codec dictionary", FOUR, &[]) },
        Case { codec: Some(|| Value::dict([("mask", list(&["PCMU"]))])), ..offer_case("the codec dictionary, mask", FOUR, &[]) },
        // Answers: rtpengine adds the offer's a=fmtp to an answer it filters; formats only.
        Case { answer: Some((&[8, 0, 101], &[])), ..offer_case("the offer's strip applies to its answer", FOUR, &["codec-strip-PCMA"]) },
        Case { answer: Some((&[0, 8, 101], &["codec-strip-PCMA"])), ..offer_case("strip in the answer", FOUR, &[]) },
        Case { answer: Some((&[0, 8, 101], &["codec-mask-PCMA"])), ..offer_case("mask in the answer: not read", FOUR, &[]) },
        Case { answer: Some((&[0, 8, 101], &["codec-strip-all", "codec-offer-PCMA", "codec-offer-PCMU"])), ..offer_case("offer in the answer", FOUR, &[]) },
    ]
}

/// Per media section: its payload types, and (when `attrs`) its rtpmap/fmtp/rtcp-fb lines.
type View = Vec<(String, BTreeSet<String>)>;

fn view(sdp: &str, attrs: bool) -> View {
    let mut v: View = Vec::new();
    for line in sdp.lines() {
        if let Some(m) = line.strip_prefix("m=") {
            v.push((m.split_whitespace().skip(3).collect::<Vec<_>>().join(" "), BTreeSet::new()));
        } else if attrs && ["a=rtpmap:", "a=fmtp:", "a=rtcp-fb:"].iter().any(|p| line.starts_with(p)) {
            if let Some((_, set)) = v.last_mut() {
                set.insert(line.to_string());
            }
        }
    }
    v
}

/// What one relay answers to every case: (offer view, answer view).
fn run_cases(ng: &mut NgClient, tag: &str) -> Vec<(View, Option<View>)> {
    let mut out = Vec::new();
    for (i, c) in cases().iter().enumerate() {
        let call = format!("codecs-{tag}-{i}");
        let mut o = offer_answer("offer", &call, "caller", None, c.sdp, "127.86.1.1");
        o[4].1 = list(c.flags);
        if let Some(d) = c.codec {
            o.push(("codec", d()));
        }
        let r = ng.cmd(o);
        assert_eq!(text(&r, "result"), "ok", "{tag}, {}: {r:?}", c.what);
        let offered = view(&text(&r, "sdp"), c.attrs);
        let answered = c.answer.map(|(formats, flags)| {
            let mut a = offer_answer("answer", &call, "caller", Some("callee"), &answer_sdp(formats), "127.86.2.1");
            a[4].1 = list(flags);
            let r = ng.cmd(a);
            assert_eq!(text(&r, "result"), "ok", "{tag}, {} (answer): {r:?}", c.what);
            view(&text(&r, "sdp"), false)
        });
        ng.cmd(vec![("command", "delete".into()), ("call-id", call.as_str().into()), ("from-tag", "caller".into())]);
        out.push((offered, answered));
    }
    out
}

/// The session-level `a=rtpengine:` values of an SDP.
fn marks(sdp: &str) -> Vec<String> {
    sdp.lines().take_while(|l| !l.starts_with("m=")).filter_map(|l| l.strip_prefix("a=rtpengine:")).map(str::to_string).collect()
}

/// loop-protect on one relay; returns its mark.
fn loop_protect(ng: &mut NgClient, tag: &str) -> String {
    let call = format!("loop-{tag}");
    let protect = |mut req: Vec<(&'static str, Value)>| {
        req[4].1 = list(&["trust-address", "loop-protect"]);
        req
    };
    let r = ng.cmd(protect(offer_answer("offer", &call, "caller", None, FOUR, "127.86.1.1")));
    let first = text(&r, "sdp");
    let mark = match marks(&first).as_slice() {
        [m] => m.clone(),
        other => panic!("{tag}: one session-level mark expected, got {other:?} in {first}"),
    };
    assert!(!mark.is_empty() && FOUR.lines().count() < first.lines().count(), "{tag}: {first}");
    let query = |ng: &mut NgClient| ng.cmd(vec![("command", "query".into()), ("call-id", call.as_str().into())]);
    let calls = |ng: &mut NgClient| ng.cmd(vec![("command", "list".into())]).get("calls").and_then(Value::as_list).map_or(0, <[Value]>::len);
    let (before, n) = (query(ng), calls(ng));
    // The marked SDP comes back: in the same call (a spiral) and as another call.
    for call_id in [call.as_str(), "loop-other-call"] {
        let r = ng.cmd(protect(offer_answer("offer", call_id, "caller", None, &first, "127.86.1.1")));
        assert_eq!((text(&r, "result"), text(&r, "sdp")), ("ok".to_string(), first.clone()), "{tag}: returned unchanged ({call_id})");
    }
    assert_eq!((query(ng), calls(ng)), (before, n), "{tag}: nothing created or changed");
    // Without the flag the marked SDP is processed like any other (the mark passes through).
    let r = ng.cmd(offer_answer("offer", "loop-no-flag", "caller", None, &first, "127.86.1.1"));
    assert_ne!(text(&r, "sdp"), first, "{tag}: processed without loop-protect");
    assert_eq!(marks(&text(&r, "sdp")), [mark.as_str()], "{tag}");
    // The answer is marked, and comes back unchanged too.
    let r = ng.cmd(protect(offer_answer("answer", &call, "caller", Some("callee"), &answer_sdp(&[0]), "127.86.2.1")));
    let answered = text(&r, "sdp");
    assert_eq!(marks(&answered), [mark.as_str()], "{tag}: {answered}");
    let r = ng.cmd(protect(offer_answer("answer", &call, "caller", Some("callee"), &answered, "127.86.2.1")));
    assert_eq!(text(&r, "sdp"), answered, "{tag}: the marked answer comes back unchanged");
    for c in [call.as_str(), "loop-no-flag"] {
        ng.cmd(vec![("command", "delete".into()), ("call-id", c.into()), ("from-tag", "caller".into())]);
    }
    mark
}

/// rtpengine 10.5 in user space on `RTPENGINE_IP`, and its NG address, once it answers pings.
fn start_rtpengine() -> (Supervised, SocketAddr) {
    let ng: SocketAddr = UdpSocket::bind((RTPENGINE_IP, 0)).unwrap().local_addr().unwrap();
    let mut cmd = Command::new(sip::which("rtpengine").unwrap());
    cmd.args(["--config-file=none", "--table=-1", "--foreground", "--log-stderr", "--log-level=4", "--delete-delay=0"])
        .arg(format!("--interface={RTPENGINE_IP}"))
        .arg(format!("--listen-ng={ng}"))
        .args(["--port-min=45000", "--port-max=45199"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut proc = Supervised::spawn("rtpengine", &mut cmd).unwrap().terminate_on_drop(Duration::from_secs(3));
    let mut client = NgClient::bind("127.0.0.1:0", ng, Duration::from_millis(200), "ready").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.request(vec![("command", "ping".into())]).is_err() {
        assert!(proc.alive(), "rtpengine exited at start");
        assert!(Instant::now() < deadline, "rtpengine did not answer NG ping within 10 s");
    }
    (proc, ng)
}

#[test]
fn codec_filters_and_loop_protect_match_rtpengine() {
    let relay = Relay::start(MEDIAPLANE_IP, 44000, 44199, Duration::from_secs(60));
    let mut mp = ng_client(relay.ng);
    let ours = run_cases(&mut mp, "mediaplane");
    assert_eq!(loop_protect(&mut mp, "mediaplane"), INSTANCE_ID);
    assert_eq!(relay.relays(), 0, "every call deleted");

    if !sip::ready("codec_filters_and_loop_protect_match_rtpengine (rtpengine half)", &["rtpengine"]) {
        return;
    }
    let (mut rtpengine, addr) = start_rtpengine();
    let mut re = ng_client(addr);
    let theirs = run_cases(&mut re, "rtpengine");
    loop_protect(&mut re, "rtpengine");
    let mut differ = Vec::new();
    for ((c, o), t) in cases().iter().zip(&ours).zip(&theirs) {
        if o != t {
            differ.push(format!("{} (flags {:?}):\n  mediaplane {o:?}\n  rtpengine  {t:?}", c.what, c.flags));
        }
    }
    rtpengine.terminate(Duration::from_secs(3)).unwrap();
    assert!(differ.is_empty(), "{} of {} cases differ from rtpengine:\n{}", differ.len(), ours.len(), differ.join("\n"));
}
