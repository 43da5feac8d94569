//! The control plane: `mediaplane serve`. It owns the session model (through the
//! [`manager::SessionManager`]), persists it in the embedded [`store`], installs compiled tables
//! in whichever data plane it was given, and answers the HTTP/JSON [`api`].

pub mod api;
pub mod config;
pub mod consumers;
pub mod crypto_legs;
pub mod error_code;
pub mod manager;
pub mod metrics;
pub mod room_token;
pub mod rtsp_paths;
pub mod store;
pub mod whip;

use anyhow::Context;
pub use config::{Config, DataplaneKind};
use mediaplane_dataplane::{Dataplane, DataplaneEvent};
use std::future::Future;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// Run the daemon until `shutdown` resolves; then stop the data plane cleanly.
///
/// The caller builds the data plane (so this crate does not depend on every data plane) and
/// hands over the receiving end of its slow-path events.
pub async fn serve(
    cfg: Config,
    dataplane: Arc<dyn Dataplane>,
    events: Option<Receiver<DataplaneEvent>>,
    reset: bool,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_with(cfg, dataplane, events, reset, shutdown, |_, _| {}).await
}

/// Run endpoint learning on a thread of its own: the sources the slow path reports
/// ([`DataplaneEvent::Unlatched`]) go to [`manager::SessionManager::latch`], and every 100 ms the
/// legs whose learning window has ended lock their source
/// ([`manager::SessionManager::close_learning`]). Relayed RTCP ([`DataplaneEvent::Rtcp`]) goes
/// to [`manager::SessionManager::on_rtcp`]; the RIDs of a browser's simulcast layers
/// ([`DataplaneEvent::StreamId`]) to [`manager::SessionManager::on_stream_id`]; DTMF events'
/// ends ([`DataplaneEvent::Dtmf`]) to [`manager::SessionManager::on_dtmf`]. Ends when the data plane's sender is gone
/// (with no events at all, it runs for the life of the process).
pub fn learn_sources(manager: Arc<manager::SessionManager>, events: Option<Receiver<DataplaneEvent>>) -> std::io::Result<std::thread::JoinHandle<()>> {
    const TICK: std::time::Duration = std::time::Duration::from_millis(100);
    // Every 10 s: the RTCP evaluation of deleted relays is forgotten.
    const PRUNE_TICKS: u64 = 100;
    std::thread::Builder::new().name("mp-learning".into()).spawn(move || {
        let mut next_close = std::time::Instant::now() + TICK;
        let mut ticks = 0u64;
        loop {
            let wait = next_close.saturating_duration_since(std::time::Instant::now());
            let ev = match &events {
                Some(rx) => match rx.recv_timeout(wait) {
                    Ok(ev) => Some(ev),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                },
                None => {
                    std::thread::sleep(wait);
                    None
                }
            };
            match ev {
                Some(DataplaneEvent::Unlatched { stream, source }) => {
                    if let Err(e) = manager.latch(stream, source) {
                        tracing::warn!(stream, %source, error = %e, "following a source failed");
                    }
                }
                Some(DataplaneEvent::Rtcp { stream, source, at_ns, wall_us, packet }) => manager.on_rtcp(stream, source, at_ns, wall_us, &packet),
                Some(DataplaneEvent::Handshake { stream, local, source, at_ns, packet }) => manager.on_handshake(stream, local, source, at_ns, &packet),
                Some(DataplaneEvent::StreamId { transport, ssrc, mid, rid }) => manager.on_stream_id(transport, ssrc, mid.as_deref(), &rid),
                Some(DataplaneEvent::Dtmf { stream, source, payload_type, event, wall_us, .. }) => {
                    manager.on_dtmf(stream, source, payload_type, event, wall_us)
                }
                None => {}
            }
            if std::time::Instant::now() >= next_close {
                if let Err(e) = manager.close_learning() {
                    tracing::warn!(error = %e, "locking learnt sources failed");
                }
                manager.tick_crypto_legs(mediaplane_dataplane::monotonic_ns());
                manager.publish_heard_simulcast();
                next_close = std::time::Instant::now() + TICK;
                ticks += 1;
                if ticks.is_multiple_of(PRUNE_TICKS) {
                    manager.prune_quality();
                }
            }
        }
    })
}

/// [`serve`], handing the session manager and the metrics registry to `start` once sessions
/// are restored (e.g. to run the NG protocol listener beside the HTTP API).
pub async fn serve_with(
    cfg: Config,
    dataplane: Arc<dyn Dataplane>,
    events: Option<Receiver<DataplaneEvent>>,
    reset: bool,
    shutdown: impl Future<Output = ()> + Send + 'static,
    start: impl FnOnce(Arc<manager::SessionManager>, Arc<metrics::Metrics>),
) -> anyhow::Result<()> {
    let mut store = store::Store::from_config(&cfg.store).with_context(|| match &cfg.store.url {
        Some(url) => format!("opening store {url}"),
        None => format!("opening store {}", cfg.store.path.display()),
    })?;
    if reset {
        store.clear()?;
        tracing::warn!(store = %store.describe(), "store cleared (--reset)");
    }
    tracing::info!(store = %store.describe(), "store open");
    let manager =
        Arc::new(manager::SessionManager::open(store, dataplane.clone(), cfg.media.clone(), cfg.limits.clone()).context("restoring stored sessions")?);
    let (rooms, relays) = manager.read(|m, _| (m.rooms.len(), m.relays.len()));
    tracing::info!(rooms, relays, dataplane = dataplane.name(), "sessions restored");

    learn_sources(manager.clone(), events)?;

    let metrics = metrics::Metrics::new(manager.clone(), &cfg.metrics);
    let listener = tokio::net::TcpListener::bind(cfg.api.listen).await.with_context(|| format!("binding API on {}", cfg.api.listen))?;
    tracing::info!(listen = %listener.local_addr()?, "API listening");
    // The API is bound (connections queue from here) before the hook runs, so a hook that tells
    // a service manager "ready" tells the truth.
    start(manager.clone(), metrics.clone());
    let app = api::router(manager.clone(), &cfg.api, metrics);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await?;
    tracing::info!("shutting down data plane");
    dataplane.shutdown()?;
    tracing::info!("data plane stopped");
    Ok(())
}
