//! Stage 4, **submit**: a planned task runs inline on the dispatcher thread, or is handed to
//! its lane as one job, as row slices (chunked launch), or as a revocable job.
//!
//! Owns: the inline run of tiny tasks (and its completion, batched into the ring with the
//! others), binding an idle queue to its lane, the queue's in-flight count and settling ticket,
//! the predicted work booked on the lane and in the latency books, and building the job's
//! [`LaneCompletion`].
//!
//! Must not: choose where the task runs or what data moves (`place`, `plan`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use agora_devices::{Device, Job, Share, Slices, Transfer, Work};
use agora_protocol::control::QueueClass;
use agora_protocol::{Completion, TaskError};

use super::complete::LaneCompletion;
use super::place::Placement;
use super::plan::Planned;
use super::{migration, Scheduler, MAX_PREDICTED_NS};
use crate::revocation::Done;
use crate::session::Session;
use crate::telemetry::Span;

impl Scheduler {
    /// Whether a planned task runs inline: short by every measure (`inline`), on a device that
    /// computes on host memory, nothing to move, its queue idle, one slice.
    pub(super) fn runs_inline(&self, placement: &Placement, planned: &Planned) -> bool {
        placement.inline_allowed
            && self.devices[placement.binding.device()].info().shares_host_memory
            && planned.transfers.is_empty()
            && placement.required_slices == 1
            && planned.capture.is_none()
    }

    /// Runs `planned` here and now; its completion joins the batch flushed to the ring.
    #[inline]
    pub(super) fn run_inline(&mut self, session: &Session, task_id: u64, placement: &Placement, planned: Box<Planned>) {
        let start = Instant::now();
        let result = match planned.injected {
            false => self.devices[placement.binding.device()].run_inline(&planned.work),
            true => Err(TaskError::KernelFault),
        };
        // Every inline run is timed: one that overran sends its shape to lanes.
        let ran = start.elapsed();
        self.inline_guard.ran_inline(placement.shape, ran.as_nanos() as f64);
        session
            .shared
            .add_device_time(placement.binding.device(), ran.as_nanos() as u64);
        let result = planned.named.settle(task_id, result);
        let counters = self.task_counters(planned.name, planned.queue.class);
        if result.is_ok() {
            counters.ok.inc()
        } else {
            counters.failed.inc()
        };
        if let Some(trace) = &self.telemetry.trace {
            trace.record(Span {
                category: "exec",
                name: planned.name,
                row: 0,
                start,
                end: start + ran,
                session: session.shared.id,
                tenant: session.shared.tenant.clone(),
                task: task_id,
                queue: planned.queue.name.clone(),
            });
        }
        self.inline_done.push(match result {
            Ok(()) => Completion::ok(task_id),
            Err(e) => Completion::failed(task_id, e),
        });
    }

    /// Hands `planned` to the lane `placement` chose.
    #[inline]
    pub(super) fn submit(&mut self, session: &Session, task_id: u64, placement: &Placement, planned: Box<Planned>) {
        let Planned {
            queue,
            kernel,
            name,
            items,
            estimated_ns,
            transfers,
            work,
            named,
            ticket,
            injected,
            capture,
        } = *planned;
        let (device, lane) = (placement.binding.device(), placement.binding.lane());
        let ticket = ticket.map_or_else(|| migration::Ticket::unreplayable(&self.migration, device), |t| *t);
        if placement.idle {
            queue.binding.store(placement.binding);
        }
        // Completions of earlier inline tasks must reach the ring before this job's.
        self.flush(&session.shared);
        queue.in_flight.fetch_add(1, Ordering::AcqRel);
        session.shared.in_flight.fetch_add(1, Ordering::Relaxed);
        // Predicted time of this job on its lane, for the policies' queue-wait estimates.
        let device_name = self.device_names[device].clone();
        let transfer_bytes = transfers.iter().map(Transfer::len).sum::<usize>() as u64;
        let (predicted, transfer_ns) = {
            let model =
                (kernel.is_some() || transfer_bytes > 0).then(|| self.model.lock().unwrap_or_else(|e| e.into_inner()));
            let predicted = match (&kernel, &model) {
                (Some(k), Some(model)) => model
                    .estimate(k.label(), &device_name, items)
                    .ns()
                    .unwrap_or(estimated_ns),
                _ => 0.0,
            };
            // What the lane is booked for: the kernel and the job's transfers. No transfer is
            // free either: a queue's 512 MiB `sync_to` booked as nothing let every policy put a
            // neighbour's small task behind it (1.4 s behind three of them on PoCL).
            let transfer_ns = match &model {
                Some(model) => {
                    super::place::transfer_ns(model, &device_name, self.facts[device].bandwidth, transfer_bytes)
                }
                _ => 0.0,
            };
            // At most 2^50 ns (13 days): a huge range extrapolated from small ones must not
            // make the lanes' sums of predictions wrap.
            (predicted.min(MAX_PREDICTED_NS) as u64, transfer_ns)
        };
        let booked = (predicted as f64 + transfer_ns).min(MAX_PREDICTED_NS) as u64;
        let lane_pending = self.lane_pending[device][lane].clone();
        lane_pending.fetch_add(booked, Ordering::Relaxed);
        let lane_tenants = self.lane_tenants[device][lane].clone();
        lane_tenants.started(session.shared.id, booked);
        let urgent = queue.class == QueueClass::Latency;
        // A DAG node job: ordered by its deadline on the lane, never sliced or revoked.
        let deadline = self.deadline_job.map(|(_, deadline)| deadline);
        // The session's outstanding lane work, for back-pressure (its batch work by prediction).
        let session_ns = if queue.class == QueueClass::Batch && deadline.is_none() {
            booked
        } else {
            0
        };
        session.shared.lane_work_started(session_ns);
        // Latency work's own accounting: its queued time per lane, TReM's `q` and `l`.
        let latency = urgent.then(|| self.books.charge(device, lane, booked));
        let slices = match deadline {
            Some(_) => placement.required_slices,
            None => self
                .slices_for(device, &work, queue.class, predicted as f64)
                .max(placement.required_slices),
        };
        let revocable = deadline.is_none()
            && slices <= 1
            && self.revocable(device, &work, queue.class, predicted as f64, || {
                crate::revocation::bytes_to_save(&work, &transfers)
            });
        let counters = self.task_counters(name, queue.class).clone();
        let done = LaneCompletion {
            task_id,
            device,
            sequence: queue.sequencer.ticket(),
            queue,
            shared: session.shared.clone(),
            named,
            ticket,
            injected,
            kernel,
            transfer_bytes,
            name,
            items,
            device_name,
            model: self.model.clone(),
            predicted: booked,
            session_ns,
            lane_pending,
            lane_tenants,
            latency,
            counters,
            histograms: self.histograms[device].clone(),
            telemetry: self.telemetry.clone(),
            row: self.first_row[device] + lane as u32,
            inline_shape: placement.shape.map(|shape| (shape, self.inline_guard.clone())),
        }
        .into_done();
        // A checkpoint captures its buffers once its job is done (their host copies are current
        // then), before the task completes; its job runs alone on the lane, so nothing after it
        // changes them first.
        let exclusive = capture.is_some();
        let done: Done = match capture {
            None => done,
            Some(capture) => Box::new(move |result, times| {
                // A job that failed captures nothing (its buffers' host copies may be stale).
                let result = result.and_then(|()| capture.capture());
                done(result, times)
            }),
        };
        if revocable {
            let rw_bytes = crate::revocation::read_write_bytes(&work) as f64;
            // The CPU stops at its next block of rows (1/256 of the launch); restoring the
            // read-write buffers costs a copy of them.
            let cost_ns = predicted as f64 / 256.0 + rw_bytes / self.facts[device].bandwidth.max(1.0) * 1e9;
            crate::revocation::submit(
                self.devices[device].clone(),
                lane,
                transfers,
                work,
                session.shared.cancelled.clone(),
                session.shared.lane_share(booked),
                self.books.victim_slot(device, lane).clone(),
                predicted as f64,
                cost_ns,
                self.revocation_counters.clone(),
                done,
            );
            return;
        }
        let cancelled = Some(session.shared.cancelled.clone());
        if slices <= 1 {
            self.devices[device].submit(
                lane,
                Job {
                    transfers,
                    work,
                    keepalive: None,
                    cancelled,
                    revoke: None,
                    urgent,
                    exclusive,
                    deadline,
                    slices: None,
                    share: session.shared.lane_share(booked),
                    done,
                },
            );
        } else {
            let share = session.shared.lane_share(booked);
            submit_sliced(
                &*self.devices[device],
                lane,
                transfers,
                work,
                slices,
                cancelled,
                share,
                done,
            );
        }
    }
}
/// Submits a launch as one job that its lane cuts into `slices` consecutive row slices as it
/// starts them ([`agora_devices::Slices`]: a launch cut into thousands of slices costs one
/// queued job). The task completes (once, with the first error if any) when its last slice has
/// run; its transfers go with the first slice. Between slices the lane may start urgent
/// (latency-class) jobs. Slice boundaries are multiples of the device's row alignment for the
/// kernel (whole work-groups on OpenCL), so there may be fewer slices than asked for.
#[allow(clippy::too_many_arguments)]
fn submit_sliced(
    device: &dyn Device,
    lane: usize,
    transfers: Vec<Transfer>,
    work: Work,
    slices: u64,
    cancelled: Option<Arc<std::sync::atomic::AtomicBool>>,
    share: Share,
    done: Done,
) {
    let Work::Launch { kernel, dims, .. } = &work else {
        unreachable!("only launches are sliced")
    };
    let align = device.row_alignment(kernel, *dims).max(1);
    device.submit(
        lane,
        Job {
            transfers,
            work,
            keepalive: None,
            cancelled,
            revoke: None,
            urgent: false,
            exclusive: false,
            deadline: None,
            slices: Some(Slices { count: slices, align }),
            share,
            done,
        },
    );
}
