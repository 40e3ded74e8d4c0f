//! Small statistics helpers.

use serde_json::{Value, json};

/// Median, min and max of repeated measurements.
pub(crate) fn spread(xs: &[f64]) -> Value {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    json!({ "median": median(&v), "min": v.first(), "max": v.last(), "runs": v.len() })
}

pub(crate) fn median(sorted: &[f64]) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let m = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[m]
    } else {
        (sorted[m - 1] + sorted[m]) / 2.0
    }
}

/// The `p`-quantile (0..=1) of sorted values.
pub(crate) fn quantile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}
