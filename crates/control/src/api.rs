//! The HTTP/JSON API (see the README for every endpoint with examples) and the Prometheus
//! `/metrics` endpoint. Every error is a JSON body `{"error": "...", "code": "..."}` with a
//! 4xx/5xx status; no input reaches a panic.

use crate::config::MediaConfig;
use crate::manager::{allocate_local, ManagerError, SessionManager};
use crate::store::Change;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use mediaplane_core::model::{LegSpec, ModelError, Relay, StreamRef, StreamSpec};
use mediaplane_core::Model;
use mediaplane_dataplane::Counters;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;

pub type AppState = Arc<SessionManager>;

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, code, message: message.into() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({"error": self.message, "code": self.code}))).into_response()
    }
}

impl From<ManagerError> for ApiError {
    fn from(e: ManagerError) -> Self {
        let msg = e.to_string();
        match e {
            ManagerError::Model(m) => match m {
                ModelError::NotFound { .. } => ApiError::new(StatusCode::NOT_FOUND, "not_found", msg),
                ModelError::Exists { .. } => ApiError::new(StatusCode::CONFLICT, "exists", msg),
                ModelError::AddressInUse { .. } | ModelError::IngressInUse { .. } => {
                    ApiError::new(StatusCode::CONFLICT, "address_in_use", msg)
                }
                ModelError::InvalidId(_) | ModelError::BadAddress(_) | ModelError::FamilyMismatch(_) | ModelError::SelfSubscription => {
                    ApiError::new(StatusCode::BAD_REQUEST, "invalid", msg)
                }
            },
            ManagerError::Limit { .. } => ApiError::new(StatusCode::FORBIDDEN, "limit", msg),
            ManagerError::NoFreePort { .. } => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_free_port", msg),
            ManagerError::Dataplane(mediaplane_dataplane::DataplaneError::Full(_)) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "dataplane_full", msg)
            }
            ManagerError::Dataplane(_) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "dataplane", msg),
            ManagerError::Store(_) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "store", msg),
            // The failing item's status and code, with the item named in the message.
            ManagerError::BatchItem { source, .. } => ApiError { message: msg, ..ApiError::from(*source) },
        }
    }
}

impl From<ModelError> for ApiError {
    fn from(e: ModelError) -> Self {
        ManagerError::from(e).into()
    }
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
            Err(rej) => {
                let status = rej.status();
                let code = if status == StatusCode::PAYLOAD_TOO_LARGE { "too_large" } else { "bad_request" };
                Err(ApiError::new(status, code, rej.body_text()))
            }
        }
    }
}

type ApiResult = Result<(StatusCode, Json<Value>), ApiError>;

fn ok(v: Value) -> ApiResult {
    Ok((StatusCode::OK, Json(v)))
}
fn created(v: Value) -> ApiResult {
    Ok((StatusCode::CREATED, Json(v)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRoom {
    id: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddParticipant {
    id: String,
    /// Where the participant receives media (and the only source allowed to publish).
    remote: SocketAddr,
    /// SFU address for this participant; allocated from the media port range when absent.
    local: Option<SocketAddr>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Publish {
    name: String,
    local: Option<SocketAddr>,
    ssrc: Option<u32>,
    #[serde(default = "yes")]
    rtp: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Subscribe {
    publisher: String,
    stream: String,
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

pub fn router(state: AppState, cfg: &crate::config::ApiConfig) -> Router {
    let (max_body, max_batch_body) = (cfg.max_body, cfg.max_batch_body.max(cfg.max_body));
    let token = cfg.token.clone().filter(|t| !t.is_empty()).map(|t| Arc::new(format!("Bearer {t}")));
    let timeout = std::time::Duration::from_millis(cfg.timeout_ms.max(1));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .route("/v1/rooms", get(list_rooms).post(create_room))
        .route("/v1/rooms/{room}", get(get_room).delete(delete_room))
        .route("/v1/rooms/{room}/participants", post(add_participant))
        .route("/v1/rooms/{room}/participants/{pid}", get(get_participant).delete(remove_participant))
        .route("/v1/rooms/{room}/participants/{pid}/streams", post(publish))
        .route("/v1/rooms/{room}/participants/{pid}/streams/{stream}", delete(unpublish))
        .route("/v1/rooms/{room}/participants/{pid}/subscriptions", post(subscribe))
        .route("/v1/rooms/{room}/participants/{pid}/subscriptions/{publisher}/{stream}", delete(unsubscribe))
        .route("/v1/relays", get(list_relays).post(create_relay))
        .route("/v1/relays/{id}", get(get_relay).delete(delete_relay))
        .route(BATCH_PATH, post(relay_batch).layer(DefaultBodyLimit::max(max_batch_body)))
        .route("/v1/stats", get(stats))
        .route("/v1/table", get(table))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Declared-too-large bodies are refused before a byte is read; chunked ones when they
        // cross the limit.
        .layer(axum::middleware::from_fn(move |req: Request, next: axum::middleware::Next| async move {
            let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            let limit = if req.uri().path() == BATCH_PATH { max_batch_body } else { max_body };
            match declared {
                Some(n) if n > limit as u64 => {
                    ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", format!("request body of {n} bytes exceeds {limit}")).into_response()
                }
                _ => next.run(req).await,
            }
        }))
        .layer(DefaultBodyLimit::max(max_body))
        // A handler stuck (e.g. on a slow store) answers 503 instead of holding the client.
        .layer(axum::middleware::from_fn(move |req: Request, next: axum::middleware::Next| async move {
            match tokio::time::timeout(timeout, next.run(req)).await {
                Ok(resp) => resp,
                Err(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "timeout", format!("request took longer than {timeout:?}")).into_response(),
            }
        }))
        // Outermost: unauthenticated requests are refused before anything else runs.
        .layer(axum::middleware::from_fn(move |req: Request, next: axum::middleware::Next| {
            let token = token.clone();
            async move {
                if let Some(expected) = token {
                    let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
                    if given != Some(expected.as_str()) {
                        return ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "missing or wrong bearer token").into_response();
                    }
                }
                next.run(req).await
            }
        }))
        .with_state(state)
}

/// The OpenAPI 3 description of this router (`crates/control/openapi.json`; the test
/// `crates/mediaplane/tests/openapi.rs` checks it against the real routes).
pub const OPENAPI: &str = include_str!("../openapi.json");

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint; see the README for the API")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "method not allowed on this endpoint")
}

async fn health(State(m): State<AppState>) -> ApiResult {
    let (rooms, relays, version) = m.read(|model, t| (model.rooms.len(), model.relays.len(), t.version));
    ok(json!({"status": "ok", "dataplane": m.dataplane().name(), "rooms": rooms, "relays": relays, "table_version": version}))
}

async fn list_rooms(State(m): State<AppState>) -> ApiResult {
    ok(json!({"rooms": m.read(|model, _| model.rooms.keys().cloned().collect::<Vec<_>>())}))
}

async fn create_room(State(m): State<AppState>, ApiJson(req): ApiJson<CreateRoom>) -> ApiResult {
    m.mutate(|model, _| {
        model.create_room(&req.id)?;
        Ok(((), vec![Change::Room(req.id.clone())]))
    })?;
    created(json!({"id": req.id}))
}

async fn get_room(State(m): State<AppState>, Path(room): Path<String>) -> ApiResult {
    let r = m.read(|model, _| model.room(&room).map(|r| serde_json::to_value(r).unwrap()))?;
    ok(json!({"id": room, "participants": r["participants"]}))
}

async fn delete_room(State(m): State<AppState>, Path(room): Path<String>) -> ApiResult {
    m.mutate(|model, _| {
        model.delete_room(&room)?;
        Ok(((), vec![Change::Room(room.clone())]))
    })?;
    ok(json!({"deleted": room}))
}

async fn add_participant(State(m): State<AppState>, Path(room): Path<String>, ApiJson(req): ApiJson<AddParticipant>) -> ApiResult {
    let local = m.mutate(|model, media| {
        let local = match req.local {
            Some(l) => l,
            None => allocate_local(model, media, &[])?,
        };
        model.add_participant(&room, &req.id, local, req.remote)?;
        Ok((local, vec![Change::Room(room.clone())]))
    })?;
    created(json!({"id": req.id, "local": local, "remote": req.remote}))
}

async fn get_participant(State(m): State<AppState>, Path((room, pid)): Path<(String, String)>) -> ApiResult {
    let p = m.read(|model, _| model.participant(&room, &pid).map(|p| serde_json::to_value(p).unwrap()))?;
    ok(p)
}

async fn remove_participant(State(m): State<AppState>, Path((room, pid)): Path<(String, String)>) -> ApiResult {
    m.mutate(|model, _| {
        model.remove_participant(&room, &pid)?;
        Ok(((), vec![Change::Room(room.clone())]))
    })?;
    ok(json!({"deleted": pid}))
}

async fn publish(State(m): State<AppState>, Path((room, pid)): Path<(String, String)>, ApiJson(req): ApiJson<Publish>) -> ApiResult {
    let spec = StreamSpec { local: req.local, ssrc: req.ssrc, rtp: req.rtp };
    let uid = m.mutate(|model, _| {
        let uid = model.publish(&room, &pid, &req.name, spec)?;
        Ok((uid, vec![Change::Room(room.clone())]))
    })?;
    created(json!({"name": req.name, "id": uid}))
}

async fn unpublish(State(m): State<AppState>, Path((room, pid, stream)): Path<(String, String, String)>) -> ApiResult {
    m.mutate(|model, _| {
        model.unpublish(&room, &pid, &stream)?;
        Ok(((), vec![Change::Room(room.clone())]))
    })?;
    ok(json!({"deleted": stream}))
}

async fn subscribe(State(m): State<AppState>, Path((room, pid)): Path<(String, String)>, ApiJson(req): ApiJson<Subscribe>) -> ApiResult {
    let sref = StreamRef { publisher: req.publisher, stream: req.stream };
    m.mutate(|model, _| {
        model.subscribe(&room, &pid, sref.clone())?;
        Ok(((), vec![Change::Room(room.clone())]))
    })?;
    created(json!({"subscriber": pid, "publisher": sref.publisher, "stream": sref.stream}))
}

async fn unsubscribe(
    State(m): State<AppState>,
    Path((room, pid, publisher, stream)): Path<(String, String, String, String)>,
) -> ApiResult {
    let sref = StreamRef { publisher, stream };
    m.mutate(|model, _| {
        model.unsubscribe(&room, &pid, &sref)?;
        Ok(((), vec![Change::Room(room.clone())]))
    })?;
    ok(json!({"deleted": sref}))
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
    let leg = |l, r: &LegRequest| LegSpec { local: l, remote: r.remote, strict: r.strict, rtp: r.rtp };
    model.create_relay(&req.id, leg(a_local, &req.a), leg(b_local, &req.b))?;
    Ok(model.relays[&req.id].clone())
}

async fn create_relay(State(m): State<AppState>, ApiJson(req): ApiJson<CreateRelay>) -> ApiResult {
    let relay = m.mutate(|model, media| Ok((create_relay_in(model, media, &req)?, vec![Change::Relay(req.id.clone())])))?;
    created(json!({"id": req.id, "a": relay.a, "b": relay.b}))
}

const BATCH_PATH: &str = "/v1/batch/relays";

/// All or nothing: the first failing operation fails the batch, named in the error
/// (`create[3] (id "x"): ...`), with that operation's status and code.
async fn relay_batch(State(m): State<AppState>, ApiJson(req): ApiJson<RelayBatch>) -> ApiResult {
    let n = req.delete.len() + req.create.len();
    if n == 0 || n > MAX_BATCH {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid", format!("a batch holds 1 to {MAX_BATCH} operations, this one {n}")));
    }
    let item = |op: &str, i: usize, id: &str, e: ManagerError| ManagerError::BatchItem { item: format!("{op}[{i}] (id {id:?})"), source: Box::new(e) };
    let created = m.mutate(|model, media| {
        let mut changes = Vec::with_capacity(n);
        for (i, id) in req.delete.iter().enumerate() {
            model.delete_relay(id).map_err(|e| item("delete", i, id, e.into()))?;
            changes.push(Change::Relay(id.clone()));
        }
        let mut created = Vec::with_capacity(req.create.len());
        for (i, r) in req.create.iter().enumerate() {
            let relay = create_relay_in(model, media, r).map_err(|e| item("create", i, &r.id, e))?;
            created.push(json!({"id": r.id, "a": relay.a, "b": relay.b}));
            changes.push(Change::Relay(r.id.clone()));
        }
        Ok((created, changes))
    })?;
    ok(json!({"deleted": req.delete, "created": created}))
}

async fn get_relay(State(m): State<AppState>, Path(id): Path<String>) -> ApiResult {
    let r = m.read(|model, _| model.relays.get(&id).cloned());
    match r {
        Some(r) => ok(json!({"id": id, "a": r.a, "b": r.b})),
        None => Err(ModelError::NotFound { kind: "relay", id }.into()),
    }
}

async fn delete_relay(State(m): State<AppState>, Path(id): Path<String>) -> ApiResult {
    m.mutate(|model, _| {
        model.delete_relay(&id)?;
        Ok(((), vec![Change::Relay(id.clone())]))
    })?;
    ok(json!({"deleted": id}))
}

#[derive(Serialize)]
struct StreamStatsOut<'a> {
    id: u32,
    label: &'a str,
    #[serde(flatten)]
    counters: Counters,
}

async fn stats(State(m): State<AppState>) -> ApiResult {
    let st = m.stats();
    let streams: Vec<Value> = m.read(|_, t| {
        t.streams
            .values()
            .map(|e| {
                let c = st.streams.get(&e.id).copied().unwrap_or_default();
                serde_json::to_value(StreamStatsOut { id: e.id, label: &e.label, counters: c }).unwrap()
            })
            .collect()
    });
    ok(json!({
        "dataplane": st.dataplane,
        "table_version": st.table_version,
        "total": st.total,
        "streams": streams,
        "copy_latency": st.copy_latency,
        "extra": st.extra,
        "memory": memory(),
    }))
}

/// What the daemon holds: resident memory and the kernel memory of its BPF maps.
fn memory() -> Value {
    use mediaplane_dataplane::sys::{bpf_map_bytes, rss_bytes};
    json!({"rss_bytes": rss_bytes(None), "bpf_map_bytes": bpf_map_bytes(None)})
}

async fn table(State(m): State<AppState>) -> ApiResult {
    let t = m.read(|_, t| json!({"version": t.version, "streams": t.streams.values().collect::<Vec<_>>()}));
    ok(t)
}

/// Prometheus text exposition of the data plane's counters, totals and per stream.
async fn metrics(State(m): State<AppState>) -> Response {
    let st = m.stats();
    let labels = m.read(|_, t| t.streams.values().map(|e| (e.id, e.label.clone())).collect::<std::collections::HashMap<_, _>>());
    let dp = &st.dataplane;
    let mut out = String::new();
    let per_stream: Vec<_> = st.streams.iter().map(|(id, c)| (id, c.fields())).collect();
    for (i, (name, total)) in st.total.fields().into_iter().enumerate() {
        let _ = writeln!(out, "# TYPE mediaplane_{name}_total counter");
        let _ = writeln!(out, "mediaplane_{name}_total{{dataplane=\"{dp}\"}} {total}");
        for (id, fields) in &per_stream {
            let label = labels.get(id).map(String::as_str).unwrap_or("removed");
            let _ = writeln!(out, "mediaplane_stream_{name}_total{{dataplane=\"{dp}\",stream=\"{}\",id=\"{id}\"}} {}", escape(label), fields[i].1);
        }
    }
    for (k, v) in &st.extra {
        let _ = writeln!(out, "mediaplane_{k}{{dataplane=\"{dp}\"}} {v}");
    }
    if let Some(l) = st.copy_latency {
        let _ = writeln!(out, "# TYPE mediaplane_copy_latency_ns summary");
        for (q, v) in [("0.5", l.p50_ns), ("0.99", l.p99_ns)] {
            let _ = writeln!(out, "mediaplane_copy_latency_ns{{dataplane=\"{dp}\",quantile=\"{q}\"}} {v}");
        }
        let _ = writeln!(out, "mediaplane_copy_latency_ns_count{{dataplane=\"{dp}\"}} {}", l.count);
    }
    let _ = writeln!(out, "mediaplane_table_version{{dataplane=\"{dp}\"}} {}", st.table_version);
    let mem = memory();
    for (name, key) in [("mediaplane_memory_rss_bytes", "rss_bytes"), ("mediaplane_memory_bpf_map_bytes", "bpf_map_bytes")] {
        let _ = writeln!(out, "# TYPE {name} gauge");
        let _ = writeln!(out, "{name} {}", mem[key]);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

#[cfg(test)]
mod tests {
    use super::*;
    use mediaplane_dataplane::DataplaneError;

    #[test]
    fn a_full_kernel_map_is_a_503_with_its_own_code_other_data_plane_errors_a_500() {
        let full: ApiError = ManagerError::Dataplane(DataplaneError::Full("kernel stats map full (4 streams)".into())).into();
        assert_eq!((full.status, full.code), (StatusCode::SERVICE_UNAVAILABLE, "dataplane_full"));
        assert!(full.message.contains("kernel stats map full"), "{}", full.message);
        let other: ApiError = ManagerError::Dataplane(DataplaneError::Other("boom".into())).into();
        assert_eq!((other.status, other.code), (StatusCode::INTERNAL_SERVER_ERROR, "dataplane"));
    }
}
