//! Starts an executor (`AGORA_EXECUTOR`, the agora binary) over a fresh memfd, builds an OpenCL
//! saxpy from source and again from its binary, runs it and prints what the sandbox enforces
//! and how long each step took: a manual check (run it under `strace -f` to see every call).
//!
//! `cargo build --release -p agora-cli -p agora-executor --example probe &&
//!  AGORA_EXECUTOR=target/release/agora target/release/examples/probe`

use std::time::{Duration, Instant};

use agora_executor::wire::{Arg, Code};
use agora_executor::{Executor, ExecutorSpec};

const SOURCE: &str = "__kernel void saxpy(const float a, __global const float *x, __global float *y) {\n\
    size_t i = get_global_id(0); y[i] = a * x[i] + y[i]; }\n";

fn main() {
    let program = std::env::var("AGORA_EXECUTOR").expect("AGORA_EXECUTOR=path/to/agora");
    let n = 1024usize;
    let fd = rustix::fs::memfd_create("probe", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, (8 * n) as u64).unwrap();
    let file = std::fs::File::from(fd.try_clone().unwrap());
    // SAFETY: a private memfd of this process; only the executor maps it besides.
    let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
    for i in 0..n {
        map[4 * i..4 * i + 4].copy_from_slice(&(i as f32).to_ne_bytes());
        map[4 * (n + i)..4 * (n + i) + 4].copy_from_slice(&1f32.to_ne_bytes());
    }
    let mut executor = Executor::new(ExecutorSpec {
        program: program.into(),
        segment: fd,
        scratch: std::env::temp_dir(),
        tenant: None,
        start_timeout: Duration::from_secs(20),
        build_timeout: Duration::from_secs(60),
        load_timeout: Duration::from_secs(10),
    });
    let t = Instant::now();
    println!("device {:?}, started in {:?}", executor.device(), t.elapsed());
    for line in executor.sandbox() {
        println!("  {line}");
    }
    let t = Instant::now();
    let built = executor
        .build(Code::OpenCl {
            source: SOURCE.into(),
            binary: None,
        })
        .unwrap();
    println!(
        "built from source in {:?}: {:?}, binary {:?} bytes",
        t.elapsed(),
        built.kernels,
        built.binary.as_ref().map(Vec::len)
    );
    let t = Instant::now();
    let again = executor
        .build(Code::OpenCl {
            source: SOURCE.into(),
            binary: built.binary,
        })
        .unwrap();
    println!(
        "built again from the binary ({}) in {:?}",
        again.from_binary,
        t.elapsed()
    );
    let args = vec![
        Arg::Scalar(u64::from(2.0f32.to_bits())),
        Arg::Buffer {
            offset: 0,
            len: 4 * n as u64,
        },
        Arg::Buffer {
            offset: 4 * n as u64,
            len: 4 * n as u64,
        },
    ];
    for round in 0..3 {
        let t = Instant::now();
        let outcome = executor.run(
            0,
            0,
            [n as u64, 1, 1],
            1,
            [0, n as u64],
            args.clone(),
            Duration::from_secs(10),
        );
        println!("launch {round}: {outcome:?} in {:?}", t.elapsed());
    }
    let y10 = f32::from_ne_bytes(map[4 * (n + 10)..4 * (n + 10) + 4].try_into().unwrap());
    println!("y[10] = {y10} (expected 61)");
}
