//! mediaplane's kernel fast path: a TC ingress eBPF program (bpf/sfu_tc.bpf.c) that forwards
//! SFU fan-outs and SIP relay legs per [`mediaplane_core::ForwardingTable`], with the
//! user-space data plane as its slow path.
//!
//! * [`maps`]: the kernel map layouts mirrored in Rust and the table -> entries compiler;
//! * [`layers`]: simulcast consumers' renumbering in the kernel (bpf/layer_rewrite.h);
//! * [`install`]: the update protocol that makes table changes atomic per packet (sans-I/O);
//! * [`loader`]: [`FastPath`], the loaded program + maps (`BPF_PROG_TEST_RUN` for tests);
//! * [`prefilter`]: [`Prefilter`], the XDP pre-filter (bpf/prefilter_xdp.bpf.c) that drops
//!   certain strangers before TC, sharing the TC program's stream map;
//! * [`attach`]: tcx / clsact / XDP hooks, pinned for hitless restarts;
//! * [`mediaplane_dataplane::netlink`] (shared with every plane): resolves new subscribers' next
//!   hops when they are installed, and hears of route and neighbour changes;
//! * [`nhwatch`]: invalidates the kernel's next-hop cache on route/neighbour changes;
//! * [`path`]: the per-stream path state shared with the program (order acknowledgements);
//! * [`rpf`]: keeps the program's reverse-path modes equal to the interfaces' rp_filter;
//! * [`steer`]: sk_lookup steering of slow-path packets to a few catch-all sockets;
//! * [`pinlock`]: one live daemon per pin directory (a kill -9'd one's pins are still adopted);
//! * [`dataplane`]: [`EbpfDataplane`], the [`mediaplane_dataplane::Dataplane`] named "ebpf".

pub mod afxdp;
pub mod attach;
pub mod dataplane;
pub mod install;
pub mod layers;
pub mod loader;
pub mod maps;
pub mod nhwatch;
pub mod path;
pub mod pinlock;
pub mod prefilter;
pub mod rpf;
pub mod steer;

/// The libbpf-cargo skeleton: used for the C struct layouts (BTF) in tests and test_run.
#[allow(dead_code, clippy::all, non_camel_case_types, non_snake_case, unused_imports)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/sfu_tc.skel.rs"));
}

pub use afxdp::{AfxdpConfig, AfxdpDataplane};
pub use attach::AttachMode;
pub use dataplane::{mount_bpffs_if_missing, remove_pins, EbpfConfig, EbpfDataplane, XdpPrefilter};
pub use install::ApplyReport;
pub use loader::{FastPath, KernelStats, LoadOptions, TestRun, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT};
pub use pinlock::{PinDirLock, PinLockError};
pub use prefilter::{Prefilter, XDP_DROP, XDP_PASS};
