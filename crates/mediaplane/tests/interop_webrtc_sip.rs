//! Interop, WebRTC ↔ SIP: a real browser (headless Chromium, fake microphone) calls a plain-RTP
//! party through `mediaplane serve`, signalled over NG as Kamailio's rtpengine module signals a
//! WebRTC caller (`transport-protocol=RTP/AVP`, `ICE=remove` on the offer). The relay is the
//! browser's ICE-lite peer and DTLS server, and bridges its SRTP to plain PCMU on the other leg.
//!
//! The test serves the page itself on loopback: the page offers (after ICE gathering), the
//! test turns the offer into an NG offer, answers it as the plain party (a Rust UDP socket,
//! PCMU), and hands the NG answer back to the page. Then 4 s of media both ways: the plain
//! party sends 200 PCMU packets of one SSRC; the browser sends its microphone. Counted at both
//! ends: the plain party's receipts by SSRC and sequence number (≥ 95 % of what the browser
//! reports sent, no duplicate), the browser's by getStats (packetsReceived ≥ 95 % of 200,
//! packetsLost ≤ 5 %), the browser's DTLS connected, the relay's SRTP failure counters all 0, and
//! the leg in the API: an ICE leg whose peer is one of the browser's host candidates, keyed by
//! the handshake, with no key material in the relay or table views.
//!
//! Needs chromium (Debian `chromium`); skipped without it, except under CI=true, where that is
//! a failure. MP_KEEP_TMP=1 keeps the run's directory (the browser's and the relay's logs).

mod common;
mod ng_common;

use common::{Daemon, TempDir};
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use mediaplane_ng::bencode::Value;
use ng_common::{ng_client, offer_answer, text, TestClient};
use serde_json::Value as Json;
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MEDIA_IP: &str = "127.0.0.1";
const CALL: &str = "webrtc-sip@interop.test";
/// PCMU packets the plain party sends, one per 20 ms.
const PACKETS: u16 = 200;
const PLAIN_SSRC: u32 = 0x51b0_0001;

const PAGE: &str = r#"<!doctype html><title>mediaplane WebRTC caller</title><script>
async function post(path, body) { const r = await fetch(path, {method: 'POST', body}); return r.text(); }
(async () => {
  try {
    const pc = new RTCPeerConnection();
    const stream = await navigator.mediaDevices.getUserMedia({audio: true});
    stream.getTracks().forEach(t => pc.addTrack(t, stream));
    await pc.setLocalDescription(await pc.createOffer());
    await new Promise(done => {
      if (pc.iceGatheringState === 'complete') return done();
      pc.addEventListener('icegatheringstatechange', () => pc.iceGatheringState === 'complete' && done());
      setTimeout(done, 3000);
    });
    const answer = await post('/offer', pc.localDescription.sdp);
    await pc.setRemoteDescription({type: 'answer', sdp: answer});
    setInterval(async () => {
      const out = {ice: pc.iceConnectionState, connection: pc.connectionState};
      (await pc.getStats()).forEach(r => {
        if (r.type === 'inbound-rtp' && r.kind === 'audio') Object.assign(out, {in_packets: r.packetsReceived, in_lost: r.packetsLost, in_ssrc: r.ssrc});
        if (r.type === 'outbound-rtp' && r.kind === 'audio') Object.assign(out, {out_packets: r.packetsSent, out_ssrc: r.ssrc});
        if (r.type === 'transport') Object.assign(out, {dtls: r.dtlsState, srtp_cipher: r.srtpCipher});
      });
      post('/stats', JSON.stringify(out));
    }, 250);
  } catch (e) {
    post('/stats', JSON.stringify({error: String(e)}));
  }
})();
</script>"#;

/// The page's server: `/` is the page, `POST /offer` hands the browser's offer to the test and
/// answers with what the test sends back, `POST /stats` keeps the browser's latest figures.
fn serve_page(listener: TcpListener, offers: mpsc::Sender<(String, mpsc::Sender<String>)>, stats: Arc<Mutex<Json>>) {
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
        let Some((method, path, body)) = read_request(&mut conn) else { continue };
        let (ctype, reply) = match (method.as_str(), path.as_str()) {
            ("GET", "/") => ("text/html", PAGE.to_string()),
            ("POST", "/offer") => {
                let (tx, rx) = mpsc::channel();
                if offers.send((body, tx)).is_err() {
                    continue;
                }
                ("application/sdp", rx.recv_timeout(Duration::from_secs(10)).unwrap_or_default())
            }
            ("POST", "/stats") => {
                if let Ok(v) = serde_json::from_str(&body) {
                    *stats.lock().unwrap() = v;
                }
                ("text/plain", String::new())
            }
            _ => ("text/plain", String::new()),
        };
        let _ = write!(conn, "HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}", reply.len());
    }
}

fn read_request(conn: &mut TcpStream) -> Option<(String, String, String)> {
    let mut r = BufReader::new(conn.try_clone().ok()?);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next()?.to_string(), parts.next()?.to_string());
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).ok()?;
        if h.trim().is_empty() {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).ok()?;
    Some((method, path, String::from_utf8_lossy(&body).into_owned()))
}

fn chromium() -> Option<String> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| Command::new("which").arg(b).stdout(Stdio::null()).status().is_ok_and(|s| s.success()))
        .map(String::from)
}

/// The plain party's SDP: PCMU on `addr`.
fn plain_sdp(addr: SocketAddr) -> String {
    format!(
        "v=0\r\no=- 7 7 IN IP4 {ip}\r\ns=-\r\nc=IN IP4 {ip}\r\nt=0 0\r\nm=audio {port} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\na=ptime:20\r\na=sendrecv\r\n",
        ip = addr.ip(),
        port = addr.port()
    )
}

fn num(v: &Json, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

#[test]
fn a_browser_calls_a_plain_rtp_party_through_the_relay() {
    let Some(browser) = chromium() else {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("interop_webrtc_sip: chromium is missing, and CI=true: interop tests must run in CI");
        }
        eprintln!("interop_webrtc_sip: skipped: no chromium");
        return;
    };
    let tmp = TempDir::new("webrtc-sip");
    let cfg = tmp.0.join("mediaplane.toml");
    std::fs::write(&cfg, format!("[media]\nip = \"{MEDIA_IP}\"\nport_min = 43000\nport_max = 43199\n")).unwrap();
    let ng_addr: SocketAddr = format!("127.0.0.1:{}", ng_common::free_udp_port()).parse().unwrap();
    let daemon = Daemon::start(&tmp.0.join("store.db"), &["--config", cfg.to_str().unwrap(), "--ng-listen", &ng_addr.to_string(), "--reset"]);
    let mut ng = ng_client(ng_addr);

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let page = format!("http://{}/", listener.local_addr().unwrap());
    let (offers_tx, offers) = mpsc::channel();
    let stats = Arc::new(Mutex::new(Json::Null));
    {
        let stats = stats.clone();
        std::thread::spawn(move || serve_page(listener, offers_tx, stats));
    }
    let profile = tmp.0.join("chromium");
    let log = std::fs::File::create(tmp.0.join("chromium.log")).unwrap();
    let mut chrome = Command::new(&browser)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--use-fake-device-for-media-stream",
            "--use-fake-ui-for-media-stream",
            // Host candidates on loopback, as IP addresses (not mDNS names).
            "--allow-loopback-in-peer-connection",
            "--disable-features=WebRtcHideLocalIpsWithMdns",
            &format!("--user-data-dir={}", profile.display()),
            &page,
        ])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start chromium");

    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // Signalling: the browser's offer, as Kamailio hands a WebRTC caller's INVITE over.
        let (offer_sdp, reply) = offers.recv_timeout(Duration::from_secs(30)).expect("the page sent no offer");
        assert!(offer_sdp.contains("UDP/TLS/RTP/SAVPF") && offer_sdp.contains("a=fingerprint"), "{offer_sdp}");
        let mut o = offer_answer("offer", CALL, "browser", None, &offer_sdp, "127.0.0.1");
        o.push(("transport-protocol", Value::str("RTP/AVP")));
        o.push(("ICE", Value::str("remove")));
        let r = ng.cmd(o);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let to_plain = text(&r, "sdp");
        assert!(to_plain.contains(" RTP/AVP ") && !to_plain.contains("a=candidate") && !to_plain.contains("a=fingerprint"), "{to_plain}");
        let relay_for_plain = mediaplane_ng::client::advertised(&r).unwrap();

        let plain = UdpSocket::bind("127.0.0.1:0").unwrap();
        plain.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let r = ng.cmd(offer_answer("answer", CALL, "browser", Some("plain"), &plain_sdp(plain.local_addr().unwrap()), "127.0.0.1"));
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
        let to_browser = text(&r, "sdp");
        for needed in ["UDP/TLS/RTP/SAVPF", "a=ice-lite", "a=ice-ufrag:", "a=fingerprint:sha-256", "a=setup:passive", "a=rtcp-mux", "a=mid:"] {
            assert!(to_browser.contains(needed), "{needed} missing: {to_browser}");
        }
        reply.send(to_browser).unwrap();

        // Media: the plain party sends 200 PCMU packets and counts what arrives from the browser.
        let (mut received, mut seen, mut duplicates) = (0u64, HashSet::new(), 0u64);
        let mut browser_ssrcs = HashSet::new();
        let start = Instant::now();
        let mut next = 0u16;
        let mut buf = [0u8; 2048];
        while start.elapsed() < Duration::from_secs(12) {
            if next < PACKETS && start.elapsed() >= Duration::from_millis(1000 + 20 * next as u64) {
                plain.send_to(&build_rtp(0, next, next as u32 * 160, PLAIN_SSRC, &[0xff; 160]), relay_for_plain).unwrap();
                next += 1;
            }
            if let Ok((n, _)) = plain.recv_from(&mut buf) {
                if let Ok(h) = RtpHeader::parse(&buf[..n]) {
                    if (200..=204).contains(&buf[1]) {
                        continue; // the browser's RTCP, multiplexed
                    }
                    browser_ssrcs.insert(h.ssrc);
                    received += 1;
                    if !seen.insert((h.ssrc, h.sequence)) {
                        duplicates += 1;
                    }
                }
            }
            let s = stats.lock().unwrap().clone();
            if next == PACKETS && num(&s, "in_packets") >= PACKETS as u64 && received >= 150 {
                break;
            }
        }
        // What the browser reports sent now has reached the plain party 600 ms later.
        let s = stats.lock().unwrap().clone();
        let drain = Instant::now();
        while drain.elapsed() < Duration::from_millis(600) {
            if let Ok((n, _)) = plain.recv_from(&mut buf) {
                if let Ok(h) = RtpHeader::parse(&buf[..n]) {
                    if (200..=204).contains(&buf[1]) {
                        continue;
                    }
                    browser_ssrcs.insert(h.ssrc);
                    received += 1;
                    if !seen.insert((h.ssrc, h.sequence)) {
                        duplicates += 1;
                    }
                }
            }
        }
        eprintln!("browser: {s}\nplain party: {received} packets from the browser, SSRCs {browser_ssrcs:x?}, {duplicates} duplicates");
        assert!(s.get("error").is_none(), "the page failed: {s}");
        assert_eq!(s["dtls"], "connected", "{s}");
        assert!(num(&s, "in_packets") >= PACKETS as u64 * 95 / 100, "the browser received {} of {PACKETS}: {s}", num(&s, "in_packets"));
        assert!(num(&s, "in_lost") <= PACKETS as u64 / 20, "{s}");
        assert_eq!(s["in_ssrc"].as_u64(), Some(PLAIN_SSRC as u64), "the plain party's SSRC reached the browser: {s}");
        let sent = num(&s, "out_packets");
        assert!(sent > 0 && received >= sent * 95 / 100 - 5, "the plain party got {received} of the {sent} the browser sent");
        assert_eq!(browser_ssrcs.into_iter().collect::<Vec<_>>(), vec![s["out_ssrc"].as_u64().unwrap() as u32], "one SSRC, the browser's");
        assert_eq!(duplicates, 0);

        // The relay: no SRTP failure, the leg's ICE and DTLS as the browser saw them.
        let (_, st) = daemon.call("GET", "/v1/stats", None);
        for k in ["srtp_no_key", "srtp_auth_failed", "srtp_replayed", "srtp_invalid", "srtp_protect_failed"] {
            assert_eq!(st["extra"][k].as_u64().unwrap_or(0), 0, "{k}: {st}");
        }
        let (_, relay) = daemon.call("GET", &format!("/v1/relays/{}", ng_common::rtp_relay(CALL)), None);
        assert_eq!(relay["a"]["ice"], true, "{relay}");
        // The nominated address is one of the browser's host candidates (Chromium offers its
        // loopback and its other local addresses; the traffic stays on this host).
        let nominated: SocketAddr = relay["a"]["remote"].as_str().and_then(|a| a.parse().ok()).unwrap_or_else(|| panic!("no nominated peer: {relay}"));
        assert!(offer_sdp.contains(&format!("{} {} typ host", nominated.ip(), nominated.port())), "{nominated} is no candidate of {offer_sdp}");
        assert_eq!(relay["a"]["srtp"]["inbound"]["suite"], "AES_CM_128_HMAC_SHA1_80", "keyed by the handshake: {relay}");
        assert!(relay["a"]["srtp"]["inbound"].get("master").is_none(), "keys never leave in a response: {relay}");
        let (_, table) = daemon.call("GET", "/v1/table", None);
        assert!(table.to_string().contains("AES_CM_128_HMAC_SHA1_80") && !table.to_string().contains("\"master\""), "nor in the table: {table}");
        let r = ng.cmd(vec![("command", Value::str("delete")), ("call-id", Value::str(CALL)), ("from-tag", Value::str("browser"))]);
        assert_eq!(text(&r, "result"), "ok", "{r:?}");
    }));
    let _ = chrome.kill();
    let _ = chrome.wait();
    if std::env::var("MP_KEEP_TMP").is_ok() || result.is_err() {
        eprintln!(
            "chromium log: {}",
            std::fs::read_to_string(tmp.0.join("chromium.log")).unwrap_or_default().lines().rev().take(30).collect::<Vec<_>>().join("\n")
        );
    }
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}
