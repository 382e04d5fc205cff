//! A kernel's size rules as data: the dimensions its range may have, the range it must have,
//! its requirements on scalars and range, and the least elements of each buffer. Checked on the
//! daemon's hot path (every launch of the kernel): expressions were compiled when the manifest
//! loaded, the variables a launch binds are filled into a fixed array, nothing is parsed or
//! allocated.

use agora_kernels::{LaunchShape, ShapeCheck};
use agora_protocol::{ScalarType, TaskError, MAX_ARGS};

use crate::expr::{Expr, Num, Ty, Variable};

/// Variable slots: `range0..range2` first, then one per parameter (a scalar's value or a
/// buffer's length in elements).
pub(crate) const RANGE_SLOTS: usize = 3;
const SLOTS: usize = RANGE_SLOTS + MAX_ARGS;

/// What a parameter binds in expressions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// A scalar, by its name.
    Scalar(ScalarType),
    /// A buffer's length in elements of this many bytes, as `len_<name>`.
    Buffer(u64),
}

/// The variables expressions of a kernel with `params` (names and slots) and `dims`
/// dimensions may read.
pub(crate) fn variables(params: &[(String, Slot)], dims: usize) -> Vec<Variable> {
    let mut known: Vec<Variable> = (0..dims).map(|d| (format!("range{d}"), d as u8, Ty::Number)).collect();
    for (i, (name, slot)) in params.iter().enumerate() {
        let name = match slot {
            Slot::Scalar(_) => name.clone(),
            Slot::Buffer(_) => format!("len_{name}"),
        };
        known.push((name, (RANGE_SLOTS + i) as u8, Ty::Number));
    }
    known
}

/// Whom a failing expression blames: the first scalar it reads, else the range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blame {
    Scalar(usize),
    Range,
}

/// One compiled expression and whom its failure blames.
#[derive(Debug, Clone)]
pub(crate) struct Rule {
    expr: Expr,
    blame: Blame,
}

/// The checks of one kernel.
#[derive(Clone)]
pub(crate) struct Rules {
    kernel: String,
    dims: usize,
    params: Vec<Slot>,
    /// Slots any expression reads (bit set).
    used: u32,
    require: Vec<Rule>,
    range: Vec<Rule>,
    /// Buffer index, element size, least elements.
    sizes: Vec<(usize, u64, Rule)>,
}

impl std::fmt::Debug for Rules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let texts = |rules: &[Rule]| rules.iter().map(|r| r.expr.text.clone()).collect::<Vec<_>>();
        f.debug_struct("Rules")
            .field("kernel", &self.kernel)
            .field("dims", &self.dims)
            .field("require", &texts(&self.require))
            .field("range", &texts(&self.range))
            .field(
                "sizes",
                &self
                    .sizes
                    .iter()
                    .map(|(i, _, r)| (*i, r.expr.text.clone()))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Rules {
    /// Rules of `kernel` with parameter slots `params` and `dims` (1..=3) dimensions.
    pub(crate) fn new(kernel: String, dims: usize, params: Vec<Slot>) -> Self {
        Rules {
            kernel,
            dims,
            params,
            used: 0,
            require: Vec::new(),
            range: Vec::new(),
            sizes: Vec::new(),
        }
    }

    /// Names the kernel (for `Debug`) by its full name.
    pub(crate) fn set_kernel(&mut self, name: String) {
        self.kernel = name;
    }

    fn rule(&mut self, expr: Expr) -> Rule {
        self.used |= expr.vars;
        let blame = (RANGE_SLOTS..RANGE_SLOTS + self.params.len())
            .find(|slot| expr.vars & (1 << slot) != 0 && matches!(self.params[slot - RANGE_SLOTS], Slot::Scalar(_)))
            .map_or(Blame::Range, |slot| Blame::Scalar(slot - RANGE_SLOTS));
        Rule { expr, blame }
    }

    /// Adds a requirement (a condition).
    pub(crate) fn require(&mut self, expr: Expr) {
        let rule = self.rule(expr);
        self.require.push(rule);
    }

    /// Adds the extent the next dimension must have.
    pub(crate) fn range(&mut self, expr: Expr) {
        let rule = self.rule(expr);
        self.range.push(rule);
    }

    /// Adds the least elements of buffer `index`.
    pub(crate) fn size(&mut self, index: usize, expr: Expr) {
        let Slot::Buffer(element) = self.params[index] else {
            return;
        };
        let rule = self.rule(expr);
        self.sizes.push((index, element, rule));
    }

    fn blame(&self, blame: Blame, shape: &LaunchShape<'_>) -> TaskError {
        match blame {
            Blame::Scalar(index) => TaskError::InvalidScalar {
                index: index as u16,
                value: scalar_value(self.params[index], shape.scalars.get(index).copied().unwrap_or(0)),
            },
            Blame::Range => TaskError::InvalidRange {
                items: shape.range.iter().fold(1u64, |a, b| a.saturating_mul(*b)),
                max: u64::MAX,
            },
        }
    }
}

/// A scalar's value as `InvalidScalar` reports it.
fn scalar_value(slot: Slot, bits: u64) -> i64 {
    match slot {
        Slot::Scalar(ScalarType::I32) => i64::from(bits as u32 as i32),
        Slot::Scalar(ScalarType::U32) => i64::from(bits as u32),
        Slot::Scalar(ScalarType::F32) => f32::from_bits(bits as u32) as i64,
        Slot::Scalar(ScalarType::F64) => f64::from_bits(bits) as i64,
        _ => bits as i64,
    }
}

fn narrow(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

impl ShapeCheck for Rules {
    fn check(&self, shape: &LaunchShape<'_>) -> Result<(), TaskError> {
        let mut got = [1u64; 3];
        for (d, extent) in shape.range.iter().take(3).enumerate() {
            got[d] = *extent;
        }
        let mismatch = |expected: [u64; 3]| TaskError::RangeMismatch {
            expected_x: narrow(expected[0]),
            expected_y: narrow(expected[1]),
            got_x: narrow(got[0]),
            got_y: narrow(got[1]),
            got_z: u16::try_from(got[2]).unwrap_or(u16::MAX),
        };
        if shape.range.len() > 3 || got[self.dims..].iter().any(|e| *e != 1) {
            let mut expected = got;
            expected[self.dims..].fill(1);
            return Err(mismatch(expected));
        }
        let mut vars = [Num::Int(0); SLOTS];
        let mut used = self.used;
        while used != 0 {
            let slot = used.trailing_zeros() as usize;
            used &= used - 1;
            vars[slot] = if slot < RANGE_SLOTS {
                Num::Int(i64::try_from(got[slot]).map_err(|_| self.blame(Blame::Range, shape))?)
            } else {
                let index = slot - RANGE_SLOTS;
                match self.params[index] {
                    Slot::Buffer(element) => {
                        let len = shape.buffer_lens.get(index).copied().unwrap_or(0) / element;
                        Num::Int(i64::try_from(len).unwrap_or(i64::MAX))
                    }
                    Slot::Scalar(t) => {
                        let bits = shape.scalars.get(index).copied().unwrap_or(0);
                        match t {
                            ScalarType::I32 => Num::Int(i64::from(bits as u32 as i32)),
                            ScalarType::U32 => Num::Int(i64::from(bits as u32)),
                            ScalarType::I64 => Num::Int(bits as i64),
                            ScalarType::U64 => {
                                Num::Int(i64::try_from(bits).map_err(|_| self.blame(Blame::Scalar(index), shape))?)
                            }
                            ScalarType::F32 => Num::Float(f64::from(f32::from_bits(bits as u32))),
                            ScalarType::F64 => Num::Float(f64::from_bits(bits)),
                        }
                    }
                }
            };
        }
        for rule in &self.require {
            if rule.expr.holds(&vars) != Ok(true) {
                return Err(self.blame(rule.blame, shape));
            }
        }
        if !self.range.is_empty() {
            let mut expected = got;
            for (d, rule) in self.range.iter().enumerate() {
                expected[d] = rule.expr.count(&vars).map_err(|_| self.blame(rule.blame, shape))?;
            }
            if expected != got {
                return Err(mismatch(expected));
            }
        }
        for (index, element, rule) in &self.sizes {
            let elements = rule.expr.count(&vars).map_err(|_| self.blame(rule.blame, shape))?;
            shape.need(*index, elements, *element)?;
        }
        Ok(())
    }
}
