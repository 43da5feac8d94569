//! The HTTP/JSON API (see the README for every endpoint with examples) and the Prometheus
//! `/metrics` endpoint. Every error is a JSON body `{"error": "...", "code": "..."}` with the
//! status of its code (one of [`ErrorCode`]); no input reaches a panic. Every request carries an `x-request-id` (the
//! client's, or a new UUID), echoed in the response and logged with method, route, status and
//! latency.

use crate::config::MediaConfig;
pub use crate::error_code::ErrorCode;
use crate::manager::{allocate_local, ManagerError, SessionManager, Ticket};
use crate::metrics::{Metrics, StatsReading};
use crate::store::Change;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, MatchedPath, Request, State};
use axum::http::{header, HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Extension, Json, Router};
use mediaplane_core::model::{LegSpec, ModelError, Relay, StreamRef, StreamSpec};
use mediaplane_core::Model;
use mediaplane_dataplane::Counters;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

pub type AppState = Arc<SessionManager>;

use crate::room_token::{Refused, RoomTokens};

/// An error answer: its code (which decides its status) and what went wrong.
#[derive(Debug)]
pub struct ApiError {
    code: ErrorCode,
    message: String,
    /// Seconds a client should wait before trying again (`Retry-After`), if it should.
    retry_after: Option<u32>,
}

impl ApiError {
    pub(crate) fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError { code, message: message.into(), retry_after: None }
    }

    pub fn code(&self) -> ErrorCode {
        self.code
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(json!({"error": self.message, "code": self.code.as_str()}));
        match self.retry_after {
            Some(s) => (self.code.status(), [(header::RETRY_AFTER, s.to_string())], body).into_response(),
            None => (self.code.status(), body).into_response(),
        }
    }
}

impl From<ManagerError> for ApiError {
    fn from(e: ManagerError) -> Self {
        let msg = e.to_string();
        match e {
            ManagerError::Model(m) => match m {
                ModelError::NotFound { .. } => ApiError::new(ErrorCode::NotFound, msg),
                ModelError::Exists { .. } => ApiError::new(ErrorCode::Exists, msg),
                ModelError::AddressInUse { .. } | ModelError::IngressInUse { .. } => ApiError::new(ErrorCode::AddressInUse, msg),
                ModelError::InvalidId(_)
                | ModelError::BadAddress(_)
                | ModelError::FamilyMismatch(_)
                | ModelError::SelfSubscription
                | ModelError::Invalid(_) => ApiError::new(ErrorCode::Invalid, msg),
                ModelError::Inconsistent(_) => ApiError::new(ErrorCode::Store, msg),
            },
            ManagerError::Limit { .. } => ApiError::new(ErrorCode::Limit, msg),
            ManagerError::Interface(_) => ApiError::new(ErrorCode::Invalid, msg),
            ManagerError::NoFreePort { .. } => ApiError::new(ErrorCode::NoFreePort, msg),
            ManagerError::Dataplane(mediaplane_dataplane::DataplaneError::Full(_)) => ApiError::new(ErrorCode::DataplaneFull, msg),
            ManagerError::Dataplane(_) => ApiError::new(ErrorCode::Dataplane, msg),
            ManagerError::Store(_) => ApiError::new(ErrorCode::Store, msg),
            // The failing item's status and code, with the item named in the message.
            ManagerError::BatchItem { source, .. } => ApiError { message: msg, ..ApiError::from(*source) },
            ManagerError::Abandoned => ApiError::new(ErrorCode::Timeout, msg),
            ManagerError::Internal(_) => ApiError::new(ErrorCode::Internal, msg),
            ManagerError::Unsupported(_) => ApiError::new(ErrorCode::Unsupported, msg),
            ManagerError::NotReady(_) => ApiError { retry_after: Some(1), ..ApiError::new(ErrorCode::NotReady, msg) },
        }
    }
}

impl From<ModelError> for ApiError {
    fn from(e: ModelError) -> Self {
        ManagerError::from(e).into()
    }
}

/// A body axum refused (too large, unreadable, not the expected JSON), as this API's error.
pub(crate) fn body_rejected(status: StatusCode, text: String) -> ApiError {
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::TooLarge,
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ErrorCode::UnsupportedMediaType,
        StatusCode::UNPROCESSABLE_ENTITY => ErrorCode::WrongShape,
        _ => ErrorCode::BadRequest,
    };
    ApiError::new(code, text)
}

/// `Json` whose rejections (bad syntax, wrong types, missing fields, wrong content type) are
/// JSON errors like every other error of this API.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T> FromRequest<S> for ApiJson<T>
where
    Json<T>: FromRequest<S, Rejection = JsonRejection>,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(rej) => Err(body_rejected(rej.status(), rej.body_text())),
        }
    }
}

/// The path's parameters (axum's `Path`), refused as this API's errors are: one that does not
/// decode (`%FF` is no UTF-8) is `invalid`.
pub struct Path<T>(pub T);

impl<S: Send + Sync, T> FromRequestParts<S> for Path<T>
where
    T: serde::de::DeserializeOwned + Send,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(Path(v)),
            Err(rej) => Err(ApiError::new(ErrorCode::Invalid, rej.body_text())),
        }
    }
}

type ApiResult = Result<(StatusCode, Json<Value>), ApiError>;

fn ok(v: Value) -> ApiResult {
    Ok((StatusCode::OK, Json(v)))
}

/// A mutating handler's answer, serialized where it was made (off the async runtime: a batch's
/// answer is megabytes).
type Answer = Result<(StatusCode, Box<RawValue>), ApiError>;

/// A request's stake in its mutation, put in every request by the timeout layer: the
/// [`Ticket`] that decides whether the change may still commit, and the handler's answer once
/// it is known (the handler may have been dropped at the deadline by then).
#[derive(Clone, Default)]
pub struct Pending(Arc<PendingInner>);

#[derive(Default)]
struct PendingInner {
    ticket: Ticket,
    answer: Mutex<Option<Answer>>,
    answered: tokio::sync::Notify,
}

impl Pending {
    fn answer(&self, a: Answer) {
        *self.0.answer.lock() = Some(a);
        self.0.answered.notify_one();
    }

    async fn wait_answer(&self) -> Answer {
        loop {
            if let Some(a) = self.0.answer.lock().take() {
                return a;
            }
            self.0.answered.notified().await;
        }
    }

    /// The answer to a request past its deadline: 503 `timeout`, saying whether its change was
    /// applied. A change not yet committing is abandoned (nothing applied); one already
    /// committing runs to its end, and the 503 waits for it and carries its result.
    async fn timed_out(&self, timeout: std::time::Duration) -> Response {
        let late = |what: &str| format!("request took longer than {timeout:?}; {what}");
        let code = ErrorCode::Timeout;
        let body = if self.0.ticket.abandon() {
            json!({"error": late("nothing was applied"), "code": code.as_str(), "applied": false})
        } else {
            match self.wait_answer().await {
                Ok((_, result)) => json!({"error": late("its change was applied"), "code": code.as_str(), "applied": true, "result": result}),
                Err(e) => json!({"error": late(&format!("its change failed and was rolled back: {}", e.message)), "code": code.as_str(), "applied": false}),
            }
        };
        (code.status(), Json(body)).into_response()
    }
}

/// Run a mutating handler's work (`f`: mutate through [`SessionManager::mutate_for`] with the
/// ticket it is given, and say what to answer) on the blocking pool, off the async runtime: the
/// runtime keeps answering reads while a big change compiles, installs and commits.
pub(crate) async fn commit(
    m: AppState,
    pending: Pending,
    f: impl FnOnce(&SessionManager, &Ticket) -> Result<(StatusCode, Value), ApiError> + Send + 'static,
) -> Result<Response, ApiError> {
    let (status, raw) = commit_value(m, pending, f).await?;
    Ok((status, [(header::CONTENT_TYPE, "application/json")], String::from(Box::<str>::from(raw))).into_response())
}

/// [`commit`], answering with the status and JSON value `f` made.
pub(crate) async fn commit_value(
    m: AppState,
    pending: Pending,
    f: impl FnOnce(&SessionManager, &Ticket) -> Result<(StatusCode, Value), ApiError> + Send + 'static,
) -> Result<(StatusCode, Box<RawValue>), ApiError> {
    let p = pending.clone();
    let joined = tokio::task::spawn_blocking(move || {
        // A panic still answers: a request past its deadline waits for this answer.
        let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&m, &p.0.ticket)));
        let done = done.unwrap_or_else(|_| Err(ApiError::new(ErrorCode::Internal, "the change failed inside the daemon")));
        let answer = done.and_then(|(status, v)| {
            let raw = serde_json::value::to_raw_value(&v).map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
            Ok((status, raw))
        });
        p.answer(answer);
    })
    .await;
    if let Err(e) = joined {
        return Err(ApiError::new(ErrorCode::Internal, format!("mutation failed: {e}")));
    }
    pending.wait_answer().await
}

/// A JSON body read but not yet parsed: parsed by [`JsonBody::parse`] where the work runs (a
/// batch's body is megabytes, too much to parse on the async runtime). Rejections are those of
/// [`ApiJson`].
pub struct JsonBody(axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let json = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|ct| {
            let ct = ct.split(';').next().unwrap_or("").trim();
            ct == "application/json" || (ct.starts_with("application/") && ct.ends_with("+json"))
        });
        if !json {
            return Err(ApiError::new(ErrorCode::UnsupportedMediaType, "Expected request with `Content-Type: application/json`"));
        }
        match axum::body::Bytes::from_request(req, state).await {
            Ok(b) => Ok(JsonBody(b)),
            Err(rej) => Err(body_rejected(rej.status(), rej.body_text())),
        }
    }
}

impl JsonBody {
    /// Parse as `T`: a syntax error is a 400, a well-formed body of the wrong shape a 422, as
    /// [`ApiJson`] answers.
    fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, ApiError> {
        parse_json(&self.0)
    }
}

/// `body` as `T`: a syntax error is a 400 `bad_request`, a well-formed body of the wrong shape a
/// 422 `wrong_shape`, as [`ApiJson`] answers.
fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => ApiError::new(ErrorCode::WrongShape, format!("Failed to deserialize the JSON body into the target type: {e}")),
        _ => ApiError::new(ErrorCode::BadRequest, format!("Failed to parse the request body as JSON: {e}")),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRoom {
    id: String,
    /// The most each WebRTC publisher may send (kbit/s), told to it as a REMB.
    publisher_max_kbps: Option<u32>,
}

/// A WebRTC participant's settings (`PUT /v1/rooms/{room}/participants/{pid}`): all replaced,
/// absent = none.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ParticipantSettings {
    max_kbps: Option<u32>,
}

/// A room's settings (`PUT /v1/rooms/{room}`): all replaced, absent = none.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RoomSettings {
    publisher_max_kbps: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddParticipant {
    id: String,
    /// Where the participant receives media (and the only source allowed to publish).
    remote: SocketAddr,
    /// SFU address for this participant; allocated from the media port range when absent.
    local: Option<SocketAddr>,
    /// SRTP keyed here (SDES): the participant's streams are then SRTP, its copies protected.
    srtp: Option<ParticipantSrtp>,
}

/// A participant's SDES keys: base64 master key and salt, as an `a=crypto` `inline:` carries
/// them. Stored; no response shows them again.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ParticipantSrtp {
    /// AEAD_AES_256_GCM, AEAD_AES_128_GCM, AES_256_CM_HMAC_SHA1_80 or _32, AES_192_CM_HMAC_SHA1_80
    /// or _32, AES_CM_128_HMAC_SHA1_80 or _32.
    suite: String,
    /// What the participant protects its packets with.
    inbound: String,
    /// What the SFU protects its copies to the participant with.
    outbound: String,
}

impl ParticipantSrtp {
    fn keys(&self) -> Result<mediaplane_core::srtp::LegSrtp, ApiError> {
        use base64::Engine as _;
        use mediaplane_core::srtp::{LegSrtp, SrtpKey, SrtpSuite};
        let bad = |m: String| ApiError::new(ErrorCode::Invalid, m);
        let suite = SrtpSuite::from_name(&self.suite).ok_or_else(|| {
            let names: Vec<&str> = SrtpSuite::ALL.iter().map(|s| s.name()).collect();
            bad(format!("srtp suite {:?} is not one of {}", self.suite, names.join(", ")))
        })?;
        let key = |which: &str, b64: &str| {
            // An a=crypto key parameter as it is pasted works too: `inline:<base64>|2^31|1:1`.
            let b64 = b64.trim().strip_prefix("inline:").unwrap_or(b64.trim());
            let b64 = b64.split('|').next().unwrap_or_default();
            let master = base64::engine::GeneralPurpose::new(
                &base64::alphabet::STANDARD,
                base64::engine::general_purpose::GeneralPurposeConfig::new().with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
            )
            .decode(b64)
            .map_err(|e| bad(format!("srtp {which}: not base64: {e}")))?;
            SrtpKey::new(suite, master).map_err(|e| bad(format!("srtp {which}: {e}")))
        };
        Ok(LegSrtp { inbound: Some(key("inbound", &self.inbound)?), outbound: Some(key("outbound", &self.outbound)?) })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Publish {
    name: String,
    local: Option<SocketAddr>,
    ssrc: Option<u32>,
    #[serde(default = "yes")]
    rtp: bool,
    clock_rate: Option<u32>,
    /// Simulcast: each layer's SSRC, lowest quality first.
    #[serde(default)]
    layers: Vec<u32>,
    /// `vp8` or `h264` (simulcast streams; vp8 when not given).
    codec: Option<String>,
    /// Its payload format as SDP names it, so browsers can subscribe to it over WHEP:
    /// `{"kind": "video", "pt": 96, "rtpmap": "VP8/90000"}`.
    format: Option<mediaplane_core::model::PayloadFormat>,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Subscribe {
    publisher: String,
    stream: String,
    /// Of a simulcast stream: the layer to receive (the top one when not given), a cap, and
    /// whether the consumer's own reports may lower it (default: yes).
    preferred_layer: Option<u8>,
    max_layer: Option<u8>,
    auto_layer: Option<bool>,
    /// Of a simulcast VP8 stream: the highest temporal layer to receive (all when not given).
    temporal_layer: Option<u8>,
}

/// A consumer's layers (`PUT .../consumers/{consumer}/layers`): all replaced, absent = none
/// (`auto` absent = on).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConsumerLayers {
    preferred: Option<u8>,
    max: Option<u8>,
    #[serde(default = "yes")]
    auto: bool,
    temporal: Option<u8>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LegRequest {
    local: Option<SocketAddr>,
    remote: Option<SocketAddr>,
    #[serde(default)]
    strict: bool,
    #[serde(default = "yes")]
    rtp: bool,
    #[serde(default)]
    follow: mediaplane_core::model::Follow,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRelay {
    id: String,
    a: LegRequest,
    b: LegRequest,
}

/// At most this many operations in one `POST /v1/batch/relays`.
pub const MAX_BATCH: usize = 10_000;

/// Many relay operations applied as one: deletes first (so a batch can replace a relay), then
/// creates, in order; one store transaction and one data plane update for all of them.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RelayBatch {
    #[serde(default)]
    delete: Vec<String>,
    #[serde(default)]
    create: Vec<CreateRelay>,
}

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The matched route pattern (bounded: never the raw path), `unmatched` for the fallback.
fn route_of(req: &Request) -> &str {
    req.extensions().get::<MatchedPath>().map_or("unmatched", MatchedPath::as_str)
}

pub fn router(state: AppState, cfg: &crate::config::ApiConfig, metrics: Arc<Metrics>) -> Router {
    let (max_body, max_batch_body) = (cfg.max_body, cfg.max_batch_body.max(cfg.max_body));
    let token = cfg.token.clone().filter(|t| !t.is_empty()).map(|t| Arc::new(format!("Bearer {t}")));
    let room_tokens = RoomTokens::new(cfg.token.as_deref().unwrap_or_default());
    let timeout = std::time::Duration::from_millis(cfg.timeout_ms);
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi))
        .route("/v1/rooms", get(list_rooms).post(create_room))
        .route("/v1/rooms/{room}", get(get_room).put(configure_room).delete(delete_room))
        .route("/v1/rooms/{room}/participants", post(add_participant))
        .route("/v1/rooms/{room}/participants/{pid}", get(get_participant).put(configure_participant).delete(remove_participant))
        .route("/v1/rooms/{room}/participants/{pid}/streams", post(publish))
        .route("/v1/rooms/{room}/participants/{pid}/streams/{stream}", delete(unpublish))
        .route("/v1/rooms/{room}/participants/{pid}/subscriptions", post(subscribe))
        .route("/v1/rooms/{room}/participants/{pid}/subscriptions/{publisher}/{stream}", delete(unsubscribe))
        .route("/v1/rooms/{room}/tokens", post(issue_room_token))
        .route("/v1/rooms/{room}/consumers", get(list_consumers))
        .route("/v1/rooms/{room}/consumers/{consumer}", get(get_consumer))
        .route("/v1/rooms/{room}/consumers/{consumer}/layers", put(set_consumer_layers))
        .route("/v1/relays", get(list_relays).post(create_relay))
        .route("/v1/relays/{id}", get(get_relay).delete(delete_relay))
        .route(BATCH_PATH, post(relay_batch).layer(DefaultBodyLimit::max(max_batch_body)))
        .route("/v1/rtsp/paths", get(list_rtsp_paths).post(add_rtsp_path))
        .route("/v1/rtsp/paths/{name}", get(get_rtsp_path).delete(remove_rtsp_path))
        .route("/v1/stats", get(stats))
        .route("/v1/table", get(table))
        .route("/v1/whip/{room}", post(crate::whip::whip))
        .route("/v1/whep/{room}/{publisher}", post(crate::whip::whep))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Declared-too-large bodies are refused before a byte is read; chunked ones when they
        // cross the limit. Only POST and PUT read a body (others are answered without it).
        .layer(axum::middleware::from_fn(move |req: Request, next: axum::middleware::Next| async move {
            let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            let limit = if req.uri().path() == BATCH_PATH { max_batch_body } else { max_body };
            let reads_body = req.method() == axum::http::Method::POST || req.method() == axum::http::Method::PUT;
            match declared {
                Some(n) if n > limit as u64 && reads_body => {
                    ApiError::new(ErrorCode::TooLarge, format!("request body of {n} bytes exceeds {limit}")).into_response()
                }
                _ => next.run(req).await,
            }
        }))
        .layer(DefaultBodyLimit::max(max_body))
        // A request past its deadline answers 503, and says whether its change was applied
        // (see [`Pending::timed_out`]).
        .layer(axum::middleware::from_fn(move |mut req: Request, next: axum::middleware::Next| async move {
            let pending = Pending::default();
            req.extensions_mut().insert(pending.clone());
            match tokio::time::timeout(timeout, next.run(req)).await {
                Ok(resp) => resp,
                Err(_) => pending.timed_out(timeout).await,
            }
        }))
        // Unauthenticated requests are refused before any handler or limit runs.
        .layer(axum::middleware::from_fn({
            let room_tokens = room_tokens.clone();
            move |req: Request, next: axum::middleware::Next| {
                let (token, room_tokens) = (token.clone(), room_tokens.clone());
                async move {
                    if let Some(expected) = token.filter(|_| !open_to_all(&req)) {
                        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or_default();
                        let admin = given.len() == expected.len() && openssl::memcmp::eq(given.as_bytes(), expected.as_bytes());
                        if !admin {
                            if let Err(refused) = room_token_allows(&room_tokens, given, &req) {
                                return refused.into_response();
                            }
                        }
                    }
                    next.run(req).await
                }
            }
        }))
        .layer(Extension(room_tokens))
        .layer(Extension(metrics.clone()))
        // Outside the token check, so refused requests are counted and logged too.
        .layer(axum::middleware::from_fn(move |req: Request, next: axum::middleware::Next| {
            let metrics = metrics.clone();
            async move {
                let (method, route, start) = (req.method().clone(), route_of(&req).to_string(), Instant::now());
                let resp = next.run(req).await;
                metrics.http.record(method.as_str(), &route, resp.status().as_u16(), start.elapsed());
                resp
            }
        }))
        .layer(PropagateRequestIdLayer::new(REQUEST_ID))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|req: &Request| {
                    // Only visible ASCII (what to_str accepts), and not without bound, goes to the log.
                    let id = req.headers().get(&REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("");
                    let id = &id[..id.len().min(128)];
                    tracing::info_span!("http", id, method = %req.method(), route = route_of(req), path = %req.uri().path())
                })
                .on_request(())
                .on_response(|resp: &Response, latency: Duration, _: &tracing::Span| {
                    tracing::info!(status = resp.status().as_u16(), latency_us = latency.as_micros() as u64, "request")
                })
                .on_failure(()),
        )
        // Outermost: the id exists before the span and every other layer.
        .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
        .with_state(state)
}

/// What answers without a token: the room page (static, no secret: it asks for the token
/// itself), `/health` (liveness probes of service managers, load balancers and orchestrators
/// carry no credentials; it tells counts, nothing of the sessions) and `/openapi.json` (the
/// API's shape, the same for every daemon). By GET or HEAD; every other request needs the token.
pub const OPEN_PATHS: [&str; 3] = ["/", "/health", "/openapi.json"];

fn open_to_all(req: &Request) -> bool {
    (req.method() == axum::http::Method::GET || req.method() == axum::http::Method::HEAD) && OPEN_PATHS.contains(&req.uri().path())
}

/// The OpenAPI 3 description of this router (`crates/control/openapi.json`; the test
/// `crates/mediaplane/tests/openapi.rs` checks it against the real routes).
pub const OPENAPI: &str = include_str!("../openapi.json");

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn not_found() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "no such endpoint; see the README for the API")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(ErrorCode::MethodNotAllowed, "method not allowed on this endpoint")
}

async fn health(State(m): State<AppState>) -> ApiResult {
    let (rooms, relays, version) = m.read(|model, t| (model.rooms.len(), model.relays.len(), t.version));
    ok(json!({"status": "ok", "dataplane": m.dataplane().name(), "rooms": rooms, "relays": relays, "table_version": version}))
}

/// The room page (WebRTC through WHIP/WHEP): `GET /`, without the token.
async fn page() -> axum::response::Html<&'static str> {
    axum::response::Html(include_str!("page/index.html"))
}

fn rtsp_of(m: &AppState) -> Result<Arc<dyn crate::rtsp_paths::RtspPaths>, ApiError> {
    m.rtsp_paths().cloned().ok_or_else(|| ApiError::new(ErrorCode::NotFound, "the RTSP proxy is not serving (set rtsp.listen)"))
}

impl From<crate::rtsp_paths::RtspPathError> for ApiError {
    fn from(e: crate::rtsp_paths::RtspPathError) -> Self {
        use crate::rtsp_paths::RtspPathError as E;
        let code = match &e {
            E::Invalid(_) => ErrorCode::Invalid,
            E::Exists(_) => ErrorCode::Exists,
            E::NotFound(_) => ErrorCode::NotFound,
            E::Failed(_) => ErrorCode::Internal,
        };
        ApiError::new(code, e.to_string())
    }
}

async fn list_rtsp_paths(State(m): State<AppState>) -> ApiResult {
    ok(json!({"paths": rtsp_of(&m)?.list()}))
}
async fn get_rtsp_path(State(m): State<AppState>, Path(name): Path<String>) -> ApiResult {
    let path = rtsp_of(&m)?.get(&name).ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no RTSP path {name:?}")))?;
    ok(path)
}
async fn add_rtsp_path(State(m): State<AppState>, ApiJson(req): ApiJson<crate::config::RtspPath>) -> Result<Response, ApiError> {
    let state = rtsp_of(&m)?.add(req)?;
    Ok((StatusCode::CREATED, Json(state)).into_response())
}
async fn remove_rtsp_path(State(m): State<AppState>, Path(name): Path<String>) -> ApiResult {
    let rtsp = rtsp_of(&m)?;
    let gone = name.clone();
    tokio::task::spawn_blocking(move || rtsp.remove(&gone)).await.map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))??;
    ok(json!({"deleted": name}))
}

async fn list_rooms(State(m): State<AppState>) -> ApiResult {
    ok(json!({"rooms": m.read(|model, _| model.rooms.keys().cloned().collect::<Vec<_>>())}))
}

async fn create_room(State(m): State<AppState>, Extension(p): Extension<Pending>, ApiJson(req): ApiJson<CreateRoom>) -> Result<Response, ApiError> {
    commit(m, p, move |m, t| {
        m.mutate_for(t, |model, _| {
            model.create_room(&req.id)?;
            if req.publisher_max_kbps.is_some() {
                model.set_publisher_max_kbps(&req.id, req.publisher_max_kbps)?;
            }
            Ok(((), vec![Change::Room(req.id.clone())]))
        })?;
        Ok((StatusCode::CREATED, json!({"id": req.id})))
    })
    .await
}

async fn configure_room(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path(room): Path<String>,
    ApiJson(req): ApiJson<RoomSettings>,
) -> Result<Response, ApiError> {
    commit(m, p, move |m, t| {
        m.mutate_for(t, |model, _| {
            model.set_publisher_max_kbps(&room, req.publisher_max_kbps)?;
            Ok(((), vec![Change::Room(room.clone())]))
        })?;
        Ok((StatusCode::OK, json!({"id": room, "publisher_max_kbps": req.publisher_max_kbps})))
    })
    .await
}

async fn get_room(State(m): State<AppState>, Path(room): Path<String>) -> ApiResult {
    let mut r = m.read(|model, _| model.room(&room).map(|r| without_keys(serde_json::to_value(r).unwrap())))?;
    if let Some(ps) = r["participants"].as_object_mut() {
        ps.values_mut().for_each(|p| with_handshake(&m, p));
    }
    let mut out = json!({"id": room, "participants": r["participants"]});
    if let Some(k) = r.get("publisher_max_kbps") {
        out["publisher_max_kbps"] = k.clone();
    }
    ok(out)
}

async fn delete_room(State(m): State<AppState>, Extension(p): Extension<Pending>, Path(room): Path<String>) -> Result<Response, ApiError> {
    commit(m, p, move |m, t| {
        m.mutate_for(t, |model, _| {
            model.delete_room(&room)?;
            Ok(((), vec![Change::Room(room.clone())]))
        })?;
        Ok((StatusCode::OK, json!({"deleted": room})))
    })
    .await
}

async fn add_participant(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path(room): Path<String>,
    ApiJson(req): ApiJson<AddParticipant>,
) -> Result<Response, ApiError> {
    let srtp = req.srtp.as_ref().map(ParticipantSrtp::keys).transpose()?;
    let suite = srtp.as_ref().and_then(|k| k.inbound.as_ref()).map(|k| json!({"suite": k.suite}));
    commit(m, p, move |m, t| {
        let local = m.mutate_for(t, |model, media| {
            let local = match req.local {
                Some(l) => l,
                None => allocate_local(model, media, &[])?,
            };
            model.add_srtp_participant(&room, &req.id, local, req.remote, srtp)?;
            Ok((local, vec![Change::Room(room.clone())]))
        })?;
        let mut out = json!({"id": req.id, "local": local, "remote": req.remote});
        if let Some(s) = suite {
            out["srtp"] = s;
        }
        Ok((StatusCode::CREATED, out))
    })
    .await
}

/// A room token's request: through when the token is valid and reaches it (see
/// [`crate::room_token::reaches`]), else why not (401, or 403 beyond its room's joining).
fn room_token_allows(tokens: &RoomTokens, authorization: &str, req: &Request) -> Result<(), ApiError> {
    let unauthorized = |m: &str| ApiError::new(ErrorCode::Unauthorized, m);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let presented = authorization.strip_prefix("Bearer ").unwrap_or_default();
    match tokens.verify(presented, now) {
        Ok(room) if crate::room_token::reaches(room, req.method(), req.uri().path()) => Ok(()),
        Ok(room) => {
            Err(ApiError::new(ErrorCode::Forbidden, format!("a room token for {room:?} reaches only WHIP and WHEP into that room, reading it and leaving it")))
        }
        Err(Refused::Expired) => Err(unauthorized("the room token has expired")),
        Err(Refused::Malformed | Refused::BadSignature) => Err(unauthorized("missing or wrong bearer token")),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct IssueRoomToken {
    /// Seconds it lives (default a day, at most 30 days).
    ttl_s: Option<u64>,
}

/// `POST /v1/rooms/{room}/tokens`: a room token for a participant's browser or WHIP client (the
/// room need not exist yet: WHIP creates it). Needs the API token.
async fn issue_room_token(Extension(tokens): Extension<RoomTokens>, Path(room): Path<String>, body: axum::body::Bytes) -> Result<Response, ApiError> {
    // The body is optional: none asks for the default lifetime.
    let req: IssueRoomToken = match body.is_empty() {
        true => IssueRoomToken::default(),
        false => parse_json(&body)?,
    };
    let ttl = req.ttl_s.unwrap_or(crate::room_token::DEFAULT_TTL_S);
    if !(1..=crate::room_token::MAX_TTL_S).contains(&ttl) {
        return Err(ApiError::new(ErrorCode::Invalid, format!("ttl_s must be 1 to {}", crate::room_token::MAX_TTL_S)));
    }
    if room.is_empty() || room.len() > 64 || !room.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.') {
        return Err(ApiError::new(ErrorCode::Invalid, format!("invalid room id {room:?}: use 1-64 characters of [A-Za-z0-9_.-]")));
    }
    let expires = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) + ttl;
    Ok((StatusCode::CREATED, Json(json!({"room": room, "token": tokens.issue(&room, expires), "expires": expires}))).into_response())
}

async fn get_participant(State(m): State<AppState>, Path((room, pid)): Path<(String, String)>) -> ApiResult {
    let mut p = m.read(|model, _| model.participant(&room, &pid).map(|p| without_keys(serde_json::to_value(p).unwrap())))?;
    with_handshake(&m, &mut p);
    ok(p)
}

async fn configure_participant(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path((room, pid)): Path<(String, String)>,
    ApiJson(req): ApiJson<ParticipantSettings>,
) -> Result<Response, ApiError> {
    commit(m, p, move |m, t| {
        m.mutate_for(t, |model, _| {
            model.set_participant_max_kbps(&room, &pid, req.max_kbps)?;
            Ok(((), vec![Change::Room(room.clone())]))
        })?;
        Ok((StatusCode::OK, json!({"id": pid, "max_kbps": req.max_kbps})))
    })
    .await
}

async fn remove_participant(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path((room, pid)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    commit(m, p, move |m, t| {
        m.mutate_for(t, |model, _| {
            model.remove_participant(&room, &pid)?;
            Ok(((), vec![Change::Room(room.clone())]))
        })?;
        Ok((StatusCode::OK, json!({"deleted": pid})))
    })
    .await
}

async fn publish(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path((room, pid)): Path<(String, String)>,
    ApiJson(req): ApiJson<Publish>,
) -> Result<Response, ApiError> {
    if req.clock_rate.is_some_and(|c| !(1..=1_000_000).contains(&c)) {
        return Err(ApiError::new(ErrorCode::Invalid, "clock_rate must be 1 to 1000000 Hz"));
    }
    if let Some(f) = &req.format {
        crate::whip::check_format(f).map_err(|e| ApiError::new(ErrorCode::Invalid, e))?;
    }
    let codec = match req.codec.as_deref() {
        None => None,
        Some(c) => {
            Some(mediaplane_core::simulcast::Codec::parse(c).ok_or_else(|| ApiError::new(ErrorCode::Invalid, format!("codec {c:?} is not one of vp8, h264")))?)
        }
    };
    let spec = StreamSpec { local: req.local, ssrc: req.ssrc, rtp: req.rtp, clock_rate: req.clock_rate, layers: req.layers, codec, format: req.format.clone() };
    commit(m, p, move |m, t| {
        let uid = m.mutate_for(t, |model, _| {
            let uid = model.publish(&room, &pid, &req.name, spec)?;
            Ok((uid, vec![Change::Room(room.clone())]))
        })?;
        Ok((StatusCode::CREATED, json!({"name": req.name, "id": uid})))
    })
    .await
}

async fn unpublish(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path((room, pid, stream)): Path<(String, String, String)>,
) -> Result<Response, ApiError> {
    commit(m, p, move |m, t| {
        m.mutate_for(t, |model, _| {
            model.unpublish(&room, &pid, &stream)?;
            Ok(((), vec![Change::Room(room.clone())]))
        })?;
        Ok((StatusCode::OK, json!({"deleted": stream})))
    })
    .await
}

async fn subscribe(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path((room, pid)): Path<(String, String)>,
    ApiJson(req): ApiJson<Subscribe>,
) -> Result<Response, ApiError> {
    let sref = StreamRef { publisher: req.publisher, stream: req.stream };
    let (preferred, max, auto, temporal) = (req.preferred_layer, req.max_layer, req.auto_layer, req.temporal_layer);
    commit(m, p, move |m, t| {
        let consumer = m.mutate_for(t, |model, _| {
            let consumer = model.subscribe(&room, &pid, sref.clone())?;
            // (auto_layer true is the default: a stream without layers takes it too.)
            if preferred.is_some() || max.is_some() || auto == Some(false) || temporal.is_some() {
                model.set_consumer_layers(&room, consumer, preferred, max, auto.unwrap_or(true), temporal)?;
            }
            Ok((consumer, vec![Change::Room(room.clone())]))
        })?;
        Ok((StatusCode::CREATED, json!({"subscriber": pid, "publisher": sref.publisher, "stream": sref.stream, "consumer": consumer})))
    })
    .await
}

async fn unsubscribe(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path((room, pid, publisher, stream)): Path<(String, String, String, String)>,
) -> Result<Response, ApiError> {
    let sref = StreamRef { publisher, stream };
    commit(m, p, move |m, t| {
        m.mutate_for(t, |model, _| {
            model.unsubscribe(&room, &pid, &sref)?;
            Ok(((), vec![Change::Room(room.clone())]))
        })?;
        Ok((StatusCode::OK, json!({"deleted": sref})))
    })
    .await
}

/// The room's consumers with their counters.
async fn list_consumers(State(m): State<AppState>, Path(room): Path<String>) -> Result<Response, ApiError> {
    m.read(|model, _| model.room(&room).map(|_| ()))?;
    read_blocking(move || json!({"consumers": m.read(|model, _| crate::consumers::list(model, Some(&room), &**m.dataplane()))})).await
}

async fn get_consumer(State(m): State<AppState>, Path((room, id)): Path<(String, String)>) -> ApiResult {
    let id: u32 = id.parse().map_err(|_| ApiError::new(ErrorCode::Invalid, format!("consumer id {id:?} is not a number")))?;
    m.read(|model, _| model.room(&room).map(|_| ()))?;
    let m2 = m.clone();
    let room2 = room.clone();
    let found = tokio::task::spawn_blocking(move || m2.read(|model, _| crate::consumers::one(model, &room2, id, &**m2.dataplane())))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("read failed: {e}")))?;
    match found {
        Some(c) => ok(serde_json::to_value(c).unwrap()),
        None => Err(ApiError::new(ErrorCode::NotFound, format!("consumer {id} not found in room {room}"))),
    }
}

/// Choose the layers a consumer of a simulcast stream receives; the switch happens at the next
/// keyframe of the layer, which the data plane asks the publisher for.
async fn set_consumer_layers(
    State(m): State<AppState>,
    Extension(p): Extension<Pending>,
    Path((room, id)): Path<(String, String)>,
    ApiJson(req): ApiJson<ConsumerLayers>,
) -> Result<Response, ApiError> {
    let id: u32 = id.parse().map_err(|_| ApiError::new(ErrorCode::Invalid, format!("consumer id {id:?} is not a number")))?;
    commit(m, p, move |m, t| {
        let c = m.mutate_for(t, |model, _| {
            Ok((model.set_consumer_layers(&room, id, req.preferred, req.max, req.auto, req.temporal)?, vec![Change::Room(room.clone())]))
        })?;
        Ok((StatusCode::OK, json!({"consumer": id, "preferred": c.preferred_layer, "max": c.max_layer, "auto": c.auto_layer, "temporal": c.temporal_layer})))
    })
    .await
}

async fn list_relays(State(m): State<AppState>) -> ApiResult {
    ok(json!({"relays": m.read(|model, _| model.relays.keys().cloned().collect::<Vec<_>>())}))
}

/// Create one relay in `model`, allocating the local addresses not given.
fn create_relay_in(model: &mut Model, media: &MediaConfig, req: &CreateRelay) -> Result<Relay, ManagerError> {
    let a_local = match req.a.local {
        Some(l) => l,
        None => allocate_local(model, media, &[])?,
    };
    let b_local = match req.b.local {
        Some(l) => l,
        None => allocate_local(model, media, &[a_local])?,
    };
    let leg = |l, r: &LegRequest| LegSpec { local: l, remote: r.remote, strict: r.strict, rtp: r.rtp, follow: r.follow };
    model.create_relay(&req.id, leg(a_local, &req.a), leg(b_local, &req.b))?;
    Ok(model.relays[&req.id].clone())
}

async fn create_relay(State(m): State<AppState>, Extension(p): Extension<Pending>, ApiJson(req): ApiJson<CreateRelay>) -> Result<Response, ApiError> {
    commit(m, p, move |m, t| {
        let relay = m.mutate_for(t, |model, media| Ok((create_relay_in(model, media, &req)?, vec![Change::Relay(req.id.clone())])))?;
        Ok((StatusCode::CREATED, json!({"id": req.id, "a": leg_view(&relay.a), "b": leg_view(&relay.b)})))
    })
    .await
}

const BATCH_PATH: &str = "/v1/batch/relays";

/// All or nothing: the first failing operation fails the batch, named in the error
/// (`create[3] (id "x"): ...`), with that operation's status and code.
async fn relay_batch(State(m): State<AppState>, Extension(p): Extension<Pending>, body: JsonBody) -> Result<Response, ApiError> {
    commit(m, p, move |m, t| {
        let req: RelayBatch = body.parse()?;
        let n = req.delete.len() + req.create.len();
        if n == 0 || n > MAX_BATCH {
            return Err(ApiError::new(ErrorCode::Invalid, format!("a batch holds 1 to {MAX_BATCH} operations, this one {n}")));
        }
        let item = |op: &str, i: usize, id: &str, e: ManagerError| ManagerError::BatchItem { item: format!("{op}[{i}] (id {id:?})"), source: Box::new(e) };
        // A big batch gives up as soon as its request has (the writer is free sooner).
        let gave_up = |i: usize| i.is_multiple_of(256) && t.is_abandoned();
        let created = m.mutate_for(t, |model, media| {
            let mut changes = Vec::with_capacity(n);
            for (i, id) in req.delete.iter().enumerate() {
                if gave_up(i) {
                    return Err(ManagerError::Abandoned);
                }
                model.delete_relay(id).map_err(|e| item("delete", i, id, e.into()))?;
                changes.push(Change::Relay(id.clone()));
            }
            let mut created = Vec::with_capacity(req.create.len());
            for (i, r) in req.create.iter().enumerate() {
                if gave_up(i) {
                    return Err(ManagerError::Abandoned);
                }
                let relay = create_relay_in(model, media, r).map_err(|e| item("create", i, &r.id, e))?;
                created.push(json!({"id": r.id, "a": leg_view(&relay.a), "b": leg_view(&relay.b)}));
                changes.push(Change::Relay(r.id.clone()));
            }
            Ok((created, changes))
        })?;
        Ok((StatusCode::OK, json!({"deleted": req.delete, "created": created})))
    })
    .await
}

/// A WebRTC participant's view gets its handshake's state (ICE checks, DTLS, keyed), as its
/// keys are never part of it.
fn with_handshake(m: &SessionManager, p: &mut Value) {
    let Some(uid) = p["webrtc"]["uid"].as_u64() else { return };
    if let Some(h) = m.crypto_leg(uid as u32) {
        p["webrtc"]["handshake"] = serde_json::to_value(h).unwrap_or_default();
    }
}

/// A relay leg as the API shows it: its SRTP keys by suite only (see [`without_keys`]), its
/// stored ICE credentials not at all.
fn leg_view(leg: &mediaplane_core::model::Leg) -> serde_json::Value {
    let mut v = without_keys(serde_json::to_value(leg).unwrap_or_default());
    if let Some(o) = v.as_object_mut() {
        o.remove("ice_credentials");
    }
    v
}

/// `v` without SRTP key material: every `master` next to a `suite` goes (the keys stay in the
/// store, never in a response). Relay legs' and SDES participants' views go through it.
fn without_keys(mut v: serde_json::Value) -> serde_json::Value {
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(o) => {
                if o.contains_key("suite") {
                    o.remove("master");
                }
                o.values_mut().for_each(strip);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    strip(&mut v);
    v
}

async fn get_relay(State(m): State<AppState>, Path(id): Path<String>) -> ApiResult {
    let r = m.read(|model, _| model.relays.get(&id).cloned());
    match r {
        Some(r) => ok(json!({"id": id, "a": leg_view(&r.a), "b": leg_view(&r.b)})),
        None => Err(ModelError::NotFound { kind: "relay", id }.into()),
    }
}

async fn delete_relay(State(m): State<AppState>, Extension(p): Extension<Pending>, Path(id): Path<String>) -> Result<Response, ApiError> {
    commit(m, p, move |m, t| {
        m.mutate_for(t, |model, _| {
            model.delete_relay(&id)?;
            Ok(((), vec![Change::Relay(id.clone())]))
        })?;
        Ok((StatusCode::OK, json!({"deleted": id})))
    })
    .await
}

#[derive(Serialize)]
struct StreamStatsOut<'a> {
    id: u32,
    label: &'a str,
    #[serde(flatten)]
    counters: Counters,
    /// In-path reception quality, for an RTP stream that has had a packet accepted.
    #[serde(skip_serializing_if = "Option::is_none")]
    reception: Option<mediaplane_core::reception::ReceptionReport>,
}

/// The same snapshot `/metrics` encodes, plus every stream and the NG totals of the registry.
/// Work a read does per installed stream (reading kernel maps, serializing thousands of
/// entries) runs on the blocking pool, not on the runtime that answers `/health`.
async fn read_blocking(f: impl FnOnce() -> Value + Send + 'static) -> Result<Response, ApiError> {
    match tokio::task::spawn_blocking(move || serde_json::to_vec(&f())).await {
        Ok(Ok(body)) => Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response()),
        Ok(Err(e)) => Err(ApiError::new(ErrorCode::Internal, format!("serializing failed: {e}"))),
        Err(e) => Err(ApiError::new(ErrorCode::Internal, format!("read failed: {e}"))),
    }
}

async fn stats(State(m): State<AppState>, Extension(mx): Extension<Arc<Metrics>>) -> Result<Response, ApiError> {
    read_blocking(move || {
        let snap = StatsReading::take(&m);
        let st = &snap.stats;
        let streams: Vec<Value> = m.read(|_, t| {
            t.streams
                .values()
                .map(|e| {
                    let c = st.streams.get(&e.id).copied().unwrap_or_default();
                    let reception = st.reception.get(&e.id).copied();
                    serde_json::to_value(StreamStatsOut { id: e.id, label: &e.label, counters: c, reception }).unwrap()
                })
                .collect()
        });
        let consumers = mx.per_consumer.then(|| m.read(|model, _| crate::consumers::list(model, None, &**m.dataplane())));
        let mut out = json!({
            "dataplane": st.dataplane,
            "table_version": st.table_version,
            "total": st.total,
            "streams": streams,
            "copy_latency": st.copy_latency,
            "extra": st.extra,
            "maps": st.maps,
            "memory": snap.memory,
            "ng": mx.ng.totals(),
            "rtsp": mx.rtsp.totals(),
        });
        if let Some(c) = consumers {
            out["consumers"] = serde_json::to_value(c).unwrap();
        }
        out
    })
    .await
}

async fn table(State(m): State<AppState>) -> Result<Response, ApiError> {
    read_blocking(move || {
        let snap = m.snapshot();
        without_keys(json!({"version": snap.table.version, "streams": snap.table.streams.values().collect::<Vec<_>>()}))
    })
    .await
}

/// The registry's exposition: OpenMetrics when the scraper asks for it (Prometheus does), the
/// Prometheus text format otherwise.
async fn metrics_text(Extension(mx): Extension<Arc<Metrics>>, headers: HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("");
    let openmetrics = accept.contains("application/openmetrics-text");
    // Reading the data plane is blocking work (map reads, /proc).
    let body = tokio::task::spawn_blocking(move || if openmetrics { mx.encode_openmetrics() } else { mx.encode_prometheus() }).await;
    let ctype = if openmetrics { "application/openmetrics-text; version=1.0.0; charset=utf-8" } else { "text/plain; version=0.0.4; charset=utf-8" };
    match body {
        Ok(body) => ([(header::CONTENT_TYPE, ctype)], body).into_response(),
        Err(e) => ApiError::new(ErrorCode::Metrics, format!("collecting metrics failed: {e}")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mediaplane_dataplane::DataplaneError;

    #[test]
    fn a_full_kernel_map_is_a_503_with_its_own_code_other_data_plane_errors_a_500() {
        let full: ApiError = ManagerError::Dataplane(DataplaneError::Full("kernel stats map full (4 streams)".into())).into();
        assert_eq!((full.code.status(), full.code.as_str()), (StatusCode::SERVICE_UNAVAILABLE, "dataplane_full"));
        assert!(full.message.contains("kernel stats map full"), "{}", full.message);
        let other: ApiError = ManagerError::Dataplane(DataplaneError::Other("boom".into())).into();
        assert_eq!((other.code.status(), other.code.as_str()), (StatusCode::INTERNAL_SERVER_ERROR, "dataplane"));
    }

    /// `auto_layer: true` is the default, so a subscription to a stream without layers takes it
    /// as it takes its absence; what does need layers (`auto_layer: false`, a preferred or
    /// maximum layer) is still refused there, and taken on a simulcast stream.
    #[test]
    fn auto_layer_true_is_taken_on_a_stream_without_layers() {
        use crate::config::{ApiConfig, Limits, MetricsSection};
        use mediaplane_dataplane::{UserspaceConfig, UserspaceDataplane};
        let dp = UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, None).unwrap();
        let media = MediaConfig { ip: "127.78.5.1".parse().unwrap(), port_min: 40000, port_max: 40099, ..Default::default() };
        let mgr = Arc::new(SessionManager::open(crate::store::Store::in_memory().unwrap(), Arc::new(dp), media, Limits::default()).unwrap());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/v1/rooms", listener.local_addr().unwrap());
        listener.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let metrics = Metrics::new(mgr.clone(), &MetricsSection::default());
                axum::serve(listener, router(mgr, &ApiConfig::default(), metrics)).await.unwrap();
            });
        });
        let post = |path: &str, body: Value| -> (u16, Value) {
            match ureq::post(&format!("{url}{path}")).timeout(Duration::from_secs(10)).send_json(body) {
                Ok(r) => (r.status(), r.into_json().unwrap()),
                Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap()),
                Err(e) => panic!("POST {path}: {e}"),
            }
        };
        assert_eq!(post("", json!({"id": "r"})).0, 201);
        for (i, who) in ["p", "s1", "s2", "s3", "s4"].iter().enumerate() {
            let (status, v) = post("/r/participants", json!({"id": who, "remote": format!("127.78.6.{}:5000", i + 1)}));
            assert_eq!(status, 201, "{v}");
        }
        assert_eq!(post("/r/participants/p/streams", json!({"name": "mic", "ssrc": 5})).0, 201);
        assert_eq!(post("/r/participants/p/streams", json!({"name": "cam", "layers": [10, 11], "codec": "vp8", "clock_rate": 90000})).0, 201);
        let sub = |who: &str, extra: Value| {
            let mut body = json!({"publisher": "p", "stream": "mic"});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            post(&format!("/r/participants/{who}/subscriptions"), body)
        };
        let (status, v) = sub("s1", json!({"auto_layer": true}));
        assert_eq!(status, 201, "auto_layer true on a stream without layers: {v}");
        assert!(v["consumer"].as_u64().is_some(), "{v}");
        for (who, extra) in [("s2", json!({"auto_layer": false})), ("s3", json!({"preferred_layer": 0})), ("s4", json!({"max_layer": 0}))] {
            let (status, v) = sub(who, extra.clone());
            assert_eq!((status, v["code"].as_str()), (400, Some("invalid")), "{extra} on a stream without layers: {v}");
            assert!(v["error"].as_str().unwrap().contains("has no layers"), "{v}");
        }
        let (status, v) = sub("s2", json!({"stream": "cam", "auto_layer": false, "max_layer": 0}));
        assert_eq!(status, 201, "a simulcast stream takes them: {v}");
    }
}
