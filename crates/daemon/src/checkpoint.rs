//! The checkpoint/restart service (FTI's model on one node): a session protects buffers under
//! ids, a `Checkpoint` task in a queue captures their bytes in the queue's order, and a writer
//! thread makes them durable in the [`agora_checkpoint::Store`]; `Recover` puts the newest intact
//! checkpoint back into the protected buffers' host copies.
//!
//! Owns the store, the writer thread and what the daemon remembers of each application's
//! checkpoints (the newest id accepted, writes in progress, the last writes' outcomes). An
//! application is the session's client name (made file-name safe) and its user: a process of the
//! same name and user, after a crash or under a restarted daemon, recovers what an earlier one
//! saved. The capture runs where the task's job finishes (a lane thread); the write, hashing
//! included, runs on the writer thread, so neither the dispatcher nor other tenants wait for the
//! disk.
//!
//! Must not: place, plan or run tasks (the scheduler makes the task's job and calls
//! [`CheckpointCapture::capture`] from its completion), or read a buffer whose host copy is not
//! current (the task's transfers bring every protected buffer home first).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};

use agora_checkpoint::{AppKey, Capture, Entry, Level, Recovered, Store, StoreConfig, StoreError};
use agora_protocol::completion::{
    CHECKPOINT_ID_NOT_NEWER, CHECKPOINT_LEVEL_UNAVAILABLE, CHECKPOINT_LEVEL_UNUSABLE, CHECKPOINT_NAME_IN_USE,
    CHECKPOINT_NO_STORE, NEWEST_FROM_CHECKPOINT, NEWEST_FROM_SNAPSHOT, NEWEST_FROM_STORE,
};
use agora_protocol::control::{
    CheckpointReport, CheckpointSummary, CheckpointWrite, ControlError, RecoverReport, Response,
};
use agora_protocol::TaskError;
use agora_transport::wake::Doorbell;

use crate::config::DaemonConfig;
use crate::memory::BufferRecord;

/// Checkpoints of one application captured and not yet written, at most: each holds a copy of
/// the protected bytes in the daemon's memory until the writer is done with it. A capture beyond
/// it waits for the writer (its queue's lane waits: back-pressure, as memory pressure waits).
const MAX_WRITING: u32 = 4;
/// Write outcomes remembered per application.
const WRITES_KEPT: usize = 64;

/// What the daemon remembers of one application.
#[derive(Debug, Default)]
struct Application {
    /// The newest checkpoint id accepted (`None` until the store was asked).
    newest: Option<u64>,
    /// Where `newest` came from (`NEWEST_FROM_*`), for the refusal of an id not above it.
    newest_from: u8,
    /// Captured, not yet written.
    writing: u32,
    /// The last writes' outcomes, oldest first.
    writes: VecDeque<CheckpointWrite>,
    /// The session whose checkpoint was admitted last: while it lives, another session's
    /// checkpoint under the same name is refused ([`CHECKPOINT_NAME_IN_USE`]).
    writer: Option<Writer>,
}

/// A session that writes an application's checkpoints.
#[derive(Debug, Clone)]
pub(crate) struct Writer {
    /// The daemon's id of the session.
    pub(crate) session: u64,
    /// Its client's process id (for the refusal's message).
    pub(crate) pid: i32,
    /// Set once the session's client is gone ([`crate::session::SessionShared::cancelled`]).
    pub(crate) gone: Arc<AtomicBool>,
}

/// The service: one per daemon.
#[derive(Debug)]
pub(crate) struct Checkpoints {
    /// `None`: the store's directory is unusable (logged at start); checkpoints are refused.
    store: Option<Arc<Store>>,
    writer: Mutex<Option<Sender<Capturing>>>,
    /// The writer thread, joined by [`Checkpoints::stop`].
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    applications: Arc<Mutex<HashMap<(u32, String), Application>>>,
    /// Signalled by the writer when a write is done (a capture may be waiting for room).
    room: Arc<std::sync::Condvar>,
    /// The bytes all applications' captures hold until written, and their bound.
    capture_memory: Arc<CaptureMemory>,
    partner: bool,
    shared: bool,
    /// Levels whose configured directory is unusable, with the refusal that names it (told to
    /// clients when they protect, since a task's failure carries no text).
    unusable: Vec<(u8, String)>,
}

/// A captured checkpoint on its way to the writer.
#[derive(Debug)]
struct Capturing {
    app: AppKey,
    capture: Capture,
    /// Its share of the capture memory, given back once it is written.
    reservation: CaptureReservation,
}

/// The daemon's bound on the bytes that captures hold in its memory until the writer is done
/// with them, all tenants together (`[checkpoint] capture_memory`). Each application may also
/// hold at most [`MAX_WRITING`] captures, but that bounds nothing across applications: four
/// tenants checkpointing 128 MiB each got a daemon in a 384 MiB cgroup OOM-killed, ending every
/// tenant's work. A checkpoint task reserves its bytes before it is planned and waits (its queue
/// with it, like a task waiting for device memory) while the others' captures fill the bound.
#[derive(Debug)]
pub(crate) struct CaptureMemory {
    limit: u64,
    held: AtomicU64,
    /// Rung when bytes are given back (the dispatcher looks at the tasks waiting for them).
    wake: Mutex<Option<Arc<Doorbell>>>,
    /// The daemon's metric of the bytes held (`agora_checkpoint_capture_bytes`), once attached.
    gauge: std::sync::OnceLock<prometheus_client::metrics::gauge::Gauge>,
}

impl CaptureMemory {
    fn new(limit: u64) -> Self {
        CaptureMemory {
            limit: limit.max(1),
            held: AtomicU64::new(0),
            wake: Mutex::new(None),
            gauge: std::sync::OnceLock::new(),
        }
    }

    /// Whether `bytes` more fit now. A capture larger than the whole bound fits when nothing
    /// else is held (alone, it holds no more than it must: refusing it would make its
    /// application's checkpoints impossible).
    pub(crate) fn has_room(&self, bytes: u64) -> bool {
        let held = self.held.load(Ordering::Acquire);
        held == 0 || held.saturating_add(bytes) <= self.limit
    }

    /// Takes `bytes` if they fit ([`CaptureMemory::has_room`]).
    fn reserve(self: &Arc<Self>, bytes: u64) -> Option<CaptureReservation> {
        let mut held = self.held.load(Ordering::Acquire);
        loop {
            if held != 0 && held.saturating_add(bytes) > self.limit {
                return None;
            }
            match self
                .held
                .compare_exchange_weak(held, held.saturating_add(bytes), Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.show(held.saturating_add(bytes));
                    return Some(CaptureReservation {
                        memory: self.clone(),
                        bytes,
                    });
                }
                Err(now) => held = now,
            }
        }
    }

    /// Sets the metric to `held` bytes (a racing update may show a moment-old value: a gauge).
    fn show(&self, held: u64) {
        if let Some(gauge) = self.gauge.get() {
            gauge.set(i64::try_from(held).unwrap_or(i64::MAX));
        }
    }

    /// Bytes held now.
    #[cfg(test)]
    fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }
}

/// A capture's bytes of [`CaptureMemory`], given back when dropped (written, failed, or never
/// captured).
#[derive(Debug)]
pub(crate) struct CaptureReservation {
    memory: Arc<CaptureMemory>,
    bytes: u64,
}

impl Drop for CaptureReservation {
    fn drop(&mut self) {
        let held = self.memory.held.fetch_sub(self.bytes, Ordering::AcqRel);
        self.memory.show(held.saturating_sub(self.bytes));
        if let Some(wake) = &*self.memory.wake.lock().unwrap_or_else(|e| e.into_inner()) {
            wake.ring();
        }
    }
}

impl Checkpoints {
    /// Opens the store the configuration describes (level 1 under the state directory unless
    /// configured) and starts the writer thread.
    pub(crate) fn start(config: &DaemonConfig) -> Arc<Checkpoints> {
        let local = config
            .checkpoint_local
            .clone()
            .unwrap_or_else(|| config.effective_state_dir().join("checkpoints"));
        let mut store_config = StoreConfig::new(local.clone());
        store_config.partner = config.checkpoint_partner.clone();
        store_config.shared = config.checkpoint_shared.clone();
        store_config.block_bytes = config.checkpoint_block_bytes;
        store_config.data_shards = config.checkpoint_data_shards;
        store_config.parity_shards = config.checkpoint_parity_shards;
        store_config.keep = config.checkpoint_keep;
        store_config.quota_per_user =
            (config.checkpoint_quota_per_user > 0).then_some(config.checkpoint_quota_per_user);
        if let Some(ms) = std::env::var("AGORA_TEST_CHECKPOINT_PAUSE_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        {
            tracing::warn!(
                ms,
                "test-only: every checkpoint write pauses before its manifest (AGORA_TEST_CHECKPOINT_PAUSE_MS)"
            );
            store_config.test_pause_before_manifest = Some(std::time::Duration::from_millis(ms));
        }
        let store = match Store::open(store_config) {
            Ok(store) => {
                // Only the levels that need it are refused: a level-1 application must not lose
                // its checkpoints to a level-4 setting it never uses.
                for bad in store.unusable() {
                    tracing::error!(key = %format!("checkpoint.{}", bad.key), directory = %bad.directory.display(), error = %bad.reason, "checkpoint level {} will be refused: its directory is unusable (the other levels work); fix it and restart the daemon", level_number(bad.level));
                }
                Some(Arc::new(store))
            }
            Err(e) => {
                tracing::error!(key = "checkpoint.local", directory = %local.display(), error = %e, "no checkpoint store: checkpoint tasks will be refused (fix [checkpoint] in the configuration)");
                None
            }
        };
        let unusable: Vec<(u8, String)> = store
            .iter()
            .flat_map(|s| s.unusable())
            .map(|u| (level_number(u.level), u.message()))
            .collect();
        let applications: Arc<Mutex<HashMap<(u32, String), Application>>> = Arc::default();
        let room: Arc<std::sync::Condvar> = Arc::default();
        let capture_memory = Arc::new(CaptureMemory::new(config.effective_capture_memory()));
        tracing::debug!(
            bytes = capture_memory.limit,
            "captured checkpoints may hold this much memory until written ([checkpoint] capture_memory)"
        );
        let (sender, receiver) = mpsc::channel::<Capturing>();
        let mut thread = None;
        if let Some(store) = store.clone() {
            let books = applications.clone();
            let done = room.clone();
            let spawned = std::thread::Builder::new()
                .name("agora-checkpoint".into())
                .spawn(move || {
                    for Capturing { app, capture, reservation } in receiver {
                        let (checkpoint, level) = (capture.sequence, capture.level);
                        let bytes_total: u64 = capture.entries.iter().map(|e| e.bytes.len() as u64).sum();
                        // A panic in the store must not end the writer: captures waiting for room
                        // would wait for ever (and their lanes with them).
                        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.write(&app, capture)))
                            .unwrap_or_else(|_| Err(StoreError::Encode { what: "the store panicked (a bug); see the daemon's log".into() }));
                        let write = match outcome {
                            Ok(report) => {
                                tracing::debug!(app = %app.name, uid = app.uid, checkpoint, level = %level, bytes = report.bytes_total, written = report.bytes_written, seconds = report.seconds, "checkpoint written");
                                CheckpointWrite {
                                    checkpoint,
                                    level: level_number(level),
                                    bytes_total: report.bytes_total,
                                    bytes_written: report.bytes_written,
                                    seconds: report.seconds,
                                    error: None,
                                }
                            }
                            Err(e) => {
                                tracing::warn!(app = %app.name, uid = app.uid, checkpoint, error = %e, "a checkpoint could not be written; recovery uses the previous one");
                                CheckpointWrite {
                                    checkpoint,
                                    level: level_number(level),
                                    bytes_total,
                                    bytes_written: 0,
                                    seconds: 0.0,
                                    error: Some(e.to_string()),
                                }
                            }
                        };
                        // The capture's bytes were freed by the write: others may capture now.
                        drop(reservation);
                        let mut books = books.lock().unwrap_or_else(|e| e.into_inner());
                        let entry = books.entry((app.uid, app.name.clone())).or_default();
                        entry.writing = entry.writing.saturating_sub(1);
                        entry.writes.push_back(write);
                        while entry.writes.len() > WRITES_KEPT {
                            entry.writes.pop_front();
                        }
                        done.notify_all();
                    }
                });
            match spawned {
                Ok(handle) => thread = Some(handle),
                Err(e) => {
                    tracing::error!(error = %e, "cannot start the checkpoint writer thread: checkpoint tasks will be refused");
                    return Arc::new(Checkpoints {
                        store: None,
                        writer: Mutex::new(None),
                        thread: Mutex::new(None),
                        applications,
                        room,
                        capture_memory,
                        partner: false,
                        shared: false,
                        unusable: Vec::new(),
                    });
                }
            }
        }
        Arc::new(Checkpoints {
            store,
            writer: Mutex::new(Some(sender)),
            thread: Mutex::new(thread),
            applications,
            room,
            capture_memory,
            partner: config.checkpoint_partner.is_some(),
            shared: config.checkpoint_shared.is_some(),
            unusable,
        })
    }

    /// Rings `wake` whenever capture memory is given back (the dispatcher's doorbell), and
    /// keeps `gauge` at the bytes held.
    pub(crate) fn set_wake(&self, wake: Arc<Doorbell>, gauge: prometheus_client::metrics::gauge::Gauge) {
        *self.capture_memory.wake.lock().unwrap_or_else(|e| e.into_inner()) = Some(wake);
        let _ = self.capture_memory.gauge.set(gauge);
    }

    /// The bound on captured bytes held for the writer, and its use.
    pub(crate) fn capture_memory(&self) -> &Arc<CaptureMemory> {
        &self.capture_memory
    }

    /// Reserves `bytes` of capture memory for a checkpoint task about to be planned; `None`:
    /// other captures fill it, the task waits ([`CaptureMemory::has_room`]).
    pub(crate) fn reserve_capture(&self, bytes: u64) -> Option<CaptureReservation> {
        self.capture_memory.reserve(bytes)
    }

    /// Levels whose configured directory is unusable, with the message naming it and why.
    pub(crate) fn unusable(&self) -> Vec<(u8, String)> {
        self.unusable.clone()
    }

    /// Stops taking checkpoints and waits until the writer has written the captured ones.
    pub(crate) fn stop(&self) {
        self.writer.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = thread.join();
        }
    }

    /// Judges a checkpoint task of `writer`: its level, whether another live session already
    /// writes the application's checkpoints, and its id against the application's newest. On
    /// success the id becomes the newest and `writer` the application's writer.
    ///
    /// A `snapshot` takes the id after the application's newest, whatever `checkpoint` says,
    /// and the id it took is returned with the level. Snapshot ids used to be the wall clock in
    /// milliseconds: one snapshot then shut out every later `checkpoint(iteration)` (ids must
    /// grow) until it left the store. Numbered after the newest, snapshots and explicit ids
    /// interleave: an explicit id is refused only when a checkpoint or snapshot already took it.
    ///
    /// Two live sessions of one user under one name (the ranks of an MPI program, two jobs of
    /// one program) would write one checkpoint stream: their ids refuse each other's, and a
    /// restarted one recovers whichever wrote last. So the first writer keeps the name while
    /// it lives, and the other's checkpoints are refused saying so (not as ids that do not grow).
    pub(crate) fn admit(
        &self,
        app: &AppKey,
        writer: &Writer,
        checkpoint: u64,
        snapshot: bool,
        level: u32,
    ) -> Result<(Level, u64), TaskError> {
        let refuse = |reason, pid: i32| TaskError::CheckpointRefused {
            reason,
            level: level.min(255) as u8,
            checkpoint,
            detail: u64::from(pid.max(0) as u32),
        };
        let store = self.store.as_ref().ok_or(refuse(CHECKPOINT_NO_STORE, 0))?;
        if self.unusable.iter().any(|(l, _)| u32::from(*l) == level) {
            return Err(refuse(CHECKPOINT_LEVEL_UNUSABLE, 0));
        }
        let level = match level {
            1 => Level::L1,
            2 if self.partner => Level::L2,
            3 => Level::L3,
            4 if self.shared => Level::L4,
            _ => return Err(refuse(CHECKPOINT_LEVEL_UNAVAILABLE, 0)),
        };
        let mut books = self.applications.lock().unwrap_or_else(|e| e.into_inner());
        let entry = books.entry((app.uid, app.name.clone())).or_default();
        if let Some(other) = &entry.writer {
            if other.session != writer.session && !other.gone.load(Ordering::Acquire) {
                return Err(refuse(CHECKPOINT_NAME_IN_USE, other.pid));
            }
        }
        if entry.newest.is_none() {
            // What an earlier daemon or process wrote counts too, damaged checkpoints included:
            // the store refuses their ids as well, and a refusal there, after the task
            // completed, would reach the client only through `checkpoints()`.
            entry.newest = store.newest_sequence(app).ok().flatten();
            entry.newest_from = NEWEST_FROM_STORE;
        }
        let checkpoint = if snapshot {
            entry.newest.map_or(1, |newest| newest.saturating_add(1))
        } else {
            checkpoint
        };
        if let Some(newest) = entry.newest.filter(|&newest| checkpoint <= newest) {
            return Err(TaskError::CheckpointRefused {
                reason: CHECKPOINT_ID_NOT_NEWER,
                level: level_number(level),
                checkpoint,
                detail: agora_protocol::completion::newest_detail(newest, entry.newest_from),
            });
        }
        entry.newest = Some(checkpoint);
        entry.newest_from = if snapshot {
            NEWEST_FROM_SNAPSHOT
        } else {
            NEWEST_FROM_CHECKPOINT
        };
        entry.writer = Some(writer.clone());
        Ok((level, checkpoint))
    }

    /// Counts one more capture of `app` being written; with `may_wait`, first waits until it has
    /// fewer than [`MAX_WRITING`].
    fn wait_for_room(&self, app: &AppKey, may_wait: bool) {
        let key = (app.uid, app.name.clone());
        let mut books = self.applications.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let entry = books.entry(key.clone()).or_default();
            if entry.writing < MAX_WRITING || !may_wait {
                entry.writing += 1;
                return;
            }
            books = self.room.wait(books).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// A counted capture that did not reach the writer.
    fn not_sent(&self, app: &AppKey) {
        let mut books = self.applications.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = books.get_mut(&(app.uid, app.name.clone())) {
            entry.writing = entry.writing.saturating_sub(1);
        }
        self.room.notify_all();
    }

    /// The newest intact checkpoint of `app` (`Ok(None)`: it has none).
    ///
    /// Captures of the application still being written (a crashed process's last checkpoints)
    /// are waited for first, up to 5 s (this runs on the control thread, which other tenants'
    /// control requests share): they are what to recover from. And the application
    /// restarts from what is on disk: ids admitted for checkpoints that were never captured (a
    /// crashed process's queued checkpoint tasks, skipped when it died) no longer count, and the
    /// damaged checkpoints recovery passed over are set aside ([`Store::resume`]), so the
    /// resumed run may use the ids after the recovered one.
    pub(crate) fn recover(&self, app: &AppKey) -> Result<Option<Recovered>, String> {
        let store = self
            .store
            .as_ref()
            .ok_or_else(|| "the daemon has no checkpoint store (see its log)".to_string())?;
        let key = (app.uid, app.name.clone());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut books = self.applications.lock().unwrap_or_else(|e| e.into_inner());
        while books.get(&key).is_some_and(|entry| entry.writing > 0) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            books = self.room.wait_timeout(books, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        if let Some(entry) = books.get_mut(&key) {
            entry.newest = None;
        }
        drop(books);
        store.resume(app).map_err(|e: StoreError| e.to_string())
    }

    /// What `app` has: its complete checkpoints and its last writes.
    pub(crate) fn report(&self, app: &AppKey) -> CheckpointReport {
        // The writes first, the listing after: a write is counted done only after its manifest
        // is in place, so every write this report calls done is in its listing (listing first
        // missed a write that ended in between, reported done but not listed).
        let (writes, writing) = {
            let books = self.applications.lock().unwrap_or_else(|e| e.into_inner());
            let entry = books.get(&(app.uid, app.name.clone()));
            (
                entry.map(|e| e.writes.iter().cloned().collect()).unwrap_or_default(),
                entry.map_or(0, |e| e.writing),
            )
        };
        let checkpoints = self
            .store
            .as_ref()
            .and_then(|store| store.list(app).ok())
            .unwrap_or_default()
            .into_iter()
            .map(|c| CheckpointSummary {
                checkpoint: c.sequence,
                level: level_number(c.level),
                bytes: c.bytes_total,
                entries: c.entries as u32,
                created_unix_ms: c.created_unix_ms,
            })
            .collect();
        CheckpointReport {
            application: app.name.clone(),
            checkpoints,
            writes,
            writing,
        }
    }
}

/// The level's number on the wire (1–4).
pub(crate) fn level_number(level: Level) -> u8 {
    match level {
        Level::L1 => 1,
        Level::L2 => 2,
        Level::L3 => 3,
        Level::L4 => 4,
    }
}

/// The application a session's checkpoints belong to: its client name with every character a
/// file name should not hold replaced by `_` (at most 128 bytes), and its user.
pub(crate) fn application(uid: u32, client_name: &str) -> AppKey {
    let mut name: String = client_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(128)
        .collect();
    if name.is_empty() || name.starts_with('.') {
        name.insert(0, '_');
        name.truncate(128);
    }
    AppKey::new(uid, name).unwrap_or_else(|_| AppKey::new(uid, "application").expect("a valid name"))
}

/// One admitted checkpoint task's capture: the protected buffers, read when the task's job is
/// done (their host copies are current then, and the job ran alone on its lane).
pub(crate) struct CheckpointCapture {
    pub(crate) service: Arc<Checkpoints>,
    pub(crate) app: AppKey,
    pub(crate) checkpoint: u64,
    pub(crate) level: Level,
    pub(crate) buffers: Vec<(u32, Arc<BufferRecord>)>,
    /// Whether the capture may wait for the writer: only on a lane thread of its own (the host
    /// device's). On other devices it runs on the device's completion thread, which every
    /// tenant's jobs there share; it does not wait there (the bound on held copies is exceeded
    /// instead).
    pub(crate) may_wait: bool,
    /// Its bytes of the daemon's capture memory, reserved before it was planned.
    pub(crate) reservation: CaptureReservation,
}

impl CheckpointCapture {
    /// Copies the protected bytes (the copy-on-checkpoint) and hands them to the writer. Runs
    /// where the task's job finishes; the write itself happens on the writer thread.
    pub(crate) fn capture(self) -> Result<(), TaskError> {
        // Room first, so the copies held for the writer stay bounded.
        self.service.wait_for_room(&self.app, self.may_wait);
        let mut entries = Vec::with_capacity(self.buffers.len());
        for (id, record) in &self.buffers {
            match record.read_host() {
                Some(bytes) => entries.push(Entry { id: *id, bytes }),
                None => {
                    self.service.not_sent(&self.app);
                    return Err(TaskError::Cancelled);
                }
            }
        }
        let sent = self
            .service
            .writer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|writer| {
                writer.send(Capturing {
                    app: self.app.clone(),
                    capture: Capture {
                        sequence: self.checkpoint,
                        level: self.level,
                        entries,
                    },
                    reservation: self.reservation,
                })
            });
        match sent {
            Some(Ok(())) => Ok(()),
            _ => {
                self.service.not_sent(&self.app);
                Err(TaskError::CheckpointRefused {
                    reason: CHECKPOINT_NO_STORE,
                    level: level_number(self.level),
                    checkpoint: self.checkpoint,
                    detail: 0,
                })
            }
        }
    }
}

/// A `Recover` request, run on the control thread (reading a checkpoint back may take long).
pub(crate) struct RecoverJob {
    pub(crate) service: Arc<Checkpoints>,
    pub(crate) app: AppKey,
    /// The protected buffers, by id (not in use by any task: checked when it was asked).
    pub(crate) buffers: Vec<(u32, Arc<BufferRecord>)>,
}

impl RecoverJob {
    /// Restores every protected buffer from the newest intact checkpoint, or none of them.
    pub(crate) fn run(self) -> Response {
        let refuse = |message: String| Response::Error(ControlError::Checkpoint(message));
        let recovered = match self.service.recover(&self.app) {
            Ok(Some(recovered)) => recovered,
            Ok(None) => {
                return refuse(format!(
                    "application {} (uid {}) has no checkpoint to recover from; start from the beginning",
                    self.app.name, self.app.uid
                ))
            }
            Err(e) => return refuse(format!("cannot recover: {e}")),
        };
        // Everything checked before anything is written: a recovery is whole or not at all.
        let mut plan = Vec::with_capacity(self.buffers.len());
        for (id, record) in &self.buffers {
            let Some(entry) = recovered.entries.iter().find(|e| e.id == *id) else {
                return refuse(format!(
                    "checkpoint {} has no data for protected id {id}; protect the same ids as the run that wrote it",
                    recovered.sequence
                ));
            };
            if entry.bytes.len() as u64 != record.len {
                return refuse(format!(
                    "checkpoint {} holds {} bytes for protected id {id}, but the buffer protected under it has {}; protect a buffer of the saved size",
                    recovered.sequence,
                    entry.bytes.len(),
                    record.len
                ));
            }
            plan.push((record, entry));
        }
        for (record, entry) in plan {
            if !record.write_host(&entry.bytes) {
                return refuse("the session ended during its recovery".into());
            }
            // Written whole, as by a `sync_to`: a failed writer's poison (or a restarted
            // daemon's lost contents) no longer applies.
            record.provenance.restored();
        }
        for message in &recovered.skipped {
            tracing::warn!(app = %self.app.name, uid = self.app.uid, "{message}");
        }
        Response::Recovered(RecoverReport {
            checkpoint: recovered.sequence,
            level: level_number(recovered.level),
            restored: self.buffers.iter().map(|(id, _)| *id).collect(),
            skipped: recovered.skipped,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_memory_admits_what_fits_and_a_capture_larger_than_it_alone() {
        let memory = Arc::new(CaptureMemory::new(100));
        let gauge = prometheus_client::metrics::gauge::Gauge::<i64>::default();
        memory.gauge.set(gauge.clone()).unwrap();
        let first = memory.reserve(60).expect("fits");
        assert_eq!(gauge.get(), 60, "the metric follows");
        assert!(memory.reserve(50).is_none(), "60 + 50 passes 100");
        assert!(!memory.has_room(50));
        let second = memory.reserve(40).expect("60 + 40 fits");
        assert_eq!(memory.held(), 100);
        drop(first);
        assert_eq!(memory.held(), 40);
        assert!(
            memory.reserve(250).is_none(),
            "larger than the bound: not beside others"
        );
        drop(second);
        let alone = memory.reserve(250).expect("larger than the bound, alone");
        assert!(memory.reserve(1).is_none());
        assert_eq!(gauge.get(), 250);
        drop(alone);
        assert_eq!(memory.held(), 0);
        assert_eq!(gauge.get(), 0);
    }

    #[test]
    fn application_names_are_made_file_name_safe() {
        assert_eq!(application(1000, "python:train.py").name, "python_train.py");
        assert_eq!(application(1000, "").name, "_");
        assert_eq!(application(1000, ".hidden").name, "_.hidden");
        assert_eq!(application(1000, &"x".repeat(300)).name.len(), 128);
    }
}
