//! Model operations the SIP relay (NG protocol) needs beyond the basic ones in `model.rs`.

use crate::model::{Bundled, DemuxedRtcp, DtmfEvent, Follow, Fork, MediaControl, Model, ModelError, Side};
use crate::srtp::LegSrtp;
use std::net::SocketAddr;

impl Model {
    /// Change what is signalled for one leg of a relay (a re-INVITE's new SDP). A moved
    /// address is sent to at once (what was latched is forgotten, and the old address only
    /// wins back while the new one has not been heard: see [`Model::latch`]). `remote: None`
    /// with `held`: the party is on hold; its address stays for when it comes back.
    pub fn set_leg_signal(&mut self, id: &str, side: Side, signal: LegSignal) -> Result<(), ModelError> {
        let r = self.relays.get_mut(id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.to_string() })?;
        let leg = match side {
            Side::A => &mut r.a,
            Side::B => &mut r.b,
        };
        if let Some(addr) = signal.remote {
            if addr.is_ipv4() != leg.local.is_ipv4() {
                return Err(ModelError::FamilyMismatch(format!("relay {id}")));
            }
        }
        if signal.clock_rate.is_some() {
            leg.clock_rate = signal.clock_rate;
        }
        if leg.ice {
            // Its SDP's address means nothing (ICE nominates one): see [`Model::set_leg_ice`].
            return Ok(());
        }
        leg.held = signal.held;
        // Signalling expresses strict-source as Follow::Strict; `strict` (only `remote` may
        // send) is the API's, and a signal ends it (a leg stored by an older version had it).
        leg.strict = false;
        leg.follow = signal.follow;
        if signal.held || leg.remote == signal.remote {
            return Ok(());
        }
        if leg.remote.is_some() || leg.latched.is_some() {
            leg.learning.superseded = leg.latched.or(leg.remote);
        }
        leg.learning.heard_signalled = false;
        leg.latched = None;
        leg.remote = signal.remote;
        Ok(())
    }

    /// Record a relay's packets (both directions) or stop; true if that changed anything.
    pub fn set_relay_record(&mut self, id: &str, record: bool) -> Result<bool, ModelError> {
        let r = self.relays.get_mut(id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.to_string() })?;
        let changed = r.record != record;
        r.record = record;
        Ok(changed)
    }

    /// Make a leg an ICE + DTLS-SRTP one (a WebRTC party, [`crate::model::Leg::ice`]) or a plain
    /// one again; true if that changed anything. Turning it on forgets the signalled and
    /// latched addresses: only a nomination ([`Model::set_leg_nominated`]) gives it a peer.
    /// Store an ICE leg's credentials ([`crate::model::Leg::ice_credentials`]); true if changed.
    pub fn set_leg_ice_credentials(&mut self, id: &str, side: Side, credentials: Option<crate::model::IceCredentials>) -> Result<bool, ModelError> {
        let leg = self.leg_mut(id, side)?;
        let changed = leg.ice_credentials != credentials;
        leg.ice_credentials = credentials;
        Ok(changed)
    }

    pub fn set_leg_ice(&mut self, id: &str, side: Side, ice: bool) -> Result<bool, ModelError> {
        let leg = self.leg_mut(id, side)?;
        if leg.ice == ice {
            return Ok(false);
        }
        leg.ice = ice;
        if ice {
            leg.remote = None;
            leg.latched = None;
            leg.held = false;
            leg.strict = true;
        } else {
            leg.strict = false;
        }
        Ok(true)
    }

    /// The address an ICE leg's peer nominated (None: its consent expired); true if that
    /// changed anything. Refused for a leg that is not an ICE leg.
    pub fn set_leg_nominated(&mut self, id: &str, side: Side, addr: Option<SocketAddr>) -> Result<bool, ModelError> {
        let leg = self.leg_mut(id, side)?;
        if !leg.ice {
            return Err(ModelError::Invalid(format!("relay {id}: leg {side:?} is not an ICE leg")));
        }
        if addr.is_some_and(|a| a.is_ipv4() != leg.local.is_ipv4()) {
            return Err(ModelError::FamilyMismatch(format!("relay {id}")));
        }
        let changed = leg.remote != addr;
        leg.remote = addr;
        // One transport: the legs bundled with it have its peer.
        for rid in self.bundled_with(id, side) {
            self.leg_mut(&rid, side)?.remote = addr;
        }
        Ok(changed)
    }

    /// The relays whose leg on `side` is bundled with relay `id`'s ([`Model::bundle_leg`]):
    /// what changes with that leg's peer and keys.
    pub fn bundled_with(&self, id: &str, side: Side) -> Vec<String> {
        self.relays.iter().filter(|(_, r)| r.leg(side).bundled.as_ref().is_some_and(|b| b.relay == id)).map(|(rid, _)| rid.clone()).collect()
    }

    /// Put leg `side` of relay `id` on the transport of `with.relay`'s leg on the same side (one
    /// more media section of a BUNDLE group, see [`Bundled`]): its address becomes that leg's
    /// (its own is released), it is an ICE leg with that leg's peer and keys, and it takes what
    /// the party sends with `with.ssrc`. True if that changed anything. Refused: a leg bundled
    /// with itself, with a leg that is not an ICE leg or is bundled itself, or elsewhere
    /// already; an SSRC another leg of the group takes.
    pub fn bundle_leg(&mut self, id: &str, side: Side, with: Bundled) -> Result<bool, ModelError> {
        let invalid = |why: String| Err(ModelError::Invalid(format!("relay {id}: leg {}: {why}", side.name())));
        if with.relay == id {
            return invalid("bundled with itself".into());
        }
        let first = self.relays.get(&with.relay).ok_or_else(|| ModelError::NotFound { kind: "relay", id: with.relay.clone() })?.leg(side).clone();
        if !first.ice || first.bundled.is_some() {
            return invalid(format!("relay {} is not the first ICE leg of a group", with.relay));
        }
        let taken = self
            .relays
            .iter()
            .find(|(rid, r)| rid.as_str() != id && r.leg(side).bundled.as_ref().is_some_and(|b| b.relay == with.relay && b.ssrc == with.ssrc));
        if let Some((other, _)) = taken {
            return Err(ModelError::IngressInUse { addr: first.local, ssrc: Some(with.ssrc), owner: format!("relay {other}/{}", side.name()) });
        }
        let leg = self.leg_mut(id, side)?;
        if let Some(b) = leg.bundled.as_ref().filter(|b| b.relay != with.relay) {
            return invalid(format!("bundled with relay {} already", b.relay));
        }
        let before = leg.clone();
        leg.local = first.local;
        leg.ice = true;
        leg.strict = true;
        leg.held = false;
        leg.latched = None;
        leg.remote = first.remote;
        leg.srtp = first.srtp.clone();
        // Its handshake is the first leg's: nothing of its own to resume after a restart.
        leg.ice_credentials = None;
        leg.bundled = Some(with);
        let changed = *leg != before;
        let owner = format!("relay {id}/{}", side.name());
        if before.local != first.local && self.owner_of(&before.local) == Some(owner.as_str()) {
            self.owners_remove(before.local);
        }
        Ok(changed)
    }

    /// The SRTP the relay terminates on one leg (None: the leg's media passes as it is); true if
    /// that changed anything.
    pub fn set_leg_srtp(&mut self, id: &str, side: Side, srtp: Option<LegSrtp>) -> Result<bool, ModelError> {
        let r = self.relays.get_mut(id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.to_string() })?;
        let leg = match side {
            Side::A => &mut r.a,
            Side::B => &mut r.b,
        };
        let changed = leg.srtp != srtp;
        let ice = leg.ice;
        leg.srtp = srtp.clone();
        if ice {
            for rid in self.bundled_with(id, side) {
                self.leg_mut(&rid, side)?.srtp = srtp.clone();
            }
        }
        Ok(changed)
    }
}

impl Model {
    /// Call control of a relay: of what one leg's peer sends (`Some(side)`), or of the whole
    /// relay (`None`, the call's, which adds to each leg's own); true if that changed anything.
    pub fn set_media_control(&mut self, id: &str, side: Option<Side>, control: MediaControl) -> Result<bool, ModelError> {
        let r = self.relays.get_mut(id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.to_string() })?;
        let slot = match side {
            None => &mut r.control,
            Some(Side::A) => &mut r.a.control,
            Some(Side::B) => &mut r.b.control,
        };
        let changed = *slot != control;
        *slot = control;
        Ok(changed)
    }

    /// Whether the DTMF events of a relay's parties are reported; true if that changed anything.
    pub fn set_report_dtmf(&mut self, id: &str, on: bool) -> Result<bool, ModelError> {
        let r = self.relays.get_mut(id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.to_string() })?;
        let changed = r.report_dtmf != on;
        r.report_dtmf = on;
        Ok(changed)
    }

    /// The `telephone-event` payload types a leg's peer signalled; true if that changed anything.
    pub fn set_leg_telephone_events(&mut self, id: &str, side: Side, mut payload_types: Vec<u8>) -> Result<bool, ModelError> {
        payload_types.sort_unstable();
        payload_types.dedup();
        let leg = self.leg_mut(id, side)?;
        let changed = leg.telephone_events != payload_types;
        leg.telephone_events = payload_types;
        Ok(changed)
    }
}

impl Model {
    /// Fork what one party of a relay sends (NG `subscribe request`): its address is claimed
    /// now, copies go once [`Model::set_fork_remote`] gives it a peer.
    pub fn add_fork(&mut self, id: &str, mut fork: Fork) -> Result<(), ModelError> {
        let r = self.relays.get(id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.to_string() })?;
        if fork.local.is_ipv4() != r.leg(fork.of).local.is_ipv4() {
            return Err(ModelError::FamilyMismatch(format!("relay {id}")));
        }
        if r.forks.iter().any(|f| f.tag == fork.tag && f.of == fork.of) {
            return Err(ModelError::Exists { kind: "fork", id: format!("{id}/{}", fork.tag) });
        }
        self.claim(fork.local, format!("relay {id}/fork {}", fork.tag))?;
        fork.uid = self.uid();
        self.relays.get_mut(id).expect("found above").forks.push(fork);
        Ok(())
    }

    /// Where a fork's copies go (the subscriber's answer); true if that changed anything.
    pub fn set_fork_remote(&mut self, id: &str, tag: &str, of: Side, remote: SocketAddr) -> Result<bool, ModelError> {
        let r = self.relays.get_mut(id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.to_string() })?;
        let f = r.forks.iter_mut().find(|f| f.tag == tag && f.of == of).ok_or_else(|| ModelError::NotFound { kind: "fork", id: format!("{id}/{tag}") })?;
        if remote.is_ipv4() != f.local.is_ipv4() {
            return Err(ModelError::FamilyMismatch(format!("relay {id} fork {tag}")));
        }
        let changed = f.remote != Some(remote);
        f.remote = Some(remote);
        Ok(changed)
    }

    /// End a relay's forks of one subscription, releasing their addresses; true if there were any.
    pub fn remove_forks(&mut self, id: &str, tag: &str) -> Result<bool, ModelError> {
        self.remove_forks_where(id, |f| f.tag == tag)
    }

    /// [`Model::remove_forks`] of one party's media only (`of`).
    pub fn remove_forks_of(&mut self, id: &str, tag: &str, of: Side) -> Result<bool, ModelError> {
        self.remove_forks_where(id, |f| f.tag == tag && f.of == of)
    }

    fn remove_forks_where(&mut self, id: &str, gone: impl Fn(&Fork) -> bool) -> Result<bool, ModelError> {
        let r = self.relays.get_mut(id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.to_string() })?;
        let (gone, kept): (Vec<Fork>, Vec<Fork>) = r.forks.drain(..).partition(|f| gone(f));
        r.forks = kept;
        for f in &gone {
            self.owners_remove(f.local);
        }
        Ok(!gone.is_empty())
    }
}

impl Model {
    /// `of`'s RTCP goes apart from its RTP while the other party multiplexes
    /// ([`DemuxedRtcp`]): its address `local` is claimed (kept if it is already this relay's),
    /// `remote` is its signalled RTCP peer. True if that changed anything.
    pub fn set_rtcp_demux(&mut self, id: &str, of: Side, local: SocketAddr, remote: Option<SocketAddr>) -> Result<bool, ModelError> {
        let r = self.relays.get(id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.to_string() })?;
        if local.is_ipv4() != r.leg(of).local.is_ipv4() || remote.is_some_and(|a| a.is_ipv4() != local.is_ipv4()) {
            return Err(ModelError::FamilyMismatch(format!("relay {id} rtcp")));
        }
        match &r.rtcp_demux {
            Some(d) if d.of == of && d.local == local => {
                let changed = d.remote != remote;
                let d = self.relays.get_mut(id).expect("found above").rtcp_demux.as_mut().expect("matched above");
                if changed {
                    // A new signalled address is followed afresh.
                    d.latched = None;
                }
                d.remote = remote;
                return Ok(changed);
            }
            Some(_) => {
                self.clear_rtcp_demux(id)?;
            }
            None => {}
        }
        self.claim(local, format!("relay {id}/rtcp"))?;
        let uid = self.uid();
        self.demuxed.insert(uid, id.to_string());
        self.relays.get_mut(id).expect("found above").rtcp_demux = Some(DemuxedRtcp { uid, of, local, remote, latched: None });
        Ok(true)
    }

    /// Both parties' RTCP goes the usual way again; its address is released. True if there was
    /// a [`DemuxedRtcp`].
    pub fn clear_rtcp_demux(&mut self, id: &str) -> Result<bool, ModelError> {
        let r = self.relays.get_mut(id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.to_string() })?;
        let Some(d) = r.rtcp_demux.take() else { return Ok(false) };
        self.owners_remove(d.local);
        self.demuxed.remove(&d.uid);
        Ok(true)
    }

    /// The relay and party a [`DemuxedRtcp`] ingress id belongs to.
    pub fn demuxed_rtcp_by_uid(&self, uid: u32) -> Option<(&str, &DemuxedRtcp)> {
        let id = self.demuxed.get(&uid)?;
        Some((id.as_str(), self.relays.get(id)?.rtcp_demux.as_ref()?))
    }

    /// RTCP from `source` reached a [`DemuxedRtcp`] that follows its party's source: followed
    /// while that party's RTP leg learns (its window is open, or it takes any source), as that
    /// leg follows its RTP. True if it changed.
    pub fn latch_demuxed_rtcp(&mut self, uid: u32, source: SocketAddr) -> Result<bool, ModelError> {
        let Some(id) = self.demuxed.get(&uid).cloned() else { return Ok(false) };
        let r = self.relays.get_mut(&id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.clone() })?;
        let Some(d) = r.rtcp_demux.as_mut() else { return Ok(false) };
        let leg = match d.of {
            Side::A => &r.a,
            Side::B => &r.b,
        };
        if !d.learns(leg) || source.port() == 0 || source.is_ipv4() != d.local.is_ipv4() || d.latched == Some(source) {
            return Ok(false);
        }
        d.latched = Some(source);
        Ok(true)
    }
}

impl Model {
    /// Queue a DTMF event into what one leg's peer sends (its `id` is given here); the id.
    pub fn queue_dtmf(&mut self, id: &str, side: Side, mut event: DtmfEvent) -> Result<u32, ModelError> {
        self.leg_mut(id, side)?;
        event.id = self.uid();
        self.leg_mut(id, side)?.dtmf.push(event);
        Ok(event.id)
    }

    /// Drop the DTMF events that must be over at `now_ms` (each starts no earlier than it was
    /// queued and than the one before ended; 5 s of slack for a party that paused). The relays
    /// that changed.
    pub fn expire_dtmf(&mut self, now_ms: u64) -> Vec<String> {
        const SLACK_MS: u64 = 5_000;
        let mut changed = Vec::new();
        let ids: Vec<String> = self.relays.iter().filter(|(_, r)| !r.a.dtmf.is_empty() || !r.b.dtmf.is_empty()).map(|(id, _)| id.clone()).collect();
        for id in ids {
            let r = self.relays.get_mut(&id).expect("listed");
            let mut any = false;
            for leg in [&mut r.a, &mut r.b] {
                let mut end = 0u64;
                let before = leg.dtmf.len();
                leg.dtmf.retain(|e| {
                    end = end.max(e.queued_ms) + u64::from(e.duration_ms) + u64::from(e.pause_ms);
                    end + SLACK_MS > now_ms
                });
                any |= leg.dtmf.len() != before;
            }
            if any {
                changed.push(id);
            }
        }
        changed
    }
}

/// What one SDP says of the party that sent it, for its leg.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LegSignal {
    pub remote: Option<SocketAddr>,
    pub follow: Follow,
    /// A zero connection address: on hold.
    pub held: bool,
    /// Clock rate of the first codec the party offers or answers (None: unknown, keep).
    pub clock_rate: Option<u32>,
}
