//! The `mediaplane demo` and `mediaplane bench` harness, out of the binary crate: real
//! conferences ([`conference`], [`demo`], [`bench_sfu`], [`bench_overload`]) and relayed calls
//! ([`bench_relay`]) in network namespaces around a `mediaplane serve` that the harness starts
//! from the running executable, and their reports ([`report`], [`relay_report`]).
//!
//! Module order is a DAG: `conference` (the shared conference run and `serve` process) ←
//! `report` ← {`demo`, `bench_sfu`, `bench_overload`}; `relay_results` (the relay run's result
//! types) ← {`bench_relay`, `relay_report`}; `bench_relay` → `relay_report`, never back.
//!
//! A separate crate from `mediaplane-bench`: that one is the measurement library the
//! integration tests of every crate depend on (testbed, traffic, QoS, process supervision);
//! this one is the binary's harness, with the NG client, the plots and the progress bars.

pub mod bench_overload;
pub mod bench_relay;
pub mod bench_rtsp;
pub mod bench_sfu;
pub mod conference;
pub mod demo;
pub mod relay_report;
pub mod relay_results;
pub mod report;
pub mod webrtc_demo;

pub use bench_sfu::{run as bench, BenchCommand};
pub use demo::{run as demo, DemoArgs};
