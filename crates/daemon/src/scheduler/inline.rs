//! The inline guard: which launches the dispatcher may run on its own thread.
//!
//! Running a tiny task inline skips a thread hand-off worth more than the task, but while it
//! runs every tenant waits. The library's estimate cannot be trusted for that: a launch's cost
//! may hide in its scalars and buffers (an `sgemm` with m = n = 1 and k = 2^26 is one work item
//! and 0.1 s of work). So a launch runs inline only when its **shape class** — kernel, work
//! items, bytes of buffer arguments and its largest scalar, each as a power of two — has been
//! measured short: an unseen class goes to a lane first, whose measurement decides; a class
//! that overran inline goes back to lanes until a lane measures it short again. The bytes a
//! launch may touch also bound it from the arguments alone: too many, and it never runs inline.
//!
//! Owns: the verdict per shape class (bounded in number: an adversary inventing classes only
//! sends its own launches to lanes) and the longest inline run (exported as a metric).
//!
//! Must not: run anything, or decide anything else about placement.

use std::collections::HashMap;
use std::sync::Mutex;

use agora_kernels::ArgValue;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::atomic::AtomicU64;

use super::validate::{Action, Ready};

/// Most shape classes remembered; beyond, the table starts afresh.
const MAX_CLASSES: usize = 4096;

/// Host bandwidth assumed for the bytes bound, bytes per nanosecond (10 GB/s: a fast core).
const BYTES_PER_NS: f64 = 10.0;

/// What sets a launch's cost apart from another's of the same kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ShapeClass {
    /// The kernel (its definition's address: definitions are `'static`).
    kernel: usize,
    /// Ceiling of log2 of the work items, the buffer bytes and the largest scalar.
    items: u8,
    bytes: u8,
    scalar: u8,
}

/// What is known of a shape class.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Verdict {
    /// The shortest execution a lane measured, nanoseconds: wall time on a loaded machine only
    /// ever adds to a task's cost, so the minimum is the best estimate of it.
    shortest_on_lane_ns: f64,
    /// It overran inline since the last short lane measurement.
    overran: bool,
}

/// See the module documentation.
pub(crate) struct InlineGuard {
    /// Nanoseconds under which a task may run inline (the scheduler's `inline_max_ns`).
    limit_ns: f64,
    verdicts: Mutex<HashMap<ShapeClass, Verdict, rustc_hash::FxBuildHasher>>,
    longest_inline: Gauge<f64, AtomicU64>,
    refused: Counter,
}

fn log2_ceiling(v: u64) -> u8 {
    (64 - v.saturating_sub(1).leading_zeros()) as u8
}

impl InlineGuard {
    pub(crate) fn new(limit_ns: f64, longest_inline: Gauge<f64, AtomicU64>, refused: Counter) -> Self {
        InlineGuard {
            limit_ns,
            verdicts: Mutex::new(HashMap::default()),
            longest_inline,
            refused,
        }
    }

    /// The shape class of a launch; `None` for transfers, whose cost their length bounds.
    pub(crate) fn class(ready: &Ready) -> Option<ShapeClass> {
        let Action::Launch {
            kernel,
            args,
            arg_count,
            ..
        } = &ready.action
        else {
            return None;
        };
        let mut largest_scalar = 0u64;
        for arg in &args[..*arg_count] {
            if let ArgValue::Scalar(bits) = arg {
                // Signed and floating scalars are compared as raw bits: a class is a label,
                // not a measure; what matters is that different sizes get different labels.
                largest_scalar = largest_scalar.max(*bits);
            }
        }
        Some(ShapeClass {
            kernel: &**kernel as *const agora_kernels::KernelDef as usize,
            items: log2_ceiling(ready.items),
            bytes: log2_ceiling(ready.touched_bytes),
            scalar: log2_ceiling(largest_scalar),
        })
    }

    /// Whether a launch of `class` whose buffers hold `bytes` may run inline.
    pub(crate) fn allows(&self, class: Option<ShapeClass>, bytes: u64) -> bool {
        let Some(class) = class else {
            return true;
        };
        let allowed = bytes as f64 / BYTES_PER_NS <= self.limit_ns
            && self
                .verdicts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&class)
                .is_some_and(|v| !v.overran && v.shortest_on_lane_ns <= self.short_ns());
        if !allowed {
            self.refused.inc();
        }
        allowed
    }

    /// Longest a run may take and still count as short, nanoseconds: a few times the inline
    /// limit, and at least 50 µs, as a lane's measurement includes its own start-up and a
    /// context switch adds tens of microseconds to anything. It bounds how long one inline
    /// run can stall the dispatcher by more than the scheduling noise.
    fn short_ns(&self) -> f64 {
        (4.0 * self.limit_ns).max(50_000.0)
    }

    /// A lane ran a launch of `class` for `ns` of execution.
    pub(crate) fn measured_on_lane(&self, class: ShapeClass, ns: f64) {
        let short = ns <= self.short_ns();
        self.update(class, |v| Verdict {
            shortest_on_lane_ns: v.shortest_on_lane_ns.min(ns),
            overran: v.overran && !short,
        });
    }

    /// The dispatcher ran a launch of `class` (or any task when `None`) inline for `ns`.
    pub(crate) fn ran_inline(&self, class: Option<ShapeClass>, ns: f64) {
        if ns / 1e9 > self.longest_inline.get() {
            self.longest_inline.set(ns / 1e9);
        }
        // Overran: to lanes until a lane measures it short again.
        if let Some(class) = class {
            if ns > self.short_ns() {
                tracing::debug!(ns, "a launch ran long inline; its shape goes to lanes");
                self.update(class, |v| Verdict { overran: true, ..v });
            }
        }
    }

    fn update(&self, class: ShapeClass, change: impl FnOnce(Verdict) -> Verdict) {
        let mut verdicts = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        if verdicts.len() >= MAX_CLASSES && !verdicts.contains_key(&class) {
            verdicts.clear();
        }
        let entry = verdicts.entry(class).or_insert(Verdict {
            shortest_on_lane_ns: f64::INFINITY,
            overran: false,
        });
        *entry = change(*entry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard() -> InlineGuard {
        InlineGuard::new(5_000.0, Gauge::default(), Counter::default())
    }

    fn class(scalar: u8) -> Option<ShapeClass> {
        Some(ShapeClass {
            kernel: 1,
            items: 0,
            bytes: 10,
            scalar,
        })
    }

    #[test]
    fn unseen_shapes_go_to_lanes_until_a_lane_measures_them_short() {
        let g = guard();
        assert!(!g.allows(class(3), 1024), "unseen");
        g.measured_on_lane(class(3).unwrap(), 800.0);
        assert!(g.allows(class(3), 1024));
        // The same kernel with a far larger scalar is another shape.
        assert!(!g.allows(class(26), 1024));
        g.measured_on_lane(class(26).unwrap(), 80_000_000.0);
        assert!(!g.allows(class(26), 1024));
        // A lane measurement slowed by load does not undo a short one.
        g.measured_on_lane(class(3).unwrap(), 900_000.0);
        assert!(g.allows(class(3), 1024));
        // Transfers are bounded by their length elsewhere.
        assert!(g.allows(None, 0));
    }

    #[test]
    fn an_inline_overrun_sends_the_shape_back_to_lanes_and_is_the_longest_stall() {
        let g = guard();
        g.measured_on_lane(class(3).unwrap(), 800.0);
        g.ran_inline(class(3), 2_000.0);
        assert!(g.allows(class(3), 1024));
        g.ran_inline(class(3), 3_000_000.0);
        assert!(!g.allows(class(3), 1024));
        assert_eq!(g.longest_inline.get(), 3e-3);
        // A lane may bring it back.
        g.measured_on_lane(class(3).unwrap(), 900.0);
        assert!(g.allows(class(3), 1024));
    }

    #[test]
    fn too_many_bytes_never_run_inline() {
        let g = guard();
        g.measured_on_lane(class(3).unwrap(), 800.0);
        // 5 µs at 10 GB/s is 50 kB.
        assert!(g.allows(class(3), 40_000));
        assert!(!g.allows(class(3), 1 << 26));
    }

    #[test]
    fn the_table_stays_bounded() {
        let g = guard();
        for k in 0..(MAX_CLASSES as u64 + 10) {
            let class = ShapeClass {
                kernel: k as usize,
                items: 0,
                bytes: 0,
                scalar: 0,
            };
            g.measured_on_lane(class, 100.0);
        }
        assert!(g.verdicts.lock().unwrap().len() <= MAX_CLASSES);
    }
}
