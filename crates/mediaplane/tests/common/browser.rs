//! Headless Chromium for the WebRTC interop tests: finding it, starting it on a page (fake
//! microphone, host candidates as addresses), and the small HTTP server its page talks to.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The browser's binary; None (after saying why) when there is none, a panic under CI=true,
/// where interop tests must run.
pub fn chromium(test: &str) -> Option<String> {
    let found = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| Command::new("which").arg(b).stdout(Stdio::null()).status().is_ok_and(|s| s.success()))
        .map(String::from);
    if found.is_none() {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{test}: chromium is missing, and CI=true: interop tests must run in CI");
        }
        eprintln!("{test}: skipped: no chromium");
    }
    found
}

/// A headless Chromium showing one page, killed on drop with every process it started (a
/// process group of its own); its output goes to `chromium.log`.
pub struct Browser {
    child: Child,
    log: PathBuf,
}

impl Browser {
    /// Run `launcher` (the browser's binary, or `ip netns exec NS <binary>`) on `page`, with a
    /// fresh profile in `dir`.
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
                // The page's console lines in the log (what the room test reads its stats from).
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
}

impl Drop for Browser {
    fn drop(&mut self) {
        // SAFETY: a plain syscall; the group is the child's own (process_group(0) above).
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// A request to the page's server.
pub struct Request {
    pub method: String,
    pub path: String,
    pub body: String,
}

/// Serve `listener` until the test binary ends: `handle` answers each request with (status,
/// content type, body). Every connection has a thread of its own: Chromium opens connections
/// ahead of its requests (preconnect) and may leave one idle, which would stall a serial
/// server's other requests for the whole read timeout.
pub fn serve(listener: TcpListener, handle: impl Fn(&Request) -> (u16, &'static str, Vec<u8>) + Send + Sync + 'static) {
    let handle = std::sync::Arc::new(handle);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let handle = handle.clone();
            std::thread::spawn(move || {
                let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                let Some(request) = read_request(&mut conn) else { return };
                let (status, ctype, reply) = handle(&request);
                let reason = if status == 200 { "OK" } else { "Not Found" };
                let _ = write!(conn, "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", reply.len());
                let _ = conn.write_all(&reply);
            });
        }
    });
}

fn read_request(conn: &mut TcpStream) -> Option<Request> {
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
    Some(Request { method, path, body: String::from_utf8_lossy(&body).into_owned() })
}
