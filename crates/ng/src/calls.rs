//! The call registry and what an offer, an answer or a delete does to the model.
//!
//! A call (one SIP Call-ID) has two sides: **A**, the party that sent the first offer (its
//! From-tag), and **B**, the other one (learned from the answer's To-tag). Each live SDP media
//! section `i` is one relay pair for RTP, `ng-<key>-<i>`, plus one for RTCP, `ng-<key>-<i>c`,
//! unless RTP and RTCP are multiplexed. Leg A of a relay faces party A: its local address is what
//! A is told to send to (in the SDP answered to A), its remote is A's media address. Leg B
//! likewise for B. `<key>` is a 64-bit FNV-1a hash of the Call-ID, so relay ids are valid model
//! ids whatever the Call-ID holds, and relays found in the store after a restart can be matched
//! to their call again ([`Registry::adopt`]).
//!
//! Everything here is a function of the model and the registry: no sockets, no clock reads.

use crate::codecs::CodecSpec;
use crate::sdp::{ConnAddr, Sdp};
use mediaplane_control::config::{InterfaceError, MediaConfig};
use mediaplane_control::manager::{allocate_on, ManagerError};
use mediaplane_control::store::Change;
use mediaplane_core::model::{Follow, LegSpec, Relay, Side};
use mediaplane_core::LegSignal;
use mediaplane_core::Model;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::time::{Instant, SystemTime};

pub const RELAY_PREFIX: &str = "ng-";

/// FNV-1a 64 of the Call-ID, as 16 hex digits.
pub fn call_key(call_id: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in call_id.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

pub fn rtp_relay_id(key: &str, media: usize) -> String {
    format!("{RELAY_PREFIX}{key}-{media}")
}

pub fn rtcp_relay_id(key: &str, media: usize) -> String {
    format!("{RELAY_PREFIX}{key}-{media}c")
}

/// Parse a relay id made by this crate: (call key, media index, is RTCP).
pub fn parse_relay_id(id: &str) -> Option<(String, usize, bool)> {
    let rest = id.strip_prefix(RELAY_PREFIX)?;
    let (key, tail) = rest.split_once('-')?;
    if key.len() != 16 || !key.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let (num, rtcp) = match tail.strip_suffix('c') {
        Some(n) => (n, true),
        None => (tail, false),
    };
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) || num.len() > 3 {
        return None;
    }
    Some((key.to_string(), num.parse().ok()?, rtcp))
}

pub fn other(side: Side) -> Side {
    match side {
        Side::A => Side::B,
        Side::B => Side::A,
    }
}

/// A side's index in the per-side arrays `[A, B]`.
pub fn side_index(side: Side) -> usize {
    ix(side)
}

fn ix(side: Side) -> usize {
    match side {
        Side::A => 0,
        Side::B => 1,
    }
}

/// One SDP media section of a call, as negotiated so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaState {
    pub kind: String,
    pub proto: String,
    /// Relays exist (false for a disabled section, port 0).
    pub active: bool,
    /// RTP local address per side [A, B]; RTCP uses the port above.
    pub local: [SocketAddr; 2],
    /// The RTCP relay exists (false when RTP and RTCP are multiplexed).
    pub rtcp: bool,
    /// Signalled RTP and RTCP peer per side.
    pub peer: [Option<SocketAddr>; 2],
    pub peer_rtcp: [Option<SocketAddr>; 2],
    /// The last offer proposed rtcp-mux; the answer accepted it.
    pub mux_offered: bool,
    pub mux: bool,
    /// `rtcp-mux-demux`: this party keeps RTCP apart (on its RTP port + 1) while the other
    /// multiplexes it ([`mediaplane_core::model::DemuxedRtcp`] on the RTP relay, no RTCP relay).
    pub demux: Option<Side>,
    /// The protocol each party's last SDP spoke [A, B] (an answer goes back in the offerer's).
    pub proto_of: [Option<String>; 2],
    /// The SRTP the relay terminates toward each party [A, B] (SDES).
    pub sdes: [Option<crate::sdes::SdesSide>; 2],
    /// The formats each party's last SDP described [A, B]: what a subscriber to it is offered.
    pub formats_of: [Option<crate::sdp::FormatDescription>; 2],
    /// The last offer went on in another protocol than its sender's (`transport-protocol`).
    pub translated: bool,
    /// ICE + DTLS-SRTP the relay terminates toward each party [A, B] (a WebRTC party).
    pub webrtc: [Option<crate::webrtc::WebrtcSide>; 2],
    /// A section the WebRTC party on `side` bundles onto another section's transport.
    pub bundle: Option<crate::webrtc::SectionBundle>,
}

impl MediaState {
    pub fn local_of(&self, side: Side) -> SocketAddr {
        self.local[ix(side)]
    }
}

#[derive(Debug, Clone)]
pub struct Call {
    /// Empty for a call adopted from the store after a restart (only its key is known).
    pub call_id: String,
    pub key: String,
    pub tag_a: Option<String>,
    pub tag_b: Option<String>,
    /// The label each party was given (an offer's or answer's `label`/`from-label` names its
    /// sender's, an answer's `to-label` the offerer's) [A, B]: what `label` selects by. Kept
    /// in memory only: after a restart a call's labels are known again when they are signalled.
    pub labels: [Option<String>; 2],
    pub created: SystemTime,
    pub last_signal: SystemTime,
    pub media: Vec<MediaState>,
    pub answered: bool,
    /// Its relays are recorded now; `recorded`: they were at some point (its metadata is kept up
    /// to date until it ends).
    pub recording: bool,
    pub recorded: bool,
    /// Media activity: the latest packet time (`Counters::last_rx_ns`, CLOCK_MONOTONIC) seen on
    /// its legs at the last sweep, and when the call last had media or was created.
    pub last_rx: u64,
    pub last_activity: Instant,
    /// Per media section, the codecs the last offer's codec filter removed: its answer loses
    /// them too.
    pub codecs_removed: Vec<Vec<CodecSpec>>,
}

impl Call {
    pub fn new(call_id: &str, now: Instant) -> Call {
        let t = SystemTime::now();
        Call {
            call_id: call_id.to_string(),
            key: call_key(call_id),
            tag_a: None,
            tag_b: None,
            labels: [None, None],
            created: t,
            last_signal: t,
            media: Vec::new(),
            answered: false,
            recording: false,
            recorded: false,
            last_rx: 0,
            last_activity: now,
            codecs_removed: Vec::new(),
        }
    }

    /// The side a tag belongs to; unknown tags of a call whose tags are unknown (adopted) are
    /// taken for A, then B.
    /// The party labelled `label`.
    pub fn side_labelled(&self, label: &str) -> Option<Side> {
        [Side::A, Side::B].into_iter().find(|s| self.labels[ix(*s)].as_deref() == Some(label))
    }

    pub fn side_of(&self, tag: &str) -> Option<Side> {
        if self.tag_a.as_deref() == Some(tag) {
            Some(Side::A)
        } else if self.tag_b.as_deref() == Some(tag) {
            Some(Side::B)
        } else {
            None
        }
    }

    pub fn has_tag(&self, tag: &str) -> bool {
        self.side_of(tag).is_some()
    }

    /// Every relay id this call owns in the model.
    pub fn relay_ids(&self) -> Vec<String> {
        let mut v = Vec::new();
        for (i, m) in self.media.iter().enumerate() {
            if m.active {
                v.push(rtp_relay_id(&self.key, i));
                if m.rtcp {
                    v.push(rtcp_relay_id(&self.key, i));
                }
            }
        }
        v
    }
}

/// One media section of a received SDP, reduced to what the relay needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaSignal {
    pub kind: String,
    pub proto: String,
    /// Port 0: the section is disabled / rejected.
    pub disabled: bool,
    /// Where the party receives RTP and RTCP; `None` for a zero (hold) address.
    pub rtp: Option<SocketAddr>,
    pub rtcp: Option<SocketAddr>,
    pub mux: bool,
    /// Clock rate of the section's first payload type (what the party sends first), if known.
    pub clock_rate: Option<u32>,
    /// Its payload types mapped to `telephone-event` (RFC 4733 DTMF).
    pub telephone_events: Vec<u8>,
}

/// How the media address of a party is found (rtpengine's `trust address`,
/// `SIP source address`, `media address`).
#[derive(Debug, Clone, Default)]
pub struct AddressPolicy {
    pub media_address: Option<IpAddr>,
    pub sip_source: bool,
    pub received_from: Option<IpAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignalError {
    #[error("media section {0}: no usable connection address (and no received-from to fall back on)")]
    NoAddress(usize),
}

/// Extract the media endpoints of each section of `sdp` from the party that sent it.
/// `strip_mux`: the relay refuses rtcp-mux, so sections are treated as not muxed.
pub fn media_signals(sdp: &Sdp, policy: &AddressPolicy, strip_mux: bool) -> Result<Vec<MediaSignal>, SignalError> {
    let mut out = Vec::with_capacity(sdp.media.len());
    for (i, m) in sdp.media.iter().enumerate() {
        let mux = m.rtcp_mux && !strip_mux;
        let clock_rate = m.formats.first().and_then(|f| f.codec.as_ref()).map(|c| c.clock).filter(|c| *c > 0);
        let telephone_events =
            m.formats.iter().filter(|f| f.codec.as_ref().is_some_and(|c| c.name.eq_ignore_ascii_case("telephone-event"))).map(|f| f.pt).collect();
        if m.port == 0 {
            out.push(MediaSignal { kind: m.kind.clone(), proto: m.proto.clone(), disabled: true, rtp: None, rtcp: None, mux, clock_rate, telephone_events });
            continue;
        }
        let sdp_ip = sdp.media_addr(i).and_then(ConnAddr::ip);
        let overridden = policy.media_address.or(if policy.sip_source { policy.received_from } else { None });
        let ip = overridden.or(sdp_ip).or(policy.received_from).ok_or(SignalError::NoAddress(i))?;
        let rtp = (!ip.is_unspecified()).then_some(SocketAddr::new(ip, m.port));
        let rtcp = rtp.and_then(|_| {
            let (rip, rport) = match &m.rtcp {
                Some(r) => (overridden.or(r.addr.as_ref().and_then(ConnAddr::ip)).unwrap_or(ip), r.port),
                None => (ip, m.port.checked_add(1)?),
            };
            (rport != 0 && !rip.is_unspecified()).then_some(SocketAddr::new(rip, rport))
        });
        out.push(MediaSignal { kind: m.kind.clone(), proto: m.proto.clone(), disabled: false, rtp, rtcp, mux, clock_rate, telephone_events });
    }
    Ok(out)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Offer,
    Answer,
}

fn rtcp_addr(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip(), a.port() + 1)
}

/// Apply one party's SDP (`from`: whose SDP it is) to the model and to `call` together.
/// Run inside [`mediaplane_control::manager::SessionManager::mutate`]: on error the caller drops
/// both the model copy and the call copy, so nothing changes.
pub fn apply_signal(
    model: &mut Model,
    media_cfg: &MediaConfig,
    call: &mut Call,
    from: Side,
    phase: Phase,
    signals: &[MediaSignal],
    opts: &SignalOptions,
) -> Result<Vec<Change>, ManagerError> {
    // What this SDP says of its sender's leg. No address (c=0.0.0.0): on hold.
    let signal = |remote: Option<SocketAddr>, held: bool| LegSignal { remote, follow: opts.follow, held, clock_rate: None };
    let mut changes = Vec::new();
    let s = ix(from);
    // Sections the new SDP no longer has (not allowed by RFC 3264, handled anyway).
    while call.media.len() > signals.len() {
        let i = call.media.len() - 1;
        remove_media(model, call, i, &mut changes)?;
        call.media.pop();
    }
    for (i, sig) in signals.iter().enumerate() {
        if sig.disabled {
            if i < call.media.len() {
                remove_media(model, call, i, &mut changes)?;
            } else {
                call.media.push(inactive(sig));
            }
            let m = &mut call.media[i];
            m.kind.clone_from(&sig.kind);
            m.proto.clone_from(&sig.proto);
            continue;
        }
        let rtp_id = rtp_relay_id(&call.key, i);
        let rtcp_id = rtcp_relay_id(&call.key, i);
        if i >= call.media.len() {
            call.media.push(inactive(sig));
        }
        // Where each party's leg lives: its interface, and its address family (the sender's
        // leg speaks its SDP's family; the other leg `address-family`'s or keeps its own).
        let (from_v4, current) = {
            let m = &call.media[i];
            (sig.rtp.map(|a| a.ip().is_ipv4()), m.active.then_some(m.local))
        };
        let want = |x: Side| -> Result<IpAddr, ManagerError> {
            let cur = current.map(|l| l[ix(x)].ip());
            let name = opts.placement.interface[ix(x)].as_deref();
            if x == from {
                leg_ip(media_cfg, name, from_v4, true, cur)
            } else {
                match opts.placement.out_v4 {
                    Some(v4) => leg_ip(media_cfg, name, Some(v4), true, cur),
                    None if cur.is_some() => leg_ip(media_cfg, name, None, false, cur),
                    None => leg_ip(media_cfg, name, from_v4, false, cur),
                }
            }
        };
        let wanted = [want(Side::A)?, want(Side::B)?];
        if let (Phase::Answer, Some(cur)) = (phase, current) {
            // The answer's sender already has its address in the offer: its leg cannot move.
            let (was, now) = (cur[s].ip(), wanted[s]);
            if was != now {
                let describe = |ip: IpAddr| match media_cfg.interface_of(ip) {
                    Some(i) => format!("{} on interface {:?}", i.advertised(), i.name),
                    None => ip.to_string(),
                };
                return Err(InterfaceError::AnswerMoves(describe(now), describe(was)).into());
            }
        }
        let m = &mut call.media[i];
        // A party that moved interface or family gets a new socket: the section's relays are
        // made again, the other party keeping its port and signalled address.
        let moved = m.active && (m.local[0].ip() != wanted[0] || m.local[1].ip() != wanted[1]);
        // Call control (`block media` and the like) outlives the move.
        let before = model.relays.get(&rtp_id).cloned();
        if moved {
            model.delete_relay(&rtp_id)?;
            if m.rtcp {
                model.delete_relay(&rtcp_id)?;
                m.rtcp = false;
            }
            m.active = false;
        }
        if !m.active {
            // New section: two RTP locals (their odd neighbours are free for RTCP).
            let keep = |x: usize| moved && m.local[x].ip() == wanted[x];
            let la = if keep(0) { m.local[0] } else { allocate_on(model, media_cfg, wanted[0], &[])? };
            let lb = if keep(1) { m.local[1] } else { allocate_on(model, media_cfg, wanted[1], &[la, rtcp_addr(la)])? };
            m.local = [la, lb];
            if !moved {
                m.peer = [None, None];
                m.peer_rtcp = [None, None];
            }
            m.peer[s] = sig.rtp;
            let blank = |local| LegSpec { local, remote: None, strict: false, rtp: true, follow: Follow::default() };
            model.create_relay(&rtp_id, blank(la), blank(lb))?;
            model.set_leg_signal(&rtp_id, from, LegSignal { clock_rate: sig.clock_rate, ..signal(sig.rtp, sig.rtp.is_none()) })?;
            let o = ix(other(from));
            if moved && m.peer[o].is_some() {
                model.set_leg_signal(&rtp_id, other(from), signal(m.peer[o], false))?;
            }
            m.active = true;
            m.rtcp = false;
            if let (true, Some(r)) = (moved, &before) {
                model.set_media_control(&rtp_id, None, r.control)?;
                model.set_media_control(&rtp_id, Some(Side::A), r.a.control)?;
                model.set_media_control(&rtp_id, Some(Side::B), r.b.control)?;
                let o = other(from);
                model.set_leg_telephone_events(&rtp_id, o, r.leg(o).telephone_events.clone())?;
            }
            changes.push(Change::Relay(rtp_id.clone()));
        } else {
            model.set_leg_signal(&rtp_id, from, LegSignal { clock_rate: sig.clock_rate, ..signal(sig.rtp, sig.rtp.is_none()) })?;
            m.peer[s] = sig.rtp;
            changes.push(Change::Relay(rtp_id.clone()));
        }
        model.set_leg_telephone_events(&rtp_id, from, sig.telephone_events.clone())?;
        model.set_report_dtmf(&rtp_id, opts.report_dtmf)?;
        m.peer_rtcp[s] = sig.rtcp;
        m.kind.clone_from(&sig.kind);
        m.proto.clone_from(&sig.proto);
        let want_rtcp = match phase {
            Phase::Offer => {
                m.mux_offered = sig.mux;
                // Keep RTP and RTCP together only if they already were and still are offered so.
                !(sig.mux && m.mux && m.active && !m.rtcp)
            }
            Phase::Answer => {
                m.mux = sig.mux && m.mux_offered;
                !m.mux
            }
        };
        if phase == Phase::Offer && want_rtcp {
            m.mux = false;
        }
        // `rtcp-mux-demux`: an offerer that multiplexes gets its RTCP demultiplexed toward a
        // receiver offered none; that stays so while the receiver answers or re-offers without
        // it, and the offerer answers with it.
        let demux = match phase {
            Phase::Offer if opts.rtcp_demux && sig.mux => Some(other(from)),
            Phase::Offer if m.demux == Some(from) && !sig.mux => Some(from),
            Phase::Answer if m.demux == Some(from) => Some(from),
            Phase::Answer if m.demux == Some(other(from)) && sig.mux => Some(other(from)),
            _ => None,
        };
        m.demux = demux;
        let want_rtcp = if demux.is_some() {
            (m.mux, m.mux_offered) = (false, false);
            false
        } else {
            // Its address goes before an RTCP relay claims it.
            if model.clear_rtcp_demux(&rtp_id)? {
                changes.push(Change::Relay(rtp_id.clone()));
            }
            want_rtcp
        };
        match (want_rtcp, m.rtcp) {
            (true, false) => {
                let [pa, pb] = m.peer_rtcp;
                let spec = |local: SocketAddr, remote: Option<SocketAddr>| LegSpec {
                    local: rtcp_addr(local),
                    remote,
                    strict: false,
                    rtp: true,
                    follow: Follow::default(),
                };
                model.create_relay(&rtcp_id, spec(m.local[0], pa), spec(m.local[1], pb))?;
                // The RTCP legs know their media's clock rates too: the reports' jitter is in
                // timestamp units (see `SessionManager::on_rtcp`).
                if let (Some(rtp), Some(rtcp)) = (model.relays.get(&rtp_id).cloned(), model.relays.get_mut(&rtcp_id)) {
                    (rtcp.a.clock_rate, rtcp.b.clock_rate) = (rtp.a.clock_rate, rtp.b.clock_rate);
                }
                model.set_leg_signal(&rtcp_id, from, LegSignal { clock_rate: sig.clock_rate, ..signal(m.peer_rtcp[s], sig.rtp.is_none()) })?;
                let o = ix(other(from));
                if moved && m.peer_rtcp[o].is_some() {
                    model.set_leg_signal(&rtcp_id, other(from), signal(m.peer_rtcp[o], false))?;
                }
                m.rtcp = true;
                changes.push(Change::Relay(rtcp_id));
            }
            (true, true) => {
                model.set_leg_signal(&rtcp_id, from, LegSignal { clock_rate: sig.clock_rate, ..signal(m.peer_rtcp[s], sig.rtp.is_none()) })?;
                changes.push(Change::Relay(rtcp_id));
            }
            (false, true) => {
                model.delete_relay(&rtcp_id)?;
                m.rtcp = false;
                changes.push(Change::Relay(rtcp_id));
            }
            (false, false) => {}
        }
        if let Some(d) = demux {
            model.set_rtcp_demux(&rtp_id, d, rtcp_addr(m.local[ix(d)]), m.peer_rtcp[ix(d)])?;
            changes.push(Change::Relay(rtp_id.clone()));
        }
    }
    // Every offer and answer re-opens learning on both parties' legs (rtpengine does the same):
    // a re-INVITE may move either, and NAT bindings change with them.
    let until = opts.at_ms + media_cfg.learning_ms;
    for (i, m) in call.media.iter().enumerate().filter(|(_, m)| m.active) {
        let ids = std::iter::once(rtp_relay_id(&call.key, i)).chain(m.rtcp.then(|| rtcp_relay_id(&call.key, i)));
        for id in ids {
            model.open_learning(&id, Side::A, until)?;
            model.open_learning(&id, Side::B, until)?;
            if !changes.contains(&Change::Relay(id.clone())) {
                changes.push(Change::Relay(id));
            }
        }
    }
    Ok(changes)
}

/// The flags of an offer or answer that shape its sender's leg, and when it came.
#[derive(Debug, Clone, Default)]
pub struct SignalOptions {
    /// `strict-source`, `media-handover`, `asymmetric`, or the default learning window.
    pub follow: Follow,
    /// Unix milliseconds: the learning windows it opens start here.
    pub at_ms: u64,
    pub placement: Placement,
    /// The section's RFC 4733 events are reported ([`mediaplane_core::model::Relay::report_dtmf`]).
    pub report_dtmf: bool,
    /// `rtcp-mux: [demux]` (`rtcp-mux-demux`): an offer that multiplexes RTCP goes on without
    /// it ([`MediaState::demux`]).
    pub rtcp_demux: bool,
}

/// Where the parties' legs live (rtpengine's `direction`, `from-interface`/`to-interface`,
/// `address-family`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// The media interface facing each party [A, B]; `None`: where its leg already is, or the
    /// default interface for a new one.
    pub interface: [Option<String>; 2],
    /// `address-family` (true: IPv4) of the SDP going out, so of the receiving party's leg;
    /// `None`: that leg keeps its family, or a new one takes the sender's.
    pub out_v4: Option<bool>,
}

/// The address of a leg on interface `name` (`None`: the one it is on, or the default) in
/// family `v4` when given. `hard`: the family is required (it is the party's own, or asked
/// for); otherwise an interface without it gives what it has.
fn leg_ip(cfg: &MediaConfig, name: Option<&str>, v4: Option<bool>, hard: bool, current: Option<IpAddr>) -> Result<IpAddr, ManagerError> {
    if let Some(cur) = current {
        let same_interface = name.is_none_or(|n| cfg.interface_of(cur).is_some_and(|i| i.name == n));
        if same_interface && v4.is_none_or(|v4| cur.is_ipv4() == v4) {
            return Ok(cur);
        }
    }
    let name = name.map(str::to_string).or_else(|| current.and_then(|c| cfg.interface_of(c)).map(|i| i.name));
    match cfg.interface_address(name.as_deref(), v4) {
        Ok(i) => Ok(i.ip),
        Err(InterfaceError::NoFamily(..)) if !hard => Ok(cfg.interface_address(name.as_deref(), None)?.ip),
        Err(e) => Err(e.into()),
    }
}

/// An active audio section between two parties (for tests).
#[cfg(test)]
pub(crate) fn media_between(a: SocketAddr, b: SocketAddr) -> MediaState {
    let sig = MediaSignal {
        kind: "audio".into(),
        proto: "RTP/AVP".into(),
        disabled: false,
        rtp: None,
        rtcp: None,
        mux: false,
        clock_rate: None,
        telephone_events: Vec::new(),
    };
    MediaState { active: true, peer: [Some(a), Some(b)], ..inactive(&sig) }
}

fn inactive(sig: &MediaSignal) -> MediaState {
    let unspecified = SocketAddr::new(IpAddr::from([0, 0, 0, 0]), 0);
    MediaState {
        kind: sig.kind.clone(),
        proto: sig.proto.clone(),
        active: false,
        local: [unspecified; 2],
        rtcp: false,
        peer: [None; 2],
        peer_rtcp: [None; 2],
        mux_offered: false,
        mux: false,
        demux: None,
        proto_of: Default::default(),
        formats_of: Default::default(),
        sdes: Default::default(),
        translated: false,
        webrtc: Default::default(),
        bundle: None,
    }
}

fn remove_media(model: &mut Model, call: &mut Call, i: usize, changes: &mut Vec<Change>) -> Result<(), ManagerError> {
    let key = call.key.clone();
    let m = &mut call.media[i];
    if m.active {
        model.delete_relay(&rtp_relay_id(&key, i))?;
        changes.push(Change::Relay(rtp_relay_id(&key, i)));
        if m.rtcp {
            model.delete_relay(&rtcp_relay_id(&key, i))?;
            changes.push(Change::Relay(rtcp_relay_id(&key, i)));
        }
    }
    m.active = false;
    m.rtcp = false;
    m.demux = None;
    m.peer = [None; 2];
    m.peer_rtcp = [None; 2];
    Ok(())
}

/// Remove every relay of `call` from the model (relays already gone are skipped).
pub fn delete_call(model: &mut Model, call: &Call) -> Result<Vec<Change>, ManagerError> {
    let mut changes = Vec::new();
    for id in call.relay_ids() {
        if model.relays.contains_key(&id) {
            model.delete_relay(&id)?;
            changes.push(Change::Relay(id));
        }
    }
    Ok(changes)
}

/// Stream ids (leg uids) of a call's relays, for counters.
pub fn stream_ids(model: &Model, call: &Call) -> Vec<u32> {
    leg_uids(&call_relays(model, call))
}

/// The relays of `call` in the model ([`Call::relay_ids`]), each with whether it carries RTCP:
/// looked up once where several things are read of them (a sweep over every call reads each
/// call's counters, traffic and last packet).
pub fn call_relays<'m>(model: &'m Model, call: &Call) -> Vec<(&'m Relay, bool)> {
    let mut out = Vec::new();
    for (i, m) in call.media.iter().enumerate().filter(|(_, m)| m.active) {
        out.extend(model.relays.get(&rtp_relay_id(&call.key, i)).map(|r| (r, false)));
        if m.rtcp {
            out.extend(model.relays.get(&rtcp_relay_id(&call.key, i)).map(|r| (r, true)));
        }
    }
    out
}

/// The stream ids (leg uids) of `relays`.
pub fn leg_uids(relays: &[(&Relay, bool)]) -> Vec<u32> {
    // A party's RTCP kept apart (`rtcp-mux-demux`) is a stream of its RTP relay.
    relays.iter().flat_map(|(r, _)| [Some(r.a.uid), Some(r.b.uid), r.rtcp_demux.as_ref().map(|d| d.uid)]).flatten().collect()
}

/// Calls by key (hash of the Call-ID).
#[derive(Debug, Default)]
pub struct Registry {
    calls: HashMap<String, Call>,
}

impl Registry {
    pub fn get(&self, call_id: &str) -> Option<&Call> {
        self.calls.get(&call_key(call_id))
    }

    pub fn by_key(&self, key: &str) -> Option<&Call> {
        self.calls.get(key)
    }

    pub fn insert(&mut self, call: Call) {
        self.calls.insert(call.key.clone(), call);
    }

    pub fn remove(&mut self, key: &str) -> Option<Call> {
        self.calls.remove(key)
    }

    pub fn len(&self) -> usize {
        self.calls.len()
    }

    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    pub fn calls(&self) -> impl Iterator<Item = &Call> {
        self.calls.values()
    }

    pub fn calls_mut(&mut self) -> impl Iterator<Item = &mut Call> {
        self.calls.values_mut()
    }

    /// Rebuild calls from relays this crate created (after a restart, the store still has the
    /// relays but the registry is gone). Call-IDs and tags are unknown until signalled again;
    /// such calls can still be deleted by Call-ID and time out like any other.
    pub fn adopt(&mut self, model: &Model, now: Instant) -> usize {
        let mut found: BTreeMap<String, BTreeMap<usize, (bool, bool)>> = BTreeMap::new();
        for id in model.relays.keys() {
            if let Some((key, i, rtcp)) = parse_relay_id(id) {
                let e = found.entry(key).or_default().entry(i).or_default();
                if rtcp {
                    e.1 = true;
                } else {
                    e.0 = true;
                }
            }
        }
        let mut n = 0;
        for (key, medias) in found {
            if self.calls.contains_key(&key) {
                continue;
            }
            let mut call = Call::new("", now);
            call.key = key.clone();
            call.answered = true;
            let len = medias.keys().max().map_or(0, |m| m + 1);
            for i in 0..len {
                let sig = MediaSignal {
                    kind: "audio".into(),
                    proto: "RTP/AVP".into(),
                    disabled: true,
                    rtp: None,
                    rtcp: None,
                    mux: false,
                    clock_rate: None,
                    telephone_events: Vec::new(),
                };
                let mut m = inactive(&sig);
                if let Some(&(true, rtcp)) = medias.get(&i) {
                    let r = &model.relays[&rtp_relay_id(&key, i)];
                    m.active = true;
                    m.local = [r.a.local, r.b.local];
                    m.peer = [r.a.remote, r.b.remote];
                    m.rtcp = rtcp;
                    m.mux = !rtcp;
                    if let Some(c) = model.relays.get(&rtcp_relay_id(&key, i)).filter(|_| rtcp) {
                        m.peer_rtcp = [c.a.remote, c.b.remote];
                    }
                    // A section on another's transport stays there (answers to its party name
                    // the group again).
                    m.bundle = [Side::A, Side::B].into_iter().find_map(|side| {
                        let b = r.leg(side).bundled.as_ref()?;
                        let (_, head, _) = parse_relay_id(&b.relay)?;
                        Some(crate::webrtc::SectionBundle { side, head, ssrc: b.ssrc })
                    });
                }
                call.media.push(m);
            }
            self.calls.insert(key, call);
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn media() -> MediaConfig {
        MediaConfig { ip: "127.80.0.1".parse().unwrap(), port_min: 30000, port_max: 30100, ..Default::default() }
    }

    fn sig(rtp: &str, mux: bool) -> MediaSignal {
        let rtp: SocketAddr = rtp.parse().unwrap();
        MediaSignal {
            kind: "audio".into(),
            proto: "RTP/AVP".into(),
            disabled: false,
            rtp: Some(rtp),
            rtcp: Some(rtcp_addr(rtp)),
            mux,
            clock_rate: None,
            telephone_events: Vec::new(),
        }
    }

    #[test]
    fn relay_ids_round_trip() {
        let k = call_key("a84b4c76e66710@pc33.atlanta.com");
        assert_eq!(k.len(), 16);
        assert_eq!(parse_relay_id(&rtp_relay_id(&k, 3)), Some((k.clone(), 3, false)));
        assert_eq!(parse_relay_id(&rtcp_relay_id(&k, 0)), Some((k.clone(), 0, true)));
        assert_eq!(parse_relay_id("ng-xyz-1"), None);
        assert_eq!(parse_relay_id("call-1"), None);
        assert_ne!(call_key("a"), call_key("b"));
    }

    #[test]
    fn offer_answer_reinvite_and_delete() {
        let mut model = Model::new();
        let t = Instant::now();
        let mut call = Call::new("c1", t);
        // Offer from A with one audio and one video section.
        let offer = vec![sig("10.1.0.1:6000", false), MediaSignal { kind: "video".into(), ..sig("10.1.0.1:6002", false) }];
        apply_signal(&mut model, &media(), &mut call, Side::A, Phase::Offer, &offer, &SignalOptions::default()).unwrap();
        assert_eq!(model.relays.len(), 4, "RTP and RTCP for each section");
        let m0 = call.media[0].clone();
        assert_eq!(m0.local[0].port() % 2, 0);
        assert_eq!(m0.local[1].port() % 2, 0);
        assert_ne!(m0.local[0], m0.local[1]);
        let r = &model.relays[&rtp_relay_id(&call.key, 0)];
        assert_eq!(r.a.remote, Some("10.1.0.1:6000".parse().unwrap()));
        assert_eq!(r.b.remote, None);
        let c = &model.relays[&rtcp_relay_id(&call.key, 0)];
        assert_eq!(c.a.local.port(), m0.local[0].port() + 1);
        assert_eq!(c.a.remote, Some("10.1.0.1:6001".parse().unwrap()));

        // Answer from B rejects video.
        let answer = vec![sig("10.2.0.1:7000", false), MediaSignal { disabled: true, rtp: None, rtcp: None, ..sig("10.2.0.1:7002", false) }];
        apply_signal(&mut model, &media(), &mut call, Side::B, Phase::Answer, &answer, &SignalOptions::default()).unwrap();
        assert_eq!(model.relays.len(), 2);
        assert_eq!(model.relays[&rtp_relay_id(&call.key, 0)].b.remote, Some("10.2.0.1:7000".parse().unwrap()));
        assert!(!call.media[1].active);

        // Re-INVITE from B moves its media; the ports stay.
        let before = call.media[0].local;
        apply_signal(&mut model, &media(), &mut call, Side::B, Phase::Offer, &[sig("10.2.0.9:7100", false)], &SignalOptions::default()).unwrap();
        assert_eq!(call.media.len(), 1);
        assert_eq!(call.media[0].local, before);
        assert_eq!(model.relays[&rtp_relay_id(&call.key, 0)].b.remote, Some("10.2.0.9:7100".parse().unwrap()));
        assert_eq!(model.relays[&rtcp_relay_id(&call.key, 0)].b.remote, Some("10.2.0.9:7101".parse().unwrap()));

        delete_call(&mut model, &call).unwrap();
        assert!(model.relays.is_empty());
        assert_eq!(model.local_addresses().count(), 0);
    }

    #[test]
    fn rtcp_mux_accepted_drops_the_rtcp_relay() {
        let mut model = Model::new();
        let mut call = Call::new("c2", Instant::now());
        apply_signal(&mut model, &media(), &mut call, Side::A, Phase::Offer, &[sig("10.1.0.1:6000", true)], &SignalOptions::default()).unwrap();
        assert!(call.media[0].rtcp, "until the answer accepts mux, RTCP gets its own relay");
        apply_signal(&mut model, &media(), &mut call, Side::B, Phase::Answer, &[sig("10.2.0.1:7000", true)], &SignalOptions::default()).unwrap();
        assert!(call.media[0].mux && !call.media[0].rtcp);
        assert_eq!(model.relays.len(), 1);
        // A re-offer with mux keeps it muxed; one without brings the RTCP relay back.
        apply_signal(&mut model, &media(), &mut call, Side::A, Phase::Offer, &[sig("10.1.0.1:6000", true)], &SignalOptions::default()).unwrap();
        assert_eq!(model.relays.len(), 1);
        apply_signal(&mut model, &media(), &mut call, Side::A, Phase::Offer, &[sig("10.1.0.1:6000", false)], &SignalOptions::default()).unwrap();
        assert_eq!(model.relays.len(), 2);
    }

    #[test]
    fn strict_source_pins_the_signalled_peer() {
        let mut model = Model::new();
        let mut call = Call::new("c3", Instant::now());
        apply_signal(
            &mut model,
            &media(),
            &mut call,
            Side::A,
            Phase::Offer,
            &[sig("10.1.0.1:6000", false)],
            &SignalOptions { follow: Follow::Strict, ..Default::default() },
        )
        .unwrap();
        let r = &model.relays[&rtp_relay_id(&call.key, 0)];
        assert_eq!((r.a.follow, r.b.follow), (Follow::Strict, Follow::Window));
    }

    #[test]
    fn adopt_rebuilds_calls_from_relays() {
        let mut model = Model::new();
        let mut call = Call::new("c4", Instant::now());
        apply_signal(&mut model, &media(), &mut call, Side::A, Phase::Offer, &[sig("10.1.0.1:6000", false)], &SignalOptions::default()).unwrap();
        let mut reg = Registry::default();
        assert_eq!(reg.adopt(&model, Instant::now()), 1);
        let adopted = reg.get("c4").unwrap();
        assert_eq!(adopted.media[0].local, call.media[0].local);
        assert_eq!(adopted.relay_ids(), call.relay_ids());
        assert_eq!(reg.adopt(&model, Instant::now()), 0, "idempotent");
    }

    /// A section on another's transport (BUNDLE) is adopted as one.
    #[test]
    fn adopt_keeps_what_is_bundled() {
        let mut model = Model::new();
        let mut call = Call::new("c5", Instant::now());
        let sigs = [sig("10.1.0.1:6000", true), sig("10.1.0.1:6000", true)];
        apply_signal(&mut model, &media(), &mut call, Side::A, Phase::Offer, &sigs, &SignalOptions::default()).unwrap();
        model.set_leg_ice(&rtp_relay_id(&call.key, 0), Side::A, true).unwrap();
        let with = mediaplane_core::model::Bundled { relay: rtp_relay_id(&call.key, 0), ssrc: 42 };
        model.bundle_leg(&rtp_relay_id(&call.key, 1), Side::A, with).unwrap();
        let mut reg = Registry::default();
        reg.adopt(&model, Instant::now());
        let adopted = reg.get("c5").unwrap();
        assert_eq!(adopted.media[0].bundle, None);
        assert_eq!(adopted.media[1].bundle, Some(crate::webrtc::SectionBundle { side: Side::A, head: 0, ssrc: 42 }));
        assert_eq!(adopted.media[1].local[0], adopted.media[0].local[0]);
    }

    #[test]
    fn media_addresses_follow_the_address_policy() {
        let body = b"v=0\r\nc=IN IP4 10.1.0.1\r\nm=audio 6000 RTP/AVP 0\r\na=rtcp:6011 IN IP4 10.1.0.2\r\nm=audio 0 RTP/AVP 0\r\nm=audio 6020 RTP/AVP 0\r\nc=IN IP4 0.0.0.0\r\n";
        let sdp = Sdp::parse(body).unwrap();
        let s = media_signals(&sdp, &AddressPolicy::default(), false).unwrap();
        assert_eq!(s[0].rtp, Some("10.1.0.1:6000".parse().unwrap()));
        assert_eq!(s[0].rtcp, Some("10.1.0.2:6011".parse().unwrap()));
        assert!(s[1].disabled);
        assert_eq!((s[2].rtp, s[2].rtcp), (None, None), "zero address: on hold");
        let src: IpAddr = "192.0.2.1".parse().unwrap();
        let p = AddressPolicy { sip_source: true, received_from: Some(src), media_address: None };
        let s = media_signals(&sdp, &p, false).unwrap();
        assert_eq!(s[0].rtp, Some("192.0.2.1:6000".parse().unwrap()));
        assert_eq!(s[0].rtcp, Some("192.0.2.1:6011".parse().unwrap()));
        let p = AddressPolicy { media_address: Some("192.0.2.9".parse().unwrap()), ..p };
        assert_eq!(media_signals(&sdp, &p, false).unwrap()[0].rtp, Some("192.0.2.9:6000".parse().unwrap()));
        let bad = Sdp::parse(b"v=0\r\nm=audio 6000 RTP/AVP 0\r\n").unwrap();
        assert_eq!(media_signals(&bad, &AddressPolicy::default(), false), Err(SignalError::NoAddress(0)));
    }

    fn two_interfaces() -> MediaConfig {
        let interfaces = ["internal/10.0.0.1", "external/203.0.113.1!198.51.100.1", "external/2001:db8::1"];
        MediaConfig { interfaces: interfaces.iter().map(|i| i.to_string().try_into().unwrap()).collect(), ..media() }
    }

    fn placed(from: Option<&str>, to: Option<&str>, out_v4: Option<bool>, sender: Side) -> SignalOptions {
        let mut interface: [Option<String>; 2] = Default::default();
        interface[ix(sender)] = from.map(str::to_string);
        interface[ix(other(sender))] = to.map(str::to_string);
        SignalOptions { placement: Placement { interface, out_v4 }, ..Default::default() }
    }

    fn ips(call: &Call) -> [IpAddr; 2] {
        [call.media[0].local[0].ip(), call.media[0].local[1].ip()]
    }

    #[test]
    fn each_party_gets_a_leg_on_its_interface_and_family() {
        let cfg = two_interfaces();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut model = Model::new();
        let mut call = Call::new("if1", Instant::now());
        // The caller is inside, the callee outside on IPv6 (address-family=IP6).
        let opts = placed(Some("internal"), Some("external"), Some(false), Side::A);
        apply_signal(&mut model, &cfg, &mut call, Side::A, Phase::Offer, &[sig("10.1.0.1:6000", false)], &opts).unwrap();
        assert_eq!(ips(&call), [ip("10.0.0.1"), ip("2001:db8::1")]);
        let rtcp = &model.relays[&rtcp_relay_id(&call.key, 0)];
        assert_eq!((rtcp.a.local.ip(), rtcp.b.local.ip()), (ip("10.0.0.1"), ip("2001:db8::1")));
        // The answer names the interfaces the other way round (its sender first).
        let answer = placed(Some("external"), Some("internal"), None, Side::B);
        apply_signal(&mut model, &cfg, &mut call, Side::B, Phase::Answer, &[sig("[2001:db8::9]:7000", false)], &answer).unwrap();
        assert_eq!(model.relays[&rtp_relay_id(&call.key, 0)].b.remote, Some("[2001:db8::9]:7000".parse().unwrap()));
        // A re-INVITE without interfaces keeps both legs where they are.
        let before = call.media[0].local;
        apply_signal(&mut model, &cfg, &mut call, Side::A, Phase::Offer, &[sig("10.1.0.1:6002", false)], &SignalOptions::default()).unwrap();
        assert_eq!(call.media[0].local, before);
        // Without address-family, a new callee leg takes the caller's family; an interface
        // without it gives what it has.
        let mut c2 = Call::new("if2", Instant::now());
        apply_signal(
            &mut model,
            &cfg,
            &mut c2,
            Side::A,
            Phase::Offer,
            &[sig("10.1.0.2:6000", false)],
            &placed(Some("internal"), Some("external"), None, Side::A),
        )
        .unwrap();
        assert_eq!(ips(&c2), [ip("10.0.0.1"), ip("203.0.113.1")]);
        let mut c3 = Call::new("if3", Instant::now());
        apply_signal(
            &mut model,
            &cfg,
            &mut c3,
            Side::A,
            Phase::Offer,
            &[sig("[2001:db8::5]:6000", false)],
            &placed(Some("external"), Some("internal"), None, Side::A),
        )
        .unwrap();
        assert_eq!(ips(&c3), [ip("2001:db8::1"), ip("10.0.0.1")]);
    }

    #[test]
    fn an_offer_moves_a_party_and_an_answer_cannot() {
        let cfg = two_interfaces();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut model = Model::new();
        let mut call = Call::new("mv", Instant::now());
        apply_signal(
            &mut model,
            &cfg,
            &mut call,
            Side::A,
            Phase::Offer,
            &[sig("10.1.0.1:6000", false)],
            &placed(Some("internal"), Some("external"), None, Side::A),
        )
        .unwrap();
        apply_signal(&mut model, &cfg, &mut call, Side::B, Phase::Answer, &[sig("10.2.0.1:7000", false)], &SignalOptions::default()).unwrap();
        let callee_port = call.media[0].local[1];
        // The caller re-INVITEs from IPv6: its leg moves to the external IPv6 address; the
        // callee keeps its port and its signalled address, RTCP included.
        apply_signal(&mut model, &cfg, &mut call, Side::A, Phase::Offer, &[sig("[2001:db8::7]:6000", false)], &placed(Some("external"), None, None, Side::A))
            .unwrap();
        assert_eq!(ips(&call), [ip("2001:db8::1"), ip("203.0.113.1")]);
        assert_eq!(call.media[0].local[1], callee_port);
        let r = &model.relays[&rtp_relay_id(&call.key, 0)];
        assert_eq!((r.a.remote, r.b.remote), (Some("[2001:db8::7]:6000".parse().unwrap()), Some("10.2.0.1:7000".parse().unwrap())));
        let c = &model.relays[&rtcp_relay_id(&call.key, 0)];
        assert_eq!(c.b.remote, Some("10.2.0.1:7001".parse().unwrap()));
        // An answer from IPv6 to the IPv4 address it was offered: refused, nothing changes.
        let mut copy = model.clone();
        let mut call2 = call.clone();
        apply_signal(&mut copy, &cfg, &mut call2, Side::A, Phase::Offer, &[sig("10.1.0.1:6000", false)], &placed(Some("internal"), None, None, Side::A))
            .unwrap();
        let e = apply_signal(&mut copy, &cfg, &mut call2, Side::B, Phase::Answer, &[sig("[2001:db8::9]:7000", false)], &SignalOptions::default()).unwrap_err();
        assert!(e.to_string().contains("its sender was offered 198.51.100.1 on interface \"external\""), "{e}");
        // Unknown interfaces and missing families are errors naming them.
        let mut c = Call::new("bad", Instant::now());
        let e = apply_signal(&mut model, &cfg, &mut c, Side::A, Phase::Offer, &[sig("10.1.0.1:6000", false)], &placed(Some("dmz"), None, None, Side::A))
            .unwrap_err();
        assert_eq!(e.to_string(), "no media interface is named \"dmz\" (configured: internal, external)");
        let e = apply_signal(
            &mut model,
            &cfg,
            &mut c,
            Side::A,
            Phase::Offer,
            &[sig("10.1.0.1:6000", false)],
            &placed(None, Some("internal"), Some(false), Side::A),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "media interface \"internal\" has no IPv6 address");
    }
}
