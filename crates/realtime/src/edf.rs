//! The uniprocessor EDF test that decides whether a set of node reservations fits on one lane.
//!
//! Owns the schedulability arithmetic and nothing else: which lane to try, and what to do when
//! nothing fits, belong to [`crate::admission`]. Each reservation is a node of some DAG: budget
//! `C`, release offset `O` and relative deadline `D` inside the DAG's period `T`, with
//! `O + D ≤ T`. Reservations of the same DAG form one *group* and are analysed with their
//! offsets (the nodes of one DAG instance are released one after another, never all at once);
//! different groups are assumed to be released with any phasing, so their demands add up.
//!
//! The test, cheapest first:
//! 1. utilisation `Σ C/T` above 1 fails outright;
//! 2. density `Σ C/D` (plus blocking over the shortest deadline) at most 1 passes: it is
//!    sufficient, and exact rational arithmetic is used when the denominators allow;
//! 3. otherwise the processor-demand criterion, `h(t) ≤ t` for every deadline `t` below the
//!    bound `L = (Σ C + B) / (1 − U)`, walked downwards with QPA (Zhang & Burns, 2009). For a
//!    group, `h` counts, for the worst choice of which of its jobs opens the interval, every job
//!    whose whole window lies inside the interval. That is exact for one group and an upper bound
//!    for several, so a pass is a guarantee.
//!
//! Utilisation within 10⁻⁹ of 1 with density above 1, and walks longer than a fixed number of
//! steps, answer [`EdfVerdict::Inconclusive`], which callers treat as "does not fit": refusing
//! is always safe, admitting is not.
//!
//! A job released earlier than its nominal offset (because its predecessors finished early)
//! only widens its window, which can only lower the demand in any interval; the test therefore
//! also covers DAG nodes that are released when their last predecessor finishes.

use std::collections::BTreeMap;

/// One node's reservation on a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneTask {
    /// Which DAG (or other periodic group) the reservation belongs to. Reservations of one group
    /// must share the period and are analysed with their offsets.
    pub group: u64,
    /// The group's period in microseconds.
    pub period_us: u64,
    /// Release offset within the period, in microseconds.
    pub release_offset_us: u64,
    /// Relative deadline from the release, in microseconds.
    pub relative_deadline_us: u64,
    /// Execution budget (WCET with margin) in microseconds.
    pub budget_us: u64,
}

/// What [`lane_test`] concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EdfVerdict {
    /// Fits: density (with blocking) is at most 1.
    FeasibleByDensity,
    /// Fits: the processor-demand criterion holds at every deadline up to the bound.
    FeasibleByDemand,
    /// Does not fit: the reservations ask for more than the whole lane in the long run.
    UtilisationAboveOne,
    /// Does not fit: in some interval of `at_us` microseconds, `demand_us` of work must finish.
    DemandExceeded {
        /// Length of the interval.
        at_us: u64,
        /// Work that must be done inside it.
        demand_us: u128,
    },
    /// The analysis could not decide within its limits; treat as "does not fit".
    Inconclusive,
}

impl EdfVerdict {
    /// Whether the reservations are guaranteed to meet every deadline on one lane.
    pub fn is_feasible(self) -> bool {
        matches!(self, Self::FeasibleByDensity | Self::FeasibleByDemand)
    }
}

/// Most QPA steps before giving up; far above what realistic lanes need (tens of steps).
const MAX_DEMAND_STEPS: usize = 200_000;
/// Utilisation this close to 1 makes the bound `L` explode; such a lane is refused instead.
const UTILISATION_MARGIN: f64 = 1e-9;

/// Sum of `C/T` over the reservations.
pub fn utilisation(tasks: &[LaneTask]) -> f64 {
    // Folded from +0.0: `Sum` for floats starts at -0.0, which an empty lane printed as
    // "-0.000".
    tasks
        .iter()
        .map(|task| task.budget_us as f64 / task.period_us as f64)
        .fold(0.0, |sum, u| sum + u)
}

/// Sum of `C/D` over the reservations (a reservation with a zero deadline counts as 1 when it
/// has a budget, 0 otherwise).
pub fn density(tasks: &[LaneTask]) -> f64 {
    tasks
        .iter()
        .map(|task| density_of(task.budget_us, task.relative_deadline_us))
        .fold(0.0, |sum, d| sum + d)
}

fn density_of(budget_us: u64, relative_deadline_us: u64) -> f64 {
    match (budget_us, relative_deadline_us) {
        (0, _) => 0.0,
        (_, 0) => f64::INFINITY,
        (budget, deadline) => budget as f64 / deadline as f64,
    }
}

/// Decides whether `tasks` meet every deadline under preemptive EDF on one lane, when any job
/// may additionally be blocked once by up to `blocking_us` of non-preemptible work.
pub fn lane_test(tasks: &[LaneTask], blocking_us: u64) -> EdfVerdict {
    let tasks: Vec<LaneTask> = tasks.iter().copied().filter(|task| task.budget_us > 0).collect();
    if tasks.is_empty() {
        return EdfVerdict::FeasibleByDensity;
    }
    if tasks
        .iter()
        .any(|task| task.relative_deadline_us < task.budget_us || task.period_us == 0)
    {
        return EdfVerdict::DemandExceeded {
            at_us: tasks.iter().map(|task| task.relative_deadline_us).min().unwrap_or(0),
            demand_us: tasks.iter().map(|task| u128::from(task.budget_us)).max().unwrap_or(0),
        };
    }
    let total_utilisation = utilisation(&tasks);
    if total_utilisation > 1.0 + 1e-12 {
        return EdfVerdict::UtilisationAboveOne;
    }
    let shortest_deadline = tasks.iter().map(|task| task.relative_deadline_us).min().unwrap_or(1);
    if density_at_most_one(&tasks, blocking_us, shortest_deadline) {
        return EdfVerdict::FeasibleByDensity;
    }
    if total_utilisation > 1.0 - UTILISATION_MARGIN {
        return EdfVerdict::Inconclusive;
    }
    let groups = Group::collect(&tasks);
    processor_demand(&groups, blocking_us, shortest_deadline, total_utilisation)
}

/// `Σ C/D + B/D_min ≤ 1`, exactly when the fractions fit in 128 bits, else in floating point
/// with a margin that errs towards "no".
fn density_at_most_one(tasks: &[LaneTask], blocking_us: u64, shortest_deadline: u64) -> bool {
    let terms = tasks
        .iter()
        .map(|task| (task.budget_us, task.relative_deadline_us))
        .chain((blocking_us > 0).then_some((blocking_us, shortest_deadline)));
    if let Some(at_most_one) = exact_sum_at_most_one(terms.clone()) {
        return at_most_one;
    }
    terms
        .map(|(budget, deadline)| density_of(budget, deadline))
        .sum::<f64>()
        <= 1.0 - 1e-9
}

/// Exact `Σ numerator/denominator ≤ 1`, or `None` if the arithmetic would overflow.
fn exact_sum_at_most_one(terms: impl Iterator<Item = (u64, u64)>) -> Option<bool> {
    let (mut numerator, mut denominator) = (0u128, 1u128);
    for (term_numerator, term_denominator) in terms {
        let (term_numerator, term_denominator) = (u128::from(term_numerator), u128::from(term_denominator));
        if term_denominator == 0 {
            return Some(false);
        }
        numerator = numerator
            .checked_mul(term_denominator)?
            .checked_add(term_numerator.checked_mul(denominator)?)?;
        denominator = denominator.checked_mul(term_denominator)?;
        let divisor = gcd(numerator, denominator);
        numerator /= divisor;
        denominator /= divisor;
        if numerator > denominator {
            return Some(false);
        }
    }
    Some(numerator <= denominator)
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}

/// The reservations of one group: jobs `(offset, deadline, budget)` repeating every `period`.
struct Group {
    period: u64,
    jobs: Vec<(u64, u64, u64)>,
}

impl Group {
    /// Groups reservations by `group`. A group whose members disagree on the period, or a member
    /// whose window does not fit in its period, is split into independent single tasks with
    /// offset 0 (the classic sporadic analysis), which is never less safe.
    fn collect(tasks: &[LaneTask]) -> Vec<Group> {
        let mut by_group: BTreeMap<u64, Vec<LaneTask>> = BTreeMap::new();
        for task in tasks {
            by_group.entry(task.group).or_default().push(*task);
        }
        let mut groups = Vec::new();
        for members in by_group.into_values() {
            let period = members[0].period_us;
            let consistent = members.iter().all(|task| {
                task.period_us == period && task.release_offset_us.saturating_add(task.relative_deadline_us) <= period
            });
            if consistent {
                let jobs = members
                    .iter()
                    .map(|task| (task.release_offset_us, task.relative_deadline_us, task.budget_us))
                    .collect();
                groups.push(Group { period, jobs });
            } else {
                for task in members {
                    groups.push(Group {
                        period: task.period_us,
                        jobs: vec![(0, task.relative_deadline_us, task.budget_us)],
                    });
                }
            }
        }
        groups
    }

    /// Distance from the release of job `opening` to the next release of job `other`.
    fn phase(&self, opening: usize, other: usize) -> u64 {
        let (opening_offset, other_offset) = (self.jobs[opening].0, self.jobs[other].0);
        if other_offset >= opening_offset {
            other_offset - opening_offset
        } else {
            other_offset + self.period - opening_offset
        }
    }

    /// Most work of this group whose windows lie entirely inside some interval of length `t`.
    fn demand(&self, t: u64) -> u128 {
        let mut worst = 0u128;
        for opening in 0..self.jobs.len() {
            let mut total = 0u128;
            for (other, &(_, deadline, budget)) in self.jobs.iter().enumerate() {
                let first_deadline = self.phase(opening, other) + deadline;
                if t >= first_deadline {
                    let count = u128::from((t - first_deadline) / self.period) + 1;
                    total += count * u128::from(budget);
                }
            }
            worst = worst.max(total);
        }
        worst
    }

    /// The largest interval length below `t` at which this group's demand can step up.
    fn largest_step_below(&self, t: u64) -> Option<u64> {
        let mut largest = None;
        for opening in 0..self.jobs.len() {
            for (other, &(_, deadline, _)) in self.jobs.iter().enumerate() {
                let first_deadline = self.phase(opening, other) + deadline;
                if t > first_deadline {
                    let step = first_deadline + (t - 1 - first_deadline) / self.period * self.period;
                    largest = largest.max(Some(step));
                }
            }
        }
        largest
    }
}

fn processor_demand(groups: &[Group], blocking_us: u64, shortest_deadline: u64, total_utilisation: f64) -> EdfVerdict {
    let total_budget: u128 = groups
        .iter()
        .flat_map(|group| group.jobs.iter().map(|&(_, _, budget)| u128::from(budget)))
        .sum();
    // h(t) ≤ U·t + ΣC + B, so a violation needs t < (ΣC + B)/(1 − U). Rounded up, plus one, so
    // floating point can only make the walk start later, never skip a point.
    let bound = (total_budget + u128::from(blocking_us)) as f64 / (1.0 - total_utilisation);
    let bound = (bound * (1.0 + 1e-9)).ceil() + 1.0;
    let bound = if bound >= u64::MAX as f64 {
        u64::MAX
    } else {
        bound as u64
    };

    let demand =
        |t: u64| -> u128 { groups.iter().map(|group| group.demand(t)).sum::<u128>() + u128::from(blocking_us) };
    let largest_step_below = |t: u64| groups.iter().filter_map(|group| group.largest_step_below(t)).max();

    let Some(mut t) = largest_step_below(bound) else {
        return EdfVerdict::FeasibleByDemand;
    };
    for _ in 0..MAX_DEMAND_STEPS {
        let needed = demand(t);
        if needed > u128::from(t) {
            return EdfVerdict::DemandExceeded {
                at_us: t,
                demand_us: needed,
            };
        }
        if needed <= u128::from(shortest_deadline) {
            return EdfVerdict::FeasibleByDemand;
        }
        // needed ≤ t fits in u64.
        let needed = needed as u64;
        if needed < t {
            // No deadline in [needed, t] can fail: demand there is at most demand(t) = needed.
            t = needed;
        } else {
            match largest_step_below(t) {
                Some(step) => t = step,
                None => return EdfVerdict::FeasibleByDemand,
            }
        }
    }
    EdfVerdict::Inconclusive
}

#[cfg(test)]
mod tests {
    /// An empty lane's utilisation and density are +0 (printed "0.000", not "-0.000": audit
    /// C-D11).
    #[test]
    fn an_empty_lane_is_positive_zero() {
        assert!(super::utilisation(&[]).is_sign_positive());
        assert!(super::density(&[]).is_sign_positive());
        assert_eq!(format!("{:.3}", super::utilisation(&[])), "0.000");
    }

    use super::*;

    fn task(group: u64, period: u64, offset: u64, deadline: u64, budget: u64) -> LaneTask {
        LaneTask {
            group,
            period_us: period,
            release_offset_us: offset,
            relative_deadline_us: deadline,
            budget_us: budget,
        }
    }

    #[test]
    fn density_passes_implicit_deadlines_up_to_exactly_one() {
        let tasks = [task(0, 10, 0, 10, 5), task(1, 20, 0, 20, 10)];
        assert_eq!(lane_test(&tasks, 0), EdfVerdict::FeasibleByDensity);
        let over = [task(0, 10, 0, 10, 5), task(1, 20, 0, 20, 11)];
        assert_eq!(lane_test(&over, 0), EdfVerdict::UtilisationAboveOne);
    }

    #[test]
    fn demand_criterion_decides_when_density_exceeds_one() {
        // Density 2/4 + 3/6 + 2/12 > 1, utilisation 2/8 + 3/12 + 2/12 < 1. The classic dbf: at
        // t = 4: 2; t = 6: 5; t = 12: 2·2 + 3 + 2 = 9 ≤ 12 … feasible.
        let tasks = [task(0, 8, 0, 4, 2), task(1, 12, 0, 6, 3), task(2, 12, 0, 12, 2)];
        assert_eq!(lane_test(&tasks, 0), EdfVerdict::FeasibleByDemand);
        // Two tasks each needing 3 within 4: demand 6 at t = 4.
        let tight = [task(0, 10, 0, 4, 3), task(1, 10, 0, 4, 3)];
        assert_eq!(
            lane_test(&tight, 0),
            EdfVerdict::DemandExceeded { at_us: 4, demand_us: 6 }
        );
    }

    #[test]
    fn offsets_of_one_dag_let_a_chain_share_a_lane() {
        // A chain of three nodes, each with a third of the period: as independent tasks they
        // would need 3·2 = 6 within 3; with their offsets they never overlap.
        let chain = [task(7, 9, 0, 3, 2), task(7, 9, 3, 3, 2), task(7, 9, 6, 3, 2)];
        assert_eq!(lane_test(&chain, 0), EdfVerdict::FeasibleByDemand);
        let independent = [task(1, 9, 0, 3, 2), task(2, 9, 3, 3, 2), task(3, 9, 6, 3, 2)];
        assert!(!lane_test(&independent, 0).is_feasible());
    }

    #[test]
    fn a_full_lane_with_density_above_one_is_refused_as_inconclusive() {
        // Utilisation exactly 1 with constrained deadlines: the demand bound would need the
        // hyperperiod; refusing is the safe answer.
        let tasks = [task(7, 9, 0, 3, 3), task(7, 9, 3, 3, 3), task(7, 9, 6, 3, 3)];
        assert_eq!(lane_test(&tasks, 0), EdfVerdict::Inconclusive);
    }

    #[test]
    fn blocking_counts_against_the_shortest_deadline() {
        let tasks = [task(0, 100, 0, 10, 8)];
        assert!(lane_test(&tasks, 2).is_feasible());
        assert!(!lane_test(&tasks, 3).is_feasible());
    }

    #[test]
    fn exact_fractions_accept_a_full_lane() {
        let tasks = [task(0, 3, 0, 3, 1), task(1, 3, 0, 3, 1), task(2, 3, 0, 3, 1)];
        assert_eq!(lane_test(&tasks, 0), EdfVerdict::FeasibleByDensity);
    }
}
