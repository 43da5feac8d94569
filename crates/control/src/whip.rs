//! WHIP (RFC 9725) ingest and WHEP egress: a browser, OBS or any WHIP/WHEP client POSTs its SDP
//! offer and becomes a room participant with a transport of its own (ICE-lite + DTLS-SRTP, one
//! BUNDLE on one SFU port); the answer comes back with `201 Created` and the participant's URL in
//! `Location`, which `DELETE` ends (the API's participant resource).
//!
//! - `POST /v1/whip/{room}`: publish. Each audio or video section the offer sends becomes a
//!   stream of the participant (`audio`, `video`, or `video-<mid>` for a second one), on the SSRC
//!   its `a=ssrc` lines give, with the one payload format the SFU answers
//!   ([`mediaplane_webrtc::sdp::choose_format`]). The room is created if it does not exist.
//! - `POST /v1/whep/{room}/{publisher}`: subscribe to one publisher's streams. Each stream that
//!   has a payload format (a WHIP publisher's, or one published through the API with `format`)
//!   goes to the first section of its kind that can receive it with the same payload type:
//!   copies are forwarded as they are, so the SFU cannot renumber payload types.
//!
//! Both take `?participant=<id>` to name the participant (one is made up otherwise). The
//! handshake starts when the client's first ICE check arrives (`crate::crypto_legs`).

use crate::api::{commit_value, ApiError, AppState, Pending};
use crate::crypto_legs::CryptoLegSpec;
use crate::manager::{allocate_local, ManagerError, SessionManager, Ticket};
use crate::store::Change;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use mediaplane_core::model::{PayloadFormat, StreamRef, StreamSpec};
use mediaplane_webrtc::dtls::Role;
use mediaplane_webrtc::ice::Credentials;
use mediaplane_webrtc::sdp::{choose_format, Answer, AnsweredMedia, Direction, Offer, SdpError, Sending};
use serde::Deserialize;
use serde_json::json;
use std::net::SocketAddr;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Naming {
    participant: Option<String>,
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
        SdpError::Unsupported(_) => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "unsupported_sdp", e.to_string()),
        _ => ApiError::new(StatusCode::BAD_REQUEST, "invalid_sdp", e.to_string()),
    }
}

/// What a WHIP or WHEP request asks, checked before anything changes: the offer in its body
/// (which must be `application/sdp`, RFC 9725 §4.2), the SFU's DTLS role answering it, the
/// participant's name, and the SFU's fresh ICE credentials for it.
struct Session {
    offer: Offer,
    role: Role,
    setup: &'static str,
    pid: String,
    ice: Credentials,
}

fn session_of(headers: &HeaderMap, body: &str, naming: Naming, prefix: &str) -> Result<Session, ApiError> {
    let ctype = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if !ctype.split(';').next().unwrap_or("").trim().eq_ignore_ascii_case("application/sdp") {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!("an SDP offer is sent as application/sdp, not {ctype:?}"),
        ));
    }
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
    let v: serde_json::Value = serde_json::from_str(raw.get()).map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    let (sdp, location) = (v["sdp"].as_str().unwrap_or_default().to_string(), v["location"].as_str().unwrap_or_default().to_string());
    Ok((status, [(header::CONTENT_TYPE, "application/sdp".to_string()), (header::LOCATION, location)], sdp).into_response())
}

pub(crate) async fn whip(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path(room): Path<String>,
    Query(naming): Query<Naming>,
    headers: HeaderMap,
    body: String,
) -> Result<Response, ApiError> {
    let session = session_of(&headers, &body, naming, "whip")?;
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
                    answered.push(AnsweredMedia { format: None, direction: Direction::Inactive, sending: None });
                    continue;
                };
                if section.simulcast {
                    return Err(unsupported(format!(
                        "section {:?} is simulcast (a=simulcast): WHIP simulcast is not mapped to layers yet; publish one encoding",
                        section.mid
                    )));
                }
                let Some(&ssrc) = section.ssrcs.first() else {
                    return Err(unsupported(format!("section {:?} names no SSRC (a=ssrc)", section.mid)));
                };
                let name = if model.participant(&room, pid)?.streams.contains_key(kind.name()) {
                    format!("{}-{}", kind.name(), section.mid)
                } else {
                    kind.name().to_string()
                };
                let format = PayloadFormat { kind: kind.name().into(), pt: f.pt, rtpmap: f.rtpmap.clone(), fmtp: f.fmtp.clone() };
                check_format(&format).map_err(|e| unsupported(format!("section {:?}: {e}", section.mid)))?;
                let spec = StreamSpec { ssrc: Some(ssrc), clock_rate: f.clock_rate(), format: Some(format), ..Default::default() };
                model.publish(&room, pid, &name, spec)?;
                answered.push(AnsweredMedia { format: Some(f.clone()), direction: Direction::RecvOnly, sending: None });
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

fn unsupported(why: String) -> ManagerError {
    ManagerError::Unsupported(why)
}

pub(crate) async fn whep(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path((room, publisher)): Path<(String, String)>,
    Query(naming): Query<Naming>,
    headers: HeaderMap,
    body: String,
) -> Result<Response, ApiError> {
    let session = session_of(&headers, &body, naming, "whep")?;
    respond(m, p, move |m, ticket| {
        let (offer, pid) = (&session.offer, &session.pid);
        let made = m.mutate_for(ticket, |model, media| {
            let streams: Vec<(String, u32, PayloadFormat)> = model
                .participant(&room, &publisher)?
                .streams
                .iter()
                .filter_map(|(name, s)| Some((name.clone(), s.ssrc.or(s.layers.first().map(|l| l.ssrc))?, s.format.clone()?)))
                .collect();
            let local = allocate_local(model, media, &[])?;
            let uid = model.add_webrtc_participant(&room, pid, local)?;
            let mut answered: Vec<AnsweredMedia> =
                offer.media.iter().map(|_| AnsweredMedia { format: None, direction: Direction::Inactive, sending: None }).collect();
            let mut mismatch = Vec::new();
            for (name, ssrc, format) in streams {
                let open = offer.media.iter().enumerate().find_map(|(i, o)| {
                    let fits = o.kind.map(|k| k.name()) == Some(format.kind.as_str()) && o.direction.receives() && !o.disabled && answered[i].format.is_none();
                    fits.then_some((i, o))
                });
                let Some((i, section)) = open else { continue };
                let Some(f) = section.formats.iter().find(|f| f.pt == format.pt && f.same_encoding(&format.rtpmap)) else {
                    mismatch.push(format!("{name} is {} on payload type {}", format.rtpmap, format.pt));
                    continue;
                };
                model.subscribe(&room, pid, StreamRef { publisher: publisher.clone(), stream: name.clone() })?;
                let sending = Sending { ssrc, cname: publisher.clone(), msid: (publisher.clone(), name.clone()) };
                answered[i] = AnsweredMedia { format: Some(f.clone()), direction: Direction::SendOnly, sending: Some(sending) };
            }
            if answered.iter().all(|a| a.format.is_none()) {
                let why = match mismatch.is_empty() {
                    true => format!("{publisher} publishes nothing this offer can receive"),
                    false => format!("the offer cannot receive {}: the SFU forwards payloads as they are", mismatch.join(", ")),
                };
                return Err(unsupported(why));
            }
            Ok((Made { local, uid, media: answered }, vec![Change::Room(room.clone())]))
        })?;
        answer(m, &room, session, made)
    })
    .await
}
