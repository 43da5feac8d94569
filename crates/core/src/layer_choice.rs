//! Which layer of a simulcast stream a consumer gets (sans-I/O: time is passed in). Three
//! things decide it, in this order:
//!
//! 1. **The ceiling** the API sets: `min(preferred, max, top layer)` ([`crate::model::Consumer`]).
//!    Nothing automatic ever goes above it.
//! 2. **The consumer's own reports** ([`LayerChoice`]) may lower it, one layer at a time:
//!    * *down* when a receiver report about what it receives says more than [`LOSS_DOWN`]
//!      (10 %) was lost, or a REMB is below the measured bitrate of the layer it receives; at
//!      most one step per [`DOWN_INTERVAL_NS`] (2 s), so the reports after a switch can show its
//!      effect before another;
//!    * *up* again one layer after [`UP_HOLD_NS`] (6 s) without a report above [`LOSS_UP`]
//!      (2 %, the hysteresis: between the two thresholds nothing moves and the hold restarts),
//!      and only if its latest REMB (if it sends them; one older than [`REMB_STALE_NS`] does not
//!      count) covers the next layer's bitrate with [`REMB_HEADROOM`] (25 %) to spare.
//!
//!    Loss is what the consumer reports about its SSRC, so loss on the publisher's link counts
//!    too (it sees the same frozen video either way).
//! 3. **What the publisher sends** ([`LayerActivity`]): a layer without a packet for
//!    [`ABSENT_AFTER_NS`] (1 s) is absent (browsers stop their top layers under congestion; some
//!    publishers never send all they announce). The consumer gets the highest layer under the
//!    limit that is sent, else the lowest sent above it; when it returns, the consumer goes back
//!    up at its next keyframe. During the stream's first [`ABSENT_AFTER_NS`] every layer is
//!    presumed sent, so a consumer does not start low just because the top layer's first packet
//!    came later than the bottom's.
//!
//! The rewriter ([`crate::simulcast::LayerRewriter`]) makes any change of the result happen at a
//! keyframe of the new layer, which the SFU asks for.

use crate::simulcast::MAX_LAYERS;
use serde::{Deserialize, Serialize};

const MS: u64 = 1_000_000;
/// Fraction lost (of 256, as a report block carries it) above which a consumer steps down: 10 %.
pub const LOSS_DOWN: u8 = 26;
/// Fraction lost (of 256) at or below which a report counts as good for stepping up: 2 %.
pub const LOSS_UP: u8 = 5;
/// At most one automatic step down per this.
pub const DOWN_INTERVAL_NS: u64 = 2_000 * MS;
/// A step up needs this long without a report above [`LOSS_UP`] or a short REMB.
pub const UP_HOLD_NS: u64 = 6_000 * MS;
/// A REMB older than this neither holds a consumer down nor lets it up.
pub const REMB_STALE_NS: u64 = 5_000 * MS;
/// A step up needs a REMB of this much more than the next layer's bitrate (in quarters: 5/4).
pub const REMB_HEADROOM: (u64, u64) = (5, 4);
/// A layer without a packet for this long is not sent.
pub const ABSENT_AFTER_NS: u64 = 1_000 * MS;
/// Bitrates are measured over windows of this length.
const RATE_WINDOW_NS: u64 = 1_000 * MS;

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

    /// The layers (of `count`) not sent now.
    pub fn absent(&self, count: u8, now_ns: u64) -> Vec<u8> {
        (0..count).filter(|l| !self.is_sent(*l, now_ns)).collect()
    }
}

/// What a consumer's automatic choice did, for its counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChoiceStats {
    /// Steps down on loss or REMB, and back up.
    pub steps_down: u64,
    pub steps_up: u64,
    /// Times the layer chosen changed because a layer went absent or came back.
    pub fallbacks: u64,
}

/// One consumer's automatic layer limit (see the module's policy).
#[derive(Debug, Clone, Default)]
pub struct LayerChoice {
    /// The highest layer its reports allow (None: no limit).
    limit: Option<u8>,
    last_down_ns: Option<u64>,
    /// Since when no report held it down (set whenever one does).
    calm_since_ns: u64,
    remb: Option<(u64, u64)>,
    /// The last choice, and whether absence decided it.
    chosen: Option<(u8, bool)>,
    pub stats: ChoiceStats,
}

impl LayerChoice {
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

    /// A REMB naming what it receives: `bps` while it receives `receiving`.
    pub fn on_remb(&mut self, bps: u64, receiving: Option<u8>, activity: &LayerActivity, now_ns: u64) {
        self.remb = Some((bps, now_ns));
        if let Some(rate) = receiving.and_then(|l| activity.bitrate_bps(l, now_ns)) {
            if bps < rate {
                self.step_down(receiving, now_ns);
            }
        }
    }

    fn step_down(&mut self, receiving: Option<u8>, now_ns: u64) {
        self.calm_since_ns = now_ns;
        // Only from a layer it receives (before its first keyframe nothing it reports is about
        // a layer), and not again before the reports can show the last step's effect.
        let Some(from) = receiving else { return };
        if from == 0 || self.last_down_ns.is_some_and(|t| now_ns.saturating_sub(t) < DOWN_INTERVAL_NS) {
            return;
        }
        let to = from - 1;
        if self.limit.is_none_or(|l| to < l) {
            self.limit = Some(to);
            self.last_down_ns = Some(now_ns);
            self.stats.steps_down += 1;
        }
    }

    /// The layer it should receive now, of `count`, under the API's `ceiling`, given what the
    /// publisher sends.
    pub fn choose(&mut self, ceiling: u8, count: u8, activity: &LayerActivity, now_ns: u64) -> u8 {
        let top = count.saturating_sub(1);
        let ceiling = ceiling.min(top);
        if let Some(limit) = self.limit {
            if limit >= ceiling {
                // The API lowered the ceiling to it (or below): nothing of its own left to lift.
                self.limit = None;
            } else if now_ns.saturating_sub(self.calm_since_ns) >= UP_HOLD_NS && self.remb_allows(limit + 1, activity, now_ns) {
                self.limit = (limit + 1 < ceiling).then_some(limit + 1);
                self.calm_since_ns = now_ns;
                self.stats.steps_up += 1;
            }
        }
        let want = self.limit.map_or(ceiling, |l| l.min(ceiling));
        let sent = |l: &u8| activity.is_sent(*l, now_ns);
        let chosen = (0..=want).rev().find(sent).or_else(|| (want + 1..count).find(sent)).unwrap_or(want);
        let by_absence = chosen != want;
        if let Some((before, was_absence)) = self.chosen {
            if before != chosen && (by_absence || was_absence) {
                self.stats.fallbacks += 1;
            }
        }
        self.chosen = Some((chosen, by_absence));
        chosen
    }

    fn remb_allows(&self, layer: u8, activity: &LayerActivity, now_ns: u64) -> bool {
        match (self.remb, activity.bitrate_bps(layer, now_ns)) {
            (Some((bps, at)), Some(rate)) if now_ns.saturating_sub(at) < REMB_STALE_NS => {
                bps as u128 * REMB_HEADROOM.1 as u128 >= rate as u128 * REMB_HEADROOM.0 as u128
            }
            _ => true,
        }
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
    }

    #[test]
    fn without_reports_a_consumer_gets_its_ceiling() {
        let a = activity(10 * S, None);
        let mut c = LayerChoice::default();
        assert_eq!(c.choose(2, 3, &a, 10 * S), 2);
        assert_eq!(c.choose(1, 3, &a, 10 * S), 1);
        assert_eq!(c.choose(7, 3, &a, 10 * S), 2, "a ceiling above the top is the top");
    }

    #[test]
    fn an_absent_layer_falls_back_and_returns() {
        // Layer 2 stops at 3 s and comes back at 6 s.
        let a = activity(8 * S, Some((2, 3 * S, 6 * S)));
        let mut c = LayerChoice::default();
        assert_eq!(c.choose(2, 3, &activity(3 * S, None), 3 * S), 2);
        assert_eq!(c.choose(2, 3, &activity(3 * S + S / 2, Some((2, 3 * S, 6 * S))), 3 * S + S / 2), 2, "not absent yet");
        assert_eq!(c.choose(2, 3, &activity(5 * S, Some((2, 3 * S, 6 * S))), 5 * S), 1, "absent: the next one down");
        assert_eq!(c.choose(2, 3, &a, 8 * S), 2, "back");
        assert_eq!(c.stats.fallbacks, 2);
        assert_eq!(a.absent(3, 8 * S), Vec::<u8>::new());
    }

    #[test]
    fn a_layer_never_sent_is_not_waited_for() {
        let mut a = LayerActivity::default();
        for i in 0..100u64 {
            a.on_packet(0, 100, i * S / 50);
            a.on_packet(1, 300, i * S / 50);
        }
        let mut c = LayerChoice::default();
        assert_eq!(c.choose(2, 3, &a, S / 2), 2, "presumed sent during the first second");
        assert_eq!(c.choose(2, 3, &a, 2 * S - S / 50), 1);
        assert_eq!(a.absent(3, 2 * S - S / 50), vec![2]);
        // Only a layer above the ceiling is sent: that one, rather than nothing.
        let mut high = LayerActivity::default();
        for i in 0..100u64 {
            high.on_packet(2, 1000, i * S / 50);
        }
        assert_eq!(c.choose(0, 3, &high, 2 * S - S / 50), 2);
    }

    #[test]
    fn loss_steps_down_one_layer_at_a_time_and_up_after_the_hold() {
        let a = activity(60 * S, None);
        let mut c = LayerChoice::default();
        let t = 10 * S;
        c.on_loss(51, Some(2), t); // 20 %
        assert_eq!(c.choose(2, 3, &a, t), 1);
        c.on_loss(51, Some(2), t + S); // a report still about the time before the switch
        assert_eq!(c.choose(2, 3, &a, t + S), 1, "one step per interval");
        c.on_loss(51, Some(1), t + 2 * S);
        assert_eq!(c.choose(2, 3, &a, t + 2 * S), 0);
        c.on_loss(51, Some(0), t + 5 * S);
        assert_eq!(c.choose(2, 3, &a, t + 5 * S), 0, "nothing below the bottom");
        // Good reports: up one layer per hold, counted from the last bad report.
        for k in 6..30 {
            c.on_loss(0, Some(c.chosen.unwrap().0), t + k * S);
        }
        assert_eq!(c.choose(2, 3, &a, t + 5 * S + UP_HOLD_NS - 1), 0);
        assert_eq!(c.choose(2, 3, &a, t + 5 * S + UP_HOLD_NS), 1);
        assert_eq!(c.choose(2, 3, &a, t + 5 * S + 2 * UP_HOLD_NS - 1), 1);
        assert_eq!(c.choose(2, 3, &a, t + 5 * S + 2 * UP_HOLD_NS), 2);
        assert_eq!(c.limit(), None, "back at the ceiling: no limit of its own");
        assert_eq!((c.stats.steps_down, c.stats.steps_up), (2, 2));
    }

    #[test]
    fn loss_between_the_thresholds_holds_without_stepping() {
        let a = activity(60 * S, None);
        let mut c = LayerChoice::default();
        c.on_loss(40, Some(2), 5 * S);
        assert_eq!(c.choose(2, 3, &a, 5 * S), 1);
        // 5 % every 2 s: not enough to go down, too much to go up.
        for k in 0..15 {
            c.on_loss(13, Some(1), 6 * S + 2 * k * S);
            assert_eq!(c.choose(2, 3, &a, 6 * S + 2 * k * S + S), 1);
        }
        assert_eq!(c.stats.steps_up, 0);
    }

    #[test]
    fn remb_below_the_layer_steps_down_and_must_cover_the_next_to_step_up() {
        let a = activity(60 * S, None);
        let mut c = LayerChoice::default();
        c.on_remb(600_000, Some(2), &a, 10 * S);
        assert_eq!(c.choose(2, 3, &a, 10 * S), 1);
        c.on_remb(600_000, Some(1), &a, 11 * S);
        assert_eq!(c.choose(2, 3, &a, 11 * S), 1, "600 kbit/s carries layer 1");
        // 1,100 kbit/s covers layer 2 (1,000) but not with 25 % to spare.
        c.on_remb(1_100_000, Some(1), &a, 20 * S);
        assert_eq!(c.choose(2, 3, &a, 20 * S), 1);
        c.on_remb(1_300_000, Some(1), &a, 21 * S);
        assert_eq!(c.choose(2, 3, &a, 21 * S), 2);
        // A stale estimate holds nothing.
        let mut d = LayerChoice::default();
        d.on_remb(200_000, Some(2), &a, 10 * S);
        assert_eq!(d.choose(2, 3, &a, 10 * S), 1);
        assert_eq!(d.choose(2, 3, &a, 10 * S + REMB_STALE_NS.max(UP_HOLD_NS)), 2);
    }

    #[test]
    fn the_api_ceiling_bounds_everything() {
        let a = activity(60 * S, None);
        let mut c = LayerChoice::default();
        c.on_loss(100, Some(2), 10 * S);
        assert_eq!(c.choose(2, 3, &a, 10 * S), 1);
        // The API caps it at 1: its own limit is moot and does not linger below a later raise.
        assert_eq!(c.choose(1, 3, &a, 11 * S), 1);
        assert_eq!(c.limit(), None);
        assert_eq!(c.choose(2, 3, &a, 12 * S), 2);
        // No report before its first keyframe steps it down.
        let mut d = LayerChoice::default();
        d.on_loss(255, None, 10 * S);
        assert_eq!(d.choose(2, 3, &a, 10 * S), 2);
    }
}
