//! **added delay** (DESIGN.md): one-way delay sender→receiver through the SFU minus the same
//! path without the SFU (the *direct path*, routed by the SFU namespace's kernel), measured in
//! the same run, per copy (one copy = one (flow, receiver) pair through the SFU). `mediaplane
//! bench sfu` passes its `kernel-forward` floor as the direct path (the same copies sent
//! participant to participant with no SFU and no BPF program attached, same invocation); the
//! demo passes the direct path of the plane's own run, which pays that plane's hooks.
//!
//! The two delays come from different packets, so they cannot be subtracted packet by packet;
//! we compare distributions. Two methods, both from the distributions' summaries:
//!
//! * [`AddedDelayMethod::QuantileDifference`] (default): each statistic of the copy minus the
//!   same statistic of the direct path (min − min, p50 − p50, mean − mean, p99 − p99,
//!   max − max). Compares like with like, so the kernel's own tail on the direct path is not
//!   blamed on the SFU. Caveat: a difference of quantiles is not a quantile of differences.
//! * [`AddedDelayMethod::SubtractDirectMedian`]: the copy's distribution shifted by the direct
//!   path's median, i.e. every statistic of the copy minus direct p50. Keeps the copy's spread
//!   (its tail includes the kernel path's own noise); min may come out slightly negative.
//!
//! Values are ns and may be negative (noise when the SFU adds almost nothing).

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::qos::Summary;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AddedDelayMethod {
    #[default]
    QuantileDifference,
    SubtractDirectMedian,
}

/// Added delay of one copy, ns. `count` is the number of copy packets it is based on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AddedDelay {
    pub method: AddedDelayMethod,
    pub count: u64,
    pub direct_count: u64,
    pub min: f64,
    pub p50: f64,
    pub mean: f64,
    pub p99: f64,
    pub max: f64,
}

/// Added delay from the delay summaries (ns) of a copy through the SFU and of the direct path.
/// `None` when either side has no packets.
pub fn added_delay(through_sfu: &Summary, direct: &Summary, method: AddedDelayMethod) -> Option<AddedDelay> {
    if through_sfu.count == 0 || direct.count == 0 {
        return None;
    }
    let baseline = match method {
        AddedDelayMethod::QuantileDifference => *direct,
        AddedDelayMethod::SubtractDirectMedian => {
            let m = direct.p50;
            Summary { count: direct.count, min: m, p50: m, mean: m, p99: m, max: m }
        }
    };
    Some(AddedDelay {
        method,
        count: through_sfu.count,
        direct_count: direct.count,
        min: through_sfu.min - baseline.min,
        p50: through_sfu.p50 - baseline.p50,
        mean: through_sfu.mean - baseline.mean,
        p99: through_sfu.p99 - baseline.p99,
        max: through_sfu.max - baseline.max,
    })
}

/// [`added_delay`] from two histograms (precision of the histograms' 3 significant digits).
pub fn added_delay_from_histograms(through_sfu: &Histogram<u64>, direct: &Histogram<u64>, method: AddedDelayMethod) -> Option<AddedDelay> {
    added_delay(&Summary::of_histogram(through_sfu), &Summary::of_histogram(direct), method)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(values: &[f64]) -> Summary {
        Summary::of(&mut values.to_vec())
    }

    #[test]
    fn quantile_difference_by_hand() {
        // direct path: 10..=109 µs-ish values; SFU copy: the same shifted by 30 plus a tail.
        let direct: Vec<f64> = (10..110).map(f64::from).collect();
        let mut sfu: Vec<f64> = direct.iter().map(|d| d + 30.0).collect();
        sfu[99] = 500.0; // one outlier (was 139)
        let a = added_delay(&summary(&sfu), &summary(&direct), AddedDelayMethod::QuantileDifference).unwrap();
        assert_eq!((a.min, a.p50, a.p99), (30.0, 30.0, 30.0));
        assert_eq!(a.max, 500.0 - 109.0);
        assert!((a.mean - (30.0 + (500.0 - 139.0) / 100.0)).abs() < 1e-9);
        assert_eq!((a.count, a.direct_count), (100, 100));
    }

    #[test]
    fn subtract_direct_median_by_hand() {
        let direct = summary(&[10.0, 20.0, 30.0]); // median 20
        let sfu = summary(&[15.0, 40.0, 65.0]);
        let a = added_delay(&sfu, &direct, AddedDelayMethod::SubtractDirectMedian).unwrap();
        assert_eq!((a.min, a.p50, a.mean, a.p99, a.max), (-5.0, 20.0, 20.0, 45.0, 45.0));
    }

    #[test]
    fn empty_side_gives_none() {
        let some = summary(&[1.0]);
        assert!(added_delay(&Summary::default(), &some, AddedDelayMethod::default()).is_none());
        assert!(added_delay(&some, &Summary::default(), AddedDelayMethod::default()).is_none());
    }
}
