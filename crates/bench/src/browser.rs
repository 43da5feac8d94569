//! Headless Chromium for the WebRTC demo and tests: finding it, starting it on a page (fake
//! camera and microphone, host candidates as addresses), reading what the room page logs, and a
//! screenshot through the DevTools protocol.

use anyhow::{bail, Context};
use base64::Engine as _;
use serde_json::Value;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The browser's binary, if there is one.
pub fn find_chromium() -> Option<String> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| Command::new("which").arg(b).stdout(Stdio::null()).status().is_ok_and(|s| s.success()))
        .map(String::from)
}

/// A headless Chromium showing one page, killed on drop with every process it started (a
/// process group of its own); its output goes to `chromium.log`.
pub struct Browser {
    child: Child,
    log: PathBuf,
}

impl Browser {
    /// Run `launcher` (the browser's binary, or `ip netns exec NS <binary>`, with any flags of
    /// its own) on `page`, with a fresh profile in `dir`.
    pub fn start(mut launcher: Command, dir: &Path, page: &str) -> Browser {
        let log = dir.join("chromium.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = launcher
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                // The machine has no network beyond the tests' own: nothing of Google's.
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--use-fake-device-for-media-stream",
                "--use-fake-ui-for-media-stream",
                // Host candidates on loopback too, as IP addresses (not mDNS names).
                "--allow-loopback-in-peer-connection",
                "--disable-features=WebRtcHideLocalIpsWithMdns",
                // The page's console lines in the log (what the room page's stats are read from).
                "--enable-logging=stderr",
                "--v=0",
                &format!("--user-data-dir={}", dir.join("chromium-profile").display()),
                page,
            ])
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("start chromium");
        Browser { child, log }
    }

    /// The last `lines` lines the browser printed.
    pub fn log_tail(&self, lines: usize) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = s.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The room page's newest `mediaplane-stats {json}` console line.
    pub fn page_stats(&self) -> Option<Value> {
        let log = self.log_tail(400);
        let line = log.lines().rev().find_map(|l| l.split_once("mediaplane-stats ").map(|(_, r)| r))?;
        // Chromium quotes the message: `"mediaplane-stats {...}", source: … (line)`.
        let json = line.rsplit_once("\", source:").map_or(line, |(j, _)| j);
        serde_json::from_str(json).ok()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // SAFETY: a plain syscall; the group is the child's own (process_group(0) above).
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// A PNG of the page of a browser started with `--remote-debugging-port=<port>`, taken through
/// the DevTools protocol (`Page.captureScreenshot`) from the calling thread's network namespace.
pub fn screenshot(port: u16, out: &Path) -> anyhow::Result<()> {
    let list: Value = ureq::get(&format!("http://127.0.0.1:{port}/json/list")).timeout(Duration::from_secs(5)).call()?.into_json()?;
    let page = list.as_array().and_then(|l| l.iter().find(|t| t["type"] == "page")).context("no page target")?;
    let url = page["webSocketDebuggerUrl"].as_str().context("no DevTools URL")?;
    let (mut ws, _) = tungstenite::connect(url).context("DevTools WebSocket")?;
    let ask = serde_json::json!({"id": 1, "method": "Page.captureScreenshot", "params": {"format": "png"}});
    ws.send(tungstenite::Message::text(ask.to_string()))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let tungstenite::Message::Text(text) = ws.read()? else { continue };
        let v: Value = serde_json::from_str(&text)?;
        if v["id"] == 1 {
            let data = v["result"]["data"].as_str().with_context(|| format!("no screenshot in {}", &text[..text.len().min(200)]))?;
            std::fs::write(out, base64::engine::general_purpose::STANDARD.decode(data)?)?;
            return Ok(());
        }
    }
    bail!("no screenshot within 10 s")
}
