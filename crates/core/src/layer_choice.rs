//! Which layer of a simulcast stream a consumer gets (sans-I/O: time is passed in). Three
//! things decide it, in this order:
//!
//! 1. **The ceiling** the API sets: `min(preferred, max, top layer)` ([`crate::model::Consumer`]).
//!    The consumer's reports never take it above that.
//! 2. **The consumer's own reports** ([`LayerChoice`]) may lower it, one layer at a time:
//!    * *down* when a receiver report about what it receives says more than [`LOSS_DOWN`]/256
//!      (10 %) was lost, or when a REMB is below the measured bitrates of the layers it covers
//!      ([`remb_over`]: one estimate for all the SSRCs it lists; the consumer receiving the most
//!      that may step steps down: not one whose `auto_layer` is off, whose layer still counts). At most one step per [`DOWN_INTERVAL_NS`] (2 s), so the reports after a
//!      switch can show its effect before another;
//!    * *up* again one layer after a hold of [`UP_HOLD_NS`] (6 s) without a report above
//!      [`LOSS_UP`]/256 (2 %) and without a REMB short of what it receives. Between the two loss
//!      thresholds nothing moves and the hold restarts (the hysteresis). A step up is a probe: a
//!      step down within [`FAILED_UP_NS`] (4 s) of it doubles the next hold (up to
//!      [`MAX_UP_HOLD_NS`], 48 s), so a link that cannot carry a layer is not probed every 6 s;
//!      any other step down resets the hold. A REMB does not hold a step up back beyond that:
//!      a browser's estimate stays near what it receives, so waiting for it to cover the next
//!      layer would keep a consumer low for good.
//!
//!    Loss is what the consumer reports about its SSRC, so loss on the publisher's link counts
//!    too (it sees the same frozen video either way).
//!
//!    A consumer's NACKs count as reports too ([`LayerChoice::on_nacks`]): a receiver may send
//!    no report blocks while it loses packets (GStreamer puts none in its early feedback packets,
//!    the ones that carry its NACKs). Over back-to-back windows of at least [`NACK_WINDOW_NS`]
//!    (1 s) and [`NACK_MIN_SENT`] (100) packets sent to it, the distinct sequence numbers it
//!    NACKed that it had been sent (not those of the window before: retries; nor late ones not
//!    sent yet) over the packets sent to it count as a report of that loss. Beside its report
//!    blocks the same loss may be judged twice; the interval between steps keeps that to one step.
//! 3. **What the publisher sends** ([`LayerActivity`]): a layer without a packet for
//!    [`ABSENT_AFTER_NS`] (1 s) is absent (browsers stop their top layers under congestion; some
//!    publishers never send all they announce). The consumer gets the highest layer under the
//!    limit that is sent, else the lowest sent above it but not above the consumer's
//!    `max_layer`; when it returns, the consumer goes back at its next keyframe. During the
//!    stream's first [`ABSENT_AFTER_NS`] every layer is presumed sent, so a consumer does not
//!    start low just because the top layer's first packet came later than the bottom's.
//!
//! The rewriter ([`crate::simulcast::LayerRewriter`]) makes any change of the result happen at a
//! keyframe of the new layer, which the SFU asks for.

use crate::simulcast::MAX_LAYERS;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

const MS: u64 = 1_000_000;
/// Fraction lost (of 256, as a report block carries it) above which a consumer steps down: 10 %.
pub const LOSS_DOWN: u8 = 26;
/// Fraction lost (of 256) at or below which a report counts as good for stepping up: 2 %.
pub const LOSS_UP: u8 = 5;
/// At most one automatic step down per this.
pub const DOWN_INTERVAL_NS: u64 = 2_000 * MS;
/// A step up needs this long without a report above [`LOSS_UP`] or a short REMB.
pub const UP_HOLD_NS: u64 = 6_000 * MS;
/// A step down this soon after a step up means the probe failed: the next hold doubles.
pub const FAILED_UP_NS: u64 = 4_000 * MS;
/// The longest hold after failed probes.
pub const MAX_UP_HOLD_NS: u64 = 48_000 * MS;
/// A layer without a packet for this long is not sent.
pub const ABSENT_AFTER_NS: u64 = 1_000 * MS;
/// Bitrates are measured over windows of this length.
const RATE_WINDOW_NS: u64 = 1_000 * MS;
/// Loss inferred from NACKs is judged over windows of at least this length...
pub const NACK_WINDOW_NS: u64 = 1_000 * MS;
/// ... in which at least this many packets were sent to the consumer: a smaller sample says
/// little (at 5 % loss, 3 or more lost of 25 sent, read as "over 10 %", happens one time in 8).
pub const NACK_MIN_SENT: u64 = 100;
/// A window not due after this long (little sent: a paused layer) is dropped unjudged. (Long
/// enough for a low-rate layer's 100 packets: 128x72 VP8 sends about 10 a second.)
pub const NACK_STALE_NS: u64 = 10 * NACK_WINDOW_NS;
/// Numbers a window keeps at most.
const NACK_MAX_TRACKED: usize = 4096;

/// What a publisher sends of each layer of one simulcast stream: when it last sent a packet of
/// it, and at what bitrate. One per stream, shared by its consumers.
#[derive(Debug, Clone, Default)]
pub struct LayerActivity {
    first_ns: Option<u64>,
    last_ns: [Option<u64>; MAX_LAYERS],
    window_start_ns: [u64; MAX_LAYERS],
    window_bytes: [u64; MAX_LAYERS],
    bps: [Option<u64>; MAX_LAYERS],
}

impl LayerActivity {
    /// A packet of `layer` (`bytes` long, headers included) arrived at `now_ns`.
    pub fn on_packet(&mut self, layer: u8, bytes: usize, now_ns: u64) {
        let l = layer as usize;
        if l >= MAX_LAYERS {
            return;
        }
        self.first_ns.get_or_insert(now_ns);
        // A layer back after a pause starts a fresh window (its old rate says nothing now).
        if self.last_ns[l].is_none_or(|t| now_ns.saturating_sub(t) >= ABSENT_AFTER_NS) {
            (self.window_start_ns[l], self.window_bytes[l], self.bps[l]) = (now_ns, 0, None);
        }
        self.last_ns[l] = Some(now_ns);
        self.window_bytes[l] += bytes as u64;
        let elapsed = now_ns.saturating_sub(self.window_start_ns[l]);
        if elapsed >= RATE_WINDOW_NS {
            self.bps[l] = Some((self.window_bytes[l] as u128 * 8 * 1_000_000_000 / elapsed as u128) as u64);
            (self.window_start_ns[l], self.window_bytes[l]) = (now_ns, 0);
        }
    }

    /// A packet of the stream has arrived (its publisher is sending, so it can be asked for a
    /// keyframe).
    pub fn started(&self) -> bool {
        self.first_ns.is_some()
    }

    /// Whether the publisher sends `layer` (presumed during the stream's first
    /// [`ABSENT_AFTER_NS`], and before any packet at all).
    pub fn is_sent(&self, layer: u8, now_ns: u64) -> bool {
        let Some(first) = self.first_ns else { return true };
        if now_ns.saturating_sub(first) < ABSENT_AFTER_NS {
            return true;
        }
        self.last_ns.get(layer as usize).copied().flatten().is_some_and(|t| now_ns.saturating_sub(t) < ABSENT_AFTER_NS)
    }

    /// The bitrate of `layer` over its last full window (None: not a window yet, or absent).
    pub fn bitrate_bps(&self, layer: u8, now_ns: u64) -> Option<u64> {
        self.bps.get(layer as usize).copied().flatten().filter(|_| self.is_sent(layer, now_ns))
    }

    /// The layers not sent now: bit i for layer i (of [`MAX_LAYERS`], whether the stream has
    /// that many or not).
    pub fn absent_mask(&self, now_ns: u64) -> u8 {
        (0..MAX_LAYERS as u8).filter(|l| !self.is_sent(*l, now_ns)).fold(0, |m, l| m | 1 << l)
    }
}

/// A REMB is one estimate for all the SSRCs it lists. Given what its simulcast consumers receive
/// (`(consumer, bitrate of the layer it receives, whether it may step to a lower layer)`), None
/// if the estimate covers it; else the consumer that should step down (the one receiving the
/// most that may), if any.
pub fn remb_over(bps: u64, receiving: &[(u32, u64, bool)]) -> Option<Option<u32>> {
    let total: u64 = receiving.iter().map(|r| r.1).sum();
    (total > bps).then(|| receiving.iter().filter(|r| r.2).max_by_key(|r| r.1).map(|r| r.0))
}

/// What a consumer's automatic choice did, for its counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChoiceStats {
    /// Steps down on loss or REMB, and back up.
    pub steps_down: u64,
    pub steps_up: u64,
    /// Times the layer chosen changed because a layer went absent or came back.
    pub fallbacks: u64,
    /// Windows of NACKs judged as a report (no report block came in them).
    pub nack_judgements: u64,
}

/// The consumer's NACKs in the current window ([`LayerChoice::on_nacks`]).
#[derive(Debug, Clone, Default)]
struct NackWindow {
    /// When the open window opened (None: none is), and the packets sent by then.
    start_ns: Option<u64>,
    sent_at_start: u64,
    /// Distinct sequence numbers NACKed in this window, and in the one before (whose retries
    /// do not count again).
    seqs: HashSet<u16>,
    previous: HashSet<u16>,
}

/// One consumer's automatic layer limit (see the module's policy).
#[derive(Debug, Clone, Default)]
pub struct LayerChoice {
    /// The highest layer its reports allow (None: no limit).
    limit: Option<u8>,
    last_down_ns: Option<u64>,
    last_up_ns: Option<u64>,
    /// Since when no report held it down (set whenever one does).
    calm_since_ns: u64,
    /// The hold before the next step up (0: [`UP_HOLD_NS`]).
    hold_ns: u64,
    /// The ceiling of the last choice: a step down to it or above changes nothing.
    ceiling: Option<u8>,
    /// The last choice, and whether absence decided it.
    chosen: Option<(u8, bool)>,
    /// The API turned the automatic choice off: reports move nothing.
    manual: bool,
    nacks: NackWindow,
    pub stats: ChoiceStats,
}

impl LayerChoice {
    /// Whether its reports may lower its layer (the consumer's `auto_layer`, as the last
    /// [`LayerChoice::choose`] was told).
    pub fn automatic(&self) -> bool {
        !self.manual
    }

    /// The highest layer its reports allow now (None: no limit).
    pub fn limit(&self) -> Option<u8> {
        self.limit
    }

    /// A receiver report block about what it receives: `fraction_lost` of 256, while it
    /// receives `receiving`.
    pub fn on_loss(&mut self, fraction_lost: u8, receiving: Option<u8>, now_ns: u64) {
        if fraction_lost > LOSS_DOWN {
            self.step_down(receiving, now_ns);
        } else if fraction_lost > LOSS_UP {
            self.calm_since_ns = now_ns;
        }
    }

    /// Sequence numbers (its own, ones it was sent) the consumer NACKed; `sent` is how many
    /// packets it has been sent in all (the rewriter's count). Windows are back to back: one
    /// that is due (at least [`NACK_WINDOW_NS`] and [`NACK_MIN_SENT`] packets sent) is judged
    /// when the next NACK comes, before that NACK's numbers open the next window, as a report of
    /// the loss it shows. One that is not due after [`NACK_STALE_NS`] (a paused layer) is dropped
    /// unjudged.
    pub fn on_nacks(&mut self, seqs: &[u16], sent: u64, receiving: Option<u8>, now_ns: u64) {
        if let Some(start) = self.nacks.start_ns {
            let (age, sent_in) = (now_ns.saturating_sub(start), sent.saturating_sub(self.nacks.sent_at_start));
            if age >= NACK_WINDOW_NS && sent_in >= NACK_MIN_SENT {
                self.close_nack_window(sent_in, receiving, now_ns);
            } else if age >= NACK_STALE_NS {
                let w = &mut self.nacks;
                w.start_ns = None;
                w.previous = std::mem::take(&mut w.seqs);
            }
        }
        let w = &mut self.nacks;
        if w.start_ns.is_none() {
            if seqs.is_empty() {
                return;
            }
            (w.start_ns, w.sent_at_start) = (Some(now_ns), sent);
        }
        for s in seqs {
            // (Bounded: a flood of NACKs costs a hash lookup per number, and past this many the
            // verdict is long decided.)
            if w.seqs.len() < NACK_MAX_TRACKED && !w.previous.contains(s) {
                w.seqs.insert(*s);
            }
        }
    }

    fn close_nack_window(&mut self, sent_in: u64, receiving: Option<u8>, now_ns: u64) {
        let w = &mut self.nacks;
        w.start_ns = None;
        let lost = w.seqs.len() as u64;
        w.previous = std::mem::take(&mut w.seqs);
        if !self.manual {
            self.stats.nack_judgements += 1;
            self.on_loss((lost * 256 / sent_in.max(lost)).min(255) as u8, receiving, now_ns);
        }
    }

    /// A REMB short of what its consumers receive ([`remb_over`]): this one steps down if
    /// `step`, and none goes up before the hold.
    pub fn on_short_estimate(&mut self, step: bool, receiving: Option<u8>, now_ns: u64) {
        if step {
            self.step_down(receiving, now_ns);
        } else {
            self.calm_since_ns = now_ns;
        }
    }

    fn step_down(&mut self, receiving: Option<u8>, now_ns: u64) {
        self.calm_since_ns = now_ns;
        if self.manual {
            return;
        }
        // Only from a layer it receives (before its first keyframe nothing it reports is about
        // a layer), and not again before the reports can show the last step's effect.
        let Some(from) = receiving else { return };
        if from == 0 || self.last_down_ns.is_some_and(|t| now_ns.saturating_sub(t) < DOWN_INTERVAL_NS) {
            return;
        }
        let to = from - 1;
        // (A switch down the API asked for is on its way: nothing to add.)
        if self.ceiling.is_some_and(|c| to >= c) || self.limit.is_some_and(|l| to >= l) {
            return;
        }
        let failed_probe = self.last_up_ns.is_some_and(|t| now_ns.saturating_sub(t) < FAILED_UP_NS);
        self.hold_ns = if failed_probe { (self.hold().saturating_mul(2)).min(MAX_UP_HOLD_NS) } else { UP_HOLD_NS };
        self.limit = Some(to);
        self.last_down_ns = Some(now_ns);
        self.stats.steps_down += 1;
    }

    fn hold(&self) -> u64 {
        if self.hold_ns == 0 {
            UP_HOLD_NS
        } else {
            self.hold_ns
        }
    }

    /// The layer it should receive now, of `count`: at most `ceiling` unless only higher layers
    /// are sent, and never above `max` (its `max_layer`), given what the publisher sends. Without
    /// `auto` (the consumer's `auto_layer` off) its reports lower nothing: a limit they had set
    /// is dropped at once, and none is set until `auto` is back.
    pub fn choose(&mut self, ceiling: u8, max: Option<u8>, auto: bool, count: u8, activity: &LayerActivity, now_ns: u64) -> u8 {
        let top = count.saturating_sub(1);
        let ceiling = ceiling.min(top);
        self.ceiling = Some(ceiling);
        self.manual = !auto;
        if self.manual {
            self.limit = None;
        }
        if let Some(limit) = self.limit {
            if limit >= ceiling {
                // The API lowered the ceiling to it (or below): nothing of its own left to lift.
                self.limit = None;
            } else if now_ns.saturating_sub(self.calm_since_ns) >= self.hold() {
                self.limit = (limit + 1 < ceiling).then_some(limit + 1);
                self.calm_since_ns = now_ns;
                self.last_up_ns = Some(now_ns);
                self.stats.steps_up += 1;
            }
        }
        let want = self.limit.map_or(ceiling, |l| l.min(ceiling));
        let highest = max.unwrap_or(top).min(top).max(want);
        let sent = |l: &u8| activity.is_sent(*l, now_ns);
        let chosen = (0..=want).rev().find(sent).or_else(|| (want + 1..=highest).find(sent)).unwrap_or(want);
        let by_absence = chosen != want;
        if let Some((before, was_absence)) = self.chosen {
            if before != chosen && (by_absence || was_absence) {
                self.stats.fallbacks += 1;
            }
        }
        self.chosen = Some((chosen, by_absence));
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    /// Three layers at 100, 300 and 1,000 kbit/s, 50 packets a second each, from 0 to `until`
    /// (layer `gap.0` not sent between `gap.1` and `gap.2`).
    fn activity(until: u64, gap: Option<(u8, u64, u64)>) -> LayerActivity {
        let mut a = LayerActivity::default();
        let mut t = 0;
        while t <= until {
            for (l, kbps) in [(0u8, 100u64), (1, 300), (2, 1000)] {
                if gap.is_some_and(|(g, from, to)| g == l && t >= from && t < to) {
                    continue;
                }
                a.on_packet(l, (kbps * 1000 / 8 / 50) as usize, t);
            }
            t += S / 50;
        }
        a
    }

    #[test]
    fn bitrates_are_measured_per_layer() {
        let a = activity(3 * S, None);
        for (l, kbps) in [(0u8, 100u64), (1, 300), (2, 1000)] {
            let bps = a.bitrate_bps(l, 3 * S).unwrap();
            assert!(bps.abs_diff(kbps * 1000) * 100 < kbps * 1000 * 3, "layer {l}: {bps}");
        }
        assert_eq!(a.bitrate_bps(2, 5 * S), None, "absent: no rate");
    }

    #[test]
    fn without_reports_a_consumer_gets_its_ceiling() {
        let a = activity(10 * S, None);
        let mut c = LayerChoice::default();
        assert_eq!(c.choose(2, None, true, 3, &a, 10 * S), 2);
        assert_eq!(c.choose(1, None, true, 3, &a, 10 * S), 1);
        assert_eq!(c.choose(7, None, true, 3, &a, 10 * S), 2, "a ceiling above the top is the top");
    }

    #[test]
    fn an_absent_layer_falls_back_and_returns() {
        // Layer 2 stops at 3 s and comes back at 6 s.
        let gap = Some((2, 3 * S, 6 * S));
        let mut c = LayerChoice::default();
        assert_eq!(c.choose(2, None, true, 3, &activity(3 * S, None), 3 * S), 2);
        assert_eq!(c.choose(2, None, true, 3, &activity(3 * S + S / 2, gap), 3 * S + S / 2), 2, "not absent yet");
        assert_eq!(c.choose(2, None, true, 3, &activity(5 * S, gap), 5 * S), 1, "absent: the next one down");
        let a = activity(8 * S, gap);
        assert_eq!(c.choose(2, None, true, 3, &a, 8 * S), 2, "back");
        assert_eq!(c.stats.fallbacks, 2);
        assert_eq!(a.absent_mask(8 * S) & 0b111, 0);
    }

    #[test]
    fn a_layer_never_sent_is_not_waited_for_and_max_is_never_exceeded() {
        let mut a = LayerActivity::default();
        for i in 0..100u64 {
            a.on_packet(0, 100, i * S / 50);
            a.on_packet(1, 300, i * S / 50);
        }
        let mut c = LayerChoice::default();
        assert_eq!(c.choose(2, None, true, 3, &a, S / 2), 2, "presumed sent during the first second");
        assert_eq!(c.choose(2, None, true, 3, &a, 2 * S - S / 50), 1);
        assert_eq!(a.absent_mask(2 * S - S / 50) & 0b111, 0b100);
        // Only layer 2 is sent: a consumer that prefers 0 gets it rather than nothing, one
        // capped at 1 (max_layer) gets nothing above its cap.
        let mut high = LayerActivity::default();
        for i in 0..100u64 {
            high.on_packet(2, 1000, i * S / 50);
        }
        assert_eq!(c.choose(0, None, true, 3, &high, 2 * S - S / 50), 2);
        assert_eq!(LayerChoice::default().choose(1, Some(1), true, 3, &high, 2 * S - S / 50), 1);
        assert_eq!(LayerChoice::default().choose(0, Some(1), true, 3, &high, 2 * S - S / 50), 0);
    }

    #[test]
    fn without_auto_layer_reports_move_nothing_but_absence_still_does() {
        let a = activity(60 * S, None);
        let mut c = LayerChoice::default();
        assert_eq!(c.choose(2, None, true, 3, &a, 10 * S - S), 2);
        c.on_loss(51, Some(2), 10 * S);
        assert_eq!(c.choose(2, None, true, 3, &a, 10 * S), 1, "automatic: down");
        // Turned off: the limit is dropped at once, and lossy reports set none.
        assert_eq!(c.choose(2, None, false, 3, &a, 10 * S + 1), 2, "manual: back to the ceiling");
        for k in 0..8 {
            c.on_loss(200, Some(2), 11 * S + 2 * k * S);
            assert_eq!(c.choose(2, None, false, 3, &a, 11 * S + 2 * k * S), 2);
        }
        assert_eq!((c.limit(), c.stats.steps_down), (None, 1), "no step while manual");
        // A layer the publisher stops sending is still left (nothing else would be forwarded).
        let gap = activity(30 * S, Some((2, 28 * S, 31 * S)));
        assert_eq!(c.choose(2, None, false, 3, &gap, 30 * S), 1);
        // On again: the next lossy report steps down.
        assert_eq!(c.choose(2, None, true, 3, &a, 40 * S), 2);
        c.on_loss(51, Some(2), 40 * S);
        assert_eq!(c.choose(2, None, true, 3, &a, 40 * S), 1);
    }

    #[test]
    fn nacks_count_as_loss_reports() {
        let a = activity(60 * S, None);
        let mut c = LayerChoice::default();
        assert_eq!(c.choose(2, None, true, 3, &a, S), 2);
        // 20 % of the 100 packets sent in a second NACKed (retries of the same numbers and a
        // number named twice count once): a step down when the window closes.
        let mut sent = 1_000;
        for k in 0..10u64 {
            let seqs: Vec<u16> = (0..2).map(|i| (100 + 10 * k + i) as u16).collect();
            c.on_nacks(&seqs, sent, Some(2), 2 * S + k * S / 10);
            c.on_nacks(&seqs, sent, Some(2), 2 * S + k * S / 10 + 1);
            sent += 10;
        }
        assert_eq!(c.choose(2, None, true, 3, &a, 3 * S), 2, "the window is still open");
        c.on_nacks(&[], sent, Some(2), 3 * S);
        assert_eq!(c.choose(2, None, true, 3, &a, 3 * S), 1, "20 % lost");
        assert_eq!((c.stats.steps_down, c.stats.nack_judgements), (1, 1));
        // Retries of the last window's numbers, then 3 % new: no step, but the hold restarts.
        let t = 6 * S;
        let retries: Vec<u16> = (0..10u16).flat_map(|k| [100 + 10 * k, 101 + 10 * k]).collect();
        c.on_nacks(&retries, sent, Some(1), t);
        c.on_nacks(&[500, 501, 502], sent + 50, Some(1), t + S / 2);
        c.on_nacks(&[], sent + 100, Some(1), t + S);
        assert_eq!(c.choose(2, None, true, 3, &a, t + S), 1);
        assert_eq!((c.stats.steps_down, c.stats.nack_judgements), (1, 2), "3 of 100: between the thresholds");
        assert_eq!(c.calm_since_ns, t + S, "...which restarts the hold");
        // The NACK that finds a window due does not count in it: it opens the next one.
        let t = 9 * S;
        c.on_nacks(&[700], sent + 100, Some(1), t);
        c.on_nacks(&(701..730).collect::<Vec<u16>>(), sent + 200, Some(1), t + S);
        assert_eq!((c.stats.steps_down, c.stats.nack_judgements), (1, 3), "1 of 100 judged, the 29 wait");
        c.on_nacks(&[], sent + 300, Some(1), t + 2 * S);
        assert_eq!((c.stats.steps_down, c.stats.nack_judgements), (2, 4), "29 of 100: down");
        // A report block beside the NACKs does not keep them from counting.
        let t = 12 * S;
        c.on_loss(0, Some(0), t);
        c.on_nacks(&(600..605).collect::<Vec<u16>>(), sent + 300, Some(0), t);
        c.on_nacks(&[], sent + 400, Some(0), t + S);
        assert_eq!((c.stats.steps_down, c.stats.nack_judgements), (2, 5), "{:?}", c.stats);
        assert_eq!(c.calm_since_ns, t + S, "5 of 100: between the thresholds");
        // A window with little sent (its publisher paused) stays open until enough was, and is
        // dropped unjudged when that takes too long.
        let t = 20 * S;
        c.on_nacks(&[900], sent + 400, Some(0), t);
        c.on_nacks(&[901], sent + 405, Some(0), t + 2 * S);
        assert_eq!(c.stats.nack_judgements, 5, "5 sent");
        c.on_nacks(&[902], sent + 410, Some(0), t + NACK_STALE_NS);
        c.on_nacks(&[], sent + 410 + NACK_MIN_SENT, Some(0), t + NACK_STALE_NS + S);
        assert_eq!((c.stats.nack_judgements, c.stats.steps_down), (6, 2), "the stale window dropped; 1 of 100 judged");
        // Off (auto_layer): nothing judged.
        assert_eq!(c.choose(2, None, false, 3, &a, 40 * S), 2);
        c.on_nacks(&(1000..1050).collect::<Vec<u16>>(), sent + 600, Some(2), 40 * S);
        c.on_nacks(&[], sent + 700, Some(2), 41 * S);
        assert_eq!((c.stats.nack_judgements, c.stats.steps_down), (6, 2));
    }

    #[test]
    fn loss_steps_down_one_layer_at_a_time_and_up_after_the_hold() {
        let a = activity(60 * S, None);
        let mut c = LayerChoice::default();
        let t = 10 * S;
        assert_eq!(c.choose(2, None, true, 3, &a, t - S), 2);
        c.on_loss(LOSS_DOWN, Some(2), t);
        assert_eq!(c.choose(2, None, true, 3, &a, t), 2, "10 % is not more than 10 %");
        c.on_loss(51, Some(2), t); // 20 %
        assert_eq!(c.choose(2, None, true, 3, &a, t), 1);
        c.on_loss(51, Some(2), t + S); // a report still about the time before the switch
        assert_eq!(c.choose(2, None, true, 3, &a, t + S), 1, "one step per interval");
        c.on_loss(51, Some(1), t + 2 * S);
        assert_eq!(c.choose(2, None, true, 3, &a, t + 2 * S), 0);
        c.on_loss(51, Some(0), t + 5 * S);
        assert_eq!(c.choose(2, None, true, 3, &a, t + 5 * S), 0, "nothing below the bottom");
        // Good reports: up one layer per hold, counted from the last bad report.
        for k in 6..30 {
            c.on_loss(LOSS_UP, Some(c.chosen.unwrap().0), t + k * S);
        }
        assert_eq!(c.choose(2, None, true, 3, &a, t + 5 * S + UP_HOLD_NS - 1), 0);
        assert_eq!(c.choose(2, None, true, 3, &a, t + 5 * S + UP_HOLD_NS), 1);
        assert_eq!(c.choose(2, None, true, 3, &a, t + 5 * S + 2 * UP_HOLD_NS - 1), 1);
        assert_eq!(c.choose(2, None, true, 3, &a, t + 5 * S + 2 * UP_HOLD_NS), 2);
        assert_eq!(c.limit(), None, "back at the ceiling: no limit of its own");
        assert_eq!((c.stats.steps_down, c.stats.steps_up), (2, 2));
    }

    #[test]
    fn loss_between_the_thresholds_holds_without_stepping() {
        let a = activity(60 * S, None);
        let mut c = LayerChoice::default();
        c.on_loss(40, Some(2), 5 * S);
        assert_eq!(c.choose(2, None, true, 3, &a, 5 * S), 1);
        // 5 % every 2 s: not enough to go down, too much to go up.
        for k in 0..15 {
            c.on_loss(13, Some(1), 6 * S + 2 * k * S);
            assert_eq!(c.choose(2, None, true, 3, &a, 6 * S + 2 * k * S + S), 1);
        }
        assert_eq!(c.stats.steps_up, 0);
    }

    #[test]
    fn a_failed_probe_doubles_the_hold_and_a_fresh_congestion_resets_it() {
        let a = activity(400 * S, None);
        let mut c = LayerChoice::default();
        let mut t = 10 * S;
        c.on_loss(100, Some(2), t);
        let mut holds = Vec::new();
        for _ in 0..5 {
            // Wait for the probe up, then lose packets on the upper layer right away.
            let from = t;
            while c.choose(2, None, true, 3, &a, t) != 2 {
                t += S / 10;
            }
            holds.push((t - from) / S);
            t += S;
            c.on_loss(100, Some(2), t);
            assert_eq!(c.choose(2, None, true, 3, &a, t), 1);
        }
        assert_eq!(holds, [6, 12, 24, 48, 48], "doubling, capped");
        // Up at last and fine for longer than a probe; the next congestion starts from 6 s.
        while c.choose(2, None, true, 3, &a, t) != 2 {
            t += S / 10;
        }
        t += 30 * S;
        c.on_loss(100, Some(2), t);
        let from = t;
        while c.choose(2, None, true, 3, &a, t) != 2 {
            t += S / 10;
        }
        assert_eq!((t - from) / S, 6);
    }

    #[test]
    fn a_remb_is_shared_by_what_it_lists() {
        // 1.2 Mbit/s for two consumers of 1 Mbit/s each: the estimate is over (a tie: the last).
        assert_eq!(remb_over(1_200_000, &[(1, 1_000_000, true), (2, 1_000_000, true)]), Some(Some(2)));
        assert_eq!(remb_over(1_200_000, &[(1, 300_000, true), (2, 1_000_000, true)]), Some(Some(2)), "the biggest steps");
        assert_eq!(remb_over(1_200_000, &[(1, 100_000, false), (2, 1_000_000, true)]), None, "covered");
        assert_eq!(remb_over(50_000, &[(1, 100_000, false)]), Some(None), "over, nothing lower");
        // One that may not step (the bottom layer, or auto_layer off) still counts toward the total.
        assert_eq!(remb_over(1_200_000, &[(1, 300_000, true), (2, 1_000_000, false)]), Some(Some(1)), "the biggest that may");
        let a = activity(60 * S, None);
        let mut c = LayerChoice::default();
        c.on_short_estimate(true, Some(2), 10 * S);
        assert_eq!(c.choose(2, None, true, 3, &a, 10 * S), 1);
        // Another consumer stepped for this one's REMB: this one holds.
        c.on_short_estimate(false, Some(1), 14 * S);
        assert_eq!(c.choose(2, None, true, 3, &a, 10 * S + UP_HOLD_NS), 1);
        assert_eq!(c.choose(2, None, true, 3, &a, 14 * S + UP_HOLD_NS), 2);
    }

    #[test]
    fn the_api_ceiling_bounds_everything() {
        let a = activity(60 * S, None);
        let mut c = LayerChoice::default();
        assert_eq!(c.choose(2, None, true, 3, &a, 9 * S), 2);
        c.on_loss(100, Some(2), 10 * S);
        assert_eq!(c.choose(2, None, true, 3, &a, 10 * S), 1);
        // The API caps it at 1: its own limit is moot and does not linger below a later raise.
        assert_eq!(c.choose(1, Some(1), true, 3, &a, 11 * S), 1);
        assert_eq!(c.limit(), None);
        assert_eq!(c.choose(2, None, true, 3, &a, 12 * S), 2);
        // No report before its first keyframe steps it down.
        let mut d = LayerChoice::default();
        d.on_loss(255, None, 10 * S);
        assert_eq!(d.choose(2, None, true, 3, &a, 10 * S), 2);
        // Loss while a switch down the API asked for is on its way adds nothing.
        let mut e = LayerChoice::default();
        assert_eq!(e.choose(1, Some(1), true, 3, &a, 10 * S), 1);
        e.on_loss(100, Some(2), 10 * S);
        assert_eq!((e.limit(), e.stats.steps_down), (None, 0));
    }
}
