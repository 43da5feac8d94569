//! SDES-SRTP (RFC 4568) terminated per leg: a party speaking `RTP/SAVP` with `a=crypto` keys
//! bridged to one speaking plain `RTP/AVP`, as rtpengine does when asked with
//! `transport-protocol` (or the `RTP/AVP`, `RTP/SAVP`... flags).
//!
//! An offer whose sender speaks SRTP and whose receiver is to get plain RTP terminates SRTP
//! toward the sender: the relay takes the first `a=crypto` line it can speak as the sender's
//! key, and answers it later with a key of its own under the same tag. The other way round the
//! relay offers the receiver one key per suite it speaks and takes the one the answer accepts.
//! Both legs speaking SRTP is passthrough: nothing to translate, the kernel path keeps it.
//! Keys are kept across re-INVITEs, so an unchanged key keeps its SRTP session (RFC 4568 §7.1.4).
//!
//! [`plan`] decides from the SDP and the call (no side effects, so errors change nothing);
//! [`install`] writes the decision into the call and the relay legs inside the model mutation.

use crate::calls::{rtcp_relay_id, rtp_relay_id, side_index, Call, Phase};
use crate::sdp::{crypto_line, Sdp};
use mediaplane_control::manager::ManagerError;
use mediaplane_control::store::Change;
use mediaplane_core::model::Side;
use mediaplane_core::srtp::{LegSrtp, SrtpKey, SrtpSuite};
use mediaplane_core::Model;

/// SRTP the relay terminates toward one party of a media section.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SdesSide {
    /// The keys the relay gave this party, by `a=crypto` tag: one per suite in an offer, the
    /// accepted one in an answer.
    pub ours: Vec<(u32, SrtpKey)>,
    /// The party's own key and its tag (None until it has sent one: the answer to our offer).
    pub theirs: Option<(u32, SrtpKey)>,
}

impl SdesSide {
    /// The leg's keys: the party's, and ours under the same tag (before its answer, the first
    /// one offered).
    fn leg(&self) -> LegSrtp {
        let tag = self.theirs.as_ref().map(|(t, _)| *t);
        let ours = self.ours.iter().find(|(t, _)| Some(*t) == tag).or(self.ours.first());
        LegSrtp { inbound: self.theirs.as_ref().map(|(_, k)| k.clone()), outbound: ours.map(|(_, k)| k.clone()) }
    }
}

/// rtpengine's `SDES` options (the `SDES` list, or flags prefixed `SDES-`; names normalised:
/// lower case, `_` as `-`) that shape which suites the relay offers and accepts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SdesOptions {
    /// `no-SUITE`: neither offered nor taken from an offer.
    pub no: Vec<String>,
    /// `only-SUITE`: when any is given, only these (`no-` is then not looked at).
    pub only: Vec<String>,
    /// `nonew`: no suite the relay would add (an SRTP offer to a plain party needs none; a plain
    /// offer to an SRTP party then has nothing to offer, which is an error).
    pub nonew: bool,
    /// `order:A;B;…`: suites offered in this order first, then the rest.
    pub order: Vec<String>,
    /// `offerer_pref:A;B;…`: which of an SRTP offerer's keys the relay takes, in this order.
    pub offerer_pref: Vec<String>,
    /// `lifetime`: every key the relay gives carries the lifetime `2^31`.
    pub lifetime: bool,
    /// `pad`: the keys the relay gives keep their base64 `=` padding.
    pub pad: bool,
}

impl SdesOptions {
    /// The options of `SDES` values and `SDES-` flags; the second list holds those not acted on
    /// (`off`, session parameters, `static`, `prefer`…), as given.
    pub fn parse<'a>(values: impl IntoIterator<Item = &'a str>) -> (SdesOptions, Vec<String>) {
        let mut o = SdesOptions::default();
        let mut ignored = Vec::new();
        let list = |v: &str| v.split(';').filter(|s| !s.is_empty()).map(str::to_string).collect::<Vec<_>>();
        for v in values {
            if let Some(s) = v.strip_prefix("no-") {
                o.no.push(s.to_string());
            } else if let Some(s) = v.strip_prefix("only-") {
                o.only.push(s.to_string());
            } else if let Some(s) = v.strip_prefix("order:") {
                o.order.extend(list(s));
            } else if let Some(s) = v.strip_prefix("offerer-pref:") {
                o.offerer_pref.extend(list(s));
            } else {
                match v {
                    "nonew" => o.nonew = true,
                    "lifetime" => o.lifetime = true,
                    "pad" => o.pad = true,
                    _ => ignored.push(v.to_string()),
                }
            }
        }
        (o, ignored)
    }

    /// An `SDES-` flag (normalised) this relay acts on.
    pub fn flag_acted_on(flag: &str) -> bool {
        flag.strip_prefix("sdes-").is_some_and(|v| SdesOptions::parse([v]).1.is_empty())
    }

    fn allows(&self, suite: SrtpSuite) -> bool {
        let name = crate::protocol::normalize(suite.name());
        if self.only.is_empty() {
            !self.no.contains(&name)
        } else {
            self.only.contains(&name)
        }
    }

    fn rank(list: &[String], suite: SrtpSuite) -> usize {
        let name = crate::protocol::normalize(suite.name());
        list.iter().position(|n| *n == name).unwrap_or(list.len())
    }

    /// The `a=crypto` value for a key the relay gives.
    fn line(&self, tag: u32, key: &SrtpKey) -> String {
        let line = crypto_line(tag, key.suite.name(), &key.master, self.pad);
        if self.lifetime {
            line + "|2^31"
        } else {
            line
        }
    }
}

/// `RTP/SAVP` and `RTP/SAVPF`: SRTP keyed by SDES (DTLS-SRTP's protocols start `UDP/TLS/`).
pub fn is_sdes(proto: &str) -> bool {
    proto.eq_ignore_ascii_case("RTP/SAVP") || proto.eq_ignore_ascii_case("RTP/SAVPF")
}

/// DTLS-SRTP (terminated toward a WebRTC party by `crate::webrtc`).
pub fn is_dtls(proto: &str) -> bool {
    proto.to_ascii_uppercase().starts_with("UDP/TLS/")
}

/// The protocols `transport-protocol` takes (and the flags naming them).
pub const PROTOCOLS: [&str; 6] = ["RTP/AVP", "RTP/AVPF", "RTP/SAVP", "RTP/SAVPF", "UDP/TLS/RTP/SAVP", "UDP/TLS/RTP/SAVPF"];

#[derive(Debug, thiserror::Error)]
pub enum SdesError {
    #[error(
        "media section {section}: no a=crypto line offers a suite and key mediaplane speaks ({}; a single inline key, no MKI, no session parameters)",
        speaks()
    )]
    NoUsableKey { section: usize },
    #[error("media section {section}: the answer accepts none of the a=crypto keys offered to it (tags {offered})")]
    NotAccepted { section: usize, offered: String },
    #[error("media section {section}: the answer refuses SRTP ({proto}) though the relay offered it RTP/SAVP keys")]
    Refused { section: usize, proto: String },
    #[error("media section {section}: the SDES options leave no suite to offer (mediaplane speaks {})", speaks())]
    NothingToOffer { section: usize },
    #[error("no randomness for SRTP keys: {0}")]
    Random(String),
}

fn speaks() -> String {
    SrtpSuite::ALL.iter().map(|s| s.name()).collect::<Vec<_>>().join(", ")
}

fn generate(suite: SrtpSuite) -> Result<SrtpKey, SdesError> {
    let mut master = vec![0u8; suite.master_len()];
    getrandom::getrandom(&mut master).map_err(|e| SdesError::Random(e.to_string()))?;
    SrtpKey::new(suite, master).map_err(SdesError::Random)
}

/// What one media section becomes: the parties' SRTP state, and the SDP going out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SectionPlan {
    /// Per side [A, B]: the SRTP the relay terminates toward that party.
    pub sdes: [Option<SdesSide>; 2],
    /// The protocol the sender's SDP spoke.
    pub sender_proto: String,
    /// For the outgoing SDP: a new `m=` protocol, and `a=crypto` values replacing the section's
    /// (None: kept).
    pub proto: Option<String>,
    pub crypto: Option<Vec<String>>,
    /// An offer: whether it goes on in another protocol than its sender's (so the answer comes
    /// back translated). None for an answer.
    pub translated: Option<bool>,
}

/// Decide the SRTP of every section of `sdp`, sent by `sender` in `phase`, with the offer's
/// `transport` protocol for the receiver and the request's SDES options. Warnings for what is
/// passed through instead.
pub fn plan(
    call: &Call,
    sender: Side,
    phase: Phase,
    sdp: &Sdp,
    transport: Option<&str>,
    opts: &SdesOptions,
    warnings: &mut Vec<String>,
) -> Result<Vec<SectionPlan>, SdesError> {
    let (s, r) = (side_index(sender), 1 - side_index(sender));
    let mut out = Vec::with_capacity(sdp.media.len());
    for (i, sm) in sdp.media.iter().enumerate() {
        let section = i + 1;
        let prev = call.media.get(i);
        let prev_side = |x: usize| prev.and_then(|m| m.sdes[x].clone());
        let mut p = SectionPlan { sender_proto: sm.proto.clone(), ..Default::default() };
        if sm.port == 0 {
            out.push(p);
            continue;
        }
        match phase {
            Phase::Offer => {
                // Without transport-protocol, a section the relay translated keeps its receiver's
                // protocol (a re-INVITE from the plain side of a bridged call stays bridged, as
                // in rtpengine); any other goes on as its sender spoke.
                let remembered = prev.filter(|m| m.translated || m.sdes.iter().any(Option::is_some)).and_then(|m| m.proto_of[r].clone());
                let target = transport.or(remembered.as_deref()).unwrap_or(&sm.proto);
                if !target.eq_ignore_ascii_case(&sm.proto) {
                    p.proto = Some(target.to_string());
                }
                p.translated = Some(p.proto.is_some());
                // DTLS-SRTP is terminated by `crate::webrtc`; toward an SDES party (DTLS-SRTP
                // bridged to SDES-SRTP) the other leg's keys are this plan's, as toward any.
                match (is_sdes(&sm.proto), is_sdes(target)) {
                    (true, false) => {
                        let usable: Vec<(u32, SrtpKey)> = sm
                            .crypto
                            .iter()
                            .filter_map(|c| {
                                let suite = SrtpSuite::from_name(&c.suite)?;
                                Some((c.tag, SrtpKey::new(suite, c.key.clone()?).ok()?))
                            })
                            .collect();
                        // The first the options allow (in `offerer_pref` order if given); if they
                        // allow none, the first usable one (rtpengine keeps the top one too).
                        let (tag, key) = usable
                            .iter()
                            .filter(|(_, k)| opts.allows(k.suite))
                            .min_by_key(|(_, k)| SdesOptions::rank(&opts.offerer_pref, k.suite))
                            .or(usable.first())
                            .cloned()
                            .ok_or(SdesError::NoUsableKey { section })?;
                        let kept = prev_side(s).and_then(|old| old.ours.into_iter().find(|(_, k)| k.suite == key.suite)).map(|(_, k)| k);
                        let ours = match kept {
                            Some(k) => k,
                            None => generate(key.suite)?,
                        };
                        p.sdes[s] = Some(SdesSide { ours: vec![(tag, ours)], theirs: Some((tag, key)) });
                        p.crypto = Some(Vec::new());
                    }
                    (false, true) => {
                        // The keys it was given before, if any (a re-INVITE keeps them).
                        let old = prev_side(r).unwrap_or_default();
                        let ours = if !old.ours.is_empty() {
                            old.ours
                        } else {
                            // Tags follow the suites' own order; `order:` only moves lines.
                            let mut suites: Vec<(u32, SrtpSuite)> =
                                SrtpSuite::ALL.into_iter().zip(1..).filter(|(s, _)| !opts.nonew && opts.allows(*s)).map(|(s, t)| (t, s)).collect();
                            suites.sort_by_key(|(_, s)| SdesOptions::rank(&opts.order, *s));
                            if suites.is_empty() {
                                return Err(SdesError::NothingToOffer { section });
                            }
                            suites.into_iter().map(|(tag, suite)| Ok((tag, generate(suite)?))).collect::<Result<_, SdesError>>()?
                        };
                        p.crypto = Some(ours.iter().map(|(tag, k)| opts.line(*tag, k)).collect());
                        // The party's key from its last answer serves until the new answer.
                        p.sdes[r] = Some(SdesSide { ours, theirs: old.theirs });
                    }
                    (true, true) if opts != &SdesOptions::default() => {
                        warnings.push(format!(
                            "media section {section}: both parties speak SRTP, their a=crypto lines pass through: the SDES options change nothing"
                        ));
                    }
                    _ => {}
                }
            }
            Phase::Answer => {
                // Back to the offerer in the protocol it offered, if the offer went on in another
                // (an answer in another protocol than its offer is otherwise left as it is).
                let offerer_proto = prev.filter(|m| m.translated).and_then(|m| m.proto_of[r].clone());
                p.proto = offerer_proto.filter(|o| !o.eq_ignore_ascii_case(&sm.proto));
                if let Some(mut ours) = prev_side(s) {
                    // The relay offered this party keys: its answer picks one and gives its own.
                    if !is_sdes(&sm.proto) {
                        return Err(SdesError::Refused { section, proto: sm.proto.clone() });
                    }
                    let accepted = sm.crypto.iter().find_map(|c| {
                        let (tag, offered) = ours.ours.iter().find(|(t, k)| *t == c.tag && k.suite.name().eq_ignore_ascii_case(&c.suite))?;
                        Some((*tag, SrtpKey::new(offered.suite, c.key.clone()?).ok()?))
                    });
                    let Some((tag, theirs)) = accepted else {
                        let offered = ours.ours.iter().map(|(t, _)| t.to_string()).collect::<Vec<_>>().join(", ");
                        return Err(SdesError::NotAccepted { section, offered });
                    };
                    ours.theirs = Some((tag, theirs));
                    p.sdes[s] = Some(ours);
                    p.crypto = Some(Vec::new());
                } else if let Some(offerer) = prev_side(r) {
                    // The offerer spoke SRTP, terminated here: our key, under its tag.
                    let line = offerer.ours.first().map(|(tag, k)| opts.line(*tag, k));
                    p.crypto = Some(line.into_iter().collect());
                    p.sdes[r] = Some(offerer);
                }
            }
        }
        out.push(p);
    }
    Ok(out)
}

/// Write `plans` into `call` and its relays' legs (after [`crate::calls::apply_signal`] made
/// them): every leg of every active section gets its SRTP, or none.
pub fn install(model: &mut Model, call: &mut Call, sender: Side, plans: Vec<SectionPlan>, changes: &mut Vec<Change>) -> Result<(), ManagerError> {
    let s = side_index(sender);
    for (i, p) in plans.into_iter().enumerate() {
        let Some(m) = call.media.get_mut(i) else { continue };
        m.proto_of[s] = Some(p.sender_proto);
        m.sdes = p.sdes;
        if let Some(t) = p.translated {
            m.translated = t;
        }
        if !m.active {
            continue;
        }
        let ids = std::iter::once(rtp_relay_id(&call.key, i)).chain(m.rtcp.then(|| rtcp_relay_id(&call.key, i)));
        for id in ids {
            let mut changed = false;
            for (x, side) in [(0, Side::A), (1, Side::B)] {
                // A WebRTC party's keys come from its DTLS handshake (`crate::webrtc`).
                if m.webrtc[x].is_some() && id == rtp_relay_id(&call.key, i) {
                    continue;
                }
                changed |= model.set_leg_srtp(&id, side, m.sdes[x].as_ref().map(SdesSide::leg))?;
            }
            if changed && !changes.contains(&Change::Relay(id.clone())) {
                changes.push(Change::Relay(id));
            }
        }
    }
    Ok(())
}
