//! Kernel manifests: a tenant program's manifest (`program_manifest`, sent by any local user
//! with `BuildProgram`) and a package's `package.toml` (`parse_package_manifest`, the parse
//! `load` does, without files), then each kernel's compiled size rules evaluated for a launch
//! shape. The input is the manifest text, a NUL byte, and the bytes of the shape (range,
//! scalars, buffer lengths).
//!
//! Properties: a manifest either yields kernels with at most `MAX_ARGS` parameters and 1 to 3
//! dimensions, or an error naming a line of the text; a size check is deterministic, accepts a
//! launch only if every buffer holds what the rules say it needs, and refuses with one of the
//! launch errors whose stated reason is true (never a panic, whatever the arithmetic).
#![no_main]

use std::cell::Cell;

use agora_kernels::{LaunchShape, SizeCheck};
use agora_packages::{KernelSpec, PackageError};
use agora_protocol::{ParamKind, TaskError, MAX_ARGS};
use libfuzzer_sys::fuzz_target;

fn words(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    bytes.chunks(8).map(|c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        u64::from_le_bytes(w)
    })
}

fn check_error(text: &str, e: &PackageError) {
    match e {
        PackageError::Manifest { line, message, .. } => {
            assert!(
                *line >= 1 && *line <= text.split('\n').count(),
                "line {line} of a {}-line text",
                text.lines().count()
            );
            assert!(!message.is_empty());
        }
        PackageError::Other(m) => assert!(!m.is_empty()),
        PackageError::Io { .. } => panic!("parsing read a file: {e}"),
    }
}

fn check_spec(spec: &KernelSpec, shape_bytes: &[u8]) {
    assert!(spec.params.len() <= MAX_ARGS);
    assert!((1..=3).contains(&spec.dims));
    let SizeCheck::Rules(rules) = &spec.check else {
        panic!("a manifest kernel without rules");
    };
    let mut w = words(shape_bytes).chain(std::iter::repeat(0));
    let n = spec.params.len();
    // Small extents and lengths are the interesting ones; the top bit picks a raw 64-bit value.
    let small = |v: u64| if v >> 63 == 1 { v } else { v % 4096 };
    let range: Vec<u64> = (0..spec.dims).map(|_| small(w.next().unwrap()).max(1)).collect();
    let mut scalars = vec![0u64; n];
    let mut lens = vec![0u64; n];
    for (i, p) in spec.params.iter().enumerate() {
        match p.kind {
            ParamKind::Scalar(_) => scalars[i] = w.next().unwrap(),
            ParamKind::Buffer { .. } => lens[i] = small(w.next().unwrap()),
        }
    }
    let needed: Vec<Cell<u64>> = (0..MAX_ARGS).map(|_| Cell::new(0)).collect();
    let shape = LaunchShape {
        range: &range,
        scalars: &scalars,
        buffer_lens: &lens,
        needed: &needed,
        overwritten: &[],
    };
    let result = rules.check(&shape);
    let needed_first: Vec<u64> = needed.iter().map(Cell::get).collect();
    needed.iter().for_each(|c| c.set(0));
    assert_eq!(rules.check(&shape), result, "a size check is not deterministic");
    assert_eq!(needed.iter().map(Cell::get).collect::<Vec<_>>(), needed_first);
    match result {
        Ok(()) => {
            for (i, p) in spec.params.iter().enumerate() {
                if matches!(p.kind, ParamKind::Buffer { .. }) {
                    assert!(needed[i].get() <= lens[i], "accepted a buffer that is too small");
                }
            }
        }
        Err(TaskError::BufferTooSmall { index, needed, len }) => {
            let i = usize::from(index);
            assert!(i < n && matches!(spec.params[i].kind, ParamKind::Buffer { .. }));
            assert!(len == lens[i] && needed > len);
        }
        Err(TaskError::InvalidScalar { index, .. }) => {
            assert!(matches!(spec.params[usize::from(index)].kind, ParamKind::Scalar(_)));
        }
        Err(TaskError::InvalidRange { .. } | TaskError::RangeMismatch { .. }) => {}
        Err(other) => panic!("a size check failed with {other:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|b| *b == 0).unwrap_or(data.len());
    let Ok(text) = std::str::from_utf8(&data[..split]) else {
        return;
    };
    let shape = data.get(split + 1..).unwrap_or(&[]);
    match agora_packages::program_manifest(text, "fuzz") {
        Ok(specs) => specs.iter().for_each(|s| check_spec(s, shape)),
        Err(e) => check_error(text, &e),
    }
    match agora_packages::parse_package_manifest(text, "package.toml") {
        Ok((name, specs)) => {
            assert!(!name.is_empty());
            specs.iter().for_each(|s| check_spec(s, shape));
        }
        Err(e) => check_error(text, &e),
    }
});
