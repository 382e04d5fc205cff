//! What a kernel implementation sees: resolved arguments and the launch's range.

use std::marker::PhantomData;
use std::ops::Range;

use agora_protocol::{TaskError, MAX_ARGS};

/// A resolved argument.
#[derive(Clone, Copy, Debug, Default)]
pub enum ArgValue {
    /// Not present.
    #[default]
    None,
    /// A scalar's raw bits (32-bit scalars in the low half).
    Scalar(u64),
    /// A buffer's memory as the executing device sees it.
    Buffer {
        /// Start of the buffer (aligned to 64 bytes).
        ptr: *mut u8,
        /// Length in bytes.
        len: u64,
    },
}

/// The shape of a launch as the size check sees it: range, scalars and buffer lengths, no memory.
#[derive(Debug, Clone, Copy)]
pub struct LaunchShape<'a> {
    /// Range per dimension (1 to 3 entries).
    pub range: &'a [u64],
    /// Scalar bits per argument (0 for buffers).
    pub scalars: &'a [u64],
    /// Buffer lengths per argument (0 for scalars).
    pub buffer_lens: &'a [u64],
    /// Filled in by [`LaunchShape::need`]: bytes the launch touches in each buffer argument (the
    /// scheduler uses it to skip copying in a write-only buffer the launch overwrites entirely).
    pub needed: &'a [std::cell::Cell<u64>],
    /// Set by [`LaunchShape::overwrite`]: read-write buffer arguments this launch writes without
    /// reading (empty: the caller does not ask).
    pub overwritten: &'a [std::cell::Cell<bool>],
}

impl LaunchShape<'_> {
    /// Total work items.
    pub fn items(&self) -> u64 {
        self.range.iter().product()
    }

    /// Scalar `index` read as `i32`.
    pub fn i32(&self, index: usize) -> i32 {
        self.scalars[index] as u32 as i32
    }

    /// Scalar `index` read as `f32`.
    pub fn f32(&self, index: usize) -> f32 {
        f32::from_bits(self.scalars[index] as u32)
    }

    /// Buffer `index`, read-write in the signature, is written by this launch without being
    /// read (sgemm's C when beta = 0): the scheduler treats it as write-only for this launch,
    /// so its old contents need not reach the device, and a launch over all of it replaces
    /// whatever a failed task or a lost device left there.
    pub fn overwrite(&self, index: usize) {
        if let Some(cell) = self.overwritten.get(index) {
            cell.set(true);
        }
    }

    /// Fails with `BufferTooSmall` unless buffer `index` has at least `elements` × `size` bytes.
    pub fn need(&self, index: usize, elements: u64, size: u64) -> Result<(), TaskError> {
        let needed = elements.saturating_mul(size);
        if let Some(cell) = self.needed.get(index) {
            cell.set(cell.get().max(needed));
        }
        let len = self.buffer_lens[index];
        if len < needed {
            return Err(TaskError::BufferTooSmall {
                index: index as u16,
                needed,
                len,
            });
        }
        Ok(())
    }
}

/// Everything a CPU kernel implementation receives.
#[derive(Debug)]
pub struct KernelCall<'a> {
    range: [u64; 3],
    args: [ArgValue; MAX_ARGS],
    _memory: PhantomData<&'a mut [u8]>,
}

// SAFETY: the raw pointers refer to memory the caller keeps mapped for 'a and that kernels
// access through disjoint row ranges or bounds-checked views (see `KernelCall::new`).
unsafe impl Send for KernelCall<'_> {}
// SAFETY: as above; threads of one lane share the call and each works on its own rows.
unsafe impl Sync for KernelCall<'_> {}

impl<'a> KernelCall<'a> {
    /// Builds a call.
    ///
    /// # Safety
    /// Every `ArgValue::Buffer` must point to `len` bytes, aligned to 64, that stay valid for
    /// reads and writes for `'a`; the launch must have passed its kernel's argument and size
    /// checks; two buffer arguments may share memory only if neither is written.
    pub unsafe fn new(range: &[u64], args: &[ArgValue]) -> Self {
        let mut r = [1u64; 3];
        r[..range.len()].copy_from_slice(range);
        let mut a = [ArgValue::None; MAX_ARGS];
        a[..args.len()].copy_from_slice(args);
        KernelCall {
            range: r,
            args: a,
            _memory: PhantomData,
        }
    }

    /// Range per dimension (unused dimensions are 1).
    pub fn range(&self) -> [u64; 3] {
        self.range
    }

    /// Items per row of the first dimension (product of the other dimensions).
    pub fn row_items(&self) -> u64 {
        self.range[1] * self.range[2]
    }

    /// Item indices covered by `rows` when the launch is treated as flat.
    pub fn items(&self, rows: Range<u64>) -> Range<usize> {
        let per = self.row_items();
        (rows.start * per) as usize..(rows.end * per) as usize
    }

    fn bits(&self, index: usize) -> u64 {
        match self.args[index] {
            ArgValue::Scalar(bits) => bits,
            _ => 0,
        }
    }

    /// Scalar `index` as `f32`.
    pub fn f32(&self, index: usize) -> f32 {
        f32::from_bits(self.bits(index) as u32)
    }

    /// Scalar `index` as `i32`.
    pub fn i32(&self, index: usize) -> i32 {
        self.bits(index) as u32 as i32
    }

    /// Argument `index` as resolved (`None` past the last).
    pub fn arg(&self, index: usize) -> ArgValue {
        self.args.get(index).copied().unwrap_or_default()
    }

    fn raw(&self, index: usize) -> (*mut u8, u64) {
        match self.args[index] {
            ArgValue::Buffer { ptr, len } => (ptr, len),
            _ => (std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8, 0),
        }
    }

    /// Buffer `index`, which the signature declares read-only, as a slice.
    pub fn input<T: bytemuck::Pod>(&self, index: usize) -> &'a [T] {
        let (ptr, len) = self.raw(index);
        let n = len as usize / std::mem::size_of::<T>();
        // SAFETY: `new`'s contract: ptr is valid for len bytes for 'a and 64-byte aligned (enough
        // for any Pod scalar); the buffer is not written by this launch (read-only parameter and
        // no aliasing with a written argument). Another process may still write it (its owner,
        // racing its own task): every bit pattern is a valid T, so that only garbles the
        // owner's own result.
        unsafe { std::slice::from_raw_parts(ptr as *const T, n) }
    }

    /// Buffer `index`, which the signature declares written, as a shared mutable view.
    pub fn output<T: bytemuck::Pod>(&self, index: usize) -> SharedMut<'a, T> {
        let (ptr, len) = self.raw(index);
        SharedMut {
            ptr: ptr as *mut T,
            len: len as usize / std::mem::size_of::<T>(),
            _life: PhantomData,
        }
    }
}

/// A written buffer shared by the threads of one lane.
///
/// Threads write disjoint elements (each owns some rows of the range). Single elements go
/// through bounds-checked `get`/`set`; hot loops take a row with `row_mut`, whose caller
/// promises that no other thread touches that row.
#[derive(Debug, Clone, Copy)]
pub struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _life: PhantomData<&'a T>,
}

impl<'a, T: bytemuck::Pod> SharedMut<'a, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Reads element `i`. Panics when out of bounds (the lane turns it into a kernel fault).
    #[inline]
    pub fn get(&self, i: usize) -> T {
        assert!(i < self.len, "kernel read index {i} out of bounds {}", self.len);
        // SAFETY: in bounds (checked above); the pointer is valid for len elements (KernelCall
        // contract). A plain read of Pod data.
        unsafe { self.ptr.add(i).read() }
    }

    /// Writes element `i`. Panics when out of bounds.
    #[inline]
    pub fn set(&self, i: usize, value: T) {
        assert!(i < self.len, "kernel write index {i} out of bounds {}", self.len);
        // SAFETY: in bounds; the element belongs to the calling thread's rows.
        unsafe { self.ptr.add(i).write(value) }
    }

    /// Elements `range` as a mutable slice.
    ///
    /// # Safety
    /// No other thread may read or write any element of `range` while the slice lives.
    #[inline]
    pub unsafe fn row_mut(&self, range: Range<usize>) -> &'a mut [T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "row {range:?} out of bounds {}",
            self.len
        );
        // SAFETY: in bounds (checked); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }

    /// Elements `range` as a shared slice.
    ///
    /// # Safety
    /// No thread may write any element of `range` while the slice lives.
    #[inline]
    pub unsafe fn row(&self, range: Range<usize>) -> &'a [T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "row {range:?} out of bounds {}",
            self.len
        );
        // SAFETY: in bounds (checked); absence of writers is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.add(range.start), range.len()) }
    }
}

/// Test helper: runs `kernel` on host vectors, split into `threads` row blocks run one after the
/// other (the same split a lane uses).
#[doc(hidden)]
pub fn run_on_host(
    kernel: &crate::KernelDef,
    range: &[u64],
    scalars: &[agora_protocol::RawArg],
    buffers: &mut [&mut [u8]],
    threads: u64,
) -> Result<(), TaskError> {
    // Arguments are given as raw args where buffers carry the index into `buffers`.
    let mut values = Vec::new();
    let mut lens = Vec::new();
    let mut bits = Vec::new();
    for a in scalars {
        if a.tag == agora_protocol::ArgTag::Buffer as u32 {
            let b = &mut buffers[a.value as usize];
            values.push(ArgValue::Buffer {
                ptr: b.as_mut_ptr(),
                len: b.len() as u64,
            });
            lens.push(b.len() as u64);
            bits.push(0);
        } else {
            values.push(ArgValue::Scalar(a.value));
            lens.push(0);
            bits.push(a.value);
        }
    }
    kernel.check_arguments(scalars)?;
    let needed = vec![std::cell::Cell::new(0u64); lens.len()];
    kernel.check_shape(&LaunchShape {
        range,
        scalars: &bits,
        buffer_lens: &lens,
        needed: &needed,
        overwritten: &[],
    })?;
    // SAFETY: buffers are live, distinct `&mut` slices for the duration of the call; alignment
    // is the caller's (tests allocate Vec<f32>, which is 4-byte aligned, enough for f32).
    let call = unsafe { KernelCall::new(range, &values) };
    let rows = range[0];
    let step = rows.div_ceil(threads.max(1));
    let mut start = 0;
    while start < rows {
        let end = (start + step).min(rows);
        kernel.run_cpu(&call, start..end)?;
        start = end;
    }
    Ok(())
}
