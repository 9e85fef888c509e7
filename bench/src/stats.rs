//! What one run measured, and the median/min/max over repeats.

use std::time::Duration;

/// Figures of one run of one target.
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    /// Deliveries acknowledged (every delivery of every subscription).
    pub acked: u64,
    /// From the first publish to the last ACK confirmation.
    pub elapsed: Duration,
    /// Publish → receive, microseconds (from the time the publish was due).
    pub latency_us: Vec<u64>,
    /// ACK sent → ACK confirmed, microseconds.
    pub ack_rtt_us: Vec<u64>,
    /// Server RSS at the end of the run (peak where the target tells it), KiB.
    pub rss_kib: Option<u64>,
    /// (RSS with the consumers connected − RSS before) / consumers, KiB.
    pub rss_per_connection_kib: Option<f64>,
    /// Bytes on disk of the database (or the append-only file).
    pub db_bytes: Option<u64>,
}

impl RunResult {
    pub fn acked_per_s(&self) -> f64 {
        self.acked as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// The `q` quantile (0..=1) of `values` in milliseconds (nearest rank).
pub fn quantile_ms(values: &mut [u64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    Some(values[rank - 1] as f64 / 1000.0)
}

/// One metric over the repeats: median, min, max.
#[derive(Debug, Clone, Copy)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(mut values: Vec<f64>) -> Option<Spread> {
        values.retain(|v| v.is_finite());
        if values.is_empty() {
            return None;
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let median = if n % 2 == 1 {
            values[n / 2]
        } else {
            (values[n / 2 - 1] + values[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: values[0],
            max: values[n - 1],
        })
    }

    /// `median (min–max)` with `decimals` digits.
    pub fn show(&self, decimals: usize) -> String {
        format!(
            "{:.d$} ({:.d$}–{:.d$})",
            self.median,
            self.min,
            self.max,
            d = decimals
        )
    }
}

/// The metrics of a target over its repeats, ready to print.
#[derive(Debug, Clone)]
pub struct Summary {
    pub target: String,
    pub runs: usize,
    pub acked_per_s: Option<Spread>,
    pub p50_ms: Option<Spread>,
    pub p99_ms: Option<Spread>,
    pub p999_ms: Option<Spread>,
    pub ack_p50_ms: Option<Spread>,
    pub ack_p99_ms: Option<Spread>,
    pub rss_mib: Option<Spread>,
    pub rss_per_connection_kib: Option<Spread>,
    pub db_mib: Option<Spread>,
}

impl Summary {
    pub fn of(target: &str, runs: &mut [RunResult]) -> Summary {
        let mut per = |f: &mut dyn FnMut(&mut RunResult) -> Option<f64>| {
            Spread::of(runs.iter_mut().filter_map(&mut *f).collect())
        };
        Summary {
            target: target.to_owned(),
            runs: 0,
            acked_per_s: per(&mut |r| Some(r.acked_per_s())),
            p50_ms: per(&mut |r| quantile_ms(&mut r.latency_us, 0.50)),
            p99_ms: per(&mut |r| quantile_ms(&mut r.latency_us, 0.99)),
            p999_ms: per(&mut |r| quantile_ms(&mut r.latency_us, 0.999)),
            ack_p50_ms: per(&mut |r| quantile_ms(&mut r.ack_rtt_us, 0.50)),
            ack_p99_ms: per(&mut |r| quantile_ms(&mut r.ack_rtt_us, 0.99)),
            rss_mib: per(&mut |r| r.rss_kib.map(|k| k as f64 / 1024.0)),
            rss_per_connection_kib: per(&mut |r| r.rss_per_connection_kib),
            db_mib: per(&mut |r| r.db_bytes.map(|b| b as f64 / (1024.0 * 1024.0))),
        }
        .with_runs(runs.len())
    }

    fn with_runs(mut self, runs: usize) -> Summary {
        self.runs = runs;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let mut v: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        assert_eq!(quantile_ms(&mut v, 0.5), Some(500.0));
        assert_eq!(quantile_ms(&mut v, 0.99), Some(990.0));
        assert_eq!(quantile_ms(&mut v, 0.999), Some(999.0));
        assert_eq!(quantile_ms(&mut [], 0.5), None);
    }

    #[test]
    fn spread_of_three() {
        let s = Spread::of(vec![3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(Spread::of(vec![4.0, 1.0]).unwrap().median, 2.5);
    }
}
