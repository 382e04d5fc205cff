//! Kernel signatures: the declared shape of a kernel's arguments.
//!
//! The daemon checks every launch against its kernel's signature; the client receives the same
//! signature when it looks a kernel up, so it can report mistakes early and print helpful names.

use serde::{Deserialize, Serialize};

/// Scalar argument types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ScalarType {
    /// 32-bit signed integer.
    I32,
    /// 32-bit unsigned integer.
    U32,
    /// 64-bit signed integer.
    I64,
    /// 64-bit unsigned integer.
    U64,
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
}

impl ScalarType {
    /// Size in bytes of one element of this type.
    pub const fn size(self) -> u64 {
        match self {
            ScalarType::I32 | ScalarType::U32 | ScalarType::F32 => 4,
            ScalarType::I64 | ScalarType::U64 | ScalarType::F64 => 8,
        }
    }

    /// Lower-case name as written in signatures (`f32`, `i32`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ScalarType::I32 => "i32",
            ScalarType::U32 => "u32",
            ScalarType::I64 => "i64",
            ScalarType::U64 => "u64",
            ScalarType::F32 => "f32",
            ScalarType::F64 => "f64",
        }
    }
}

/// How a kernel accesses a buffer argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Access {
    /// The kernel only reads the buffer.
    Read,
    /// The kernel only writes the buffer, and writes every element of the range its size check
    /// requires (so when that range is the whole buffer, the previous contents are not needed
    /// and are not copied to the device). A kernel that writes only some elements declares
    /// `ReadWrite`.
    Write,
    /// The kernel reads and writes the buffer.
    ReadWrite,
}

impl Access {
    /// Whether the kernel may modify the buffer.
    pub const fn writes(self) -> bool {
        matches!(self, Access::Write | Access::ReadWrite)
    }

    /// Short name used in messages (`read`, `write`, `read-write`).
    pub const fn name(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::Write => "write",
            Access::ReadWrite => "read-write",
        }
    }
}

/// What a parameter is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ParamKind {
    /// A scalar passed by value.
    Scalar(ScalarType),
    /// A buffer of elements of the given type, accessed as stated.
    Buffer {
        /// Element type the kernel interprets the bytes as.
        element: ScalarType,
        /// How the kernel accesses it.
        access: Access,
    },
}

impl std::fmt::Display for ParamKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParamKind::Scalar(t) => write!(f, "{}", t.name()),
            ParamKind::Buffer { element, access } => {
                write!(f, "{} {} buffer", access.name(), element.name())
            }
        }
    }
}

/// One declared parameter.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Parameter name, for messages.
    pub name: String,
    /// Its kind.
    pub kind: ParamKind,
}

/// A kernel's full signature as the daemon publishes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelSignature {
    /// Kernel name, e.g. `saxpy` or `gaussian.fan1`.
    pub name: String,
    /// Parameters in call order.
    pub params: Vec<ParamSpec>,
    /// One line describing what the kernel computes and what range it expects.
    pub doc: String,
}

impl std::fmt::Display for KernelSignature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}(", self.name)?;
        for (i, p) in self.params.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{}: {}", p.name, p.kind)?;
        }
        write!(f, ")")
    }
}
