//! Small statistics: means, nearest-rank percentiles and medians.

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
}
