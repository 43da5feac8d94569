//! WebRTC parties on a SIP call: toward a party speaking DTLS-SRTP (`UDP/TLS/RTP/SAVP(F)`,
//! with ICE) the relay is an ICE-lite agent and a DTLS endpoint, and bridges it to plain RTP
//! on the other leg: the WebRTC↔SIP gateway rtpengine is mostly run as, asked the same way
//! (`transport-protocol` or a protocol flag, `ICE=force`, `DTLS=passive|active`).
//!
//! - An offer from a WebRTC party going on as plain RTP: the relay takes the party's ICE
//!   credentials, certificate fingerprint and `a=setup`, and strips ICE and DTLS from what the
//!   receiver gets; its answer goes back with the relay's own (credentials, one host candidate,
//!   fingerprint, `a=setup`, the offer's `a=mid`, `a=rtcp-mux`, session-level `a=ice-lite`).
//! - A plain offer going on to a WebRTC party: the receiver gets the relay's attributes
//!   (`a=setup:actpass` unless `DTLS` says otherwise, a `mid` and `rtcp-mux` where the offer had
//!   none); its answer gives its own, which the relay takes, and reaches the offerer stripped.
//!
//! The other leg may speak SDES-SRTP instead of plain RTP (DTLS-SRTP bridged to SDES-SRTP, as
//! rtpengine does): its keys are `crate::sdes`'s, each leg keyed on its own.
//!
//! Both legs speaking DTLS-SRTP pass through untouched. [`plan`] decides from the SDP and the
//! call (no side effects); [`install`] marks the legs in the model; the engine then hands each
//! WebRTC leg's handshake parameters to the control plane ([`hand_over_legs`]).

use crate::calls::{rtp_relay_id, side_index, Call, Phase};
use crate::sdes::{is_dtls, SectionPlan};
use crate::sdp::Sdp;
use mediaplane_control::crypto_legs::CryptoLegSpec;
use mediaplane_control::manager::{ManagerError, SessionManager};
use mediaplane_control::store::Change;
use mediaplane_core::model::{Bundled, IceCredentials, Side};
use mediaplane_core::Model;
use mediaplane_webrtc::dtls::{Fingerprint, Role};
use mediaplane_webrtc::ice::Credentials;
use std::net::SocketAddr;

/// What the relay terminates toward one WebRTC party of a media section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebrtcSide {
    /// The relay's credentials on this leg.
    pub local_ice: Credentials,
    /// The party's, from its SDP (None until it has sent one: the answer to our offer).
    pub remote_ice: Option<Credentials>,
    pub remote_fingerprint: Option<Fingerprint>,
    /// Which end of DTLS the relay is.
    pub role: Role,
    /// The section's `a=mid` as this party knows it.
    pub mid: String,
}

/// What a section's outgoing SDP gets.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Outgoing {
    /// Nothing of ICE or DTLS changes.
    #[default]
    Keep,
    /// Its ICE and DTLS attributes go (the receiver speaks plain RTP).
    Strip,
    /// The relay's own attributes for the party on side `side` (index), with this `a=setup`;
    /// `add_mid` / `add_mux` where the section lacks them.
    Ours { side: usize, setup: &'static str, add_mid: bool, add_mux: bool },
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WebrtcPlan {
    pub sides: [Option<WebrtcSide>; 2],
    pub outgoing: Outgoing,
    /// The section goes on another section's transport (BUNDLE).
    pub bundle: Option<SectionBundle>,
}

/// A media section of a BUNDLE group (RFC 8843) the relay accepted from a WebRTC offerer on
/// `side`: its media goes on the transport of section `head` (the group's first), where the
/// party's packets with `ssrc` (the section's first `a=ssrc`) are this section's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectionBundle {
    pub side: Side,
    pub head: usize,
    pub ssrc: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum WebrtcError {
    #[error("media section {section}: the {what} has no {attr}, which a DTLS-SRTP party must send")]
    Missing { section: usize, what: &'static str, attr: &'static str },
    #[error("media section {section}: a=fingerprint {value:?} is not one mediaplane can check (sha-1, sha-256, sha-384, sha-512)")]
    Fingerprint { section: usize, value: String },
    #[error("media section {section}: the answer refuses DTLS-SRTP ({proto}) though the relay offered it {offered}")]
    Refused { section: usize, proto: String, offered: String },
    #[error("media section {section}: a re-offer that takes a section out of the BUNDLE group the relay accepted, or moves it to another, is not supported (offer the same group, or end the call)")]
    BundleChanged { section: usize },
}

/// `DTLS=` of the request: which `a=setup` the relay offers (`passive`, `active`) or asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DtlsOption {
    #[default]
    Default,
    Passive,
    Active,
}

impl DtlsOption {
    /// The `DTLS` value, or None for one not acted on (`off`/`no`: DTLS is always terminated
    /// toward a WebRTC party the call bridges to plain RTP).
    pub fn parse(v: &str) -> Option<DtlsOption> {
        match v {
            "passive" => Some(DtlsOption::Passive),
            "active" => Some(DtlsOption::Active),
            _ => None,
        }
    }
}

fn credentials(sdp: &Sdp, i: usize) -> Option<Credentials> {
    Some(Credentials { ufrag: sdp.transport_attr(i, "ice-ufrag")?.to_string(), pwd: sdp.transport_attr(i, "ice-pwd")?.to_string() })
}

/// The party's side of a section: its credentials and fingerprint (both required).
fn theirs(sdp: &Sdp, i: usize, what: &'static str) -> Result<(Credentials, Fingerprint), WebrtcError> {
    let section = i + 1;
    let ice = credentials(sdp, i).ok_or(WebrtcError::Missing { section, what, attr: "a=ice-ufrag/a=ice-pwd" })?;
    let value = sdp.transport_attr(i, "fingerprint").ok_or(WebrtcError::Missing { section, what, attr: "a=fingerprint" })?;
    let fp = Fingerprint::parse(value).map_err(|_| WebrtcError::Fingerprint { section, value: value.to_string() })?;
    Ok((ice, fp))
}

/// Decide every section of `sdp` (sent by `sender` in `phase`), given what the SDES plan made
/// of its protocol (`secure`, one per section).
pub fn plan(call: &Call, sender: Side, phase: Phase, sdp: &Sdp, secure: &[SectionPlan], dtls: DtlsOption) -> Result<Vec<WebrtcPlan>, WebrtcError> {
    let (s, r) = (side_index(sender), 1 - side_index(sender));
    let mut out = Vec::with_capacity(sdp.media.len());
    for (i, sm) in sdp.media.iter().enumerate() {
        let section = i + 1;
        let prev = call.media.get(i);
        let prev_side = |x: usize| prev.and_then(|m| m.webrtc[x].clone());
        let mut p = WebrtcPlan::default();
        if sm.port == 0 {
            out.push(p);
            continue;
        }
        let mid = sm.transport_attr("mid").map(str::to_string);
        match phase {
            Phase::Offer => {
                let target = secure.get(i).and_then(|x| x.proto.clone()).unwrap_or_else(|| sm.proto.clone());
                match (is_dtls(&sm.proto), is_dtls(&target)) {
                    (true, false) => {
                        let (remote_ice, fp) = theirs(sdp, i, "offer")?;
                        let old = prev_side(s);
                        // The same party re-offering without an ICE restart keeps the relay's
                        // credentials; a restart (new ufrag) gets new ones.
                        let local_ice = match &old {
                            Some(o) if o.remote_ice.as_ref().map(|c| &c.ufrag) == Some(&remote_ice.ufrag) => o.local_ice.clone(),
                            _ => Credentials::generate(),
                        };
                        // Its `a=setup:passive` makes the relay the client; `active` or
                        // `actpass` the server (what the answer will say), unless DTLS=active
                        // asks the relay to connect.
                        // A re-offer with `actpass` keeps the role agreed (RFC 8842 §5.5: a
                        // role is not reversed without a new association).
                        let role = match (sdp.transport_attr(i, "setup"), dtls, &old) {
                            (Some("passive"), _, _) => Role::Client,
                            (Some("active"), _, _) => Role::Server,
                            (_, DtlsOption::Active, _) => Role::Client,
                            (_, _, Some(o)) => o.role,
                            _ => Role::Server,
                        };
                        let mid = mid.unwrap_or_else(|| i.to_string());
                        p.sides[s] = Some(WebrtcSide { local_ice, remote_ice: Some(remote_ice), remote_fingerprint: Some(fp), role, mid });
                        p.outgoing = Outgoing::Strip;
                    }
                    (false, true) => {
                        let old = prev_side(r);
                        let (role, setup) = match dtls {
                            DtlsOption::Active => (Role::Client, "active"),
                            DtlsOption::Passive => (Role::Server, "passive"),
                            // The answer decides; until then the relay would be the server.
                            DtlsOption::Default => (old.as_ref().map_or(Role::Server, |o| o.role), "actpass"),
                        };
                        p.sides[r] = Some(WebrtcSide {
                            local_ice: old.as_ref().map_or_else(Credentials::generate, |o| o.local_ice.clone()),
                            remote_ice: old.as_ref().and_then(|o| o.remote_ice.clone()),
                            remote_fingerprint: old.as_ref().and_then(|o| o.remote_fingerprint.clone()),
                            role,
                            mid: mid.clone().unwrap_or_else(|| i.to_string()),
                        });
                        p.outgoing = Outgoing::Ours { side: r, setup, add_mid: mid.is_none(), add_mux: !sm.rtcp_mux };
                    }
                    _ => {}
                }
            }
            Phase::Answer => {
                if let Some(mut ours) = prev_side(s) {
                    // The relay offered this party DTLS-SRTP: its answer gives its side.
                    if !is_dtls(&sm.proto) {
                        return Err(WebrtcError::Refused { section, proto: sm.proto.clone(), offered: "UDP/TLS/RTP/SAVPF".into() });
                    }
                    let (remote_ice, fp) = theirs(sdp, i, "answer")?;
                    ours.role = match sdp.transport_attr(i, "setup") {
                        Some("passive") => Role::Client,
                        _ => Role::Server,
                    };
                    ours.remote_ice = Some(remote_ice);
                    ours.remote_fingerprint = Some(fp);
                    p.sides[s] = Some(ours);
                    p.outgoing = Outgoing::Strip;
                } else if let Some(offerer) = prev_side(r) {
                    // The offerer spoke DTLS-SRTP, terminated here: the relay's attributes.
                    let setup = match offerer.role {
                        Role::Server => "passive",
                        Role::Client => "active",
                    };
                    p.outgoing = Outgoing::Ours { side: r, setup, add_mid: mid.is_none(), add_mux: !sm.rtcp_mux };
                    p.sides[r] = Some(offerer);
                }
            }
        }
        out.push(p);
    }
    // What was bundled stays so, but for what the bundling party's own offer changes.
    for (i, p) in out.iter_mut().enumerate() {
        p.bundle = call.media.get(i).and_then(|m| m.bundle).filter(|b| phase == Phase::Answer || b.side != sender);
    }
    if phase == Phase::Offer {
        bundle(call, sender, sdp, &mut out)?;
    }
    Ok(out)
}

/// Accept the offerer's first BUNDLE group (RFC 8843) for its sections whose DTLS-SRTP the
/// relay terminates: the first mid's section carries the group's transport, every other
/// section with an `a=ssrc` goes on it (its media told apart by that SSRC) and is given the
/// same credentials. A section without one stays on a transport of its own (its packets could
/// not be told apart). A re-offer must keep the group the relay accepted.
fn bundle(call: &Call, sender: Side, sdp: &Sdp, plans: &mut [WebrtcPlan]) -> Result<(), WebrtcError> {
    let s = side_index(sender);
    let terminated = |i: usize| plans.get(i).is_some_and(|p| p.sides[s].is_some() && p.outgoing == Outgoing::Strip);
    let section_of = |mid: &str| sdp.media.iter().position(|m| m.port != 0 && m.transport_attr("mid") == Some(mid));
    let group: Vec<usize> =
        sdp.bundle_groups.first().map(|g| g.iter().filter_map(|mid| section_of(mid)).filter(|i| terminated(*i)).collect()).unwrap_or_default();
    if let Some((&head, members)) = group.split_first() {
        let head_side = plans[head].sides[s].clone().expect("terminated");
        for &i in members {
            // A section bundled before keeps its SSRC when this offer names none (its sender
            // stopped: `recvonly`); one never bundled needs one.
            let before = call.media.get(i).and_then(|m| m.bundle).filter(|b| b.side == sender && b.head == head).map(|b| b.ssrc);
            let Some(ssrc) = sdp.media[i].ssrcs.first().copied().or(before) else { continue };
            let side = plans[i].sides[s].as_mut().expect("terminated");
            side.local_ice = head_side.local_ice.clone();
            side.role = head_side.role;
            plans[i].bundle = Some(SectionBundle { side: sender, head, ssrc });
        }
    }
    for (i, m) in call.media.iter().enumerate() {
        let Some(was) = m.bundle.filter(|b| b.side == sender) else { continue };
        let now = plans.get(i).and_then(|p| p.bundle);
        if now.map(|b| b.head) != Some(was.head) {
            return Err(WebrtcError::BundleChanged { section: i + 1 });
        }
    }
    Ok(())
}

/// The `group:BUNDLE` attribute for the party on `to` (the mids of each group the relay
/// accepted from it, its first section's first), if any.
pub fn bundle_groups(call: &Call, to: Side) -> Vec<String> {
    let mut heads: Vec<usize> = call.media.iter().filter_map(|m| m.bundle.filter(|b| b.side == to).map(|b| b.head)).collect();
    heads.dedup();
    let mid = |i: usize| call.media.get(i).and_then(|m| m.webrtc[side_index(to)].as_ref()).map(|w| w.mid.clone());
    heads
        .into_iter()
        .filter_map(|h| {
            let members = call.media.iter().enumerate().filter(|(_, m)| m.bundle.is_some_and(|b| b.side == to && b.head == h)).map(|(i, _)| i);
            let mids: Option<Vec<String>> = std::iter::once(h).chain(members).map(mid).collect();
            mids.map(|m| format!("group:BUNDLE {}", m.join(" ")))
        })
        .collect()
}

/// Write `plans` into `call` and mark its RTP relays' legs (after [`crate::calls::apply_signal`]
/// made them, before [`crate::sdes::install`]): a WebRTC party's leg is an ICE leg whose SRTP
/// waits for its handshake.
pub fn install(model: &mut Model, call: &mut Call, plans: &[WebrtcPlan], changes: &mut Vec<Change>) -> Result<(), ManagerError> {
    for (i, p) in plans.iter().enumerate() {
        let Some(m) = call.media.get_mut(i) else { continue };
        m.webrtc = p.sides.clone();
        m.bundle = p.bundle.filter(|_| m.active);
        if !m.active {
            continue;
        }
        let id = rtp_relay_id(&call.key, i);
        let mut changed = false;
        for (x, side) in [(0, Side::A), (1, Side::B)] {
            let webrtc = m.webrtc[x].is_some();
            changed |= model.set_leg_ice(&id, side, webrtc)?;
            // Stored with the leg: a restarted relay answers the peer's consent checks.
            let credentials = m.webrtc[x].as_ref().map(|w| IceCredentials {
                local_ufrag: w.local_ice.ufrag.clone(),
                local_pwd: w.local_ice.pwd.clone(),
                remote: w.remote_ice.as_ref().map(|r| (r.ufrag.clone(), r.pwd.clone())),
                dtls_client: w.role == Role::Client,
                remote_fingerprint: w.remote_fingerprint.as_ref().map(|f| f.to_sdp()),
            });
            changed |= model.set_leg_ice_credentials(&id, side, credentials)?;
            let leg = match side {
                Side::A => model.relays.get(&id).map(|r| &r.a),
                Side::B => model.relays.get(&id).map(|r| &r.b),
            };
            match (webrtc, leg.map(|l| l.srtp.is_some())) {
                // SRTP with no key yet: nothing passes until the handshake keys it.
                (true, Some(false)) => changed |= model.set_leg_srtp(&id, side, Some(Default::default()))?,
                // No longer a WebRTC party: its handshake keys go.
                (false, _) if m.sdes[x].is_none() => changed |= model.set_leg_srtp(&id, side, None)?,
                _ => {}
            }
        }
        if changed && !changes.contains(&Change::Relay(id.clone())) {
            changes.push(Change::Relay(id));
        }
    }
    // On its group's transport (once every section's legs are ICE legs): the leg moves to the
    // first section's address.
    for (i, m) in call.media.iter_mut().enumerate() {
        let Some(b) = m.bundle else { continue };
        let id = rtp_relay_id(&call.key, i);
        model.bundle_leg(&id, b.side, Bundled { relay: rtp_relay_id(&call.key, b.head), ssrc: b.ssrc })?;
        // Named whether or not it moved now: its first section's changes are its own too.
        if !changes.contains(&Change::Relay(id.clone())) {
            changes.push(Change::Relay(id.clone()));
        }
        if let Some(r) = model.relays.get(&id) {
            m.local[side_index(b.side)] = r.leg(b.side).local;
        }
    }
    Ok(())
}

/// Hand every WebRTC leg of `call` its handshake parameters (after the mutation committed).
pub fn hand_over_legs(mgr: &SessionManager, call: &Call) {
    for (i, m) in call.media.iter().enumerate().filter(|(_, m)| m.active) {
        let id = rtp_relay_id(&call.key, i);
        for (x, side) in [(0, Side::A), (1, Side::B)] {
            let Some(w) = &m.webrtc[x] else { continue };
            // Its handshake is its group's first section's.
            if m.bundle.is_some_and(|b| b.side == side) {
                continue;
            }
            let Some(uid) = mgr.read(|model, _| model.relays.get(&id).map(|r| if side == Side::A { r.a.uid } else { r.b.uid })) else { continue };
            mgr.set_crypto_leg(
                uid,
                CryptoLegSpec {
                    local: m.local_of(side),
                    local_ice: w.local_ice.clone(),
                    remote_ice: w.remote_ice.clone(),
                    role: w.role,
                    remote_fingerprint: w.remote_fingerprint.clone(),
                },
            );
        }
    }
}

/// The attributes (after `a=`) the relay gives a WebRTC party in a section: credentials, its one
/// host candidate at `addr`, its fingerprint and `a=setup`, and `mid`/`rtcp-mux` if asked.
pub fn attributes(w: &WebrtcSide, addr: SocketAddr, fingerprint: &Fingerprint, setup: &str, add_mid: bool, add_mux: bool) -> Vec<String> {
    let mut out = vec![format!("ice-ufrag:{}", w.local_ice.ufrag), format!("ice-pwd:{}", w.local_ice.pwd)];
    // RFC 8445 §5.1.2.1 priority of a host candidate, component 1 (RTP; RTCP is muxed).
    out.push(format!("candidate:1 1 UDP 2130706431 {} {} typ host", addr.ip(), addr.port()));
    out.push("end-of-candidates".into());
    out.push(format!("fingerprint:{}", fingerprint.to_sdp()));
    out.push(format!("setup:{setup}"));
    if add_mid {
        out.push(format!("mid:{}", w.mid));
    }
    if add_mux {
        out.push("rtcp-mux".into());
    }
    out
}
