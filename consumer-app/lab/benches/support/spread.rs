//! Spread over repetitions: every ratio of the report is measured in at
//! least three interleaved repetitions (baseline and candidate alternated
//! within each), and printed as its median with the lowest and highest
//! repetition beside it, so that a reader can tell a change from the noise
//! of two shared cores.

use std::fmt::Write as _;

/// The least number of repetitions a ratio is printed from.
pub(crate) const MIN_REPS: usize = 3;

/// Repetitions per measurement: `INBOX_BENCH_REPS`, at least [`MIN_REPS`].
pub(crate) fn reps() -> usize {
    std::env::var("INBOX_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(MIN_REPS)
        .max(MIN_REPS)
}

/// Median, lowest and highest of a few values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Spread {
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
}

impl Spread {
    /// The spread of the finite `values`; `None` when there are none.
    pub(crate) fn of(values: impl IntoIterator<Item = f64>) -> Option<Self> {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        let median = if v.len().is_multiple_of(2) {
            (v[mid - 1] + v[mid]) / 2.0
        } else {
            v[mid]
        };
        Some(Self {
            median,
            min: v[0],
            max: v[v.len() - 1],
        })
    }

    /// The spread of `candidate[i] / baseline[i]`: each repetition's ratio
    /// is taken within that repetition, where both ran side by side.
    pub(crate) fn ratios(candidate: &[f64], baseline: &[f64]) -> Option<Self> {
        Self::of(candidate.iter().zip(baseline).map(|(c, b)| c / b))
    }

    /// `0.76 (0.70–0.81)`, with `decimals` digits.
    pub(crate) fn cell(&self, decimals: usize) -> String {
        let mut out = String::new();
        let _ = write!(
            out,
            "{:.d$} ({:.d$}–{:.d$})",
            self.median,
            self.min,
            self.max,
            d = decimals
        );
        out
    }
}

/// [`Spread::cell`] of a maybe-measured spread; empty when not measured.
pub(crate) fn cell(spread: Option<Spread>, decimals: usize) -> String {
    spread.map_or_else(String::new, |s| s.cell(decimals))
}

/// "met", "MISSED" or "not measured": the worst repetition decides, so a
/// target is met only if no repetition missed it.
pub(crate) fn verdict(spread: Option<Spread>, target: f64) -> &'static str {
    match spread {
        Some(s) if s.min >= target => "met",
        Some(s) if s.median >= target => "met by the median, MISSED by the worst repetition",
        Some(_) => "MISSED",
        None => "not measured",
    }
}
