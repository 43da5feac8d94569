//! The kernel's simulcast consumers, as the user-space plane sees them when it is the eBPF
//! plane's slow path. The kernel renumbers every copy of a layer packet on its own per-consumer
//! state; this plane keeps the judgement (the layer each consumer should get, keyframe requests,
//! what publishers send) and reaches the states only through [`KernelLayers`], so the kernel's
//! rules, applied one packet at a time, stay the only ones that change them.

use mediaplane_core::simulcast::{Codec, RewriterState};
use mediaplane_core::StreamEntry;
use std::sync::Arc;

/// How often the plane updates the kernel's targets, reads what the kernel received of each
/// layer and asks for the keyframes consumers wait for.
pub const TICK_NS: u64 = 20_000_000;
/// Every this many ticks, states of consumers the installed table no longer has are deleted
/// (one removed while a tick was running, or left in the pinned map by an earlier process).
pub const RECONCILE_TICKS: u64 = 50;

/// The kernel's per-consumer simulcast states (implemented by the eBPF plane).
pub trait KernelLayers: Send + Sync {
    /// Give `consumer` a state (no target yet) unless it has one.
    fn create(&self, consumer: u32, ssrc: u32, clock_rate: u32);
    fn remove(&self, consumer: u32);
    /// Whether the kernel makes `entry`'s copies itself. A consumer no such stream copies to is
    /// decided by the slow path alone, on a state of its own: no syscall per copy.
    fn judges(&self, entry: &StreamEntry) -> bool;
    /// Make `state` `consumer`'s in the kernel (created or replaced): the hand-over when a
    /// stream of a consumer the slow path decided alone comes to the kernel. False: not done.
    fn load(&self, consumer: u32, ssrc: u32, clock_rate: u32, state: &RewriterState) -> bool;
    /// Want `target` (None: pause) from its next keyframe on, and temporal layers up to
    /// `temporal` (None: all). False: not done (no state).
    fn set_target(&self, consumer: u32, target: Option<u8>, temporal: Option<u8>) -> bool;
    /// The consumers that have a state.
    fn consumers(&self) -> Vec<u32>;
    /// Decide a packet the slow path forwards: Some(the copy's bytes) when it goes to `consumer`.
    fn decide(&self, consumer: u32, layer: u8, codec: Codec, now_ns: u64, packet: &[u8]) -> Option<Vec<u8>>;
    /// `consumer`'s state, read under its lock.
    fn state(&self, consumer: u32) -> Option<RewriterState>;
    /// What the kernel received of stream `id`.
    fn received(&self, id: u32) -> Option<KernelReceived>;
}

/// What the kernel received of a simulcast layer's stream, counted since it was installed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelReceived {
    pub packets: u64,
    /// Payload bytes.
    pub bytes: u64,
    /// The last arrival, on the monotonic clock.
    pub last_ns: u64,
    /// Keyframe starts it forwarded.
    pub keyframes: u64,
}

/// See [`crate::userspace::UserspaceConfig::kernel_layers`].
#[derive(Clone)]
pub struct KernelLayersHandle(pub Arc<dyn KernelLayers>);

impl std::fmt::Debug for KernelLayersHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KernelLayers")
    }
}
