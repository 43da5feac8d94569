//! Model operations the SIP relay (NG protocol) needs beyond the basic ones in `model.rs`.

use crate::model::{Model, ModelError, Side};
use std::net::SocketAddr;

impl Model {
    /// Change what is signalled for one leg of a relay (a re-INVITE's new SDP): its peer
    /// address and strictness. A changed address forgets what was latched.
    pub fn set_leg_remote(&mut self, id: &str, side: Side, remote: Option<SocketAddr>, strict: bool) -> Result<(), ModelError> {
        let r = self.relays.get_mut(id).ok_or_else(|| ModelError::NotFound { kind: "relay", id: id.to_string() })?;
        let leg = match side {
            Side::A => &mut r.a,
            Side::B => &mut r.b,
        };
        if let Some(addr) = remote {
            if addr.is_ipv4() != leg.local.is_ipv4() {
                return Err(ModelError::FamilyMismatch(format!("relay {id}")));
            }
        }
        if leg.remote != remote {
            leg.latched = None;
        }
        leg.remote = remote;
        leg.strict = strict;
        Ok(())
    }
}
