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
//! 4. old ranges and stats slots are *retired*, not freed: the apply returns with the new table
//!    live. They are freed for reuse ([`Installer::reclaim`]) only after an RCU barrier (see
//!    [`KernelMaps::rcu_barrier`]) that started after they were retired, once no program run can
//!    still hold an old value. The caller runs that barrier off the apply path (one barrier frees
//!    every batch retired before it); an apply that finds no room but retired space waits for
//!    one itself ([`Installer::apply_changes`]).
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
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
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
    /// Copy ranges and stats slots retired: free once an RCU barrier has passed ([`Installer::reclaim`]).
    pub retired: usize,
    /// The apply waited for an RCU barrier itself: it needed room that was only retired.
    pub barrier: bool,
}

/// Copy ranges and stats slots no entry refers to any more, which a program run that started
/// before the change may still read: free for reuse only after an RCU barrier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Retired {
    ranges: Vec<(u32, u32)>,
    slots: Vec<u32>,
}

/// Everything retired up to a point (see [`Installer::reclaim_mark`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimMark(u64);

/// An apply's plan: entries to write (ranges and slots assigned), fresh slots, what it retires.
struct Plan {
    writes: Vec<Write>,
    fresh_slots: Vec<u32>,
    retire_ranges: Vec<(u32, u32)>,
    /// Stream ids whose slot an old entry held.
    retire_ids: Vec<u32>,
}

struct Write {
    key: KeyRaw,
    stream: KernelStream,
    value: StreamValueRaw,
    new_range: bool,
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
    /// Retired batches, oldest first, with their sequence numbers.
    pending: VecDeque<(u64, Retired)>,
    /// Sequence number of the next retired batch.
    next_batch: u64,
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
            pending: VecDeque::new(),
            next_batch: 0,
        }
    }

    /// Rebuild the mirror from entries read back from (pinned) kernel maps. The first apply
    /// afterwards compares every entry and rewrites only what differs.
    pub fn adopt(copies_capacity: u32, stats_capacity: u32, existing: Vec<(KeyRaw, StreamValueRaw, Vec<CopyRaw>)>) -> Result<Self, DataplaneError> {
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
            let any = value.flags & crate::maps::flags::ANY_SOURCE != 0;
            // A placeholder carries a source only with ONE_SOURCE (the address's one source) or
            // FEEDBACK (the consumer's); a learning stream only once it follows one (a source
            // port is never 0).
            let one_source = value.flags & (crate::maps::flags::ONE_SOURCE | crate::maps::flags::FEEDBACK) != 0;
            let followed = latch && value.src_port != [0, 0];
            let source = (followed || (!latch && !any && (!placeholder || one_source)))
                .then(|| SocketAddr::new(KeyRaw { addr: value.src_addr, ..key }.local().ip(), u16::from_be_bytes(value.src_port)));
            if !placeholder {
                let e = me.slots.entry(value.id).or_insert((value.stats_slot, 0));
                e.1 += 1;
                used_slots.insert(e.0);
            }
            let stream =
                KernelStream { id: value.id, flags: value.flags, source, copies, rate: None, clock_rate: value.clock_rate, layer: (value.layer, value.codec) };
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

    /// Entries of the stream map / stats slots in use.
    pub fn installed_len(&self) -> usize {
        self.installed.len()
    }

    pub fn slots_len(&self) -> usize {
        self.slots.len()
    }

    pub fn installed_keys(&self) -> impl Iterator<Item = &KeyRaw> {
        self.installed.keys()
    }

    /// Free entries of the copies array (retired ranges not included).
    pub fn free_copy_slots(&self) -> u32 {
        self.ranges.free_total()
    }

    /// Whether retired ranges or slots wait for an RCU barrier.
    pub fn has_retired(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Everything retired so far (None: nothing): once an RCU barrier that started after this
    /// call has returned, [`Installer::reclaim`] with it frees all of it.
    pub fn reclaim_mark(&self) -> Option<ReclaimMark> {
        self.has_retired().then_some(ReclaimMark(self.next_batch))
    }

    /// Free for reuse what was retired before `mark` was taken (and is not freed yet). Only
    /// after an RCU barrier that started after [`Installer::reclaim_mark`] returned `mark`.
    pub fn reclaim(&mut self, mark: ReclaimMark) {
        while self.pending.front().is_some_and(|(seq, _)| *seq < mark.0) {
            let (_, r) = self.pending.pop_front().expect("front");
            for (b, l) in r.ranges {
                self.ranges.free(b, l);
            }
            self.free_slots.extend(r.slots);
        }
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
            None => return Err(DataplaneError::Full(format!("kernel stats map full ({} streams; raise dataplane.max_streams)", self.stats_capacity))),
        };
        self.slots.insert(id, (slot, 1));
        fresh.push(slot);
        Ok(slot)
    }

    /// One entry less uses stream `id`'s slot: the slot, when that was the last one.
    fn release_slot(&mut self, id: u32) -> Option<u32> {
        let e = self.slots.get_mut(&id)?;
        e.1 -= 1;
        (e.1 == 0).then(|| self.slots.remove(&id).expect("present").0)
    }

    /// Install `table`, touching only the entries that differ from what is installed.
    pub fn apply(&mut self, table: Arc<ForwardingTable>, maps: &mut impl KernelMaps) -> Result<ApplyReport, DataplaneError> {
        self.apply_changes(table, None, maps)
    }

    /// [`Installer::apply`] for a table that differs from the last one installed only at
    /// `changed` (None: find out by comparing the tables). Only the addresses of those keys are
    /// looked at, so the cost is what changed, not the table size.
    ///
    /// Returns once the new entries are written (live): what they replaced is retired, for
    /// [`Installer::reclaim`] after the caller's next RCU barrier. Only when the apply needs room
    /// that is retired but not free yet does it run the barrier itself (and reclaim everything).
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
                d.upserts.iter().map(|e| e.key.local).chain(d.removals.iter().map(|k| k.local)).chain(d.feedback).collect()
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
        let plan = match self.plan(&desired) {
            Err(DataplaneError::Full(_)) if self.has_retired() => {
                // Maybe only retired space is missing: wait for the grace period here, then retry.
                maps.rcu_barrier()?;
                report.barrier = true;
                self.reclaim(ReclaimMark(self.next_batch));
                self.plan(&desired)?
            }
            p => p?,
        };
        let Plan { mut writes, fresh_slots, mut retire_ranges, retire_ids } = plan;
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
        let mut retire_ids = retire_ids;
        let mut deletes = deletes;
        deletes.sort_by_key(|k| (k.is_wildcard(), *k));
        for key in deletes {
            maps.delete_stream(&key)?;
            if let Some(old) = self.installed.remove(&key) {
                retire_ranges.push((old.value.copies_base, old.value.copies_count));
                if !old.stream.is_placeholder() {
                    retire_ids.push(old.stream.id);
                }
            }
            report.streams_deleted += 1;
        }
        // 4. retire what old entries used: free once no program can still be reading them.
        retire_ranges.retain(|r| r.1 > 0);
        let slots = retire_ids.into_iter().filter_map(|id| self.release_slot(id)).collect();
        let retired = Retired { ranges: retire_ranges, slots };
        report.retired = retired.ranges.len() + retired.slots.len();
        if report.retired > 0 {
            self.pending.push_back((self.next_batch, retired));
            self.next_batch += 1;
        }
        self.prev = Some(table);
        Ok(report)
    }

    /// Assign ranges and slots to the entries of `desired` that differ from what is installed,
    /// or undo every assignment and fail.
    fn plan(&mut self, desired: &BTreeMap<KeyRaw, KernelStream>) -> Result<Plan, DataplaneError> {
        let mut plan = Plan { writes: Vec::new(), fresh_slots: Vec::new(), retire_ranges: Vec::new(), retire_ids: Vec::new() };
        let mut failure = None;
        for (key, d) in desired {
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
                    plan.retire_ranges.push((c.value.copies_base, c.value.copies_count));
                }
                if !c.stream.is_placeholder() {
                    plan.retire_ids.push(c.stream.id);
                }
            }
            let slot = if d.is_placeholder() {
                0
            } else {
                match self.acquire_slot(d.id, &mut plan.fresh_slots) {
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
            plan.writes.push(Write { key: *key, value: d.value(slot, base), stream: d.clone(), new_range });
        }
        let Some(e) = failure else { return Ok(plan) };
        // Undo the plan: nothing was written, so nothing needs a barrier.
        for w in &plan.writes {
            if w.new_range {
                self.ranges.free(w.value.copies_base, w.value.copies_count);
            }
            if !w.stream.is_placeholder() {
                if let Some(slot) = self.release_slot(w.stream.id) {
                    self.free_slots.push(slot);
                }
            }
        }
        Err(e)
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

    /// A kernel that checks the protocol: a copy range is never written, nor a stats slot
    /// zeroed for reuse, while a stream entry refers to it or while a replaced entry that did
    /// may still be read (no barrier since).
    #[derive(Default)]
    struct FakeKernel {
        streams: BTreeMap<KeyRaw, StreamValueRaw>,
        copies: BTreeMap<u32, CopyRaw>,
        /// Ranges referenced by values replaced or deleted since the last barrier.
        retired: Vec<(u32, u32)>,
        /// Stats slots of (non-placeholder) values replaced or deleted since the last barrier.
        retired_slots: Vec<u32>,
        barriers: usize,
    }

    impl FakeKernel {
        fn retire(&mut self, old: StreamValueRaw) {
            self.retired.push((old.copies_base, old.copies_count));
            if old.flags & flags::PRESENT != 0 {
                self.retired_slots.push(old.stats_slot);
            }
        }
    }

    /// The caller's side of step 4 (the background reclaimer): barrier, then reclaim.
    fn barrier_and_reclaim(inst: &mut Installer, k: &mut FakeKernel) {
        let mark = inst.reclaim_mark().expect("something retired");
        k.rcu_barrier().unwrap();
        inst.reclaim(mark);
    }

    fn overlaps(a: (u32, u32), b: (u32, u32)) -> bool {
        a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
    }

    /// An installer adopting everything in the fake kernel's maps, as a restarted daemon does.
    fn adopt_all(k: &FakeKernel) -> Installer {
        let existing = k.streams.iter().map(|(key, v)| (*key, *v, (0..v.copies_count).map(|i| k.copies[&(v.copies_base + i)]).collect())).collect();
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
                self.retire(old);
            }
            Ok(())
        }
        fn delete_stream(&mut self, key: &KeyRaw) -> Result<(), DataplaneError> {
            let old = self.streams.remove(key).expect("deleting a missing entry");
            self.retire(old);
            Ok(())
        }
        fn zero_stats(&mut self, slot: u32) -> Result<(), DataplaneError> {
            let live = self.streams.values().any(|v| v.flags & flags::PRESENT != 0 && v.stats_slot == slot);
            assert!(!live, "zeroed the stats slot {slot} of a live entry");
            assert!(!self.retired_slots.contains(&slot), "reused stats slot {slot} before the RCU barrier");
            Ok(())
        }
        fn write_rate(&mut self, _slot: u32, _rate: &RateRaw) -> Result<(), DataplaneError> {
            Ok(())
        }
        fn rcu_barrier(&mut self) -> Result<(), DataplaneError> {
            self.retired.clear();
            self.retired_slots.clear();
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
            m.add_participant("r", &format!("p{i}"), a(&format!("10.0.0.1:{}", 4000 + 2 * i)), a(&format!("10.0.1.{}:5000", i + 1))).unwrap();
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
        assert_eq!((r.streams_written, r.copies_written, r.retired, r.barrier), (4, 3, 0, false));
        assert_eq!(k.as_entries(), expected(&t1));

        // Same table: nothing written.
        assert_eq!(inst.apply(t1.clone(), &mut k).unwrap(), ApplyReport::default());

        // Remove a subscriber: one entry rewritten to a fresh range, the old one retired (not
        // waited for) and freed by reclaim after a barrier; and the subscriber's own entry, no
        // longer a consumer's (no FEEDBACK).
        m.unsubscribe("r", "p2", &StreamRef { publisher: "p0".into(), stream: "main".into() }).unwrap();
        let t2 = Arc::new(ForwardingTable::compile(&m, 2));
        let r = inst.apply(t2.clone(), &mut k).unwrap();
        assert_eq!((r.streams_written, r.copies_written, r.retired, r.barrier), (2, 2, 1, false));
        assert_eq!(k.as_entries(), expected(&t2));
        assert_eq!((inst.free_copy_slots(), k.barriers), (64 - 3 - 2, 0));
        barrier_and_reclaim(&mut inst, &mut k);
        assert_eq!(inst.free_copy_slots(), 64 - 2);
        assert!(!inst.has_retired());

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
        assert!(r.retired >= 2, "p3's range and stats slot, p0's old range");
        assert!(!r.barrier);
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
        e.source = mediaplane_core::SourceRule::Learn(None);
        let t2 = Arc::new(t2);
        let r = inst.apply(t2.clone(), &mut k).unwrap();
        assert_eq!((r.streams_written, r.copies_written, r.retired, r.barrier), (1, 0, 0, false));
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

    /// However many applies retire, nothing retired is reused before reclaim; reclaim after a
    /// barrier frees what was retired before its mark, and only that.
    #[test]
    fn retired_space_is_reused_only_after_reclaim() {
        let mut k = FakeKernel::default();
        let mut inst = Installer::new(64, 16);
        let mut m = room(5);
        for s in 1..5 {
            sub(&mut m, s, 0);
        }
        inst.apply(Arc::new(ForwardingTable::compile(&m, 1)), &mut k).unwrap();
        let p0 = StreamRef { publisher: "p0".into(), stream: "main".into() };
        let mut version = 1;
        let mut toggle = |m: &mut Model, inst: &mut Installer, k: &mut FakeKernel| {
            match m.unsubscribe("r", "p4", &p0) {
                Ok(_) => {}
                Err(_) => sub(m, 4, 0),
            }
            version += 1;
            let t = Arc::new(ForwardingTable::compile(m, version));
            let r = inst.apply(t.clone(), k).unwrap();
            assert_eq!((r.retired, r.barrier), (1, false));
            assert_eq!(k.as_entries(), expected(&t));
        };
        // p0's fan-out alternates 3 and 4 copies, each time in a fresh range (FakeKernel checks).
        for _ in 0..10 {
            toggle(&mut m, &mut inst, &mut k);
        }
        assert_eq!(k.barriers, 0);
        assert_eq!(inst.free_copy_slots(), 64 - 4 - 5 * 3 - 5 * 4);
        let mark = inst.reclaim_mark().unwrap();
        // Retired after the mark: not freed by it.
        toggle(&mut m, &mut inst, &mut k);
        k.rcu_barrier().unwrap();
        inst.reclaim(mark);
        assert_eq!(inst.free_copy_slots(), 64 - 4 - 3);
        assert!(inst.has_retired());
        barrier_and_reclaim(&mut inst, &mut k);
        assert_eq!(inst.free_copy_slots(), 64 - 3);
        assert_eq!(inst.reclaim_mark(), None);
    }

    /// An apply that needs room which is only retired waits for the barrier itself and
    /// succeeds; one that does not fit even then still fails with Full, writing nothing.
    #[test]
    fn full_with_retired_room_waits_for_the_barrier() {
        let mut k = FakeKernel::default();
        let mut inst = Installer::new(6, 16);
        let mut m = room(5);
        for s in 1..4 {
            sub(&mut m, s, 0);
        }
        inst.apply(Arc::new(ForwardingTable::compile(&m, 1)), &mut k).unwrap();
        let p0 = StreamRef { publisher: "p0".into(), stream: "main".into() };
        // Another 3 copies: the last free ones; the first 3 retired.
        m.unsubscribe("r", "p3", &p0).unwrap();
        sub(&mut m, 4, 0);
        let t2 = Arc::new(ForwardingTable::compile(&m, 2));
        let r = inst.apply(t2, &mut k).unwrap();
        assert_eq!((r.retired, r.barrier, inst.free_copy_slots(), k.barriers), (1, false, 0, 0));
        // And back: no free room, but retired room.
        m.unsubscribe("r", "p4", &p0).unwrap();
        sub(&mut m, 3, 0);
        let t3 = Arc::new(ForwardingTable::compile(&m, 3));
        let r = inst.apply(t3.clone(), &mut k).unwrap();
        assert_eq!((r.copies_written, r.retired, r.barrier, k.barriers), (3, 1, true, 1));
        assert_eq!(k.as_entries(), expected(&t3));
        assert!(inst.has_retired(), "what this apply retired waits for the next barrier");
        // 4 copies for p1 never fit (3 in use): Full after the barrier, nothing written.
        for s in [0, 2, 3, 4] {
            sub(&mut m, s, 1);
        }
        let e = inst.apply(Arc::new(ForwardingTable::compile(&m, 4)), &mut k).unwrap_err();
        assert!(matches!(e, DataplaneError::Full(_)), "{e}");
        assert_eq!((k.barriers, inst.free_copy_slots()), (2, 3));
        assert_eq!(k.as_entries(), expected(&t3));
    }

    /// The same for stats slots: a slot is zeroed for a new stream only after the barrier.
    #[test]
    fn full_stats_with_a_retired_slot_waits_for_the_barrier() {
        let mut k = FakeKernel::default();
        let mut inst = Installer::new(64, 2);
        let mut m = room(2);
        inst.apply(Arc::new(ForwardingTable::compile(&m, 1)), &mut k).unwrap();
        let slot1 = inst.stats_slot(k.streams[&KeyRaw::new(a("10.0.0.1:4002"), None)].id).unwrap();
        m.remove_participant("r", "p1").unwrap();
        let r = inst.apply(Arc::new(ForwardingTable::compile(&m, 2)), &mut k).unwrap();
        assert_eq!((r.streams_deleted, r.retired, r.barrier), (1, 1, false));
        m.add_participant("r", "p9", a("10.0.0.1:4100"), a("10.0.1.9:5000")).unwrap();
        m.publish("r", "p9", "main", StreamSpec::default()).unwrap();
        let t3 = Arc::new(ForwardingTable::compile(&m, 3));
        let r = inst.apply(t3.clone(), &mut k).unwrap();
        assert_eq!((r.streams_written, r.barrier, k.barriers), (1, true, 1));
        assert_eq!(k.as_entries(), expected(&t3));
        assert_eq!(inst.stats_slot(k.streams[&KeyRaw::new(a("10.0.0.1:4100"), None)].id), Some(slot1));
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
        t3.streams.get_mut(&lo).unwrap().source = SourceRule::Learn(None);
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
