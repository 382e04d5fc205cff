//! The simulator's reports: counters per DAG and in total, and percentiles of response times.
//!
//! Owns only accumulation and summary arithmetic (nearest-rank percentiles over every finished
//! instance); it must not know how the engine schedules. Reports are serialisable so that a
//! later `agora bench rt` can print them as JSON unchanged.

use serde::Serialize;

use super::Policy;

/// p50, p99 and maximum of a set of durations, in microseconds (all 0 when empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct DurationPercentiles {
    /// Median.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Largest.
    pub max_us: u64,
}

/// p50, p99 and maximum of response time divided by deadline (above 1 is a miss).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct RatioPercentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

/// What happened to one DAG.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DagReport {
    /// The DAG's name.
    pub name: String,
    /// Instances released.
    pub releases: u64,
    /// Instances that finished after their end-to-end deadline.
    pub deadline_misses: u64,
    /// Of those, instances during which some job ran past its WCET budget (its own, a
    /// predecessor's, or any job's anywhere while one of its jobs was pending).
    pub overrun_misses: u64,
    /// Node jobs that finished after their derived node deadline.
    pub node_deadline_misses: u64,
    /// Times one of the DAG's nodes started or resumed on a lane other than the one it last ran
    /// on (for APEDF, its home lane counts as where it last ran before its first job).
    pub migrations: u64,
    /// Jobs of this DAG that were marked as overruns.
    pub overrun_jobs: u64,
    /// End-to-end response times.
    pub response_time: DurationPercentiles,
    /// Response time over deadline.
    pub response_over_deadline: RatioPercentiles,
    /// Release jitter: always 0, the simulator releases instances exactly on their period.
    pub release_jitter_us: u64,
}

/// Sums over all DAGs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TotalReport {
    /// Instances released.
    pub releases: u64,
    /// Instances that missed their end-to-end deadline.
    pub deadline_misses: u64,
    /// Of those, overrun-affected ones.
    pub overrun_misses: u64,
    /// `deadline_misses / releases` (0 when nothing was released).
    pub miss_ratio: f64,
    /// Node jobs that missed their derived deadline.
    pub node_deadline_misses: u64,
    /// Migrations.
    pub migrations: u64,
    /// Response over deadline, over every instance of every DAG.
    pub response_over_deadline: RatioPercentiles,
}

/// The result of one simulation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimulationReport {
    /// The policy simulated.
    pub policy: Policy,
    /// Lanes simulated.
    pub lanes: usize,
    /// Release window in microseconds.
    pub duration_us: u64,
    /// Time at which the last job finished.
    pub finished_at_us: u64,
    /// Per DAG, in workload order.
    pub dags: Vec<DagReport>,
    /// Totals.
    pub total: TotalReport,
}

/// Counters the engine fills for one DAG.
#[derive(Debug, Clone, Default)]
pub(super) struct DagCounters {
    pub releases: u64,
    pub deadline_misses: u64,
    pub overrun_misses: u64,
    pub node_deadline_misses: u64,
    pub migrations: u64,
    pub overrun_jobs: u64,
    pub response_times_us: Vec<u64>,
    pub ratios: Vec<f64>,
}

/// Nearest-rank percentile of sorted values.
fn nearest_rank<T: Copy + Default>(sorted: &[T], percent: usize) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let rank = (sorted.len() * percent).div_ceil(100).max(1);
    sorted[rank - 1]
}

fn duration_percentiles(values: &[u64]) -> DurationPercentiles {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    DurationPercentiles {
        p50_us: nearest_rank(&sorted, 50),
        p99_us: nearest_rank(&sorted, 99),
        max_us: sorted.last().copied().unwrap_or(0),
    }
}

fn ratio_percentiles(values: &[f64]) -> RatioPercentiles {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    RatioPercentiles {
        p50: nearest_rank(&sorted, 50),
        p99: nearest_rank(&sorted, 99),
        max: sorted.last().copied().unwrap_or(0.0),
    }
}

pub(super) fn build_report(
    policy: Policy,
    lanes: usize,
    duration_us: u64,
    finished_at_us: u64,
    names: Vec<String>,
    counters: Vec<DagCounters>,
) -> SimulationReport {
    let dags: Vec<DagReport> = names
        .into_iter()
        .zip(&counters)
        .map(|(name, counter)| DagReport {
            name,
            releases: counter.releases,
            deadline_misses: counter.deadline_misses,
            overrun_misses: counter.overrun_misses,
            node_deadline_misses: counter.node_deadline_misses,
            migrations: counter.migrations,
            overrun_jobs: counter.overrun_jobs,
            response_time: duration_percentiles(&counter.response_times_us),
            response_over_deadline: ratio_percentiles(&counter.ratios),
            release_jitter_us: 0,
        })
        .collect();
    let all_ratios: Vec<f64> = counters
        .iter()
        .flat_map(|counter| counter.ratios.iter().copied())
        .collect();
    let releases: u64 = dags.iter().map(|dag| dag.releases).sum();
    let deadline_misses: u64 = dags.iter().map(|dag| dag.deadline_misses).sum();
    let total = TotalReport {
        releases,
        deadline_misses,
        overrun_misses: dags.iter().map(|dag| dag.overrun_misses).sum(),
        miss_ratio: if releases == 0 {
            0.0
        } else {
            deadline_misses as f64 / releases as f64
        },
        node_deadline_misses: dags.iter().map(|dag| dag.node_deadline_misses).sum(),
        migrations: dags.iter().map(|dag| dag.migrations).sum(),
        response_over_deadline: ratio_percentiles(&all_ratios),
    };
    SimulationReport {
        policy,
        lanes,
        duration_us,
        finished_at_us,
        dags,
        total,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let values: Vec<u64> = (1..=100).collect();
        let percentiles = duration_percentiles(&values);
        assert_eq!(
            percentiles,
            DurationPercentiles {
                p50_us: 50,
                p99_us: 99,
                max_us: 100
            }
        );
        assert_eq!(duration_percentiles(&[]), DurationPercentiles::default());
        assert_eq!(duration_percentiles(&[7]).p99_us, 7);
    }
}
