//! The control plane: `mediaplane serve`. It owns the session model (through the
//! [`manager::SessionManager`]), persists it in the embedded [`store`], installs compiled tables
//! in whichever data plane it was given, and answers the HTTP/JSON [`api`].

pub mod api;
pub mod config;
pub mod manager;
pub mod metrics;
pub mod store;

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
    let mut store = store::Store::open(&cfg.store.path).with_context(|| format!("opening store {}", cfg.store.path.display()))?;
    if reset {
        store.clear()?;
        tracing::warn!(path = %cfg.store.path.display(), "store cleared (--reset)");
    }
    let manager =
        Arc::new(manager::SessionManager::open(store, dataplane.clone(), cfg.media.clone(), cfg.limits.clone()).context("restoring stored sessions")?);
    let (rooms, relays) = manager.read(|m, _| (m.rooms.len(), m.relays.len()));
    tracing::info!(rooms, relays, dataplane = dataplane.name(), "sessions restored");

    if let Some(events) = events {
        let m = manager.clone();
        std::thread::Builder::new().name("mp-slowpath".into()).spawn(move || {
            for ev in events {
                match ev {
                    DataplaneEvent::Unlatched { stream, source } => {
                        if let Err(e) = m.latch(stream, source) {
                            tracing::warn!(stream, %source, error = %e, "latch failed");
                        }
                    }
                }
            }
        })?;
    }

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
    Ok(())
}
