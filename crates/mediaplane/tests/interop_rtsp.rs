//! Interop, the RTSP proxy (issue 43): GStreamer's RTSP server (gst-rtsp-server through
//! Python's GObject bindings, Debian's `gir1.2-gst-rtsp-server-1.0`) is the camera, H.264 video
//! and Opus audio; `mediaplane serve --rtsp-path cam=...` pulls it once; ffmpeg viewers (UDP)
//! watch it through the proxy while one ffmpeg watches the camera directly as the anchor.
//!
//! On loopback with the socket plane. The peers are installed by `make deps`; a missing one is a
//! failure, not a skip.

mod common;

use common::netns::NetnsServe;
use common::{free_port, Daemon, TempDir};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::process::Supervised;
use serde_json::json;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One test at a time: each runs a camera encoding H.264 and several decoders, and two cores
/// shared by several of them drop frames at the viewers (seen: 78 frames of 106).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

const CAMERA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../rtsp/tests/peers/camera.py");
const FPS: u32 = 25;

/// The camera: its process and the lines it printed (`ready`, `client <n>`).
struct Camera {
    _proc: Supervised,
    lines: Arc<Mutex<Vec<String>>>,
    url: String,
}

impl Camera {
    fn start() -> Camera {
        Camera::start_with(Command::new("/usr/bin/python3"), "127.0.0.1")
    }

    /// The camera run by `python3` (a command that may enter a namespace first) on `address`.
    fn start_with(cmd: Command, address: &str) -> Camera {
        Camera::start_at_rate(cmd, address, None)
    }

    /// [`Camera::start_with`], its video at `bitrate` bit/s (a noisy picture) when given.
    fn start_at_rate(cmd: Command, address: &str, bitrate: Option<u32>) -> Camera {
        Camera::start_on(cmd, address, free_port(), bitrate)
    }

    /// The camera on `port` (a restarted one: where the first was).
    fn start_on(mut cmd: Command, address: &str, port: u16, bitrate: Option<u32>) -> Camera {
        cmd.args([CAMERA, &port.to_string(), &FPS.to_string(), address]).args(bitrate.map(|b| b.to_string())).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut proc = Supervised::spawn("camera (gst-rtsp-server)", &mut cmd).expect("python3 with gst-rtsp-server (make deps installs it)");
        let out = proc.child_mut().stdout.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(l);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(15);
        while !lines.lock().unwrap().iter().any(|l| l == "ready") {
            assert!(Instant::now() < deadline, "the camera did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Camera { _proc: proc, lines, url: format!("rtsp://{address}:{port}/cam") }
    }

    /// RTSP connections the camera accepted.
    fn clients(&self) -> usize {
        self.lines.lock().unwrap().iter().filter(|l| l.starts_with("client ")).count()
    }
}

/// An ffmpeg viewer decoding `secs` of the video over UDP (or TCP, interleaved); `frames()`
/// when it is done.
struct Viewer {
    proc: Supervised,
    url: String,
    /// Its stdout and stderr, read as they come (a full pipe would stall it).
    out: std::thread::JoinHandle<String>,
    err: std::thread::JoinHandle<String>,
}

impl Viewer {
    fn start(url: &str, secs: u32) -> Viewer {
        Viewer::start_with(Command::new("ffmpeg"), url, secs)
    }

    fn start_tcp(url: &str, secs: u32) -> Viewer {
        Viewer::over(Command::new("ffmpeg"), "tcp", url, secs)
    }

    fn start_with(cmd: Command, url: &str, secs: u32) -> Viewer {
        Viewer::over(cmd, "udp", url, secs)
    }

    fn over(mut cmd: Command, transport: &str, url: &str, secs: u32) -> Viewer {
        // Timestamps from the arrival clock: `-t` is then `secs` of wall time. The stream's own
        // jump when ffmpeg first maps them by an RTCP sender report, which arrives at a random
        // point of the window (a TCP viewer saw 246 frames in 5 s at 25 fps, another 53).
        cmd.args(["-nostdin", "-loglevel", "error", "-use_wallclock_as_timestamps", "1", "-rtsp_transport", transport, "-i", url, "-t", &secs.to_string()])
            .args(["-map", "0:v", "-f", "null", "-progress", "pipe:1", "-"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut proc = Supervised::spawn("ffmpeg viewer", &mut cmd).expect("ffmpeg (make deps installs it)");
        let read_all = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = r.read_to_string(&mut s);
                s
            })
        };
        let out = read_all(Box::new(proc.child_mut().stdout.take().unwrap()));
        let err = read_all(Box::new(proc.child_mut().stderr.take().unwrap()));
        Viewer { proc, url: url.to_string(), out, err }
    }

    /// Frames decoded, and what ffmpeg said on stderr.
    fn frames(mut self, within: Duration) -> (u64, String) {
        let status = self.proc.wait_timeout(within).unwrap().unwrap_or_else(|| panic!("ffmpeg on {} did not finish in {within:?}", self.url));
        let (out, err) = (self.out.join().unwrap(), self.err.join().unwrap());
        assert!(status.success(), "ffmpeg on {} failed ({status}): {err}", self.url);
        let frames = out.lines().filter_map(|l| l.strip_prefix("frame=")).filter_map(|v| v.trim().parse().ok()).max().unwrap_or(0);
        (frames, err)
    }
}

/// The daemon, its media on loopback address `media_ip` (one per test: the tests run side by side
/// and each daemon allocates the same ports), proxying the camera as `cam`.
fn serve(tmp: &TempDir, camera: &Camera, media_ip: &str) -> (Daemon, String) {
    serve_with(tmp, camera, media_ip, "")
}

/// [`serve`] with more of the config file.
fn serve_with(tmp: &TempDir, camera: &Camera, media_ip: &str, config: &str) -> (Daemon, String) {
    let (d, rtsp) = serve_paths(tmp, media_ip, config, &["--rtsp-path", &format!("cam={}", camera.url)]);
    (d, format!("{rtsp}/cam"))
}

/// The daemon with the RTSP proxy and the paths `config` and `args` declare; `rtsp://<its address>`.
fn serve_paths(tmp: &TempDir, media_ip: &str, config: &str, args: &[&str]) -> (Daemon, String) {
    let rtsp = format!("127.0.0.1:{}", free_port());
    let cfg = tmp.0.join("mediaplane.toml");
    std::fs::write(&cfg, format!("[media]\nip = \"{media_ip}\"\n{config}")).unwrap();
    let d = Daemon::start(&tmp.0.join("store.db"), &[&["--config", cfg.to_str().unwrap(), "--rtsp-listen", &rtsp], args].concat());
    (d, format!("rtsp://{rtsp}"))
}

/// One raw request on a fresh connection, and the status line and body of the answer.
fn raw(addr: &str, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    // Until the server closes or a complete answer arrived.
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if let Ok(Some(_)) = mediaplane_rtsp::message::decode(&out) {
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn one_pull_from_the_camera_many_udp_and_tcp_viewers() {
    let _one = one_at_a_time();
    const UDP_VIEWERS: usize = 3;
    const VIEWERS: usize = UDP_VIEWERS + 2;
    const SECS: u32 = 5;
    let tmp = TempDir::new("rtsp-fanout");
    let camera = Camera::start();
    let (d, url) = serve(&tmp, &camera, "127.43.0.1");
    let started = Instant::now();
    while camera.clients() < 1 {
        assert!(started.elapsed() < Duration::from_secs(10), "the proxy did not pull the camera");
        std::thread::sleep(Duration::from_millis(50));
    }
    let viewers: Vec<Viewer> = (0..VIEWERS).map(|i| if i < UDP_VIEWERS { Viewer::start(&url, SECS) } else { Viewer::start_tcp(&url, SECS) }).collect();
    let anchor = Viewer::start(&camera.url, SECS);

    // While they play: the room holds the camera's two tracks and every viewer's two (the
    // viewers start side by side with other tests: polled until all are in).
    let deadline = Instant::now() + Duration::from_secs(SECS as u64);
    let room = loop {
        let (status, room) = d.call("GET", "/v1/rooms/rtsp.cam", None);
        assert_eq!(status, 200, "{room}");
        let participants = room["participants"].as_object().unwrap();
        let subscribed = participants.values().filter(|p| p["subscriptions"].as_array().is_some_and(|s| !s.is_empty())).count();
        if subscribed == VIEWERS * 2 || Instant::now() > deadline {
            break room;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let participants = room["participants"].as_object().unwrap();
    assert!(participants.contains_key("source-0") && participants.contains_key("source-1"), "{room}");
    let subscribed = participants.values().filter(|p| p["subscriptions"].as_array().is_some_and(|s| !s.is_empty())).count();
    assert_eq!(subscribed, VIEWERS * 2, "every viewer's video and audio consume the camera's: {room}");

    let wait = Duration::from_secs(SECS as u64 + 20);
    let (anchor_frames, _) = anchor.frames(wait);
    let frames: Vec<(u64, String)> = viewers.into_iter().map(|v| v.frames(wait)).collect();
    eprintln!("frames decoded: direct {anchor_frames}, through the proxy (UDP, then TCP) {:?}", frames.iter().map(|f| f.0).collect::<Vec<_>>());
    assert!(anchor_frames >= (SECS * FPS / 2) as u64, "the anchor decoded {anchor_frames} frames: the camera is not working");
    for (f, err) in &frames {
        assert!(*f + 5 >= anchor_frames, "a viewer through the proxy decoded {f} frames, the direct one {anchor_frames}; ffmpeg said: {err}");
    }
    // The camera saw the proxy's one session and the anchor, never a viewer.
    assert_eq!(camera.clients(), 2, "camera lines: {:?}", camera.lines.lock().unwrap());

    // Every viewer sent TEARDOWN: only the camera's sources are left.
    let (_, room) = d.call("GET", "/v1/rooms/rtsp.cam", None);
    let left: Vec<&String> = room["participants"].as_object().unwrap().keys().collect();
    assert_eq!(left, vec!["source-0", "source-1"], "{room}");
}

#[test]
fn bad_requests_get_an_answer_and_the_server_carries_on() {
    let _one = one_at_a_time();
    let tmp = TempDir::new("rtsp-bad");
    let camera = Camera::start();
    let (_d, url) = serve(&tmp, &camera, "127.43.0.2");
    let addr = url.trim_start_matches("rtsp://").trim_end_matches("/cam").to_string();

    let garbage = raw(&addr, b"\x16\x03\x01 not rtsp at all\r\n\r\n");
    assert!(garbage.starts_with("RTSP/1.0 400 "), "{garbage}");
    let huge = raw(&addr, &vec![b'A'; 20_000]);
    assert!(huge.starts_with("RTSP/1.0 400 "), "{huge}");
    let unknown = raw(&addr, format!("DESCRIBE rtsp://{addr}/nope RTSP/1.0\r\nCSeq: 1\r\n\r\n").as_bytes());
    assert!(unknown.starts_with("RTSP/1.0 404 ") && unknown.contains("CSeq: 1"), "{unknown}");
    let multicast = raw(&addr, format!("SETUP {url}/trackID=0 RTSP/1.0\r\nCSeq: 2\r\nTransport: RTP/AVP;multicast;client_port=5000-5001\r\n\r\n").as_bytes());
    assert!(multicast.starts_with("RTSP/1.0 461 "), "{multicast}");
    let elsewhere = raw(
        &addr,
        format!("SETUP {url}/trackID=0 RTSP/1.0\r\nCSeq: 3\r\nTransport: RTP/AVP;unicast;destination=192.0.2.1;client_port=5000-5001\r\n\r\n").as_bytes(),
    );
    assert!(elsewhere.starts_with("RTSP/1.0 403 "), "a viewer may not send the camera to a third address: {elsewhere}");
    let no_session = raw(&addr, format!("PLAY {url} RTSP/1.0\r\nCSeq: 4\r\nSession: 0123456789abcdef\r\n\r\n").as_bytes());
    assert!(no_session.starts_with("RTSP/1.0 454 "), "{no_session}");
    let options = raw(&addr, format!("OPTIONS {url} RTSP/1.0\r\nCSeq: 5\r\n\r\n").as_bytes());
    assert!(options.starts_with("RTSP/1.0 200 ") && options.contains("Public: OPTIONS, DESCRIBE, ANNOUNCE, SETUP"), "{options}");

    // And a real viewer still plays.
    let (frames, err) = Viewer::start(&url, 2).frames(Duration::from_secs(20));
    assert!(frames > 0, "after the bad requests a viewer decoded nothing: {err}");
}

/// An on-demand path: the camera is not pulled until a viewer asks for it, is pulled within 1 s
/// of the first DESCRIBE, and is released (its connection closed) after the last viewer left.
#[test]
fn an_on_demand_path_is_pulled_while_watched() {
    let _one = one_at_a_time();
    let tmp = TempDir::new("rtsp-demand");
    let camera = Camera::start();
    let config = format!("[rtsp]\n[[rtsp.paths]]\nname = \"lobby\"\nsource = \"{}\"\non_demand = true\nrelease_after_secs = 1\n", camera.url);
    let (d, rtsp) = serve_paths(&tmp, "127.43.0.5", &config, &[]);
    let url = format!("{rtsp}/lobby");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(camera.clients(), 0, "an on-demand path was pulled with nobody watching");

    let asked = Instant::now();
    let viewer = Viewer::start(&url, 3);
    while camera.clients() == 0 {
        assert!(asked.elapsed() < Duration::from_secs(5), "the viewer's DESCRIBE did not make the proxy pull the camera");
        std::thread::sleep(Duration::from_millis(10));
    }
    // ffmpeg's start-up is in it too: DESCRIBE is its first request.
    let pulled_after = asked.elapsed();
    let (frames, err) = viewer.frames(Duration::from_secs(25));
    assert!(frames >= (3 * FPS / 2) as u64, "{frames} frames through an on-demand path: {err}");
    assert!(pulled_after < Duration::from_secs(1), "pulled {pulled_after:?} after the viewer started");

    // The viewer sent TEARDOWN: released about a second later.
    let left = Instant::now();
    while !camera.lines.lock().unwrap().iter().any(|l| l == "closed 1") {
        assert!(left.elapsed() < Duration::from_secs(5), "the camera was not released: {:?}", camera.lines.lock().unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }
    // Released for good: not pulled again by the requests of the viewer that left (it once was).
    std::thread::sleep(Duration::from_secs(1));
    let (_, stats) = d.call("GET", "/v1/stats", None);
    assert_eq!(stats["rtsp"]["upstreams_playing"], 0, "{}", stats["rtsp"]);
    assert_eq!(stats["rtsp"]["upstream_pulls"], 1, "{}", stats["rtsp"]);
    assert_eq!(camera.clients(), 1, "{:?}", camera.lines.lock().unwrap());
    eprintln!("pulled {pulled_after:?} after the viewer started; released {:?} after it left", left.elapsed());

    // And pulled again for the next viewer.
    let (frames, err) = Viewer::start(&url, 2).frames(Duration::from_secs(25));
    assert!(frames > 0, "a second viewer got nothing: {err}");
    assert_eq!(camera.clients(), 2);
}

/// Paths through the REST API: added (pulled at once), their state while a viewer watches,
/// removed (upstream released, room gone); bad requests refused with the API's codes.
#[test]
fn paths_added_and_removed_through_the_api() {
    let _one = one_at_a_time();
    let tmp = TempDir::new("rtsp-api");
    let camera = Camera::start();
    let (d, rtsp) = serve_paths(&tmp, "127.43.0.6", "", &[]);
    assert_eq!(d.call("GET", "/v1/rtsp/paths", None).1["paths"], json!([]));

    let (status, added) = d.call("POST", "/v1/rtsp/paths", Some(json!({"name": "yard", "source": camera.url})));
    assert_eq!(status, 201, "{added}");
    assert_eq!((added["name"].as_str(), added["room"].as_str(), added["on_demand"].as_bool()), (Some("yard"), Some("rtsp.yard"), Some(false)), "{added}");
    for (body, code) in [
        (json!({"name": "yard", "source": camera.url}), "exists"),
        (json!({"name": "no/slash", "source": camera.url}), "invalid"),
        (json!({"name": "x", "source": "http://example.invalid/"}), "invalid"),
        (json!({"name": "x", "source": camera.url, "colour": "blue"}), "wrong_shape"),
    ] {
        let (status, err) = d.call("POST", "/v1/rtsp/paths", Some(body.clone()));
        assert_eq!(err["code"], code, "{body}: {status} {err}");
    }
    assert_eq!(d.call("GET", "/v1/rtsp/paths/nope", None).1["code"], "not_found");

    let viewer = Viewer::start(&format!("{rtsp}/yard"), 4);
    std::thread::sleep(Duration::from_secs(3));
    let (_, state) = d.call("GET", "/v1/rtsp/paths/yard", None);
    assert_eq!((state["upstream"]["playing"].as_bool(), state["viewers"].as_u64()), (Some(true), Some(1)), "{state}");
    let tracks = state["upstream"]["tracks"].as_array().unwrap();
    assert_eq!(tracks.iter().map(|t| t["kind"].as_str().unwrap()).collect::<Vec<_>>(), vec!["video", "audio"], "{state}");
    assert!(tracks.iter().all(|t| t["rx_packets"].as_u64() > Some(0) && t["copies"].as_u64() > Some(0)), "{state}");
    let (frames, err) = viewer.frames(Duration::from_secs(25));
    assert!(frames > 0, "a viewer of a path added through the API got nothing: {err}");

    let (status, deleted) = d.call("DELETE", "/v1/rtsp/paths/yard", None);
    assert_eq!((status, &deleted), (200, &json!({"deleted": "yard"})));
    let released = Instant::now();
    while !camera.lines.lock().unwrap().iter().any(|l| l == "closed 1") {
        assert!(released.elapsed() < Duration::from_secs(5), "the camera was not released: {:?}", camera.lines.lock().unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(d.call("GET", "/v1/rooms/rtsp.yard", None).0, 404, "the path's room outlived it");
    assert_eq!(d.call("GET", "/v1/rtsp/paths/yard", None).0, 404);
    let refused = raw(rtsp.trim_start_matches("rtsp://"), format!("DESCRIBE {rtsp}/yard RTSP/1.0\r\nCSeq: 1\r\n\r\n").as_bytes());
    assert!(refused.starts_with("RTSP/1.0 404 "), "{refused}");

    // Without the proxy, its routes are not found.
    let tmp2 = TempDir::new("rtsp-api-off");
    let off = Daemon::start(&tmp2.0.join("store.db"), &[]);
    assert_eq!(off.call("GET", "/v1/rtsp/paths", None).1["code"], "not_found");
}

/// A camera that asks for credentials (Digest, then Basic): pulled with the ones in the source
/// URL (percent-encoded), never shown back; without them, or with wrong ones, not pulled, and a
/// viewer is told 503.
#[test]
fn a_camera_behind_digest_or_basic_authentication() {
    let _one = one_at_a_time();
    for method in ["digest", "basic"] {
        let tmp = TempDir::new(&format!("rtsp-auth-{method}"));
        let mut cmd = Command::new("/usr/bin/python3");
        cmd.env("CAMERA_AUTH", format!("ann:s3cr%t:{method}"));
        let camera = Camera::start_with(cmd, "127.0.0.1");
        let with = camera.url.replace("rtsp://", "rtsp://ann:s3cr%25t@");
        let wrong = camera.url.replace("rtsp://", "rtsp://ann:guess@");
        let args = ["--rtsp-path", &format!("good={with}"), "--rtsp-path", &format!("none={}", camera.url), "--rtsp-path", &format!("wrong={wrong}")];
        let (d, rtsp) = serve_paths(&tmp, if method == "digest" { "127.43.0.7" } else { "127.43.0.8" }, "", &args);
        let (frames, err) = Viewer::start(&format!("{rtsp}/good"), 2).frames(Duration::from_secs(25));
        assert!(frames > 0, "{method}: nothing through a path with credentials: {err}");
        let (_, good) = d.call("GET", "/v1/rtsp/paths/good", None);
        assert_eq!(good["source"], camera.url.replace("rtsp://", "rtsp://ann:***@"), "{method}: {good}");
        for refused in ["none", "wrong"] {
            let (_, state) = d.call("GET", &format!("/v1/rtsp/paths/{refused}"), None);
            assert_eq!(state["upstream"]["playing"], false, "{method}: {state}");
            let answer = raw(rtsp.trim_start_matches("rtsp://"), format!("DESCRIBE {rtsp}/{refused} RTSP/1.0\r\nCSeq: 1\r\n\r\n").as_bytes());
            assert!(answer.starts_with("RTSP/1.0 503 "), "{method} {refused}: {answer}");
        }
    }
}

/// A path with `read_users`: a viewer without credentials or with wrong ones is answered 401
/// (Digest and Basic offered) and counted; ffmpeg with the right ones watches (it answers
/// Digest); a Basic answer is taken too.
#[test]
fn a_path_only_its_readers_may_watch() {
    let _one = one_at_a_time();
    let tmp = TempDir::new("rtsp-readers");
    let camera = Camera::start();
    let config = format!("[rtsp]\n[[rtsp.paths]]\nname = \"locked\"\nsource = \"{}\"\nread_users = [\"ann:s3cret\"]\n", camera.url);
    let (d, rtsp) = serve_paths(&tmp, "127.43.0.9", &config, &[]);
    let addr = rtsp.trim_start_matches("rtsp://").to_string();
    let url = format!("{rtsp}/locked");

    let anonymous = raw(&addr, format!("DESCRIBE {url} RTSP/1.0\r\nCSeq: 1\r\n\r\n").as_bytes());
    assert!(anonymous.starts_with("RTSP/1.0 401 "), "{anonymous}");
    assert!(
        anonymous.contains("WWW-Authenticate: Digest realm=\"mediaplane\"") && anonymous.contains("WWW-Authenticate: Basic realm=\"mediaplane\""),
        "{anonymous}"
    );
    let basic = |pair: &str| {
        use base64::Engine as _;
        let b = base64::engine::general_purpose::STANDARD.encode(pair);
        raw(&addr, format!("DESCRIBE {url} RTSP/1.0\r\nCSeq: 2\r\nAuthorization: Basic {b}\r\n\r\n").as_bytes())
    };
    assert!(basic("ann:s3cret").starts_with("RTSP/1.0 200 "), "{}", basic("ann:s3cret"));
    assert!(basic("ann:guess").starts_with("RTSP/1.0 401 "));
    // OPTIONS needs no credentials (clients ask it first).
    assert!(raw(&addr, format!("OPTIONS {url} RTSP/1.0\r\nCSeq: 3\r\n\r\n").as_bytes()).starts_with("RTSP/1.0 200 "));

    let (frames, err) = Viewer::start(&url.replace("rtsp://", "rtsp://ann:s3cret@"), 2).frames(Duration::from_secs(25));
    assert!(frames > 0, "ffmpeg with the reader's credentials got nothing: {err}");
    let mut refused = Viewer::start(&url.replace("rtsp://", "rtsp://ann:guess@"), 2);
    let status = refused.proc.wait_timeout(Duration::from_secs(20)).unwrap().expect("ffmpeg with wrong credentials gave up");
    assert!(!status.success(), "ffmpeg with wrong credentials was served");
    let (_, stats) = d.call("GET", "/v1/stats", None);
    assert!(stats["rtsp"]["unauthorized"].as_u64().unwrap() >= 3, "{}", stats["rtsp"]);
    let (_, state) = d.call("GET", "/v1/rtsp/paths/locked", None);
    assert_eq!(state["read_users"], json!(["ann"]), "names only: {state}");
}

/// The camera's sender reports reach the viewers unchanged (the same SSRC as the RTP they get):
/// a UDP viewer's at its client RTCP port from its server RTCP port, a TCP viewer's interleaved
/// on the channel after its RTP's.
#[test]
fn the_cameras_sender_reports_reach_the_viewers() {
    let _one = one_at_a_time();
    let tmp = TempDir::new("rtsp-rtcp");
    let camera = Camera::start();
    let (_d, url) = serve(&tmp, &camera, "127.43.0.10");
    let addr = url.trim_start_matches("rtsp://").trim_end_matches("/cam").to_string();
    let request = |s: &mut TcpStream, req: String| -> mediaplane_rtsp::message::Response {
        s.write_all(req.as_bytes()).unwrap();
        let mut buf = Vec::new();
        let mut byte = [0u8; 1];
        loop {
            if let Ok(Some((mediaplane_rtsp::message::Message::Response(r), _))) = mediaplane_rtsp::message::decode(&buf) {
                return r;
            }
            assert_eq!(s.read(&mut byte).unwrap(), 1);
            buf.push(byte[0]);
        }
    };
    let sender_ssrc = |p: &[u8]| (p.len() >= 8 && p[1] == 200).then(|| u32::from_be_bytes([p[4], p[5], p[6], p[7]]));

    // UDP: RTP and RTCP sockets of its own.
    let rtp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = rtp.local_addr().unwrap().port();
    let rtcp = std::net::UdpSocket::bind(("127.0.0.1", port + 1)).expect("the port after the RTP socket's is free");
    rtcp.set_read_timeout(Some(Duration::from_secs(12))).unwrap();
    rtp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut udp = TcpStream::connect(&addr).unwrap();
    let setup = request(&mut udp, format!("SETUP {url}/trackID=0 RTSP/1.0\r\nCSeq: 1\r\nTransport: RTP/AVP;unicast;client_port={port}-{}\r\n\r\n", port + 1));
    assert_eq!(setup.status, 200, "{setup:?}");
    let server_rtcp = mediaplane_rtsp::transport::TransportSpec::parse(setup.headers.get("Transport").unwrap()).unwrap().server_port.unwrap().1;
    let session = setup.headers.session().unwrap().to_string();
    assert_eq!(request(&mut udp, format!("PLAY {url} RTSP/1.0\r\nCSeq: 2\r\nSession: {session}\r\n\r\n")).status, 200);
    let mut buf = [0u8; 2048];
    rtp.recv(&mut buf).expect("RTP through the proxy");
    let media_ssrc = u32::from_be_bytes([buf[8], buf[9], buf[10], buf[11]]);
    let (n, from) = rtcp.recv_from(&mut buf).expect("a sender report within 12 s");
    assert_eq!(from.port(), server_rtcp, "from the server RTCP port its SETUP answered");
    assert_eq!(sender_ssrc(&buf[..n]), Some(media_ssrc), "the camera's SR for the SSRC of the RTP: {:02x?}", &buf[..n.min(16)]);

    // TCP: the SR on channel 1 of its connection.
    let mut tcp = TcpStream::connect(&addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(12))).unwrap();
    let setup = request(&mut tcp, format!("SETUP {url}/trackID=0 RTSP/1.0\r\nCSeq: 1\r\nTransport: RTP/AVP/TCP;unicast;interleaved=0-1\r\n\r\n"));
    let session = setup.headers.session().unwrap().to_string();
    assert_eq!(request(&mut tcp, format!("PLAY {url} RTSP/1.0\r\nCSeq: 2\r\nSession: {session}\r\n\r\n")).status, 200);
    let deadline = Instant::now() + Duration::from_secs(12);
    let mut stream = Vec::new();
    let mut chunk = [0u8; 4096];
    'read: loop {
        assert!(Instant::now() < deadline, "no sender report on channel 1 within 12 s");
        let n = tcp.read(&mut chunk).unwrap();
        stream.extend_from_slice(&chunk[..n]);
        while let Ok(Some((m, used))) = mediaplane_rtsp::message::decode(&stream) {
            stream.drain(..used);
            if let mediaplane_rtsp::message::Message::Interleaved { channel: 1, data } = m {
                assert_eq!(sender_ssrc(&data), Some(media_ssrc), "{data:02x?}");
                break 'read;
            }
        }
    }
}

/// An upstream that answers garbage (a TCP server writing junk, then a valid RTSP answer with an
/// SDP that is not one) is retried with backoff, not played, and disturbs neither the daemon nor
/// the viewers of another path.
#[test]
fn a_garbage_upstream_disturbs_no_other_path() {
    let _one = one_at_a_time();
    let tmp = TempDir::new("rtsp-garbage");
    let camera = Camera::start();
    let junk = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let junk_url = format!("rtsp://{}/x", junk.local_addr().unwrap());
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        for (i, conn) in junk.incoming().enumerate() {
            let Ok(mut c) = conn else { return };
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = c.set_read_timeout(Some(Duration::from_millis(500)));
            let mut buf = [0u8; 2048];
            let _ = c.read(&mut buf);
            let answer: &[u8] = match i % 3 {
                0 => b"\x00\xff garbage \r\n\r\n",
                1 => b"RTSP/1.0 200 OK\r\nCSeq: 1\r\nContent-Length: 9\r\n\r\nnot a sdp",
                _ => b"RTSP/1.0 200 OK\r\nCSeq: 1\r\nContent-Length: 99999999\r\n\r\n",
            };
            let _ = c.write_all(answer);
        }
    });
    let args = ["--rtsp-path", &format!("cam={}", camera.url), "--rtsp-path", &format!("junk={junk_url}")];
    let (mut d, rtsp) = serve_paths(&tmp, "127.43.0.11", "", &args);
    let (frames, err) = Viewer::start(&format!("{rtsp}/cam"), 4).frames(Duration::from_secs(25));
    assert!(frames >= (4 * FPS / 2) as u64, "a viewer of the good path got {frames} frames beside a garbage upstream: {err}");
    let tries = accepted.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!("the garbage upstream was tried {tries} times");
    // Measured: 4 (at 0, 0.5, 1.5 and 3.5 s); the fifth would be at 7.5 s.
    assert!((3..=5).contains(&tries), "the garbage upstream was tried {tries} times in ~5 s (backoff 0.5 s doubling)");
    let (_, state) = d.call("GET", "/v1/rtsp/paths/junk", None);
    assert_eq!(state["upstream"]["playing"], false, "{state}");
    assert!(d.alive());
}

/// A viewer that vanishes without TEARDOWN (killed) loses its session after
/// `rtsp.session_timeout_secs`, and the camera's copies to it stop; one that keeps the session
/// alive with GET_PARAMETER keeps it.
#[test]
fn a_silent_viewer_times_out() {
    let _one = one_at_a_time();
    let tmp = TempDir::new("rtsp-timeout");
    let camera = Camera::start();
    let (d, url) = serve_with(&tmp, &camera, "127.43.0.3", "[rtsp]\nsession_timeout_secs = 2\n");
    let viewers = |d: &Daemon| {
        let (_, room) = d.call("GET", "/v1/rooms/rtsp.cam", None);
        room["participants"].as_object().map(|p| p.keys().filter(|k| k.starts_with('v')).count()).unwrap_or(0)
    };
    let addr = url.trim_start_matches("rtsp://").trim_end_matches("/cam").to_string();
    // A hand-made session that keeps itself alive for 4 s, then goes silent.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut ask = |req: String| {
        s.write_all(req.as_bytes()).unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Ok(Some((mediaplane_rtsp::message::Message::Response(r), _))) = mediaplane_rtsp::message::decode(&buf) {
                return r;
            }
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0, "the server closed the connection");
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    let port = free_port();
    let setup = ask(format!("SETUP {url}/trackID=0 RTSP/1.0\r\nCSeq: 1\r\nTransport: RTP/AVP;unicast;client_port={port}-{}\r\n\r\n", port + 1));
    assert_eq!(setup.status, 200, "{setup:?}");
    let session = setup.headers.session().unwrap().to_string();
    assert!(setup.headers.get("Session").unwrap().ends_with(";timeout=2"), "{setup:?}");
    let play = ask(format!("PLAY {url} RTSP/1.0\r\nCSeq: 2\r\nSession: {session}\r\n\r\n"));
    assert_eq!(play.status, 200, "{play:?}");
    for cseq in 3..7 {
        std::thread::sleep(Duration::from_secs(1));
        let alive = ask(format!("GET_PARAMETER {url} RTSP/1.0\r\nCSeq: {cseq}\r\nSession: {session}\r\n\r\n"));
        assert_eq!(alive.status, 200, "kept alive, the session lasts beyond its timeout: {alive:?}");
    }
    assert_eq!(viewers(&d), 1);
    // Silent from here on: gone within the timeout and the reaper's second.
    std::thread::sleep(Duration::from_millis(3500));
    assert_eq!(viewers(&d), 0, "a silent session outlived its timeout");
    let late = ask(format!("GET_PARAMETER {url} RTSP/1.0\r\nCSeq: 9\r\nSession: {session}\r\n\r\n"));
    assert_eq!(late.status, 454, "{late:?}");
}

/// `/v1/stats` read between two packets. The camera never stops sending, and the kernel's
/// counters are read one by one (and a packet is counted received before it is forwarded): a
/// packet arriving during a read can be in one counter and not yet in another. Two reads in a
/// row that agree on both were taken with no packet in between.
fn settled_stats(serve: &NetnsServe) -> serde_json::Value {
    let key = |v: &serde_json::Value| (v["total"]["rx_packets"].as_u64(), v["extra"]["forwarded"].as_u64());
    let mut last = serve.api("GET", "/v1/stats", None);
    for _ in 0..100 {
        let next = serve.api("GET", "/v1/stats", None);
        if key(&next) == key(&last) {
            return next;
        }
        last = next;
    }
    panic!("no two reads of /v1/stats in a row agreed on the camera's counters: {last}");
}

/// Camera, SFU and viewers in network namespaces of their own, on every data plane: the camera
/// in p0, the viewers (and the anchor, routed through the SFU namespace by its stack) in p1.
/// On the eBPF planes the viewers' copies are made by the kernel: its forwarded counter covers
/// them, and no camera packet goes up to the daemon once the path is playing.
#[test]
fn viewers_in_a_namespace_on_every_plane() {
    let _one = one_at_a_time();
    if !mediaplane_bench::require_root("interop_rtsp::viewers_in_a_namespace_on_every_plane") {
        return;
    }
    const VIEWERS: usize = 3;
    const SECS: u32 = 5;
    for plane in common::planes() {
        let tb = Testbed::star(2).unwrap();
        let (cam_ns, view_ns) = (&tb.peers[0], &tb.peers[1]);
        let tmp = TempDir::new(&format!("rtsp-ns-{plane}"));
        let camera = Camera::start_with(tb.command(&cam_ns.ns, "/usr/bin/python3"), &cam_ns.ip.to_string());
        let cfg = tmp.0.join("mediaplane.toml");
        std::fs::write(&cfg, format!("[media]\nip = \"{}\"\n", cam_ns.sfu_ip)).unwrap();
        let rtsp = format!("{}:8554", cam_ns.sfu_ip);
        let path = format!("cam={}", camera.url);
        let serve = NetnsServe::start(&tb, &plane, &tmp.0.join("store.db"), &["--config", cfg.to_str().unwrap(), "--rtsp-listen", &rtsp, "--rtsp-path", &path]);
        // The path plays (every track's packets arriving) before the viewers come: what reaches
        // the daemon from now on is counted. A cold machine may take seconds to start the
        // camera's pipeline, so this waits for the packets rather than for a fixed time.
        let started = Instant::now();
        loop {
            let state = serve.api("GET", "/v1/rtsp/paths/cam", None);
            let tracks = state["upstream"]["tracks"].as_array().cloned().unwrap_or_default();
            if state["upstream"]["playing"] == true && !tracks.is_empty() && tracks.iter().all(|t| t["rx_packets"].as_u64().unwrap_or(0) > 0) {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{plane}: the proxied path is not playing: {state}; camera lines: {:?}",
                camera.lines.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let pulls = camera.clients();
        let before = settled_stats(&serve);
        let url = format!("rtsp://{rtsp}/cam");
        let viewers: Vec<Viewer> = (0..VIEWERS).map(|_| Viewer::start_with(tb.command(&view_ns.ns, "ffmpeg"), &url, SECS)).collect();
        let anchor = Viewer::start_with(tb.command(&view_ns.ns, "ffmpeg"), &camera.url, SECS);
        let wait = Duration::from_secs(SECS as u64 + 20);
        let (anchor_frames, _) = anchor.frames(wait);
        let frames: Vec<(u64, String)> = viewers.into_iter().map(|v| v.frames(wait)).collect();
        let after = settled_stats(&serve);
        let delta = |path: &[&str]| {
            let get = |v: &serde_json::Value| path.iter().fold(v, |v, k| &v[*k]).as_u64().unwrap_or(0);
            get(&after) - get(&before)
        };
        eprintln!(
            "{plane}: frames direct {anchor_frames}, through the proxy {:?}; copies {} (kernel-forwarded {}), camera packets in {}",
            frames.iter().map(|f| f.0).collect::<Vec<_>>(),
            delta(&["total", "tx_copies"]),
            delta(&["extra", "forwarded"]),
            delta(&["total", "rx_packets"]),
        );
        assert!(anchor_frames >= (SECS * FPS / 2) as u64, "{plane}: the anchor decoded {anchor_frames} frames: the camera is not working");
        for (f, err) in &frames {
            assert!(*f + 5 >= anchor_frames, "{plane}: a viewer through the proxy decoded {f} frames, the direct one {anchor_frames}; ffmpeg said: {err}");
        }
        // The viewers did not reach the camera: it gained one client, the anchor.
        assert_eq!(camera.clients(), pulls + 1, "{plane}: camera lines: {:?}", camera.lines.lock().unwrap());
        if !common::copies_in_user_space(&plane) {
            // The seed's claim: every camera packet was copied to the viewers by the kernel.
            assert!(delta(&["total", "rx_packets"]) > 0, "{plane}: {after}");
            assert_eq!(
                delta(&["extra", "forwarded"]),
                delta(&["total", "rx_packets"]),
                "{plane}: not every camera packet was forwarded by the kernel: {after}"
            );
        }

        // A TCP viewer (media interleaved on its RTSP connection) beside a UDP one. Its copies
        // go to the proxy's relay socket, a local address the kernel path does not deliver to:
        // on the eBPF planes the path's packets take the slow path while it watches.
        // Compared with an anchor started with them: how many frames a viewer decodes in its
        // seconds depends on where in the camera's GOP it joined.
        let pair = [Viewer::over(tb.command(&view_ns.ns, "ffmpeg"), "tcp", &url, SECS), Viewer::start_with(tb.command(&view_ns.ns, "ffmpeg"), &url, SECS)];
        let anchor = Viewer::start_with(tb.command(&view_ns.ns, "ffmpeg"), &camera.url, SECS);
        let (anchor_frames, _) = anchor.frames(wait);
        for (kind, v) in ["TCP", "UDP"].into_iter().zip(pair) {
            let (f, err) = v.frames(wait);
            let stats = serve.api("GET", "/v1/stats", None);
            eprintln!("{plane}: {kind} viewer beside a TCP one: {f} frames, the direct one {anchor_frames}");
            assert!(
                f + 5 >= anchor_frames,
                "{plane}: a {kind} viewer decoded {f} frames, the direct one {anchor_frames}; ffmpeg said: {err}; proxy: {}; plane: {} {}",
                stats["rtsp"],
                stats["total"],
                stats["extra"]
            );
        }
    }
}

/// A TCP viewer that stops reading (a small receive window, never read) fills its own queue: its
/// media is dropped and counted, and a TCP viewer beside it decodes every frame the anchor does.
/// Closing its connection ends its session.
#[test]
fn a_slow_tcp_viewer_stalls_nobody_else() {
    let _one = one_at_a_time();
    const SECS: u32 = 5;
    let tmp = TempDir::new("rtsp-slow");
    // 3 Mbit/s of video: the stalled viewer's socket buffers and queue fill within seconds.
    let camera = Camera::start_at_rate(Command::new("/usr/bin/python3"), "127.0.0.1", Some(3_000_000));
    let (d, url) = serve(&tmp, &camera, "127.43.0.4");
    let addr: std::net::SocketAddr = url.trim_start_matches("rtsp://").trim_end_matches("/cam").parse().unwrap();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(&addr.into()).unwrap();
    let mut slow: TcpStream = socket.into();
    slow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut session = None;
    let mut cseq = 0;
    let mut ask = |slow: &mut TcpStream, method: &str, uri: String, extra: &str, session: &Option<String>| {
        cseq += 1;
        let s = session.as_ref().map(|s| format!("Session: {s}\r\n")).unwrap_or_default();
        slow.write_all(format!("{method} {uri} RTSP/1.0\r\nCSeq: {cseq}\r\n{s}{extra}\r\n").as_bytes()).unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 1];
        // Byte by byte up to the end of the answer: nothing after it is read.
        loop {
            if let Ok(Some((mediaplane_rtsp::message::Message::Response(r), _))) = mediaplane_rtsp::message::decode(&buf) {
                return r;
            }
            assert_eq!(slow.read(&mut chunk).unwrap(), 1, "the server closed the connection");
            buf.push(chunk[0]);
        }
    };
    for track in 0..2 {
        let r = ask(&mut slow, "SETUP", format!("{url}/trackID={track}"), "Transport: RTP/AVP/TCP;unicast\r\n", &session);
        assert_eq!(r.status, 200, "{r:?}");
        assert!(r.headers.get("Transport").unwrap().contains(&format!("interleaved={}-{}", track * 2, track * 2 + 1)), "{r:?}");
        session = r.headers.session().map(String::from);
    }
    let r = ask(&mut slow, "PLAY", url.clone(), "", &session);
    assert_eq!(r.status, 200, "{r:?}");
    // Long enough for its socket buffers and its queue to fill.
    std::thread::sleep(Duration::from_secs(4));
    let viewer = Viewer::start_tcp(&url, SECS);
    let anchor = Viewer::start(&camera.url, SECS);
    let wait = Duration::from_secs(SECS as u64 + 20);
    let (anchor_frames, _) = anchor.frames(wait);
    let (frames, err) = viewer.frames(wait);
    let (_, stats) = d.call("GET", "/v1/stats", None);
    eprintln!("direct {anchor_frames} frames, TCP viewer beside the stalled one {frames}; {}; camera {}", stats["rtsp"], stats["total"]);
    assert!(frames + 5 >= anchor_frames, "the TCP viewer decoded {frames} frames, the direct one {anchor_frames}: {err}");
    assert!(stats["rtsp"]["tcp_dropped"].as_u64().unwrap() > 0, "the stalled viewer's media was not dropped: {}", stats["rtsp"]);
    assert_eq!(stats["rtsp"]["sessions"], 1, "{}", stats["rtsp"]);

    drop(slow);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, stats) = d.call("GET", "/v1/stats", None);
        if stats["rtsp"]["sessions"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "closing an interleaved session's connection did not end it: {}", stats["rtsp"]);
        std::thread::sleep(Duration::from_millis(100));
    }
    let (_, room) = d.call("GET", "/v1/rooms/rtsp.cam", None);
    let left: Vec<&String> = room["participants"].as_object().unwrap().keys().collect();
    assert_eq!(left, vec!["source-0", "source-1"], "{room}");
}

/// A publisher: ffmpeg (`-f rtsp`) or GStreamer's `rtspclientsink` sending `secs` of H.264 at
/// [`FPS`] (with Opus audio from ffmpeg) to `url` with ANNOUNCE and RECORD, as `user:password`.
fn publish(url: &str, (user, password): (&str, &str), tool: &str, transport: &str, secs: u32) -> Supervised {
    let mut cmd = match tool {
        "ffmpeg" => {
            let mut c = Command::new("ffmpeg");
            c.args(["-nostdin", "-loglevel", "error", "-re", "-f", "lavfi", "-i", &format!("testsrc2=size=320x240:rate={FPS}")])
                .args(["-f", "lavfi", "-i", "sine=f=440:sample_rate=48000", "-t", &secs.to_string()])
                .args(["-c:v", "libx264", "-preset", "ultrafast", "-tune", "zerolatency", "-g", &FPS.to_string(), "-c:a", "libopus"])
                .args(["-rtsp_transport", transport, "-f", "rtsp", &url.replace("rtsp://", &format!("rtsp://{user}:{password}@"))]);
            c
        }
        _ => {
            let mut c = Command::new("gst-launch-1.0");
            let pipeline = format!(
                "videotestsrc is-live=true pattern=ball num-buffers={} ! video/x-raw,width=320,height=240,framerate={FPS}/1 \
                 ! openh264enc gop-size={FPS} ! h264parse config-interval=-1 \
                 ! rtspclientsink protocols={transport} location={url} user-id={user} user-pw={password}",
                secs * FPS,
            );
            c.arg("-q").args(pipeline.split_whitespace());
            c
        }
    };
    cmd.stdout(Stdio::null()).stderr(Stdio::inherit());
    Supervised::spawn(tool, &mut cmd).unwrap_or_else(|e| panic!("{tool} (make deps installs it): {e}"))
}

/// Wait until the path's state says its source plays (or, `playing` false, no longer does).
fn wait_playing(d: &Daemon, path: &str, playing: bool, within: Duration) -> serde_json::Value {
    let deadline = Instant::now() + within;
    loop {
        let (_, state) = d.call("GET", &format!("/v1/rtsp/paths/{path}"), None);
        if state["upstream"]["playing"] == playing {
            return state;
        }
        assert!(Instant::now() < deadline, "path {path} did not turn playing={playing} in {within:?}: {state}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A path published into (`source = "publisher"`): ffmpeg publishes H.264 + Opus with ANNOUNCE
/// and RECORD, over UDP then interleaved on TCP, and GStreamer's rtspclientsink publishes too;
/// ffmpeg viewers over UDP and TCP decode each. Only `publish_users` may publish (401 without),
/// a viewer may not (455 on a path pulled from a camera), and a newer publisher takes the path
/// from the one before (an encoder that restarted).
#[test]
fn publishers_record_into_a_path_and_viewers_watch() {
    let _one = one_at_a_time();
    const SECS: u32 = 4;
    // A viewer starts at the next keyframe (one a second), so it decodes at least the seconds
    // after it; 10% less, for frames a loaded machine drops at the decoder (seen: 81 of 100).
    const ENOUGH: u64 = ((SECS - 1) * FPS * 9 / 10) as u64;
    let tmp = TempDir::new("rtsp-publish");
    let camera = Camera::start();
    let config = format!(
        "[rtsp]\n[[rtsp.paths]]\nname = \"live\"\nsource = \"publisher\"\npublish_users = [\"pub:pw\"]\n[[rtsp.paths]]\nname = \"cam\"\nsource = \"{}\"\n",
        camera.url
    );
    let (d, rtsp) = serve_paths(&tmp, "127.43.0.12", &config, &[]);
    let addr = rtsp.trim_start_matches("rtsp://").to_string();
    let url = format!("{rtsp}/live");
    let with = ("pub", "pw");

    let sdp = "v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=x\r\nt=0 0\r\nm=video 0 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\na=control:streamid=0\r\n";
    let announce =
        |path: &str| format!("ANNOUNCE {rtsp}/{path} RTSP/1.0\r\nCSeq: 1\r\nContent-Type: application/sdp\r\nContent-Length: {}\r\n\r\n{sdp}", sdp.len());
    let anonymous = raw(&addr, announce("live").as_bytes());
    assert!(anonymous.starts_with("RTSP/1.0 401 "), "{anonymous}");
    let onto_a_camera = raw(&addr, announce("cam").as_bytes());
    assert!(onto_a_camera.starts_with("RTSP/1.0 455 "), "{onto_a_camera}");
    let mut wrong = publish(&url, ("pub", "guess"), "ffmpeg", "udp", 2);
    let status = wrong.wait_timeout(Duration::from_secs(20)).unwrap().expect("ffmpeg with wrong credentials gave up");
    assert!(!status.success(), "ffmpeg published with wrong credentials");
    assert_eq!(d.call("GET", "/v1/rtsp/paths/live", None).1["upstream"]["playing"], false);

    for transport in ["udp", "tcp"] {
        let mut publisher = publish(&url, with, "ffmpeg", transport, SECS + 6);
        wait_playing(&d, "live", true, Duration::from_secs(10));
        let viewers = [Viewer::start(&url, SECS), Viewer::start_tcp(&url, SECS)];
        let frames: Vec<(u64, String)> = viewers.into_iter().map(|v| v.frames(Duration::from_secs(25))).collect();
        eprintln!("ffmpeg publishing over {transport}: frames decoded by a UDP and a TCP viewer {:?}", frames.iter().map(|f| f.0).collect::<Vec<_>>());
        for (f, err) in &frames {
            assert!(*f >= ENOUGH, "published over {transport}: a viewer decoded {f} frames; ffmpeg said: {err}");
        }
        let (_, state) = d.call("GET", "/v1/rtsp/paths/live", None);
        let tracks = state["upstream"]["tracks"].as_array().unwrap();
        assert_eq!(tracks.iter().map(|t| t["kind"].as_str().unwrap()).collect::<Vec<_>>(), vec!["video", "audio"], "{state}");
        assert!(tracks.iter().all(|t| t["rx_packets"].as_u64() > Some(0) && t["copies"].as_u64() > Some(0)), "{state}");
        let status = publisher.wait_timeout(Duration::from_secs(20)).unwrap().expect("the publisher did not finish");
        assert!(status.success(), "ffmpeg publishing over {transport} failed: {status}");
        // It sent TEARDOWN: the path goes quiet, its room keeps no source.
        wait_playing(&d, "live", false, Duration::from_secs(3));
        let (_, room) = d.call("GET", "/v1/rooms/rtsp.live", None);
        assert!(room["participants"].as_object().unwrap().is_empty(), "{room}");
    }

    // GStreamer publishes; ffmpeg, started after it, takes the path over.
    let _gst = publish(&url, with, "gst", "udp", 30);
    wait_playing(&d, "live", true, Duration::from_secs(10));
    let (frames, err) = Viewer::start(&url, SECS).frames(Duration::from_secs(25));
    assert!(frames >= ENOUGH, "published by rtspclientsink: {frames} frames; ffmpeg said: {err}");
    let mut newer = publish(&url, with, "ffmpeg", "udp", SECS + 6);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, stats) = d.call("GET", "/v1/stats", None);
        let tracks = d.call("GET", "/v1/rtsp/paths/live", None).1["upstream"]["tracks"].as_array().map_or(0, Vec::len);
        // ffmpeg's has audio too.
        if tracks == 2 {
            assert!(stats["rtsp"]["sessions_ended"].as_u64() >= Some(1), "{}", stats["rtsp"]);
            break;
        }
        assert!(Instant::now() < deadline, "the newer publisher did not take the path: {}", d.call("GET", "/v1/rtsp/paths/live", None).1);
        std::thread::sleep(Duration::from_millis(50));
    }
    let (frames, err) = Viewer::start(&url, SECS).frames(Duration::from_secs(25));
    assert!(frames >= ENOUGH, "from the newer publisher: {frames} frames; ffmpeg said: {err}");
    let metrics = ureq::get(&format!("{}/metrics", d.api)).call().unwrap().into_string().unwrap();
    assert!(metrics.contains("mediaplane_rtsp_sessions_ended_total{reason=\"replaced\"} 1"), "the replaced publisher is counted");
    assert!(newer.wait_timeout(Duration::from_secs(20)).unwrap().is_some_and(|s| s.success()));
}

/// WHEP from a path: a headless Chromium opens the daemon's room page for the path's room
/// (`rtsp.cam`), which subscribes to each of the camera's sources over WHEP, and decodes the
/// camera's H.264 and receives its Opus as the camera sent them (the SFU never decodes; the
/// browser numbers H.264 otherwise than the camera's 96, so its copies are renumbered), beside
/// an ffmpeg viewer over RTSP; then the camera restarts, and the browser is subscribed again to
/// the new sources, renumbered as before. Camera, browser and viewer each in a namespace, on
/// every plane.
///
/// Needs root and chromium; skipped without them, except under CI=true, where that is a failure.
#[test]
fn a_browser_watches_the_camera_over_whep() {
    let _one = one_at_a_time();
    if !mediaplane_bench::require_root("interop_rtsp::a_browser_watches_the_camera_over_whep") {
        return;
    }
    let Some(chromium) = common::browser::chromium("interop_rtsp::a_browser_watches_the_camera_over_whep") else { return };
    const TOKEN: &str = "rtsp-whep-token";
    const API_PORT: u16 = 7586;
    for plane in common::planes() {
        let tb = Testbed::star(2).unwrap();
        let (cam_ns, view_ns) = (&tb.peers[0], &tb.peers[1]);
        let tmp = TempDir::new(&format!("rtsp-whep-{plane}"));
        let camera = Camera::start_with(tb.command(&cam_ns.ns, "/usr/bin/python3"), &cam_ns.ip.to_string());
        let cfg = tmp.0.join("mediaplane.toml");
        std::fs::write(&cfg, format!("[api]\ntoken = \"{TOKEN}\"\n[media]\nip = \"{}\"\n", cam_ns.sfu_ip)).unwrap();
        let rtsp = format!("{}:8554", cam_ns.sfu_ip);
        let path = format!("cam={}", camera.url);
        let store = tmp.0.join("store.db");
        let _serve = NetnsServe::start_on(
            &tb,
            &format!("0.0.0.0:{API_PORT}"),
            &plane,
            &store,
            &["--config", cfg.to_str().unwrap(), "--rtsp-listen", &rtsp, "--rtsp-path", &path],
        );
        let api =
            |method: &str, path: &str| common::netns::try_api_as(&tb, &format!("127.0.0.1:{API_PORT}"), Some(TOKEN), method, path, None).unwrap_or_default();
        let deadline = Instant::now() + Duration::from_secs(10);
        while api("GET", "/v1/rtsp/paths/cam")["upstream"]["playing"] != true {
            assert!(Instant::now() < deadline, "{plane}: the proxy did not pull the camera");
            std::thread::sleep(Duration::from_millis(50));
        }

        let origin = format!("http://{}:{API_PORT}", view_ns.sfu_ip);
        let mut launcher = tb.command(&view_ns.ns, &chromium);
        launcher.arg(format!("--unsafely-treat-insecure-origin-as-secure={origin}"));
        let bdir = tmp.0.join("browser");
        std::fs::create_dir_all(&bdir).unwrap();
        let page = common::browser::Browser::start(launcher, &bdir, &format!("{origin}/?room=rtsp.cam&name=b&join=1&token={TOKEN}"));
        let viewer = Viewer::start_with(tb.command(&view_ns.ns, "ffmpeg"), &format!("rtsp://{rtsp}/cam"), 4);

        // Video flows, then 3 s of it: frames decoded and audio received grow throughout.
        let received = |what: &str, kind: &str| page.page_stats().map(|s| s["received"][what][kind].clone()).unwrap_or_default();
        let deadline = Instant::now() + Duration::from_secs(30);
        while received("source-0", "in_video")["frames_decoded"].as_u64().unwrap_or(0) == 0 {
            assert!(Instant::now() < deadline, "{plane}: the browser decoded nothing of the camera: {}", page.log_tail(40));
            std::thread::sleep(Duration::from_millis(300));
        }
        let (video0, audio0) = (received("source-0", "in_video"), received("source-1", "in_audio"));
        std::thread::sleep(Duration::from_secs(3));
        let (video, audio) = (received("source-0", "in_video"), received("source-1", "in_audio"));
        let grew = |a: &serde_json::Value, b: &serde_json::Value, k: &str| b[k].as_u64().unwrap_or(0).saturating_sub(a[k].as_u64().unwrap_or(0));
        let (frames, packets) = (grew(&video0, &video, "frames_decoded"), grew(&audio0, &audio, "packets"));
        eprintln!("{plane}: the browser decoded {frames} frames of the camera's H.264 in 3 s ({video}); audio packets {packets} ({audio})");
        // 25 fps and 50 audio packets a second; the page reports once a second, so two readings
        // 3 s apart span 2 to 4 s of them (measured: 74-75 frames, 150 packets).
        assert!(frames >= 50, "{plane}: {frames} frames in 3 s: {video}");
        assert!(packets >= 100, "{plane}: {packets} audio packets in 3 s (50 a second): {audio}");
        assert_eq!((video["frame_width"].as_u64(), video["lost"].as_u64()), (Some(320), Some(0)), "{plane}: {video}");

        // The browser's subscription renumbers the camera's H.264 (96) to its own payload type.
        let room = api("GET", "/v1/rooms/rtsp.cam");
        let subs = room["participants"]["b.sees.source-0"]["subscriptions"].as_array().cloned().unwrap_or_default();
        assert!(subs.len() == 1 && subs[0]["payload_type"].as_u64().is_some_and(|pt| pt != 96), "{plane}: {room}");
        let (f, err) = viewer.frames(Duration::from_secs(25));
        assert!(f >= (3 * FPS) as u64, "{plane}: the RTSP viewer beside the browser decoded {f} frames: {err}");

        // The camera restarts (a new process on its port): the proxy pulls it again, and the
        // browser's subscriptions come back with the sources, renumbered as before.
        let port: u16 = camera.url.rsplit(':').next().and_then(|p| p.split('/').next()).and_then(|p| p.parse().ok()).unwrap();
        drop(camera);
        let deadline = Instant::now() + Duration::from_secs(10);
        while api("GET", "/v1/rtsp/paths/cam")["upstream"]["playing"] != false {
            assert!(Instant::now() < deadline, "{plane}: the camera's end was not noticed");
            std::thread::sleep(Duration::from_millis(50));
        }
        let _camera = Camera::start_on(tb.command(&cam_ns.ns, "/usr/bin/python3"), &cam_ns.ip.to_string(), port, None);
        let deadline = Instant::now() + Duration::from_secs(20);
        while api("GET", "/v1/rtsp/paths/cam")["upstream"]["playing"] != true {
            assert!(Instant::now() < deadline, "{plane}: the restarted camera was not pulled again");
            std::thread::sleep(Duration::from_millis(50));
        }
        let room = api("GET", "/v1/rooms/rtsp.cam");
        let again = room["participants"]["b.sees.source-0"]["subscriptions"].as_array().cloned().unwrap_or_default();
        assert_eq!(again.first().map(|c| &c["payload_type"]), subs.first().map(|c| &c["payload_type"]), "{plane}: {room}");
        // Copies of the new stream go to the browser (its only consumer now). Whether Chromium
        // decodes them is its own choice: the new SSRC is not the one its answer announced, and
        // it took it as the section's in some runs and not in others (until the proxy keeps
        // the stream continuous across upstream sessions, issue 43).
        let deadline = Instant::now() + Duration::from_secs(10);
        let copies = || api("GET", "/v1/rtsp/paths/cam")["upstream"]["tracks"][0]["copies"].as_u64().unwrap_or(0);
        while copies() == 0 {
            assert!(Instant::now() < deadline, "{plane}: no copy of the restarted camera to the browser: {}", api("GET", "/v1/rtsp/paths/cam"));
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_secs(3));
        let later = received("source-0", "in_video");
        let decoding = later["ssrc"] != video["ssrc"];
        eprintln!("{plane}: after the camera restarted, {} copies to the browser; it decodes the new stream: {decoding} ({later})", copies());
    }
}

/// Sessions are bounded too: at most `max_sessions_per_client` from one address, here two
/// publishers; a third SETUP is answered 453 (and changes nothing; counted), and once one
/// session is torn down the address may open another.
#[test]
fn sessions_are_bounded_per_client() {
    let _one = one_at_a_time();
    let tmp = TempDir::new("rtsp-sessions");
    let paths: String = (1..=3).map(|i| format!("[[rtsp.paths]]\nname = \"live{i}\"\nsource = \"publisher\"\npublish_users = [\"pub:pw\"]\n")).collect();
    let (d, rtsp) = serve_paths(&tmp, "127.43.0.15", &format!("[rtsp]\nmax_sessions_per_client = 2\n{paths}"), &[]);
    let mut s = TcpStream::connect(rtsp.trim_start_matches("rtsp://")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
    let mut cseq = 0;
    let mut ask = |head: &str, extra: &str, body: &str| {
        cseq += 1;
        let auth = {
            use base64::Engine as _;
            format!("Authorization: Basic {}\r\n", base64::engine::general_purpose::STANDARD.encode("pub:pw"))
        };
        let len = if body.is_empty() { String::new() } else { format!("Content-Type: application/sdp\r\nContent-Length: {}\r\n", body.len()) };
        s.write_all(format!("{head} RTSP/1.0\r\nCSeq: {cseq}\r\n{auth}{extra}{len}\r\n{body}").as_bytes()).unwrap();
        let (mut got, mut b) = (Vec::new(), [0u8; 4096]);
        while !matches!(mediaplane_rtsp::message::decode(&got), Ok(Some(_))) {
            let n = s.read(&mut b).unwrap();
            assert!(n > 0, "closed mid-answer");
            got.extend_from_slice(&b[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    };
    let sdp = "v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=x\r\nt=0 0\r\nm=video 0 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\na=control:streamid=0\r\n";
    let publish = |ask: &mut dyn FnMut(&str, &str, &str) -> String, i: u16| {
        let a = ask(&format!("ANNOUNCE {rtsp}/live{i}"), "", sdp);
        assert!(a.starts_with("RTSP/1.0 200 "), "{a}");
        let transport = format!("Transport: RTP/AVP/UDP;unicast;client_port={}-{};mode=record\r\n", 40000 + 2 * i, 40001 + 2 * i);
        ask(&format!("SETUP {rtsp}/live{i}/streamid=0"), &transport, "")
    };
    let first = publish(&mut ask, 1);
    assert!(first.starts_with("RTSP/1.0 200 "), "{first}");
    assert!(publish(&mut ask, 2).starts_with("RTSP/1.0 200 "));
    let third = publish(&mut ask, 3);
    assert!(third.starts_with("RTSP/1.0 453 ") && third.contains("rtsp.max_sessions_per_client"), "{third}");
    let session = first.lines().find_map(|l| l.strip_prefix("Session: ")).unwrap().split(';').next().unwrap().trim().to_string();
    let a = ask(&format!("TEARDOWN {rtsp}/live1"), &format!("Session: {session}\r\n"), "");
    assert!(a.starts_with("RTSP/1.0 200 "), "{a}");
    let again = publish(&mut ask, 3);
    assert!(again.starts_with("RTSP/1.0 200 "), "a session given back may be opened again: {again}");
    let (_, stats) = d.call("GET", "/v1/stats", None);
    assert_eq!(stats["rtsp"]["sessions_refused"].as_u64(), Some(1), "{}", stats["rtsp"]);
    let mut metrics = ureq::get(&format!("{}/metrics", d.api)).timeout(Duration::from_secs(10));
    if let Some(t) = &d.token {
        metrics = metrics.set("authorization", &format!("Bearer {t}"));
    }
    let text = metrics.call().unwrap().into_string().unwrap();
    assert!(text.contains("mediaplane_rtsp_sessions_refused_total 1"), "{text}");
}

/// Connections are bounded: at most `max_connections_per_client` from one address (the next is
/// closed at once); one that idles without a session is closed after the session timeout, and
/// one trickling a request is closed when the request is not done in time, however many bytes
/// it sends; one whose session lasts stays open while silent. Each closing is counted.
#[test]
fn connections_are_bounded_per_client_and_in_time() {
    let _one = one_at_a_time();
    let tmp = TempDir::new("rtsp-conns");
    let config = "[rtsp]\nsession_timeout_secs = 2\nmax_connections_per_client = 3\n[[rtsp.paths]]\nname = \"live\"\nsource = \"publisher\"\npublish_users = [\"pub:pw\"]\n";
    let (d, rtsp) = serve_paths(&tmp, "127.43.0.13", config, &[]);
    let addr = rtsp.trim_start_matches("rtsp://").to_string();
    let connect = || {
        let s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
        s
    };
    // Closed by the server: a read returns nothing (or the connection was reset), and when.
    let closed_after = |s: &mut TcpStream, since: Instant| {
        let mut b = [0u8; 256];
        let n = s.read(&mut b).unwrap_or(0);
        assert_eq!(n, 0, "the server answered instead of closing: {}", String::from_utf8_lossy(&b[..n]));
        since.elapsed()
    };
    let t0 = Instant::now();
    let mut idle = connect();
    let mut trickling = connect();
    let mut with_session = connect();
    let mut fourth = connect();
    assert!(closed_after(&mut fourth, t0) < Duration::from_secs(1), "a fourth connection from one address was kept");

    let sdp = "v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=x\r\nt=0 0\r\nm=video 0 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\na=control:streamid=0\r\n";
    let ask = |s: &mut TcpStream, req: String| {
        s.write_all(req.as_bytes()).unwrap();
        let mut got = Vec::new();
        let mut b = [0u8; 4096];
        while !matches!(mediaplane_rtsp::message::decode(&got), Ok(Some(_))) {
            let n = s.read(&mut b).unwrap();
            assert!(n > 0, "closed mid-answer");
            got.extend_from_slice(&b[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    };
    let url = format!("{rtsp}/live");
    let auth = {
        use base64::Engine as _;
        format!("Authorization: Basic {}\r\n", base64::engine::general_purpose::STANDARD.encode("pub:pw"))
    };
    let announce = format!("ANNOUNCE {url} RTSP/1.0\r\nCSeq: 1\r\n{auth}Content-Type: application/sdp\r\nContent-Length: {}\r\n\r\n{sdp}", sdp.len());
    let a = ask(&mut with_session, announce);
    assert!(a.starts_with("RTSP/1.0 200 "), "{a}");
    let setup = format!("SETUP {url}/streamid=0 RTSP/1.0\r\nCSeq: 2\r\n{auth}Transport: RTP/AVP/UDP;unicast;client_port=40000-40001;mode=record\r\n\r\n");
    let a = ask(&mut with_session, setup);
    assert!(a.starts_with("RTSP/1.0 200 "), "{a}");

    let t1 = Instant::now();
    trickling.write_all(b"OPTIONS ").unwrap();
    let writer = {
        let mut w = trickling.try_clone().unwrap();
        std::thread::spawn(move || {
            for _ in 0..16 {
                std::thread::sleep(Duration::from_millis(250));
                if w.write_all(b"x").is_err() {
                    return;
                }
            }
        })
    };
    let idled = closed_after(&mut idle, t0);
    let trickled = closed_after(&mut trickling, t1);
    writer.join().unwrap();
    eprintln!("closed: silent after {idled:?}, trickling after {trickled:?}");
    assert!(idled >= Duration::from_millis(1900) && idled < Duration::from_secs(4), "a silent connection without a session: {idled:?}");
    assert!(trickled >= Duration::from_millis(1900) && trickled < Duration::from_secs(4), "a request trickled for {trickled:?}");

    // The publisher's connection idled as long, and is still served; and the closed ones were
    // given back: a new connection is admitted.
    std::thread::sleep(Duration::from_secs(1));
    let a = ask(&mut with_session, format!("OPTIONS {url} RTSP/1.0\r\nCSeq: 3\r\n\r\n"));
    assert!(a.starts_with("RTSP/1.0 200 "), "{a}");
    let a = ask(&mut connect(), format!("OPTIONS {url} RTSP/1.0\r\nCSeq: 1\r\n\r\n"));
    assert!(a.starts_with("RTSP/1.0 200 "), "{a}");
    let (_, stats) = d.call("GET", "/v1/stats", None);
    assert_eq!((stats["rtsp"]["connections_refused"].as_u64(), stats["rtsp"]["connections_timed_out"].as_u64()), (Some(1), Some(2)), "{}", stats["rtsp"]);
}
