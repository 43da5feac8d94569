//! The AF_XDP plane's fragment path (what the host stack does for the socket plane): arbitrary
//! frames through `parse_fragment`, the reassembler and `whole_datagram`. Never panics; what it
//! holds stays within its budget; a datagram it completes is exactly as long as its last
//! fragment said.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mediaplane_dataplane::reassembly::{parse_fragment, whole_datagram, Reassembler, MAX_PENDING_BYTES};

fuzz_target!(|data: &[u8]| {
    let mut r = Reassembler::default();
    // Frames are length-prefixed (one byte) in the input; the clock moves 1 s per frame.
    let mut rest = data;
    let mut now = 0u64;
    while let Some((&len, tail)) = rest.split_first() {
        let (frame, tail) = tail.split_at((len as usize).min(tail.len()));
        rest = tail;
        now += 1_000_000_000;
        let Some(frag) = parse_fragment(frame) else { continue };
        let end = frag.offset + frag.data.len();
        if let Some(whole) = r.offer(frag.key, frag.offset, frag.more, frag.data, now) {
            // Complete: as long as its last fragment said, which this one is unless more follow.
            assert!(if frag.more { whole.len() >= end } else { whole.len() == end });
            let _ = whole_datagram(frag.key, &whole);
        }
        assert!(r.held() <= MAX_PENDING_BYTES);
    }
});
