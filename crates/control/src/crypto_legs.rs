//! The handshakes of ICE + DTLS-SRTP transports: relay legs of a WebRTC party
//! ([`mediaplane_core::model::Leg::ice`]) and browsers' room participants
//! ([`mediaplane_core::model::Participant::webrtc`], WHIP/WHEP): one ICE-lite agent and one DTLS
//! session per transport, fed with the STUN and DTLS the data plane
//! hands up ([`mediaplane_dataplane::DataplaneEvent::Handshake`]), answered through
//! [`mediaplane_dataplane::Dataplane::send_datagram`]. What they decide goes into the model like
//! any change: the nominated address becomes the leg's peer, the exported keys its SRTP.
//!
//! After a restart an ICE relay leg is resumed from what the model stores with it (its keys and
//! [`mediaplane_core::model::Leg::ice_credentials`]): its peer's consent checks are answered
//! from its nominated address, so media goes on. The DTLS certificate is new, and there is no
//! DTLS session: a re-offer (with the new fingerprint) is what keys it afresh. A browser's room
//! participant is not resumed (it is removed at start; the browser joins again).

use crate::manager::{ManagerError, SessionManager};
use crate::store::Change;
use mediaplane_core::model::Side;
use mediaplane_core::srtp::LegSrtp;
use mediaplane_webrtc::dtls::{DtlsContext, DtlsSession, Fingerprint, Progress, Role, State};
use mediaplane_webrtc::ice::{CheckOutcome, Credentials, LiteAgent};
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::HashMap;
use std::net::SocketAddr;

/// What signalling decided for one ICE leg (the NG engine sets it from the SDPs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CryptoLegSpec {
    /// The relay's address on the leg (where its STUN and DTLS arrive).
    pub local: SocketAddr,
    /// The relay's ICE credentials on this leg (in the SDP the peer gets).
    pub local_ice: Credentials,
    /// The peer's (from its SDP), once known.
    pub remote_ice: Option<Credentials>,
    /// Which end of DTLS the relay is (`a=setup`).
    pub role: Role,
    /// The fingerprint of the peer's certificate (from its SDP), once known: the handshake
    /// waits for it.
    pub remote_fingerprint: Option<Fingerprint>,
}

struct CryptoLeg {
    spec: CryptoLegSpec,
    agent: LiteAgent,
    dtls: Option<DtlsSession>,
    /// DTLS from anywhere but a valid ICE pair's source, or before a fingerprint is known.
    dtls_refused: u64,
    keyed: bool,
    /// Keyed by a handshake before a restart (the keys stored with the leg): no handshake is
    /// started for it until signalling changes the peer's fingerprint or the roles.
    resumed: bool,
    /// The first address an ICE check of it was answered for went to the model (see
    /// [`mediaplane_core::Model::set_participant_checked`]): once is enough.
    checked: bool,
    /// When signalling set it up: a browser's session that is not keyed within
    /// [`HANDSHAKE_DEADLINE`] ends.
    since: std::time::Instant,
}

/// How long a WHIP/WHEP session may take from its answer to its DTLS-SRTP keys (a client that
/// never got the answer, or whose ICE failed, must not keep its port and room slot).
pub const HANDSHAKE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

impl CryptoLeg {
    /// Start the relay's handshake as the DTLS client, if that is its role, none runs, the
    /// peer nominated an address and its fingerprint is known (in whichever order those came).
    /// True if it started (its first flight waits in the session's output).
    fn start_client(&mut self, ctx: &DtlsContext, stream: u32) -> bool {
        let (Role::Client, None, Some(fp), Some(_), false) = (self.spec.role, &self.dtls, &self.spec.remote_fingerprint, self.agent.selected(), self.resumed)
        else {
            return false;
        };
        match ctx.session(Role::Client, fp.clone()) {
            Ok(s) => {
                self.dtls = Some(s);
                true
            }
            Err(e) => {
                tracing::warn!(stream, error = %e, "no DTLS session");
                false
            }
        }
    }
}

/// What the API and the NG `query` show of an ICE leg.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct CryptoLegView {
    pub nominated: Option<SocketAddr>,
    pub checks_answered: u64,
    pub checks_refused: u64,
    pub dtls_role: &'static str,
    /// `waiting`, `handshaking`, `connected`, or `closed: <why>`.
    pub dtls: String,
    pub dtls_refused: u64,
    pub keyed: bool,
}

/// Every ICE leg's handshake state, and the process's DTLS certificate.
pub struct CryptoLegs {
    dtls: DtlsContext,
    legs: Mutex<HashMap<u32, CryptoLeg>>,
}

impl CryptoLegs {
    /// With the certificate `store` keeps, or a new one it keeps from now on: a restarted relay
    /// (or one taking over the store) presents the fingerprint its peers' SDP already has, so a
    /// re-offer after the restart needs no new handshake. One that is unreadable or near its
    /// end is replaced (and said so).
    pub fn open(store: &mut crate::store::Store) -> Result<CryptoLegs, ManagerError> {
        let stored = match store.dtls_identity()?.map(|pem| DtlsContext::from_pem(&pem)) {
            Some(Ok(dtls)) => Some(dtls),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "the stored DTLS certificate is replaced by a new one");
                None
            }
            None => None,
        };
        let dtls = match stored {
            Some(dtls) => dtls,
            None => {
                let dtls = DtlsContext::generate().map_err(|e| ManagerError::Internal(format!("no DTLS certificate: {e}")))?;
                let pem = dtls.to_pem().map_err(|e| ManagerError::Internal(format!("DTLS certificate: {e}")))?;
                store.set_dtls_identity(&pem)?;
                dtls
            }
        };
        tracing::info!(fingerprint = %dtls.fingerprint().to_sdp(), "DTLS certificate");
        Ok(CryptoLegs { dtls, legs: Mutex::new(HashMap::new()) })
    }

    /// The relay's certificate fingerprint, for `a=fingerprint`.
    pub fn fingerprint(&self) -> &Fingerprint {
        self.dtls.fingerprint()
    }

    /// The ICE relay legs of a stored `model` (a restart): each one with stored credentials
    /// answers its peer's checks again, its nominated address (the leg's peer) taken as
    /// nominated now, keyed if its keys were stored.
    pub(crate) fn resume(&self, model: &mediaplane_core::Model) {
        let now_ns = mediaplane_dataplane::monotonic_ns();
        let mut legs = self.legs.lock();
        for leg in model.relays.values().flat_map(|r| [&r.a, &r.b]).filter(|l| l.ice) {
            let Some(c) = &leg.ice_credentials else { continue };
            let credentials = |(ufrag, pwd): (&String, &String)| Credentials { ufrag: ufrag.clone(), pwd: pwd.clone() };
            let spec = CryptoLegSpec {
                local: leg.local,
                local_ice: credentials((&c.local_ufrag, &c.local_pwd)),
                remote_ice: c.remote.as_ref().map(|(u, p)| credentials((u, p))),
                role: if c.dtls_client { Role::Client } else { Role::Server },
                remote_fingerprint: c
                    .remote_fingerprint
                    .as_deref()
                    .and_then(|f| Fingerprint::parse(f).inspect_err(|e| tracing::warn!(uid = leg.uid, error = %e, "stored peer fingerprint not taken")).ok()),
            };
            let mut agent = LiteAgent::new(spec.local_ice.clone(), spec.remote_ice.clone());
            if let Some(peer) = leg.remote {
                agent.resume(peer, now_ns);
            }
            let keyed = leg.srtp.as_ref().is_some_and(|s| s.inbound.is_some() && s.outbound.is_some());
            let resumed = CryptoLeg { spec, agent, dtls: None, dtls_refused: 0, keyed, resumed: keyed, checked: true, since: std::time::Instant::now() };
            legs.insert(leg.uid, resumed);
        }
        if !legs.is_empty() {
            tracing::info!(legs = legs.len(), "ICE legs resumed from the store");
        }
    }
}

/// What a handshake event decided, applied after the legs' lock is released.
#[derive(Default)]
struct Decided {
    send: Vec<(SocketAddr, SocketAddr, Vec<u8>)>,
    /// The first address a check was answered for, before any nomination.
    checked: Option<SocketAddr>,
    nominated: Option<SocketAddr>,
    keys: Option<LegSrtp>,
}

impl SessionManager {
    /// The relay's DTLS certificate fingerprint (`a=fingerprint` of every SDP it terminates).
    pub fn dtls_fingerprint(&self) -> Fingerprint {
        self.crypto_legs().fingerprint().clone()
    }

    /// Set (or update, after a re-offer) what signalling decided for ICE leg `uid`. New local
    /// credentials restart ICE; a new peer fingerprint or role starts a new handshake.
    pub fn set_crypto_leg(&self, uid: u32, spec: CryptoLegSpec) {
        let mut legs = self.crypto_legs().legs.lock();
        match legs.get_mut(&uid) {
            Some(leg) if leg.spec == spec => {}
            Some(leg) => {
                if leg.spec.local_ice != spec.local_ice {
                    leg.agent.restart(spec.local_ice.clone(), spec.remote_ice.clone());
                } else {
                    leg.agent.remote = spec.remote_ice.clone();
                }
                if leg.spec.role != spec.role || leg.spec.remote_fingerprint != spec.remote_fingerprint {
                    leg.dtls = None;
                    leg.resumed = false;
                }
                leg.spec = spec;
            }
            None => {
                let agent = LiteAgent::new(spec.local_ice.clone(), spec.remote_ice.clone());
                legs.insert(
                    uid,
                    CryptoLeg { spec, agent, dtls: None, dtls_refused: 0, keyed: false, resumed: false, checked: false, since: std::time::Instant::now() },
                );
            }
        }
    }

    /// The handshake state of ICE leg `uid`.
    pub fn crypto_leg(&self, uid: u32) -> Option<CryptoLegView> {
        let legs = self.crypto_legs().legs.lock();
        let leg = legs.get(&uid)?;
        Some(CryptoLegView {
            nominated: leg.agent.selected(),
            checks_answered: leg.agent.checks_answered,
            checks_refused: leg.agent.checks_refused,
            dtls_role: match leg.spec.role {
                Role::Server => "passive",
                Role::Client => "active",
            },
            dtls: match leg.dtls.as_ref().map(DtlsSession::state) {
                None => "waiting".into(),
                Some(State::Handshaking) => "handshaking".into(),
                Some(State::Connected) => "connected".into(),
                Some(State::Closed(why)) => format!("closed: {why}"),
            },
            dtls_refused: leg.dtls_refused,
            keyed: leg.keyed,
        })
    }

    /// STUN or DTLS for ICE leg `stream` from `source` (see the module).
    pub fn on_handshake(&self, stream: u32, local: SocketAddr, source: SocketAddr, at_ns: u64, packet: &[u8]) {
        let mut d = Decided::default();
        {
            let ctx = &self.crypto_legs().dtls;
            let mut legs = self.crypto_legs().legs.lock();
            let Some(leg) = legs.get_mut(&stream) else {
                tracing::debug!(stream, %source, "handshake packet for a leg without ICE state");
                return;
            };
            if mediaplane_webrtc::dtls::is_dtls(packet) {
                let from_peer = leg.agent.valid_source(source);
                tracing::debug!(stream, %source, from_peer, len = packet.len(), "DTLS datagram");
                // A new ClientHello (handshake record, type 1) after a failed handshake starts
                // over: one bad datagram must not end the leg until the next re-offer.
                let client_hello = packet.first() == Some(&22) && packet.get(13) == Some(&1);
                if client_hello && leg.spec.role == Role::Server && matches!(leg.dtls.as_ref().map(DtlsSession::state), Some(State::Closed(_))) {
                    leg.dtls = None;
                }
                match (&mut leg.dtls, &leg.spec.remote_fingerprint) {
                    _ if !from_peer => leg.dtls_refused += 1,
                    (None, Some(fp)) if leg.spec.role == Role::Server => match ctx.session(Role::Server, fp.clone()) {
                        Ok(s) => leg.dtls = Some(s),
                        Err(e) => tracing::warn!(stream, error = %e, "no DTLS session"),
                    },
                    (None, _) => leg.dtls_refused += 1,
                    _ => {}
                }
                if let Some(s) = leg.dtls.as_mut().filter(|_| from_peer) {
                    match s.on_datagram(packet) {
                        Progress::Connected(keys) => {
                            leg.keyed = true;
                            d.keys = Some(LegSrtp { inbound: Some(keys.inbound), outbound: Some(keys.outbound) });
                        }
                        Progress::Closed(why) => tracing::warn!(stream, %source, %why, "DTLS ended"),
                        Progress::Pending => {}
                    }
                    while let Some(out) = s.poll_output() {
                        d.send.push((local, source, out));
                    }
                }
            } else {
                match leg.agent.on_stun(packet, source, at_ns) {
                    CheckOutcome::Answered { reply, nominated } => {
                        d.send.push((local, source, reply));
                        if !nominated && !leg.checked {
                            leg.checked = true;
                            d.checked = Some(source);
                        }
                        if nominated {
                            d.nominated = Some(source);
                            if leg.start_client(ctx, stream) {
                                let s = leg.dtls.as_mut().expect("just started");
                                while let Some(out) = s.poll_output() {
                                    d.send.push((local, source, out));
                                }
                            }
                        }
                    }
                    CheckOutcome::Refused { reply, reason } => {
                        tracing::debug!(stream, %source, reason, "ICE check refused");
                        d.send.push((local, source, reply));
                    }
                    CheckOutcome::Ignored { .. } => {}
                }
            }
        }
        // A browser sends media on a checked pair as soon as its DTLS is done, which can be
        // before it nominates (and its first packets are its bandwidth probes): accepted from
        // there, not sent to, until a nomination.
        if let Some(addr) = d.checked {
            if let Err(e) = self.set_transport(stream, |m, t| t.checked(m, addr)) {
                tracing::warn!(stream, %addr, error = %e, "could not take the checked address");
            }
        }
        // The model first: the nominated address is the only one media goes to and comes from.
        if let Some(addr) = d.nominated {
            match self.set_transport(stream, |m, t| t.nominated(m, Some(addr))) {
                Ok(_) => tracing::info!(stream, %addr, "ICE nominated"),
                Err(e) => tracing::warn!(stream, %addr, error = %e, "could not take the nominated address"),
            }
        }
        if let Some(keys) = d.keys {
            match self.set_transport(stream, |m, t| t.keys(m, keys)) {
                Ok(_) => tracing::info!(stream, "DTLS-SRTP keys installed"),
                Err(e) => tracing::warn!(stream, error = %e, "could not install the DTLS-SRTP keys"),
            }
        }
        for (from, to, payload) in d.send {
            if let Err(e) = self.dataplane().send_datagram(from, to, &payload) {
                tracing::debug!(%from, %to, error = %e, "handshake reply not sent");
            }
        }
    }

    /// Every 100 ms or so: retransmit DTLS flights whose timer ran out, end the legs whose
    /// peer's consent expired (nothing more is sent to it), forget legs no longer ICE legs.
    pub fn tick_crypto_legs(&self, now_ns: u64) {
        let mut send = Vec::new();
        let mut expired = Vec::new();
        {
            // The lock first: a leg the engine adds after this snapshot waits for the next tick
            // instead of being forgotten as not (yet) in the model.
            let mut legs = self.crypto_legs().legs.lock();
            let snapshot = self.snapshot();
            let ctx = &self.crypto_legs().dtls;
            // One lookup per leg: gone from the model, it is forgotten; a browser's is noted.
            let mut participants = std::collections::HashSet::new();
            legs.retain(|uid, _| match Transport::of(&snapshot.model, *uid) {
                Some(Transport::Participant(..)) => participants.insert(*uid),
                Some(Transport::RelayLeg(..)) => true,
                None => false,
            });
            for (uid, leg) in legs.iter_mut() {
                let peer = leg.agent.selected();
                let participant = participants.contains(uid);
                if leg.agent.consent_expired(now_ns) || (participant && !leg.keyed && leg.since.elapsed() > HANDSHAKE_DEADLINE) {
                    expired.push(*uid);
                }
                // The client's first flight: once nominated and the peer's fingerprint is known
                // (the answer may bring it after the nomination, or a re-offer dropped the
                // session), whatever came first.
                leg.start_client(ctx, *uid);
                if let (Some(s), Some(peer)) = (leg.dtls.as_mut(), peer) {
                    s.on_timer();
                    while let Some(out) = s.poll_output() {
                        send.push((leg.spec.local, peer, out));
                    }
                }
            }
        }
        for uid in expired {
            // A relay leg waits for its call's signalling; a browser's participant is gone with
            // its browser (a WHIP/WHEP session ends when its client does, DELETE or not).
            tracing::info!(stream = uid, "ICE consent expired, or a browser's session was not keyed in time: nothing more is sent to the peer");
            if let Err(e) = self.set_transport(uid, |m, t| t.consent_expired(m)) {
                tracing::warn!(stream = uid, error = %e, "could not end the leg's peer");
            }
        }
        for (from, to, payload) in send {
            let _ = self.dataplane().send_datagram(from, to, &payload);
        }
    }

    /// Change the transport with handshake id `uid` (nothing if it is gone).
    fn set_transport(
        &self,
        uid: u32,
        f: impl FnOnce(&mut mediaplane_core::Model, &Transport) -> Result<bool, mediaplane_core::model::ModelError>,
    ) -> Result<bool, ManagerError> {
        self.mutate(|m, _| {
            let Some(t) = Transport::of(m, uid) else {
                return Ok((false, vec![]));
            };
            let changed = f(m, &t)?;
            let changes = match t {
                // The legs bundled with it have its peer and keys.
                Transport::RelayLeg(id, side) => std::iter::once(id.clone()).chain(m.bundled_with(&id, side)).map(Change::Relay).collect(),
                Transport::Participant(room, _) => vec![Change::Room(room)],
            };
            Ok((changed, if changed { changes } else { vec![] }))
        })
    }
}

/// What a handshake keys: an ICE relay leg, or a WebRTC room participant.
enum Transport {
    RelayLeg(String, Side),
    Participant(String, String),
}

impl Transport {
    /// The ICE transport with handshake id `uid` in `m`, if it is one still.
    fn of(m: &mediaplane_core::Model, uid: u32) -> Option<Transport> {
        if let Some((id, side)) = m.relay_leg_by_uid(uid) {
            let leg = m.relays.get(id).map(|r| if side == Side::A { &r.a } else { &r.b })?;
            return leg.ice.then(|| Transport::RelayLeg(id.to_string(), side));
        }
        m.participant_by_transport(uid).map(|(room, pid)| Transport::Participant(room.to_string(), pid.to_string()))
    }

    fn nominated(&self, m: &mut mediaplane_core::Model, addr: Option<SocketAddr>) -> Result<bool, mediaplane_core::model::ModelError> {
        match self {
            Transport::RelayLeg(id, side) => m.set_leg_nominated(id, *side, addr),
            Transport::Participant(room, pid) => m.set_participant_nominated(room, pid, addr),
        }
    }

    fn checked(&self, m: &mut mediaplane_core::Model, addr: SocketAddr) -> Result<bool, mediaplane_core::model::ModelError> {
        match self {
            // A relay leg's peer is a SIP endpoint's ICE agent: it waits for the nomination.
            Transport::RelayLeg(..) => Ok(false),
            Transport::Participant(room, pid) => m.set_participant_checked(room, pid, addr),
        }
    }

    fn consent_expired(&self, m: &mut mediaplane_core::Model) -> Result<bool, mediaplane_core::model::ModelError> {
        match self {
            Transport::RelayLeg(id, side) => m.set_leg_nominated(id, *side, None),
            Transport::Participant(room, pid) => m.remove_participant(room, pid).map(|()| true),
        }
    }

    fn keys(&self, m: &mut mediaplane_core::Model, keys: LegSrtp) -> Result<bool, mediaplane_core::model::ModelError> {
        match self {
            Transport::RelayLeg(id, side) => m.set_leg_srtp(id, *side, Some(keys)),
            Transport::Participant(room, pid) => m.set_participant_srtp(room, pid, keys),
        }
    }
}
