//! The recording tap: a process-wide, bounded hand-off of the packets of recorded streams
//! ([`mediaplane_core::StreamEntry::record`]) from the forwarding threads to whoever writes them
//! (the NG relay's recorder, which keeps one pcap per call).
//!
//! Process-wide because a daemon has one data plane and one recorder, and because the kernel
//! plane's slow path is a user-space plane of its own: both reach the same tap without plumbing.
//! Forwarding never waits on it: when nobody listens, nothing is copied; when the queue is full,
//! the packet is forwarded but not recorded, and counted ([`not_recorded`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Mutex, PoisonError};
use std::time::SystemTime;

/// One packet of a recorded stream, as it arrived (`src` → the stream's local address `dst`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedPacket {
    pub at: SystemTime,
    pub stream: u32,
    /// The stream's label (`relay:<relay id>/<side>`): says whose packet it is.
    pub label: String,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub payload: Vec<u8>,
}

static LISTENING: AtomicBool = AtomicBool::new(false);
static TAP: Mutex<Option<SyncSender<RecordedPacket>>> = Mutex::new(None);
static NOT_RECORDED: AtomicU64 = AtomicU64::new(0);

/// Start listening: packets of recorded streams arrive on the returned receiver (at most
/// `capacity` waiting). Replaces an earlier listener, whose receiver then sees the end.
pub fn listen(capacity: usize) -> Receiver<RecordedPacket> {
    let (tx, rx) = sync_channel(capacity);
    *TAP.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
    LISTENING.store(true, Ordering::Release);
    rx
}

/// Stop listening (the receiver sees the end once it has drained what was queued).
pub fn stop() {
    LISTENING.store(false, Ordering::Release);
    TAP.lock().unwrap_or_else(PoisonError::into_inner).take();
}

/// Hand a forwarded packet of a recorded stream to the listener, if there is one. Called by the
/// data planes; never blocks.
pub fn tap(stream: u32, label: &str, src: SocketAddr, dst: SocketAddr, payload: &[u8]) {
    if !LISTENING.load(Ordering::Acquire) {
        return;
    }
    let guard = TAP.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(tx) = guard.as_ref() else { return };
    let p = RecordedPacket { at: SystemTime::now(), stream, label: label.to_string(), src, dst, payload: payload.to_vec() };
    match tx.try_send(p) {
        Ok(()) => {}
        Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
            NOT_RECORDED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Packets of recorded streams that were forwarded but not recorded (the writer fell behind).
pub fn not_recorded() -> u64 {
    NOT_RECORDED.load(Ordering::Relaxed)
}
