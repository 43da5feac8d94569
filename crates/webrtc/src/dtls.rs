//! DTLS-SRTP (RFC 5763/5764) with OpenSSL: one certificate per process (ECDSA P-256, made at
//! start, its SHA-256 fingerprint in every SDP), one DTLS 1.2 session per leg, the peer's
//! certificate checked against the fingerprint its SDP gave, and the SRTP master keys exported
//! when the handshake is done.
//!
//! Sans-I/O in the quinn-proto way: datagrams go in ([`DtlsSession::on_datagram`]), the ones
//! to send come out ([`DtlsSession::poll_output`]); OpenSSL works on an in-memory channel.

use mediaplane_core::srtp::{SrtpKey, SrtpSuite};
use openssl::asn1::Asn1Time;
use openssl::bn::{BigNum, MsbOption};
use openssl::ec::{EcGroup, EcKey};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use openssl::ssl::{ErrorCode, Ssl, SslContext, SslContextBuilder, SslMethod, SslOptions, SslStream, SslVerifyMode, SslVersion};
use openssl::x509::{X509NameBuilder, X509Ref, X509};
use std::collections::VecDeque;
use std::io::{self, Read, Write};

/// The largest datagram a handshake flight is cut into: under any path MTU a media relay meets.
const DTLS_MTU: u32 = 1200;
/// The SRTP profiles offered in use_srtp (RFC 5764 §4.1.2, RFC 7714 §14.2), preferred first:
/// AES-GCM (one pass, cheaper than AES-CM + HMAC with AES-NI), 128 before 256 (a peer that
/// offers only AES-256-GCM, as some gateways do, still gets it).
const SRTP_PROFILES: &str = "SRTP_AEAD_AES_128_GCM:SRTP_AEAD_AES_256_GCM:SRTP_AES128_CM_SHA1_80:SRTP_AES128_CM_SHA1_32";
/// RFC 5764 §4.2.
const EXPORTER_LABEL: &str = "EXTRACTOR-dtls_srtp";

#[derive(Debug, thiserror::Error)]
pub enum DtlsError {
    #[error("OpenSSL: {0}")]
    OpenSsl(#[from] openssl::error::ErrorStack),
    #[error("handshake failed: {0}")]
    Handshake(String),
    #[error("the peer's certificate does not match the fingerprint of its SDP")]
    FingerprintMismatch,
    #[error("the peer sent no certificate")]
    NoCertificate,
    #[error("no SRTP profile agreed (the peer offered none of {SRTP_PROFILES})")]
    NoSrtpProfile,
    #[error("unsupported fingerprint {0:?}")]
    BadFingerprint(String),
    #[error("stored certificate not taken: {0}")]
    Identity(String),
}

/// A certificate fingerprint as `a=fingerprint` carries it (RFC 8122 §5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// `sha-256`, `sha-1`, `sha-384` or `sha-512` (lower case).
    pub algorithm: String,
    pub bytes: Vec<u8>,
}

impl Fingerprint {
    /// Parse `sha-256 AB:CD:…` (the hash function's name in any case).
    pub fn parse(value: &str) -> Result<Fingerprint, DtlsError> {
        let bad = || DtlsError::BadFingerprint(value.to_string());
        let (alg, hex) = value.trim().split_once(' ').ok_or_else(bad)?;
        let algorithm = alg.to_ascii_lowercase();
        digest_of(&algorithm).ok_or_else(bad)?;
        let bytes = hex.trim().split(':').map(|b| u8::from_str_radix(b, 16).map_err(|_| bad())).collect::<Result<Vec<u8>, _>>()?;
        if bytes.len() != digest_of(&algorithm).map_or(0, |d| d.size()) {
            return Err(bad());
        }
        Ok(Fingerprint { algorithm, bytes })
    }

    pub fn of(cert: &X509Ref, algorithm: &str) -> Result<Fingerprint, DtlsError> {
        let md = digest_of(algorithm).ok_or_else(|| DtlsError::BadFingerprint(algorithm.to_string()))?;
        Ok(Fingerprint { algorithm: algorithm.to_string(), bytes: cert.digest(md)?.to_vec() })
    }

    /// The `a=fingerprint` value.
    pub fn to_sdp(&self) -> String {
        let hex: Vec<String> = self.bytes.iter().map(|b| format!("{b:02X}")).collect();
        format!("{} {}", self.algorithm, hex.join(":"))
    }
}

fn digest_of(algorithm: &str) -> Option<MessageDigest> {
    match algorithm {
        "sha-1" => Some(MessageDigest::sha1()),
        "sha-256" => Some(MessageDigest::sha256()),
        "sha-384" => Some(MessageDigest::sha384()),
        "sha-512" => Some(MessageDigest::sha512()),
        _ => None,
    }
}

/// The process's certificate and the DTLS context built on it (shared by every session).
#[derive(Clone)]
pub struct DtlsContext {
    ctx: SslContext,
    fingerprint: Fingerprint,
    key: PKey<Private>,
    cert: X509,
}

/// How long a new certificate is valid (as browsers make theirs).
const CERTIFICATE_DAYS: u32 = 30;

/// A certificate with fewer days left than this is not taken again ([`DtlsContext::from_pem`]):
/// a new one is made, so a restart never keeps one that expires while the daemon runs on.
pub const RENEW_DAYS_BEFORE_EXPIRY: u32 = 7;

impl DtlsContext {
    /// A fresh self-signed ECDSA P-256 certificate (what browsers make for themselves too),
    /// valid for 30 days from now, and a DTLS 1.2 context offering the SRTP profiles.
    pub fn generate() -> Result<DtlsContext, DtlsError> {
        Self::offering(SRTP_PROFILES)
    }

    /// [`DtlsContext::generate`] offering these SRTP profiles (OpenSSL's names, `:`-separated).
    pub fn offering(profiles: &str) -> Result<DtlsContext, DtlsError> {
        let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
        let key = PKey::from_ec_key(EcKey::generate(&group)?)?;
        let cert = self_signed(&key, CERTIFICATE_DAYS)?;
        Self::with_identity(key, cert, profiles)
    }

    /// The context of a certificate made earlier ([`DtlsContext::to_pem`]: its private key and
    /// certificate), so that a restarted relay keeps the fingerprint its peers' SDP knows.
    /// Refused when the two do not match or the certificate has fewer than
    /// [`RENEW_DAYS_BEFORE_EXPIRY`] days left.
    pub fn from_pem(pem: &str) -> Result<DtlsContext, DtlsError> {
        let key = PKey::private_key_from_pem(pem.as_bytes())?;
        let cert = X509::from_pem(pem.as_bytes())?;
        if !cert.public_key()?.public_eq(&key) {
            return Err(DtlsError::Identity("the certificate is not the private key's".into()));
        }
        if cert.not_after() < Asn1Time::days_from_now(RENEW_DAYS_BEFORE_EXPIRY)? {
            return Err(DtlsError::Identity(format!("the certificate expires within {RENEW_DAYS_BEFORE_EXPIRY} days ({})", cert.not_after())));
        }
        Self::with_identity(key, cert, SRTP_PROFILES)
    }

    /// The private key and the certificate, PEM, for [`DtlsContext::from_pem`].
    pub fn to_pem(&self) -> Result<String, DtlsError> {
        let key = self.key.private_key_to_pem_pkcs8()?;
        let cert = self.cert.to_pem()?;
        Ok(format!("{}{}", String::from_utf8_lossy(&key), String::from_utf8_lossy(&cert)))
    }

    fn with_identity(key: PKey<Private>, cert: X509, profiles: &str) -> Result<DtlsContext, DtlsError> {
        let fingerprint = Fingerprint::of(&cert, "sha-256")?;
        let mut b = SslContextBuilder::new(SslMethod::dtls())?;
        b.set_min_proto_version(Some(SslVersion::DTLS1_2))?;
        b.set_certificate(&cert)?;
        b.set_private_key(&key)?;
        b.check_private_key()?;
        b.set_tlsext_use_srtp(profiles)?;
        // Peers' certificates are self-signed: OpenSSL asks for one and accepts it; what makes
        // it trusted is its fingerprint matching the SDP's, checked after the handshake.
        b.set_verify_callback(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT, |_, _| true);
        // The in-memory channel has no MTU to ask; the session sets it.
        b.set_options(SslOptions::NO_QUERY_MTU);
        Ok(DtlsContext { ctx: b.build(), fingerprint, key, cert })
    }

    /// The certificate's SHA-256 fingerprint, for `a=fingerprint`.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// A session for one leg: `role` as `a=setup` decided, `remote` the fingerprint of the
    /// peer's SDP. A client sends its first flight at once (see [`DtlsSession::poll_output`]).
    pub fn session(&self, role: Role, remote: Fingerprint) -> Result<DtlsSession, DtlsError> {
        let mut ssl = Ssl::new(&self.ctx)?;
        ssl.set_mtu(DTLS_MTU)?;
        match role {
            Role::Server => ssl.set_accept_state(),
            Role::Client => ssl.set_connect_state(),
        }
        let stream = SslStream::new(ssl, Channel::default())?;
        let mut s = DtlsSession { stream, role, remote, state: State::Handshaking };
        if role == Role::Client {
            s.drive();
        }
        Ok(s)
    }
}

fn self_signed(key: &PKey<Private>, days: u32) -> Result<X509, openssl::error::ErrorStack> {
    let mut name = X509NameBuilder::new()?;
    name.append_entry_by_nid(Nid::COMMONNAME, "mediaplane")?;
    let name = name.build();
    let mut serial = BigNum::new()?;
    serial.rand(63, MsbOption::MAYBE_ZERO, false)?;
    let mut b = X509::builder()?;
    b.set_version(2)?;
    let serial = serial.to_asn1_integer()?;
    b.set_serial_number(&serial)?;
    b.set_subject_name(&name)?;
    b.set_issuer_name(&name)?;
    // A day back: a peer whose clock is a little behind still takes it.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    let (from, until) = (Asn1Time::from_unix(now - 86_400)?, Asn1Time::days_from_now(days)?);
    b.set_not_before(&from)?;
    b.set_not_after(&until)?;
    b.set_pubkey(key)?;
    b.sign(key, MessageDigest::sha256())?;
    Ok(b.build())
}

/// Which end of the handshake the relay is (RFC 5763 §5: `a=setup:passive` is the server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Server,
    Client,
}

/// The two SRTP master keys a handshake yields, seen from the relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SrtpKeys {
    /// What the peer protects its packets with (the relay unprotects with it).
    pub inbound: SrtpKey,
    /// What the relay protects its packets to the peer with.
    pub outbound: SrtpKey,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Handshaking,
    Connected,
    /// The handshake failed or the peer closed: nothing more is read or sent.
    Closed(String),
}

/// What one datagram did to a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Still handshaking (or connected and nothing new).
    Pending,
    /// The handshake just completed: the keys are ready.
    Connected(SrtpKeys),
    /// It failed or closed now.
    Closed(String),
}

/// Datagrams between OpenSSL and the relay's sockets: one read is one datagram, one write is
/// one datagram (OpenSSL writes a flight's records datagram by datagram with the MTU set).
#[derive(Default)]
struct Channel {
    incoming: VecDeque<Vec<u8>>,
    outgoing: VecDeque<Vec<u8>>,
}

impl Read for Channel {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.incoming.pop_front() {
            Some(d) => {
                let n = d.len().min(buf.len());
                buf[..n].copy_from_slice(&d[..n]);
                Ok(n)
            }
            None => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

impl Write for Channel {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.outgoing.push_back(buf.to_vec());
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The DTLS session of one leg.
pub struct DtlsSession {
    stream: SslStream<Channel>,
    role: Role,
    remote: Fingerprint,
    state: State,
}

impl std::fmt::Debug for DtlsSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DtlsSession").field("role", &self.role).field("state", &self.state).finish()
    }
}

impl DtlsSession {
    pub fn state(&self) -> &State {
        &self.state
    }

    /// A datagram that demultiplexed as DTLS (first byte 20..=63, RFC 7983) from the peer.
    pub fn on_datagram(&mut self, datagram: &[u8]) -> Progress {
        if matches!(self.state, State::Closed(_)) {
            return Progress::Pending;
        }
        self.stream.get_mut().incoming.push_back(datagram.to_vec());
        self.drive()
    }

    /// The next datagram to send the peer, if any.
    pub fn poll_output(&mut self) -> Option<Vec<u8>> {
        self.stream.get_mut().outgoing.pop_front()
    }

    /// Retransmit the last flight if its timer ran out (the peer's lost datagrams); call it
    /// every few hundred milliseconds while handshaking. A server mostly needs none: a client
    /// resends its flight, and OpenSSL answers a repeated flight with its own.
    pub fn on_timer(&mut self) {
        if self.state == State::Handshaking {
            // DTLS_CTRL_HANDLE_TIMEOUT: OpenSSL retransmits only when its own timer expired.
            // SAFETY: the pointer is the live SSL of this session's stream.
            unsafe {
                openssl_sys::SSL_ctrl(foreign_types::ForeignTypeRef::as_ptr(self.stream.ssl()), 74, 0, std::ptr::null_mut());
            }
        }
    }

    fn drive(&mut self) -> Progress {
        match self.state {
            State::Handshaking => match self.stream.do_handshake() {
                Ok(()) => match self.finish() {
                    Ok(keys) => {
                        self.state = State::Connected;
                        Progress::Connected(keys)
                    }
                    Err(e) => self.close(e.to_string()),
                },
                Err(e) if e.code() == ErrorCode::WANT_READ || e.code() == ErrorCode::WANT_WRITE => Progress::Pending,
                Err(e) => self.close(format!("handshake failed: {e}")),
            },
            State::Connected => {
                // WebRTC sends no application data over DTLS without SCTP; read what came
                // (an alert) to see a close.
                let mut buf = [0u8; 2048];
                match self.stream.ssl_read(&mut buf) {
                    Ok(_) => Progress::Pending,
                    Err(e) if e.code() == ErrorCode::ZERO_RETURN => self.close("the peer closed DTLS".into()),
                    Err(_) => Progress::Pending,
                }
            }
            State::Closed(_) => Progress::Pending,
        }
    }

    fn close(&mut self, why: String) -> Progress {
        self.state = State::Closed(why.clone());
        Progress::Closed(why)
    }

    fn finish(&mut self) -> Result<SrtpKeys, DtlsError> {
        let ssl = self.stream.ssl();
        let cert = ssl.peer_certificate().ok_or(DtlsError::NoCertificate)?;
        if Fingerprint::of(&cert, &self.remote.algorithm)? != self.remote {
            return Err(DtlsError::FingerprintMismatch);
        }
        let suite = match ssl.selected_srtp_profile().map(|p| p.name().to_string()).as_deref() {
            Some("SRTP_AEAD_AES_128_GCM") => SrtpSuite::AeadAes128Gcm,
            Some("SRTP_AEAD_AES_256_GCM") => SrtpSuite::AeadAes256Gcm,
            Some("SRTP_AES128_CM_SHA1_80") => SrtpSuite::AesCm128HmacSha1_80,
            Some("SRTP_AES128_CM_SHA1_32") => SrtpSuite::AesCm128HmacSha1_32,
            _ => return Err(DtlsError::NoSrtpProfile),
        };
        // RFC 5764 §4.2: client key, server key, client salt, server salt (RFC 7714: 12-byte salts).
        let s = if suite.is_aead() { 12 } else { 14 };
        let k = suite.master_len() - s;
        let mut material = vec![0u8; 2 * (k + s)];
        ssl.export_keying_material(&mut material, EXPORTER_LABEL, None)?;
        let client = [&material[..k], &material[2 * k..2 * k + s]].concat();
        let server = [&material[k..2 * k], &material[2 * k + s..]].concat();
        let key = |m: Vec<u8>| SrtpKey::new(suite, m).map_err(DtlsError::Handshake);
        let (inbound, outbound) = match self.role {
            Role::Server => (key(client)?, key(server)?),
            Role::Client => (key(server)?, key(client)?),
        };
        Ok(SrtpKeys { inbound, outbound })
    }
}

/// Whether a datagram is DTLS by its first byte (RFC 7983 §7: 20..=63).
pub fn is_dtls(datagram: &[u8]) -> bool {
    matches!(datagram.first(), Some(20..=63))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Move every pending datagram between the two sessions until neither has more.
    fn pump(a: &mut DtlsSession, b: &mut DtlsSession) -> (Vec<Progress>, Vec<Progress>) {
        let (mut pa, mut pb) = (Vec::new(), Vec::new());
        for _ in 0..20 {
            let mut moved = false;
            while let Some(d) = a.poll_output() {
                assert!(is_dtls(&d));
                pb.push(b.on_datagram(&d));
                moved = true;
            }
            while let Some(d) = b.poll_output() {
                pa.push(a.on_datagram(&d));
                moved = true;
            }
            if !moved {
                break;
            }
        }
        (pa, pb)
    }

    fn connected(p: &[Progress]) -> Option<SrtpKeys> {
        p.iter().find_map(|x| match x {
            Progress::Connected(k) => Some(k.clone()),
            _ => None,
        })
    }

    #[test]
    fn two_sessions_agree_on_mirrored_srtp_keys() {
        let (relay, peer) = (DtlsContext::generate().unwrap(), DtlsContext::generate().unwrap());
        let mut server = relay.session(Role::Server, peer.fingerprint().clone()).unwrap();
        let mut client = peer.session(Role::Client, relay.fingerprint().clone()).unwrap();
        let (pc, ps) = pump(&mut client, &mut server);
        let (kc, ks) = (connected(&pc).expect("client connected"), connected(&ps).expect("server connected"));
        assert_eq!(kc.outbound, ks.inbound, "what the client sends with, the server reads with");
        assert_eq!(kc.inbound, ks.outbound);
        assert_ne!(ks.inbound, ks.outbound);
        assert_eq!(ks.inbound.suite, SrtpSuite::AeadAes128Gcm, "AES-GCM first when both offer it");
        assert_eq!(ks.inbound.master.len(), 28, "RFC 7714: a 16-byte key and a 12-byte salt");
        assert_eq!((server.state(), client.state()), (&State::Connected, &State::Connected));
    }

    /// A peer offering only AES-256-GCM gets it: 32-byte keys, 12-byte salts, mirrored; and the
    /// SRTP it protects, the relay's side unprotects.
    #[test]
    fn a_peer_offering_only_aes_256_gcm_is_keyed_with_it() {
        let (relay, peer) = (DtlsContext::generate().unwrap(), DtlsContext::offering("SRTP_AEAD_AES_256_GCM").unwrap());
        let mut server = relay.session(Role::Server, peer.fingerprint().clone()).unwrap();
        let mut client = peer.session(Role::Client, relay.fingerprint().clone()).unwrap();
        let (pc, ps) = pump(&mut client, &mut server);
        let (kc, ks) = (connected(&pc).expect("client connected"), connected(&ps).expect("server connected"));
        assert_eq!((ks.inbound.suite, ks.inbound.master.len()), (SrtpSuite::AeadAes256Gcm, 44));
        assert_eq!((kc.outbound.clone(), kc.inbound.clone()), (ks.inbound.clone(), ks.outbound.clone()));
        // The halves are the exporter's: the client's key is not the server's.
        assert_ne!(ks.inbound.master[..32], ks.outbound.master[..32]);
    }

    /// A context made again from its PEM has the same fingerprint and handshakes with a peer
    /// that knows only that fingerprint; a key that is not the certificate's, a certificate near
    /// its end, and garbage are refused.
    #[test]
    fn a_certificate_kept_as_pem_is_the_same_certificate() {
        let first = DtlsContext::generate().unwrap();
        let pem = first.to_pem().unwrap();
        let again = DtlsContext::from_pem(&pem).unwrap();
        assert_eq!(again.fingerprint(), first.fingerprint());
        let peer = DtlsContext::generate().unwrap();
        let mut server = again.session(Role::Server, peer.fingerprint().clone()).unwrap();
        let mut client = peer.session(Role::Client, first.fingerprint().clone()).unwrap();
        let (pc, _) = pump(&mut client, &mut server);
        assert!(connected(&pc).is_some(), "the peer took the restored certificate for the signalled one");

        let other = DtlsContext::generate().unwrap().to_pem().unwrap();
        let other_key = &other[..other.find("-----BEGIN CERTIFICATE").unwrap()];
        let own_cert = &pem[pem.find("-----BEGIN CERTIFICATE").unwrap()..];
        assert!(matches!(DtlsContext::from_pem(&format!("{other_key}{own_cert}")), Err(DtlsError::Identity(_))));

        let key = PKey::from_ec_key(EcKey::generate(&EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap()).unwrap()).unwrap();
        let ending = DtlsContext::with_identity(key.clone(), self_signed(&key, RENEW_DAYS_BEFORE_EXPIRY - 1).unwrap(), SRTP_PROFILES).unwrap();
        assert!(matches!(DtlsContext::from_pem(&ending.to_pem().unwrap()), Err(DtlsError::Identity(e)) if e.contains("expires")));
        assert!(DtlsContext::from_pem("not a certificate").is_err());
    }

    #[test]
    fn a_certificate_that_is_not_the_signalled_one_is_refused() {
        let (relay, peer, other) = (DtlsContext::generate().unwrap(), DtlsContext::generate().unwrap(), DtlsContext::generate().unwrap());
        let mut server = relay.session(Role::Server, other.fingerprint().clone()).unwrap();
        let mut client = peer.session(Role::Client, relay.fingerprint().clone()).unwrap();
        let (_, ps) = pump(&mut client, &mut server);
        assert!(connected(&ps).is_none());
        assert!(matches!(server.state(), State::Closed(why) if why.contains("fingerprint")), "{:?}", server.state());
    }

    #[test]
    fn fingerprints_parse_and_print_as_sdp_has_them() {
        let c = DtlsContext::generate().unwrap();
        let sdp = c.fingerprint().to_sdp();
        assert!(sdp.starts_with("sha-256 ") && sdp.len() == 8 + 32 * 3 - 1, "{sdp}");
        assert_eq!(Fingerprint::parse(&sdp).unwrap(), *c.fingerprint());
        assert_eq!(Fingerprint::parse(&sdp.replace("sha-256", "SHA-256")).unwrap(), *c.fingerprint());
        for bad in ["sha-256", "md5 AB:CD", "sha-256 AB:CD", "sha-1 ZZ:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00"] {
            assert!(Fingerprint::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn garbage_closes_a_handshake_and_closed_sessions_ignore_more() {
        let relay = DtlsContext::generate().unwrap();
        let peer = DtlsContext::generate().unwrap();
        let mut server = relay.session(Role::Server, peer.fingerprint().clone()).unwrap();
        // A DTLS record header claiming a handshake, with nonsense inside.
        let mut junk = vec![22, 0xfe, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8];
        junk.extend_from_slice(&[0xff; 8]);
        let p = server.on_datagram(&junk);
        // A handshake record that cannot be parsed ends the session (with an alert to the
        // sender); from then on datagrams do nothing.
        assert!(matches!(&p, Progress::Closed(why) if why.contains("handshake failed")), "{p:?}");
        while server.poll_output().is_some() {}
        let client = peer.session(Role::Client, relay.fingerprint().clone());
        let hello = client.unwrap().poll_output().unwrap();
        assert_eq!(server.on_datagram(&hello), Progress::Pending);
        assert!(server.poll_output().is_none());
    }
}
