//! Small statistics: means, nearest-rank percentiles, medians and an interval for a median.

/// The mean of `values` (µs), 0 when empty.
pub fn mean_us(values: &[u32]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len() as f64
}

/// The nearest-rank `p` percentile (0 < p <= 1) of `values`, 0 when empty. Reorders
/// `values`.
pub fn percentile_us(values: &mut [u32], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let rank = (p * values.len() as f64).ceil() as usize;
    let index = rank.clamp(1, values.len()) - 1;
    f64::from(*values.select_nth_unstable(index).1)
}

/// The median of `values` (the mean of the middle two when even), `None` when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
}

/// A range that holds the median of the distribution the values were drawn from with the
/// given probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    pub low: f64,
    pub high: f64,
    /// The probability, 0 ..= 1.
    pub confidence: f64,
}

/// The distribution-free interval for the median of `values` (the sign test's): the k-th
/// smallest and the k-th largest value hold the true median unless k or more values fall on
/// one side of it, which for independent rounds has probability 2 P(Binomial(n, 1/2) < k).
/// k is the largest with a confidence of at least 95%, or 1 when no k reaches it (fewer than
/// 6 values). So 7 rounds give [min, max] at 98.4%, and 11 rounds the second smallest and
/// second largest at 98.8%. `None` when no value is finite. It assumes nothing about the
/// shape of the noise, only that rounds are independent draws.
pub fn median_interval(values: &[f64]) -> Option<Interval> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    // confidence[k - 1] for k = 1 ..= ceil(n / 2): 1 - 2 P(X <= k - 1), X ~ Binomial(n, 1/2).
    let mut below = 0.0; // P(X <= k - 1)
    let mut choose = 1.0; // C(n, k - 1)
    let half_n = 0.5f64.powi(i32::try_from(n).unwrap_or(i32::MAX));
    let mut best = (1, 0.0);
    for k in 1..=n.div_ceil(2) {
        below += choose * half_n;
        let confidence = (1.0 - 2.0 * below).max(0.0);
        if k == 1 || confidence >= 0.95 {
            best = (k, confidence);
        }
        choose = choose * (n - (k - 1)) as f64 / k as f64;
    }
    let (k, confidence) = best;
    Some(Interval {
        low: v[k - 1],
        high: v[n - k],
        confidence,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let mut v: Vec<u32> = (1..=100).rev().collect();
        assert_eq!(percentile_us(&mut v, 0.99), 99.0);
        assert_eq!(percentile_us(&mut v, 0.50), 50.0);
        assert_eq!(percentile_us(&mut v, 1.0), 100.0);
        assert_eq!(percentile_us(&mut [7], 0.99), 7.0);
        assert_eq!(percentile_us(&mut [], 0.99), 0.0);
        assert_eq!(mean_us(&[1, 2, 3]), 2.0);
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn median_intervals() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        // 7 rounds: only [min, max] reaches 95% (98.4%; the next pair is 87.5%).
        let i = median_interval(&[5.0, 1.0, 7.0, 3.0, 2.0, 6.0, 4.0]).unwrap();
        assert_eq!((i.low, i.high), (1.0, 7.0));
        assert!(close(i.confidence, 1.0 - 2.0 / 128.0));
        // 11: the second smallest and largest (98.8%; the third pair is 93.5%).
        let v: Vec<f64> = (1..=11).map(f64::from).collect();
        let i = median_interval(&v).unwrap();
        assert_eq!((i.low, i.high), (2.0, 10.0));
        assert!(close(i.confidence, 1.0 - 2.0 * 12.0 / 2048.0));
        // 20: the 6th and 15th (95.9%; the 7th pair is 88.5%).
        let v: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        let i = median_interval(&v).unwrap();
        assert_eq!((i.low, i.high), (6.0, 15.0));
        assert!((i.confidence - 0.9586).abs() < 1e-4);
        // Too few rounds for 95%: [min, max] with what it has (5 rounds: 93.75%).
        let i = median_interval(&[3.0, 1.0, 2.0, 5.0, 4.0]).unwrap();
        assert_eq!((i.low, i.high), (1.0, 5.0));
        assert!(close(i.confidence, 0.9375));
        let i = median_interval(&[2.0, f64::NAN]).unwrap();
        assert_eq!((i.low, i.high, i.confidence), (2.0, 2.0, 0.0));
        assert_eq!(median_interval(&[f64::NAN]), None);
    }
}
