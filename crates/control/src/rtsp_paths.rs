//! What the API asks of the RTSP proxy (crate `mediaplane-rtsp`, which depends on this one):
//! its paths and their state. The proxy registers itself with the session manager when it
//! serves; without it, the API's RTSP routes answer 404.

use crate::config::RtspPath;

#[derive(Debug, thiserror::Error)]
pub enum RtspPathError {
    #[error("{0}")]
    Invalid(String),
    #[error("RTSP path {0:?} exists already")]
    Exists(String),
    #[error("no RTSP path {0:?}")]
    NotFound(String),
    #[error("{0}")]
    Failed(String),
}

/// The proxy's paths. `remove` blocks (it ends the path's sessions and deletes its room): call
/// it off the async runtime.
pub trait RtspPaths: Send + Sync {
    /// Every path's state, by name.
    fn list(&self) -> Vec<serde_json::Value>;
    fn get(&self, name: &str) -> Option<serde_json::Value>;
    /// Serve a new path (pulled at once, or on demand): its state.
    fn add(&self, path: RtspPath) -> Result<serde_json::Value, RtspPathError>;
    /// Stop serving a path: its upstream is released and its viewers' sessions end.
    fn remove(&self, name: &str) -> Result<(), RtspPathError>;
}
