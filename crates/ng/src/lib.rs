//! mediaplane's SIP media relay control surface: the NG protocol of rtpengine (bencoded
//! dictionaries over UDP) as spoken by Kamailio's `rtpengine` module.
//!
//! * [`bencode`] — the codec (strict, bounded, never panics);
//! * [`protocol`] — `<cookie> <dict>` framing, option spelling variants, the reply cache that
//!   answers retransmissions;
//! * [`sdp`] — SDP parsing and the relay rewrite (c=, o=, m= ports, a=rtcp, ICE removal, codec
//!   filtering, the loop-protection mark), all other bytes kept;
//! * [`codecs`] — which payload types the `codec-…` flags keep (no transcoding);
//! * [`calls`] — the call registry and what offer/answer/delete do to the model (one relay pair
//!   per media section for RTP, one for RTCP unless muxed);
//! * [`stats`] — rtpengine's reply key sets for `query`, `delete` and `statistics`;
//! * [`engine`] — command handling: datagram in, datagram out, against a `SessionManager`;
//! * [`serve_ng`] — the thin UDP driver and the media-timeout poller.
//!
//! Sans-I/O: everything but [`serve_ng`] is testable without sockets.

pub mod bencode;
pub mod call_control;
pub mod calls;
pub mod client;
pub mod codecs;
pub mod dtmf_log;
pub mod engine;
pub mod protocol;
pub mod recording;
pub mod sdes;
pub mod sdp;
pub mod stats;
pub mod subscribe;
pub mod webrtc;

pub use engine::{Engine, EngineConfig};

use mediaplane_control::manager::SessionManager;
use mediaplane_control::metrics::NgMetrics;
use parking_lot::Mutex;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// NG listener configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NgConfig {
    /// Where the NG socket listens (the caller binds it; see [`serve_ng`]).
    pub listen: SocketAddr,
    /// Calls whose media did not move for this long are deleted.
    pub media_timeout: Duration,
    /// Clients allowed to send commands; empty allows any (the protocol has no authentication:
    /// keep `listen` on loopback or a private network, or list the SIP proxies here).
    pub allow: Vec<IpAddr>,
    /// Where recorded calls go (see [`recording`]); None: nothing is recorded.
    pub recording_dir: Option<std::path::PathBuf>,
    /// The `loop-protect` mark (`a=rtpengine:<id>`); None: generated at start.
    pub instance_id: Option<String>,
    /// Where each DTMF event of a call is reported (see [`dtmf_log`]); None: not reported.
    pub dtmf_log_dest: Option<SocketAddr>,
    /// Where `start forwarding` sends calls' media; None: not configured.
    pub forward_to: Option<SocketAddr>,
}

impl Default for NgConfig {
    fn default() -> Self {
        NgConfig {
            listen: "127.0.0.1:2223".parse().unwrap(),
            media_timeout: Duration::from_secs(60),
            allow: Vec::new(),
            recording_dir: None,
            instance_id: None,
            dtmf_log_dest: None,
            forward_to: None,
        }
    }
}

/// Largest NG datagram.
const MAX_DATAGRAM: usize = 65_535;

/// Aborts a task when dropped (the poller dies with `serve_ng`'s future).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serve the NG protocol on `socket` until an I/O error (or until the future is dropped).
///
/// Requests are executed one at a time, in arrival order, on the blocking pool (a request
/// mutates the model, which persists to the store). Relays this crate created before a
/// restart are adopted so they still time out and can still be deleted. Requests and calls
/// are counted in `metrics` (the daemon's registry's: `Metrics::ng`).
pub async fn serve_ng(socket: tokio::net::UdpSocket, manager: Arc<SessionManager>, cfg: NgConfig, metrics: NgMetrics) -> anyhow::Result<()> {
    let mut engine_cfg =
        EngineConfig { media_timeout: cfg.media_timeout, report_dtmf: cfg.dtmf_log_dest.is_some(), forward_to: cfg.forward_to, ..Default::default() };
    if let Some(id) = cfg.instance_id.clone() {
        engine_cfg.instance_id = id;
    }
    let mut engine = Engine::with_metrics(engine_cfg, metrics);
    if let Some(dir) = &cfg.recording_dir {
        let r = recording::Recordings::start(dir).map_err(|e| anyhow::anyhow!("recording directory {}: {e}", dir.display()))?;
        tracing::info!(dir = %dir.display(), "calls asking for it are recorded");
        engine.record_with(r);
    }
    let engine = Arc::new(Mutex::new(engine));
    let adopted = engine.lock().adopt(&manager, Instant::now());
    if let Some(dest) = cfg.dtmf_log_dest {
        dtmf_log::start(dest, &manager, engine.clone())?;
        tracing::info!(%dest, "DTMF events are reported");
    }
    let local = socket.local_addr()?;
    if !local.ip().is_loopback() && cfg.allow.is_empty() {
        tracing::warn!(%local, "NG listens beyond loopback and accepts commands from anyone: set an allow list");
    }
    tracing::info!(%local, adopted, timeout_s = cfg.media_timeout.as_secs(), instance_id = %engine.lock().instance_id(), "NG listening");

    let _poller = {
        let (engine, manager) = (engine.clone(), manager.clone());
        AbortOnDrop(tokio::spawn(async move {
            // Every second (a quarter of a timeout under 4 s), as rtpengine sweeps: the data
            // planes report each stream's last packet time, so a call ends within one sweep of
            // `last packet + timeout`. A sweep reads the counters of NG calls' streams only.
            let every = (cfg.media_timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let (engine, manager) = (engine.clone(), manager.clone());
                let _ = tokio::task::spawn_blocking(move || engine.lock().expire(&manager, Instant::now())).await;
            }
        }))
    };

    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let (n, client) = socket.recv_from(&mut buf).await?;
        if !cfg.allow.is_empty() && !cfg.allow.contains(&client.ip()) {
            tracing::warn!(%client, "NG request from a client not in the allow list dropped");
            continue;
        }
        let datagram = buf[..n].to_vec();
        let (e, m) = (engine.clone(), manager.clone());
        let reply = match tokio::task::spawn_blocking(move || e.lock().handle_datagram(&m, client, &datagram, Instant::now())).await {
            Ok(reply) => reply,
            // A bug met by one request must not end the listener for every call.
            Err(err) => {
                tracing::error!(%client, error = %err, "NG request failed inside the engine; no reply");
                continue;
            }
        };
        if let Some(reply) = reply {
            if let Err(e) = socket.send_to(&reply, client).await {
                tracing::warn!(%client, error = %e, "NG reply not sent");
            }
        }
    }
}
