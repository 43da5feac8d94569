//! Installing tables into the kernel maps without a window of inconsistency (sans-I/O: the maps
//! are behind [`KernelMaps`], so the protocol is unit-tested without root).
//!
//! The protocol, per apply:
//! 1. a stream whose fan-out changed gets its new copies written to a *fresh* range of the
//!    `copies` array (a range in use is never written);
//! 2. stream entries are replaced whole (the hash map has no prealloc: a program that looked up
//!    the old value keeps a stable copy until it is done), SSRC entries before the wildcard
//!    entry of their local, so the "narrowed" flag never points at entries not yet there;
//! 3. removed entries are deleted, SSRC entries first;
//! 4. an RCU barrier (see [`KernelMaps::rcu_barrier`]) waits until no program run can still hold
//!    an old value, and only then are old ranges and stats slots freed for reuse.
//!
//! So each packet sees the old or the new stream entry and that entry's own, complete fan-out:
//! no duplicate, no copy to a removed subscriber.
//!
//! The wildcard entry of a local address depends on every stream there (`NARROWED`, and
//! `ONE_SOURCE` with the source they all share, read by the XDP pre-filter): an apply compiles
//! all entries of every local address it touches, so a change to any stream there rewrites the
//! wildcard (or placeholder) too, after the SSRC entries.

use crate::maps::{kernel_entries, CopyRaw, KernelStream, KeyRaw, RateRaw, StreamValueRaw};
use mediaplane_core::{ForwardingTable, IngressKey};
use mediaplane_dataplane::DataplaneError;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

/// The kernel side of an installation.
pub trait KernelMaps {
    fn write_copies(&mut self, base: u32, copies: &[CopyRaw]) -> Result<(), DataplaneError>;
    fn write_stream(&mut self, key: &KeyRaw, value: &StreamValueRaw) -> Result<(), DataplaneError>;
    fn delete_stream(&mut self, key: &KeyRaw) -> Result<(), DataplaneError>;
    fn zero_stats(&mut self, slot: u32) -> Result<(), DataplaneError>;
    /// Install a stream's rate limit (and reset its bucket) in `stream_rate[slot]`.
    fn write_rate(&mut self, slot: u32, rate: &RateRaw) -> Result<(), DataplaneError>;
    /// Return only once no program run that started before the call is still running.
    fn rcu_barrier(&mut self) -> Result<(), DataplaneError>;
}

/// First-fit allocator of ranges in the `copies` array.
#[derive(Debug, Clone)]
pub struct RangeAllocator {
    /// start -> length of free ranges, coalesced.
    free: BTreeMap<u32, u32>,
    capacity: u32,
}

impl RangeAllocator {
    pub fn new(capacity: u32) -> Self {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        RangeAllocator { free, capacity }
    }

    pub fn alloc(&mut self, len: u32) -> Option<u32> {
        let (&start, &flen) = self.free.iter().find(|(_, &l)| l >= len)?;
        self.free.remove(&start);
        if flen > len {
            self.free.insert(start + len, flen - len);
        }
        Some(start)
    }

    pub fn free(&mut self, start: u32, len: u32) {
        if len == 0 {
            return;
        }
        let (mut start, mut len) = (start, len);
        if let Some((&ps, &pl)) = self.free.range(..start).next_back() {
            if ps + pl == start {
                self.free.remove(&ps);
                start = ps;
                len += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += nl;
        }
        self.free.insert(start, len);
    }

    /// Mark a range as used (when adopting state already in the kernel).
    pub fn reserve(&mut self, start: u32, len: u32) -> bool {
        if len == 0 {
            return true;
        }
        let Some((&fs, &fl)) = self.free.range(..=start).next_back() else { return false };
        if fs + fl < start + len {
            return false;
        }
        self.free.remove(&fs);
        if start > fs {
            self.free.insert(fs, start - fs);
        }
        if fs + fl > start + len {
            self.free.insert(start + len, fs + fl - start - len);
        }
        true
    }

    pub fn free_total(&self) -> u32 {
        self.free.values().sum()
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }
}

#[derive(Debug, Clone)]
struct Installed {
    stream: KernelStream,
    value: StreamValueRaw,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyReport {
    pub streams_written: usize,
    pub streams_deleted: usize,
    pub copies_written: usize,
    pub barrier: bool,
}

/// The user-space mirror of what is installed, plus the allocators.
#[derive(Debug)]
pub struct Installer {
    ranges: RangeAllocator,
    stats_capacity: u32,
    free_slots: Vec<u32>,
    next_slot: u32,
    /// stream id -> (stats slot, number of entries using it)
    slots: HashMap<u32, (u32, u32)>,
    installed: BTreeMap<KeyRaw, Installed>,
    prev: Option<Arc<ForwardingTable>>,
}

impl Installer {
    pub fn new(copies_capacity: u32, stats_capacity: u32) -> Self {
        Installer {
            ranges: RangeAllocator::new(copies_capacity),
            stats_capacity,
            free_slots: Vec::new(),
            next_slot: 0,
            slots: HashMap::new(),
            installed: BTreeMap::new(),
            prev: None,
        }
    }

    /// Rebuild the mirror from entries read back from (pinned) kernel maps. The first apply
    /// afterwards compares every entry and rewrites only what differs.
    pub fn adopt(
        copies_capacity: u32,
        stats_capacity: u32,
        existing: Vec<(KeyRaw, StreamValueRaw, Vec<CopyRaw>)>,
    ) -> Result<Self, DataplaneError> {
        let mut me = Installer::new(copies_capacity, stats_capacity);
        let mut used_slots = BTreeSet::new();
        for (key, value, copies) in existing {
            if !me.ranges.reserve(value.copies_base, value.copies_count) {
                return Err(DataplaneError::Other(format!(
                    "pinned state is inconsistent (fan-out range {}+{} of {:?} overlaps); restart with reset",
                    value.copies_base,
                    value.copies_count,
                    key.local()
                )));
            }
            let placeholder = value.flags & crate::maps::flags::PRESENT == 0;
            let latch = value.flags & crate::maps::flags::LATCH != 0;
            // A placeholder carries a source only with ONE_SOURCE (the address's one source).
            let one_source = value.flags & crate::maps::flags::ONE_SOURCE != 0;
            let source = (!latch && (!placeholder || one_source))
                .then(|| SocketAddr::new(KeyRaw { addr: value.src_addr, ..key }.local().ip(), u16::from_be_bytes(value.src_port)));
            if !placeholder {
                let e = me.slots.entry(value.id).or_insert((value.stats_slot, 0));
                e.1 += 1;
                used_slots.insert(e.0);
            }
            let stream = KernelStream { id: value.id, flags: value.flags, source, copies, rate: None };
            me.installed.insert(key, Installed { stream, value });
        }
        me.next_slot = used_slots.last().map_or(0, |s| s + 1);
        me.free_slots = (0..me.next_slot).filter(|s| !used_slots.contains(s)).rev().collect();
        Ok(me)
    }

    pub fn table(&self) -> Option<&Arc<ForwardingTable>> {
        self.prev.as_ref()
    }

    /// (stream id, stats slot) of every installed stream.
    pub fn stats_slots(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.slots.iter().map(|(id, (slot, _))| (*id, *slot))
    }

    /// The stats slot of an installed stream.
    pub fn stats_slot(&self, id: u32) -> Option<u32> {
        self.slots.get(&id).map(|(slot, _)| *slot)
    }

    pub fn installed_keys(&self) -> impl Iterator<Item = &KeyRaw> {
        self.installed.keys()
    }

    pub fn free_copy_slots(&self) -> u32 {
        self.ranges.free_total()
    }

    fn acquire_slot(&mut self, id: u32, fresh: &mut Vec<u32>) -> Result<u32, DataplaneError> {
        if let Some(e) = self.slots.get_mut(&id) {
            e.1 += 1;
            return Ok(e.0);
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None if self.next_slot < self.stats_capacity => {
                self.next_slot += 1;
                self.next_slot - 1
            }
            None => {
                return Err(DataplaneError::Full(format!(
                    "kernel stats map full ({} streams; raise dataplane.max_streams)",
                    self.stats_capacity
                )))
            }
        };
        self.slots.insert(id, (slot, 1));
        fresh.push(slot);
        Ok(slot)
    }

    fn release_slot(&mut self, id: u32) {
        if let Some(e) = self.slots.get_mut(&id) {
            e.1 -= 1;
            if e.1 == 0 {
                self.free_slots.push(e.0);
                self.slots.remove(&id);
            }
        }
    }

    /// Install `table`, touching only the entries that differ from what is installed.
    pub fn apply(&mut self, table: Arc<ForwardingTable>, maps: &mut impl KernelMaps) -> Result<ApplyReport, DataplaneError> {
        self.apply_changes(table, None, maps)
    }

    /// [`Installer::apply`] for a table that differs from the last one installed only at
    /// `changed` (None: find out by comparing the tables). Only the addresses of those keys are
    /// looked at, so the cost is what changed, not the table size.
    pub fn apply_changes(
        &mut self,
        table: Arc<ForwardingTable>,
        changed: Option<&[IngressKey]>,
        maps: &mut impl KernelMaps,
    ) -> Result<ApplyReport, DataplaneError> {
        // With a previous table, only locals that changed are compared; otherwise all.
        let locals: Option<BTreeSet<SocketAddr>> = self.prev.as_ref().map(|prev| match changed {
            Some(keys) => keys.iter().map(|k| k.local).collect(),
            None => {
                let d = table.diff(prev);
                d.upserts.iter().map(|e| e.key.local).chain(d.removals.iter().map(|k| k.local)).collect()
            }
        });
        if locals.as_ref().is_some_and(|l| l.is_empty()) {
            self.prev = Some(table);
            return Ok(ApplyReport::default());
        }
        let desired = kernel_entries(&table, locals.as_ref());
        // Invalidate the diff base until this apply fully succeeds.
        self.prev = None;
        let mut report = ApplyReport::default();

        // Plan: assign ranges and slots; nothing is written until everything fits.
        struct Write {
            key: KeyRaw,
            stream: KernelStream,
            value: StreamValueRaw,
            new_range: bool,
        }
        let mut writes = Vec::new();
        let mut fresh_slots = Vec::new();
        let mut retire_ranges: Vec<(u32, u32)> = Vec::new();
        let mut retire_slots: Vec<u32> = Vec::new();
        let mut failure = None;
        for (key, d) in &desired {
            let cur = self.installed.get(key);
            if cur.is_some_and(|c| c.stream == *d) {
                continue;
            }
            let reuse = cur.filter(|c| c.stream.copies == d.copies);
            let (base, new_range) = match reuse {
                Some(c) => (c.value.copies_base, false),
                None if d.copies.is_empty() => (0, false),
                None => match self.ranges.alloc(d.copies.len() as u32) {
                    Some(b) => (b, true),
                    None => {
                        failure = Some(DataplaneError::Full(format!(
                            "kernel fan-out map full: {} copies needed for {:?}, {} free of {} (raise dataplane.max_copies)",
                            d.copies.len(),
                            key.local(),
                            self.ranges.free_total(),
                            self.ranges.capacity()
                        )));
                        break;
                    }
                },
            };
            if let Some(c) = cur {
                if reuse.is_none() {
                    retire_ranges.push((c.value.copies_base, c.value.copies_count));
                }
                if !c.stream.is_placeholder() {
                    retire_slots.push(c.stream.id);
                }
            }
            let slot = if d.is_placeholder() {
                0
            } else {
                match self.acquire_slot(d.id, &mut fresh_slots) {
                    Ok(s) => s,
                    Err(e) => {
                        if new_range {
                            self.ranges.free(base, d.copies.len() as u32);
                        }
                        failure = Some(e);
                        break;
                    }
                }
            };
            writes.push(Write { key: *key, value: d.value(slot, base), stream: d.clone(), new_range });
        }
        if let Some(e) = failure {
            // Undo the plan: nothing was written.
            for w in &writes {
                if w.new_range {
                    self.ranges.free(w.value.copies_base, w.value.copies_count);
                }
                if !w.stream.is_placeholder() {
                    self.release_slot(w.stream.id);
                }
            }
            return Err(e);
        }
        let deletes: Vec<KeyRaw> = match &locals {
            Some(ls) => ls
                .iter()
                .flat_map(|l| self.installed.range(KeyRaw::new(*l, None)..=KeyRaw::new(*l, Some(u32::MAX))))
                .map(|(k, _)| *k)
                .filter(|k| !desired.contains_key(k))
                .collect(),
            None => self.installed.keys().filter(|k| !desired.contains_key(k)).copied().collect(),
        };

        // 1. fresh fan-out ranges and zeroed counters.
        for w in writes.iter().filter(|w| w.new_range) {
            maps.write_copies(w.value.copies_base, &w.stream.copies)?;
            report.copies_written += w.stream.copies.len();
        }
        for slot in &fresh_slots {
            maps.zero_stats(*slot)?;
        }
        // Rate limits before the entries that enable them.
        for w in writes.iter() {
            if let Some(r) = &w.stream.rate {
                maps.write_rate(w.value.stats_slot, &RateRaw::new(r))?;
            }
        }
        // 2. flip entries: SSRC entries before wildcard ones.
        writes.sort_by_key(|w| (w.key.is_wildcard(), w.key));
        for w in writes {
            maps.write_stream(&w.key, &w.value)?;
            self.installed.insert(w.key, Installed { stream: w.stream, value: w.value });
            report.streams_written += 1;
        }
        // 3. deletions, SSRC entries first.
        let mut deletes = deletes;
        deletes.sort_by_key(|k| (k.is_wildcard(), *k));
        for key in deletes {
            maps.delete_stream(&key)?;
            if let Some(old) = self.installed.remove(&key) {
                retire_ranges.push((old.value.copies_base, old.value.copies_count));
                if !old.stream.is_placeholder() {
                    retire_slots.push(old.stream.id);
                }
            }
            report.streams_deleted += 1;
        }
        // 4. free what old entries used, once no program can still be reading them.
        retire_ranges.retain(|r| r.1 > 0);
        let slot_freed = retire_slots.iter().any(|id| self.slots.get(id).is_some_and(|e| e.1 == 1));
        if !retire_ranges.is_empty() || slot_freed {
            maps.rcu_barrier()?;
            report.barrier = true;
        }
        for (b, l) in retire_ranges {
            self.ranges.free(b, l);
        }
        for id in retire_slots {
            self.release_slot(id);
        }
        self.prev = Some(table);
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::flags;
    use mediaplane_core::model::{Model, StreamRef, StreamSpec};
    use mediaplane_core::SourceRule;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// A kernel that checks the protocol: a copy range is never written while a stream entry
    /// refers to it or while a replaced entry may still be read (no barrier since).
    #[derive(Default)]
    struct FakeKernel {
        streams: BTreeMap<KeyRaw, StreamValueRaw>,
        copies: BTreeMap<u32, CopyRaw>,
        /// Ranges referenced by values replaced or deleted since the last barrier.
        retired: Vec<(u32, u32)>,
        barriers: usize,
    }

    fn overlaps(a: (u32, u32), b: (u32, u32)) -> bool {
        a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
    }

    /// An installer adopting everything in the fake kernel's maps, as a restarted daemon does.
    fn adopt_all(k: &FakeKernel) -> Installer {
        let existing = k
            .streams
            .iter()
            .map(|(key, v)| (*key, *v, (0..v.copies_count).map(|i| k.copies[&(v.copies_base + i)]).collect()))
            .collect();
        Installer::adopt(64, 16, existing).unwrap()
    }

    impl KernelMaps for FakeKernel {
        fn write_copies(&mut self, base: u32, copies: &[CopyRaw]) -> Result<(), DataplaneError> {
            let r = (base, copies.len() as u32);
            for v in self.streams.values() {
                assert!(!overlaps(r, (v.copies_base, v.copies_count)), "wrote a range in use");
            }
            for old in &self.retired {
                assert!(!overlaps(r, *old), "reused a range before the RCU barrier");
            }
            for (i, c) in copies.iter().enumerate() {
                self.copies.insert(base + i as u32, *c);
            }
            Ok(())
        }
        fn write_stream(&mut self, key: &KeyRaw, value: &StreamValueRaw) -> Result<(), DataplaneError> {
            // The new value's copies must already be complete.
            for i in 0..value.copies_count {
                assert_eq!(self.copies[&(value.copies_base + i)].stream_id, value.id);
            }
            if let Some(old) = self.streams.insert(*key, *value) {
                self.retired.push((old.copies_base, old.copies_count));
            }
            Ok(())
        }
        fn delete_stream(&mut self, key: &KeyRaw) -> Result<(), DataplaneError> {
            let old = self.streams.remove(key).expect("deleting a missing entry");
            self.retired.push((old.copies_base, old.copies_count));
            Ok(())
        }
        fn zero_stats(&mut self, _slot: u32) -> Result<(), DataplaneError> {
            Ok(())
        }
        fn write_rate(&mut self, _slot: u32, _rate: &RateRaw) -> Result<(), DataplaneError> {
            Ok(())
        }
        fn rcu_barrier(&mut self) -> Result<(), DataplaneError> {
            self.retired.clear();
            self.barriers += 1;
            Ok(())
        }
    }

    /// (id, flags, source address, source port, copies) of an entry.
    type Entry = (u32, u32, [u8; 16], [u8; 2], Vec<CopyRaw>);

    impl FakeKernel {
        /// What the kernel says, in the compiler's terms.
        fn as_entries(&self) -> BTreeMap<KeyRaw, Entry> {
            self.streams
                .iter()
                .map(|(k, v)| {
                    let copies = (0..v.copies_count).map(|i| self.copies[&(v.copies_base + i)]).collect();
                    (*k, (v.id, v.flags, v.src_addr, v.src_port, copies))
                })
                .collect()
        }
    }

    fn expected(t: &ForwardingTable) -> BTreeMap<KeyRaw, Entry> {
        kernel_entries(t, None)
            .into_iter()
            .map(|(k, s)| {
                let v = s.value(0, 0);
                (k, (s.id, s.flags, v.src_addr, v.src_port, s.copies))
            })
            .collect()
    }

    fn room(n: usize) -> Model {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        for i in 0..n {
            m.add_participant("r", &format!("p{i}"), a(&format!("10.0.0.1:{}", 4000 + 2 * i)), a(&format!("10.0.1.{}:5000", i + 1)))
                .unwrap();
            m.publish("r", &format!("p{i}"), "main", StreamSpec::default()).unwrap();
        }
        m
    }

    fn sub(m: &mut Model, s: usize, p: usize) {
        m.subscribe("r", &format!("p{s}"), StreamRef { publisher: format!("p{p}"), stream: "main".into() }).unwrap();
    }

    #[test]
    fn applies_only_changes_and_follows_the_protocol() {
        let mut k = FakeKernel::default();
        let mut inst = Installer::new(64, 16);
        let mut m = room(4);
        for s in 1..4 {
            sub(&mut m, s, 0);
        }
        let t1 = Arc::new(ForwardingTable::compile(&m, 1));
        let r = inst.apply(t1.clone(), &mut k).unwrap();
        assert_eq!((r.streams_written, r.copies_written, r.barrier), (4, 3, false));
        assert_eq!(k.as_entries(), expected(&t1));

        // Same table: nothing written.
        assert_eq!(inst.apply(t1.clone(), &mut k).unwrap(), ApplyReport::default());

        // Remove a subscriber: one entry rewritten to a fresh range, barrier, old range freed.
        m.unsubscribe("r", "p2", &StreamRef { publisher: "p0".into(), stream: "main".into() }).unwrap();
        let t2 = Arc::new(ForwardingTable::compile(&m, 2));
        let r = inst.apply(t2.clone(), &mut k).unwrap();
        assert_eq!((r.streams_written, r.copies_written, r.barrier), (1, 2, true));
        assert_eq!(k.as_entries(), expected(&t2));
        assert_eq!(inst.free_copy_slots(), 64 - 2);

        // Remove a participant (and its stream), add another.
        m.remove_participant("r", "p3").unwrap();
        m.add_participant("r", "p9", a("10.0.0.1:4100"), a("10.0.1.9:5000")).unwrap();
        m.publish("r", "p9", "main", StreamSpec { rtp: false, ..Default::default() }).unwrap();
        sub(&mut m, 9, 0);
        sub(&mut m, 0, 9);
        let t3 = Arc::new(ForwardingTable::compile(&m, 3));
        let r = inst.apply(t3.clone(), &mut k).unwrap();
        assert_eq!(r.streams_deleted, 1);
        assert_eq!(k.as_entries(), expected(&t3));
        assert!(k.barriers >= 2);
    }

    #[test]
    fn source_change_keeps_the_fan_out_range() {
        let mut k = FakeKernel::default();
        let mut inst = Installer::new(8, 8);
        let mut m = room(2);
        sub(&mut m, 1, 0);
        let t1 = Arc::new(ForwardingTable::compile(&m, 1));
        inst.apply(t1.clone(), &mut k).unwrap();
        let mut t2 = (*t1).clone();
        t2.version = 2;
        let first = *t2.streams.keys().next().unwrap();
        let e = t2.streams.get_mut(&first).unwrap();
        e.source = mediaplane_core::SourceRule::Latch;
        let t2 = Arc::new(t2);
        let r = inst.apply(t2.clone(), &mut k).unwrap();
        assert_eq!((r.streams_written, r.copies_written, r.barrier), (1, 0, false));
        assert_eq!(k.as_entries(), expected(&t2));
        let latch = k.streams.values().find(|v| v.flags & flags::LATCH != 0);
        assert!(latch.is_some());
    }

    #[test]
    fn full_fan_out_map_fails_without_writing() {
        let mut k = FakeKernel::default();
        let mut inst = Installer::new(2, 8);
        let mut m = room(4);
        for s in 1..4 {
            sub(&mut m, s, 0);
        }
        let t = Arc::new(ForwardingTable::compile(&m, 1));
        let e = inst.apply(t, &mut k).unwrap_err();
        assert!(matches!(e, DataplaneError::Full(_)) && e.to_string().contains("fan-out map full"), "{e}");
        assert!(k.streams.is_empty());
        assert_eq!(inst.free_copy_slots(), 2);
    }

    #[test]
    fn adopt_rebuilds_the_mirror_and_rewrites_nothing() {
        let mut k = FakeKernel::default();
        let mut inst = Installer::new(64, 16);
        let mut m = room(3);
        sub(&mut m, 1, 0);
        sub(&mut m, 2, 0);
        sub(&mut m, 0, 2);
        let t = Arc::new(ForwardingTable::compile(&m, 1));
        inst.apply(t.clone(), &mut k).unwrap();
        let mut again = adopt_all(&k);
        let r = again.apply(t.clone(), &mut k).unwrap();
        assert_eq!(r, ApplyReport::default());
        assert_eq!(again.free_copy_slots(), inst.free_copy_slots());
        // And it keeps allocating from free space only.
        sub(&mut m, 1, 2);
        let t2 = Arc::new(ForwardingTable::compile(&m, 2));
        again.apply(t2.clone(), &mut k).unwrap();
        assert_eq!(k.as_entries(), expected(&t2));
    }

    #[test]
    fn ssrc_streams_flip_the_wildcard_last() {
        let mut k = FakeKernel::default();
        let mut inst = Installer::new(64, 16);
        let mut m = room(2);
        sub(&mut m, 1, 0);
        let t1 = Arc::new(ForwardingTable::compile(&m, 1));
        inst.apply(t1, &mut k).unwrap();
        m.unpublish("r", "p0", "main").unwrap();
        m.publish("r", "p0", "hi", StreamSpec { ssrc: Some(7), ..Default::default() }).unwrap();
        m.subscribe("r", "p1", StreamRef { publisher: "p0".into(), stream: "hi".into() }).unwrap();
        let t2 = Arc::new(ForwardingTable::compile(&m, 2));
        inst.apply(t2.clone(), &mut k).unwrap();
        assert_eq!(k.as_entries(), expected(&t2));
        let wild = k.streams[&KeyRaw::new(a("10.0.0.1:4000"), None)];
        assert_eq!(wild.flags, flags::NARROWED | flags::ONE_SOURCE);
        // And back: the placeholder becomes a real stream again, the SSRC entry goes.
        m.unpublish("r", "p0", "hi").unwrap();
        m.publish("r", "p0", "main", StreamSpec::default()).unwrap();
        let t3 = Arc::new(ForwardingTable::compile(&m, 3));
        inst.apply(t3.clone(), &mut k).unwrap();
        assert_eq!(k.as_entries(), expected(&t3));
    }

    /// The wildcard (or placeholder) entry says "one source" exactly while every stream on its
    /// address has that fixed source, and an apply told about any one key there rewrites it.
    #[test]
    fn one_source_wildcard_follows_every_stream_on_its_address() {
        let mut k = FakeKernel::default();
        let mut inst = Installer::new(64, 16);
        let mut m = room(2);
        m.unpublish("r", "p0", "main").unwrap();
        for (name, ssrc) in [("hi", 7), ("lo", 8)] {
            m.publish("r", "p0", name, StreamSpec { ssrc: Some(ssrc), ..Default::default() }).unwrap();
            m.subscribe("r", "p1", StreamRef { publisher: "p0".into(), stream: name.into() }).unwrap();
        }
        let local = a("10.0.0.1:4000");
        let (owner, other) = (a("10.0.1.1:5000"), a("10.0.9.9:5000"));
        let wild = KeyRaw::new(local, None);
        let lo = IngressKey { local, ssrc: Some(8) };
        let placeholder = |k: &FakeKernel| k.streams[&wild];
        let src_of = |v: StreamValueRaw| {
            let (ip, port) = (v.src_addr, u16::from_be_bytes(v.src_port));
            (v.flags & flags::ONE_SOURCE != 0).then(|| SocketAddr::new(std::net::IpAddr::from([ip[0], ip[1], ip[2], ip[3]]), port))
        };
        let t1 = Arc::new(ForwardingTable::compile(&m, 1));
        inst.apply(t1.clone(), &mut k).unwrap();
        assert_eq!(k.as_entries(), expected(&t1));
        assert_eq!(placeholder(&k).flags, flags::NARROWED | flags::ONE_SOURCE);
        assert_eq!(src_of(placeholder(&k)), Some(owner));
        // p1's address has one real (wildcard) stream: its own source.
        assert_eq!(src_of(k.streams[&KeyRaw::new(a("10.0.0.1:4002"), None)]), Some(a("10.0.1.2:5000")));

        // One narrowed stream gets another source; the apply is told only about that key.
        let mut t2 = (*t1).clone();
        t2.version = 2;
        t2.streams.get_mut(&lo).unwrap().source = SourceRule::Fixed(other);
        let t2 = Arc::new(t2);
        let r = inst.apply_changes(t2.clone(), Some(&[lo]), &mut k).unwrap();
        assert_eq!(r.streams_written, 2, "the SSRC entry and the placeholder");
        assert_eq!(k.as_entries(), expected(&t2));
        assert_eq!(placeholder(&k).flags, flags::NARROWED);
        assert_eq!(placeholder(&k).src_addr, [0; 16]);

        // A latching one: still no one source.
        let mut t3 = (*t2).clone();
        t3.version = 3;
        t3.streams.get_mut(&lo).unwrap().source = SourceRule::Latch;
        let t3 = Arc::new(t3);
        inst.apply_changes(t3.clone(), Some(&[lo]), &mut k).unwrap();
        assert_eq!(k.as_entries(), expected(&t3));
        assert_eq!(placeholder(&k).flags, flags::NARROWED);

        // It goes away: the address has one source again.
        let mut t4 = (*t3).clone();
        t4.version = 4;
        t4.streams.remove(&lo);
        let t4 = Arc::new(t4);
        let r = inst.apply_changes(t4.clone(), Some(&[lo]), &mut k).unwrap();
        assert_eq!((r.streams_written, r.streams_deleted), (1, 1));
        assert_eq!(k.as_entries(), expected(&t4));
        assert_eq!(src_of(placeholder(&k)), Some(owner));

        // The owner moves (a new remote for all its streams), found by diffing the tables.
        let mut t5 = (*t4).clone();
        t5.version = 5;
        let at_local: Vec<IngressKey> = t5.streams.keys().filter(|key| key.local == local).copied().collect();
        at_local.iter().for_each(|key| t5.streams.get_mut(key).unwrap().source = SourceRule::Fixed(other));
        let t5 = Arc::new(t5);
        inst.apply(t5.clone(), &mut k).unwrap();
        assert_eq!(k.as_entries(), expected(&t5));
        assert_eq!(src_of(placeholder(&k)), Some(other));

        // A real wildcard stream beside the narrowed one: one source while it has the same.
        let mut t6 = (*t5).clone();
        t6.version = 6;
        let mut w = t6.streams[&IngressKey { local, ssrc: Some(7) }].clone();
        w.key.ssrc = None;
        w.id = 99;
        t6.streams.insert(w.key, w.clone());
        let t6 = Arc::new(t6);
        inst.apply_changes(t6.clone(), Some(&[w.key]), &mut k).unwrap();
        assert_eq!(k.as_entries(), expected(&t6));
        assert_eq!(k.streams[&wild].flags, flags::PRESENT | flags::RTP | flags::NARROWED | flags::ONE_SOURCE);
        assert_eq!(src_of(k.streams[&wild]), Some(other));
        let mut t7 = (*t6).clone();
        t7.version = 7;
        t7.streams.get_mut(&w.key).unwrap().source = SourceRule::Fixed(owner);
        let t7 = Arc::new(t7);
        inst.apply_changes(t7.clone(), Some(&[w.key]), &mut k).unwrap();
        assert_eq!(k.as_entries(), expected(&t7));
        assert_eq!(k.streams[&wild].flags, flags::PRESENT | flags::RTP | flags::NARROWED);

        // Adopting these entries (placeholder with a source included) rewrites nothing.
        let mut t8 = (*t5).clone();
        t8.version = 8;
        let t8 = Arc::new(t8);
        inst.apply(t8.clone(), &mut k).unwrap();
        let mut again = adopt_all(&k);
        assert_eq!(again.apply(t8, &mut k).unwrap(), ApplyReport::default());
    }

    #[test]
    fn range_allocator_coalesces() {
        let mut r = RangeAllocator::new(10);
        let a0 = r.alloc(3).unwrap();
        let a1 = r.alloc(3).unwrap();
        let a2 = r.alloc(4).unwrap();
        assert!(r.alloc(1).is_none());
        r.free(a1, 3);
        r.free(a0, 3);
        assert_eq!(r.alloc(6), Some(0));
        r.free(0, 6);
        r.free(a2, 4);
        assert_eq!(r.free_total(), 10);
        assert_eq!(r.alloc(10), Some(0));
        let mut r = RangeAllocator::new(10);
        assert!(r.reserve(4, 2));
        assert!(!r.reserve(5, 1));
        assert_eq!(r.alloc(4), Some(0));
        assert_eq!(r.alloc(4), Some(6));
    }
}
