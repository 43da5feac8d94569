//! Interop, WebRTC ↔ SIP as deployed: a browser SIP client (SIP.js 0.21 from npm, in headless
//! Chromium with a fake microphone) registers through Kamailio's websocket module and calls a
//! SIPp UAS; Kamailio's rtpengine module has the relay bridge the browser's DTLS-SRTP + ICE leg
//! to plain RTP toward the UAS (`RTP/AVP ICE=remove rtcp-mux-demux` on the offer from WebSocket,
//! `UDP/TLS/RTP/SAVPF ICE=force` on its answer: `KamailioConfig::websocket`).
//!
//! Testbed (as the other SIP interop tests): the relay, Kamailio and SIPp in the relay namespace;
//! the browser in peer 0's namespace (its page served from that namespace's loopback, its
//! WebSocket to Kamailio on the relay's address on that link); the UAS's media, a Rust socket
//! in peer 1's namespace, named in SIPp's answer. So on the eBPF plane both legs cross the TC
//! programs, which hand the media to user space (SRTP ↔ RTP is per-packet crypto): the test
//! checks that most of what the endpoints received went through that slow path.
//!
//! Checked: the browser registered and its call was established; the UAS was offered plain
//! RTP/AVP (no fingerprint, no candidates, no SAVP); 4 s of media both ways, counted at both
//! ends: the plain party sends 200 PCMU packets of one SSRC and counts the browser's by SSRC and
//! sequence number (≥ 95 % of what the browser's getStats says it sent, no duplicate); the
//! browser's getStats shows ≥ 95 % of the 200 received, from the plain party's SSRC, ≤ 5 % lost,
//! DTLS connected. RTCP demultiplexed: the UAS is offered no `a=rtcp-mux`, the browser's RTCP
//! reaches the plain party on its RTCP port (the port above; none on its RTP port), and the
//! plain party's sender reports, sent from that port to the relay's RTCP port, reach the browser
//! (getStats has a remote-inbound-rtp). Then the browser hangs up: the BYE reaches the UAS through the route set and
//! SIPp completes its scenario. On mediaplane also: no SRTP failure counted, and the call's
//! browser leg in the API is an ICE leg whose peer is one of the browser's host candidates,
//! keyed by the handshake, with no key material in the relay's or the table's view.
//!
//! The same call to an SDES-SRTP callee (`webrtc_sdes_*`: DTLS-SRTP bridged to SDES-SRTP, the
//! browser's INVITE asking `X-Callee-Protocol: RTP/SAVP`, which Kamailio's script puts in the
//! offer's flags instead of `RTP/AVP`): the UAS must be offered RTP/SAVP with the relay's
//! AES_CM_128_HMAC_SHA1_80 key under tag 7 and nothing of ICE, answers with its own key under
//! that tag, and the plain party's socket protects what it sends and unprotects what it gets
//! with those keys (libsrtp, mediaplane's dataplane crate); every packet must unprotect.
//!
//! A video call (`webrtc_video_*`): the browser sends and receives audio and VP8 video; the UAS
//! answers both sections on two plain port pairs. Each section must reach its own pair (no video
//! on the audio port), both ways, with each section's RTCP demultiplexed to its RTCP port and the
//! plain party's reports of each reaching the browser. SIP.js asks for the "balanced" bundle
//! policy; mediaplane accepts the browser's `a=group:BUNDLE` (one ICE + DTLS transport for both
//! sections, the video told apart by its SSRC), rtpengine 10.5 answers none (a transport per
//! section). `webrtc_max_bundle_*`: the same call from a browser with `bundlePolicy:
//! max-bundle` (candidates for its first section only), which works only on a relay that
//! accepts BUNDLE.
//!
//! One test per relay: rtpengine 10.5 in user space (the baseline), `mediaplane serve` on the
//! user-space and on the eBPF plane. Needs root, kamailio with its websocket module, sipp,
//! chromium, and SIP.js installed by `make deps` (npm); skipped without them, except under
//! CI=true, where that is a failure. MP_KEEP_TMP=1 keeps the run's directory.

mod common;

use common::browser::{self, Browser};
use common::sipp::{recv_offer, sipp_command, Bed, Relay};
use mediaplane_bench::sip::{self, parse_sipp_event, sipp_result, LogTail, UAS_BYE_OK};
use mediaplane_core::call_quality::{build_report, ReportBlock};
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use mediaplane_core::srtp::{SrtpKey, SrtpSuite};
use mediaplane_dataplane::srtp::{protect, unprotect, Context};
use serde_json::{json, Value as Json};
use std::collections::HashSet;
use std::fmt::Write as _;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What every offer and answer carries; Kamailio adds the WebSocket bridging flags.
const BASE_FLAGS: &str = "replace-origin replace-session-connection";
/// The UAS's SIP port, on the relay namespace's loopback.
const UAS_PORT: u16 = 5070;
/// PCMU packets the plain party sends, one per 20 ms.
const PACKETS: u16 = 200;
const PLAIN_SSRC: u32 = 0x51b0_0002;
const PLAIN_VIDEO_SSRC: u32 = 0x51b0_0003;

/// The page: SIP.js registers, calls `target`, and reports its progress (from its first line,
/// so a page that stalls still says where) and the peer connection's figures to `/stats` every
/// 250 ms; it hangs up when a report is answered `hangup`.
const PAGE: &str = r#"<!doctype html><title>mediaplane SIP.js caller</title><script type="module">
const attempt = Number(new URLSearchParams(location.search).get('attempt') || 1);
const events = ['page' + (attempt > 1 ? ' (load ' + attempt + ')' : '')];
// A reload's reports come after the last one's (the server keeps the highest n).
let call = null, error = null, hungUp = false, n = attempt * 100000;
const report = async out => (await fetch('/stats', {method: 'POST', body: JSON.stringify(out)})).text();
setInterval(async () => {
  const out = {n: ++n, events, error};
  if (call) {
    Object.assign(out, {call_id: call.request.callId, state: call.state});
    const pc = call.sessionDescriptionHandler && call.sessionDescriptionHandler.peerConnection;
    if (pc) {
      out.ice = pc.iceConnectionState;
      out.offer = pc.localDescription && pc.localDescription.sdp;
      out.answer = pc.remoteDescription && pc.remoteDescription.sdp;
      out.transports = 0;
      (await pc.getStats()).forEach(r => {
        if (r.type === 'transport') out.transports += 1;
        if (r.type === 'inbound-rtp' && r.kind === 'audio') Object.assign(out, {in_packets: r.packetsReceived, in_lost: r.packetsLost, in_ssrc: r.ssrc});
        if (r.type === 'outbound-rtp' && r.kind === 'audio') Object.assign(out, {out_packets: r.packetsSent, out_ssrc: r.ssrc});
        // A receiver report about what it sends, and a sender report of what it receives.
        if (r.type === 'remote-inbound-rtp' && r.kind === 'audio') Object.assign(out, {rr_in: true});
        if (r.type === 'remote-outbound-rtp' && r.kind === 'audio') Object.assign(out, {sr_in: true});
        if (r.type === 'inbound-rtp' && r.kind === 'video') Object.assign(out, {in_video_packets: r.packetsReceived, in_video_ssrc: r.ssrc});
        if (r.type === 'outbound-rtp' && r.kind === 'video') Object.assign(out, {out_video_packets: r.packetsSent, out_video_ssrc: r.ssrc});
        if (r.type === 'remote-inbound-rtp' && r.kind === 'video') Object.assign(out, {rr_in_video: true});
        if (r.type === 'transport') Object.assign(out, {dtls: r.dtlsState, srtp_cipher: r.srtpCipher});
      });
    }
  }
  const command = await report(out);
  if (command === 'hangup' && call && !hungUp && call.state === 'Established') {
    hungUp = true;
    call.bye().catch(e => events.push('bye failed: ' + e));
  }
}, 250);
try {
  let sipjs;
  try {
    sipjs = await import('/sip.js/index.js');
  } catch (e) {
    // One of SIP.js's 190-odd modules failed to load (seen once in a while, in CI only): the
    // failed module stays failed in this document, so load the page again, at most twice.
    if (attempt < 3) {
      await report({n: ++n, events: events.concat(['import failed: ' + e]), error: null});
      location.replace('/?attempt=' + (attempt + 1));
      await new Promise(() => {});
    }
    throw e;
  }
  const { UserAgent, Registerer, RegistererState, Inviter } = sipjs;
  events.push('sip.js loaded');
  const cfg = await (await fetch('/config')).json();
  const ua = new UserAgent({
    uri: UserAgent.makeURI(cfg.aor),
    transportOptions: {server: cfg.ws},
    logLevel: 'warn',
    sessionDescriptionHandlerFactoryOptions: {peerConnectionConfiguration: {iceServers: [], bundlePolicy: cfg.bundle_policy || 'balanced'}, iceGatheringTimeout: 3000},
  });
  ua.transport.stateChange.addListener(s => events.push('transport:' + s));
  await ua.start();
  const registerer = new Registerer(ua);
  const registered = new Promise(done => registerer.stateChange.addListener(s => {
    events.push('register:' + s);
    if (s === RegistererState.Registered) done();
  }));
  await registerer.register();
  await registered;
  const inviter = new Inviter(ua, UserAgent.makeURI(cfg.target), {extraHeaders: cfg.headers || [], sessionDescriptionHandlerOptions: {constraints: {audio: true, video: !!cfg.video}}});
  inviter.stateChange.addListener(s => events.push('session:' + s));
  call = inviter;
  await inviter.invite();
} catch (e) {
  error = String(e);
}
</script>"#;

/// What the browser calls: a plain RTP party, or an SDES-SRTP one (DTLS-SRTP bridged to SDES).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Callee {
    Plain,
    /// Keyed with this AES_CM_128_HMAC_SHA1_80 key || salt (its answer's a=crypto, tag 7).
    Sdes([u8; 30]),
}

/// The SDES callee answers the relay's tag 7: AES_CM_128_HMAC_SHA1_80 in rtpengine's and
/// mediaplane's offers alike.
const SDES_TAG: &str = "7 AES_CM_128_HMAC_SHA1_80";

/// The UAS: the offer must be plain RTP/AVP (or, for an SDES callee, RTP/SAVP with the relay's
/// AES_CM_128_HMAC_SHA1_80 key, logged as "relay-key 1 KEY") with nothing of WebRTC left, nor
/// `a=rtcp-mux` (`rtcp-mux-demux`: the UAS keeps RTCP on the port above its RTP port) (its
/// relay address is logged as "offered 1 IP PORT"; rtpengine also offers an SDES callee DTLS
/// on RTP/SAVP, a=fingerprint and a=setup beside the a=crypto lines, which an answer with
/// a=crypto and no fingerprint declines); it answers PCMU on the plain party's
/// address (SDES: RTP/SAVP with its own key under the same tag), keeping the route set, and
/// waits for the BYE.
fn uas_xml(plain: SocketAddr, callee: Callee, video: Option<SocketAddr>) -> String {
    use base64::Engine as _;
    let (m_regexp, proto, crypto, mut secure) = match callee {
        Callee::Plain => (
            "m=audio ([0-9]+) RTP/AVP ",
            "RTP/AVP",
            String::new(),
            r#"
      <ereg regexp="a=fingerprint|a=candidate|a=ice-|SAVP|a=rtcp-mux" search_in="body" check_it_inverse="true" assign_to="webrtc_left"/>"#
                .to_string(),
        ),
        Callee::Sdes(key) => (
            "m=audio ([0-9]+) RTP/SAVP ",
            "RTP/SAVP",
            format!("      a=crypto:{SDES_TAG} inline:{}\n", base64::engine::general_purpose::STANDARD_NO_PAD.encode(key)),
            format!(
                r#"
      <ereg regexp="a=candidate|a=ice-|UDP/TLS|a=rtcp-mux" search_in="body" check_it_inverse="true" assign_to="webrtc_left"/>
      <ereg regexp="a=crypto:{SDES_TAG} inline:([A-Za-z0-9+/=]+)" search_in="body" check_it="true" assign_to="crypto_line,relay_key"/>
      <log message="relay-key 1 [$relay_key]"/>"#
            ),
        ),
    };
    let mut refs = if callee == Callee::Plain { "c_line,m_line,webrtc_left" } else { "c_line,m_line,webrtc_left,crypto_line,relay_key" }.to_string();
    // A video call: the video section's relay port is logged as "video 1 IP PORT"; the answer
    // takes VP8 on the port `video` (its RTCP on the port above).
    let video_answer = match video {
        Some(v) => {
            secure.push_str(
                r#"
      <ereg regexp="m=video ([0-9]+) RTP/AVP " search_in="body" check_it="true" assign_to="v_line,video_port"/>
      <log message="video 1 [$offer_ip] [$video_port]"/>"#,
            );
            refs.push_str(",v_line,video_port");
            format!("      m=video {} RTP/AVP 96\n      a=rtpmap:96 VP8/90000\n      a=sendrecv\n", v.port())
        }
        None => String::new(),
    };
    format!(
        r#"<?xml version="1.0" encoding="ISO-8859-1" ?>
<!DOCTYPE scenario SYSTEM "sipp.dtd">
<scenario name="WebRTC caller's callee">
{offer}  <send retrans="500"><![CDATA[

      SIP/2.0 200 OK
      [last_Via:]
      [last_Record-Route:]
      [last_From:]
      [last_To:];tag=u[pid]-[call_number]
      [last_Call-ID:]
      [last_CSeq:]
      Contact: <sip:bob@[local_ip]:[local_port]>
      Content-Type: application/sdp
      Content-Length: [len]

      v=0
      o=bob 1 1 IN IP4 {ip}
      s=-
      c=IN IP4 {ip}
      t=0 0
      m=audio {port} {proto} 0
      a=rtpmap:0 PCMU/8000
{crypto}      a=ptime:20
      a=sendrecv
{video_answer}
  ]]></send>
  <recv request="ACK" crlf="true"/>
{bye}  <Reference variables="{refs}"/>
</scenario>
"#,
        offer = recv_offer(1, m_regexp, &secure),
        ip = plain.ip(),
        port = plain.port(),
        bye = UAS_BYE_OK,
    )
}

/// The page's server: the page, SIP.js's modules, the page's configuration; `/stats` keeps the
/// browser's latest report (by its number: each request has a thread, so an older one may come
/// second) and answers `hangup` once `hangup` is set; `served` counts the requests answered
/// (a page that never reports: did it load at all?) and keeps those refused.
fn serve_page(listener: TcpListener, config: Json, stats: Arc<Mutex<Json>>, hangup: Arc<Mutex<bool>>, served: Arc<Served>) {
    let sipjs = sipjs_dir();
    browser::serve(listener, move |req| {
        served.requests.fetch_add(1, Ordering::Relaxed);
        let answer = answer(req, &sipjs, &config, &stats, &hangup);
        if answer.0 != 200 && req.path != "/favicon.ico" {
            served.refused.lock().unwrap().push(format!("{} {}", req.method, req.path));
        }
        answer
    });
}

/// What the page's server answered: how many requests, and those it could not answer.
#[derive(Default)]
struct Served {
    requests: AtomicUsize,
    refused: Mutex<Vec<String>>,
}

/// One request: the page (any query: a reload says which load it is), its configuration, a
/// SIP.js module, or the page's report.
fn answer(req: &browser::Request, sipjs: &Path, config: &Json, stats: &Mutex<Json>, hangup: &Mutex<bool>) -> (u16, &'static str, Vec<u8>) {
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", p) if p == "/" || p.starts_with("/?") => (200, "text/html", PAGE.as_bytes().to_vec()),
        ("GET", "/config") => (200, "application/json", config.to_string().into_bytes()),
        ("GET", path) if path.starts_with("/sip.js/") && !path.contains("..") => match std::fs::read(sipjs.join(&path["/sip.js/".len()..])) {
            Ok(module) => (200, "text/javascript", module),
            Err(_) => (404, "text/plain", Vec::new()),
        },
        ("POST", "/stats") => {
            if let Ok(v) = serde_json::from_str::<Json>(&req.body) {
                let mut latest = stats.lock().unwrap();
                if v["n"].as_u64() > latest["n"].as_u64() {
                    *latest = v;
                }
            }
            (200, "text/plain", if *hangup.lock().unwrap() { b"hangup".to_vec() } else { Vec::new() })
        }
        _ => (404, "text/plain", Vec::new()),
    }
}

/// SIP.js's ES modules, as `make deps` installs them (crates/mediaplane/tests/browser).
fn sipjs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/node_modules/sip.js/lib")
}

fn num(v: &Json, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

/// What the plain party received from the browser.
#[derive(Default)]
struct Receipts {
    packets: u64,
    seen: HashSet<(u32, u16)>,
    duplicates: u64,
    ssrcs: HashSet<u32>,
    srtp_failed: u64,
    /// The browser's RTCP on the plain party's RTCP port (`rtcp-mux-demux`), and on its RTP port.
    rtcp: u64,
    rtcp_on_rtp_port: u64,
}

impl Receipts {
    /// What arrived on the plain party's socket; SRTP unprotected with `srtp` (an SDES callee;
    /// what fails to unprotect is counted in `srtp_failed`).
    fn drain(&mut self, socket: &UdpSocket, srtp: Option<&Arc<Context>>) {
        let mut buf = [0u8; 2048];
        loop {
            match socket.recv_from(&mut buf) {
                Ok((n, _)) => {
                    // The browser multiplexes its RTCP: the relay must demultiplex it.
                    if n < 2 || (200..=204).contains(&buf[1]) {
                        self.rtcp_on_rtp_port += 1;
                        continue;
                    }
                    let clear = match srtp {
                        None => buf[..n].to_vec(),
                        Some(ctx) => match unprotect(Some(ctx), &buf[..n]) {
                            Ok(clear) => clear,
                            Err(_) => {
                                self.srtp_failed += 1;
                                continue;
                            }
                        },
                    };
                    if let Ok(h) = RtpHeader::parse(&clear) {
                        self.ssrcs.insert(h.ssrc);
                        self.packets += 1;
                        if !self.seen.insert((h.ssrc, h.sequence)) {
                            self.duplicates += 1;
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => panic!("plain party receiving: {e}"),
            }
        }
    }

    /// What arrived on the plain party's RTCP port: the browser's RTCP (SRTCP unprotected with
    /// `srtp`: what fails counts in `srtp_failed`).
    fn drain_rtcp(&mut self, socket: &UdpSocket, srtp: Option<&Arc<Context>>) {
        let mut buf = [0u8; 2048];
        loop {
            match socket.recv_from(&mut buf) {
                Ok((n, _)) => {
                    let clear = match srtp {
                        None => Ok(buf[..n].to_vec()),
                        Some(ctx) => unprotect(Some(ctx), &buf[..n]),
                    };
                    match clear {
                        Ok(p) if p.len() >= 8 && (200..=204).contains(&p[1]) => self.rtcp += 1,
                        Ok(_) => {}
                        Err(_) => self.srtp_failed += 1,
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => panic!("plain party receiving RTCP: {e}"),
            }
        }
    }
}

fn run_plain(relay: Relay) {
    run(relay, Callee::Plain, false, false);
}

/// The relay restarts mid-call (mediaplane only: rtpengine restarts without its calls unless
/// it keeps them in Redis, which this bed does not run).
fn run_restart(relay: Relay) {
    run(relay, Callee::Plain, false, true);
}

/// A video call: audio and VP8 video, each section to its own plain port pair.
fn run_video(relay: Relay) {
    run_with(relay, Callee::Plain, true, false, "balanced");
}

/// The video call from a browser that bundles everything (`bundlePolicy: max-bundle`): it
/// gathers for its first section only, so the call works only if the relay accepts BUNDLE.
fn run_max_bundle(relay: Relay) {
    run_with(relay, Callee::Plain, true, false, "max-bundle");
}

/// DTLS-SRTP bridged to SDES-SRTP: the callee's key is fresh per run.
fn run_sdes(relay: Relay) {
    let mut key = [0u8; 30];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key)).expect("reading /dev/urandom");
    run(relay, Callee::Sdes(key), false, false);
}

fn run(relay: Relay, callee: Callee, video: bool, restart: bool) {
    run_with(relay, callee, video, restart, "balanced");
}

/// [`run`] with the browser's `bundlePolicy`.
fn run_with(relay: Relay, callee: Callee, video: bool, restart: bool, bundle_policy: &str) {
    let test = format!(
        "interop_webrtc_sipjs ({}, {callee:?}{}{}, {bundle_policy})",
        relay.name(),
        if video { ", video" } else { "" },
        if restart { ", restart" } else { "" }
    );
    // A restarted call: 3 s before the restart, then until 10 s after it (the restart takes a
    // second or two); the plain party sends throughout.
    let total = if restart { 5 * PACKETS } else { PACKETS };
    let Some(chromium) = browser::chromium(&test) else { return };
    if !sipjs_dir().join("index.js").exists() {
        assert!(!mediaplane_bench::in_ci(), "{test}: SIP.js is not installed (make deps), and CI=true");
        eprintln!("{test}: skipped: SIP.js is not installed (make deps)");
        return;
    }
    if !sip::kamailio_module_dir().is_some_and(|d| d.join("websocket.so").exists()) {
        assert!(!mediaplane_bench::in_ci(), "{test}: Kamailio's websocket module is missing, and CI=true");
        eprintln!("{test}: skipped: no websocket module (kamailio-websocket-modules)");
        return;
    }
    let prefix = match (callee, video) {
        _ if restart => "webrtc-restart",
        _ if bundle_policy == "max-bundle" => "webrtc-bundle",
        (_, true) => "webrtc-video",
        (Callee::Plain, false) => "webrtc-sipjs",
        (Callee::Sdes(_), false) => "webrtc-sdes",
    };
    let Some(mut bed) = Bed::start_websocket(prefix, relay, BASE_FLAGS) else { return };
    bed.media_in_kernel = false;
    let tb = &bed.tb;
    let dir = bed.tmp.0.clone();
    let (browser_ns, plain_ns) = (tb.peers[0].ns.clone(), tb.peers[1].ns.clone());
    let plain_addr = SocketAddr::new(tb.peers[1].ip, 31000);
    let plain = tb.udp_socket(&plain_ns, plain_addr).unwrap();
    plain.set_nonblocking(true).unwrap();
    // Its RTCP: on the port above, as its SDP (no a=rtcp, no a=rtcp-mux) implies.
    let plain_rtcp = tb.udp_socket(&plain_ns, SocketAddr::new(plain_addr.ip(), plain_addr.port() + 1)).unwrap();
    plain_rtcp.set_nonblocking(true).unwrap();
    // A video call's video section: RTP and RTCP on the next two ports.
    let video_addr = SocketAddr::new(plain_addr.ip(), plain_addr.port() + 2);
    let video_sockets = video.then(|| {
        let [rtp, rtcp] = [0, 1].map(|i| tb.udp_socket(&plain_ns, SocketAddr::new(video_addr.ip(), video_addr.port() + i)).unwrap());
        rtp.set_nonblocking(true).unwrap();
        rtcp.set_nonblocking(true).unwrap();
        (rtp, rtcp)
    });

    std::fs::write(dir.join("call-uas.xml"), uas_xml(plain_addr, callee, video.then_some(video_addr))).unwrap();
    let mut uas = sip::spawn_group("sipp uas", &mut sipp_command(tb, &dir, "call", "uas", UAS_PORT)).unwrap();
    sip::wait_udp_bound(&mut uas, UAS_PORT, Duration::from_secs(10)).unwrap();
    let mut uas_log = LogTail::new(dir.join("call-uas.log"));

    let listener = tb.in_ns(&browser_ns, || TcpListener::bind("127.0.0.1:0")).unwrap().unwrap();
    let page = format!("http://{}/", listener.local_addr().unwrap());
    let config = json!({
        "ws": format!("ws://{}", bed.websocket.unwrap()),
        "aor": "sip:alice@interop.test",
        "target": format!("sip:bob@127.0.0.1:{UAS_PORT}"),
        "headers": if callee == Callee::Plain { vec![] } else { vec!["X-Callee-Protocol: RTP/SAVP"] },
        "video": video,
        "bundle_policy": bundle_policy,
    });
    let (stats, hangup) = (Arc::new(Mutex::new(Json::Null)), Arc::new(Mutex::new(false)));
    let served = Arc::new(Served::default());
    serve_page(listener, config, stats.clone(), hangup.clone(), served.clone());
    let chrome = Browser::start(tb.command(&browser_ns, &chromium), &dir, &page);

    let (mut report, mut failures) = (String::new(), Vec::new());
    let mut check = |ok: bool, what: String| {
        let _ = writeln!(report, "  {} {what}", if ok { "ok  " } else { "FAIL" });
        if !ok {
            failures.push(what);
        }
    };

    // Signalling, then media: the plain party starts once the browser's call is established, its
    // DTLS connected, and the plain party knows where the relay wants its media (the address in
    // the UAS's offer).
    let (mut relay_for_plain, mut relay_for_video) = (None, None);
    // An SDES callee: it protects with its own key and unprotects with the relay's (from the
    // offer it received).
    let own_srtp = match callee {
        Callee::Plain => None,
        Callee::Sdes(key) => Some(Arc::new(Context::new(&SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, key.to_vec()).unwrap(), true).unwrap())),
    };
    let mut relay_srtp: Option<Arc<Context>> = None;
    let (mut receipts, mut video_receipts) = (Receipts::default(), Receipts::default());
    let (mut next, mut media_start, mut reports_sent) = (0u16, None::<Instant>, 0u64);
    // When the restart was done and how it went; what had arrived (at the plain party, at the
    // browser) and been sent (by the plain party) by then, and 6 s after.
    let mut restarted: Option<(Instant, Result<(), String>)> = None;
    let mut at_restart = (0u64, 0u64);
    let mut after_restart: Option<(u64, u64, u16)> = None;
    let deadline = Instant::now() + Duration::from_secs(40);
    while Instant::now() < deadline {
        for line in uas_log.lines() {
            if let Some((event, addr)) = parse_sipp_event(&line) {
                if event == "offered 1" {
                    relay_for_plain = addr;
                }
                if event == "video 1" {
                    relay_for_video = addr;
                }
            }
            if let Some(b64) = line.strip_prefix("relay-key 1 ") {
                use base64::Engine as _;
                let key = base64::engine::general_purpose::STANDARD_NO_PAD.decode(b64.trim().trim_end_matches('=')).ok();
                let key = key.and_then(|k| SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, k).ok());
                relay_srtp = key.and_then(|k| Context::new(&k, false).ok()).map(Arc::new);
            }
        }
        let s = stats.lock().unwrap().clone();
        if !s["error"].is_null() || s["state"] == "Terminated" {
            break;
        }
        // Established is the answer applied; the keys come with DTLS, after ICE.
        let keyed = callee == Callee::Plain || relay_srtp.is_some();
        if media_start.is_none() && s["state"] == "Established" && s["dtls"] == "connected" && relay_for_plain.is_some() && keyed {
            media_start = Some(Instant::now());
        }
        if let (Some(start), Some(to)) = (media_start, relay_for_plain) {
            while next < total && start.elapsed() >= Duration::from_millis(20 * next as u64) {
                let packet = build_rtp(0, next, next as u32 * 160, PLAIN_SSRC, &[0xff; 160]);
                let packet = match &own_srtp {
                    Some(ctx) => protect(Some(ctx), &packet).expect("SRTP protect"),
                    None => packet,
                };
                plain.send_to(&packet, to).unwrap();
                // VP8 (a descriptor, then bytes no decoder takes): counted by the browser's
                // getStats all the same.
                if let (Some((rtp, _)), Some(to)) = (&video_sockets, relay_for_video) {
                    rtp.send_to(&build_rtp(96, next, next as u32 * 1800, PLAIN_VIDEO_SSRC, &[0x10; 200]), to).unwrap();
                }
                next += 1;
            }
        }
        receipts.drain(&plain, relay_srtp.as_ref());
        receipts.drain_rtcp(&plain_rtcp, relay_srtp.as_ref());
        if let Some((rtp, rtcp)) = &video_sockets {
            video_receipts.drain(rtp, None);
            video_receipts.drain_rtcp(rtcp, None);
        }
        // Once a second, a sender report with a block about the browser's stream, from the RTCP
        // port to the relay's RTCP port (the port above the one offered).
        let browser_ssrc = receipts.ssrcs.iter().next().copied();
        if let (Some(start), Some(to), Some(about)) = (media_start, relay_for_plain, browser_ssrc) {
            if start.elapsed() >= Duration::from_secs(reports_sent) {
                let block = ReportBlock { reporter: PLAIN_SSRC, about, highest_seq: 1, ..Default::default() };
                let report = build_report(PLAIN_SSRC, Some(0x1234_5678), &[block]);
                let report = match &own_srtp {
                    Some(ctx) => protect(Some(ctx), &report).expect("SRTCP protect"),
                    None => report,
                };
                plain_rtcp.send_to(&report, SocketAddr::new(to.ip(), to.port() + 1)).unwrap();
                // And of the video section, about the browser's video SSRC.
                if let (Some((_, rtcp)), Some(to), Some(about)) = (&video_sockets, relay_for_video, s["out_video_ssrc"].as_u64()) {
                    let block = ReportBlock { reporter: PLAIN_VIDEO_SSRC, about: about as u32, highest_seq: 1, ..Default::default() };
                    rtcp.send_to(&build_report(PLAIN_VIDEO_SSRC, Some(0x1234_5678), &[block]), SocketAddr::new(to.ip(), to.port() + 1)).unwrap();
                }
                reports_sent += 1;
            }
        }
        // Done when the media is through and the RTCP has gone both ways (or after 12 s: a
        // browser reports its audio every 5 s on average, the first one sooner).
        let rtcp_through = receipts.rtcp > 0 && s["rr_in"] == true;
        let video_through = !video || (num(&s, "in_video_packets") >= total as u64 && video_receipts.rtcp > 0 && s["rr_in_video"] == true);
        // The restart: 3 s into the media, mediaplane stops (SIGTERM) and starts again on its
        // store. What the browser and the plain party receive is read 6 and 10 s after.
        if restart && restarted.is_none() && media_start.is_some_and(|t| t.elapsed() >= Duration::from_secs(3)) {
            at_restart = (receipts.packets, num(&s, "in_packets"));
            let result = bed.restart_relay().map_err(|e| format!("{e:#}"));
            restarted = Some((Instant::now(), result));
        }
        if let Some((at, _)) = &restarted {
            if at.elapsed() >= Duration::from_secs(6) && after_restart.is_none() {
                after_restart = Some((receipts.packets, num(&s, "in_packets"), next));
            }
        }
        if restart {
            if restarted.as_ref().is_some_and(|(at, _)| at.elapsed() >= Duration::from_secs(10))
                || (next == total && media_start.is_some_and(|t| t.elapsed() > Duration::from_secs(20)))
            {
                break;
            }
        } else if next == total
            && ((num(&s, "in_packets") >= total as u64 && rtcp_through && video_through) || media_start.is_some_and(|t| t.elapsed() > Duration::from_secs(12)))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // What the browser reports sent by now has reached the plain party 600 ms later.
    let s = stats.lock().unwrap().clone();
    let drain = Instant::now();
    while drain.elapsed() < Duration::from_millis(600) {
        receipts.drain(&plain, relay_srtp.as_ref());
        receipts.drain_rtcp(&plain_rtcp, relay_srtp.as_ref());
        if let Some((rtp, rtcp)) = &video_sockets {
            video_receipts.drain(rtp, None);
            video_receipts.drain_rtcp(rtcp, None);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let events = s["events"].as_array().map(|e| e.iter().filter_map(Json::as_str).collect::<Vec<_>>().join(", ")).unwrap_or_default();
    let refused = served.refused.lock().unwrap().clone();
    check(!s.is_null(), format!("the page reported (its server answered {} requests, refused {refused:?})", served.requests.load(Ordering::Relaxed)));
    check(s["error"].is_null(), format!("the page ran without error{}", if s["error"].is_null() { String::new() } else { format!(": {}", s["error"]) }));
    check(events.contains("register:Registered"), format!("SIP.js registered through Kamailio's websocket module (events: {events})"));
    check(events.contains("session:Established"), "the browser's call was established".into());
    match callee {
        Callee::Plain => check(relay_for_plain.is_some(), format!("the UAS was offered plain RTP/AVP at the relay: {relay_for_plain:?}")),
        Callee::Sdes(_) => {
            check(relay_for_plain.is_some(), format!("the UAS was offered RTP/SAVP at the relay: {relay_for_plain:?}"));
            check(relay_srtp.is_some(), format!("with the relay's key under a=crypto:{SDES_TAG}"));
            check(receipts.srtp_failed == 0, format!("the SDES callee unprotected everything it got ({} failed)", receipts.srtp_failed));
        }
    }
    check(s["dtls"] == "connected", format!("the browser's DTLS is connected ({}, {})", s["dtls"], s["srtp_cipher"]));
    let (in_packets, in_lost) = (num(&s, "in_packets"), num(&s, "in_lost"));
    // (Across a restart the plain party's packets sent while the relay is down are lost.)
    let (min_in, max_lost) = if restart { (next as u64 * 3 / 4, next as u64 / 4) } else { (next as u64 * 95 / 100, next as u64 / 20) };
    check(in_packets >= min_in, format!("the browser received {in_packets} of the plain party's {next} packets (getStats)"));
    check(in_lost <= max_lost, format!("the browser counted {in_lost} lost"));
    check(s["in_ssrc"].as_u64() == Some(PLAIN_SSRC as u64), format!("from the plain party's SSRC (browser saw {})", s["in_ssrc"]));
    let sent = num(&s, "out_packets");
    check(sent > 0 && receipts.packets + 5 >= sent * 95 / 100, format!("the plain party received {} of the {sent} packets the browser sent", receipts.packets));
    let browser_ssrc = s["out_ssrc"].as_u64().map(|v| v as u32);
    check(
        receipts.ssrcs.iter().all(|x| Some(*x) == browser_ssrc) && receipts.duplicates == 0,
        format!("one SSRC, the browser's ({:x?} vs {browser_ssrc:x?}), {} duplicates", receipts.ssrcs, receipts.duplicates),
    );
    // rtcp-mux-demux: the browser's RTCP reaches the plain party on its RTCP port, never its
    // RTP port; the plain party's reports from its RTCP port reach the browser.
    check(
        receipts.rtcp > 0 && receipts.rtcp_on_rtp_port == 0,
        format!("the browser's RTCP reached the plain party's RTCP port ({} packets; {} on its RTP port)", receipts.rtcp, receipts.rtcp_on_rtp_port),
    );
    check(s["rr_in"] == true, format!("the plain party's reports ({reports_sent} sent) reached the browser (getStats: remote-inbound-rtp)"));
    if restart {
        // The browser's transport outlives the relay's process: its consent checks are answered
        // by the restarted relay (otherwise Chromium stops sending within seconds), and media
        // goes both ways from 6 to 10 s after the restart.
        let restart_result = restarted.as_ref().map(|(_, r)| r.clone());
        check(matches!(restart_result, Some(Ok(()))), format!("mediaplane restarted on its store mid-call: {restart_result:?}"));
        let (plain_at_6, browser_at_6, sent_at_6) = after_restart.unwrap_or_default();
        let (plain_gain, browser_gain, sent) =
            (receipts.packets.saturating_sub(plain_at_6), in_packets.saturating_sub(browser_at_6), next.saturating_sub(sent_at_6) as u64);
        // 4 s of a browser's audio is 200 packets; the plain party sends 50 a second too.
        check(plain_gain >= 150, format!("the plain party received {plain_gain} of the browser's packets 6-10 s after the restart"));
        check(
            sent >= 150 && browser_gain + 10 >= sent * 9 / 10,
            format!("the browser received {browser_gain} of the {sent} packets the plain party sent 6-10 s after the restart"),
        );
        check(matches!(s["ice"].as_str(), Some("connected" | "completed")), format!("the browser's ICE is {} at the end", s["ice"]));
    }
    if video {
        // The video section goes its own way: the plain party's video port pair.
        check(relay_for_video.is_some(), format!("the UAS was offered a video section at the relay: {relay_for_video:?}"));
        let (in_video, video_ssrc) = (num(&s, "in_video_packets"), s["in_video_ssrc"].as_u64());
        check(
            in_video >= total as u64 * 95 / 100 && video_ssrc == Some(PLAIN_VIDEO_SSRC as u64),
            format!("the browser received {in_video} of the plain party's {total} video packets, SSRC {video_ssrc:?}"),
        );
        let (sent, ssrc) = (num(&s, "out_video_packets"), s["out_video_ssrc"].as_u64().map(|v| v as u32));
        let got = video_receipts.seen.iter().filter(|(x, _)| Some(*x) == ssrc).count() as u64;
        check(sent > 0 && got + 5 >= sent * 95 / 100, format!("the plain party's video port received {got} of the {sent} video packets the browser sent"));
        check(!receipts.ssrcs.iter().any(|x| Some(*x) == ssrc), "no video on the audio port".into());
        check(
            video_receipts.rtcp > 0 && video_receipts.rtcp_on_rtp_port == 0,
            format!(
                "the browser's video RTCP reached the video RTCP port ({} packets; {} on the RTP port)",
                video_receipts.rtcp, video_receipts.rtcp_on_rtp_port
            ),
        );
        check(s["rr_in_video"] == true, "the plain party's video reports reached the browser (getStats: remote-inbound-rtp)".into());
        // mediaplane accepts the browser's BUNDLE group: both sections on one transport (one
        // ICE and DTLS association) whatever the policy; rtpengine 10.5 answers no group, so a
        // balanced browser runs a transport per section.
        let answer = s["answer"].as_str().unwrap_or_default();
        let bundled = answer.lines().any(|l| l.trim_end().starts_with("a=group:BUNDLE ") && l.split_whitespace().count() == 3);
        let transports = num(&s, "transports");
        if relay == Relay::Rtpengine {
            check(!bundled && transports == 2, format!("rtpengine answered no BUNDLE group: {transports} transports"));
        } else {
            check(bundled && transports == 1, format!("the relay answered the BUNDLE group and the browser runs one transport ({transports})"));
        }
    }

    if relay != Relay::Rtpengine {
        // (On the eBPF plane the slow path's counters; a counter missing panics, not reads as 0.)
        let st = common::netns::try_api(&bed.tb, "GET", "/v1/stats", None);
        let failed: Vec<String> = ["srtp_no_key", "srtp_auth_failed", "srtp_replayed", "srtp_invalid", "srtp_protect_failed"]
            .into_iter()
            .map(|k| (k, common::srtp_counter(&st, k)))
            .filter(|(_, n)| *n > 0)
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        check(failed.is_empty(), format!("the relay counted no SRTP failure {failed:?}"));
        let call_id = s["call_id"].as_str().unwrap_or_default();
        let id = mediaplane_ng::calls::rtp_relay_id(&mediaplane_ng::calls::call_key(call_id), 0);
        match common::netns::try_api(&bed.tb, "GET", &format!("/v1/relays/{id}"), None) {
            Ok(view) => {
                let leg = &view["a"];
                let offer = s["offer"].as_str().unwrap_or_default();
                let nominated: Option<SocketAddr> = leg["remote"].as_str().and_then(|a| a.parse().ok());
                let candidate = nominated.is_some_and(|n| offer.contains(&format!("{} {} typ host", n.ip(), n.port())));
                check(leg["ice"] == true && candidate, format!("the browser's leg is an ICE leg nominated at one of its host candidates ({nominated:?})"));
                // Chromium offers AES-GCM, which the relay prefers (RFC 7714), and AES-CM.
                let suite = leg["srtp"]["inbound"]["suite"].as_str().unwrap_or_default();
                let keyed = ["AEAD_AES_128_GCM", "AES_CM_128_HMAC_SHA1_80"].contains(&suite) && leg["srtp"]["inbound"].get("master").is_none();
                check(keyed, format!("keyed by the handshake, no key in the view ({})", leg["srtp"]));
                check(leg.get("ice_credentials").is_none() && !leg.to_string().contains("pwd"), "nor its stored ICE credentials".into());
                if video {
                    // The video section's browser leg is on the audio leg's transport, taking the
                    // browser's video SSRC.
                    let id = mediaplane_ng::calls::rtp_relay_id(&mediaplane_ng::calls::call_key(call_id), 1);
                    let video_leg = common::netns::try_api(&bed.tb, "GET", &format!("/v1/relays/{id}"), None).map(|v| v["a"].clone()).unwrap_or_default();
                    check(
                        video_leg["local"] == leg["local"] && video_leg["bundled"]["ssrc"] == s["out_video_ssrc"] && video_leg["remote"] == leg["remote"],
                        format!("the video leg is bundled on the audio leg's address and peer: {video_leg}"),
                    );
                }
            }
            Err(e) => check(false, format!("the call's relay {id} in the API: {e}")),
        }
        let table = common::netns::try_api(&bed.tb, "GET", "/v1/table", None).map(|t| t.to_string()).unwrap_or_default();
        check(
            (table.contains("AEAD_AES_128_GCM") || table.contains("AES_CM_128_HMAC_SHA1_80")) && !table.contains("\"master\""),
            "nor in the forwarding table's view".into(),
        );
    }

    // The browser hangs up; the BYE reaches the UAS through Kamailio's route set.
    *hangup.lock().unwrap() = true;
    let uas_result = sipp_result(&mut uas, &dir, "call", "uas");
    check(uas_result.is_ok(), format!("the browser's BYE reached the UAS, which completed the call {}", uas_result.err().unwrap_or_default()));
    if !failures.is_empty() || std::env::var_os("MP_KEEP_TMP").is_some() {
        eprintln!("browser report: {s}\nchromium log:\n{}", chrome.log_tail(20));
    }
    drop(chrome);
    // The eBPF plane's counters start over with the restarted process: held against what arrived
    // since.
    let received = receipts.packets + in_packets - if restart { at_restart.0 + at_restart.1 } else { 0 };
    bed.finish(received as usize, report, failures);
}

relay_tests!(run_plain, webrtc_sipjs_rtpengine, webrtc_sipjs_mediaplane_userspace, webrtc_sipjs_mediaplane_ebpf);

mod restart {
    use super::*;

    #[test]
    fn webrtc_restart_mediaplane_userspace() {
        run_restart(Relay::MediaplaneUserspace);
    }

    #[test]
    fn webrtc_restart_mediaplane_ebpf() {
        run_restart(Relay::MediaplaneEbpf);
    }
}

mod video {
    use super::*;
    relay_tests!(run_video, webrtc_video_rtpengine, webrtc_video_mediaplane_userspace, webrtc_video_mediaplane_ebpf);
}

mod max_bundle {
    use super::*;

    #[test]
    fn webrtc_max_bundle_mediaplane_userspace() {
        run_max_bundle(Relay::MediaplaneUserspace);
    }

    #[test]
    fn webrtc_max_bundle_mediaplane_ebpf() {
        run_max_bundle(Relay::MediaplaneEbpf);
    }
}

mod sdes {
    use super::*;
    relay_tests!(run_sdes, webrtc_sdes_rtpengine, webrtc_sdes_mediaplane_userspace, webrtc_sdes_mediaplane_ebpf);
}
