//! The demo's WebRTC scenario: headless Chromium participants open the daemon's room page, each
//! in a network namespace of its own, publish their fake camera and microphone over WHIP and
//! receive each other over WHEP. Per data plane it prints what each one sent and decoded (from
//! the page's getStats) and saves a screenshot of the first participant's page.

use crate::conference::ServeProcess;
use anyhow::{bail, Context};
use mediaplane_bench::browser::{screenshot, Browser};
use mediaplane_bench::netns::Testbed;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const API_PORT: u16 = 7590;
const DEVTOOLS_PORT: u16 = 9229;

/// What one data plane's run showed.
pub struct WebrtcRun {
    pub dataplane: String,
    /// Per participant: its last stats line.
    pub pages: Vec<(String, Value)>,
    pub screenshot: Option<PathBuf>,
    /// Every participant decoded every other one.
    pub all_decoded: bool,
}

/// Frames a participant decoded of each other one (0 when it receives nothing of it yet).
fn decoded(stats: &Value, from: &str) -> u64 {
    stats["received"][from]["in_video"]["frames_decoded"].as_u64().unwrap_or(0)
}

pub fn run(tb: &Testbed, dataplane: &str, participants: usize, seconds: f64, chromium: &str, out_dir: &Path) -> anyhow::Result<WebrtcRun> {
    if tb.peers.len() < participants {
        bail!("the WebRTC scenario needs {participants} namespaces, the testbed has {}", tb.peers.len());
    }
    let token = mediaplane_webrtc::random_hex(16);
    let work = out_dir.join(format!("webrtc-{dataplane}"));
    std::fs::create_dir_all(&work)?;
    let config = work.join("serve.toml");
    // The pages load from every link's SFU address: the API is not on loopback, so it takes a token.
    std::fs::write(&config, format!("[api]\ntoken = \"{token}\"\n[media]\nip = \"{}\"\n", tb.peers[0].sfu_ip))?;
    let listen = format!("0.0.0.0:{API_PORT}");
    let mut serve = ServeProcess::start_with(tb, dataplane, &work.join("store.db"), work.join("serve.log"), &listen, &["-c", config.to_str().unwrap()])?;
    let health = format!("http://127.0.0.1:{API_PORT}/health");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (url, auth) = (health.clone(), format!("Bearer {token}"));
        if tb.in_ns(&tb.sfu_ns, move || ureq::get(&url).set("Authorization", &auth).timeout(Duration::from_secs(2)).call().is_ok())? {
            break;
        }
        if let Some(why) = serve.exited()? {
            bail!("serve exited at start ({why})");
        }
        if Instant::now() > deadline {
            bail!("serve did not answer within 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }

    let names: Vec<String> = (0..participants).map(|i| format!("p{i}")).collect();
    let browsers: Vec<Browser> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let dir = work.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            let origin = format!("http://{}:{API_PORT}", tb.peers[i].sfu_ip);
            let mut launcher = tb.command(&tb.peers[i].ns, chromium);
            // A camera needs a secure context: this origin is trusted as one (no TLS here).
            launcher.arg(format!("--unsafely-treat-insecure-origin-as-secure={origin}")).arg("--window-size=1280,800");
            if i == 0 {
                launcher.arg(format!("--remote-debugging-port={DEVTOOLS_PORT}"));
            }
            Browser::start(launcher, &dir, &format!("{origin}/?room=demo&name={name}&join=1&token={token}"))
        })
        .collect();

    // Everyone decodes everyone (up to 30 s), then `seconds` of the call.
    let all_decoded = |pages: &[Option<Value>]| {
        pages.iter().enumerate().all(|(i, p)| p.as_ref().is_some_and(|p| names.iter().filter(|n| **n != names[i]).all(|n| decoded(p, n) > 0)))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut ok = false;
    while Instant::now() < deadline {
        let pages: Vec<Option<Value>> = browsers.iter().map(Browser::page_stats).collect();
        if all_decoded(&pages) {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let pages: Vec<(String, Value)> = names.iter().cloned().zip(browsers.iter().map(|b| b.page_stats().unwrap_or_default())).collect();
    let shot = work.join("room-page.png");
    let took = tb.in_ns(&tb.peers[0].ns, || screenshot(DEVTOOLS_PORT, &shot))?;
    let screenshot = match took {
        Ok(()) => Some(shot),
        Err(e) => {
            println!("  screenshot failed: {e:#}");
            None
        }
    };
    drop(browsers);
    serve.stop().context("stopping serve")?;
    // Only the logs and the screenshot stay: browser profiles are tens of megabytes.
    for name in &names {
        let _ = std::fs::remove_dir_all(work.join(name).join("chromium-profile"));
    }
    Ok(WebrtcRun {
        dataplane: dataplane.to_string(),
        all_decoded: ok && all_decoded(&pages.iter().map(|(_, v)| Some(v.clone())).collect::<Vec<_>>()),
        pages,
        screenshot,
    })
}

/// One line per participant and what it received.
pub fn print(r: &WebrtcRun) {
    println!("\n[{}] WebRTC room: {} browsers, WHIP to publish, WHEP to receive", r.dataplane, r.pages.len());
    for (name, s) in &r.pages {
        let sent = &s["sent"];
        println!(
            "  {name}: sent video {} packets ({} kbit/s, {} frames encoded), audio {} packets; DTLS {}, {}",
            sent["out_video"]["packets"],
            sent["out_video"]["kbps"],
            sent["out_video"]["frames_encoded"],
            sent["out_audio"]["packets"],
            sent["dtls"].as_str().unwrap_or("-"),
            sent["srtp_cipher"].as_str().unwrap_or("-")
        );
        for (from, got) in s["received"].as_object().into_iter().flatten() {
            println!(
                "    from {from}: video {} frames decoded, {} packets, {} lost, {} kbit/s; audio {} packets, {} lost",
                got["in_video"]["frames_decoded"],
                got["in_video"]["packets"],
                got["in_video"]["lost"],
                got["in_video"]["kbps"],
                got["in_audio"]["packets"],
                got["in_audio"]["lost"]
            );
        }
    }
    match &r.screenshot {
        Some(p) => println!("  screenshot of {}'s page: {}", r.pages.first().map_or("", |(n, _)| n.as_str()), p.display()),
        None => println!("  no screenshot"),
    }
}
