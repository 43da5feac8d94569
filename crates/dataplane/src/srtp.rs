//! SRTP on relay legs, with libsrtp: one session per stream, direction and key, kept across
//! table updates (its rollover counters and replay windows must outlive them), replaced when
//! the key changes (a re-INVITE with new keys starts a new session, as RFC 4568 §7.1.4 says).
//!
//! Packets are unprotected once on arrival and protected once per copy; failures are dropped
//! and counted process-wide (see [`failures`]).

use mediaplane_core::rtp::{self, MediaKind};
use mediaplane_core::srtp::{Protection, SrtpKey, SrtpSuite};
use mediaplane_core::table::StreamEntry;
use mediaplane_core::ForwardingTable;
use parking_lot::Mutex;
use srtp::{CryptoPolicy, Session, StreamPolicy};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Why a packet of an SRTP leg was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SrtpDrop {
    /// The leg speaks SRTP but its key is not negotiated yet (e.g. before the answer).
    NoKey,
    /// Authentication failed: not from the holder of the key, or altered.
    Auth,
    /// A replay, or older than the replay window.
    Replay,
    /// Neither RTP nor RTCP, or libsrtp refused it otherwise (e.g. too short).
    Invalid,
}

static NO_KEY: AtomicU64 = AtomicU64::new(0);
static AUTH: AtomicU64 = AtomicU64::new(0);
static REPLAY: AtomicU64 = AtomicU64::new(0);
static INVALID: AtomicU64 = AtomicU64::new(0);
static PROTECT_FAILED: AtomicU64 = AtomicU64::new(0);

impl SrtpDrop {
    fn count(self) {
        let c = match self {
            SrtpDrop::NoKey => &NO_KEY,
            SrtpDrop::Auth => &AUTH,
            SrtpDrop::Replay => &REPLAY,
            SrtpDrop::Invalid => &INVALID,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn of(e: srtp::Error) -> SrtpDrop {
        match e {
            srtp::Error::AUTH_FAIL => SrtpDrop::Auth,
            srtp::Error::REPLAY_FAIL | srtp::Error::REPLAY_OLD => SrtpDrop::Replay,
            _ => SrtpDrop::Invalid,
        }
    }
}

/// Process-wide SRTP failure counts, as `DataplaneStats.extra` names them: packets dropped
/// on arrival (no key yet, failed authentication, replays, invalid) and copies not sent
/// because protecting them failed.
pub fn failures() -> [(&'static str, u64); 5] {
    [
        ("srtp_no_key", NO_KEY.load(Ordering::Relaxed)),
        ("srtp_auth_failed", AUTH.load(Ordering::Relaxed)),
        ("srtp_replayed", REPLAY.load(Ordering::Relaxed)),
        ("srtp_invalid", INVALID.load(Ordering::Relaxed)),
        ("srtp_protect_failed", PROTECT_FAILED.load(Ordering::Relaxed)),
    ]
}

fn policy(suite: SrtpSuite) -> (CryptoPolicy, CryptoPolicy) {
    match suite {
        // RFC 4568 §6.2: SRTCP is always authenticated with the 80-bit tag.
        SrtpSuite::AesCm128HmacSha1_80 => (CryptoPolicy::aes_cm_128_hmac_sha1_80(), CryptoPolicy::aes_cm_128_hmac_sha1_80()),
        SrtpSuite::AesCm128HmacSha1_32 => (CryptoPolicy::aes_cm_128_hmac_sha1_32(), CryptoPolicy::aes_cm_128_hmac_sha1_80()),
        // RFC 7714: SRTP and SRTCP both AEAD with a 16-byte tag.
        SrtpSuite::AeadAes128Gcm => (CryptoPolicy::aes_gcm_128_16_auth(), CryptoPolicy::aes_gcm_128_16_auth()),
        SrtpSuite::AeadAes256Gcm => (CryptoPolicy::aes_gcm_256_16_auth(), CryptoPolicy::aes_gcm_256_16_auth()),
        // RFC 6188 §4: as their 128-bit siblings, SRTCP with the 80-bit tag.
        SrtpSuite::Aes192CmHmacSha1_80 => (CryptoPolicy::aes_cm_192_hmac_sha1_80(), CryptoPolicy::aes_cm_192_hmac_sha1_80()),
        SrtpSuite::Aes192CmHmacSha1_32 => (CryptoPolicy::aes_cm_192_hmac_sha1_32(), CryptoPolicy::aes_cm_192_hmac_sha1_80()),
        SrtpSuite::Aes256CmHmacSha1_80 => (CryptoPolicy::aes_cm_256_hmac_sha1_80(), CryptoPolicy::aes_cm_256_hmac_sha1_80()),
        SrtpSuite::Aes256CmHmacSha1_32 => (CryptoPolicy::aes_cm_256_hmac_sha1_32(), CryptoPolicy::aes_cm_256_hmac_sha1_80()),
    }
}

/// One libsrtp session: every SSRC a leg's peer sends (inbound) or the relay sends it
/// (outbound), RTP and RTCP.
pub struct Context {
    key: SrtpKey,
    session: Mutex<Session>,
}

/// The suite only: keys stay out of debug output (as [`SrtpKey`]'s own Debug does).
impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("key", &self.key).finish_non_exhaustive()
    }
}

impl Context {
    pub fn new(key: &SrtpKey, outbound: bool) -> Result<Context, String> {
        let (rtp, rtcp) = policy(key.suite);
        // A copy sent again (a consumer's NACK answered from the send history) is protected
        // again with its sequence number: libsrtp refuses that unless told (the same packet, so
        // the same keystream over the same bytes).
        let p = StreamPolicy { rtp, rtcp, key: &key.master, allow_repeat_tx: outbound, ..Default::default() };
        let session = if outbound { Session::with_outbound_template(p) } else { Session::with_inbound_template(p) };
        let session = session.map_err(|e| format!("libsrtp refused a {} session: {e}", key.suite.name()))?;
        Ok(Context { key: key.clone(), session: Mutex::new(session) })
    }

    /// Turn the SRTP or SRTCP packet in `buf` into RTP or RTCP.
    pub fn unprotect(&self, buf: &mut Vec<u8>) -> Result<(), SrtpDrop> {
        let r = match rtp::demux(buf) {
            MediaKind::Rtp => self.session.lock().unprotect(buf),
            MediaKind::Rtcp => self.session.lock().unprotect_rtcp(buf),
            _ => return Err(SrtpDrop::Invalid),
        };
        r.map_err(SrtpDrop::of)
    }

    /// Turn the RTP or RTCP packet in `buf` into SRTP or SRTCP.
    pub fn protect(&self, buf: &mut Vec<u8>) -> Result<(), srtp::Error> {
        match rtp::demux(buf) {
            MediaKind::Rtcp => self.session.lock().protect_rtcp(buf),
            MediaKind::Rtp => self.session.lock().protect(buf),
            // A plain leg may relay any UDP (it checks RTP only when asked). libsrtp would seal
            // some of it (it does not check the RTP version), but no SRTP receiver demultiplexes
            // that back as media: refuse it here (found by fuzz/fuzz_targets/srtp_input.rs).
            _ => Err(srtp::Error::BAD_PARAM),
        }
    }
}

/// Unprotect `payload` with the stream's inbound context: the clear packet, or why it is dropped
/// (counted).
pub fn unprotect(ctx: Option<&Arc<Context>>, payload: &[u8]) -> Result<Vec<u8>, SrtpDrop> {
    let r = match ctx {
        None => Err(SrtpDrop::NoKey),
        Some(c) => {
            let mut buf = payload.to_vec();
            c.unprotect(&mut buf).map(|_| buf)
        }
    };
    if let Err(d) = r {
        d.count();
    }
    r
}

/// Protect a copy of `clear` with `ctx`; None (counted) when there is no key yet or it fails.
pub fn protect(ctx: Option<&Arc<Context>>, clear: &[u8]) -> Option<Vec<u8>> {
    let Some(c) = ctx else {
        NO_KEY.fetch_add(1, Ordering::Relaxed);
        return None;
    };
    let mut buf = Vec::with_capacity(clear.len() + srtp::sys::SRTP_MAX_TRAILER_LEN as usize);
    buf.extend_from_slice(clear);
    match c.protect(&mut buf) {
        Ok(()) => Some(buf),
        Err(_) => {
            PROTECT_FAILED.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// Which context: what arrives at an SFU address (`outbound` false), or what the SFU sends
/// from it. One libsrtp session per address and direction, whatever the streams: an address is
/// one relay leg or one participant's transport (a WebRTC BUNDLE carries every SSRC of its DTLS
/// association, RTP and RTCP, each with its own index in the one session).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SrtpSlot {
    pub local: SocketAddr,
    pub outbound: bool,
}

/// The contexts a table needs, looked up without locks by the workers (a snapshot swapped with
/// the table): each with the number of table entries that use it.
#[derive(Clone, Default)]
pub struct Contexts(imbl::HashMap<SrtpSlot, (Arc<Context>, u32)>);

impl Contexts {
    /// The context of `slot`, if it holds `key` (the one the table names).
    pub fn get(&self, slot: SrtpSlot, key: Option<&SrtpKey>) -> Option<&Arc<Context>> {
        self.0.get(&slot).map(|(c, _)| c).filter(|c| Some(&c.key) == key)
    }

    /// The context of `slot`, whatever its key (for a packet decided with the table these
    /// contexts were made for, whose keys they hold).
    pub fn slot(&self, slot: SrtpSlot) -> Option<&Arc<Context>> {
        self.0.get(&slot).map(|(c, _)| c)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The contexts for `table`, keeping every one of `self` whose slot and key are unchanged
    /// (its rollover counters and replay windows live on). `changed`: only the entries at these
    /// keys differ from the table `self` was made for.
    pub fn update(&self, old: &ForwardingTable, table: &ForwardingTable, changed: Option<&[mediaplane_core::IngressKey]>) -> Contexts {
        let mut next = match changed {
            Some(_) => self.0.clone(),
            None => imbl::HashMap::new(),
        };
        let add = |next: &mut imbl::HashMap<SrtpSlot, (Arc<Context>, u32)>, e: &StreamEntry| {
            for (slot, key) in slots(e) {
                if let Some((_, users)) = next.get_mut(&slot).filter(|(c, _)| c.key == *key) {
                    *users += 1;
                    continue;
                }
                let users = next.get(&slot).map_or(0, |(_, u)| *u) + 1;
                let kept = self.0.get(&slot).map(|(c, _)| c).filter(|c| c.key == *key).cloned();
                let ctx = match kept {
                    Some(c) => c,
                    None => match Context::new(key, slot.outbound) {
                        Ok(c) => Arc::new(c),
                        Err(error) => {
                            // Its packets are then dropped as having no key, and counted.
                            tracing::error!(stream = %e.label, %error, "no SRTP context");
                            continue;
                        }
                    },
                };
                next.insert(slot, (ctx, users));
            }
        };
        match changed {
            Some(keys) => {
                // Every user of a changed entry's slots lets go first, so a re-keyed address
                // keeps its count while its context is replaced.
                for k in keys {
                    for (slot, _) in old.streams.get(k).into_iter().flat_map(slots) {
                        if let Some((_, users)) = next.get_mut(&slot) {
                            *users -= 1;
                        }
                    }
                }
                for k in keys {
                    if let Some(e) = table.streams.get(k) {
                        add(&mut next, e);
                    }
                }
            }
            None => table.streams.values().filter(|e| e.has_srtp()).for_each(|e| add(&mut next, e)),
        }
        // Feedback needs contexts of its own: a consumer's SRTCP is unprotected at its address,
        // and what is routed on is protected from the publisher's. A participant that only
        // subscribes has no stream entry at its address, so its feedback entry keeps that
        // context (counted apart from the entries' users: recomputed from the table each time).
        let feedback = feedback_slots(table);
        next.retain(|slot, (c, users)| *users > 0 || feedback.get(slot).is_some_and(|k| **k == c.key));
        for (slot, key) in feedback {
            if next.contains_key(&slot) {
                continue;
            }
            let kept = self.0.get(&slot).map(|(c, _)| c).filter(|c| c.key == *key).cloned();
            match kept.map_or_else(|| Context::new(key, slot.outbound).map(Arc::new), Ok) {
                Ok(ctx) => {
                    next.insert(slot, (ctx, 0));
                }
                Err(error) => tracing::error!(%error, local = %slot.local, "no SRTP context for feedback"),
            }
        }
        Contexts(next)
    }
}

/// The contexts the table's feedback uses: each consumer address's inbound one, and the outbound
/// one of each publisher address its feedback is routed from.
fn feedback_slots(table: &ForwardingTable) -> std::collections::HashMap<SrtpSlot, &SrtpKey> {
    let mut out = std::collections::HashMap::new();
    for fb in table.feedback.values() {
        if let Protection::Srtp(Some(k)) = &fb.inbound {
            out.insert(SrtpSlot { local: fb.local, outbound: false }, k);
        }
        for r in &fb.routes {
            if let Protection::Srtp(Some(k)) = &r.outbound {
                out.insert(SrtpSlot { local: r.from, outbound: true }, k);
            }
        }
    }
    out
}

/// Every context an entry uses, once each: its address's inbound one, the outbound one toward
/// its source (feedback, keyframe requests), and each protected copy's sender address's (its
/// RTCP's too, when that leaves from another address).
fn slots(e: &StreamEntry) -> Vec<(SrtpSlot, &SrtpKey)> {
    let mut out: Vec<(SrtpSlot, &SrtpKey)> = Vec::new();
    let at = |local, outbound| SrtpSlot { local, outbound };
    let copies = e.copies.iter().flat_map(|c| std::iter::once(c.from).chain(c.rtcp.map(|(from, _)| from)).map(move |from| (at(from, true), &c.outbound)));
    let all = [(at(e.key.local, false), &e.inbound), (at(e.key.local, true), &e.reverse)].into_iter().chain(copies);
    for (slot, p) in all {
        if let Protection::Srtp(Some(k)) = p {
            if !out.iter().any(|(s, _)| *s == slot) {
                out.push((slot, k));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use mediaplane_core::rtp::build_rtp;

    fn key(byte: u8, suite: SrtpSuite) -> SrtpKey {
        SrtpKey::new(suite, (0..30).map(|i| byte.wrapping_add(i)).collect()).unwrap()
    }

    /// An RTCP receiver report with one report block, then an SDES packet (a real compound).
    fn rtcp_rr(ssrc: u32) -> Vec<u8> {
        let mut p = vec![0x81, 201, 0, 7];
        p.extend_from_slice(&ssrc.to_be_bytes());
        p.extend_from_slice(&[0; 24]);
        p.extend_from_slice(&[0x81, 202, 0, 2]);
        p.extend_from_slice(&ssrc.to_be_bytes());
        p.extend_from_slice(&[1, 2, b'm', b'p']);
        p
    }

    #[test]
    fn what_one_side_protects_the_other_unprotects_rtp_and_rtcp() {
        for suite in SrtpSuite::ALL {
            let k = SrtpKey::new(suite, (1..=suite.master_len() as u8).collect()).unwrap();
            let (tx, rx) = (Arc::new(Context::new(&k, true).unwrap()), Arc::new(Context::new(&k, false).unwrap()));
            for clear in [build_rtp(0, 100, 160, 0x1234, &[9; 160]), rtcp_rr(0x1234), build_rtp(0, 101, 320, 0x1234, &[8; 160])] {
                let sealed = protect(Some(&tx), &clear).unwrap();
                assert_ne!(sealed, clear, "{suite:?}: protected");
                assert_eq!(&sealed[..8], &clear[..8], "headers stay readable");
                let rtcp = rtp::demux(&clear) == MediaKind::Rtcp;
                let tag = match suite {
                    SrtpSuite::AeadAes128Gcm | SrtpSuite::AeadAes256Gcm => 16 + if rtcp { 4 } else { 0 },
                    _ if rtcp => 4 + 10,
                    SrtpSuite::AesCm128HmacSha1_32 | SrtpSuite::Aes192CmHmacSha1_32 | SrtpSuite::Aes256CmHmacSha1_32 => 4,
                    _ => 10,
                };
                assert_eq!(sealed.len(), clear.len() + tag, "{suite:?}: the suite's tag (and SRTCP's index)");
                assert_eq!(unprotect(Some(&rx), &sealed).unwrap(), clear);
            }
            // What no receiver would take as SRTP (not version 2) is not sealed either.
            assert!(protect(Some(&tx), &[0; 12]).is_none(), "{suite:?}: not RTP");
        }
    }

    #[test]
    fn wrong_keys_altered_packets_and_replays_are_refused_and_told_apart() {
        let k = key(1, SrtpSuite::AesCm128HmacSha1_80);
        let tx = Context::new(&k, true).unwrap();
        let rx = Context::new(&k, false).unwrap();
        let stranger = Context::new(&key(2, SrtpSuite::AesCm128HmacSha1_80), false).unwrap();
        let mut sealed = build_rtp(0, 7, 0, 42, &[5; 20]);
        tx.protect(&mut sealed).unwrap();
        assert_eq!(stranger.unprotect(&mut sealed.clone()), Err(SrtpDrop::Auth));
        let mut altered = sealed.clone();
        altered[14] ^= 1;
        assert_eq!(rx.unprotect(&mut altered), Err(SrtpDrop::Auth));
        rx.unprotect(&mut sealed.clone()).unwrap();
        assert_eq!(rx.unprotect(&mut sealed.clone()), Err(SrtpDrop::Replay));
        assert_eq!(rx.unprotect(&mut vec![1, 2, 3]), Err(SrtpDrop::Invalid));
        assert_eq!(unprotect(None, &sealed), Err(SrtpDrop::NoKey));
        assert!(protect(None, &sealed).is_none());
    }

    fn entry(id: u32, inbound: Protection, outbound: Protection) -> StreamEntry {
        let a = |s: &str| s.parse().unwrap();
        StreamEntry {
            id,
            label: format!("relay:r/{id}"),
            key: mediaplane_core::IngressKey { local: a(&format!("127.0.0.1:{}", 20000 + id)), ssrc: None },
            source: mediaplane_core::SourceRule::Any,
            rtp: true,
            copies: vec![mediaplane_core::Copy {
                subscriber: "s".into(),
                from: a("127.0.0.1:30000"),
                to: a("127.0.0.2:30000"),
                outbound,
                consumer: 0,
                layer: None,
                max_layer: None,
                auto_layer: true,
                temporal_layer: None,
                payload_type: None,
                rtcp: None,
            }],
            rate: None,
            record: false,
            inbound,
            clock_rate: 0,
            evaluate_rtcp: false,
            simulcast: None,
            handshake: false,
            stream_ids: None,
            publisher_feedback: None,
            reverse: Protection::Clear,
            control: Default::default(),
            dtmf: Vec::new(),
        }
    }

    fn table(entries: Vec<StreamEntry>) -> ForwardingTable {
        ForwardingTable { streams: entries.into_iter().map(|e| (e.key, e)).collect(), ..Default::default() }
    }

    #[test]
    fn contexts_survive_updates_that_keep_their_key_and_are_replaced_or_dropped_otherwise() {
        let (k1, k2) = (key(1, SrtpSuite::AesCm128HmacSha1_80), key(9, SrtpSuite::AesCm128HmacSha1_32));
        let srtp = |k: &SrtpKey| Protection::Srtp(Some(k.clone()));
        let t1 =
            table(vec![entry(1, srtp(&k1), Protection::Clear), entry(2, Protection::Clear, srtp(&k2)), entry(3, Protection::Srtp(None), Protection::Clear)]);
        let c1 = Contexts::default().update(&ForwardingTable::default(), &t1, None);
        assert_eq!(c1.len(), 2, "no context without a key");
        let inbound = SrtpSlot { local: "127.0.0.1:20001".parse().unwrap(), outbound: false };
        let outbound = SrtpSlot { local: "127.0.0.1:30000".parse().unwrap(), outbound: true };
        assert!(c1.get(SrtpSlot { local: "127.0.0.1:20003".parse().unwrap(), outbound: false }, None).is_none());
        assert!(c1.get(inbound, Some(&k2)).is_none(), "only with the key the table names");

        // Entry 1 unchanged, entry 2 re-keyed: only its context is new.
        let t2 = table(vec![entry(1, srtp(&k1), Protection::Clear), entry(2, Protection::Clear, srtp(&k1))]);
        let changed = [t1.streams.values().nth(1).unwrap().key, t1.streams.values().nth(2).unwrap().key];
        let c2 = c1.update(&t1, &t2, Some(&changed));
        assert!(Arc::ptr_eq(c1.get(inbound, Some(&k1)).unwrap(), c2.get(inbound, Some(&k1)).unwrap()), "kept: its replay window and ROC live on");
        assert!(c2.get(outbound, Some(&k2)).is_none(), "new key, new session");
        assert_eq!(c2.get(outbound, Some(&k1)).unwrap().key, k1);
        // A full rebuild keeps the same ones; a table without SRTP has none.
        let c3 = c2.update(&t2, &t2, None);
        assert!(Arc::ptr_eq(c2.get(inbound, Some(&k1)).unwrap(), c3.get(inbound, Some(&k1)).unwrap()));
        assert!(c3.update(&t2, &table(vec![entry(1, Protection::Clear, Protection::Clear)]), None).is_empty());
    }

    /// `rtcp-mux-demux` toward an SDES party: its RTCP leaves from its RTCP address, which
    /// needs an outbound context of its own with the copy's key.
    #[test]
    fn a_copy_whose_rtcp_leaves_from_another_address_has_a_context_there() {
        let k = key(3, SrtpSuite::AesCm128HmacSha1_80);
        let mut e = entry(1, Protection::Clear, Protection::Srtp(Some(k.clone())));
        e.copies[0].rtcp = Some(("127.0.0.1:30001".parse().unwrap(), "127.0.0.2:30001".parse().unwrap()));
        let c = Contexts::default().update(&ForwardingTable::default(), &table(vec![e]), None);
        for port in [30000, 30001] {
            let slot = SrtpSlot { local: format!("127.0.0.1:{port}").parse().unwrap(), outbound: true };
            assert_eq!(c.get(slot, Some(&k)).map(|c| &c.key), Some(&k), "{port}");
        }
    }

    #[test]
    fn a_participant_that_only_subscribes_keeps_a_context_for_its_feedback() {
        // No stream entry at the subscriber's address: only its feedback entry needs the key.
        let k = key(5, SrtpSuite::AesCm128HmacSha1_80);
        let local: SocketAddr = "127.0.0.1:21000".parse().unwrap();
        let fb = mediaplane_core::feedback::FeedbackEntry {
            consumer: "r/sub".into(),
            local,
            source: "127.0.0.2:5000".parse().unwrap(),
            routes: Vec::new(),
            inbound: Protection::Srtp(Some(k.clone())),
        };
        let mut t = table(vec![entry(1, Protection::Clear, Protection::Clear)]);
        t.feedback.insert(local, fb);
        let slot = SrtpSlot { local, outbound: false };
        let c1 = Contexts::default().update(&ForwardingTable::default(), &t, None);
        assert!(c1.get(slot, Some(&k)).is_some(), "a full build makes it");
        // An update of an unrelated entry keeps the same one (its replay window lives on).
        let changed = [t.streams.values().next().unwrap().key];
        let c2 = c1.update(&t, &t, Some(&changed));
        assert!(Arc::ptr_eq(c1.get(slot, Some(&k)).unwrap(), c2.get(slot, Some(&k)).unwrap()));
        // The feedback entry goes (it unsubscribed from everything): so does the context.
        let mut t2 = t.clone();
        t2.feedback.clear();
        assert!(c2.update(&t, &t2, Some(&changed)).get(slot, Some(&k)).is_none());
    }

    #[test]
    fn entries_sharing_an_address_share_its_session_until_the_last_one_goes() {
        // Two streams of one participant's transport (a BUNDLE): one inbound session for both.
        let k = key(3, SrtpSuite::AesCm128HmacSha1_80);
        let at = |id: u32, ssrc: u32| {
            let mut e = entry(id, Protection::Srtp(Some(k.clone())), Protection::Clear);
            e.key = mediaplane_core::IngressKey { local: "127.0.0.1:20000".parse().unwrap(), ssrc: Some(ssrc) };
            e
        };
        let t1 = table(vec![at(1, 11), at(2, 22)]);
        let c1 = Contexts::default().update(&ForwardingTable::default(), &t1, None);
        let slot = SrtpSlot { local: "127.0.0.1:20000".parse().unwrap(), outbound: false };
        assert_eq!(c1.len(), 1);
        // One stream goes: the session stays for the other.
        let t2 = table(vec![at(1, 11)]);
        let c2 = c1.update(&t1, &t2, Some(&[at(2, 22).key]));
        assert!(Arc::ptr_eq(c1.get(slot, Some(&k)).unwrap(), c2.get(slot, Some(&k)).unwrap()));
        // The last one goes: so does the session.
        let c3 = c2.update(&t2, &table(vec![]), Some(&[at(1, 11).key]));
        assert!(c3.is_empty());
    }
}
