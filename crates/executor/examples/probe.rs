//! Starts an executor (`AGORA_EXECUTOR`, the agora binary) over a fresh memfd, builds an OpenCL
//! saxpy, runs it and prints timings: a manual check of the sandbox (run it under `strace -f`).

use std::time::{Duration, Instant};

use agora_executor::wire::{Arg, Code};
use agora_executor::{Executor, ExecutorSpec};

const SOURCE: &str = "__kernel void saxpy(const float a, __global const float *x, __global float *y) {\n\
    size_t i = get_global_id(0); y[i] = a * x[i] + y[i]; }\n";

fn main() {
    let program = std::env::var("AGORA_EXECUTOR").expect("AGORA_EXECUTOR=path/to/agora");
    let len = 1 << 20;
    let fd = rustix::fs::memfd_create("probe", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    let file = std::fs::File::from(fd.try_clone().unwrap());
    let map = unsafe { memmap::map(&file, len as usize) };
    let n = 1024u64;
    let floats = map as *mut f32;
    for i in 0..n as usize {
        unsafe {
            *floats.add(i) = i as f32;
            *floats.add(n as usize + i) = 1.0;
        }
    }
    let mut executor = Executor::new(ExecutorSpec {
        program: program.into(),
        segment: fd,
        scratch: std::env::temp_dir(),
        tenant: None,
        start_timeout: Duration::from_secs(20),
        build_timeout: Duration::from_secs(60),
    });
    let t = Instant::now();
    println!("device {:?} in {:?}", executor.device(), t.elapsed());
    println!("sandbox {:?}", executor.sandbox());
    let t = Instant::now();
    let built = executor.build(Code::OpenCl {
        source: SOURCE.into(),
        binary: None,
    });
    println!(
        "build {:?} in {:?}",
        built.as_ref().map(|b| (&b.kernels, b.binary.as_ref().map(|b| b.len()))),
        t.elapsed()
    );
    let binary = built.unwrap().binary;
    let t = Instant::now();
    let again = executor.build(Code::OpenCl {
        source: SOURCE.into(),
        binary,
    });
    println!(
        "from binary {:?} in {:?}",
        again.as_ref().map(|b| b.from_binary),
        t.elapsed()
    );
    let args = vec![
        Arg::Scalar(2.0f32.to_bits() as u64),
        Arg::Buffer { offset: 0, len: n * 4 },
        Arg::Buffer {
            offset: n * 4,
            len: n * 4,
        },
    ];
    for round in 0..3 {
        let t = Instant::now();
        let r = executor.run(0, 0, [n, 1, 1], 1, [0, n], args.clone(), Duration::from_secs(10));
        println!("run {round} {r:?} in {:?}", t.elapsed());
    }
    println!("y[10] = {}", unsafe { *floats.add(n as usize + 10) });
}

mod memmap {
    pub unsafe fn map(file: &std::fs::File, len: usize) -> *mut u8 {
        unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                file,
                0,
            )
            .unwrap() as *mut u8
        }
    }
}
