//! The API's JSON inputs as the daemon deserialises them (model specs, tables): arbitrary bytes
//! must be rejected with an error, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_core::model::{LegSpec, StreamSpec};
use mediaplane_core::table::ForwardingTable;
use mediaplane_core::Model;

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<StreamSpec>(data);
    let _ = serde_json::from_slice::<LegSpec>(data);
    let _ = serde_json::from_slice::<ForwardingTable>(data);
    if let Ok(mut m) = serde_json::from_slice::<Model>(data) {
        // A stored model that deserialises must either reindex cleanly or say why.
        let _ = m.reindex();
        let _ = ForwardingTable::compile(&m, 1);
    }
});
