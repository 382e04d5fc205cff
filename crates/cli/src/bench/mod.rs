//! `agora bench …`: system benchmarks, reported side by side with a baseline measured in the
//! same run.
//!
//! Every benchmark starts its own daemon as a separate process on a private socket and stops it
//! afterwards (unless `--socket`/`AGORA_SOCKET` names a running one), so each command measures
//! from a clean state. Client sides run as separate processes (`agora bench-client …`), as real
//! applications would.
//!
//! One file per benchmark; what they share is in [`harness`] (the daemon process, spread
//! statistics) and [`client`](mod@client) (the client process and its modes). Benchmarks use the harness and
//! the client, never each other.

pub mod checkpoint;
pub mod client;
pub mod gpu;
pub mod harness;
pub mod insitu;
pub mod kernels;
pub mod latency;
pub mod migrate;
pub mod overhead;
pub mod sched;
pub mod soak;
pub mod stall;

use anyhow::Result;
use clap::Subcommand;

pub use client::{client, ClientArgs};

/// Benchmarks.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Per-task latency and throughput of empty (`noop`) tasks from separate client processes,
    /// beside an in-process call of the same kernel (the floor).
    Latency(latency::LatencyArgs),
    /// Each program on each device kind, natively and through Agora (client process), and the
    /// transfer round trip; ratios and their geometric mean.
    Overhead(overhead::OverheadArgs),
    /// A mixed workload over cpu + opencl + sim devices under each placement policy, side by
    /// side: makespan, per-device utilisation, energy.
    Hetero(sched::HeteroArgs),
    /// Four client applications sharing the node at once vs the same four one after another
    /// (time-sharing): total time ratio.
    Sharing(sched::SharingArgs),
    /// Latency-class requests beside long batch kernels, unsliced vs chunked: response times,
    /// SLA met, preemption latency.
    Sla(sched::SlaArgs),
    /// Kernels written by hand outside the library (stencil, blocked matmul, reduction): natively
    /// on OpenCL vs as an installed package vs as a sandboxed tenant program, their C versions
    /// natively vs through Agora, the empty tenant-program round trip, first vs cached build.
    Kernels(kernels::KernelsArgs),
    /// Live migration: time to move a queue with N MiB of live buffers between devices with
    /// their own memory, and the slowdown of an iterative application migrated once mid-run.
    Migrate(migrate::MigrateArgs),
    /// NVIDIA GPUs through Agora vs natively (CUDA driver API) in one run: empty kernel, copies,
    /// the Rodinia programs (and their kernels fenced vs unfenced), two tenants sharing a GPU,
    /// latency-class kernels beside a batch tenant. Without a GPU: `"gpus": 0` and the NVRTC / fencing / ptxas pipeline's times.
    Gpu(gpu::GpuArgs),
    /// Checkpoints of an iterative application that rewrites part of its protected state each
    /// iteration: time per iteration with a checkpoint after each vs none, bytes each
    /// checkpoint wrote (differential), the writer's throughput, recovery time (verified).
    Checkpoint(checkpoint::CheckpointArgs),
    /// XEMEM's in situ workflow: a CG simulation exports its state, an analytics process
    /// attaches it and runs STREAM over it (synchronous / asynchronous, one-time / recurring
    /// attachment), and the simulation with checkpoints per level: time against the simulation
    /// alone, attach latency, and a recovered run verified bit for bit.
    Insitu(insitu::InsituArgs),
    /// Periodic DAG sets swept from utilisation 0.5 to the number of lanes under FIFO, global
    /// EDF and APEDF first-fit / worst-fit in the simulator (miss ratios, what APEDF admits,
    /// misses of admitted sets), then on a daemon started for it: release jitter and the
    /// sweep's sets admitted and run there.
    Rt(crate::rt::BenchRtArgs),
    /// An honest neighbour's round trips quiet and beside launches that look tiny but run long
    /// (sgemm with k = 2^22, an nw block of 1024²): p99 ratio, the dispatcher's longest stretch.
    Stall(stall::StallArgs),
    /// Minutes of mixed, verified work from several client processes, some killed (`kill -9`)
    /// and restarted at random: wrong results (must be 0), the daemon's RSS and descriptor
    /// slopes after warm-up, throughput per interval.
    Soak(soak::SoakArgs),
}

/// Runs a benchmark.
pub fn run(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Latency(args) => latency::latency(args.socket.path(), args),
        BenchCommand::Overhead(args) => overhead::overhead(args.socket.path(), args),
        BenchCommand::Hetero(args) => sched::hetero(args),
        BenchCommand::Sharing(args) => sched::sharing(args.socket.path(), args),
        BenchCommand::Sla(args) => sched::sla(args),
        BenchCommand::Migrate(args) => migrate::migrate(args),
        BenchCommand::Kernels(args) => kernels::kernels(args),
        BenchCommand::Soak(args) => soak::soak(args),
        BenchCommand::Gpu(args) => gpu::gpu(args.socket.path(), args),
        BenchCommand::Checkpoint(args) => checkpoint::checkpoint(args.socket.path(), args),
        BenchCommand::Insitu(args) => insitu::insitu(args.socket.path(), args),
        BenchCommand::Rt(args) => crate::rt::bench_rt(args),
        BenchCommand::Stall(args) => stall::stall(args),
    }
}
