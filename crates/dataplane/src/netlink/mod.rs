//! The host's routing view for every plane that caches next hops or builds its own frames: a
//! watcher of rtnetlink changes ([`RouteWatch`]) and a resolver that has a destination's
//! neighbour resolved before its first packet needs it ([`neigh::NeighbourResolver`]).

pub mod neigh;
mod watch;

pub use neigh::{NeighbourResolver, NextHop, NextHopLookup};
pub use watch::{OnChange, Refresh, RouteWatch};
