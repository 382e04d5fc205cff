//! Human-readable durations for error messages and reports.
//!
//! Owns only formatting: every time in this crate is an integer number of microseconds, and
//! messages print it the way an operator thinks of it ("7 ms", "7.25 ms", "750 µs"). It must not
//! parse anything or round in a way that hides arithmetic: a value that is not a whole number of
//! milliseconds keeps its microseconds.

use std::fmt;

/// A duration in microseconds that prints itself in the unit an operator would use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Micros(pub u64);

impl fmt::Display for Micros {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let micros = self.0;
        if micros < 1_000 {
            return write!(formatter, "{micros} µs");
        }
        let whole = micros / 1_000;
        let fraction = micros % 1_000;
        if fraction == 0 {
            write!(formatter, "{whole} ms")
        } else {
            // Three digits, then drop trailing zeros: 7.250 ms reads as 7.25 ms.
            let digits = format!("{fraction:03}");
            write!(formatter, "{whole}.{} ms", digits.trim_end_matches('0'))
        }
    }
}

/// Joins node names into a path such as `a → b → c`.
pub(crate) fn arrow_path(names: &[String]) -> String {
    names.join(" → ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_the_natural_unit() {
        assert_eq!(Micros(750).to_string(), "750 µs");
        assert_eq!(Micros(7_000).to_string(), "7 ms");
        assert_eq!(Micros(7_250).to_string(), "7.25 ms");
        assert_eq!(Micros(7_001).to_string(), "7.001 ms");
    }
}
