//! A workload: buffers, an ordered list of steps (transfers and kernel launches on one queue), and
//! a check of the final buffer contents against a host reference.
//!
//! The same description is replayed by every executor — through Agora ([`run_on_agora`]), and
//! natively without Agora ([`crate::native`]) — so benchmarks compare the same work.

use std::time::Instant;

use agora::{Arg, DeviceKind, Error, NdRange, Queue, Session};
use serde::{Deserialize, Serialize};

/// A kernel argument in a workload.
#[derive(Debug, Clone, Copy)]
pub enum WArg {
    /// Buffer number `n` of the workload.
    Buffer(usize),
    /// `f32`.
    F32(f32),
    /// `i32`.
    I32(i32),
    /// `u32`.
    U32(u32),
    /// `u64`.
    U64(u64),
}

/// One step.
#[derive(Debug, Clone)]
pub enum Step {
    /// Host copy → device (`sync_to`, `clEnqueueWriteBuffer`).
    SyncTo(usize),
    /// Device → host copy (`sync_from`, `clEnqueueReadBuffer`).
    SyncFrom(usize),
    /// A kernel launch.
    Launch {
        /// Kernel name.
        kernel: &'static str,
        /// Arguments in signature order.
        args: Vec<WArg>,
        /// Range (1 to 3 dimensions).
        range: Vec<u64>,
    },
}

/// How a result compares with its reference: the largest relative error, and whether it passes.
pub type Verdict = (f64, bool);

/// A workload.
pub struct Workload {
    /// Program name.
    pub name: &'static str,
    /// Problem size (program-specific meaning).
    pub size: u64,
    /// Initial contents of each buffer.
    pub buffers: Vec<Vec<u8>>,
    /// Steps, in order.
    pub steps: Vec<Step>,
    /// Checks the final buffers.
    #[allow(clippy::type_complexity)]
    pub verify: Box<dyn Fn(&[&[u8]]) -> Verdict + Send + Sync>,
}

impl std::fmt::Debug for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workload")
            .field("name", &self.name)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl Workload {
    /// Verifies `buffers` (final contents, one per workload buffer) and reports a run of
    /// `seconds`.
    pub fn report(&self, seconds: f64, buffers: &[&[u8]]) -> AppReport {
        let (max_error, verified) = (self.verify)(buffers);
        AppReport {
            app: self.name.to_string(),
            size: self.size,
            tasks: self.steps.len() as u64,
            seconds,
            max_error,
            verified,
            devices: Vec::new(),
            buffers: self.buffers.len() as u64,
        }
    }

    /// Kernel launches in the workload.
    pub fn launches(&self) -> usize {
        self.steps.iter().filter(|s| matches!(s, Step::Launch { .. })).count()
    }
}

/// What a run did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AppReport {
    /// Workload name.
    pub app: String,
    /// Problem size.
    pub size: u64,
    /// Tasks issued.
    pub tasks: u64,
    /// Wall time of the steps (buffers already allocated and initialised), seconds.
    pub seconds: f64,
    /// Largest error against the host reference.
    pub max_error: f64,
    /// Whether the result matched the reference.
    pub verified: bool,
    /// Devices the tasks ran on, as the daemon reports them (`agora status`): the device of the
    /// queue's last task, plus any a caller saw the queue bound to during the run. Empty for
    /// native runs.
    #[serde(default)]
    pub devices: Vec<String>,
    /// Buffers the workload allocates. Through Agora, each is released when the run ends by a
    /// task on the ring (so it is ordered after the tasks that use it), which the daemon counts
    /// among completed tasks beside the `tasks` above.
    #[serde(default)]
    pub buffers: u64,
}

/// Runs `workload` on one Agora queue (preferring `device`), then verifies it.
pub fn run_on_agora(session: &Session, workload: &Workload, device: Option<DeviceKind>) -> Result<AppReport, Error> {
    prepare_on_agora(session, workload, device)?.run(session, workload)
}

/// A workload's queue, kernels and buffers (with their initial contents), ready to run once: what
/// [`run_on_agora`] does before its timer starts, apart so a caller can time runs that start
/// together (two tenants at once) without their set-up in between.
pub struct PreparedRun {
    queue: Queue,
    kernels: std::collections::HashMap<&'static str, agora::Kernel>,
    buffers: Vec<agora::Buffer>,
}

/// Opens `workload`'s queue (preferring `device`), looks up its kernels and allocates its buffers.
pub fn prepare_on_agora(
    session: &Session,
    workload: &Workload,
    device: Option<DeviceKind>,
) -> Result<PreparedRun, Error> {
    let queue = crate::queue(session, workload.name, device)?;
    let mut kernels = std::collections::HashMap::new();
    for step in &workload.steps {
        if let Step::Launch { kernel, .. } = step {
            if !kernels.contains_key(kernel) {
                kernels.insert(*kernel, session.kernel(kernel)?);
            }
        }
    }
    let buffers = workload
        .buffers
        .iter()
        .map(|b| session.buffer_from(b))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PreparedRun {
        queue,
        kernels,
        buffers,
    })
}

impl PreparedRun {
    /// Runs the steps of `workload` (the one it was prepared for), timed, then verifies them.
    pub fn run(self, session: &Session, workload: &Workload) -> Result<AppReport, Error> {
        let PreparedRun {
            queue,
            kernels,
            buffers,
        } = self;
        let start = Instant::now();
        for step in &workload.steps {
            match step {
                Step::SyncTo(b) => drop(queue.sync_to(&buffers[*b])?),
                Step::SyncFrom(b) => drop(queue.sync_from(&buffers[*b])?),
                Step::Launch { kernel, args, range } => {
                    let args: Vec<Arg<'_>> = args
                        .iter()
                        .map(|a| match *a {
                            WArg::Buffer(b) => Arg::Buffer(&buffers[b]),
                            WArg::F32(v) => Arg::F32(v),
                            WArg::I32(v) => Arg::I32(v),
                            WArg::U32(v) => Arg::U32(v),
                            WArg::U64(v) => Arg::U64(v),
                        })
                        .collect();
                    let range = match range.as_slice() {
                        [x] => NdRange::d1(*x),
                        [x, y] => NdRange::d2(*x, *y),
                        [x, y, z] => NdRange::d3(*x, *y, *z),
                        _ => {
                            return Err(Error::Protocol(format!(
                                "{}: a range has 1 to 3 dimensions",
                                workload.name
                            )))
                        }
                    };
                    let kernel = kernels.get(kernel).ok_or_else(|| {
                        Error::Protocol(format!("{}: not prepared for kernel {kernel}", workload.name))
                    })?;
                    drop(queue.launch(kernel, &args, range)?);
                }
            }
        }
        queue.finish()?;
        let seconds = start.elapsed().as_secs_f64();
        // Where the policy put the queue's last task (asked before the queue is released, after
        // the timed part).
        let last_device = queue_device(session, workload.name)?;
        let views: Vec<&[u8]> = buffers.iter().map(|b| b.as_slice::<u8>()).collect();
        let mut report = workload.report(seconds, &views);
        report.devices.extend(last_device);
        Ok(report)
    }
}

/// The device queue `name` of this session is bound to now, else the one its last task ran on
/// (`device/lane` trimmed to the device), as the daemon's status reports it.
pub fn queue_device(session: &Session, name: &str) -> Result<Option<String>, Error> {
    let me = session.session_status(session.id())?;
    let queue = me.queues.iter().find(|q| q.name == name);
    Ok(queue
        .and_then(|q| q.bound_to.as_ref().or(q.last_device.as_ref()))
        .map(|d| d.split('/').next().unwrap_or(d).to_string()))
}
