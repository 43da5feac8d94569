//! DTLS-SRTP against an independent peer: OpenSSL's own `s_server` and `s_client` in DTLS 1.2
//! mode, over real UDP sockets on loopback. Each side prints the keying material it exported
//! (RFC 5764 §4.2); the SRTP keys mediaplane derived must be exactly its halves, for every
//! profile, whichever side mediaplane plays. A peer whose certificate does not match the SDP's
//! fingerprint, or which offers no SRTP profile, must not yield keys.
//!
//! Needs the `openssl` program (Debian `openssl`, installed by `make deps`): skipped without it,
//! a failure under CI=true.

use mediaplane_core::srtp::SrtpSuite;
use mediaplane_webrtc::dtls::{DtlsContext, DtlsSession, Fingerprint, Progress, Role, SrtpKeys};
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(15);

fn openssl_ready(test: &str) -> bool {
    let found = Command::new("openssl").arg("version").stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    // Under CI (`CI` set to anything but empty, 0, false or no), as mediaplane_bench::in_ci.
    let in_ci = std::env::var("CI").is_ok_and(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false" | "no"));
    if !found && in_ci {
        panic!("{test}: the openssl program is missing under CI=true (make deps installs it)");
    }
    if !found {
        eprintln!("SKIPPED {test}: the openssl program is not installed (apt-get install openssl)");
    }
    found
}

/// A per-run directory with the OpenSSL peer's certificate and key; removed on drop.
struct PeerFiles {
    dir: PathBuf,
}

impl PeerFiles {
    fn new(tag: &str) -> PeerFiles {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let dir = std::env::temp_dir().join(format!("mediaplane-dtls-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = PeerFiles { dir };
        let ok = Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=openssl-peer"])
            .arg("-keyout")
            .arg(files.key())
            .arg("-out")
            .arg(files.cert())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(ok.success(), "openssl req made no certificate");
        files
    }

    fn cert(&self) -> PathBuf {
        self.dir.join("cert.pem")
    }

    fn key(&self) -> PathBuf {
        self.dir.join("key.pem")
    }

    /// What the peer's SDP would carry: its certificate's SHA-256 fingerprint.
    fn fingerprint(&self) -> Fingerprint {
        let cert = openssl::x509::X509::from_pem(&std::fs::read(self.cert()).unwrap()).unwrap();
        Fingerprint::of(&cert, "sha-256").unwrap()
    }
}

impl Drop for PeerFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An `openssl s_server`/`s_client` run: its stdout lines, its stdin held open (closing it
/// ends the program), killed by PID on drop.
struct Peer {
    child: Child,
    _stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Peer {
    fn spawn(args: &[String]) -> Peer {
        let mut child = Command::new("openssl").args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("openssl starts");
        let (tx, lines) = mpsc::channel();
        for out in [Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>, Box::new(child.stderr.take().unwrap())] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        let stdin = child.stdin.take().unwrap();
        Peer { child, _stdin: stdin, lines, seen: Vec::new() }
    }

    /// The rest of the first line starting with `prefix` (after trimming), waiting up to `wait`.
    fn line_after(&mut self, prefix: &str, wait: Duration) -> Option<String> {
        if let Some(l) = self.seen.iter().find_map(|l| l.trim().strip_prefix(prefix)) {
            return Some(l.trim().to_string());
        }
        let until = Instant::now() + wait;
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            let line = self.lines.recv_timeout(left).ok()?;
            let found = line.trim().strip_prefix(prefix).map(|l| l.trim().to_string());
            self.seen.push(line);
            if found.is_some() {
                return found;
            }
        }
        None
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Drive `session` over `sock` until it connects, fails or the deadline passes. `peer`: where
/// to send (a client knows; a server learns it from the first datagram).
fn handshake(session: &mut DtlsSession, sock: &UdpSocket, mut peer: Option<SocketAddr>) -> Result<SrtpKeys, String> {
    let until = Instant::now() + DEADLINE;
    sock.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let mut buf = [0u8; 4096];
    let flush = |session: &mut DtlsSession, peer: Option<SocketAddr>| {
        while let Some(p) = peer {
            let Some(d) = session.poll_output() else { break };
            sock.send_to(&d, p).unwrap();
        }
    };
    while Instant::now() < until {
        flush(session, peer);
        match sock.recv_from(&mut buf) {
            Ok((n, from)) => {
                peer = Some(from);
                let progress = session.on_datagram(&buf[..n]);
                // A server's last flight (ChangeCipherSpec, Finished) leaves with the keys.
                flush(session, peer);
                match progress {
                    Progress::Connected(keys) => return Ok(keys),
                    Progress::Closed(why) => return Err(why),
                    Progress::Pending => {}
                }
            }
            Err(_) => session.on_timer(),
        }
    }
    Err(format!("no handshake within {DEADLINE:?}"))
}

fn profile_name(suite: SrtpSuite) -> &'static str {
    match suite {
        SrtpSuite::AeadAes128Gcm => "SRTP_AEAD_AES_128_GCM",
        SrtpSuite::AeadAes256Gcm => "SRTP_AEAD_AES_256_GCM",
        SrtpSuite::AesCm128HmacSha1_80 => "SRTP_AES128_CM_SHA1_80",
        SrtpSuite::AesCm128HmacSha1_32 => "SRTP_AES128_CM_SHA1_32",
        // SDES-only here: the DTLS side offers the four profiles above.
        other => unreachable!("{} is not a DTLS-SRTP profile mediaplane offers", other.name()),
    }
}

const SUITES: [SrtpSuite; 4] = [SrtpSuite::AeadAes128Gcm, SrtpSuite::AeadAes256Gcm, SrtpSuite::AesCm128HmacSha1_80, SrtpSuite::AesCm128HmacSha1_32];

/// The common arguments of one run: DTLS 1.2, the profile, the exporter, the peer's identity.
fn peer_args(files: &PeerFiles, suite: Option<SrtpSuite>) -> Vec<String> {
    let mut a: Vec<String> = ["-dtls1_2", "-keymatexport", "EXTRACTOR-dtls_srtp", "-keymatexportlen"].map(String::from).into();
    a.push(suite.map_or(60, |s| 2 * s.master_len()).to_string());
    if let Some(s) = suite {
        a.extend(["-use_srtp".to_string(), profile_name(s).to_string()]);
    }
    a.extend(["-cert".to_string(), files.cert().display().to_string(), "-key".to_string(), files.key().display().to_string()]);
    a
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// RFC 5764 §4.2: client key, server key, client salt, server salt → (client, server) masters.
fn split(material: &[u8], suite: SrtpSuite) -> (Vec<u8>, Vec<u8>) {
    let s = if suite.is_aead() { 12 } else { 14 };
    let k = suite.master_len() - s;
    assert_eq!(material.len(), 2 * (k + s));
    ([&material[..k], &material[2 * k..2 * k + s]].concat(), [&material[k..2 * k], &material[2 * k + s..]].concat())
}

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn start_server(files: &PeerFiles, suite: Option<SrtpSuite>) -> (Peer, SocketAddr) {
    let at: SocketAddr = format!("127.0.0.1:{}", free_udp_port()).parse().unwrap();
    let mut args: Vec<String> = vec!["s_server".into(), "-accept".into(), at.to_string(), "-naccept".into(), "1".into(), "-verify".into(), "1".into()];
    args.extend(peer_args(files, suite));
    let mut server = Peer::spawn(&args);
    assert!(server.line_after("ACCEPT", DEADLINE).is_some(), "s_server did not start: {:?}", server.seen);
    (server, at)
}

#[test]
fn mediaplane_as_dtls_client_exports_what_openssl_s_server_exports() {
    if !openssl_ready("mediaplane_as_dtls_client_exports_what_openssl_s_server_exports") {
        return;
    }
    let files = PeerFiles::new("client");
    let ours = DtlsContext::generate().unwrap();
    for suite in SUITES {
        let (mut server, at) = start_server(&files, Some(suite));
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut session = ours.session(Role::Client, files.fingerprint()).unwrap();
        let keys = handshake(&mut session, &sock, Some(at)).unwrap_or_else(|e| panic!("{suite:?}: {e}; s_server said {:?}", server.seen));
        let material = server.line_after("Keying material:", DEADLINE).unwrap_or_else(|| panic!("{suite:?}: s_server exported nothing: {:?}", server.seen));
        assert!(server.seen.iter().any(|l| l.contains(&format!("profile={}", profile_name(suite)))), "{suite:?}: {:?}", server.seen);
        let (client, srv) = split(&unhex(&material), suite);
        assert_eq!(keys.outbound.suite, suite);
        assert_eq!(keys.outbound.master, client, "{suite:?}: the client protects with the client half");
        assert_eq!(keys.inbound.master, srv, "{suite:?}: and unprotects with the server half");
    }
}

#[test]
fn mediaplane_as_dtls_server_exports_what_openssl_s_client_exports() {
    if !openssl_ready("mediaplane_as_dtls_server_exports_what_openssl_s_client_exports") {
        return;
    }
    let files = PeerFiles::new("server");
    let ours = DtlsContext::generate().unwrap();
    for suite in SUITES {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut args: Vec<String> = vec!["s_client".into(), "-connect".into(), sock.local_addr().unwrap().to_string()];
        args.extend(peer_args(&files, Some(suite)));
        let mut client = Peer::spawn(&args);
        let mut session = ours.session(Role::Server, files.fingerprint()).unwrap();
        let keys = handshake(&mut session, &sock, None).unwrap_or_else(|e| panic!("{suite:?}: {e}; s_client said {:?}", client.seen));
        let material = client.line_after("Keying material:", DEADLINE).unwrap_or_else(|| panic!("{suite:?}: s_client exported nothing: {:?}", client.seen));
        let (cl, srv) = split(&unhex(&material), suite);
        assert_eq!(keys.inbound.suite, suite);
        assert_eq!(keys.inbound.master, cl, "{suite:?}: the server unprotects with the client half");
        assert_eq!(keys.outbound.master, srv, "{suite:?}: and protects with the server half");
    }
}

#[test]
fn a_peer_with_another_certificate_or_without_srtp_yields_no_keys() {
    if !openssl_ready("a_peer_with_another_certificate_or_without_srtp_yields_no_keys") {
        return;
    }
    let (files, stranger) = (PeerFiles::new("peer"), PeerFiles::new("stranger"));
    let ours = DtlsContext::generate().unwrap();

    // The SDP named another certificate than the one the peer presents.
    let (_server, at) = start_server(&files, Some(SrtpSuite::AeadAes128Gcm));
    let mut session = ours.session(Role::Client, stranger.fingerprint()).unwrap();
    let err = handshake(&mut session, &UdpSocket::bind("127.0.0.1:0").unwrap(), Some(at)).unwrap_err();
    assert!(err.contains("fingerprint"), "{err}");

    // DTLS without use_srtp: the handshake itself completes, but there is nothing to key SRTP.
    let (_server, at) = start_server(&files, None);
    let mut session = ours.session(Role::Client, files.fingerprint()).unwrap();
    let err = handshake(&mut session, &UdpSocket::bind("127.0.0.1:0").unwrap(), Some(at)).unwrap_err();
    assert!(err.contains("no SRTP profile"), "{err}");
}
