//! Keeps the kernel's next-hop cache honest: the shared rtnetlink watcher
//! ([`mediaplane_dataplane::netlink::RouteWatch`]) bumps the cache generation (`nh_gen`) on
//! every change it hears of, so the program resolves next hops again with `bpf_fib_lookup`
//! instead of using a cached MAC or interface that may no longer be right. The cache entries also
//! expire on their own (NH_CACHE_TTL_NS), which bounds staleness when nobody listens (after
//! `kill -9`, or if netlink messages were lost).

use libbpf_rs::{MapCore, MapFlags, MapHandle};
use mediaplane_dataplane::netlink::{Refresh, RouteWatch};
use mediaplane_dataplane::DataplaneError;

/// Bump the generation in `nh_gen[0]` (wrapping).
pub fn bump(gen_map: &MapHandle) -> Result<u32, DataplaneError> {
    let key = 0u32.to_ne_bytes();
    let cur = gen_map
        .lookup(&key, MapFlags::ANY)
        .map_err(|e| DataplaneError::Other(format!("reading nh_gen: {e}")))?
        .map(|v| u32::from_ne_bytes(v[..4].try_into().unwrap()))
        .unwrap_or(0);
    let next = cur.wrapping_add(1);
    gen_map.update(&key, &next.to_ne_bytes(), MapFlags::ANY).map_err(|e| DataplaneError::Other(format!("writing nh_gen: {e}")))?;
    Ok(next)
}

/// The watcher bumping `nh_gen`; stops on drop (held for that alone).
pub struct NextHopWatch {
    _watch: RouteWatch,
}

impl NextHopWatch {
    /// Start listening in the calling thread's network namespace.
    pub fn start(gen_map: MapHandle, refresh: Option<Refresh>) -> Result<NextHopWatch, DataplaneError> {
        // A change may have happened between the program's first lookups and now.
        bump(&gen_map)?;
        let on_change = Box::new(move || {
            if let Err(e) = bump(&gen_map) {
                tracing::warn!("next-hop cache invalidation failed: {e}");
            }
        });
        Ok(NextHopWatch { _watch: RouteWatch::start(on_change, refresh)? })
    }
}
