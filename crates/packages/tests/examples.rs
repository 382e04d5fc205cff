//! The example package examples/packages/imaging builds (scripts/build-packages.sh), loads, and
//! its C kernels compute what they document.

use std::path::{Path, PathBuf};
use std::process::Command;

use agora_kernels::run_on_host;
use agora_packages::{discover, load, Package};
use agora_protocol::{RawArg, TaskError};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn imaging() -> Package {
    let status = Command::new("bash")
        .arg(repository().join("scripts/build-packages.sh"))
        .status()
        .expect("bash runs");
    assert!(status.success(), "scripts/build-packages.sh succeeded");
    let dirs = discover(&repository().join("examples/packages")).unwrap();
    let dir = dirs
        .iter()
        .find(|d| d.ends_with("imaging"))
        .expect("examples/packages/imaging is found");
    load(dir).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn the_imaging_example_loads_with_its_three_implementations() {
    let package = imaging();
    assert_eq!(package.name, "imaging");
    let names: Vec<&str> = package.kernels.iter().map(|k| &*k.def.name).collect();
    assert_eq!(names, vec!["imaging.scale", "imaging.blur"]);
    for k in &package.kernels {
        assert_eq!(k.implementations, vec!["opencl", "cuda", "cpu"], "{}", k.def.name);
        let cuda = k.def.cuda.as_ref().unwrap();
        assert!(cuda.guarded, "{}: imaging.cu takes the guarded convention", k.def.name);
        assert_eq!(cuda.program, "imaging/imaging.cu");
        assert_eq!(cuda.code.language(), "cuda");
        assert!(k.def.chunkable, "{}", k.def.name);
        assert!(k.def.doc.contains("range"), "{}: the doc names the range", k.def.name);
    }
}

#[test]
fn imaging_scale_computes_on_the_cpu() {
    let package = imaging();
    let scale = &package
        .kernels
        .iter()
        .find(|k| k.def.name == "imaging.scale")
        .unwrap()
        .def;
    let mut x: Vec<f32> = (0..1000).map(|i| i as f32 - 500.0).collect();
    let mut y = vec![0f32; 1000];
    let expected: Vec<f32> = x.iter().map(|v| 1.5 * v).collect();
    let mut buffers: Vec<&mut [u8]> = vec![bytemuck::cast_slice_mut(&mut x), bytemuck::cast_slice_mut(&mut y)];
    run_on_host(
        scale,
        &[1000],
        &[RawArg::f32(1.5), RawArg::buffer(0), RawArg::buffer(1)],
        &mut buffers,
        4,
    )
    .unwrap();
    assert_eq!(y, expected);
}

/// The 5-point mean with clamped edges, as the package documents it.
fn blur_reference(w: usize, h: usize, src: &[f32]) -> Vec<f32> {
    let mut dst = vec![0f32; w * h];
    for r in 0..h {
        for c in 0..w {
            let (up, down) = (r.saturating_sub(1), (r + 1).min(h - 1));
            let (left, right) = (c.saturating_sub(1), (c + 1).min(w - 1));
            let sum = src[r * w + c] + src[up * w + c] + src[down * w + c] + src[r * w + left] + src[r * w + right];
            dst[r * w + c] = sum / 5.0;
        }
    }
    dst
}

#[test]
fn imaging_blur_computes_on_the_cpu_and_checks_its_range() {
    let package = imaging();
    let blur = &package
        .kernels
        .iter()
        .find(|k| k.def.name == "imaging.blur")
        .unwrap()
        .def;
    let (w, h) = (37usize, 23usize);
    let mut src: Vec<f32> = (0..w * h).map(|i| ((i * 7919) % 101) as f32).collect();
    let expected = blur_reference(w, h, &src);
    let args = [
        RawArg::i32(w as i32),
        RawArg::i32(h as i32),
        RawArg::buffer(0),
        RawArg::buffer(1),
    ];
    for threads in [1, 5] {
        let mut dst = vec![0f32; w * h];
        let mut buffers: Vec<&mut [u8]> = vec![bytemuck::cast_slice_mut(&mut src), bytemuck::cast_slice_mut(&mut dst)];
        run_on_host(blur, &[h as u64, w as u64], &args, &mut buffers, threads).unwrap();
        for (i, (got, want)) in dst.iter().zip(&expected).enumerate() {
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "pixel {i}: {got} != {want}"
            );
        }
    }
    // The range must be (h, w), and the images w * h pixels.
    let mut dst = vec![0f32; w * h - 1];
    let mut buffers: Vec<&mut [u8]> = vec![bytemuck::cast_slice_mut(&mut src), bytemuck::cast_slice_mut(&mut dst)];
    let err = run_on_host(blur, &[h as u64, w as u64], &args, &mut buffers, 1).unwrap_err();
    assert_eq!(
        err,
        TaskError::BufferTooSmall {
            index: 3,
            needed: (w * h * 4) as u64,
            len: (w * h * 4 - 4) as u64
        }
    );
    let err = run_on_host(blur, &[w as u64, h as u64], &args, &mut buffers, 1).unwrap_err();
    assert!(matches!(err, TaskError::RangeMismatch { .. }), "{err:?}");
}

/// docs/KERNELS.md's manifest example is the example package's manifest (comments aside).
#[test]
fn the_documented_manifest_is_the_example_package() {
    let package = imaging();
    let doc = std::fs::read_to_string(repository().join("docs/KERNELS.md")).unwrap();
    let start = doc.find("```toml\n").expect("a toml block in docs/KERNELS.md") + "```toml\n".len();
    let manifest = &doc[start..start + doc[start..].find("```").unwrap()];
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(agora_packages::MANIFEST), manifest).unwrap();
    for file in ["imaging.cl", "imaging.cu", "libimaging.so"] {
        std::fs::copy(package.dir.join(file), dir.path().join(file)).unwrap();
    }
    let documented = load(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(documented.kernels.len(), package.kernels.len());
    for (a, b) in documented.kernels.iter().zip(&package.kernels) {
        assert_eq!(a.def.name, b.def.name);
        assert_eq!(a.fingerprint, b.fingerprint, "{}: the same definition", a.def.name);
    }
}

/// The Rodinia programs that moved out of the compiled-in library into example packages.
fn rodinia(name: &str) -> Package {
    let status = Command::new("bash")
        .arg(repository().join("scripts/build-packages.sh"))
        .status()
        .expect("bash runs");
    assert!(status.success(), "scripts/build-packages.sh succeeded");
    load(&repository().join("examples/packages").join(name)).unwrap_or_else(|e| panic!("{e}"))
}

/// Every case of the library's case table for hotspot and pathfinder (the inputs and results
/// the compiled-in kernels were tested with) passes on the packages' C implementations, split
/// into 1, 2 and 3 row blocks.
#[test]
fn the_rodinia_packages_pass_the_cases_of_the_kernels_they_replace() {
    for program in agora_kernels::cases::PACKAGE_PROGRAMS {
        let package = rodinia(program);
        let cases = agora_kernels::cases::for_program(program);
        assert!(!cases.is_empty(), "{program} has cases");
        for case in &cases {
            let def = &package
                .kernels
                .iter()
                .find(|k| k.def.name == case.kernel)
                .unwrap_or_else(|| panic!("{program} defines {}", case.kernel))
                .def;
            assert!(
                def.chunkable && def.opencl.is_some() && def.cpu.is_some(),
                "{}",
                case.kernel
            );
            for threads in [1, 2, 3] {
                agora_kernels::cases::run_case_with(case, def, threads)
                    .unwrap_or_else(|e| panic!("{e} ({threads} row blocks)"));
            }
        }
    }
}

/// The packages' size rules refuse what the compiled-in checks refused, with the same errors.
#[test]
fn the_rodinia_packages_refuse_bad_launches_like_the_library_did() {
    let hotspot = rodinia("hotspot");
    let step = &hotspot.kernels[0].def;
    let (rows, cols) = (7usize, 13usize);
    let mut power = vec![0f32; rows * cols];
    let mut src = vec![0f32; rows * cols];
    let mut dst = vec![0f32; rows * cols];
    let args = |rows: i32| {
        vec![
            RawArg::buffer(0),
            RawArg::buffer(1),
            RawArg::buffer(2),
            RawArg::i32(rows),
            RawArg::i32(cols as i32),
            RawArg::f32(0.1),
            RawArg::f32(0.1),
            RawArg::f32(0.1),
            RawArg::f32(0.1),
            RawArg::f32(80.0),
        ]
    };
    let mut run = |range: &[u64], args: &[RawArg], short: bool| {
        let len = if short { 4 } else { power.len() * 4 };
        let mut buffers: Vec<&mut [u8]> = vec![
            &mut bytemuck::cast_slice_mut(&mut power)[..len],
            bytemuck::cast_slice_mut(&mut src),
            bytemuck::cast_slice_mut(&mut dst),
        ];
        run_on_host(step, range, args, &mut buffers, 1)
    };
    assert_eq!(
        run(&[13, 7], &args(7), false).unwrap_err(),
        TaskError::RangeMismatch {
            expected_x: 7,
            expected_y: 13,
            got_x: 13,
            got_y: 7,
            got_z: 1
        }
    );
    assert!(matches!(
        run(&[7, 13], &args(-1), false).unwrap_err(),
        TaskError::InvalidScalar { index: 3, .. }
    ));
    assert!(matches!(
        run(&[7, 13], &args(7), true).unwrap_err(),
        TaskError::BufferTooSmall { index: 0, .. }
    ));
    run(&[7, 13], &args(7), false).unwrap();

    // pathfinder.row: a row past the wall.
    let pathfinder = rodinia("pathfinder");
    let row = &pathfinder.kernels[0].def;
    let mut wall = vec![0i32; 3 * 5];
    let mut src = vec![0i32; 5];
    let mut dst = vec![0i32; 5];
    let mut buffers: Vec<&mut [u8]> = vec![
        bytemuck::cast_slice_mut(&mut wall),
        bytemuck::cast_slice_mut(&mut src),
        bytemuck::cast_slice_mut(&mut dst),
    ];
    let args = [
        RawArg::buffer(0),
        RawArg::buffer(1),
        RawArg::buffer(2),
        RawArg::i32(5),
        RawArg::i32(7),
    ];
    assert!(matches!(
        run_on_host(row, &[5], &args, &mut buffers, 1).unwrap_err(),
        TaskError::BufferTooSmall { index: 0, .. }
    ));
}
