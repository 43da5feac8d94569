//! The session model: rooms of participants publishing streams and subscribing to each other's,
//! and SIP-style relay pairs. Pure data with validated mutations; no I/O.
//!
//! Every local address (an SFU IP:port) has exactly one owner: a participant (its transport or a
//! stream's own port) or a relay leg. That single rule makes ingress lookups unambiguous.

use crate::simulcast::{Codec, MAX_LAYERS};
use imbl::OrdMap;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;

pub const MAX_ID_LEN: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("invalid id {0:?}: use 1-64 characters of [A-Za-z0-9_.-]")]
    InvalidId(String),
    #[error("{kind} {id:?} already exists")]
    Exists { kind: &'static str, id: String },
    #[error("{kind} {id:?} not found")]
    NotFound { kind: &'static str, id: String },
    #[error("local address {addr} is already used by {owner}")]
    AddressInUse { addr: SocketAddr, owner: String },
    #[error("a stream with ingress {addr} and ssrc {ssrc:?} already exists ({owner})")]
    IngressInUse { addr: SocketAddr, ssrc: Option<u32>, owner: String },
    #[error("a participant cannot subscribe to its own stream")]
    SelfSubscription,
    #[error("address {0} must be a concrete unicast address with a non-zero port")]
    BadAddress(SocketAddr),
    #[error("local and remote addresses of {0} must be the same IP family")]
    FamilyMismatch(String),
    /// Stored state that cannot be right (see [`Model::from_parts`]).
    #[error("inconsistent stored state: {0}")]
    Inconsistent(String),
    /// A request the model cannot take as given (e.g. a simulcast stream with one layer).
    #[error("{0}")]
    Invalid(String),
}

fn check_id(id: &str) -> Result<(), ModelError> {
    let ok = !id.is_empty() && id.len() <= MAX_ID_LEN && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(ModelError::InvalidId(id.to_string()))
    }
}

fn check_addr(a: SocketAddr) -> Result<(), ModelError> {
    let ip = a.ip();
    if a.port() == 0 || ip.is_unspecified() || ip.is_multicast() {
        return Err(ModelError::BadAddress(a));
    }
    if let std::net::IpAddr::V4(v4) = ip {
        if v4.is_broadcast() {
            return Err(ModelError::BadAddress(a));
        }
    }
    Ok(())
}

/// A published stream. Its ingress is `local` (or the publisher's transport address) narrowed
/// by `ssrc` when given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stream {
    /// Stable numeric id used for counters and kernel maps.
    pub uid: u32,
    /// Its own local port, when it does not arrive on the participant's transport address.
    pub local: Option<SocketAddr>,
    pub ssrc: Option<u32>,
    /// RTP-aware checks (header validity, SSRC) apply only to RTP streams.
    pub rtp: bool,
    /// RTP clock rate (Hz) of its payload, for the jitter the data planes measure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_rate: Option<u32>,
    /// Simulcast: the layers it is sent in, lowest quality first, each on its own SSRC at the
    /// stream's address. Empty for a plain stream. Its consumers get one layer at a time
    /// ([`crate::simulcast`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<Layer>,
    /// Its payload format (simulcast streams: where keyframes are).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub codec: Option<Codec>,
    /// The payload format a browser publisher negotiated (WHIP): what WHEP subscribers are
    /// answered with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<PayloadFormat>,
    /// A browser's simulcast stream (WHIP): the RID of each layer, in `layers`' order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rids: Vec<String>,
}

/// A payload format as SDP names it (`a=rtpmap`, `a=fmtp`), and its media kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayloadFormat {
    /// `audio` or `video`.
    pub kind: String,
    pub pt: u8,
    /// What follows the payload type in `a=rtpmap`: `VP8/90000`, `opus/48000/2`.
    pub rtpmap: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fmtp: Option<String>,
}

/// One layer of a simulcast stream: its SSRC, and a uid of its own (each layer is counted and
/// forwarded as a stream of its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layer {
    pub uid: u32,
    pub ssrc: u32,
}

/// What a caller gives to publish a stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamSpec {
    pub local: Option<SocketAddr>,
    pub ssrc: Option<u32>,
    #[serde(default = "default_true")]
    pub rtp: bool,
    /// RTP clock rate (Hz): jitter is measured only where it is known.
    #[serde(default)]
    pub clock_rate: Option<u32>,
    /// Simulcast: the SSRC of each layer, lowest quality first (2 to
    /// [`crate::simulcast::MAX_LAYERS`]); `ssrc` is then not given.
    #[serde(default)]
    pub layers: Vec<u32>,
    #[serde(default)]
    pub codec: Option<Codec>,
    /// What a browser publisher negotiated (WHIP sets it).
    #[serde(default)]
    pub format: Option<PayloadFormat>,
}

fn default_true() -> bool {
    true
}

impl Default for StreamSpec {
    /// RTP on the participant's transport address, any SSRC.
    fn default() -> Self {
        StreamSpec { local: None, ssrc: None, rtp: true, clock_rate: None, layers: Vec::new(), codec: None, format: None }
    }
}

/// Identifies a stream inside a room: its publisher and its name (e.g. a quality "low"/"high").
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct StreamRef {
    pub publisher: String,
    pub stream: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Participant {
    /// SFU address this participant sends to and receives its copies from (symmetric RTP).
    pub local: SocketAddr,
    /// Where the participant receives media; also the only source allowed to publish.
    pub remote: SocketAddr,
    pub streams: BTreeMap<String, Stream>,
    /// What it receives: one consumer per subscribed stream. Stored and shown as a list of
    /// `{publisher, stream, consumer}`.
    #[serde(with = "subscription_list")]
    pub subscriptions: BTreeMap<StreamRef, Consumer>,
    /// A browser's participant (WHIP/WHEP): it reaches `local` through ICE (the SFU is a lite
    /// agent) and keys its media with DTLS-SRTP. `remote` is the address its checks nominated,
    /// the unspecified address (port 9, as WebRTC SDPs say "no address") before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webrtc: Option<WebrtcTransport>,
    /// SRTP keyed at join (SDES, RFC 4568's model: a SIP gateway or any peer that exchanged keys
    /// out of band): `inbound` is what the participant protects its packets with, `outbound`
    /// what the SFU protects its copies to it with. Stored, as a relay leg's SDES keys are;
    /// never shown by the API. A WebRTC participant's keys come from DTLS instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub srtp: Option<crate::srtp::LegSrtp>,
}

/// A WebRTC participant's transport (one BUNDLE: every stream on `local`, told apart by SSRC).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebrtcTransport {
    /// Its own uid, from the same sequence as streams': the handshake's id, and the id of the
    /// table entry its STUN, DTLS and unknown SSRCs arrive on.
    pub uid: u32,
    /// ICE nominated `remote`: only then is anything sent to it or accepted from it.
    pub nominated: bool,
    /// The keys its DTLS handshake exported (none before: nothing passes either way). Never
    /// stored: a restarted daemon cannot resume the session (see
    /// [`Model::remove_webrtc_participants`]), and a fresh SRTP context on an old key would reuse
    /// its keystream.
    #[serde(skip)]
    pub srtp: crate::srtp::LegSrtp,
    /// The header extensions its packets name their simulcast encoding with, while a section
    /// waits for its layers ([`WebrtcTransport::pending`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_ids: Option<StreamIdExtensions>,
    /// The id its offer gave the transport-wide sequence number header extension, when the SFU
    /// answered transport-cc: its arrivals are fed back so its send-side estimate can grow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport_cc: Option<u8>,
    /// The id its offer gave the abs-send-time header extension, answered when it did not offer
    /// transport-cc: the SFU estimates what its path carries from the send times and tells it
    /// in a REMB ([`crate::remote_estimate`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abs_send_time: Option<u8>,
    /// The most it may send (kbit/s), below its room's ceiling: told to it as a REMB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_kbps: Option<u32>,
    /// The first address an ICE check of it was answered for (the check authenticated with its
    /// ICE password), before any nomination: media is accepted from it, not sent to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checked: Option<SocketAddr>,
    /// Simulcast sections whose layers' SSRCs are learned from the first packets
    /// ([`Model::learn_layer`]); each becomes a stream when they are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pending: Vec<PendingSimulcast>,
    /// Sections published with fewer layers than offered: a browser enables its higher
    /// encodings as its bandwidth estimate grows, and a layer heard later above the stream's
    /// top one joins it ([`Model::learn_layer`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub late: Vec<PendingSimulcast>,
}

/// The ids of the RTP header extensions a browser names a packet's simulcast encoding (RFC
/// 8852's RTP stream id) and media section (RFC 8843's MID) with, as its offer mapped them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamIdExtensions {
    pub rid: u8,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mid: Option<u8>,
}

/// The range of a room's publisher ceiling (kbit/s): below 30 not even audio passes; above
/// 100 Mbit/s it caps nothing a browser sends.
pub const MIN_PUBLISHER_KBPS: u32 = 30;
pub const MAX_PUBLISHER_KBPS: u32 = 100_000;

fn check_publisher_kbps(name: &str, kbps: Option<u32>) -> Result<(), ModelError> {
    match kbps.filter(|k| !(MIN_PUBLISHER_KBPS..=MAX_PUBLISHER_KBPS).contains(k)) {
        Some(k) => Err(ModelError::Invalid(format!("{name} {k}: {MIN_PUBLISHER_KBPS} to {MAX_PUBLISHER_KBPS}"))),
        None => Ok(()),
    }
}

/// How long after a pending simulcast section's first layer is heard it is published with the
/// layers heard so far: a browser leaves out the encodings its bandwidth or resolution does
/// not allow (those it enables later join the stream above its top layer).
pub const SIMULCAST_LEARNING_MS: u64 = 2_000;

/// How long a section with only one of several layers heard waits for a second one: a browser
/// starting at a low bandwidth estimate sends its lowest encoding alone for a second or two,
/// and a stream published with one layer is a plain stream, which layers cannot join.
pub const SIMULCAST_ONE_LAYER_MS: u64 = 5_000;

/// What publishing learned simulcast sections changed: the rooms, and why a section that was
/// due could not become a stream (it is dropped).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SimulcastPublished {
    pub rooms: Vec<String>,
    pub refused: Vec<String>,
}

/// A browser's simulcast section (`a=simulcast` with RIDs, no SSRCs signalled), waiting for
/// its layers' SSRCs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingSimulcast {
    /// The stream it becomes.
    pub name: String,
    /// The section's `a=mid`.
    pub mid: String,
    /// Its encodings' RIDs, lowest quality first.
    pub rids: Vec<String>,
    /// The SSRC learned for each RID so far.
    pub ssrcs: Vec<Option<u32>>,
    /// What the stream is published with (its `layers` from `ssrcs`).
    pub spec: StreamSpec,
    /// When its first layer was heard (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heard_at_ms: Option<u64>,
    /// When it was offered (Unix ms): a section none of whose layers is heard within
    /// [`SIMULCAST_UNHEARD_MS`] is dropped (its sender sends nothing the SFU can name).
    #[serde(default)]
    pub offered_at_ms: u64,
}

/// How long a pending simulcast section waits for its first layer before it is dropped (so a
/// publisher that never sends it is not waited for: WHEP of it answers 503 meanwhile).
pub const SIMULCAST_UNHEARD_MS: u64 = 10_000;

impl PendingSimulcast {
    /// Heard long enough ago to be published with the layers heard (or, none heard, waited for
    /// long enough to be dropped).
    fn due(&self, now_ms: u64) -> bool {
        let one_of_several = self.rids.len() > 1 && self.ssrcs.iter().flatten().count() == 1;
        let wait = if one_of_several { SIMULCAST_ONE_LAYER_MS } else { SIMULCAST_LEARNING_MS };
        match self.heard_at_ms {
            Some(t) => now_ms.saturating_sub(t) >= wait,
            None => now_ms.saturating_sub(self.offered_at_ms) >= SIMULCAST_UNHEARD_MS,
        }
    }

    /// An offered layer above the highest one heard is not heard yet.
    fn has_room_above(&self) -> bool {
        self.ssrcs.last().is_some_and(Option::is_none)
    }

    /// The layers learned, lowest first: (RID, SSRC).
    fn learned(&self) -> Vec<(String, u32)> {
        self.rids.iter().zip(&self.ssrcs).filter_map(|(r, s)| Some((r.clone(), (*s)?))).collect()
    }
}

impl Participant {
    /// Where its copies go, if anywhere yet: `remote`, or for a WebRTC participant the address
    /// ICE nominated.
    pub fn peer(&self) -> Option<SocketAddr> {
        match &self.webrtc {
            Some(w) if !w.nominated => None,
            _ => Some(self.remote),
        }
    }

    /// The only address it may send from: `remote`, or for a WebRTC participant the address ICE
    /// nominated (before: the first address a check was answered for, if any; else, or after its
    /// consent ended, the unspecified address, nobody's).
    pub fn source(&self) -> SocketAddr {
        let nobody: std::net::IpAddr = if self.local.is_ipv4() { std::net::Ipv4Addr::UNSPECIFIED.into() } else { std::net::Ipv6Addr::UNSPECIFIED.into() };
        let checked = self.webrtc.as_ref().and_then(|w| w.checked.filter(|_| !w.nominated));
        self.peer().or(checked).unwrap_or(SocketAddr::new(nobody, 9))
    }

    /// Whether it speaks SRTP (a browser, or keyed at join): it sends and receives RTP only.
    pub fn speaks_srtp(&self) -> bool {
        self.keys().is_some()
    }

    /// Its SRTP keys, if it speaks SRTP: from DTLS (WebRTC; empty until the handshake is done)
    /// or given at join (SDES).
    fn keys(&self) -> Option<&crate::srtp::LegSrtp> {
        self.webrtc.as_ref().map(|w| &w.srtp).or(self.srtp.as_ref())
    }

    /// How what the SFU sends it is protected.
    pub fn outbound(&self) -> crate::srtp::Protection {
        self.keys().map_or(crate::srtp::Protection::Clear, |k| crate::srtp::Protection::Srtp(k.outbound.clone()))
    }

    /// How what it sends arrives.
    pub fn inbound(&self) -> crate::srtp::Protection {
        self.keys().map_or(crate::srtp::Protection::Clear, |k| crate::srtp::Protection::Srtp(k.inbound.clone()))
    }
}

/// VP8's TID has two bits.
pub const MAX_TEMPORAL_LAYER: u8 = 3;

/// One subscription as a first-class object (mediasoup's consumer): what one participant receives
/// of one published stream. Its uid comes from the same sequence as streams' and legs', so it is
/// never reused; the data planes count each consumer's copies under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Consumer {
    pub uid: u32,
    /// Of a simulcast stream: the layer it should receive (the top one when not given), and the
    /// highest it may ([`Consumer::wanted_layer`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_layer: Option<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_layer: Option<u8>,
    /// Its own loss reports and REMBs may lower its layer below the wanted one (the default).
    /// Off: only the API and the layers its publisher sends decide ([`crate::layer_choice`]).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub auto_layer: bool,
    /// Of a simulcast stream (VP8): the highest temporal layer it receives of its layer (None:
    /// all). Frames above it are dropped without a gap ([`crate::simulcast`]); a stream
    /// without temporal layers is not affected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temporal_layer: Option<u8>,
    /// The payload type its copies carry in place of the stream's [`Stream::format`]'s: a
    /// WebRTC subscriber whose offer numbered the same format differently (a camera's H.264 on
    /// 96, which a browser numbers 102). None: as the publisher sends it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_type: Option<u8>,
}

impl Default for Consumer {
    fn default() -> Consumer {
        Consumer { uid: 0, preferred_layer: None, max_layer: None, auto_layer: true, temporal_layer: None, payload_type: None }
    }
}

fn yes() -> bool {
    true
}

fn is_true(v: &bool) -> bool {
    *v
}

impl Consumer {
    /// The layer it should receive of a stream with `layers` layers.
    pub fn wanted_layer(&self, layers: usize) -> u8 {
        let top = layers.saturating_sub(1) as u8;
        self.preferred_layer.unwrap_or(top).min(self.max_layer.unwrap_or(top)).min(top)
    }
}

/// `subscriptions` as a JSON list (a map with structured keys is not JSON). A stored list from
/// before consumers had uids reads as uid 0, and [`Model::from_parts`] gives those fresh uids.
mod subscription_list {
    use super::{Consumer, StreamRef};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::BTreeMap;

    #[derive(Serialize, Deserialize)]
    struct Entry {
        publisher: String,
        stream: String,
        #[serde(default)]
        consumer: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        preferred_layer: Option<u8>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_layer: Option<u8>,
        #[serde(default = "super::yes", skip_serializing_if = "super::is_true")]
        auto_layer: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        temporal_layer: Option<u8>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        payload_type: Option<u8>,
    }

    pub fn serialize<S: Serializer>(subs: &BTreeMap<StreamRef, Consumer>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(subs.iter().map(|(r, c)| Entry {
            publisher: r.publisher.clone(),
            stream: r.stream.clone(),
            consumer: c.uid,
            preferred_layer: c.preferred_layer,
            max_layer: c.max_layer,
            auto_layer: c.auto_layer,
            temporal_layer: c.temporal_layer,
            payload_type: c.payload_type,
        }))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<StreamRef, Consumer>, D::Error> {
        let list = Vec::<Entry>::deserialize(d)?;
        Ok(list
            .into_iter()
            .map(|e| {
                let c = Consumer {
                    uid: e.consumer,
                    preferred_layer: e.preferred_layer,
                    max_layer: e.max_layer,
                    auto_layer: e.auto_layer,
                    temporal_layer: e.temporal_layer,
                    payload_type: e.payload_type,
                };
                (StreamRef { publisher: e.publisher, stream: e.stream }, c)
            })
            .collect())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Room {
    pub participants: BTreeMap<String, Participant>,
    /// The most a WebRTC publisher of the room may send (kbit/s): the SFU sends it as a REMB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher_max_kbps: Option<u32>,
}

/// One side of a relayed call: media from `peer` arrives at `local` and is sent on from the
/// other leg's `local` to the other leg's peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leg {
    pub uid: u32,
    pub local: SocketAddr,
    /// The peer address signalled (e.g. from SDP); may be absent until media arrives.
    pub remote: Option<SocketAddr>,
    /// The peer's real source, learnt from its packets (NAT traversal): see [`Follow`].
    pub latched: Option<SocketAddr>,
    /// Only `remote` may send; no latching.
    pub strict: bool,
    pub rtp: bool,
    #[serde(default)]
    pub follow: Follow,
    #[serde(default)]
    pub learning: Learning,
    /// The party put itself on hold (a zero connection address): nothing is sent to it until
    /// it signals an address again. What it sends (music on hold) is still relayed.
    #[serde(default)]
    pub held: bool,
    /// SRTP the relay terminates on this leg (its peer speaks SRTP, the other leg's may not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub srtp: Option<crate::srtp::LegSrtp>,
    /// RTP clock rate (Hz) of what its peer sends (from its SDP), for the measured jitter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_rate: Option<u32>,
    /// The peer reaches this leg through ICE (the relay is a lite agent) and keys it with
    /// DTLS-SRTP (a WebRTC party): its STUN and DTLS go to the control plane, `remote` is the
    /// address its checks nominated (None before, or after its consent expired) and the only
    /// one sent to or accepted; nothing is learnt from media.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ice: bool,
    /// An ICE leg's credentials (both ends', from the SDPs) and DTLS role: stored with its keys
    /// so that after a restart the relay still answers its peer's consent checks, and media
    /// goes on. Secret as the keys are: never in an API view.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ice_credentials: Option<IceCredentials>,
    /// Call control of what this leg's peer sends (directional: NG `block media` and the like
    /// with a `from-tag`); the relay's own [`Relay::control`] adds to it.
    #[serde(default, skip_serializing_if = "MediaControl::is_off")]
    pub control: MediaControl,
    /// The RTP payload types its peer's SDP maps to `telephone-event` (RFC 4733): what
    /// [`MediaControl`] tells apart from media.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub telephone_events: Vec<u8>,
    /// DTMF events to put into what its peer sends (NG `play DTMF`), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dtmf: Vec<DtmfEvent>,
    /// This leg is one more media section on another relay's ICE leg's transport (BUNDLE): see
    /// [`Bundled`] and [`Model::bundle_leg`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundled: Option<Bundled>,
}

/// A leg on the transport of `relay`'s leg on the same side (an SDP BUNDLE group, RFC 8843:
/// several media sections of a WebRTC party on one address, ICE and DTLS association). That
/// leg (the group's first section) owns the address and its handshake; this one takes what the
/// party sends with `ssrc` (RTP of that SSRC, RTCP whose sender it is), and its peer and SRTP
/// keys are that leg's ([`Model::set_leg_nominated`] and [`Model::set_leg_srtp`] set both).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bundled {
    pub relay: String,
    pub ssrc: u32,
}

/// What an ICE leg's handshake state is rebuilt from after a restart ([`Leg::ice_credentials`]).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IceCredentials {
    pub local_ufrag: String,
    pub local_pwd: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<(String, String)>,
    /// The relay is the DTLS client (`a=setup:active`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dtls_client: bool,
    /// The peer's certificate fingerprint as its SDP gave it (`sha-256 AB:CD:..`): a restarted
    /// relay checks a new handshake against it, and knows a re-offer that repeats it for one
    /// that changes nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_fingerprint: Option<String>,
}

impl std::fmt::Debug for IceCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The passwords stay out of logs.
        f.debug_struct("IceCredentials").field("local_ufrag", &self.local_ufrag).field("remote_ufrag", &self.remote.as_ref().map(|r| &r.0)).finish()
    }
}

/// One RFC 4733 event to put into a party's audio (NG `play DTMF`). The party's own packets
/// carry it: from the first one after it is queued, each is sent as an event packet (same
/// SSRC and sequence number, the event's start as timestamp, a growing duration; the last three
/// with the end bit) until the duration is reached; then audio again, or after `pause_ms` the
/// next event. So no packet is added and no sequence number moves (audio during an event is
/// replaced, as rtpengine suppresses it); a party that sends nothing plays nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DtmfEvent {
    /// Increasing over a model's life: the data plane plays each once, in order.
    pub id: u32,
    /// 0-9, 10 (*), 11 (#), 12-15 (A-D).
    pub code: u8,
    /// Attenuation in dB below 0 dBm0 (RFC 4733's volume field, 0-63).
    pub volume: u8,
    pub duration_ms: u32,
    /// Silence after it before the next event, ms.
    pub pause_ms: u32,
    /// The receiving party's `telephone-event` payload type.
    pub payload_type: u8,
    /// When it was queued (Unix ms): it is dropped from the model once it must be over.
    pub queued_ms: u64,
}

/// Call control of one direction of a relay (rtpengine's `block media`, `silence media` and
/// `block DTMF`). A packet is told to be DTMF by its payload type (the legs'
/// [`Leg::telephone_events`]); any other RTP is media. RTCP is never touched.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MediaControl {
    /// Media is dropped; DTMF events still pass (as rtpengine does).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub block_media: bool,
    /// Media of a codec with a silence pattern (G.711) goes on with its payload silenced.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub silence_media: bool,
    /// DTMF events are dropped.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub block_dtmf: bool,
}

impl MediaControl {
    /// Nothing is blocked or changed.
    pub fn is_off(&self) -> bool {
        *self == MediaControl::default()
    }

    /// What applies when both hold (the call's and the direction's).
    pub fn or(self, o: MediaControl) -> MediaControl {
        MediaControl {
            block_media: self.block_media || o.block_media,
            silence_media: self.silence_media || o.silence_media,
            block_dtmf: self.block_dtmf || o.block_dtmf,
        }
    }
}

/// How a leg follows its peer's source address (rtpengine's endpoint learning).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Follow {
    /// For a window after every signal (offer, answer, re-INVITE) the leg follows the newest
    /// source, then locks it; after that other sources are still relayed but not followed.
    #[default]
    Window,
    /// Learns in the window like [`Follow::Window`]; after it only the locked source may send,
    /// others are dropped as strangers (rtpengine's `strict-source`).
    Strict,
    /// Follows every new source at once, window or not (rtpengine's `media-handover`).
    Handover,
    /// Never learns: media goes to the signalled address; any source is relayed
    /// (rtpengine's `asymmetric`).
    Asymmetric,
}

/// The learning window of a [`Follow::Window`] or [`Follow::Strict`] leg.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Learning {
    /// The leg still follows new sources (until `until_ms`, or until the first packet when
    /// none came during the window).
    pub open: bool,
    /// End of the window, in Unix milliseconds (a wall clock: it survives a restart).
    pub until_ms: u64,
    /// A packet from the signalled address arrived since it was signalled.
    pub heard_signalled: bool,
    /// Where the leg sent before a signal moved it: once the new signalled address has been
    /// heard from, a late packet from the old one (a UA keeps sending from its old port until
    /// the answer) does not win it back.
    pub superseded: Option<SocketAddr>,
}

impl Leg {
    /// Where packets for this leg's peer go: the latched source wins over the signalled one.
    pub fn peer(&self) -> Option<SocketAddr> {
        if self.held {
            None
        } else if self.strict || self.follow == Follow::Asymmetric {
            self.remote
        } else {
            self.latched.or(self.remote)
        }
    }

    /// True while the leg follows a new source (see [`Follow`]).
    pub fn learns(&self) -> bool {
        match self.follow {
            _ if self.ice => false,
            _ if self.pinned() => false,
            Follow::Asymmetric => false,
            Follow::Handover => true,
            Follow::Window | Follow::Strict => self.learning.open || self.latched.is_none(),
        }
    }

    /// Learns in windows opened by signals.
    pub fn has_window(&self) -> bool {
        matches!(self.follow, Follow::Window | Follow::Strict) && !self.pinned()
    }

    /// Only the signalled address may send (a `strict` leg with a `remote`): it never learns.
    pub fn pinned(&self) -> bool {
        self.strict && self.remote.is_some()
    }

    /// Its learning window ended by `now_ms` and it heard a source to lock.
    pub fn window_due(&self, now_ms: u64) -> bool {
        self.window_closes_at().is_some_and(|at| now_ms >= at)
    }

    /// When its learning window ends with a source to lock (unix ms); None: nothing to lock.
    pub fn window_closes_at(&self) -> Option<u64> {
        (self.has_window() && self.learning.open && self.latched.is_some()).then_some(self.learning.until_ms)
    }
}

/// What a caller gives to create one leg of a relay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LegSpec {
    pub local: SocketAddr,
    pub remote: Option<SocketAddr>,
    #[serde(default)]
    pub strict: bool,
    #[serde(default = "default_true")]
    pub rtp: bool,
    #[serde(default)]
    pub follow: Follow,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Relay {
    pub a: Leg,
    pub b: Leg,
    /// Both directions are recorded ([`crate::StreamEntry::record`]).
    #[serde(default)]
    pub record: bool,
    /// Call control of both directions (NG `block media` and the like without a participant);
    /// a leg's own [`Leg::control`] adds to it and outlives this one's end.
    #[serde(default, skip_serializing_if = "MediaControl::is_off")]
    pub control: MediaControl,
    /// Copies of what a party sends to third parties (NG `subscribe request`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forks: Vec<Fork>,
    /// The RFC 4733 events either party sends are reported to the control plane (NG's DTMF
    /// log): on the eBPF plane those packets, and only those, go through the slow path.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub report_dtmf: bool,
    /// One party multiplexes RTCP with RTP and the other does not (NG `rtcp-mux-demux`): the
    /// latter's RTCP has an address of its own here instead of a relay of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rtcp_demux: Option<DemuxedRtcp>,
}

/// The RTCP of a relay party that does not multiplex it while the other party does (NG
/// `rtcp-mux-demux`, a browser calling a plain SIP phone): the muxing party's RTCP, which
/// arrives on its RTP address, goes to this party's RTCP address from `local`; this party's RTCP
/// arrives at `local` and goes to the muxing party's RTP address, from its RTP address. On the
/// eBPF plane RTCP of a relay leg goes through the slow path already (it is evaluated), so this
/// adds no kernel work.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DemuxedRtcp {
    /// Its ingress stream's id.
    #[serde(default)]
    pub uid: u32,
    /// The party that does not multiplex.
    pub of: Side,
    /// Its RTCP address on the relay (claimed like a leg's; the port above its RTP leg's).
    pub local: SocketAddr,
    /// Its RTCP peer as signalled (`a=rtcp`, or the RTP port + 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<SocketAddr>,
    /// The source its RTCP came from, followed while its party's RTP leg learns (NAT).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latched: Option<SocketAddr>,
}

impl DemuxedRtcp {
    /// Where the other party's RTCP goes.
    pub fn peer(&self) -> Option<SocketAddr> {
        self.latched.or(self.remote)
    }

    /// It follows the source of what arrives now, by the rules of its party's RTP `leg`:
    /// during that leg's window, or until it heard a first source; always on a handover leg;
    /// never on a pinned, ICE or asymmetric one.
    pub fn learns(&self, leg: &Leg) -> bool {
        match leg.follow {
            _ if leg.ice || leg.pinned() => false,
            Follow::Asymmetric => false,
            Follow::Handover => true,
            Follow::Window | Follow::Strict => leg.learning.open || self.latched.is_none(),
        }
    }
}

/// A copy of what one party of a relay sends, for a third party (NG `subscribe request`: call
/// monitoring, a SIPREC recorder): one more copy of the party's stream, in the kernel on the
/// eBPF plane, leaving from an address of its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fork {
    /// Its ingress stream's id (what the subscriber sends it: its RTCP, counted and consumed).
    #[serde(default)]
    pub uid: u32,
    /// The subscription it belongs to (NG `to-tag`).
    pub tag: String,
    /// Whose media: the peer of this leg.
    pub of: Side,
    /// Its media section's place in the subscription's SDP (what the subscriber's answer
    /// addresses it by).
    #[serde(default)]
    pub position: u16,
    /// Where the copies leave from (claimed like a leg's address).
    pub local: SocketAddr,
    /// Where they go; None until the subscriber answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<SocketAddr>,
}

impl Relay {
    pub fn leg(&self, side: Side) -> &Leg {
        match side {
            Side::A => &self.a,
            Side::B => &self.b,
        }
    }
}

/// Which side of a relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    A,
    B,
}

impl Side {
    /// The other party of a relay.
    pub fn other(self) -> Side {
        match self {
            Side::A => Side::B,
            Side::B => Side::A,
        }
    }

    /// `a` or `b`, as labels and address owners name it.
    pub fn name(self) -> &'static str {
        match self {
            Side::A => "a",
            Side::B => "b",
        }
    }
}

/// Rooms, relays and the derived indexes live in persistent maps: cloning a model is O(1) and a
/// mutation copies only the path to what it changes. That is what lets the control plane apply
/// each change to a copy (and drop the copy on failure) at any number of sessions.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Model {
    pub rooms: OrdMap<String, Room>,
    pub relays: OrdMap<String, Relay>,
    next_uid: u32,
    /// Owner of every local address in use; derived, rebuilt on load.
    #[serde(skip)]
    owners: OrdMap<SocketAddr, String>,
    /// Relay leg uid -> (relay id, side); derived, rebuilt on load.
    #[serde(skip)]
    legs: OrdMap<u32, (String, Side)>,
    /// [`DemuxedRtcp`] uid -> relay id; derived, rebuilt on load.
    #[serde(skip)]
    pub(crate) demuxed: OrdMap<u32, String>,
    /// WebRTC transport uid -> (room, participant); derived, rebuilt on load.
    #[serde(skip)]
    transports: OrdMap<u32, (String, String)>,
    #[serde(skip)]
    last_claimed: AllocHint,
}

/// The port of the last address claimed: port allocation continues from there instead of
/// rescanning every used port. A hint, so it never makes two models unequal.
#[derive(Debug, Clone, Copy, Default)]
struct AllocHint(u16);

impl PartialEq for AllocHint {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for AllocHint {}

fn not_found(kind: &'static str, id: &str) -> ModelError {
    ModelError::NotFound { kind, id: id.to_string() }
}

impl Model {
    pub fn new() -> Self {
        Model { next_uid: 1, ..Default::default() }
    }

    /// Reassemble a model from stored parts (rooms and relays stored apart), validating it.
    pub fn from_parts(
        rooms: impl IntoIterator<Item = (String, Room)>,
        relays: impl IntoIterator<Item = (String, Relay)>,
        next_uid: u32,
    ) -> Result<Model, ModelError> {
        let mut m = Model { rooms: rooms.into_iter().collect(), relays: relays.into_iter().collect(), next_uid, ..Default::default() };
        let uids: Vec<u32> = m
            .rooms
            .values()
            .flat_map(|r| r.participants.values())
            .flat_map(|p| {
                let layers = p.streams.values().flat_map(|s| s.layers.iter().map(|l| l.uid));
                let transport = p.webrtc.as_ref().map(|w| w.uid);
                p.streams.values().map(|s| s.uid).chain(layers).chain(p.subscriptions.values().map(|c| c.uid)).chain(transport)
            })
            .chain(m.relays.values().flat_map(|r| [r.a.uid, r.b.uid]))
            .filter(|u| *u != 0)
            .collect();
        // Counters and kernel map entries are keyed by uid: two owners of one would share them.
        let mut seen = std::collections::BTreeSet::new();
        if let Some(dup) = uids.iter().find(|u| !seen.insert(**u)) {
            return Err(ModelError::Inconsistent(format!("uid {dup} is used twice")));
        }
        // A simulcast stream as publish() makes one (an older binary's store has none).
        for (rid, r) in &m.rooms {
            for (pid, p) in &r.participants {
                for (sid, s) in p.streams.iter().filter(|(_, s)| !s.layers.is_empty()) {
                    let spec = StreamSpec { ssrc: s.ssrc, rtp: s.rtp, layers: s.layers.iter().map(|l| l.ssrc).collect(), ..Default::default() };
                    Self::check_layers(sid, &spec).map_err(|e| ModelError::Inconsistent(format!("{rid}/{pid}: {e}")))?;
                }
            }
        }
        let max_uid = uids.iter().copied().max().unwrap_or(0);
        m.next_uid = m.next_uid.max(max_uid + 1);
        // Subscriptions stored before consumers had uids get theirs now.
        let rooms: Vec<String> = m.rooms.keys().cloned().collect();
        for rid in rooms {
            let pids: Vec<String> = m.rooms[&rid].participants.keys().cloned().collect();
            for pid in pids {
                let unnumbered: Vec<StreamRef> =
                    m.rooms[&rid].participants[&pid].subscriptions.iter().filter(|(_, c)| c.uid == 0).map(|(r, _)| r.clone()).collect();
                for r in unnumbered {
                    let uid = m.uid();
                    let c = m.room_mut(&rid)?.participants.get_mut(&pid).expect("listed").subscriptions.get_mut(&r).expect("listed");
                    c.uid = uid;
                }
            }
        }
        m.reindex()?;
        Ok(m)
    }

    /// The uid the next stream or leg will get (persisted so uids are never reused).
    pub fn next_uid(&self) -> u32 {
        self.next_uid
    }

    /// Find the relay leg with this uid: (relay id, side).
    pub fn relay_leg_by_uid(&self, uid: u32) -> Option<(&str, Side)> {
        self.legs.get(&uid).map(|(id, side)| (id.as_str(), *side))
    }

    /// Rebuild derived indexes after deserialisation; fails if the stored state is inconsistent.
    pub fn reindex(&mut self) -> Result<(), ModelError> {
        let mut fresh = Model { next_uid: self.next_uid.max(1), ..Default::default() };
        for (rid, room) in &self.rooms {
            for (pid, p) in &room.participants {
                fresh.claim(p.local, format!("participant {rid}/{pid}"))?;
                if let Some(w) = &p.webrtc {
                    fresh.transports.insert(w.uid, (rid.clone(), pid.clone()));
                }
                for s in p.streams.values() {
                    if let Some(l) = s.local {
                        fresh.claim(l, format!("participant {rid}/{pid}"))?;
                    }
                }
            }
        }
        for (id, r) in &self.relays {
            for (leg, side) in [(&r.a, Side::A), (&r.b, Side::B)] {
                let owner = format!("relay {id}/{}", side.name());
                match &leg.bundled {
                    // Claimed by the leg it is bundled with.
                    Some(b) if self.relays.get(&b.relay).is_some_and(|p| p.leg(side).local == leg.local && p.leg(side).bundled.is_none()) => {}
                    // That leg's relay is gone (deleted through the API): the address is held by
                    // a leg of its group (the first to claim it; see `delete_relay`).
                    Some(b) => {
                        let held_by_group = fresh
                            .owners
                            .get(&leg.local)
                            .and_then(|o| o.strip_prefix("relay "))
                            .and_then(|o| o.rsplit_once('/'))
                            .is_some_and(|(rid, _)| self.relays.get(rid).and_then(|o| o.leg(side).bundled.as_ref()).is_some_and(|ob| ob.relay == b.relay));
                        if !held_by_group {
                            fresh.claim(leg.local, owner)?;
                        }
                    }
                    None => fresh.claim(leg.local, owner)?,
                }
            }
            for f in &r.forks {
                fresh.claim(f.local, format!("relay {id}/fork {}", f.tag))?;
            }
            if let Some(d) = &r.rtcp_demux {
                fresh.claim(d.local, format!("relay {id}/rtcp"))?;
                fresh.demuxed.insert(d.uid, id.clone());
            }
            fresh.legs.insert(r.a.uid, (id.clone(), Side::A));
            fresh.legs.insert(r.b.uid, (id.clone(), Side::B));
        }
        self.owners = fresh.owners;
        self.legs = fresh.legs;
        self.demuxed = fresh.demuxed;
        self.transports = fresh.transports;
        self.next_uid = fresh.next_uid;
        Ok(())
    }

    pub(crate) fn owners_remove(&mut self, addr: SocketAddr) {
        self.owners.remove(&addr);
    }

    pub(crate) fn claim(&mut self, addr: SocketAddr, owner: String) -> Result<(), ModelError> {
        match self.owners.get(&addr) {
            Some(o) if *o != owner => Err(ModelError::AddressInUse { addr, owner: o.clone() }),
            _ => {
                self.owners.insert(addr, owner);
                self.last_claimed = AllocHint(addr.port());
                Ok(())
            }
        }
    }

    fn check_free(&self, addr: SocketAddr, owner: &str) -> Result<(), ModelError> {
        match self.owners.get(&addr) {
            Some(o) if o != owner => Err(ModelError::AddressInUse { addr, owner: o.clone() }),
            _ => Ok(()),
        }
    }

    pub(crate) fn uid(&mut self) -> u32 {
        let u = self.next_uid.max(1);
        self.next_uid = u + 1;
        u
    }

    /// The owner of a local address, if any (e.g. for port allocation).
    pub fn owner_of(&self, addr: &SocketAddr) -> Option<&str> {
        self.owners.get(addr).map(String::as_str)
    }

    /// The port of the address claimed last (where port allocation resumes).
    pub fn last_claimed_port(&self) -> u16 {
        self.last_claimed.0
    }

    pub fn local_addresses(&self) -> impl Iterator<Item = &SocketAddr> {
        self.owners.keys()
    }

    pub fn create_room(&mut self, id: &str) -> Result<(), ModelError> {
        check_id(id)?;
        if self.rooms.contains_key(id) {
            return Err(ModelError::Exists { kind: "room", id: id.into() });
        }
        self.rooms.insert(id.into(), Room::default());
        Ok(())
    }

    /// The most each WebRTC publisher of `room` may send (kbit/s; None: what its link carries).
    pub fn set_publisher_max_kbps(&mut self, room: &str, max_kbps: Option<u32>) -> Result<(), ModelError> {
        check_publisher_kbps("publisher_max_kbps", max_kbps)?;
        self.room_mut(room)?.publisher_max_kbps = max_kbps;
        Ok(())
    }

    /// The most WebRTC participant `pid` may send (kbit/s; None: its room's ceiling, if any; the
    /// lower of the two holds).
    pub fn set_participant_max_kbps(&mut self, room: &str, pid: &str, max_kbps: Option<u32>) -> Result<(), ModelError> {
        check_publisher_kbps("max_kbps", max_kbps)?;
        self.webrtc_mut(room, pid)?.1.max_kbps = max_kbps;
        Ok(())
    }

    pub fn delete_room(&mut self, id: &str) -> Result<(), ModelError> {
        let room = self.rooms.remove(id).ok_or_else(|| not_found("room", id))?;
        for p in room.participants.values() {
            if let Some(w) = &p.webrtc {
                self.transports.remove(&w.uid);
            }
            self.release_participant(p);
        }
        Ok(())
    }

    fn release_participant(&mut self, p: &Participant) {
        self.owners.remove(&p.local);
        for s in p.streams.values() {
            if let Some(l) = s.local {
                self.owners.remove(&l);
            }
        }
    }

    pub fn room(&self, id: &str) -> Result<&Room, ModelError> {
        self.rooms.get(id).ok_or_else(|| not_found("room", id))
    }

    fn room_mut(&mut self, id: &str) -> Result<&mut Room, ModelError> {
        self.rooms.get_mut(id).ok_or_else(|| not_found("room", id))
    }

    pub fn participant(&self, room: &str, pid: &str) -> Result<&Participant, ModelError> {
        self.room(room)?.participants.get(pid).ok_or_else(|| not_found("participant", pid))
    }

    pub fn add_participant(&mut self, room: &str, pid: &str, local: SocketAddr, remote: SocketAddr) -> Result<(), ModelError> {
        self.add_srtp_participant(room, pid, local, remote, None)
    }

    /// [`Model::add_participant`], speaking SRTP with the keys given (SDES) when `srtp` is set:
    /// both directions need a key.
    pub fn add_srtp_participant(
        &mut self,
        room: &str,
        pid: &str,
        local: SocketAddr,
        remote: SocketAddr,
        srtp: Option<crate::srtp::LegSrtp>,
    ) -> Result<(), ModelError> {
        check_id(pid)?;
        check_addr(local)?;
        check_addr(remote)?;
        if local.is_ipv4() != remote.is_ipv4() {
            return Err(ModelError::FamilyMismatch(format!("participant {pid}")));
        }
        if srtp.as_ref().is_some_and(|k| k.inbound.is_none() || k.outbound.is_none()) {
            return Err(ModelError::Invalid(format!("participant {pid}: SRTP needs a key for each direction")));
        }
        self.insert_participant(room, pid, Participant { local, remote, streams: BTreeMap::new(), subscriptions: BTreeMap::new(), webrtc: None, srtp })
    }

    /// Add a browser's participant (WHIP/WHEP) on `local`: no peer until ICE nominates one
    /// ([`Model::set_participant_nominated`]), no media until DTLS keys it
    /// ([`Model::set_participant_srtp`]). Returns its transport's uid.
    pub fn add_webrtc_participant(&mut self, room: &str, pid: &str, local: SocketAddr) -> Result<u32, ModelError> {
        check_id(pid)?;
        check_addr(local)?;
        let uid = self.uid();
        let webrtc = Some(WebrtcTransport {
            uid,
            nominated: false,
            srtp: Default::default(),
            stream_ids: None,
            transport_cc: None,
            abs_send_time: None,
            max_kbps: None,
            checked: None,
            pending: Vec::new(),
            late: Vec::new(),
        });
        let mut p = Participant { local, remote: local, streams: BTreeMap::new(), subscriptions: BTreeMap::new(), webrtc, srtp: None };
        // Its `remote` until ICE nominates one: nobody's address (see `Participant::source`).
        p.remote = p.source();
        self.insert_participant(room, pid, p)?;
        Ok(uid)
    }

    /// Add `p` as `pid` (its addresses checked already), claiming its SFU address.
    fn insert_participant(&mut self, room: &str, pid: &str, p: Participant) -> Result<(), ModelError> {
        let owner = format!("participant {room}/{pid}");
        if self.room(room)?.participants.contains_key(pid) {
            return Err(ModelError::Exists { kind: "participant", id: pid.into() });
        }
        self.check_free(p.local, &owner)?;
        self.claim(p.local, owner)?;
        if let Some(w) = &p.webrtc {
            self.transports.insert(w.uid, (room.into(), pid.into()));
        }
        self.room_mut(room)?.participants.insert(pid.into(), p);
        Ok(())
    }

    /// Remove every WebRTC participant (with its streams and the subscriptions to them): the
    /// rooms that changed.
    pub fn remove_webrtc_participants(&mut self) -> Vec<String> {
        let gone: Vec<(String, String)> = self
            .rooms
            .iter()
            .flat_map(|(rid, r)| r.participants.iter().filter(|(_, p)| p.webrtc.is_some()).map(move |(pid, _)| (rid.clone(), pid.clone())))
            .collect();
        let mut rooms: Vec<String> = Vec::new();
        for (rid, pid) in gone {
            if self.remove_participant(&rid, &pid).is_ok() && !rooms.contains(&rid) {
                rooms.push(rid);
            }
        }
        rooms
    }

    /// The WebRTC participant whose transport has this uid: (room, participant).
    pub fn participant_by_transport(&self, uid: u32) -> Option<(&str, &str)> {
        self.transports.get(&uid).map(|(r, p)| (r.as_str(), p.as_str()))
    }

    fn webrtc_mut(&mut self, room: &str, pid: &str) -> Result<(&mut SocketAddr, &mut WebrtcTransport), ModelError> {
        let p = self.room_mut(room)?.participants.get_mut(pid).ok_or_else(|| not_found("participant", pid))?;
        match &mut p.webrtc {
            Some(w) => Ok((&mut p.remote, w)),
            None => Err(ModelError::Invalid(format!("participant {room}/{pid} is not a WebRTC participant"))),
        }
    }

    /// The address a WebRTC participant's ICE checks nominated (None: its consent expired, and
    /// nothing is sent to it any more); true if that changed anything.
    pub fn set_participant_nominated(&mut self, room: &str, pid: &str, addr: Option<SocketAddr>) -> Result<bool, ModelError> {
        let (remote, w) = self.webrtc_mut(room, pid)?;
        match addr {
            Some(a) if a.is_ipv4() != remote.is_ipv4() => Err(ModelError::FamilyMismatch(format!("participant {room}/{pid}"))),
            Some(a) => {
                let changed = !w.nominated || *remote != a || w.checked.is_some();
                // The checked address served until now; a consent that ends later does not
                // bring it back.
                (*remote, w.nominated, w.checked) = (a, true, None);
                Ok(changed)
            }
            None => {
                let changed = w.nominated;
                w.nominated = false;
                Ok(changed)
            }
        }
    }

    /// An ICE check of a WebRTC participant from `addr` was answered before any nomination: its
    /// media is accepted from there until ICE nominates (only the first such address, and not
    /// after a nomination); true if that changed anything.
    pub fn set_participant_checked(&mut self, room: &str, pid: &str, addr: SocketAddr) -> Result<bool, ModelError> {
        let (remote, w) = self.webrtc_mut(room, pid)?;
        if w.nominated || w.checked.is_some() || addr.is_ipv4() != remote.is_ipv4() {
            return Ok(false);
        }
        w.checked = Some(addr);
        Ok(true)
    }

    /// The keys a WebRTC participant's DTLS handshake exported; true if that changed anything.
    pub fn set_participant_srtp(&mut self, room: &str, pid: &str, srtp: crate::srtp::LegSrtp) -> Result<bool, ModelError> {
        let (_, w) = self.webrtc_mut(room, pid)?;
        let changed = w.srtp != srtp;
        w.srtp = srtp;
        Ok(changed)
    }

    /// A WebRTC participant's packets carry transport-wide sequence numbers in header extension
    /// `id` (as its offer mapped it; 0 is no extension's): the SFU feeds back.
    pub fn set_transport_cc(&mut self, room: &str, pid: &str, id: u8) -> Result<(), ModelError> {
        if id == 0 {
            return Err(ModelError::Invalid("transport-cc header extension id 0".into()));
        }
        let (_, w) = self.webrtc_mut(room, pid)?;
        if w.transport_cc.is_some_and(|known| known != id) {
            return Err(ModelError::Invalid("one transport, one mapping of header extensions".into()));
        }
        w.transport_cc = Some(id);
        Ok(())
    }

    /// A WebRTC publisher's packets carry their send time (abs-send-time) in header extension
    /// `id`: estimated from when it has no transport-cc.
    pub fn set_abs_send_time(&mut self, room: &str, pid: &str, id: u8) -> Result<(), ModelError> {
        if id == 0 {
            return Err(ModelError::Invalid("abs-send-time header extension id 0".into()));
        }
        let (_, w) = self.webrtc_mut(room, pid)?;
        if w.abs_send_time.is_some_and(|known| known != id) {
            return Err(ModelError::Invalid("one transport, one mapping of header extensions".into()));
        }
        w.abs_send_time = Some(id);
        Ok(())
    }

    /// Let a WebRTC participant publish `section` once its layers are heard: its packets name
    /// their encoding with the header extensions `ids`.
    pub fn add_pending_simulcast(&mut self, room: &str, pid: &str, ids: StreamIdExtensions, section: PendingSimulcast) -> Result<(), ModelError> {
        check_id(&section.name)?;
        let n = section.rids.len();
        if !(1..=MAX_LAYERS).contains(&n) || section.ssrcs.len() != n || section.rids.iter().enumerate().any(|(i, r)| section.rids[..i].contains(r)) {
            return Err(ModelError::Invalid(format!("stream {}: 1 to {MAX_LAYERS} distinct RIDs", section.name)));
        }
        let p = self.participant(room, pid)?;
        let taken = p.streams.contains_key(&section.name) || p.webrtc.as_ref().is_some_and(|w| w.pending.iter().any(|o| o.name == section.name));
        if taken {
            return Err(ModelError::Exists { kind: "stream", id: section.name });
        }
        let (_, w) = self.webrtc_mut(room, pid)?;
        if w.stream_ids.is_some_and(|known| known != ids) {
            return Err(ModelError::Invalid("one transport, one mapping of header extensions".into()));
        }
        w.stream_ids = Some(ids);
        w.pending.push(section);
        Ok(())
    }

    /// A packet of WebRTC transport `uid` on `ssrc` named its encoding `rid` (and its section
    /// `mid`, when it did): the SSRC of that layer of a pending section. The section becomes a
    /// stream once every layer is heard; [`Model::publish_heard_simulcast`] publishes it with
    /// fewer after [`SIMULCAST_LEARNING_MS`]. None if nothing changed.
    pub fn learn_layer(&mut self, uid: u32, mid: Option<&str>, rid: &str, ssrc: u32, now_ms: u64) -> Option<SimulcastPublished> {
        let (room, pid) = self.participant_by_transport(uid).map(|(r, p)| (r.to_string(), p.to_string()))?;
        let p = self.participant(&room, &pid).ok()?;
        let w = p.webrtc.as_ref()?;
        let named = |s: &&PendingSimulcast| s.rids.iter().any(|r| r == rid) && mid.is_none_or(|m| m == s.mid);
        // An SSRC already a stream's or another layer's is not this one's.
        let used = p.streams.values().any(|s| s.ssrc == Some(ssrc) || s.layers.iter().any(|l| l.ssrc == ssrc))
            || w.pending.iter().chain(&w.late).any(|s| s.ssrcs.contains(&Some(ssrc)));
        let matching: Vec<usize> = w.pending.iter().enumerate().filter(|(_, s)| named(s)).map(|(i, _)| i).collect();
        let late: Vec<usize> = w.late.iter().enumerate().filter(|(_, s)| named(s)).map(|(i, _)| i).collect();
        // Without a MID, a RID two sections share (learning or published) names neither.
        let [i] = matching[..] else {
            return match (&matching[..], &late[..], used) {
                (&[], &[i], false) => self.join_late_layer(&room, &pid, i, rid, ssrc),
                _ => None,
            };
        };
        if !late.is_empty() {
            return None;
        }
        let layer = w.pending[i].rids.iter().position(|r| r == rid).expect("matched");
        if used || w.pending[i].ssrcs[layer].is_some() {
            return None;
        }
        let (_, w) = self.webrtc_mut(&room, &pid).ok()?;
        let section = &mut w.pending[i];
        section.ssrcs[layer] = Some(ssrc);
        section.heard_at_ms.get_or_insert(now_ms);
        let mut out = SimulcastPublished { rooms: vec![room.clone()], refused: Vec::new() };
        if section.ssrcs.iter().all(Option::is_some) {
            if let Err(e) = self.publish_pending(&room, &pid, i) {
                out.refused.push(format!("{room}/{pid}: {e}"));
            }
        }
        Some(out)
    }

    /// Whether [`Model::publish_heard_simulcast`] has anything to publish at `now_ms` (it looks
    /// at WebRTC participants only).
    pub fn simulcast_due(&self, now_ms: u64) -> bool {
        self.transports.values().any(|(rid, pid)| {
            let w = self.rooms.get(rid).and_then(|r| r.participants.get(pid)).and_then(|p| p.webrtc.as_ref());
            w.is_some_and(|w| w.pending.iter().any(|s| s.due(now_ms)))
        })
    }

    /// Publish every pending simulcast section whose first layer was heard
    /// [`SIMULCAST_LEARNING_MS`] ago or more, with the layers heard; drop those offered
    /// [`SIMULCAST_UNHEARD_MS`] ago with none heard.
    pub fn publish_heard_simulcast(&mut self, now_ms: u64) -> SimulcastPublished {
        let due: Vec<(String, String, usize)> = self
            .transports
            .values()
            .filter_map(|(rid, pid)| Some((rid, pid, self.rooms.get(rid)?.participants.get(pid)?.webrtc.as_ref()?)))
            .flat_map(|(rid, pid, w)| {
                w.pending.iter().enumerate().filter(|(_, s)| s.due(now_ms)).map(|(i, _)| (rid.clone(), pid.clone(), i)).collect::<Vec<_>>()
            })
            .collect();
        let mut out = SimulcastPublished::default();
        // From the last index down, so the earlier ones stay where they are.
        for (room, pid, i) in due.into_iter().rev() {
            if let Err(e) = self.publish_pending(&room, &pid, i) {
                out.refused.push(format!("{room}/{pid}: {e}"));
            }
            if !out.rooms.contains(&room) {
                out.rooms.push(room);
            }
        }
        out
    }

    /// Publish pending section `i` with the layers heard: simulcast with two or more, a plain
    /// stream with one. The section is gone either way (so one that cannot be published does
    /// not fail again with every packet).
    fn publish_pending(&mut self, room: &str, pid: &str, i: usize) -> Result<(), ModelError> {
        let (_, w) = self.webrtc_mut(room, pid)?;
        let section = w.pending.remove(i);
        let learned = section.learned();
        let mut spec = section.spec.clone();
        match learned.len() {
            0 => {}
            1 => (spec.ssrc, spec.codec) = (Some(learned[0].1), None),
            _ => spec.layers = learned.iter().map(|(_, s)| *s).collect(),
        }
        let published = if learned.is_empty() { Ok(0) } else { self.publish(room, pid, &section.name, spec) };
        let (_, w) = self.webrtc_mut(room, pid)?;
        // Layers above the top one heard may still come (a plain stream takes none).
        if published.is_ok() && learned.len() > 1 && section.has_room_above() {
            w.late.push(section.clone());
        }
        if w.pending.is_empty() && w.late.is_empty() {
            w.stream_ids = None;
        }
        published?;
        if let Some(stream) = self.room_mut(room)?.participants.get_mut(pid).and_then(|p| p.streams.get_mut(&section.name)) {
            stream.rids = learned.into_iter().map(|(r, _)| r).collect();
        }
        Ok(())
    }

    /// Layer `rid` of late section `i`, heard on `ssrc`, joins its stream if it is above the
    /// stream's top layer (below, the layers' order, and the consumers' choices and SSRC with
    /// it, would change: it is left out). The section is done once no offered layer is left
    /// above the top one.
    fn join_late_layer(&mut self, room: &str, pid: &str, i: usize, rid: &str, ssrc: u32) -> Option<SimulcastPublished> {
        let layer_uid = self.uid();
        let (_, w) = self.webrtc_mut(room, pid).ok()?;
        let section = &mut w.late[i];
        let layer = section.rids.iter().position(|r| r == rid)?;
        if section.ssrcs[layer].is_some() {
            return None;
        }
        section.ssrcs[layer] = Some(ssrc);
        let above_top = section.ssrcs[layer + 1..].iter().all(Option::is_none);
        let name = section.name.clone();
        let done = !section.has_room_above();
        if done {
            w.late.remove(i);
            if w.pending.is_empty() && w.late.is_empty() {
                w.stream_ids = None;
            }
        }
        let mut out = SimulcastPublished { rooms: vec![room.to_string()], refused: Vec::new() };
        let stream = self.room_mut(room).ok()?.participants.get_mut(pid).and_then(|p| p.streams.get_mut(&name));
        match stream {
            Some(s) if above_top && s.layers.len() < MAX_LAYERS => {
                s.layers.push(Layer { uid: layer_uid, ssrc });
                s.rids.push(rid.to_string());
            }
            Some(_) => out.refused.push(format!("{room}/{pid}/{name}: layer {rid} was heard after a higher one, and is left out")),
            None => out.refused.push(format!("{room}/{pid}/{name}: the stream is gone")),
        }
        Some(out)
    }

    /// Remove a participant, its streams, and every subscription to them.
    pub fn remove_participant(&mut self, room: &str, pid: &str) -> Result<(), ModelError> {
        let p = self.room_mut(room)?.participants.remove(pid).ok_or_else(|| not_found("participant", pid))?;
        self.release_participant(&p);
        if let Some(w) = &p.webrtc {
            self.transports.remove(&w.uid);
        }
        for other in self.room_mut(room)?.participants.values_mut() {
            other.subscriptions.retain(|s, _| s.publisher != pid);
        }
        Ok(())
    }

    /// Ingress of a stream: its own port or its publisher's transport address, plus SSRC.
    /// The ingress keys of a stream: its address with its SSRC, or with each layer's.
    fn ingress_of(p: &Participant, s: &Stream) -> Vec<(SocketAddr, Option<u32>)> {
        let addr = s.local.unwrap_or(p.local);
        if s.layers.is_empty() {
            vec![(addr, s.ssrc)]
        } else {
            s.layers.iter().map(|l| (addr, Some(l.ssrc))).collect()
        }
    }

    /// The stream of `p` already using this ingress. Only `p`'s streams can: the ingress
    /// address is `p`'s transport address or one that is free or owned by `p` (checked before).
    fn find_ingress(room: &str, pid: &str, p: &Participant, addr: SocketAddr, ssrc: Option<u32>) -> Option<String> {
        p.streams.iter().find(|(_, s)| Self::ingress_of(p, s).contains(&(addr, ssrc))).map(|(sid, _)| format!("stream {room}/{pid}/{sid}"))
    }

    /// A simulcast spec's layers are 2 to MAX_LAYERS distinct SSRCs on an RTP stream.
    fn check_layers(name: &str, spec: &StreamSpec) -> Result<(), ModelError> {
        if spec.layers.is_empty() {
            return match spec.codec {
                Some(_) => Err(ModelError::Invalid(format!("stream {name}: codec is only used with layers"))),
                None => Ok(()),
            };
        }
        let n = spec.layers.len();
        let bad = if !(2..=MAX_LAYERS).contains(&n) {
            Some(format!("has {n} layers; a simulcast stream has 2 to {MAX_LAYERS}"))
        } else if spec.ssrc.is_some() {
            Some("gives both ssrc and layers; a simulcast stream's SSRCs are its layers'".into())
        } else if !spec.rtp {
            Some("is not RTP; layers need RTP".into())
        } else if spec.layers.iter().enumerate().any(|(i, s)| spec.layers[..i].contains(s)) {
            Some("names one SSRC for two layers".into())
        } else {
            None
        };
        bad.map_or(Ok(()), |b| Err(ModelError::Invalid(format!("stream {name} {b}"))))
    }

    pub fn publish(&mut self, room: &str, pid: &str, name: &str, spec: StreamSpec) -> Result<u32, ModelError> {
        check_id(name)?;
        let owner = format!("participant {room}/{pid}");
        let p = self.participant(room, pid)?;
        let pending = p.webrtc.as_ref().is_some_and(|w| w.pending.iter().any(|s| s.name == name));
        if p.streams.contains_key(name) || pending {
            return Err(ModelError::Exists { kind: "stream", id: name.into() });
        }
        let ingress = spec.local.unwrap_or(p.local);
        if let Some(l) = spec.local {
            check_addr(l)?;
            if l.is_ipv4() != p.remote.is_ipv4() {
                return Err(ModelError::FamilyMismatch(format!("stream {name}")));
            }
            self.check_free(l, &owner)?;
        }
        Self::check_layers(name, &spec)?;
        if p.webrtc.is_some() && (spec.local.is_some() || (spec.ssrc.is_none() && spec.layers.is_empty())) {
            // Its transport address is a BUNDLE: STUN, DTLS and every stream, told apart by SSRC.
            return Err(ModelError::Invalid(format!("stream {name}: a WebRTC participant's streams arrive on its transport and need an SSRC")));
        }
        if p.srtp.is_some() && !spec.rtp && spec.ssrc.is_none() && spec.layers.is_empty() {
            return Err(ModelError::Invalid(format!("stream {name}: an SRTP participant's streams are RTP")));
        }
        if p.srtp.is_some() && spec.local.is_some() {
            // One address, one SRTP session per direction: a second address would protect the
            // same key's packets in a session of its own (two rollover counters, two SRTCP
            // indexes under one key).
            return Err(ModelError::Invalid(format!("stream {name}: an SRTP participant's streams arrive on its own address")));
        }
        let keys: Vec<Option<u32>> = if spec.layers.is_empty() { vec![spec.ssrc] } else { spec.layers.iter().map(|s| Some(*s)).collect() };
        for ssrc in keys {
            if let Some(o) = Self::find_ingress(room, pid, p, ingress, ssrc) {
                return Err(ModelError::IngressInUse { addr: ingress, ssrc, owner: o });
            }
        }
        if let Some(l) = spec.local {
            self.claim(l, owner)?;
        }
        let uid = self.uid();
        let layers = spec.layers.iter().map(|ssrc| Layer { uid: self.uid(), ssrc: *ssrc }).collect::<Vec<_>>();
        let codec = spec.codec.or_else(|| (!layers.is_empty()).then_some(Codec::Vp8));
        let rtp = spec.rtp || spec.ssrc.is_some();
        let stream = Stream { uid, local: spec.local, ssrc: spec.ssrc, rtp, clock_rate: spec.clock_rate, layers, codec, format: spec.format, rids: Vec::new() };
        self.room_mut(room)?.participants.get_mut(pid).unwrap().streams.insert(name.into(), stream);
        Ok(uid)
    }

    /// Remove a stream and every subscription to it.
    pub fn unpublish(&mut self, room: &str, pid: &str, name: &str) -> Result<(), ModelError> {
        let r = self.room_mut(room)?;
        let p = r.participants.get_mut(pid).ok_or_else(|| not_found("participant", pid))?;
        let s = p.streams.remove(name).ok_or_else(|| not_found("stream", name))?;
        if let Some(w) = &mut p.webrtc {
            w.late.retain(|l| l.name != name);
            if w.pending.is_empty() && w.late.is_empty() {
                w.stream_ids = None;
            }
        }
        let gone = StreamRef { publisher: pid.into(), stream: name.into() };
        for other in r.participants.values_mut() {
            other.subscriptions.remove(&gone);
        }
        if let Some(l) = s.local {
            // The participant may still use it for another stream with a different SSRC.
            let still_used = self.rooms[room].participants[pid].streams.values().any(|o| o.local == Some(l));
            if !still_used {
                self.owners.remove(&l);
            }
        }
        Ok(())
    }

    /// Subscribe `subscriber` to a stream: the uid of its consumer (the existing one when it is
    /// subscribed already).
    pub fn subscribe(&mut self, room: &str, subscriber: &str, to: StreamRef) -> Result<u32, ModelError> {
        if subscriber == to.publisher {
            return Err(ModelError::SelfSubscription);
        }
        let r = self.room(room)?;
        r.participants.get(subscriber).ok_or_else(|| not_found("participant", subscriber))?;
        let publ = r.participants.get(&to.publisher).ok_or_else(|| not_found("participant", &to.publisher))?;
        let stream = publ.streams.get(&to.stream).ok_or_else(|| not_found("stream", &to.stream))?;
        if r.participants[subscriber].speaks_srtp() && !stream.rtp {
            // Its copies would be protected as SRTP, which only RTP can be.
            return Err(ModelError::Invalid(format!("{subscriber} speaks SRTP and receives RTP only: stream {} is not RTP", to.stream)));
        }
        if let Some(c) = r.participants[subscriber].subscriptions.get(&to) {
            return Ok(c.uid);
        }
        let uid = self.uid();
        self.room_mut(room)?.participants.get_mut(subscriber).unwrap().subscriptions.insert(to, Consumer { uid, ..Default::default() });
        Ok(uid)
    }

    /// The payload type `subscriber`'s copies of `to` carry (see [`Consumer::payload_type`]).
    pub fn set_consumer_payload_type(&mut self, room: &str, subscriber: &str, to: &StreamRef, pt: Option<u8>) -> Result<(), ModelError> {
        if pt.is_some_and(|pt| pt > 127) {
            return Err(ModelError::Invalid(format!("payload type {pt:?} is not 0-127")));
        }
        let p = self.room_mut(room)?.participants.get_mut(subscriber).ok_or_else(|| not_found("participant", subscriber))?;
        let c = p.subscriptions.get_mut(to).ok_or_else(|| not_found("subscription", &format!("{}/{}", to.publisher, to.stream)))?;
        c.payload_type = pt;
        Ok(())
    }

    /// Choose the layers consumer `uid` of `room` receives of its simulcast stream (None: the top
    /// one, no cap), whether its reports may lower them, and its temporal ceiling (None: all); all
    /// replaced. The layer changes at the next keyframe of it, which the data plane asks for.
    pub fn set_consumer_layers(
        &mut self,
        room: &str,
        uid: u32,
        preferred: Option<u8>,
        max: Option<u8>,
        auto_layer: bool,
        temporal: Option<u8>,
    ) -> Result<Consumer, ModelError> {
        let r = self.room(room)?;
        let (pid, sref) = r
            .participants
            .iter()
            .find_map(|(pid, p)| p.subscriptions.iter().find(|(_, c)| c.uid == uid).map(|(s, _)| (pid.clone(), s.clone())))
            .ok_or_else(|| not_found("consumer", &uid.to_string()))?;
        let layers = r.participants.get(&sref.publisher).and_then(|p| p.streams.get(&sref.stream)).map_or(0, |s| s.layers.len());
        if layers == 0 {
            return Err(ModelError::Invalid(format!("consumer {uid} receives {}/{}, which has no layers", sref.publisher, sref.stream)));
        }
        if let Some(l) = preferred.into_iter().chain(max).find(|l| *l as usize >= layers) {
            return Err(ModelError::Invalid(format!("layer {l} does not exist: {}/{} has layers 0 to {}", sref.publisher, sref.stream, layers - 1)));
        }
        if let Some(t) = temporal.filter(|t| *t > MAX_TEMPORAL_LAYER) {
            return Err(ModelError::Invalid(format!("temporal layer {t} does not exist: VP8 has temporal layers 0 to {MAX_TEMPORAL_LAYER}")));
        }
        let c = self.room_mut(room)?.participants.get_mut(&pid).expect("found").subscriptions.get_mut(&sref).expect("found");
        (c.preferred_layer, c.max_layer, c.auto_layer, c.temporal_layer) = (preferred, max, auto_layer, temporal);
        Ok(*c)
    }

    pub fn unsubscribe(&mut self, room: &str, subscriber: &str, from: &StreamRef) -> Result<(), ModelError> {
        let r = self.room_mut(room)?;
        let p = r.participants.get_mut(subscriber).ok_or_else(|| not_found("participant", subscriber))?;
        if p.subscriptions.remove(from).is_none() {
            return Err(not_found("subscription", &format!("{}/{}", from.publisher, from.stream)));
        }
        Ok(())
    }

    pub fn create_relay(&mut self, id: &str, a: LegSpec, b: LegSpec) -> Result<(), ModelError> {
        check_id(id)?;
        if self.relays.contains_key(id) {
            return Err(ModelError::Exists { kind: "relay", id: id.into() });
        }
        for (leg, side) in [(&a, "a"), (&b, "b")] {
            check_addr(leg.local)?;
            if let Some(r) = leg.remote {
                check_addr(r)?;
                if r.is_ipv4() != leg.local.is_ipv4() {
                    return Err(ModelError::FamilyMismatch(format!("relay {id}/{side}")));
                }
            }
            self.check_free(leg.local, &format!("relay {id}/{side}"))?;
        }
        if a.local == b.local {
            return Err(ModelError::AddressInUse { addr: b.local, owner: format!("relay {id}/a") });
        }
        self.claim(a.local, format!("relay {id}/a"))?;
        self.claim(b.local, format!("relay {id}/b"))?;
        let mk = |m: &mut Model, s: LegSpec| Leg {
            uid: m.uid(),
            local: s.local,
            remote: s.remote,
            latched: None,
            strict: s.strict,
            rtp: s.rtp,
            follow: s.follow,
            learning: Learning::default(),
            held: false,
            srtp: None,
            clock_rate: None,
            ice: false,
            ice_credentials: None,
            control: MediaControl::default(),
            telephone_events: Vec::new(),
            dtmf: Vec::new(),
            bundled: None,
        };
        let a = mk(self, a);
        let b = mk(self, b);
        self.legs.insert(a.uid, (id.into(), Side::A));
        self.legs.insert(b.uid, (id.into(), Side::B));
        self.relays.insert(id.into(), Relay { a, b, record: false, control: MediaControl::default(), forks: Vec::new(), report_dtmf: false, rtcp_demux: None });
        Ok(())
    }

    pub fn delete_relay(&mut self, id: &str) -> Result<Relay, ModelError> {
        let r = self.relays.remove(id).ok_or_else(|| not_found("relay", id))?;
        for (leg, side) in [(&r.a, Side::A), (&r.b, Side::B)] {
            // The address goes with its claim: a bundled leg's is its group's first leg's, and a
            // leg that holds one passes it to a leg still on it (a group whose first relay is
            // deleted through the API keeps its address claimed while any of it is left).
            if self.owners.get(&leg.local).map(String::as_str) != Some(format!("relay {id}/{}", side.name()).as_str()) {
                continue;
            }
            let heir = leg.ice.then(|| self.relays.iter().find(|(_, o)| o.leg(side).local == leg.local && o.leg(side).bundled.is_some())).flatten();
            match heir.map(|(rid, _)| format!("relay {rid}/{}", side.name())) {
                Some(heir) => {
                    self.owners.insert(leg.local, heir);
                }
                None => {
                    self.owners.remove(&leg.local);
                }
            }
        }
        for f in &r.forks {
            self.owners.remove(&f.local);
        }
        if let Some(d) = &r.rtcp_demux {
            self.owners.remove(&d.local);
            self.demuxed.remove(&d.uid);
        }
        self.legs.remove(&r.a.uid);
        self.legs.remove(&r.b.uid);
        Ok(r)
    }

    pub(crate) fn leg_mut(&mut self, id: &str, side: Side) -> Result<&mut Leg, ModelError> {
        let r = self.relays.get_mut(id).ok_or_else(|| not_found("relay", id))?;
        Ok(match side {
            Side::A => &mut r.a,
            Side::B => &mut r.b,
        })
    }

    /// A packet from `source` reached a learning leg (the data plane relayed it already):
    /// follow it if the leg's rules say so. `now_ms`: Unix milliseconds. Returns true when the
    /// leg changed (its peer, or it locked).
    ///
    /// A [`Follow::Window`] leg follows the newest source while its window is open, except the
    /// address a signal moved it away from once the newly signalled one has been heard; the
    /// first packet after a window that saw none locks its source at once. A leg that never
    /// had a window (created outside signalling) locks its first source.
    pub fn latch(&mut self, id: &str, side: Side, source: SocketAddr, now_ms: u64) -> Result<bool, ModelError> {
        let leg = self.leg_mut(id, side)?;
        if !leg.learns() || source.port() == 0 || source.is_ipv4() != leg.local.is_ipv4() {
            return Ok(false);
        }
        let windowed = leg.has_window();
        let l = &mut leg.learning;
        if windowed && l.open && l.heard_signalled && Some(source) == l.superseded {
            return Ok(false);
        }
        if Some(source) == leg.remote {
            l.heard_signalled = true;
        }
        let mut changed = leg.latched != Some(source);
        leg.latched = Some(source);
        if l.open && now_ms >= l.until_ms {
            l.open = false;
            changed = true;
        }
        Ok(changed)
    }

    /// A signal (offer, answer) for the call this leg belongs to: open its learning window
    /// until `until_ms`. A signal does not re-open learning on strict or asymmetric legs.
    pub fn open_learning(&mut self, id: &str, side: Side, until_ms: u64) -> Result<(), ModelError> {
        let leg = self.leg_mut(id, side)?;
        if leg.has_window() {
            leg.learning.open = true;
            leg.learning.until_ms = until_ms;
        }
        Ok(())
    }

    /// Lock the source of every leg whose window ended by `now_ms` and that has heard one.
    /// Returns the relays that changed.
    pub fn close_learning(&mut self, now_ms: u64) -> Vec<String> {
        let ids: Vec<String> = self.relays.iter().filter(|(_, r)| r.a.window_due(now_ms) || r.b.window_due(now_ms)).map(|(id, _)| id.clone()).collect();
        for id in &ids {
            if let Some(r) = self.relays.get_mut(id) {
                for leg in [&mut r.a, &mut r.b] {
                    if leg.window_due(now_ms) {
                        leg.learning.open = false;
                    }
                }
            }
        }
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn room_of_two() -> Model {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "alice", a("10.0.0.1:4000"), a("10.0.1.1:5000")).unwrap();
        m.add_participant("r", "bob", a("10.0.0.1:4002"), a("10.0.1.2:5000")).unwrap();
        m
    }

    #[test]
    fn simulcast_streams_are_checked_and_their_consumers_choose_layers() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        m.add_participant("r", "p0", a("10.0.0.1:4000"), a("10.0.1.1:5000")).unwrap();
        m.add_participant("r", "p1", a("10.0.0.1:4002"), a("10.0.1.2:5000")).unwrap();
        let sim = |layers: Vec<u32>| StreamSpec { layers, ..Default::default() };
        assert!(matches!(m.publish("r", "p0", "v", sim(vec![1])), Err(ModelError::Invalid(_))), "one layer");
        assert!(matches!(m.publish("r", "p0", "v", sim(vec![1, 2, 3, 4, 5])), Err(ModelError::Invalid(_))), "five layers");
        assert!(matches!(m.publish("r", "p0", "v", sim(vec![1, 1])), Err(ModelError::Invalid(_))), "one SSRC twice");
        let both = StreamSpec { ssrc: Some(9), layers: vec![1, 2], ..Default::default() };
        assert!(matches!(m.publish("r", "p0", "v", both), Err(ModelError::Invalid(_))));
        m.publish("r", "p0", "a", StreamSpec { ssrc: Some(2), ..Default::default() }).unwrap();
        assert!(matches!(m.publish("r", "p0", "v", sim(vec![1, 2])), Err(ModelError::IngressInUse { ssrc: Some(2), .. })), "a layer's SSRC in use");
        m.publish("r", "p0", "v", sim(vec![10, 11, 12])).unwrap();
        let s = m.rooms["r"].participants["p0"].streams["v"].clone();
        assert_eq!((s.layers.len(), s.codec), (3, Some(Codec::Vp8)));
        assert!(s.layers.iter().all(|l| l.uid != 0 && l.uid != s.uid));
        assert!(matches!(m.publish("r", "p0", "w", StreamSpec { ssrc: Some(11), ..Default::default() }), Err(ModelError::IngressInUse { .. })));
        let c = m.subscribe("r", "p1", StreamRef { publisher: "p0".into(), stream: "v".into() }).unwrap();
        let plain = m.subscribe("r", "p1", StreamRef { publisher: "p0".into(), stream: "a".into() }).unwrap();
        assert_eq!(m.set_consumer_layers("r", c, Some(2), Some(1), true, None).unwrap().wanted_layer(3), 1, "capped");
        assert_eq!(m.set_consumer_layers("r", c, None, None, true, Some(1)).unwrap().temporal_layer, Some(1));
        assert!(matches!(m.set_consumer_layers("r", c, None, None, true, Some(4)), Err(ModelError::Invalid(_))));
        assert_eq!(Consumer::default().wanted_layer(3), 2, "the top one by default");
        assert!(matches!(m.set_consumer_layers("r", c, Some(3), None, true, None), Err(ModelError::Invalid(_))));
        assert!(matches!(m.set_consumer_layers("r", plain, Some(0), None, true, None), Err(ModelError::Invalid(_))));
        assert!(matches!(m.set_consumer_layers("r", 9999, None, None, true, None), Err(ModelError::NotFound { .. })));
        // Layers and choices survive a store round trip; a layer's uid counts as used.
        let json = serde_json::to_string(&m.rooms["r"]).unwrap();
        let room: Room = serde_json::from_str(&json).unwrap();
        let back = Model::from_parts([("r".to_string(), room)], [], 1).unwrap();
        assert_eq!(back.rooms["r"], m.rooms["r"]);
        assert!(back.next_uid() > s.layers.iter().map(|l| l.uid).max().unwrap());
        // A stored simulcast stream publish() would refuse is refused on load.
        let mut broken: Room = serde_json::from_str(&json).unwrap();
        broken.participants.get_mut("p0").unwrap().streams.get_mut("v").unwrap().ssrc = Some(5);
        assert!(matches!(Model::from_parts([("r".to_string(), broken)], [], 1), Err(ModelError::Inconsistent(_))));
    }

    #[test]
    fn ids_and_addresses_are_validated() {
        let mut m = Model::new();
        assert!(matches!(m.create_room(""), Err(ModelError::InvalidId(_))));
        assert!(matches!(m.create_room("a/b"), Err(ModelError::InvalidId(_))));
        assert!(matches!(m.create_room(&"x".repeat(65)), Err(ModelError::InvalidId(_))));
        m.create_room("r").unwrap();
        assert!(matches!(m.create_room("r"), Err(ModelError::Exists { .. })));
        let e = m.add_participant("r", "p", a("0.0.0.0:4000"), a("10.0.1.1:5000"));
        assert!(matches!(e, Err(ModelError::BadAddress(_))));
        let e = m.add_participant("r", "p", a("10.0.0.1:0"), a("10.0.1.1:5000"));
        assert!(matches!(e, Err(ModelError::BadAddress(_))));
        let e = m.add_participant("r", "p", a("10.0.0.1:4000"), a("[fd00::1]:5000"));
        assert!(matches!(e, Err(ModelError::FamilyMismatch(_))));
        assert!(matches!(m.add_participant("nope", "p", a("10.0.0.1:1"), a("10.0.0.2:1")), Err(ModelError::NotFound { .. })));
    }

    #[test]
    fn local_addresses_have_one_owner() {
        let mut m = room_of_two();
        let e = m.add_participant("r", "carol", a("10.0.0.1:4000"), a("10.0.1.3:5000"));
        assert!(matches!(e, Err(ModelError::AddressInUse { .. })));
        let spec = StreamSpec { local: Some(a("10.0.0.1:4002")), ssrc: None, rtp: true, clock_rate: None, ..Default::default() };
        assert!(matches!(m.publish("r", "alice", "s", spec), Err(ModelError::AddressInUse { .. })));
        let leg = |p| LegSpec { local: a(p), remote: None, strict: false, rtp: true, follow: Default::default() };
        assert!(matches!(m.create_relay("c", leg("10.0.0.1:4000"), leg("10.0.0.1:9000")), Err(ModelError::AddressInUse { .. })));
        m.create_relay("c", leg("10.0.0.1:9000"), leg("10.0.0.1:9002")).unwrap();
        // Deleting frees the addresses for reuse.
        m.delete_relay("c").unwrap();
        m.remove_participant("r", "alice").unwrap();
        m.add_participant("r", "carol", a("10.0.0.1:4000"), a("10.0.1.3:5000")).unwrap();
        m.create_relay("c", leg("10.0.0.1:9000"), leg("10.0.0.1:9002")).unwrap();
    }

    #[test]
    fn ingress_must_be_unique_but_ssrc_narrows_it() {
        let mut m = room_of_two();
        m.publish("r", "alice", "low", StreamSpec { ssrc: Some(1), ..Default::default() }).unwrap();
        m.publish("r", "alice", "high", StreamSpec { ssrc: Some(2), ..Default::default() }).unwrap();
        let dup = m.publish("r", "alice", "again", StreamSpec { ssrc: Some(2), ..Default::default() });
        assert!(matches!(dup, Err(ModelError::IngressInUse { .. })));
        assert!(matches!(m.publish("r", "alice", "low", StreamSpec::default()), Err(ModelError::Exists { .. })));
    }

    #[test]
    fn removing_a_publisher_removes_subscriptions_to_it() {
        let mut m = room_of_two();
        m.publish("r", "alice", "main", StreamSpec::default()).unwrap();
        let sref = StreamRef { publisher: "alice".into(), stream: "main".into() };
        assert_eq!(m.subscribe("r", "alice", sref.clone()), Err(ModelError::SelfSubscription));
        m.subscribe("r", "bob", sref.clone()).unwrap();
        assert!(m.participant("r", "bob").unwrap().subscriptions.contains_key(&sref));
        m.unpublish("r", "alice", "main").unwrap();
        assert!(m.participant("r", "bob").unwrap().subscriptions.is_empty());
        assert!(matches!(m.unsubscribe("r", "bob", &sref), Err(ModelError::NotFound { .. })));
    }

    #[test]
    fn each_subscription_is_a_consumer_with_a_uid_of_its_own() {
        let mut m = room_of_two();
        let stream = m.publish("r", "alice", "main", StreamSpec::default()).unwrap();
        let sref = StreamRef { publisher: "alice".into(), stream: "main".into() };
        let consumer = m.subscribe("r", "bob", sref.clone()).unwrap();
        assert_ne!(consumer, stream);
        assert_eq!(m.subscribe("r", "bob", sref.clone()).unwrap(), consumer, "subscribing again keeps the consumer");
        // Stored and shown as a list; a list stored before consumers had uids gets fresh ones.
        let room = serde_json::to_value(m.room("r").unwrap()).unwrap();
        assert_eq!(room["participants"]["bob"]["subscriptions"], serde_json::json!([{"publisher": "alice", "stream": "main", "consumer": consumer}]));
        let mut old = room.clone();
        old["participants"]["bob"]["subscriptions"] = serde_json::json!([{"publisher": "alice", "stream": "main"}]);
        let back = Model::from_parts([("r".to_string(), serde_json::from_value(old).unwrap())], [], 0).unwrap();
        let renumbered = back.participant("r", "bob").unwrap().subscriptions[&sref].uid;
        assert!(renumbered > stream && renumbered < back.next_uid(), "{renumbered}");
    }

    #[test]
    fn serde_roundtrip_then_reindex_keeps_ownership() {
        let mut m = room_of_two();
        m.publish("r", "alice", "hi", StreamSpec { local: Some(a("10.0.0.1:4100")), ssrc: None, rtp: true, clock_rate: None, ..Default::default() }).unwrap();
        let json = serde_json::to_string(&m).unwrap();
        let mut back: Model = serde_json::from_str(&json).unwrap();
        back.reindex().unwrap();
        assert_eq!(back, m);
        assert_eq!(back.owner_of(&a("10.0.0.1:4100")), Some("participant r/alice"));
        // uids keep increasing after a reload.
        let u = back.publish("r", "bob", "x", StreamSpec::default()).unwrap();
        assert!(u > m.participant("r", "alice").unwrap().streams["hi"].uid);
    }

    #[test]
    fn latching_respects_strict_legs() {
        let mut m = Model::new();
        let leg = |p, strict| LegSpec { local: a(p), remote: Some(a("10.0.2.1:7000")), strict, rtp: true, follow: Default::default() };
        m.create_relay("c", leg("10.0.0.1:9000", false), leg("10.0.0.1:9002", true)).unwrap();
        assert!(m.latch("c", Side::A, a("10.0.2.9:7777"), 0).unwrap());
        assert!(!m.latch("c", Side::A, a("10.0.2.9:7777"), 0).unwrap());
        assert!(!m.latch("c", Side::B, a("10.0.2.9:7777"), 0).unwrap());
        assert_eq!(m.relays["c"].a.peer(), Some(a("10.0.2.9:7777")));
        assert_eq!(m.relays["c"].b.peer(), Some(a("10.0.2.1:7000")));
        // No window was ever opened (a relay made outside signalling): the first source locks.
        assert!(!m.latch("c", Side::A, a("10.0.2.9:8888"), 0).unwrap());
        assert_eq!(m.relays["c"].a.peer(), Some(a("10.0.2.9:7777")));
    }

    /// One relay whose leg A (the caller) signalled `p1` and opened its window at t=0 (3 s).
    fn signalled_call(p1: &str) -> Model {
        let mut m = Model::new();
        let leg = |p, r: Option<&str>| LegSpec { local: a(p), remote: r.map(a), strict: false, rtp: true, follow: Follow::Window };
        m.create_relay("c", leg("10.0.0.1:9000", Some(p1)), leg("10.0.0.1:9002", Some("10.0.3.1:8000"))).unwrap();
        m.open_learning("c", Side::A, 3_000).unwrap();
        m
    }

    fn move_to(m: &mut Model, remote: &str, now: u64) {
        m.set_leg_signal("c", Side::A, crate::LegSignal { remote: Some(a(remote)), ..Default::default() }).unwrap();
        m.open_learning("c", Side::A, now + 3_000).unwrap();
    }

    #[test]
    fn the_window_follows_the_newest_source_then_locks() {
        let mut m = signalled_call("10.0.2.1:7000");
        // A NAT binding, then a rebinding inside the window: followed.
        assert!(m.latch("c", Side::A, a("192.0.2.7:40000"), 100).unwrap());
        assert!(m.latch("c", Side::A, a("192.0.2.7:40002"), 1_000).unwrap());
        assert_eq!(m.relays["c"].a.peer(), Some(a("192.0.2.7:40002")));
        // The window ends: locked. A later rebinding is relayed (SourceRule::Any), not followed.
        assert!(m.close_learning(2_999).is_empty());
        assert_eq!(m.close_learning(3_000), vec!["c".to_string()]);
        assert!(!m.relays["c"].a.learns());
        assert!(!m.latch("c", Side::A, a("192.0.2.7:40004"), 6_000).unwrap());
        assert_eq!(m.relays["c"].a.peer(), Some(a("192.0.2.7:40002")));
        // A signal with the same address (a session refresh) keeps what was learnt and learns again.
        move_to(&mut m, "10.0.2.1:7000", 7_000);
        assert_eq!(m.relays["c"].a.peer(), Some(a("192.0.2.7:40002")));
        assert!(m.latch("c", Side::A, a("192.0.2.7:40004"), 7_500).unwrap());
        assert_eq!(m.relays["c"].a.peer(), Some(a("192.0.2.7:40004")));
    }

    #[test]
    fn a_moved_port_wins_over_old_port_stragglers() {
        let mut m = signalled_call("10.0.2.1:7000");
        assert!(m.latch("c", Side::A, a("10.0.2.1:7000"), 100).unwrap());
        m.close_learning(3_000);
        // re-INVITE at t=10 s: the caller moves to port 7002 but sends from 7000 until the
        // answer. The new address is sent to at once; a straggler wins it back only until the
        // new port is heard from.
        move_to(&mut m, "10.0.2.1:7002", 10_000);
        assert_eq!(m.relays["c"].a.peer(), Some(a("10.0.2.1:7002")));
        assert!(m.latch("c", Side::A, a("10.0.2.1:7000"), 10_020).unwrap());
        assert_eq!(m.relays["c"].a.peer(), Some(a("10.0.2.1:7000")), "the UA still listens on its old port until the answer");
        // The answer (200 ms late) re-opens the window; the caller switches to 7002.
        m.open_learning("c", Side::A, 13_200).unwrap();
        assert!(!m.latch("c", Side::A, a("10.0.2.1:7000"), 10_210).unwrap(), "already there");
        assert!(m.latch("c", Side::A, a("10.0.2.1:7002"), 10_220).unwrap());
        assert!(!m.latch("c", Side::A, a("10.0.2.1:7000"), 10_240).unwrap(), "a straggler after the new port was heard");
        assert_eq!(m.relays["c"].a.peer(), Some(a("10.0.2.1:7002")));
        m.close_learning(13_200);
        assert_eq!(m.relays["c"].a.peer(), Some(a("10.0.2.1:7002")));
    }

    #[test]
    fn a_window_without_packets_locks_the_first_source_after_it() {
        let mut m = signalled_call("10.0.2.1:7000");
        assert!(m.close_learning(5_000).is_empty(), "nothing heard: stays open");
        assert!(m.latch("c", Side::A, a("192.0.2.7:40000"), 5_000).unwrap());
        assert!(!m.relays["c"].a.learns());
        assert!(!m.latch("c", Side::A, a("192.0.2.7:40002"), 5_020).unwrap());
    }

    #[test]
    fn handover_follows_always_and_asymmetric_never() {
        let mut m = signalled_call("10.0.2.1:7000");
        let signal = |follow| crate::LegSignal { remote: Some(a("10.0.2.1:7000")), follow, ..Default::default() };
        m.set_leg_signal("c", Side::A, signal(Follow::Handover)).unwrap();
        m.latch("c", Side::A, a("192.0.2.7:40000"), 100).unwrap();
        m.close_learning(10_000);
        assert!(m.latch("c", Side::A, a("192.0.2.7:40002"), 60_000).unwrap());
        assert_eq!(m.relays["c"].a.peer(), Some(a("192.0.2.7:40002")));
        m.set_leg_signal("c", Side::A, signal(Follow::Asymmetric)).unwrap();
        assert!(!m.relays["c"].a.learns());
        assert!(!m.latch("c", Side::A, a("192.0.2.7:40004"), 60_100).unwrap());
        assert_eq!(m.relays["c"].a.peer(), Some(a("10.0.2.1:7000")), "asymmetric: the signalled address");
    }

    #[test]
    fn hold_sends_nothing_to_the_holder_and_keeps_its_address() {
        let mut m = signalled_call("10.0.2.1:7000");
        m.latch("c", Side::A, a("192.0.2.7:40000"), 100).unwrap();
        m.set_leg_signal("c", Side::A, crate::LegSignal { remote: None, held: true, ..Default::default() }).unwrap();
        assert_eq!(m.relays["c"].a.peer(), None);
        assert_eq!(m.relays["c"].a.remote, Some(a("10.0.2.1:7000")));
        // Unhold with the same address: back to what was learnt.
        m.set_leg_signal("c", Side::A, crate::LegSignal { remote: Some(a("10.0.2.1:7000")), ..Default::default() }).unwrap();
        assert_eq!(m.relays["c"].a.peer(), Some(a("192.0.2.7:40000")));
    }

    /// A browser's participant: no peer until ICE nominates one, found by its transport's uid,
    /// its keys never stored, and gone (with the subscriptions to it) when a restarted daemon
    /// drops what it cannot resume.
    #[test]
    fn webrtc_participants_are_nominated_keyed_and_not_resumed() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        let uid = m.add_webrtc_participant("r", "w", a("10.0.0.1:4000")).unwrap();
        m.add_participant("r", "plain", a("10.0.0.1:4002"), a("10.0.1.1:5000")).unwrap();
        assert_eq!(m.participant_by_transport(uid), Some(("r", "w")));
        let w = m.participant("r", "w").unwrap();
        assert_eq!((w.peer(), w.source()), (None, a("0.0.0.0:9")));
        assert!(m.publish("r", "w", "cam", StreamSpec::default()).is_err(), "a browser's stream needs an SSRC");
        m.publish("r", "w", "cam", StreamSpec { ssrc: Some(7), ..Default::default() }).unwrap();
        m.subscribe("r", "plain", StreamRef { publisher: "w".into(), stream: "cam".into() }).unwrap();
        assert!(m.set_participant_nominated("r", "w", Some(a("10.0.2.2:6000"))).unwrap());
        assert_eq!(m.participant("r", "w").unwrap().peer(), Some(a("10.0.2.2:6000")));
        assert!(m.set_participant_nominated("r", "plain", None).is_err(), "not a WebRTC participant");
        let key = crate::srtp::SrtpKey::new(crate::srtp::SrtpSuite::AesCm128HmacSha1_80, vec![9; 30]).unwrap();
        m.set_participant_srtp("r", "w", crate::srtp::LegSrtp { inbound: Some(key.clone()), outbound: Some(key) }).unwrap();
        let stored = serde_json::to_string(&m.rooms["r"]).unwrap();
        assert!(!stored.contains("master") && !stored.contains("suite"), "keys are never stored: {stored}");
        // Consent gone: no peer, nobody's source.
        m.set_participant_nominated("r", "w", None).unwrap();
        assert_eq!(m.participant("r", "w").unwrap().source(), a("0.0.0.0:9"));
        assert_eq!(m.remove_webrtc_participants(), ["r"]);
        assert!(m.participant("r", "w").is_err() && m.participant_by_transport(uid).is_none());
        assert!(m.participant("r", "plain").unwrap().subscriptions.is_empty());
        assert!(m.owner_of(&a("10.0.0.1:4000")).is_none(), "its port is free again");
    }

    /// A browser's simulcast section: its layers' SSRCs come from the RIDs its packets name;
    /// it becomes a stream when all are heard, or with those heard once the learning time is
    /// over (one heard: a plain stream). Reports that do not fit change nothing.
    #[test]
    fn simulcast_sections_become_streams_as_their_layers_are_heard() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        let uid = m.add_webrtc_participant("r", "w", a("10.0.0.1:4000")).unwrap();
        let ids = StreamIdExtensions { rid: 10, mid: Some(9) };
        let section = |name: &str, mid: &str, rids: &[&str]| PendingSimulcast {
            name: name.into(),
            mid: mid.into(),
            rids: rids.iter().map(|r| r.to_string()).collect(),
            ssrcs: vec![None; rids.len()],
            spec: StreamSpec { clock_rate: Some(90000), codec: Some(Codec::Vp8), ..Default::default() },
            heard_at_ms: None,
            offered_at_ms: 0,
        };
        m.add_pending_simulcast("r", "w", ids, section("video", "1", &["q", "h", "f"])).unwrap();
        m.add_pending_simulcast("r", "w", ids, section("video-2", "2", &["q", "f"])).unwrap();
        assert!(m.add_pending_simulcast("r", "w", ids, section("video", "3", &["q", "h"])).is_err(), "its name is taken");
        assert!(m.add_pending_simulcast("r", "w", ids, section("x", "3", &["q", "q"])).is_err());
        assert!(m.add_pending_simulcast("r", "w", StreamIdExtensions { rid: 3, mid: None }, section("y", "4", &["a", "b"])).is_err());
        let entry = |m: &Model| crate::ForwardingTable::compile(m, 1).streams[&crate::IngressKey { local: a("10.0.0.1:4000"), ssrc: None }].clone();
        assert_eq!(entry(&m).stream_ids, Some(ids), "the transport's entry reads the RIDs");

        // Section 1: q and f heard, h never. Section 2: all heard, so published at once.
        assert!(m.learn_layer(uid, Some("1"), "q", 100, 1_000).is_some());
        assert!(m.learn_layer(uid, Some("1"), "q", 100, 1_010).is_none(), "heard already");
        assert!(m.learn_layer(uid, Some("1"), "h", 100, 1_010).is_none(), "an SSRC is one layer's");
        assert!(m.learn_layer(uid, None, "q", 300, 1_010).is_none(), "without a MID, q names two sections");
        assert!(m.learn_layer(uid, Some("1"), "zz", 300, 1_010).is_none() && m.learn_layer(uid + 1, Some("1"), "h", 300, 1_010).is_none());
        assert!(m.learn_layer(uid, Some("2"), "q", 200, 1_100).is_some());
        let done = m.learn_layer(uid, Some("2"), "f", 201, 1_200).unwrap();
        assert_eq!(done, SimulcastPublished { rooms: vec!["r".into()], refused: vec![] });
        let v2 = &m.participant("r", "w").unwrap().streams["video-2"];
        assert_eq!((v2.layers.iter().map(|l| l.ssrc).collect::<Vec<_>>(), v2.rids.join(",")), (vec![200, 201], "q,f".to_string()));
        // One section left with f: the RID alone names it.
        assert!(m.learn_layer(uid, None, "f", 102, 1_300).is_some());
        assert!(!m.simulcast_due(2_999) && m.simulcast_due(3_000));
        assert_eq!(m.publish_heard_simulcast(3_000), SimulcastPublished { rooms: vec!["r".into()], refused: vec![] });
        let v = &m.participant("r", "w").unwrap().streams["video"];
        assert_eq!(v.layers.iter().map(|l| l.ssrc).collect::<Vec<_>>(), [100, 102], "lowest first, the unheard layer left out");
        assert_eq!((v.rids.join(","), v.codec, v.clock_rate), ("q,f".to_string(), Some(Codec::Vp8), Some(90000)));
        assert_eq!(entry(&m).stream_ids, None, "nothing left to learn");
        assert!(m.learn_layer(uid, Some("1"), "h", 101, 3_100).is_none(), "a layer heard late is not added");

        // A section none of whose layers is ever heard is dropped after a while; its name
        // stays its own until then.
        m.add_pending_simulcast("r", "w", ids, PendingSimulcast { offered_at_ms: 3_000, ..section("mute", "6", &["q", "h"]) }).unwrap();
        assert!(matches!(m.publish("r", "w", "mute", StreamSpec { ssrc: Some(9), ..Default::default() }), Err(ModelError::Exists { .. })));
        assert!(!m.simulcast_due(12_999) && m.simulcast_due(13_000));
        m.publish_heard_simulcast(13_000);
        let w = m.participant("r", "w").unwrap();
        assert!(w.webrtc.as_ref().unwrap().pending.is_empty() && !w.streams.contains_key("mute"));

        // One layer heard: waited for a second one longer, then a plain stream on its SSRC,
        // which no layer joins.
        m.add_pending_simulcast("r", "w", ids, section("solo", "5", &["l", "h"])).unwrap();
        m.learn_layer(uid, Some("5"), "l", 500, 10_000).unwrap();
        assert!(!m.simulcast_due(10_000 + SIMULCAST_ONE_LAYER_MS - 1) && m.simulcast_due(10_000 + SIMULCAST_ONE_LAYER_MS));
        assert_eq!(m.publish_heard_simulcast(15_000).refused, Vec::<String>::new());
        assert_eq!(m.participant("r", "w").unwrap().streams["solo"].ssrc, Some(500));
        assert!(m.learn_layer(uid, Some("5"), "h", 501, 16_000).is_none() && entry(&m).stream_ids.is_none());
    }

    /// A browser enables its higher encodings as its bandwidth estimate grows: a layer heard
    /// after its stream was published joins it above its top layer (consumers that want the
    /// top move up to it, their SSRC, the lowest layer's, stays); one below the top does not.
    #[test]
    fn simulcast_layers_heard_late_join_their_stream_above_its_top() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        let uid = m.add_webrtc_participant("r", "w", a("10.0.0.1:4000")).unwrap();
        m.add_participant("r", "viewer", a("10.0.0.1:4002"), a("10.0.1.2:5000")).unwrap();
        let ids = StreamIdExtensions { rid: 10, mid: Some(9) };
        let section = |name: &str, mid: &str, rids: &[&str]| PendingSimulcast {
            name: name.into(),
            mid: mid.into(),
            rids: rids.iter().map(|r| r.to_string()).collect(),
            ssrcs: vec![None; rids.len()],
            spec: StreamSpec { clock_rate: Some(90000), codec: Some(Codec::Vp8), ..Default::default() },
            heard_at_ms: None,
            offered_at_ms: 0,
        };
        m.add_pending_simulcast("r", "w", ids, section("video", "1", &["q", "h", "f"])).unwrap();
        m.learn_layer(uid, Some("1"), "q", 100, 1_000).unwrap();
        m.learn_layer(uid, Some("1"), "h", 101, 1_500).unwrap();
        m.publish_heard_simulcast(3_000);
        let c = m.subscribe("r", "viewer", StreamRef { publisher: "w".into(), stream: "video".into() }).unwrap();
        let layers = |m: &Model| m.participant("r", "w").unwrap().streams["video"].layers.iter().map(|l| l.ssrc).collect::<Vec<_>>();
        let table = |m: &Model| crate::ForwardingTable::compile(m, 1);
        assert_eq!(layers(&m), [100, 101]);
        assert_eq!(table(&m).streams[&crate::IngressKey { local: a("10.0.0.1:4000"), ssrc: None }].stream_ids, Some(ids), "f is listened for");
        assert!(m.learn_layer(uid, Some("1"), "f", 100, 9_000).is_none(), "an SSRC is one layer's");

        let joined = m.learn_layer(uid, Some("1"), "f", 102, 9_000).unwrap();
        assert_eq!(joined, SimulcastPublished { rooms: vec!["r".into()], refused: vec![] });
        let v = &m.participant("r", "w").unwrap().streams["video"];
        assert_eq!((layers(&m), v.rids.join(",")), (vec![100, 101, 102], "q,h,f".to_string()));
        let t = table(&m);
        let top = &t.streams[&crate::IngressKey { local: a("10.0.0.1:4000"), ssrc: Some(102) }];
        let info = top.simulcast.as_ref().unwrap();
        assert_eq!((info.index, info.layers.len(), info.layers[0].1), (2, 3, 100), "a layer of its own, the consumers' SSRC the lowest layer's");
        assert_eq!((top.copies[0].consumer, top.copies[0].layer), (c, Some(2)), "a consumer wanting the top gets the new top");
        assert!(t.streams[&crate::IngressKey { local: a("10.0.0.1:4000"), ssrc: None }].stream_ids.is_none(), "nothing left to listen for");
        assert!(m.learn_layer(uid, Some("1"), "f", 103, 9_100).is_none());

        // h late, f in time: h stays out (the layers' order would change under the consumers).
        m.add_pending_simulcast("r", "w", ids, section("cam", "2", &["q", "h", "f"])).unwrap();
        m.learn_layer(uid, Some("2"), "q", 200, 10_000).unwrap();
        m.learn_layer(uid, Some("2"), "f", 202, 10_000).unwrap();
        m.publish_heard_simulcast(12_000);
        assert!(m.learn_layer(uid, Some("2"), "h", 201, 13_000).is_none());
        assert_eq!(m.participant("r", "w").unwrap().streams["cam"].layers.len(), 2);

        // A stream unpublished stops listening for its layers.
        m.add_pending_simulcast("r", "w", ids, section("screen", "3", &["q", "h", "f"])).unwrap();
        m.learn_layer(uid, Some("3"), "q", 300, 20_000).unwrap();
        m.learn_layer(uid, Some("3"), "h", 301, 20_000).unwrap();
        m.publish_heard_simulcast(22_000);
        m.unpublish("r", "w", "screen").unwrap();
        assert!(m.learn_layer(uid, Some("3"), "f", 302, 23_000).is_none());
        assert!(m.participant("r", "w").unwrap().webrtc.as_ref().unwrap().late.is_empty());
    }
}
