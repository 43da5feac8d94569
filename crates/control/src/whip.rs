//! WHIP (RFC 9725) ingest and WHEP egress: a browser, OBS or any WHIP/WHEP client POSTs its SDP
//! offer and becomes a room participant with a transport of its own (ICE-lite + DTLS-SRTP, one
//! BUNDLE on one SFU port); the answer comes back with `201 Created` and the participant's URL in
//! `Location`, which `DELETE` ends (the API's participant resource).
//!
//! - `POST /v1/whip/{room}`: publish. Each audio or video section the offer sends becomes a
//!   stream of the participant (`audio`, `video`, or `video-<mid>` for a second one), on the SSRC
//!   its `a=ssrc` lines give, with the one payload format the SFU answers
//!   ([`mediaplane_webrtc::sdp::choose_format`]). The room is created if it does not exist.
//! - A section sent in several encodings (`a=simulcast` with RIDs; browsers signal no SSRCs
//!   then) becomes a simulcast stream: answered with the RIDs and the header extensions that
//!   name them, it waits ([`mediaplane_core::model::PendingSimulcast`]) until its first packets
//!   have told each layer's SSRC ([`SessionManager::on_stream_id`]), or until
//!   [`SIMULCAST_LEARNING_MS`] after the first one (a browser leaves out the encodings its
//!   bandwidth or resolution does not allow); with one layer heard it is a plain stream, with
//!   none heard within
//!   [`mediaplane_core::model::SIMULCAST_UNHEARD_MS`] it is dropped. Layers
//!   are ordered lowest quality first by their RIDs when they follow a common naming (`q`/`h`/`f`,
//!   `l`/`m`/`h`, `low`/`mid`/`high`), else in the offer's order (as mediasoup reads
//!   `sendEncodings`). A RID first heard after its stream is published is not added.
//! - `POST /v1/whep/{room}/{publisher}`: subscribe to one publisher's streams. Each stream that
//!   has a payload format (a WHIP publisher's, or one published through the API with `format`)
//!   goes to the first section of its kind that can receive it with the same payload type:
//!   copies are forwarded as they are, so the SFU cannot renumber payload types. A publisher
//!   whose simulcast layers are still being learned answers `503` with `Retry-After`.
//!
//! Both take `?participant=<id>` to name the participant (one is made up otherwise). The
//! handshake starts when the client's first ICE check arrives (`crate::crypto_legs`).

use crate::api::{body_rejected, commit_value, ApiError, AppState, ErrorCode, Path, Pending};
use crate::crypto_legs::CryptoLegSpec;
use crate::manager::{allocate_local, ManagerError, SessionManager, Ticket};
use crate::store::Change;
use axum::extract::{FromRequest, FromRequestParts, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use mediaplane_core::model::{
    Model, PayloadFormat, PendingSimulcast, StreamIdExtensions, StreamRef, StreamSpec, SIMULCAST_LEARNING_MS, SIMULCAST_ONE_LAYER_MS,
};
use mediaplane_core::simulcast::{Codec, MAX_LAYERS};
use mediaplane_webrtc::dtls::Role;
use mediaplane_webrtc::ice::Credentials;
use mediaplane_webrtc::sdp::{
    choose_format, Answer, AnsweredMedia, Direction, Format, Offer, OfferedMedia, SdpError, Sending, SimulcastAnswer, ABS_SEND_TIME_URI, RTP_STREAM_ID,
    SDES_MID, TRANSPORT_CC_URI,
};
use serde::Deserialize;
use serde_json::json;
use std::net::SocketAddr;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Naming {
    participant: Option<String>,
}

/// The query string, refused as this API's errors are (`invalid`: an unknown parameter).
impl<S: Send + Sync> FromRequestParts<S> for Naming {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        match Query::<Naming>::from_request_parts(parts, state).await {
            Ok(Query(n)) => Ok(n),
            Err(rej) => Err(ApiError::new(ErrorCode::Invalid, rej.body_text())),
        }
    }
}

/// The body of a WHIP or WHEP request: an SDP offer, sent as `application/sdp` (RFC 9725 §4.2).
/// Refused as this API's errors are: another type is `unsupported_media_type`, a body too large
/// `too_large`, one that is not UTF-8 `invalid_sdp`.
pub(crate) struct SdpBody(String);

impl<S: Send + Sync> FromRequest<S> for SdpBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let ctype = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
        if !ctype.split(';').next().unwrap_or("").trim().eq_ignore_ascii_case("application/sdp") {
            return Err(ApiError::new(ErrorCode::UnsupportedMediaType, format!("an SDP offer is sent as application/sdp, not {ctype:?}")));
        }
        let bytes = axum::body::Bytes::from_request(req, state).await.map_err(|rej| body_rejected(rej.status(), rej.body_text()))?;
        let text = String::from_utf8(bytes.into()).map_err(|_| ApiError::new(ErrorCode::InvalidSdp, "not an SDP offer: the body is not UTF-8"))?;
        Ok(SdpBody(text))
    }
}

/// A payload format the API may store for a stream: what an SDP answer can carry.
pub fn check_format(f: &PayloadFormat) -> Result<(), String> {
    if f.kind != "audio" && f.kind != "video" {
        return Err(format!("format.kind {:?} is not audio or video", f.kind));
    }
    // RFC 5761 §4: with RTP and RTCP on one port, payload types 64-95 read as RTCP.
    if f.pt > 127 || (64..=95).contains(&f.pt) {
        return Err(format!("format.pt {} is not a payload type (0-63, 96-127)", f.pt));
    }
    let mut parts = f.rtpmap.split('/');
    let name_ok = parts.next().is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
    let clock_ok = parts.next().and_then(|c| c.parse::<u32>().ok()).is_some_and(|c| c > 0);
    if !name_ok || !clock_ok || f.rtpmap.contains(char::is_whitespace) {
        return Err(format!("format.rtpmap {:?} is not <encoding>/<clock rate>[/<channels>]", f.rtpmap));
    }
    if f.fmtp.as_deref().is_some_and(|p| p.contains(['\r', '\n'])) {
        return Err("format.fmtp is one line".into());
    }
    Ok(())
}

fn sdp_error(e: SdpError) -> ApiError {
    match e {
        SdpError::Unsupported(_) => ApiError::new(ErrorCode::UnsupportedSdp, e.to_string()),
        _ => ApiError::new(ErrorCode::InvalidSdp, e.to_string()),
    }
}

/// What a WHIP or WHEP request asks, checked before anything changes: the offer in its body,
/// the SFU's DTLS role answering it, the participant's name, and the SFU's fresh ICE
/// credentials for it.
struct Session {
    offer: Offer,
    role: Role,
    setup: &'static str,
    pid: String,
    ice: Credentials,
}

fn session_of(body: &str, naming: Naming, prefix: &str) -> Result<Session, ApiError> {
    let offer = Offer::parse(body).map_err(sdp_error)?;
    let (role, setup) = offer.answer_role().map_err(sdp_error)?;
    let pid = naming.participant.unwrap_or_else(|| made_up(prefix));
    Ok(Session { offer, role, setup, pid, ice: Credentials::generate() })
}

/// A name for a participant the client did not name.
fn made_up(prefix: &str) -> String {
    format!("{prefix}-{}", mediaplane_webrtc::random_hex(4))
}

/// What a WHIP or WHEP request made: the participant's transport, and the answer's sections.
struct Made {
    local: SocketAddr,
    uid: u32,
    media: Vec<AnsweredMedia>,
}

/// Register the handshake, write the answer, and answer `201 Created` with it.
fn answer(m: &SessionManager, room: &str, session: Session, made: Made) -> Result<(StatusCode, serde_json::Value), ApiError> {
    let Session { offer, role, setup, pid, ice } = session;
    let fingerprint = m.dtls_fingerprint();
    let spec = CryptoLegSpec {
        local: made.local,
        local_ice: ice.clone(),
        remote_ice: Some(offer.ice.clone()),
        role,
        remote_fingerprint: Some(offer.fingerprint.clone()),
    };
    m.set_crypto_leg(made.uid, spec);
    let ip = made.local.ip();
    let advertised = m.media_config().interface_of(ip).map_or(ip, |i| i.advertised());
    let sdp =
        Answer { offer: &offer, ice: &ice, fingerprint: &fingerprint, setup, candidate: SocketAddr::new(advertised, made.local.port()), media: made.media }
            .write();
    let location = format!("/v1/rooms/{room}/participants/{pid}");
    Ok((StatusCode::CREATED, json!({"sdp": sdp, "location": location, "participant": pid})))
}

/// The SDP answer as WHIP/WHEP answers it: `201`, `application/sdp`, `Location`.
async fn respond(
    m: AppState,
    p: Pending,
    f: impl FnOnce(&SessionManager, &Ticket) -> Result<(StatusCode, serde_json::Value), ApiError> + Send + 'static,
) -> Result<Response, ApiError> {
    let (status, raw) = commit_value(m, p, f).await?;
    let v: serde_json::Value = serde_json::from_str(raw.get()).map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    let (sdp, location) = (v["sdp"].as_str().unwrap_or_default().to_string(), v["location"].as_str().unwrap_or_default().to_string());
    Ok((status, [(header::CONTENT_TYPE, "application/sdp".to_string()), (header::LOCATION, location)], sdp).into_response())
}

pub(crate) async fn whip(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path(room): Path<String>,
    naming: Naming,
    SdpBody(body): SdpBody,
) -> Result<Response, ApiError> {
    let session = session_of(&body, naming, "whip")?;
    respond(m, p, move |m, ticket| {
        let (offer, pid) = (&session.offer, &session.pid);
        let made = m.mutate_for(ticket, |model, media| {
            if model.room(&room).is_err() {
                model.create_room(&room)?;
            }
            let local = allocate_local(model, media, &[])?;
            let uid = model.add_webrtc_participant(&room, pid, local)?;
            let mut answered = Vec::new();
            for section in &offer.media {
                let format = choose_format(section).filter(|_| section.direction.sends() && !section.disabled);
                let (Some(kind), Some(f)) = (section.kind, format) else {
                    answered.push(AnsweredMedia::inactive());
                    continue;
                };
                let name = stream_name(model, &room, pid, kind.name(), &section.mid)?;
                let format = PayloadFormat { kind: kind.name().into(), pt: f.pt, rtpmap: f.rtpmap.clone(), fmtp: f.fmtp.clone() };
                check_format(&format).map_err(|e| unsupported(format!("section {:?}: {e}", section.mid)))?;
                let spec = StreamSpec { clock_rate: f.clock_rate(), format: Some(format), ..Default::default() };
                // Its arrivals are fed back, so the publisher's send-side estimate can grow.
                let transport_cc = section.extmap(TRANSPORT_CC_URI).filter(|&id| id > 0);
                if let Some(id) = transport_cc {
                    model.set_transport_cc(&room, pid, id)?;
                }
                // Without it, the SFU estimates the path itself from the send times (REMB).
                let abs_send_time = section.extmap(ABS_SEND_TIME_URI).filter(|&id| id > 0 && transport_cc.is_none());
                if let Some(id) = abs_send_time {
                    model.set_abs_send_time(&room, pid, id)?;
                }
                if !section.rids.is_empty() {
                    let simulcast = pend_simulcast(model, &room, pid, section, name, spec)?;
                    answered.push(AnsweredMedia { simulcast: Some(simulcast), transport_cc, abs_send_time, ..AnsweredMedia::receiving(f.clone()) });
                    continue;
                }
                let Some(&ssrc) = section.ssrcs.first() else {
                    return Err(unsupported(format!("section {:?} names no SSRC (a=ssrc)", section.mid)));
                };
                model.publish(&room, pid, &name, StreamSpec { ssrc: Some(ssrc), ..spec })?;
                answered.push(AnsweredMedia { transport_cc, abs_send_time, ..AnsweredMedia::receiving(f.clone()) });
            }
            if answered.iter().all(|a| a.format.is_none()) {
                return Err(unsupported("the offer sends no audio or video the SFU can take".into()));
            }
            Ok((Made { local, uid, media: answered }, vec![Change::Room(room.clone())]))
        })?;
        answer(m, &room, session, made)
    })
    .await
}

/// The name of a publisher's stream of `kind`: the kind, or `<kind>-<mid>` for a second one.
fn stream_name(model: &Model, room: &str, pid: &str, kind: &str, mid: &str) -> Result<String, ManagerError> {
    let p = model.participant(room, pid)?;
    let pending = p.webrtc.as_ref().map_or(&[][..], |w| &w.pending[..]);
    let taken = p.streams.contains_key(kind) || pending.iter().any(|s| s.name == kind);
    Ok(if taken { format!("{kind}-{mid}") } else { kind.to_string() })
}

/// Let simulcast `section` become stream `name` once its layers are heard; the RIDs and header
/// extensions to answer it with.
fn pend_simulcast(model: &mut Model, room: &str, pid: &str, section: &OfferedMedia, name: String, spec: StreamSpec) -> Result<SimulcastAnswer, ManagerError> {
    let encoding = spec.format.as_ref().map_or("", |f| f.rtpmap.split('/').next().unwrap_or(""));
    let Some(codec) = Codec::parse(encoding) else {
        return Err(unsupported(format!("section {:?} is simulcast in {encoding}: the SFU switches layers at VP8 and H.264 keyframes", section.mid)));
    };
    let Some(rid) = section.extmap(RTP_STREAM_ID) else {
        return Err(unsupported(format!(
            "section {:?} is simulcast without the RTP stream id header extension ({RTP_STREAM_ID}) its layers are told apart by",
            section.mid
        )));
    };
    let mid = section.extmap(SDES_MID).filter(|m| *m != rid);
    // More encodings than layers: the answer leaves out the last ones (RFC 8853 §5.3).
    let offered: Vec<String> = section.rids.iter().take(MAX_LAYERS).cloned().collect();
    let rids = lowest_first(&offered);
    let pending = PendingSimulcast {
        name,
        mid: section.mid.clone(),
        ssrcs: vec![None; rids.len()],
        rids,
        spec: StreamSpec { codec: Some(codec), ..spec },
        heard_at_ms: None,
        offered_at_ms: crate::manager::unix_ms(),
    };
    model.add_pending_simulcast(room, pid, StreamIdExtensions { rid, mid }, pending)?;
    let extmaps = mid.map(|id| (id, SDES_MID.to_string())).into_iter().chain([(rid, RTP_STREAM_ID.to_string())]).collect();
    Ok(SimulcastAnswer { rids: offered, extmaps })
}

/// RIDs by the quality they carry, lowest first: by name when they follow a common naming,
/// else as offered (most applications list `sendEncodings` from the lowest, as mediasoup asks).
pub fn lowest_first(rids: &[String]) -> Vec<String> {
    const NAMINGS: [&[&str]; 4] = [&["q", "h", "f"], &["l", "m", "h"], &["low", "mid", "high"], &["low", "medium", "high"]];
    for naming in NAMINGS {
        let rank = |r: &String| naming.iter().position(|n| r.eq_ignore_ascii_case(n));
        if rids.iter().all(|r| rank(r).is_some()) {
            let mut ordered = rids.to_vec();
            ordered.sort_by_key(rank);
            return ordered;
        }
    }
    rids.to_vec()
}

impl SessionManager {
    /// A packet of WebRTC transport `transport` on `ssrc` named its simulcast encoding `rid`
    /// (see the module): learn the layer, and publish its stream when every layer is heard.
    pub fn on_stream_id(&self, transport: u32, ssrc: u32, mid: Option<&str>, rid: &str) {
        let now = crate::manager::unix_ms();
        // Most reports change nothing (a layer heard already, its packets still arriving until
        // the table claims its SSRC): decided on a copy of the snapshot, without the lock.
        if self.read(|m, _| m.clone().learn_layer(transport, mid, rid, ssrc, now)).is_none() {
            return;
        }
        let learned = self.mutate(|m, _| {
            let out = m.learn_layer(transport, mid, rid, ssrc, now);
            let changes = out.iter().flat_map(|o| o.rooms.iter().cloned().map(Change::Room)).collect();
            Ok((out, changes))
        });
        match learned {
            Ok(Some(out)) => {
                tracing::info!(transport, ssrc, rid, mid, "simulcast layer heard");
                out.refused.iter().for_each(|why| tracing::warn!(transport, %why, "simulcast stream not published"));
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(transport, ssrc, rid, error = %e, "could not learn a simulcast layer"),
        }
    }

    /// Every 100 ms or so: publish the simulcast sections whose learning time is over with the
    /// layers heard.
    pub fn publish_heard_simulcast(&self) {
        let now = crate::manager::unix_ms();
        if !self.read(|m, _| m.simulcast_due(now)) {
            return;
        }
        let published = self.mutate(|m, _| {
            let out = m.publish_heard_simulcast(now);
            let changes = out.rooms.iter().cloned().map(Change::Room).collect();
            Ok((out, changes))
        });
        match published {
            Ok(out) => out.refused.iter().for_each(|why| tracing::warn!(%why, "simulcast stream not published")),
            Err(e) => tracing::warn!(error = %e, "could not publish learned simulcast streams"),
        }
    }
}

fn unsupported(why: String) -> ManagerError {
    ManagerError::Unsupported(why)
}

/// The offered format a stream in `format` goes out as: on its own payload type if the offer has
/// it there, else on the one the offer gives the same encoding (its copies then renumbered). For
/// H.264 the packetization mode must agree (RFC 6184: 0 when not said), and the same profile is
/// preferred.
fn receivable<'a>(offered: &'a [Format], format: &PayloadFormat) -> Option<&'a Format> {
    let param = |fmtp: Option<&str>, key: &str| -> Option<String> {
        fmtp?.split(';').filter_map(|kv| kv.trim().split_once('=')).find(|(k, _)| k.eq_ignore_ascii_case(key)).map(|(_, v)| v.trim().to_ascii_lowercase())
    };
    let h264 = format.rtpmap.to_ascii_lowercase().starts_with("h264/");
    let mode = |fmtp: Option<&str>| param(fmtp, "packetization-mode").unwrap_or_else(|| "0".into());
    let profile = |fmtp: Option<&str>| param(fmtp, "profile-level-id").map(|p| p.chars().take(2).collect::<String>());
    let wanted = format.fmtp.as_deref();
    let fits: Vec<&Format> = offered.iter().filter(|f| f.same_encoding(&format.rtpmap) && (!h264 || mode(f.fmtp.as_deref()) == mode(wanted))).collect();
    let same_profile = || fits.iter().find(|f| !h264 || profile(f.fmtp.as_deref()) == profile(wanted));
    fits.iter().find(|f| f.pt == format.pt).or_else(same_profile).or(fits.first()).copied()
}

pub(crate) async fn whep(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path((room, publisher)): Path<(String, String)>,
    naming: Naming,
    SdpBody(body): SdpBody,
) -> Result<Response, ApiError> {
    let session = session_of(&body, naming, "whep")?;
    respond(m, p, move |m, ticket| {
        let (offer, pid) = (&session.offer, &session.pid);
        let made = m.mutate_for(ticket, |model, media| {
            let pending = model.participant(&room, &publisher)?.webrtc.as_ref().map_or(0, |w| w.pending.len());
            if pending > 0 {
                return Err(ManagerError::NotReady(format!(
                    "{publisher}'s simulcast layers are still being learned from its first packets ({} s after the first, {} s if only one is heard)",
                    SIMULCAST_LEARNING_MS / 1000,
                    SIMULCAST_ONE_LAYER_MS / 1000
                )));
            }
            let streams: Vec<(String, u32, PayloadFormat)> = model
                .participant(&room, &publisher)?
                .streams
                .iter()
                .filter_map(|(name, s)| Some((name.clone(), s.ssrc.or(s.layers.first().map(|l| l.ssrc))?, s.format.clone()?)))
                .collect();
            let local = allocate_local(model, media, &[])?;
            let uid = model.add_webrtc_participant(&room, pid, local)?;
            let mut answered: Vec<AnsweredMedia> = offer.media.iter().map(|_| AnsweredMedia::inactive()).collect();
            let mut mismatch = Vec::new();
            for (name, ssrc, format) in streams {
                let open = offer.media.iter().enumerate().find_map(|(i, o)| {
                    let fits = o.kind.map(|k| k.name()) == Some(format.kind.as_str()) && o.direction.receives() && !o.disabled && answered[i].format.is_none();
                    fits.then_some((i, o))
                });
                let Some((i, section)) = open else { continue };
                let Some(f) = receivable(&section.formats, &format) else {
                    mismatch.push(format!("{name} ({} on payload type {})", format.rtpmap, format.pt));
                    continue;
                };
                let stream = StreamRef { publisher: publisher.clone(), stream: name.clone() };
                model.subscribe(&room, pid, stream.clone())?;
                if f.pt != format.pt {
                    model.set_consumer_payload_type(&room, pid, &stream, Some(f.pt))?;
                }
                let sending = Sending { ssrc, cname: publisher.clone(), msid: (publisher.clone(), name.clone()) };
                answered[i] = AnsweredMedia {
                    format: Some(f.clone()),
                    direction: Direction::SendOnly,
                    sending: Some(sending),
                    simulcast: None,
                    transport_cc: None,
                    abs_send_time: None,
                };
            }
            if answered.iter().all(|a| a.format.is_none()) {
                let why = match mismatch.is_empty() {
                    true => format!("{publisher} publishes nothing this offer can receive"),
                    false => format!("the offer cannot receive {}", mismatch.join(", ")),
                };
                return Err(unsupported(why));
            }
            Ok((Made { local, uid, media: answered }, vec![Change::Room(room.clone())]))
        })?;
        answer(m, &room, session, made)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offered(pt: u8, rtpmap: &str, fmtp: Option<&str>) -> Format {
        Format { pt, rtpmap: rtpmap.into(), fmtp: fmtp.map(String::from), feedback: Vec::new() }
    }

    /// A camera's H.264 goes to the offer's H.264 of the same packetization mode, its own
    /// payload type first (only if the mode agrees), then the same profile; other encodings on
    /// the same or another number.
    #[test]
    fn a_stream_goes_out_as_an_offered_format_of_its_encoding() {
        let chromium = [
            offered(96, "VP8/90000", None),
            offered(97, "H264/90000", Some("level-asymmetry-allowed=1;packetization-mode=0;profile-level-id=42001f")),
            offered(102, "H264/90000", Some("level-asymmetry-allowed=1;packetization-mode=1;profile-level-id=4d001f")),
            offered(104, "H264/90000", Some("level-asymmetry-allowed=1;packetization-mode=1;profile-level-id=42e01f")),
            offered(111, "opus/48000/2", Some("minptime=10;useinbandfec=1")),
        ];
        let camera = |pt: u8, rtpmap: &str, fmtp: Option<&str>| PayloadFormat { kind: "video".into(), pt, rtpmap: rtpmap.into(), fmtp: fmtp.map(String::from) };
        let pt = |f: PayloadFormat| receivable(&chromium, &f).map(|f| f.pt);
        assert_eq!(pt(camera(96, "H264/90000", Some("packetization-mode=1;profile-level-id=42c00d"))), Some(104), "same mode and profile");
        assert_eq!(pt(camera(97, "H264/90000", Some("packetization-mode=1;profile-level-id=4d0028"))), Some(102), "97 is mode 0 here");
        assert_eq!(pt(camera(96, "H264/90000", None)), Some(97), "no fmtp: mode 0");
        assert_eq!(pt(camera(96, "VP8/90000", None)), Some(96));
        assert_eq!(pt(camera(97, "OPUS/48000/2", None)), Some(111), "names compared without case");
        assert_eq!(pt(camera(8, "PCMA/8000", None)), None);
    }
}
