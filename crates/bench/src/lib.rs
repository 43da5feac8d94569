//! mediaplane bench: the measurement library.
//!
//! * [`netns`]: a star testbed in network namespaces (one SFU namespace, n participants, a
//!   kernel-routed *direct path* between participants as the added-delay baseline);
//! * [`traffic`]: a paced generator and epoll receivers with kernel timestamps, presets
//!   `thesis`, `voice`, `video`, and a per-copy report;
//! * [`qos`]: the metrics of DESIGN.md "Measurement definitions" as pure functions (RFC 3550
//!   jitter, RFC 4689 delay variation, loss/duplicates/reordering, summaries, G.107 E-model);
//! * [`added_delay`]: through-SFU delay minus direct-path delay, per copy;
//! * [`sip`]: Kamailio and SIPp for the interop tests (finding them, Kamailio's configuration,
//!   starting them, waiting until they listen).

pub mod added_delay;
pub mod browser;
pub mod flood;
pub mod netns;
pub mod process;
pub mod qos;
pub mod redis;
pub mod sip;
pub mod traffic;

pub use added_delay::{added_delay, AddedDelay, AddedDelayMethod};
pub use netns::{Peer, Testbed};
pub use qos::{EModel, Summary};
pub use traffic::{run, Preset, Profile, TrafficPlan, TrafficReport};

/// True when running under CI: `CI` set to anything but empty, `0`, `false` or `no` (CI systems
/// spell it `true`, `1` or `yes`). Under CI a test that cannot run fails instead of skipping.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false" | "no"))
}

/// Guard for privileged tests: true when running as root. Without root, panics when `CI=true`
/// (CI runs as root, so a privileged test must never silently skip there), otherwise prints
/// "skipped: needs root" and returns false.
pub fn require_root(test: &str) -> bool {
    if is_root() {
        return true;
    }
    if in_ci() {
        panic!("{test}: needs root, and CI=true: privileged tests must run in CI");
    }
    eprintln!("{test}: skipped: needs root");
    false
}

/// True when this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// For the commands that build namespaces (`demo`, `bench`): an error saying so unless root.
pub fn ensure_root(what: &str) -> anyhow::Result<()> {
    if is_root() {
        Ok(())
    } else {
        anyhow::bail!("{what} builds network namespaces and needs root")
    }
}
