//! The per-stream path state the fast path shares with user space (`stream_path`, bpf/maps.h),
//! mapped into this process: the slow path acknowledges, without a syscall, each packet the
//! kernel handed up in stream order (bpf/order.h), so the kernel knows when the slow path has sent
//! the last packet of a stream it handed up and may forward the stream itself again.

use crate::maps::{StreamPathRaw, ORDER_MARK, ORDER_SEQ_MASK, ORDER_SLOT_BITS};
use libbpf_rs::MapCore;
use mediaplane_dataplane::DataplaneError;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// `stream_path`, mmapped (the map is created with BPF_F_MMAPABLE). The mapping keeps the map
/// alive on its own, so this outlives the object that created it.
pub struct StreamPaths {
    base: *mut u8,
    len: usize,
    entries: u32,
}

// SAFETY: the mapping is shared memory accessed only through atomics (and by the kernel).
unsafe impl Send for StreamPaths {}
unsafe impl Sync for StreamPaths {}

impl std::fmt::Debug for StreamPaths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamPaths").field("entries", &self.entries).finish()
    }
}

const STRIDE: usize = std::mem::size_of::<StreamPathRaw>();
const DONE: usize = std::mem::offset_of!(StreamPathRaw, done);
const UP: usize = std::mem::offset_of!(StreamPathRaw, up);

impl StreamPaths {
    pub fn map(map: &libbpf_rs::Map<'_>) -> Result<StreamPaths, DataplaneError> {
        assert_eq!(map.value_size() as usize, STRIDE, "stream_path layout");
        assert_eq!(STRIDE % 8, 0, "array elements are 8-byte aligned");
        let entries = map.max_entries();
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let len = (STRIDE * entries as usize).div_ceil(page) * page;
        // SAFETY: a shared read-write mapping of an mmapable array map's fd; checked below.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, map.as_fd().as_raw_fd(), 0) };
        if base == libc::MAP_FAILED {
            return Err(DataplaneError::Io { context: "mapping stream_path".into(), source: std::io::Error::last_os_error() });
        }
        Ok(StreamPaths { base: base.cast(), len, entries })
    }

    fn word(&self, slot: u32, offset: usize) -> Option<&AtomicU64> {
        if slot >= self.entries {
            return None;
        }
        // SAFETY: in bounds (slot < entries), 8-byte aligned (page-aligned base, STRIDE and the
        // offset multiples of 8); the memory lives as long as self.
        Some(unsafe { &*(self.base.add(slot as usize * STRIDE + offset) as *const AtomicU64) })
    }

    /// The slow path has sent the copies of a packet the kernel marked `mark` (see
    /// [`crate::maps::ORDER_MARK`]): its sequence number becomes the stream's last one sent (a
    /// stream is served first in, first out, so this covers every earlier one). Marks without
    /// the order bit are not ours: ignored.
    pub fn ack_mark(&self, mark: u32) {
        if mark & ORDER_MARK != 0 {
            let slot = mark & ((1 << ORDER_SLOT_BITS) - 1);
            if let Some(done) = self.word(slot, DONE) {
                done.store(((mark >> ORDER_SLOT_BITS) & ORDER_SEQ_MASK) as u64, Ordering::Release);
            }
        }
    }

    /// (sequence number of the last packet handed up in order, of the last one acknowledged)
    /// of a stats slot, both as the marks carry them (ORDER_SEQ_MASK bits).
    pub fn order_seqs(&self, slot: u32) -> Option<(u32, u32)> {
        let seq = |w: &AtomicU64| (w.load(Ordering::Acquire) as u32) & ORDER_SEQ_MASK;
        Some((seq(self.word(slot, UP)?), seq(self.word(slot, DONE)?)))
    }
}

impl Drop for StreamPaths {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
