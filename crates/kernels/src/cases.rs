//! Device-agnostic test cases for every kernel of the library.
//!
//! A [`KernelCase`] names a kernel, a launch range, its arguments (scalars as wire arguments,
//! buffers as initial bytes) and, for each buffer the kernel writes, the contents it must hold
//! afterwards with a tolerance. Expected contents come from the host references (computed here,
//! never hard-coded). Any device runs a case the same way:
//!
//! 1. create one buffer per [`KernelCase::buffers`] entry, holding those bytes;
//! 2. launch [`KernelCase::kernel`] over [`KernelCase::range`] with [`KernelCase::raw_args`],
//!    whose buffer arguments are `RawArg::buffer(i)` for the `i`-th buffer (replace `i` by the
//!    device's handle for it);
//! 3. read every buffer back and pass them, in the same order, to [`KernelCase::check`].
//!
//! [`run_case_on_host`] does this with the CPU implementation. Every kernel has at least one
//! realistic-size case ([`KernelCase::large`]) and small edge cases (odd sizes, ranges that do not
//! divide evenly into blocks or tiles).

use agora_protocol::RawArg;

use crate::{backprop, gaussian, hotspot, hpccg, lavamd, nw, pathfinder, sgemm, stream, KernelDef};

/// How far a float result may be from the expected value: `|got - want| ≤ abs + rel·|want|`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Relative part.
    pub rel: f64,
    /// Absolute part.
    pub abs: f64,
}

impl Tolerance {
    /// Bit-for-bit equality (NaN equals NaN).
    pub const EXACT: Tolerance = Tolerance { rel: 0.0, abs: 0.0 };

    /// A relative and an absolute part.
    pub const fn new(rel: f64, abs: f64) -> Self {
        Tolerance { rel, abs }
    }

    /// Whether `got` is close enough to `want`.
    pub fn allows(&self, want: f64, got: f64) -> bool {
        if want.is_nan() || got.is_nan() {
            return want.is_nan() && got.is_nan();
        }
        want == got || (got - want).abs() <= self.abs + self.rel * want.abs()
    }
}

/// Expected buffer contents, typed.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// 32-bit signed integers.
    I32(Vec<i32>),
}

impl Values {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::I32(v) => v.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a written buffer must hold after the launch.
#[derive(Debug, Clone, PartialEq)]
pub struct Expected {
    /// The whole buffer's expected contents.
    pub values: Values,
    /// Allowed deviation (integers are always compared exactly).
    pub tolerance: Tolerance,
}

impl Expected {
    /// Compares `bytes` (a buffer read back after the launch) with the expectation.
    pub fn compare(&self, bytes: &[u8]) -> Result<(), String> {
        let want_len = self.values.len() * 4;
        if bytes.len() != want_len {
            return Err(format!("{} bytes, expected {want_len}", bytes.len()));
        }
        let mut bad = Vec::new();
        let mut count = 0usize;
        let mut worst = 0f64;
        let mut note = |i: usize, want: String, got: String, err: f64| {
            count += 1;
            worst = worst.max(err);
            if bad.len() < 5 {
                bad.push(format!("[{i}] want {want} got {got}"));
            }
        };
        match &self.values {
            Values::F32(want) => {
                for (i, (w, chunk)) in want.iter().zip(bytes.chunks_exact(4)).enumerate() {
                    let g = f32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
                    if !self.tolerance.allows(f64::from(*w), f64::from(g)) {
                        note(i, w.to_string(), g.to_string(), (f64::from(g) - f64::from(*w)).abs());
                    }
                }
            }
            Values::I32(want) => {
                for (i, (w, chunk)) in want.iter().zip(bytes.chunks_exact(4)).enumerate() {
                    let g = i32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
                    if *w != g {
                        note(i, w.to_string(), g.to_string(), (f64::from(g) - f64::from(*w)).abs());
                    }
                }
            }
        }
        if count == 0 {
            Ok(())
        } else {
            Err(format!(
                "{count} of {} elements differ (largest error {worst:e}, tolerance {:?}): {}",
                self.values.len(),
                self.tolerance,
                bad.join(", ")
            ))
        }
    }
}

/// One argument of a case, in the kernel's parameter order.
#[derive(Debug, Clone, PartialEq)]
pub enum CaseArg {
    /// A scalar, as passed on the wire.
    Scalar(RawArg),
    /// A buffer: its initial contents and, when the kernel writes it, what it must hold after.
    Buffer {
        /// Initial bytes (native-endian elements).
        initial: Vec<u8>,
        /// Expected contents after the launch (`None` for buffers the kernel only reads).
        expected: Option<Expected>,
    },
}

/// One launch of one kernel with known inputs and expected outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelCase {
    /// Human-readable name, e.g. `hotspot.step 512x512`.
    pub name: String,
    /// The kernel's library name.
    pub kernel: &'static str,
    /// Launch range (1 to 3 dimensions).
    pub range: Vec<u64>,
    /// Arguments in the kernel's parameter order.
    pub args: Vec<CaseArg>,
    /// Whether this is a realistic-size case (the others are small edge cases, cheap anywhere).
    pub large: bool,
}

impl KernelCase {
    /// The kernel's definition.
    pub fn def(&self) -> Result<&'static KernelDef, String> {
        crate::find(self.kernel)
            .map(|(_, k)| k)
            .ok_or_else(|| format!("{}: no kernel named {}", self.name, self.kernel))
    }

    /// The launch's arguments: scalars as given, the `i`-th buffer argument as `RawArg::buffer(i)`.
    pub fn raw_args(&self) -> Vec<RawArg> {
        let mut next = 0u64;
        self.args
            .iter()
            .map(|a| match a {
                CaseArg::Scalar(raw) => *raw,
                CaseArg::Buffer { .. } => {
                    next += 1;
                    RawArg::buffer(next - 1)
                }
            })
            .collect()
    }

    /// Initial contents of the buffer arguments, in order.
    pub fn buffers(&self) -> Vec<&[u8]> {
        self.args
            .iter()
            .filter_map(|a| match a {
                CaseArg::Buffer { initial, .. } => Some(initial.as_slice()),
                CaseArg::Scalar(_) => None,
            })
            .collect()
    }

    /// Checks the buffers read back after the launch (same order as [`KernelCase::buffers`]).
    pub fn check(&self, results: &[&[u8]]) -> Result<(), String> {
        let buffers: Vec<(usize, &Option<Expected>)> = self
            .args
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match a {
                CaseArg::Buffer { expected, .. } => Some((i, expected)),
                CaseArg::Scalar(_) => None,
            })
            .collect();
        if results.len() != buffers.len() {
            return Err(format!(
                "{}: {} buffers given, expected {}",
                self.name,
                results.len(),
                buffers.len()
            ));
        }
        let def = self.def().ok();
        for ((arg, expected), got) in buffers.into_iter().zip(results) {
            if let Some(expected) = expected {
                let name = def.and_then(|d| d.params.get(arg)).map_or("?", |p| &*p.name);
                expected
                    .compare(got)
                    .map_err(|e| format!("{}: argument {arg} ({name}): {e}", self.name))?;
            }
        }
        Ok(())
    }
}

/// Runs `case` through the kernel's CPU implementation, split into `threads` row blocks (run one
/// after the other, as [`crate::run_on_host`] does), and checks the results.
pub fn run_case_on_host(case: &KernelCase, threads: u64) -> Result<(), String> {
    run_timed(case, threads).map(|_| ())
}

/// [`run_case_on_host`] with `def` as the kernel (e.g. a package's, loaded at run time).
pub fn run_case_with(case: &KernelCase, def: &KernelDef, threads: u64) -> Result<(), String> {
    run_timed_with(case, def, threads).map(|_| ())
}

/// [`run_case_on_host`], returning how long the launch itself took.
fn run_timed(case: &KernelCase, threads: u64) -> Result<std::time::Duration, String> {
    run_timed_with(case, case.def()?, threads)
}

fn run_timed_with(case: &KernelCase, def: &KernelDef, threads: u64) -> Result<std::time::Duration, String> {
    if def.cpu.is_none() {
        return Err(format!("{}: {} has no CPU implementation", case.name, case.kernel));
    }
    // Copy the buffers into 8-byte aligned storage: kernels view them as f32/i32 slices.
    let mut storage: Vec<(Vec<u64>, usize)> = case
        .buffers()
        .iter()
        .map(|b| {
            let mut words = vec![0u64; b.len().div_ceil(8)];
            bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..b.len()].copy_from_slice(b);
            (words, b.len())
        })
        .collect();
    let mut views: Vec<&mut [u8]> = storage
        .iter_mut()
        .map(|(words, len)| &mut bytemuck::cast_slice_mut::<u64, u8>(words)[..*len])
        .collect();
    let args = case.raw_args();
    let started = std::time::Instant::now();
    crate::run_on_host(def, &case.range, &args, &mut views, threads)
        .map_err(|e| format!("{}: launch refused: {e}", case.name))?;
    let took = started.elapsed();
    let results: Vec<&[u8]> = views.iter().map(|v| &**v).collect();
    case.check(&results)?;
    Ok(took)
}

/// The programs of the library with cases, for [`for_program`].
pub const PROGRAMS: &[&str] = &[
    "basic", "gaussian", "nw", "lavamd", "backprop", "sgemm", "stream", "hpccg",
];

/// Programs whose kernels are example kernel packages (`examples/packages/NAME`), with cases for
/// [`for_program`]: [`KernelCase::def`] does not find their kernels (the daemon loads them); run
/// them through a daemon or with [`run_case_with`] and the loaded definition.
pub const PACKAGE_PROGRAMS: &[&str] = &["hotspot", "pathfinder"];

/// The cases of one program (see [`PROGRAMS`], [`PACKAGE_PROGRAMS`]); empty for an unknown name.
pub fn for_program(program: &str) -> Vec<KernelCase> {
    build(program, true)
}

/// The cases of one program, without the realistic-size ones unless `with_large`.
fn build(program: &str, with_large: bool) -> Vec<KernelCase> {
    match program {
        "basic" => basic_cases(with_large),
        "gaussian" => gaussian_cases(with_large),
        "hotspot" => hotspot_cases(with_large),
        "nw" => nw_cases(with_large),
        "pathfinder" => pathfinder_cases(with_large),
        "lavamd" => lavamd_cases(with_large),
        "backprop" => backprop_cases(with_large),
        "sgemm" => sgemm_cases(with_large),
        "stream" => stream_cases(with_large),
        "hpccg" => hpccg_cases(with_large),
        _ => Vec::new(),
    }
}

/// Every case of every kernel, the packages' included (a few hundred MB of data at once;
/// [`for_program`] builds less).
pub fn all() -> Vec<KernelCase> {
    PROGRAMS
        .iter()
        .chain(PACKAGE_PROGRAMS)
        .flat_map(|p| for_program(p))
        .collect()
}

/// Only the small edge cases of every kernel (cheap to build and run anywhere).
pub fn small() -> Vec<KernelCase> {
    PROGRAMS.iter().flat_map(|p| build(p, false)).collect()
}

// ---------------------------------------------------------------------------------------------
// Building cases.

/// Elementwise float results that a compiler may contract into fused multiply-adds.
const ELEMENTWISE: Tolerance = Tolerance::new(1e-5, 1e-6);

struct Case {
    case: KernelCase,
}

impl Case {
    fn new(name: impl Into<String>, kernel: &'static str, range: &[u64], large: bool) -> Self {
        Case {
            case: KernelCase {
                name: name.into(),
                kernel,
                range: range.to_vec(),
                args: Vec::new(),
                large,
            },
        }
    }

    fn scalar(mut self, raw: RawArg) -> Self {
        self.case.args.push(CaseArg::Scalar(raw));
        self
    }

    fn i32(self, v: i32) -> Self {
        self.scalar(RawArg::i32(v))
    }

    fn f32(self, v: f32) -> Self {
        self.scalar(RawArg::f32(v))
    }

    fn input<T: bytemuck::Pod>(mut self, data: &[T]) -> Self {
        self.case.args.push(CaseArg::Buffer {
            initial: bytemuck::cast_slice(data).to_vec(),
            expected: None,
        });
        self
    }

    fn output_f32(mut self, initial: &[f32], want: Vec<f32>, tolerance: Tolerance) -> Self {
        self.case.args.push(CaseArg::Buffer {
            initial: bytemuck::cast_slice(initial).to_vec(),
            expected: Some(Expected {
                values: Values::F32(want),
                tolerance,
            }),
        });
        self
    }

    fn output_i32(mut self, initial: &[i32], want: Vec<i32>) -> Self {
        self.case.args.push(CaseArg::Buffer {
            initial: bytemuck::cast_slice(initial).to_vec(),
            expected: Some(Expected {
                values: Values::I32(want),
                tolerance: Tolerance::EXACT,
            }),
        });
        self
    }

    fn done(self) -> KernelCase {
        self.case
    }
}

fn random(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
    let mut rng = crate::rng::Rng::new(seed);
    (0..n).map(|_| rng.range(lo, hi)).collect()
}

/// Garbage for write-only outputs, so a kernel that skips an element is caught.
fn garbage(n: usize) -> Vec<f32> {
    vec![-12345.0; n]
}

/// A name's size tag: `large` for realistic sizes, `edge` otherwise.
fn tag(large: bool) -> &'static str {
    if large {
        "large"
    } else {
        "edge"
    }
}

fn basic_cases(with_large: bool) -> Vec<KernelCase> {
    let mut out = vec![Case::new("noop", "noop", &[1000], false).done()];
    for (n, large) in [(1 << 20, true), (1001, false)] {
        if large && !with_large {
            continue;
        }
        let x = random(n, -1.0, 1.0, 1);
        let y = random(n, -1.0, 1.0, 2);
        let a = 2.5f32;
        let want: Vec<f32> = x.iter().zip(&y).map(|(x, y)| a * x + y).collect();
        out.push(
            Case::new(format!("saxpy n={n}"), "saxpy", &[n as u64], large)
                .f32(a)
                .input(&x)
                .output_f32(&y, want, ELEMENTWISE)
                .done(),
        );
        let sum: Vec<f32> = x.iter().zip(&y).map(|(x, y)| x + y).collect();
        out.push(
            Case::new(format!("vector_add n={n}"), "vector_add", &[n as u64], large)
                .input(&x)
                .input(&y)
                .output_f32(&garbage(n), sum, Tolerance::EXACT)
                .done(),
        );
        out.push(
            Case::new(format!("fill n={n}"), "fill", &[n as u64], large)
                .f32(0.75)
                .output_f32(&garbage(n), vec![0.75; n], Tolerance::EXACT)
                .done(),
        );
    }
    out
}

fn gaussian_cases(with_large: bool) -> Vec<KernelCase> {
    use gaussian::reference as g;
    let mut out = Vec::new();
    for (size, t, large) in [(1024usize, 3usize, true), (7, 5, false), (33, 0, false)] {
        if large && !with_large {
            continue;
        }
        // State after steps 0..t, then fan1 and fan2 of step t.
        let (mut a, mut b) = g::matrix(size);
        let mut m = vec![0f32; size * size];
        for step in 0..t {
            g::fan1(&a, &mut m, size, step);
            g::fan2(&mut a, &mut b, &m, size, step);
        }
        let m_before = m.clone();
        g::fan1(&a, &mut m, size, t);
        let live = (size - 1 - t) as u64;
        out.push(
            Case::new(
                format!("gaussian.fan1 {} size={size} t={t}", tag(large)),
                "gaussian.fan1",
                &[live],
                large,
            )
            .output_f32(&m_before, m.clone(), Tolerance::new(1e-5, 0.0))
            .input(&a)
            .i32(size as i32)
            .i32(t as i32)
            .done(),
        );
        let (mut a2, mut b2) = (a.clone(), b.clone());
        g::fan2(&mut a2, &mut b2, &m, size, t);
        out.push(
            Case::new(
                format!("gaussian.fan2 {} size={size} t={t}", tag(large)),
                "gaussian.fan2",
                &[live, (size - t) as u64],
                large,
            )
            .input(&m)
            .output_f32(&a, a2, Tolerance::new(1e-5, 1e-5))
            .output_f32(&b, b2, Tolerance::new(1e-5, 1e-5))
            .i32(size as i32)
            .i32(t as i32)
            .done(),
        );
    }
    out
}

fn hotspot_cases(with_large: bool) -> Vec<KernelCase> {
    use hotspot::reference as h;
    let mut out = Vec::new();
    for (rows, cols, large) in [
        (512usize, 512usize, true),
        (1024, 1024, true),
        (7, 13, false),
        (1, 5, false),
        (6, 1, false),
    ] {
        if large && !with_large {
            continue;
        }
        let (temp, power) = h::grids(rows, cols, 3);
        let p = h::Params::for_grid(rows, cols);
        let mut want = vec![0f32; rows * cols];
        h::step(&power, &temp, &mut want, rows, cols, &p);
        out.push(
            Case::new(
                format!("hotspot.step {rows}x{cols}"),
                "hotspot.step",
                &[rows as u64, cols as u64],
                large,
            )
            .input(&power)
            .input(&temp)
            .output_f32(&garbage(rows * cols), want, Tolerance::new(1e-6, 1e-4))
            .i32(rows as i32)
            .i32(cols as i32)
            .f32(p.step_div_cap)
            .f32(p.rx_1)
            .f32(p.ry_1)
            .f32(p.rz_1)
            .f32(p.amb_temp)
            .done(),
        );
    }
    out
}

fn nw_cases(with_large: bool) -> Vec<KernelCase> {
    use nw::reference as r;
    let mut out = Vec::new();
    // (n, block, diagonal): the longest diagonal of blocks, the longest anti-diagonal of cells,
    // the last (partial) block of a size that blocks do not divide, and a middle diagonal.
    let blocks = |n: usize, b: usize| r::blocks_per_side(n, b);
    let list = [
        (2048usize, 16usize, blocks(2048, 16) - 1, true),
        (2048, 1, 2047, true),
        (100, 16, 2 * blocks(100, 16) - 2, false),
        (37, 5, 4, false),
        (37, 5, 9, false),
    ];
    for (n, block, diag, large) in list {
        if large && !with_large {
            continue;
        }
        let (mut score, reference) = r::inputs(n, r::PENALTY, 4);
        out.push(nw_case(n, block, diag, large, r::PENALTY, &mut score, &reference));
    }
    // Extreme scores and penalty: the recurrence wraps around instead of overflowing.
    let (n, block) = (20, 4);
    let (_, reference) = r::inputs(n, r::PENALTY, 5);
    let mut score: Vec<i32> = (0..(n + 1) * (n + 1))
        .map(|i| {
            if i % 3 == 0 {
                i32::MIN + i as i32
            } else {
                i32::MAX - i as i32
            }
        })
        .collect();
    out.push(nw_case(n, block, 3, false, i32::MAX, &mut score, &reference));
    out
}

/// The case of diagonal `diag`, starting from `score` after the diagonals before it.
fn nw_case(
    n: usize,
    block: usize,
    diag: usize,
    large: bool,
    penalty: i32,
    score: &mut [i32],
    reference: &[i32],
) -> KernelCase {
    use nw::reference as r;
    for d in 0..diag {
        r::diagonal(score, reference, n, penalty, d, block);
    }
    let mut want = score.to_vec();
    r::diagonal(&mut want, reference, n, penalty, diag, block);
    let count = r::diagonal_blocks(n, block, diag).len() as u64;
    Case::new(
        format!("nw.diagonal n={n} block={block} diagonal={diag} penalty={penalty}"),
        "nw.diagonal",
        &[count],
        large,
    )
    .output_i32(score, want)
    .input(reference)
    .i32(n as i32)
    .i32(penalty)
    .i32(diag as i32)
    .i32(block as i32)
    .done()
}

fn pathfinder_cases(with_large: bool) -> Vec<KernelCase> {
    use pathfinder::reference as p;
    let mut out = Vec::new();
    let list = [
        (100usize, 100_000usize, 50usize, true, false),
        (3, 1, 1, false, false),
        (9, 13, 4, false, false),
        (4, 9, 2, false, true),
    ];
    for (rows, cols, row, large, extreme) in list {
        if large && !with_large {
            continue;
        }
        let mut wall = p::wall(rows, cols, 5);
        if extreme {
            // Sums wrap around instead of overflowing.
            wall.iter_mut()
                .enumerate()
                .for_each(|(i, w)| *w = if i % 2 == 0 { i32::MAX - *w } else { i32::MIN + *w });
        }
        let src = p::run(&wall, cols, row);
        let mut want = vec![0i32; cols];
        p::row(&wall, &src, &mut want, cols, row);
        out.push(
            Case::new(
                format!(
                    "pathfinder.row cols={cols} row={row}{}",
                    if extreme { " extreme" } else { "" }
                ),
                "pathfinder.row",
                &[cols as u64],
                large,
            )
            .input(&wall)
            .input(&src)
            .output_i32(&vec![-1; cols], want)
            .i32(cols as i32)
            .i32(row as i32)
            .done(),
        );
    }
    out
}

fn lavamd_cases(with_large: bool) -> Vec<KernelCase> {
    use lavamd::reference as l;
    let mut out = Vec::new();
    for (boxes1d, per_box, large) in [(5usize, l::PAR_PER_BOX, true), (2, 7, false), (1, 3, false)] {
        if large && !with_large {
            continue;
        }
        let (rv, qv) = l::inputs(boxes1d, per_box, 6);
        let want = l::boxes(&rv, &qv, boxes1d, per_box, l::ALPHA);
        let particles = boxes1d.pow(3) * per_box;
        out.push(
            Case::new(
                format!("lavamd.boxes boxes1d={boxes1d} par_per_box={per_box}"),
                "lavamd.boxes",
                &[particles as u64],
                large,
            )
            .input(&rv)
            .input(&qv)
            .output_f32(&garbage(4 * particles), want, Tolerance::new(2e-5, 2e-3))
            .i32(boxes1d as i32)
            .i32(per_box as i32)
            .f32(l::ALPHA)
            .done(),
        );
    }
    out
}

fn backprop_cases(with_large: bool) -> Vec<KernelCase> {
    use backprop::reference as b;
    let mut out = Vec::new();
    for (n_in, n_hid, large) in [(65_536usize, b::HIDDEN, true), (37, 3, false)] {
        if large && !with_large {
            continue;
        }
        let net = b::net(n_in, n_hid, 7);
        let blocks = n_in.div_ceil(backprop::BLOCK);
        let partial = b::layer_partials(&net.input, &net.input_weights, n_in, n_hid);
        out.push(
            Case::new(
                format!("backprop.layerforward n_in={n_in} n_hid={n_hid}"),
                "backprop.layerforward",
                &[blocks as u64, n_hid as u64],
                large,
            )
            .input(&net.input)
            .input(&net.input_weights)
            .output_f32(&garbage(blocks * n_hid), partial.clone(), Tolerance::new(1e-5, 1e-5))
            .i32(n_in as i32)
            .i32(n_hid as i32)
            .done(),
        );
        // Rodinia's weights saturate the sigmoid; the small case uses partial sums around zero.
        let partial = if large {
            partial
        } else {
            random(blocks * n_hid, -0.5, 0.5, 8)
        };
        let mut hidden = vec![1f32; n_hid + 1];
        b::squash(&partial, &net.input_weights, &mut hidden, n_in, n_hid);
        let mut initial = vec![1f32; n_hid + 1];
        initial[1..].fill(-1.0);
        out.push(
            Case::new(
                format!("backprop.squash n_in={n_in} n_hid={n_hid}"),
                "backprop.squash",
                &[n_hid as u64],
                large,
            )
            .input(&partial)
            .input(&net.input_weights)
            .output_f32(&initial, hidden.clone(), Tolerance::new(1e-5, 1e-6))
            .i32(n_in as i32)
            .i32(n_hid as i32)
            .done(),
        );
        // The hidden deltas of a training step, and non-zero previous changes (momentum).
        let output = b::layer(&hidden, &net.hidden_weights, n_hid, net.n_out);
        let (out_delta, _) = b::output_error(&output, &net.target);
        let (mut delta, _) = b::hidden_error(&hidden, &out_delta, &net.hidden_weights);
        if delta.iter().all(|d| *d == 0.0) {
            delta = random(n_hid + 1, -0.01, 0.01, 9);
        }
        let oldw = random((n_in + 1) * (n_hid + 1), -0.01, 0.01, 10);
        let (mut w2, mut old2) = (net.input_weights.clone(), oldw.clone());
        b::adjust_weights(&delta, &net.input, &mut w2, &mut old2, n_in, n_hid, b::ETA, b::MOMENTUM);
        out.push(
            Case::new(
                format!("backprop.adjust_weights n_in={n_in} n_hid={n_hid}"),
                "backprop.adjust_weights",
                &[n_in as u64 + 1, n_hid as u64],
                large,
            )
            .input(&delta)
            .input(&net.input)
            .output_f32(&net.input_weights, w2, Tolerance::new(1e-5, 1e-6))
            .output_f32(&oldw, old2, Tolerance::new(1e-5, 1e-6))
            .i32(n_in as i32)
            .i32(n_hid as i32)
            .f32(b::ETA)
            .f32(b::MOMENTUM)
            .done(),
        );
    }
    out
}

fn sgemm_cases(with_large: bool) -> Vec<KernelCase> {
    use sgemm::reference as s;
    let mut out = Vec::new();
    let list = [
        (1024usize, 1024usize, 1024usize, 1.0f32, 0.0f32, true),
        (37, 53, 29, 1.5, -0.5, false),
        (17, 18, 19, -2.0, 0.0, false),
        (5, 3, 0, 1.0, 2.0, false),
    ];
    for (m, n, k, alpha, beta, large) in list {
        if large && !with_large {
            continue;
        }
        // With k = 0, A and B are empty; the daemon refuses empty buffers, so pass one unused
        // element (a buffer may be larger than the launch needs).
        let (mut a, mut b) = (s::matrix(m, k, 11), s::matrix(k, n, 12));
        for matrix in [&mut a, &mut b] {
            if matrix.is_empty() {
                matrix.push(7.0);
            }
        }
        // With beta = 0, C is not read: start from NaN to check that.
        let c = if beta == 0.0 {
            vec![f32::NAN; m * n]
        } else {
            s::matrix(m, n, 13)
        };
        let mut want = c.clone();
        s::sgemm(m, n, k, alpha, &a, &b, beta, &mut want);
        out.push(
            Case::new(
                format!("sgemm {m}x{n}x{k} alpha={alpha} beta={beta}"),
                "sgemm",
                &[m as u64, n as u64],
                large,
            )
            .i32(m as i32)
            .i32(n as i32)
            .i32(k as i32)
            .f32(alpha)
            .input(&a)
            .input(&b)
            .f32(beta)
            .output_f32(&c, want, Tolerance::new(1e-4, 1e-5 * (k as f64 + 1.0)))
            .done(),
        );
    }
    out
}

fn stream_cases(with_large: bool) -> Vec<KernelCase> {
    use stream::reference as st;
    let mut out = Vec::new();
    let s = 3.0f32;
    for (n, large) in [(1usize << 20, true), (1001, false)] {
        if large && !with_large {
            continue;
        }
        let (a, b, c) = st::arrays(n, 14);
        let r = [n as u64];
        let mut want = vec![0f32; n];
        st::copy(&a, &mut want);
        out.push(
            Case::new(format!("stream.copy n={n}"), "stream.copy", &r, large)
                .input(&a)
                .output_f32(&garbage(n), want.clone(), Tolerance::EXACT)
                .done(),
        );
        st::scale(s, &c, &mut want);
        out.push(
            Case::new(format!("stream.scale n={n}"), "stream.scale", &r, large)
                .f32(s)
                .input(&c)
                .output_f32(&garbage(n), want.clone(), ELEMENTWISE)
                .done(),
        );
        st::add(&a, &b, &mut want);
        out.push(
            Case::new(format!("stream.add n={n}"), "stream.add", &r, large)
                .input(&a)
                .input(&b)
                .output_f32(&garbage(n), want.clone(), ELEMENTWISE)
                .done(),
        );
        st::triad(s, &b, &c, &mut want);
        out.push(
            Case::new(format!("stream.triad n={n}"), "stream.triad", &r, large)
                .f32(s)
                .input(&b)
                .input(&c)
                .output_f32(&garbage(n), want, ELEMENTWISE)
                .done(),
        );
    }
    out
}

fn spmv_case(name: String, a: &hpccg::reference::Csr, x: &[f32], large: bool) -> KernelCase {
    let mut want = vec![0f32; a.rows];
    hpccg::reference::spmv(a, x, &mut want);
    Case::new(name, "hpccg.spmv", &[a.rows as u64], large)
        .input(&a.row_ptr)
        .input(&a.cols)
        .input(&a.vals)
        .input(x)
        .output_f32(&garbage(a.rows), want, Tolerance::new(1e-5, 1e-5))
        .i32(x.len() as i32)
        .i32(a.cols.len() as i32)
        .done()
}

fn hpccg_cases(with_large: bool) -> Vec<KernelCase> {
    use hpccg::reference as h;
    let mut out = Vec::new();
    for (nx, ny, nz, large) in [(48usize, 48usize, 48usize, true), (3, 4, 5, false)] {
        if large && !with_large {
            continue;
        }
        let (a, _, _) = h::problem(nx, ny, nz);
        let x = random(a.rows, 0.0, 1.0, 15);
        out.push(spmv_case(format!("hpccg.spmv {nx}x{ny}x{nz}"), &a, &x, large));
    }
    // Hostile index arrays: decreasing and out-of-range row bounds, columns outside the vector.
    let hostile = h::Csr {
        rows: 6,
        row_ptr: vec![0, 3, 2, 9, -4, 100, 7],
        cols: vec![0, 1, -1, 2, 5, 4, 1000, 3, i32::MIN],
        vals: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
    };
    let x = random(6, 0.0, 1.0, 16);
    out.push(spmv_case("hpccg.spmv hostile indices".to_string(), &hostile, &x, false));
    for (n, large) in [(1usize << 20, true), (1000, false), (3000, false)] {
        if large && !with_large {
            continue;
        }
        let x = random(n, 0.0, 1.0, 17);
        let y = random(n, 0.0, 1.0, 18);
        let blocks = n.div_ceil(hpccg::DOT_BLOCK);
        out.push(
            Case::new(format!("hpccg.dot n={n}"), "hpccg.dot", &[blocks as u64], large)
                .i32(n as i32)
                .input(&x)
                .input(&y)
                .output_f32(&garbage(blocks), h::dot_partials(&x, &y), Tolerance::new(1e-4, 1e-4))
                .done(),
        );
        let mut w = vec![0f32; n];
        h::waxpby(1.5, &x, -0.75, &y, &mut w);
        out.push(
            Case::new(format!("hpccg.waxpby n={n}"), "hpccg.waxpby", &[n as u64], large)
                .f32(1.5)
                .input(&x)
                .f32(-0.75)
                .input(&y)
                .output_f32(&garbage(n), w, ELEMENTWISE)
                .done(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_program(program: &str) {
        let cases = for_program(program);
        assert!(!cases.is_empty(), "{program} has cases");
        for case in &cases {
            for threads in [1, 2, 3] {
                let started = std::time::Instant::now();
                if let Err(e) = run_case_on_host(case, threads) {
                    panic!("{e} ({threads} row blocks)");
                }
                let took = started.elapsed();
                if took.as_secs_f64() > 2.0 {
                    eprintln!("slow case: {} took {took:?} with {threads} row blocks", case.name);
                }
            }
        }
    }

    #[test]
    fn basic_cases_pass_on_the_cpu() {
        run_program("basic");
    }

    #[test]
    fn gaussian_cases_pass_on_the_cpu() {
        run_program("gaussian");
    }

    #[test]
    fn nw_cases_pass_on_the_cpu() {
        run_program("nw");
    }

    #[test]
    fn lavamd_cases_pass_on_the_cpu() {
        run_program("lavamd");
    }

    #[test]
    fn backprop_cases_pass_on_the_cpu() {
        run_program("backprop");
    }

    #[test]
    fn sgemm_cases_pass_on_the_cpu() {
        run_program("sgemm");
    }

    #[test]
    fn stream_cases_pass_on_the_cpu() {
        run_program("stream");
    }

    #[test]
    fn hpccg_cases_pass_on_the_cpu() {
        run_program("hpccg");
    }

    /// Prints each case's time on one core and the nanoseconds per work item, to calibrate
    /// `KernelDef::cost`: `cargo test -p agora-kernels --release -- --ignored --nocapture timings`.
    #[test]
    #[ignore]
    fn timings() {
        for program in PROGRAMS {
            let started = std::time::Instant::now();
            let cases = for_program(program);
            eprintln!("{program}: built {} cases in {:?}", cases.len(), started.elapsed());
            for case in cases {
                let took = run_timed(&case, 1).unwrap();
                let items: u64 = case.range.iter().product();
                let def = case.def().unwrap();
                eprintln!(
                    "  {:<55} {:>10.3} ms {:>12.1} ns/item (cost says {:?})",
                    case.name,
                    took.as_secs_f64() * 1e3,
                    took.as_secs_f64() * 1e9 / items as f64,
                    def.cost
                );
            }
        }
    }

    #[test]
    fn every_kernel_has_a_large_and_a_small_case() {
        // The packages' cases are checked with the loaded packages (crates/packages/tests).
        let cases: Vec<KernelCase> = PROGRAMS.iter().flat_map(|p| for_program(p)).collect();
        for k in crate::library() {
            let mine: Vec<&KernelCase> = cases.iter().filter(|c| c.kernel == k.name).collect();
            assert!(mine.iter().any(|c| !c.large), "{} has a small case", k.name);
            assert!(
                k.name == "noop" || mine.iter().any(|c| c.large),
                "{} has a large case",
                k.name
            );
        }
        for c in &cases {
            assert!(
                c.buffers().iter().all(|b| !b.is_empty()),
                "{}: the daemon refuses empty buffers",
                c.name
            );
            let def = c.def().unwrap();
            def.check_arguments(&c.raw_args())
                .unwrap_or_else(|e| panic!("{}: {e}", c.name));
            assert!(
                c.args
                    .iter()
                    .any(|a| matches!(a, CaseArg::Buffer { expected: Some(_), .. }))
                    || c.kernel == "noop",
                "{} checks an output",
                c.name
            );
        }
    }

    /// Runs `kernel` on copies of `buffers` (truncated to `lens`); returns whether it panicked.
    fn panics(def: &'static KernelDef, range: &[u64], args: &[RawArg], buffers: &[&[u8]], lens: &[usize]) -> bool {
        let mut storage: Vec<Vec<u64>> = buffers.iter().map(|b| vec![0u64; b.len().div_ceil(8)]).collect();
        let mut views: Vec<&mut [u8]> = storage
            .iter_mut()
            .zip(buffers.iter().zip(lens))
            .map(|(words, (b, len))| {
                let bytes = &mut bytemuck::cast_slice_mut::<u64, u8>(words)[..*len];
                bytes.copy_from_slice(&b[..*len]);
                bytes
            })
            .collect();
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = crate::run_on_host(def, range, args, &mut views, 2);
        }))
        .is_err()
    }

    /// Hostile scalars, ranges and buffer sizes are refused by the size checks, or run safely:
    /// nothing panics (no overflow, no out-of-bounds access) for any combination tried.
    #[test]
    fn hostile_launches_are_refused_or_safe() {
        let ints = [
            -1,
            0,
            1,
            2,
            3,
            5,
            16,
            17,
            1000,
            46_340,
            65_536,
            i32::MAX,
            i32::MIN,
            i32::MAX / 2,
        ];
        let floats = [f32::NAN, f32::INFINITY, -1.0, 0.0, 1e30];
        let mut seen = std::collections::HashSet::new();
        let mut tried = 0;
        for case in small() {
            if !seen.insert(case.kernel) {
                continue;
            }
            let def = case.def().unwrap();
            let buffers = case.buffers();
            let full: Vec<usize> = buffers.iter().map(|b| b.len()).collect();
            let args = case.raw_args();
            let r0 = case.range[0];
            let mut ranges = vec![
                case.range.clone(),
                vec![r0 + 1],
                vec![r0.saturating_sub(1).max(1)],
                vec![1, 1, 1],
            ];
            ranges.push(vec![0]);
            ranges.push(vec![agora_protocol::descriptor::MAX_RANGE_ITEMS]);
            let mut wider = case.range.clone();
            wider.push(2);
            ranges.push(wider);
            for (i, a) in args.iter().enumerate() {
                let values: Vec<RawArg> = if a.tag == agora_protocol::ArgTag::I32 as u32 {
                    ints.iter().map(|v| RawArg::i32(*v)).collect()
                } else if a.tag == agora_protocol::ArgTag::F32 as u32 {
                    floats.iter().map(|v| RawArg::f32(*v)).collect()
                } else {
                    // A buffer: try it shorter (an odd number of bytes, then half).
                    let k = a.value as usize;
                    for len in [full[k].saturating_sub(1), full[k] / 2, 0] {
                        let mut lens = full.clone();
                        lens[k] = len;
                        tried += 1;
                        assert!(
                            !panics(def, &case.range, &args, &buffers, &lens),
                            "{}: buffer {k} of {len} bytes",
                            case.name
                        );
                    }
                    continue;
                };
                for v in values {
                    let mut hostile = args.clone();
                    hostile[i] = v;
                    for range in &ranges {
                        tried += 1;
                        assert!(
                            !panics(def, range, &hostile, &buffers, &full),
                            "{}: argument {i} = {:#x}, range {range:?}",
                            case.name,
                            v.value
                        );
                    }
                }
            }
        }
        assert!(tried > 1000, "{tried} launches tried");
    }

    /// Runs the first small case of `kernel` with argument `index` replaced by `arg` (when given),
    /// the range replaced by `range` (when given) and buffer `shrink` cut to 4 bytes (when given).
    fn refusal(
        kernel: &str,
        change: Option<(usize, RawArg)>,
        range: Option<&[u64]>,
        shrink: Option<usize>,
    ) -> agora_protocol::TaskError {
        let case = small().into_iter().find(|c| c.kernel == kernel).unwrap();
        let mut args = case.raw_args();
        if let Some((i, a)) = change {
            args[i] = a;
        }
        let mut buffers: Vec<Vec<u64>> = case
            .buffers()
            .iter()
            .map(|b| {
                let mut words = vec![0u64; b.len().div_ceil(8)];
                bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..b.len()].copy_from_slice(b);
                words
            })
            .collect();
        let lens: Vec<usize> = case.buffers().iter().map(|b| b.len()).collect();
        let mut views: Vec<&mut [u8]> = buffers
            .iter_mut()
            .zip(&lens)
            .enumerate()
            .map(|(i, (w, len))| {
                let len = if shrink == Some(i) { 4 } else { *len };
                &mut bytemuck::cast_slice_mut::<u64, u8>(w)[..len]
            })
            .collect();
        let range = range.map_or(case.range.clone(), |r| r.to_vec());
        crate::run_on_host(case.def().unwrap(), &range, &args, &mut views, 1).unwrap_err()
    }

    #[test]
    fn checks_name_the_offending_argument() {
        use agora_protocol::TaskError::*;
        // nw.diagonal: a diagonal past the last one; a huge n.
        assert_eq!(
            refusal("nw.diagonal", Some((4, RawArg::i32(1000))), None, None),
            InvalidScalar { index: 4, value: 1000 }
        );
        assert_eq!(
            refusal("nw.diagonal", Some((2, RawArg::i32(i32::MAX))), None, None),
            InvalidScalar {
                index: 2,
                value: i64::from(i32::MAX)
            }
        );
        // sgemm: a k whose A would not fit; a short B.
        assert!(matches!(
            refusal("sgemm", Some((2, RawArg::i32(1000))), None, None),
            BufferTooSmall { index: 4, .. }
        ));
        assert!(matches!(
            refusal("sgemm", None, None, Some(1)),
            BufferTooSmall { index: 5, .. }
        ));
        // lavamd.boxes: so many boxes that the particles overflow an int.
        assert_eq!(
            refusal("lavamd.boxes", Some((3, RawArg::i32(2000))), None, None),
            InvalidScalar { index: 3, value: 2000 }
        );
        // hpccg.dot: a range that is not ceil(n / 1024).
        assert_eq!(
            refusal("hpccg.dot", None, Some(&[5]), None),
            RangeMismatch {
                expected_x: 1,
                expected_y: 1,
                got_x: 5,
                got_y: 1,
                got_z: 1
            }
        );
        // sgemm over (4, 4) with m = 100000 (issue #19): the message states the range it must
        // have, not a bound on the number of items.
        let e = refusal("sgemm", Some((0, RawArg::i32(100_000))), Some(&[4, 4]), None);
        let RangeMismatch {
            expected_x, expected_y, ..
        } = e
        else {
            panic!("expected a range mismatch, got {e:?}")
        };
        assert_eq!(expected_x, 100_000);
        let message = e.to_string();
        assert!(
            message.starts_with(&format!(
                "invalid range (4, 4): the range must be exactly (100000, {expected_y})"
            )),
            "{message}"
        );
        assert!(message.contains("(m, n)") && !message.contains("at most"), "{message}");
        // backprop.layerforward: an n_in whose weights overflow an int.
        assert!(matches!(
            refusal(
                "backprop.layerforward",
                Some((3, RawArg::i32(i32::MAX - 1))),
                None,
                None
            ),
            InvalidScalar { index: 4, .. }
        ));
    }

    #[test]
    fn a_wrong_result_is_reported() {
        let case = for_program("stream").into_iter().find(|c| !c.large).unwrap();
        let mut results: Vec<Vec<u8>> = case.buffers().iter().map(|b| b.to_vec()).collect();
        let refs: Vec<&[u8]> = results.iter().map(|r| r.as_slice()).collect();
        let err = case.check(&refs).unwrap_err();
        assert!(err.contains("elements differ"), "{err}");
        // Fix the output by hand: the copy's output must equal its input.
        results[1] = results[0].clone();
        let refs: Vec<&[u8]> = results.iter().map(|r| r.as_slice()).collect();
        case.check(&refs).unwrap();
    }

    #[test]
    fn tolerances_compare_as_documented() {
        let t = Tolerance::new(1e-3, 1e-6);
        assert!(t.allows(1000.0, 1000.9));
        assert!(!t.allows(1000.0, 1001.1));
        assert!(t.allows(0.0, 1e-7));
        assert!(!t.allows(0.0, f64::NAN));
        assert!(Tolerance::EXACT.allows(f64::NAN, f64::NAN));
        assert!(!Tolerance::EXACT.allows(1.0, 1.0 + 1e-12));
    }
}
