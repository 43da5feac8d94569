//! Headless Chromium for the WebRTC interop tests ([`mediaplane_bench::browser`]), and the small
//! HTTP server a test's own page talks to.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

#[allow(unused_imports)] // not every test that includes `common` starts a browser
pub use mediaplane_bench::browser::Browser;

/// The browser's binary; None (after saying why) when there is none, a panic under CI=true,
/// where interop tests must run.
pub fn chromium(test: &str) -> Option<String> {
    let found = mediaplane_bench::browser::find_chromium();
    if found.is_none() {
        if mediaplane_bench::in_ci() {
            panic!("{test}: chromium is missing, and CI=true: interop tests must run in CI");
        }
        eprintln!("{test}: skipped: no chromium");
    }
    found
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
