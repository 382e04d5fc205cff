//! Slurm jobs on this node (issue #17): the prolog registers a job (`JobStart`), sessions of
//! its processes join it, and the epilog ends it (`JobEnd`): every session of the job is ended
//! and reclaimed, even if one of its processes still runs, and the job's use is recorded.
//!
//! Owns: the running jobs and their use so far, which job a new session belongs to (the
//! `SLURM_JOB_ID` in its process's environment, checked against the job's uid), the
//! `[slurm] require_job` refusal, the accounting record (`STATE_DIR/jobs/JOB.json`) and the
//! running jobs kept across a daemon restart (`STATE_DIR/jobs/running/JOB.json`).
//! Must not: schedule anything differently for a job (shares are recorded, and size a device
//! quota only through the prolog's `--device-quota`; lane time is not weighed by them).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use agora_protocol::control::{ControlError, JobAccount, JobStart, Response, STATUS_JOBS};

use super::{Conn, Server};
use crate::session::{Credentials, Session, ACCOUNTED_DEVICES};

/// A running job and what its ended sessions used.
#[derive(Debug)]
pub(super) struct RunningJob {
    spec: JobStart,
    started: Instant,
    /// Sessions it opened so far.
    sessions: u64,
    used: Usage,
}

impl RunningJob {
    /// A job starting now, with nothing used yet.
    fn new(spec: JobStart) -> Self {
        RunningJob {
            spec,
            started: Instant::now(),
            sessions: 0,
            used: Usage::default(),
        }
    }
}

/// Use added up over sessions.
#[derive(Debug, Default, Clone)]
struct Usage {
    tasks_completed: u64,
    tasks_failed: u64,
    device_ns: [u64; ACCOUNTED_DEVICES],
    bytes_to_device: u64,
    bytes_to_host: u64,
}

impl Usage {
    fn add_session(&mut self, session: &Session) {
        let shared = &session.shared;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        self.tasks_completed += load(&shared.completed);
        self.tasks_failed += load(&shared.failed);
        for (total, device) in self.device_ns.iter_mut().zip(&shared.device_ns) {
            *total += load(device);
        }
        self.bytes_to_device += load(&shared.bytes_to_device);
        self.bytes_to_host += load(&shared.bytes_to_host);
    }
}

/// The running jobs.
#[derive(Debug, Default)]
pub(super) struct Jobs {
    running: HashMap<u64, RunningJob>,
    /// Where records go (`STATE_DIR/jobs`).
    dir: PathBuf,
}

impl Jobs {
    /// The jobs a previous daemon on this state directory had running (its prolog ran, its
    /// epilog not yet): they go on, so that the epilog still finds its job.
    pub(super) fn load(state_dir: &std::path::Path) -> Jobs {
        let dir = state_dir.join("jobs");
        let mut running = HashMap::new();
        if let Ok(entries) = std::fs::read_dir(dir.join("running")) {
            for entry in entries.flatten() {
                let Ok(text) = std::fs::read_to_string(entry.path()) else {
                    continue;
                };
                match serde_json::from_str::<JobStart>(&text) {
                    Ok(spec) => {
                        running.insert(spec.job, RunningJob::new(spec));
                    }
                    Err(e) => {
                        tracing::warn!(file = %entry.path().display(), error = %e, "ignoring an unreadable running-job file")
                    }
                }
            }
        }
        if !running.is_empty() {
            tracing::info!(jobs = running.len(), "Slurm jobs still running from before the restart");
        }
        Jobs { running, dir }
    }
}

/// Whether `who` may register and end jobs: root or the daemon's user (Slurm's prolog and
/// epilog run as root).
fn is_job_controller(who: &Credentials) -> bool {
    who.uid == 0 || who.uid == rustix::process::geteuid().as_raw()
}

/// The `SLURM_JOB_ID` in process `pid`'s environment, if any (readable by its own user and root:
/// the daemon runs as one of them for sessions it can serve).
fn job_of_process(pid: i32) -> Option<u64> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ
        .split(|&b| b == 0)
        .find_map(|entry| entry.strip_prefix(b"SLURM_JOB_ID="))
        .and_then(|value| std::str::from_utf8(value).ok()?.parse().ok())
}

impl Server {
    /// `Request::JobStart`: registers a job; for a job registered already (its prolog run again)
    /// takes the new settings and keeps its use.
    pub(super) fn job_start(&mut self, id: u64, spec: JobStart) -> Option<Response> {
        let who = self.credentials(id)?;
        if !is_job_controller(&who) {
            return Some(Response::Error(ControlError::NotPermitted(format!(
                "uid {} may not register Slurm jobs: only root or the daemon's user (Slurm's prolog) may",
                who.uid
            ))));
        }
        // A quota of 0 would make every session of the job fail at its first buffer, blaming
        // the daemon's `--session-quota`: refuse it here, where the cause is.
        if spec.heap_quota == Some(0) {
            return Some(Response::Error(ControlError::BadRequest(format!(
                "a heap quota of 0 for Slurm job {} would refuse every buffer of its sessions: give at least 1 byte (e.g. 256M), or none for the daemon's",
                spec.job
            ))));
        }
        // Slurm runs the prolog again for a requeued job: the job goes on with the use it has,
        // its settings replaced. A different uid is another job under a reused id, or a mistake:
        // joining its sessions to the recorded one would mix two users' accounting.
        let again = match self.jobs.running.get(&spec.job) {
            Some(job) if job.spec.uid != spec.uid => {
                return Some(Response::Error(ControlError::BadRequest(format!(
                    "Slurm job {} is already registered for uid {}, not uid {}: end it first (agora slurm job-end --job {}) if its id now names another job",
                    spec.job, job.spec.uid, spec.uid, spec.job
                ))));
            }
            Some(_) => true,
            None => false,
        };
        // Granted, but a session never gets more than the daemon's own bound (`hello`): say so where
        // the operator looks, since the prolog that asked shows nothing of a success.
        if let Some(asked) = spec.heap_quota.filter(|&asked| asked > self.config.session_quota) {
            tracing::warn!(
                job = spec.job,
                asked,
                granted = self.config.session_quota,
                "Slurm job's heap quota (AGORA_HEAP_QUOTA, job-start --heap-quota) is above this daemon's session quota ([sessions] quota, --session-quota): its sessions get the daemon's; raise that to grant more"
            );
        }
        let file = self.jobs.dir.join("running").join(format!("{}.json", spec.job));
        let written = std::fs::create_dir_all(self.jobs.dir.join("running"))
            .and_then(|()| crate::state_files::write_bytes_replacing(&file, &serde_json::to_vec(&spec)?));
        let not_recorded = written.err().map(|e| {
            tracing::warn!(job = spec.job, error = %e, file = %file.display(), "could not record the running job; a daemon restart will forget it");
            format!("could not write {}: {e}", file.display())
        });
        tracing::info!(
            job = spec.job,
            uid = spec.uid,
            shares = spec.shares,
            again,
            "Slurm job started"
        );
        match self.jobs.running.get_mut(&spec.job) {
            Some(job) => job.spec = spec,
            None => {
                self.jobs.running.insert(spec.job, RunningJob::new(spec));
            }
        }
        Some(Response::JobStarted { again, not_recorded })
    }

    /// Which job a new session of `who` belongs to, or why it is refused: a process naming a
    /// job of another uid is refused; with `[slurm] require_job`, so is one in no running job
    /// (admins exempt).
    pub(super) fn session_job(&self, who: &Credentials) -> Result<Option<&JobStart>, ControlError> {
        let claimed = job_of_process(who.pid);
        match claimed.and_then(|job| self.jobs.running.get(&job)) {
            Some(job) if job.spec.uid == who.uid => return Ok(Some(&job.spec)),
            Some(job) => {
                return Err(ControlError::NotPermitted(format!(
                    "this process says it belongs to Slurm job {} of uid {}, but runs as uid {}: use your own job's allocation",
                    job.spec.job, job.spec.uid, who.uid
                )))
            }
            None => {}
        }
        if self.config.slurm_require_job && !self.is_admin_credentials(who) {
            let why = match claimed {
                Some(job) => format!("Slurm job {job} is not running on this node"),
                None => "this process is not part of a Slurm job".to_string(),
            };
            return Err(ControlError::NotPermitted(format!(
                "{why}, and this daemon serves only processes of running jobs ([slurm] require_job): run it with srun or sbatch"
            )));
        }
        Ok(None)
    }

    /// A session of a job ended: its use goes to the job.
    pub(super) fn job_session_ended(&mut self, session: &Session) {
        if let Some(job) = session.job.and_then(|job| self.jobs.running.get_mut(&job)) {
            job.used.add_session(session);
        }
    }

    /// A session joined `job`.
    pub(super) fn job_session_opened(&mut self, job: u64) {
        if let Some(job) = self.jobs.running.get_mut(&job) {
            job.sessions += 1;
        }
    }

    /// `Request::JobEnd`: ends the job's sessions, records and returns its use.
    pub(super) fn job_end(&mut self, id: u64, job: u64) -> Option<Response> {
        let who = self.credentials(id)?;
        if !is_job_controller(&who) {
            return Some(Response::Error(ControlError::NotPermitted(format!(
                "uid {} may not end Slurm jobs: only root or the daemon's user (Slurm's epilog) may",
                who.uid
            ))));
        }
        if !self.jobs.running.contains_key(&job) {
            return Some(Response::Error(ControlError::BadRequest(format!(
                "no Slurm job {job} is running on this daemon (its prolog did not register it, or its epilog already ran)"
            ))));
        }
        let sessions: Vec<u64> = self
            .conns
            .iter()
            .filter_map(|(&sid, conn)| match conn {
                Conn::Session(s) if s.job == Some(job) => Some(sid),
                _ => None,
            })
            .collect();
        for &sid in &sessions {
            tracing::info!(job, session = sid, "ending a session of an ended Slurm job");
            // `close` adds its use to the job.
            self.close(sid);
        }
        let running = self.jobs.running.remove(&job)?;
        let mut account = self.account(&running);
        account.sessions_ended_by_daemon = sessions.len() as u64;
        let _ = std::fs::remove_file(self.jobs.dir.join("running").join(format!("{job}.json")));
        let record = self.jobs.dir.join(format!("{job}.json"));
        // A requeued job's epilog ran after each earlier run and left its record: this run's use
        // is added to it (the record then covers every run), never written over it.
        let runs = match earlier_runs(&record, &running.spec) {
            Some((earlier, runs)) => {
                add_account(&mut account, &earlier);
                runs + 1
            }
            None => 1,
        };
        let written = std::fs::create_dir_all(&self.jobs.dir).and_then(|()| {
            let mut value = serde_json::to_value(&account)?;
            value["ended_unix_s"] = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
                .into();
            value["restarts"] = running.spec.restarts.into();
            value["runs"] = runs.into();
            crate::state_files::write_bytes_replacing(&record, &serde_json::to_vec_pretty(&value)?)
        });
        let not_recorded = written.err().map(|e| {
            tracing::warn!(job, error = %e, file = %record.display(), "could not write the job's accounting record");
            format!("could not write {}: {e}", record.display())
        });
        tracing::info!(
            job,
            sessions = account.sessions,
            tasks = account.tasks_completed,
            runs,
            "Slurm job ended"
        );
        Some(Response::JobEnded {
            account: Box::new(account),
            not_recorded,
        })
    }

    /// A job's use so far: its ended sessions' and its live ones'.
    fn account(&self, job: &RunningJob) -> JobAccount {
        let mut used = job.used.clone();
        for conn in self.conns.values() {
            if let Conn::Session(s) = conn {
                if s.job == Some(job.spec.job) {
                    used.add_session(s);
                }
            }
        }
        let mut by_kind: Vec<(String, f64)> = Vec::new();
        let mut energy = 0.0;
        for (index, device) in self.scheduler.devices.iter().enumerate().take(ACCOUNTED_DEVICES) {
            let seconds = used.device_ns[index] as f64 / 1e9;
            energy += seconds * self.scheduler.lane_watts(index);
            let kind = device.info().kind.name().to_string();
            match by_kind.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, total)) => *total += seconds,
                None => by_kind.push((kind, seconds)),
            }
        }
        JobAccount {
            job: job.spec.job,
            uid: job.spec.uid,
            shares: job.spec.shares,
            sessions: job.sessions,
            sessions_ended_by_daemon: 0,
            tasks_completed: used.tasks_completed,
            tasks_failed: used.tasks_failed,
            device_seconds: by_kind,
            bytes_to_device: used.bytes_to_device,
            bytes_to_host: used.bytes_to_host,
            energy_model_joules: energy,
            wall_seconds: job.started.elapsed().as_secs_f64(),
        }
    }

    /// The running jobs with their use so far, for status.
    pub(super) fn job_accounts(&self) -> Vec<JobAccount> {
        let mut jobs: Vec<&RunningJob> = self.jobs.running.values().collect();
        jobs.sort_by_key(|j| j.spec.job);
        jobs.into_iter().take(STATUS_JOBS).map(|j| self.account(j)).collect()
    }
}

/// The use that earlier runs of a requeued job recorded in `record`, and how many runs that
/// was: only when `spec` is a restart (Slurm's restart count above 0) of the same user's job and
/// the record is of an earlier run (its restart count lower). A record of a job of another user
/// or one left by a cluster whose job ids started again is no earlier run of this job.
fn earlier_runs(record: &std::path::Path, spec: &JobStart) -> Option<(JobAccount, u64)> {
    if spec.restarts == 0 {
        return None;
    }
    let text = std::fs::read_to_string(record).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    let restarts = value.get("restarts").and_then(serde_json::Value::as_u64).unwrap_or(0);
    let runs = value.get("runs").and_then(serde_json::Value::as_u64).unwrap_or(1);
    let earlier: JobAccount = serde_json::from_value(value).ok()?;
    (earlier.job == spec.job && earlier.uid == spec.uid && restarts < u64::from(spec.restarts))
        .then_some((earlier, runs))
}

/// Adds `earlier`'s use to `account` (shares stay this run's).
fn add_account(account: &mut JobAccount, earlier: &JobAccount) {
    account.sessions += earlier.sessions;
    account.sessions_ended_by_daemon += earlier.sessions_ended_by_daemon;
    account.tasks_completed += earlier.tasks_completed;
    account.tasks_failed += earlier.tasks_failed;
    for (kind, seconds) in &earlier.device_seconds {
        match account.device_seconds.iter_mut().find(|(k, _)| k == kind) {
            Some((_, total)) => *total += seconds,
            None => account.device_seconds.push((kind.clone(), *seconds)),
        }
    }
    account.bytes_to_device += earlier.bytes_to_device;
    account.bytes_to_host += earlier.bytes_to_host;
    account.energy_model_joules += earlier.energy_model_joules;
    account.wall_seconds += earlier.wall_seconds;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(tasks: u64, seconds: f64) -> JobAccount {
        JobAccount {
            job: 9,
            uid: 1001,
            shares: 1,
            sessions: 1,
            tasks_completed: tasks,
            device_seconds: vec![("cpu".into(), seconds)],
            wall_seconds: 5.0,
            ..JobAccount::default()
        }
    }

    #[test]
    fn a_requeued_run_adds_its_use_to_the_earlier_runs_record() {
        let dir = tempfile::tempdir().unwrap();
        let record = dir.path().join("9.json");
        let mut value = serde_json::to_value(account(10_879, 1.63)).unwrap();
        value["restarts"] = 0.into();
        std::fs::write(&record, serde_json::to_vec(&value).unwrap()).unwrap();
        let spec = |uid, restarts| JobStart {
            job: 9,
            uid,
            shares: 1,
            restarts,
            ..JobStart::default()
        };
        // A first run (no restart) never adds: its id may be reused by a fresh cluster.
        assert!(earlier_runs(&record, &spec(1001, 0)).is_none());
        // Another user's job under the same id is no earlier run.
        assert!(earlier_runs(&record, &spec(1002, 1)).is_none());
        let (earlier, runs) = earlier_runs(&record, &spec(1001, 1)).expect("the first run's record");
        assert_eq!(runs, 1);
        let mut now = account(20_006, 2.18);
        add_account(&mut now, &earlier);
        assert_eq!(now.tasks_completed, 30_885);
        assert!((now.device_seconds[0].1 - 3.81).abs() < 1e-9, "{now:?}");
        assert_eq!(now.sessions, 2);
        assert!((now.wall_seconds - 10.0).abs() < 1e-9);
        // A record written by this run's own restart count (or a later one) is not earlier.
        let mut value = serde_json::to_value(&now).unwrap();
        value["restarts"] = 1.into();
        value["runs"] = 2.into();
        std::fs::write(&record, serde_json::to_vec(&value).unwrap()).unwrap();
        assert!(earlier_runs(&record, &spec(1001, 1)).is_none());
        assert_eq!(earlier_runs(&record, &spec(1001, 2)).map(|(_, runs)| runs), Some(2));
    }
}
