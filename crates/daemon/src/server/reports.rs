//! What the operator asks of the daemon as a whole: the status report (summarised so it fits one
//! frame), per-uid usage, the device list, draining a device, and Slurm's suspend and resume of
//! them all, which remember what the suspend drained (admin only).
//!
//! The dispatcher's (`Server`'s) methods for these replies. It must not change sessions.

use super::*;

impl Server {
    /// Whether `credentials` are an admin's: root or the daemon's own user by default, else the
    /// uids of `[daemon] admin_uids`; and members of `admin_gids` (by primary gid or a
    /// supplementary group).
    pub(super) fn is_admin_credentials(&self, credentials: &crate::session::Credentials) -> bool {
        let daemon_uid = rustix::process::geteuid().as_raw();
        let listed = match &self.config.admin_uids {
            None => credentials.uid == 0 || credentials.uid == daemon_uid,
            Some(uids) => uids.contains(&credentials.uid),
        };
        listed || credentials.in_any_group(&self.config.admin_gids)
    }

    /// `Err(reply)` unless connection `id` is an admin's ([`Server::is_admin_credentials`]).
    pub(super) fn require_admin(&self, id: u64, what: &str) -> Result<(), Response> {
        let Some(credentials) = self.credentials(id) else {
            return Err(Response::Error(ControlError::BadRequest("connection gone".into())));
        };
        let daemon_uid = rustix::process::geteuid().as_raw();
        if !self.is_admin_credentials(&credentials) {
            let who = match &self.config.admin_uids {
                None => format!("root or the daemon's user (uid {daemon_uid})"),
                Some(uids) => format!("uids {uids:?}"),
            };
            return Err(Response::Error(ControlError::NotPermitted(format!(
                "uid {} (in groups {:?}) may not {what}: only {who} or members of groups {:?} may ([daemon] admin_uids / admin_gids)",
                credentials.uid,
                credentials.all_groups(),
                self.config.admin_gids
            ))));
        }
        Ok(())
    }

    /// `Request::Drain`: admin only (root or the daemon's own user).
    pub(super) fn drain(&mut self, id: u64, device: &str, drain: bool, evacuate: bool) -> Response {
        if let Err(refusal) = self.require_admin(id, "drain devices") {
            return refusal;
        }
        let names: Vec<&str> = self.scheduler.devices.iter().map(|d| d.info().name.as_str()).collect();
        let Some(index) = names.iter().position(|n| *n == device) else {
            return Response::Error(ControlError::BadRequest(format!(
                "unknown device '{device}': this daemon has {}",
                names.join(", ")
            )));
        };
        if evacuate && !drain {
            return Response::Error(ControlError::BadRequest(
                "evacuate goes with drain: a device that takes new work would fill up again".into(),
            ));
        }
        if let Err(e) = self.scheduler.set_draining(index, drain) {
            return Response::Error(ControlError::BadRequest(e));
        }
        // The operator decided about this device since the suspend: resume leaves it so.
        self.suspended.remove(&index);
        let (evacuated_buffers, evacuated_bytes) = if evacuate && !self.scheduler.migration.is_failed(index) {
            self.scheduler.evacuate(index)
        } else {
            (0, 0)
        };
        // Queues busy there now: each moves when its next task arrives and these are done.
        let queues_bound = self
            .live_sessions()
            .flat_map(|s| s.queues.values())
            .filter(|q| q.in_flight.load(Ordering::Relaxed) > 0 && q.binding.load().device() == index)
            .count() as u64;
        Response::Drained {
            device: device.to_string(),
            draining: drain,
            queues_bound,
            evacuated_buffers,
            evacuated_bytes,
            migrations: self.scheduler.migration.stats.migrations,
        }
    }

    /// `Request::PowerSave`: admin only. Suspend drains and evacuates every device, noting the
    /// ones it drained; resume undrains only those.
    pub(super) fn power_save(&mut self, id: u64, suspend: bool) -> Response {
        let what = if suspend {
            "suspend the node's devices"
        } else {
            "resume the node's devices"
        };
        if let Err(refusal) = self.require_admin(id, what) {
            return refusal;
        }
        let mut devices = Vec::with_capacity(self.scheduler.devices.len());
        for index in 0..self.scheduler.devices.len() {
            let device = self.scheduler.devices[index].info().name.clone();
            let was_draining = self.scheduler.migration.is_draining(index);
            let mut report = agora_protocol::control::PowerDevice {
                device,
                changed: false,
                draining: was_draining,
                evacuated_buffers: 0,
                evacuated_bytes: 0,
            };
            if suspend {
                if !was_draining && self.scheduler.set_draining(index, true).is_ok() {
                    self.suspended.insert(index);
                    report.changed = true;
                    report.draining = true;
                }
                // A device drained by hand may still hold idle buffers: nothing may be left on
                // a device that powers down, whoever drained it.
                if !self.scheduler.migration.is_failed(index) {
                    (report.evacuated_buffers, report.evacuated_bytes) = self.scheduler.evacuate(index);
                }
            } else if self.suspended.remove(&index) {
                match self.scheduler.set_draining(index, false) {
                    Ok(()) => {
                        report.changed = true;
                        report.draining = false;
                    }
                    // Failed meanwhile: it stays drained and comes back by itself.
                    Err(e) => tracing::warn!(device = %report.device, error = %e, "not resumed"),
                }
            }
            devices.push(report);
        }
        Response::PowerSaved(devices)
    }

    pub(super) fn device_names(&self) -> Vec<String> {
        self.scheduler.devices.iter().map(|d| d.info().name.clone()).collect()
    }

    /// Whose sessions connection `id` may see: `None` for all of them (the default, and an
    /// admin's view), else its own uid's (`[daemon] private_status`).
    pub(super) fn private_viewer(&self, id: u64) -> Option<u32> {
        if !self.config.private_status {
            return None;
        }
        // A connection without credentials (gone) sees nothing of anyone's.
        let credentials = self.credentials(id).unwrap_or(crate::session::Credentials {
            pid: 0,
            uid: u32::MAX,
            gid: u32::MAX,
            groups: Arc::from([]),
        });
        (!self.is_admin_credentials(&credentials)).then_some(credentials.uid)
    }

    /// The status summary: every counter, and the busiest sessions (each with its busiest
    /// queues) as many as fit in [`REPLY_BUDGET`], whatever the tenants created. With a
    /// `viewer` (a private daemon's tenant), the sessions, uids, jobs and DAGs listed are that
    /// uid's only; the counters and devices stay the node's.
    pub(super) fn status(&self, viewer: Option<u32>) -> StatusReport {
        let device_names = self.device_names();
        let live: Vec<&Session> = self.live_sessions().collect();
        let live_completed: u64 = live.iter().map(|s| s.shared.completed.load(Ordering::Relaxed)).sum();
        let live_failed: u64 = live.iter().map(|s| s.shared.failed.load(Ordering::Relaxed)).sum();
        let visible = |uid: u32| viewer.is_none_or(|v| v == uid);
        let mut busiest: Vec<&Session> = live.iter().copied().filter(|s| visible(s.credentials.uid)).collect();
        let private = viewer.map(|uid| agora_protocol::control::PrivateView {
            uid,
            sessions: busiest.len() as u64,
        });
        busiest.sort_by_key(|s| {
            (
                std::cmp::Reverse(s.shared.in_flight.load(Ordering::Relaxed)),
                std::cmp::Reverse(s.submitted),
                s.id,
            )
        });
        let mut sessions = Vec::new();
        let mut bytes = 0;
        for session in busiest.into_iter().take(STATUS_SESSIONS) {
            let entry = session.status(&device_names);
            bytes += encoded_len(&entry);
            if bytes > REPLY_BUDGET {
                break;
            }
            sessions.push(entry);
        }
        sessions.sort_by_key(|s| s.id);
        let closing_completed: u64 = self
            .closing
            .iter()
            .map(|s| s.shared.completed.load(Ordering::Relaxed))
            .sum();
        let closing_failed: u64 = self
            .closing
            .iter()
            .map(|s| s.shared.failed.load(Ordering::Relaxed))
            .sum();
        StatusReport {
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            policy: self.scheduler.policy_name().to_string(),
            devices: self
                .scheduler
                .devices
                .iter()
                .enumerate()
                .map(|(index, d)| {
                    let mut status = device_status(d.status());
                    status.draining = self.scheduler.migration.is_draining(index);
                    status.failed |= self.scheduler.migration.is_failed(index);
                    status
                })
                .collect(),
            sessions,
            live_sessions: live.len() as u64,
            closing_sessions: self.closing.len() as u64,
            sessions_opened: self.sessions_opened,
            sessions_closed: self.sessions_closed,
            tasks_completed: self.retired_completed + live_completed + closing_completed,
            tasks_failed: self.retired_failed + live_failed + closing_failed,
            evictions: self.scheduler.residency.evictions,
            memory_waits: self.scheduler.migration.stats.memory_waits,
            dispatcher_longest_iteration_ms: self.longest_iteration_ns as f64 / 1e6,
            dispatcher_stalls: self.stalls,
            batch_priority: self.scheduler.config().lane_priorities.batch().name(),
            batch_priority_now: self.scheduler.config().lane_priorities.batch_now().name(),
            batch_priority_switches: self.scheduler.batch_priority_switches,
            allocation_retries: self.scheduler.allocation_retries,
            latency_policy: self.scheduler.config().latency_policy.name().to_string(),
            revocations: self.scheduler.revocations().0,
            revoked_work_s: self.scheduler.revocations().1,
            migrations: self.scheduler.migration.stats.migrations,
            tasks_replayed: self.scheduler.migration.stats.replayed,
            tasks_lost: self.scheduler.migration.stats.lost,
            uids: self.uid_usage(viewer),
            limit_refusals: self.books.refusals(),
            jobs: self.job_accounts().into_iter().filter(|job| visible(job.uid)).collect(),
            dags: self
                .realtime
                .as_ref()
                .map(|(service, _)| service.status(agora_protocol::control::STATUS_DAGS))
                .unwrap_or_default()
                .into_iter()
                .filter(|dag| viewer.is_none() || session_uid(&live, dag.session) == viewer)
                .collect(),
            private,
            state_dir: Some(self.config.effective_state_dir().display().to_string()),
        }
    }

    /// Each uid present against the limits, the most connected first (at most `STATUS_UIDS`);
    /// with a `viewer`, that uid only.
    pub(super) fn uid_usage(&self, viewer: Option<u32>) -> Vec<agora_protocol::control::UidUsage> {
        let mut uids: Vec<(u32, usize)> = self
            .books
            .uids()
            .map(|(uid, conns, _, _)| (uid, conns))
            .filter(|&(uid, _)| viewer.is_none_or(|v| v == uid))
            .collect();
        uids.sort_by_key(|&(uid, conns)| (std::cmp::Reverse(conns), uid));
        uids.into_iter()
            .take(agora_protocol::control::STATUS_UIDS)
            .map(|(uid, _)| {
                let queues = self.uid_sessions(uid).map(|s| s.queues.len() as u64).sum();
                let buffers = self.uid_sessions(uid).map(|s| s.buffers.len() as u64).sum();
                self.books.usage(uid, queues, buffers, self.uid_control_requests(uid))
            })
            .collect()
    }
}

/// The uid of live session `session`, if it is one.
fn session_uid(live: &[&Session], session: u64) -> Option<u32> {
    live.iter().find(|s| s.id == session).map(|s| s.credentials.uid)
}
