//! Task descriptors: the fixed-size records a client writes into its submission ring.
//!
//! A descriptor is plain old data: every bit pattern is a valid [`TaskDescriptor`], so copying one
//! out of hostile shared memory is always sound. [`TaskDescriptor::decode`] then checks the
//! fields that need no session state (operation code, argument tags and count, range); the
//! daemon checks handles, kernel ids and signatures against the session afterwards.

use bytemuck::{Pod, Zeroable};

use crate::completion::{Malformed, TaskError};
use crate::signature::ScalarType;

/// Most arguments a kernel launch can carry (Rodinia's hotspot needs 13).
pub const MAX_ARGS: usize = 16;
/// Largest number of work items one launch may cover (product of its range), 2^40.
pub const MAX_RANGE_ITEMS: u64 = 1 << 40;

/// Operation codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Op {
    /// Run a kernel: `kernel`, `args[..arg_count]`, `range[..dims]`.
    Launch = 1,
    /// Make the device side see the host copy: `args[0]` buffer, `args[1]` offset, `args[2]` length (0 = to the end).
    SyncTo = 2,
    /// Make the host copy current: same arguments as [`Op::SyncTo`].
    SyncFrom = 3,
    /// Fill bytes: `args[0]` buffer, `args[1]` byte value, `args[2]` offset, `args[3]` length (0 = to the end).
    Memset = 4,
    /// Copy between buffers: `args[0]` source, `args[1]` destination, `args[2]` source offset,
    /// `args[3]` destination offset, `args[4]` length (0 = the whole source from its offset).
    Copy = 5,
    /// Release a buffer handle (`args[0]`); its memory is reclaimed once no task uses it.
    ReleaseBuffer = 6,
    /// Release the queue named by `queue` after its earlier tasks.
    ReleaseQueue = 7,
    /// Checkpoint the session's protected buffers after the queue's earlier tasks (FTI's
    /// `checkpoint`): `args[0]` the checkpoint's id (a `u64`, larger than the application's
    /// previous one), `args[1]` its level (`u32`, 1–4). The task completes once the bytes are
    /// captured; the daemon writes them in the background.
    Checkpoint = 8,
    /// Release the tenant program whose kernel `kernel` is (one of its ids; the client sends
    /// its first): the session holds it once less, and when it holds it no more its slot is
    /// free, its kernel ids are refused from then on (never reused), and its executor unloads
    /// its code once no task issued before uses it. Ordered after every task issued before it.
    /// Added without a new [`crate::PROTOCOL_VERSION`]: an older daemon fails it with
    /// `Malformed::UnknownOp` and keeps the program, as it always did.
    ReleaseProgram = 9,
}

impl Op {
    /// Decodes an operation code.
    pub fn from_u32(value: u32) -> Option<Op> {
        Some(match value {
            1 => Op::Launch,
            2 => Op::SyncTo,
            3 => Op::SyncFrom,
            4 => Op::Memset,
            5 => Op::Copy,
            6 => Op::ReleaseBuffer,
            7 => Op::ReleaseQueue,
            8 => Op::Checkpoint,
            9 => Op::ReleaseProgram,
            _ => return None,
        })
    }
}

/// Argument tags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum ArgTag {
    /// A buffer handle.
    Buffer = 1,
    /// A scalar of the given type.
    I32 = 2,
    /// `u32` scalar.
    U32 = 3,
    /// `i64` scalar.
    I64 = 4,
    /// `u64` scalar.
    U64 = 5,
    /// `f32` scalar.
    F32 = 6,
    /// `f64` scalar.
    F64 = 7,
}

impl ArgTag {
    /// Decodes a tag.
    pub fn from_u32(value: u32) -> Option<ArgTag> {
        Some(match value {
            1 => ArgTag::Buffer,
            2 => ArgTag::I32,
            3 => ArgTag::U32,
            4 => ArgTag::I64,
            5 => ArgTag::U64,
            6 => ArgTag::F32,
            7 => ArgTag::F64,
            _ => return None,
        })
    }

    /// The scalar type of a scalar tag.
    pub fn scalar(self) -> Option<ScalarType> {
        Some(match self {
            ArgTag::Buffer => return None,
            ArgTag::I32 => ScalarType::I32,
            ArgTag::U32 => ScalarType::U32,
            ArgTag::I64 => ScalarType::I64,
            ArgTag::U64 => ScalarType::U64,
            ArgTag::F32 => ScalarType::F32,
            ArgTag::F64 => ScalarType::F64,
        })
    }

    /// The tag for a scalar type.
    pub fn for_scalar(t: ScalarType) -> ArgTag {
        match t {
            ScalarType::I32 => ArgTag::I32,
            ScalarType::U32 => ArgTag::U32,
            ScalarType::I64 => ArgTag::I64,
            ScalarType::U64 => ArgTag::U64,
            ScalarType::F32 => ArgTag::F32,
            ScalarType::F64 => ArgTag::F64,
        }
    }

    /// Name used in messages.
    pub fn name(self) -> &'static str {
        match self.scalar() {
            None => "buffer",
            Some(t) => t.name(),
        }
    }
}

/// One argument slot: a tag and 64 bits of payload (a handle or a scalar's bits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct RawArg {
    /// An [`ArgTag`] value.
    pub tag: u32,
    /// Zero.
    pub reserved: u32,
    /// Handle, or scalar bits (32-bit scalars in the low half).
    pub value: u64,
}

impl RawArg {
    /// A buffer handle argument.
    pub fn buffer(handle: u64) -> Self {
        RawArg {
            tag: ArgTag::Buffer as u32,
            reserved: 0,
            value: handle,
        }
    }
    /// An `f32` argument.
    pub fn f32(v: f32) -> Self {
        RawArg {
            tag: ArgTag::F32 as u32,
            reserved: 0,
            value: u64::from(v.to_bits()),
        }
    }
    /// An `f64` argument.
    pub fn f64(v: f64) -> Self {
        RawArg {
            tag: ArgTag::F64 as u32,
            reserved: 0,
            value: v.to_bits(),
        }
    }
    /// An `i32` argument.
    pub fn i32(v: i32) -> Self {
        RawArg {
            tag: ArgTag::I32 as u32,
            reserved: 0,
            value: u64::from(v as u32),
        }
    }
    /// A `u32` argument.
    pub fn u32(v: u32) -> Self {
        RawArg {
            tag: ArgTag::U32 as u32,
            reserved: 0,
            value: u64::from(v),
        }
    }
    /// An `i64` argument.
    pub fn i64(v: i64) -> Self {
        RawArg {
            tag: ArgTag::I64 as u32,
            reserved: 0,
            value: v as u64,
        }
    }
    /// A `u64` argument.
    pub fn u64(v: u64) -> Self {
        RawArg {
            tag: ArgTag::U64 as u32,
            reserved: 0,
            value: v,
        }
    }
}

/// The fixed-size submission record (320 bytes, five cache lines).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct TaskDescriptor {
    /// Client-chosen id echoed in the completion; the daemon attaches no meaning to it.
    pub task_id: u64,
    /// Queue handle.
    pub queue: u64,
    /// An [`Op`] value.
    pub op: u32,
    /// Kernel id from a lookup (launch only).
    pub kernel: u32,
    /// Number of meaningful entries in `args`.
    pub arg_count: u32,
    /// Number of meaningful entries in `range` (1..=3, launch only).
    pub dims: u32,
    /// Global range per dimension (launch only).
    pub range: [u64; 3],
    /// Launch only: the first row (of dimension 0) of a **row window**, with
    /// [`TaskDescriptor::window_rows`]. The launch keeps its whole range for its size checks and
    /// indexing, but only rows `window_first .. window_first + window_rows` run (a chunkable
    /// kernel's rows are independent): a long launch issued as windows, with a checkpoint after
    /// each, resumes after a crash from the last checkpointed window (FTI's partial-task
    /// checkpoints). Both zero: the whole range.
    pub window_first: u32,
    /// Launch only: rows in the window (0: no window, the whole range).
    pub window_rows: u32,
    /// Arguments.
    pub args: [RawArg; MAX_ARGS],
}

const _: () = assert!(std::mem::size_of::<TaskDescriptor>() == 320);

/// A descriptor whose stateless fields have been checked.
#[derive(Clone, Copy, Debug)]
pub struct Decoded<'a> {
    /// The operation.
    pub op: Op,
    /// The task id to echo.
    pub task_id: u64,
    /// Queue handle (unchecked: the session resolves it).
    pub queue: u64,
    /// Kernel id (unchecked: the kernel table resolves it).
    pub kernel: u32,
    /// Arguments with valid tags.
    pub args: &'a [RawArg],
    /// Range, dims entries, each at least 1, product at most [`MAX_RANGE_ITEMS`].
    pub range: &'a [u64],
    /// Rows of dimension 0 to run (launch only), `(first, end)` inside `range[0]`; `None`: all.
    pub window: Option<(u64, u64)>,
}

impl TaskDescriptor {
    /// An all-zero descriptor.
    pub fn zeroed() -> Self {
        Zeroable::zeroed()
    }

    /// Checks what can be checked without session state.
    pub fn decode(&self) -> Result<Decoded<'_>, TaskError> {
        let op = Op::from_u32(self.op).ok_or(TaskError::Malformed(Malformed::UnknownOp(self.op)))?;
        let count = self.arg_count as usize;
        if count > MAX_ARGS {
            return Err(TaskError::Malformed(Malformed::TooManyArguments(self.arg_count)));
        }
        let args = &self.args[..count];
        for (index, arg) in args.iter().enumerate() {
            if ArgTag::from_u32(arg.tag).is_none() {
                return Err(TaskError::Malformed(Malformed::BadArgumentTag {
                    index: index as u16,
                    tag: arg.tag,
                }));
            }
        }
        let range: &[u64] = if op == Op::Launch {
            let dims = self.dims as usize;
            if !(1..=3).contains(&dims) {
                return Err(TaskError::Malformed(Malformed::BadDimensions(self.dims)));
            }
            let range = &self.range[..dims];
            let mut items: u64 = 1;
            for &extent in range {
                items = items.saturating_mul(extent);
            }
            if range.contains(&0) || items > MAX_RANGE_ITEMS {
                return Err(TaskError::InvalidRange {
                    items,
                    max: MAX_RANGE_ITEMS,
                });
            }
            range
        } else {
            &[]
        };
        let window = match (self.window_first, self.window_rows) {
            (0, 0) => None,
            (first, rows) => {
                let (first, end) = (u64::from(first), u64::from(first) + u64::from(rows));
                let extent = range.first().copied().unwrap_or(0);
                if op != Op::Launch || rows == 0 || end > extent {
                    return Err(TaskError::BadWindow {
                        reason: crate::completion::WINDOW_OUTSIDE,
                        first,
                        end,
                    });
                }
                Some((first, end))
            }
        };
        Ok(Decoded {
            op,
            task_id: self.task_id,
            queue: self.queue,
            kernel: self.kernel,
            args,
            range,
            window,
        })
    }
}

impl Decoded<'_> {
    /// Argument `index` as a buffer handle, if present and tagged as one.
    pub fn buffer_arg(&self, index: usize) -> Result<u64, TaskError> {
        match self.args.get(index) {
            Some(a) if a.tag == ArgTag::Buffer as u32 => Ok(a.value),
            Some(a) => Err(TaskError::ArgumentType {
                index: index as u16,
                expected: ArgTag::Buffer as u32,
                got: a.tag,
            }),
            None => Err(TaskError::ArgumentCount {
                expected: index as u32 + 1,
                got: self.args.len() as u32,
            }),
        }
    }

    /// Argument `index` as an unsigned integer (u32/u64 tag), or `default` when absent.
    pub fn u64_arg_or(&self, index: usize, default: u64) -> Result<u64, TaskError> {
        match self.args.get(index) {
            None => Ok(default),
            Some(a) if a.tag == ArgTag::U64 as u32 || a.tag == ArgTag::U32 as u32 => Ok(a.value),
            Some(a) => Err(TaskError::ArgumentType {
                index: index as u16,
                expected: ArgTag::U64 as u32,
                got: a.tag,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch() -> TaskDescriptor {
        let mut d = TaskDescriptor::zeroed();
        d.op = Op::Launch as u32;
        d.dims = 1;
        d.range = [16, 0, 0];
        d.arg_count = 2;
        d.args[0] = RawArg::f32(2.0);
        d.args[1] = RawArg::buffer(7);
        d
    }

    #[test]
    fn decodes_a_good_launch() {
        let d = launch();
        let dec = d.decode().unwrap();
        assert_eq!(dec.op, Op::Launch);
        assert_eq!(dec.args.len(), 2);
        assert_eq!(dec.range, &[16]);
    }

    #[test]
    fn rejects_each_malformed_field() {
        let mut d = launch();
        d.op = 99;
        assert!(matches!(
            d.decode(),
            Err(TaskError::Malformed(Malformed::UnknownOp(99)))
        ));
        let mut d = launch();
        d.arg_count = 17;
        assert!(matches!(
            d.decode(),
            Err(TaskError::Malformed(Malformed::TooManyArguments(17)))
        ));
        let mut d = launch();
        d.args[1].tag = 0;
        assert!(matches!(
            d.decode(),
            Err(TaskError::Malformed(Malformed::BadArgumentTag { index: 1, tag: 0 }))
        ));
        let mut d = launch();
        d.dims = 4;
        assert!(matches!(
            d.decode(),
            Err(TaskError::Malformed(Malformed::BadDimensions(4)))
        ));
        let mut d = launch();
        d.range = [0, 0, 0];
        assert!(matches!(d.decode(), Err(TaskError::InvalidRange { .. })));
        let mut d = launch();
        d.dims = 3;
        d.range = [u64::MAX, u64::MAX, 2];
        assert!(matches!(d.decode(), Err(TaskError::InvalidRange { .. })));
    }

    #[test]
    // Exhaustive over byte patterns: run natively (`cargo test`); under Miri (which checks the
    // crate's unsafe code: scripts/miri.sh) it would take hours and has no unsafe code to check.
    #[cfg_attr(miri, ignore = "exhaustive; runs natively, has no unsafe code for Miri to check")]
    fn every_byte_pattern_decodes_or_errors_without_panicking() {
        // A cheap stand-in for the fuzz target: pseudo-random descriptors never panic.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20_000 {
            let mut bytes = [0u8; 320];
            for b in bytes.iter_mut() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = (state & 0x0f) as u8; // small values hit the interesting cases
            }
            let d: TaskDescriptor = bytemuck::pod_read_unaligned(&bytes);
            let _ = d.decode();
        }
    }
}
