//! OS scheduling priorities for the two classes of work a lane runs.
//!
//! Every lane runs both batch-class and latency-class jobs ([`crate::Job::urgent`]). With
//! [`BatchPriority`] other than `normal`, a lane's threads (the lane thread and, on the CPU, the
//! helper threads of its gang) run batch jobs at a lower OS priority and latency jobs at the
//! normal one (`SCHED_OTHER` at the daemon's nice value), so a thread with latency work — the
//! dispatcher, a client waiting for its answer, a lane running a latency job — is scheduled at
//! once instead of after a time slice of a busy batch lane. The policy of a lane's threads changes
//! only when the class of the lane's work changes: one system call per thread on a change, none
//! otherwise ([`LaneClass`]). A latency job pushed onto a lane that runs batch work raises the
//! lane at once (the batch slice it waits behind then finishes at normal priority, instead of
//! starving at idle priority behind the very threads waiting for it).
//!
//! # `auto`: idle beside latency work
//!
//! `auto` (the daemon's default) runs batch work at `batch` while no latency-class work is live,
//! and at `idle` while some is ([`LanePriorities::set_latency_live`], called by the daemon's
//! scheduler when a latency-class queue submits and when it has been quiet for a while). A
//! latency tenant then gets the cores whenever it wants them, and batch work keeps `batch`'s
//! throughput when there is nobody to yield to (an `idle` lane starves behind any thread that
//! spins, the batch tenant's own client included). A switch costs one system call per thread of
//! each lane running batch work at that moment, none for the others: they pick up the setting at
//! their next batch job.
//!
//! # Privileges (Linux, sched(7), setpriority(2))
//!
//! Any thread may lower its own priority (to `SCHED_BATCH`, to `SCHED_IDLE`, to a higher nice
//! value), but the way back is restricted:
//!
//! * `batch` (`SCHED_BATCH` ↔ `SCHED_OTHER` at the same nice value) is always allowed.
//! * `idle` (`SCHED_IDLE` → `SCHED_OTHER`) needs `CAP_SYS_NICE`, or an `RLIMIT_NICE` of at
//!   least `20 - nice` (20 for a daemon at nice 0; `ulimit -e`, `LimitNICE=` in systemd,
//!   `nice` in limits.conf).
//! * `nice:N` (nice + N → nice) needs the same.
//! * `auto` needs what `idle` needs; without it, it is `batch`.
//!
//! [`LanePriorities::resolve`] tries the round trip on a scratch thread before any lane starts;
//! where it fails it falls back to the strongest setting that works (`idle` and `nice:N` to
//! `batch`, `batch` to `normal`) and says why ([`LanePriorities::fallback`]), so a latency job
//! never runs at a batch priority. Lanes only ever get resolved priorities.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// How lane threads run batch-class work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchPriority {
    /// As latency work: no difference between the classes (`SCHED_OTHER`).
    #[default]
    Normal,
    /// `SCHED_BATCH`: same weight as normal threads, but a waking batch thread never preempts a
    /// running one, and the kernel treats it as CPU-bound. Needs no privilege.
    Batch,
    /// `SCHED_IDLE`: runs only when no normal thread wants the core (weight 3 against 1024),
    /// and any waking normal thread preempts it at once. Needs privilege for the way back.
    Idle,
    /// `SCHED_OTHER` at the daemon's nice value plus N (1 to 19). Needs privilege for the way
    /// back.
    Nice(u8),
    /// `Batch` while no latency-class work is live, `Idle` while some is (see the module
    /// documentation). Needs privilege for the way back, as `Idle`.
    Auto,
}

impl BatchPriority {
    /// Parses `auto`, `normal`, `batch`, `idle` or `nice:N` (N from 1 to 19).
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        match t {
            "normal" => Ok(BatchPriority::Normal),
            "batch" => Ok(BatchPriority::Batch),
            "idle" => Ok(BatchPriority::Idle),
            "auto" => Ok(BatchPriority::Auto),
            _ => match t.strip_prefix("nice:").map(|n| n.trim().parse::<u8>()) {
                Some(Ok(n)) if (1..=19).contains(&n) => Ok(BatchPriority::Nice(n)),
                _ => Err(format!(
                    "unknown batch priority '{text}': choose auto, normal, batch, idle or nice:N (N from 1 to 19)"
                )),
            },
        }
    }

    /// The name [`BatchPriority::parse`] reads.
    pub fn name(self) -> String {
        match self {
            BatchPriority::Normal => "normal".into(),
            BatchPriority::Batch => "batch".into(),
            BatchPriority::Idle => "idle".into(),
            BatchPriority::Nice(n) => format!("nice:{n}"),
            BatchPriority::Auto => "auto".into(),
        }
    }

    /// The next weaker setting that needs less privilege.
    fn weaker(self) -> BatchPriority {
        match self {
            BatchPriority::Idle | BatchPriority::Nice(_) | BatchPriority::Auto => BatchPriority::Batch,
            BatchPriority::Batch | BatchPriority::Normal => BatchPriority::Normal,
        }
    }
}

impl std::fmt::Display for BatchPriority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// Lane priorities that work in this process: a [`BatchPriority`] whose round trip (to the
/// batch priority and back to normal) was tried, or the one it fell back to. Clones share the
/// `auto` setting's state: one [`LanePriorities::set_latency_live`] switches every lane made
/// from any of them.
#[derive(Debug, Clone, Default)]
pub struct LanePriorities {
    requested: BatchPriority,
    batch: BatchPriority,
    fallback: Option<String>,
    regime: Arc<Regime>,
}

impl PartialEq for LanePriorities {
    fn eq(&self, other: &Self) -> bool {
        (self.requested, self.batch, &self.fallback) == (other.requested, other.batch, &other.fallback)
    }
}

impl Eq for LanePriorities {}

/// The `auto` setting's state: whether batch work runs at `idle` now, and the lanes to switch.
#[derive(Debug, Default)]
struct Regime {
    /// Latency-class work is live: `auto` lanes run batch work at `idle`.
    idle: AtomicBool,
    /// The lanes made with `auto` (held weakly: a lane that ends leaves by itself). Switches are
    /// made under this lock, so two cannot interleave.
    lanes: Mutex<Vec<std::sync::Weak<LaneClass>>>,
}

impl LanePriorities {
    /// No class difference: every job at normal priority (what lanes did before).
    pub fn normal() -> Self {
        LanePriorities::default()
    }

    /// Tries `requested` on a scratch thread (a thread started by the calling one, so with its
    /// nice value, capabilities and limits, as the lanes it starts will have) and falls back to
    /// weaker settings until one works. Starts no lane; costs a thread and a few system calls.
    pub fn resolve(requested: BatchPriority) -> Self {
        Self::resolve_with(requested, probe)
    }

    /// `batch` taken as working without trying it: for tests of code that reads the setting
    /// (a lane made from it would fail to switch and say so once).
    #[doc(hidden)]
    pub fn assumed(batch: BatchPriority) -> Self {
        Self::resolve_with(batch, |_| Ok(()))
    }

    /// [`LanePriorities::resolve`] with the round trip tried by `probe`.
    fn resolve_with(requested: BatchPriority, probe: impl Fn(BatchPriority) -> Result<(), String>) -> Self {
        let mut batch = requested;
        let mut reasons = Vec::new();
        while batch != BatchPriority::Normal {
            // `auto` goes where `idle` goes: that is the round trip it must make.
            let tried = if batch == BatchPriority::Auto {
                BatchPriority::Idle
            } else {
                batch
            };
            match probe(tried) {
                Ok(()) => break,
                Err(why) => {
                    reasons.push(format!("{tried}: {why}"));
                    batch = batch.weaker();
                }
            }
        }
        LanePriorities {
            requested,
            batch,
            fallback: (!reasons.is_empty()).then(|| reasons.join("; ")),
            regime: Arc::default(),
        }
    }

    /// The setting asked for.
    pub fn requested(&self) -> BatchPriority {
        self.requested
    }

    /// The setting lanes use: the one asked for, or what it fell back to.
    pub fn batch(&self) -> BatchPriority {
        self.batch
    }

    /// Why the setting asked for could not be used (one line), if it could not.
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// What batch work runs at now: the setting, or for `auto` `idle` or `batch` as latency
    /// work is live or not.
    pub fn batch_now(&self) -> BatchPriority {
        effective(self.batch, &self.regime)
    }

    /// For `auto`: whether latency-class work is live. On a change, every `auto` lane running
    /// batch work now moves to the new priority (a system call per thread); the others take it
    /// at their next batch job. Returns whether anything changed (always `false` for the other
    /// settings, which never change).
    pub fn set_latency_live(&self, live: bool) -> bool {
        if self.batch != BatchPriority::Auto {
            return false;
        }
        let mut lanes = self.regime.lanes.lock().unwrap_or_else(|e| e.into_inner());
        if self.regime.idle.swap(live, Ordering::SeqCst) == live {
            return false;
        }
        lanes.retain(|lane| match lane.upgrade() {
            Some(lane) => {
                lane.reapply();
                true
            }
            None => false,
        });
        true
    }
}

/// What `batch` means now under `regime` (only `auto` depends on it).
fn effective(batch: BatchPriority, regime: &Regime) -> BatchPriority {
    match batch {
        BatchPriority::Auto if regime.idle.load(Ordering::SeqCst) => BatchPriority::Idle,
        BatchPriority::Auto => BatchPriority::Batch,
        other => other,
    }
}

/// The class of work a lane's threads run now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Latency-class work, or none since: normal priority.
    Latency = 0,
    /// Batch-class work: the lane's batch priority.
    Batch = 1,
}

/// One thread of a lane: its kernel thread id and the nice value it started with.
#[derive(Debug, Clone, Copy)]
struct Member {
    tid: i32,
    base_nice: i32,
}

#[derive(Debug)]
struct Members {
    threads: Vec<Member>,
    class: Class,
}

/// The OS scheduling class of one lane's threads (see the module documentation).
#[derive(Debug)]
pub struct LaneClass {
    batch: BatchPriority,
    /// The `auto` setting's state, shared with the [`LanePriorities`] the lane was made from.
    regime: Arc<Regime>,
    /// Mirrors `members.class`, for the check without the lock (written under it).
    class: AtomicU8,
    members: Mutex<Members>,
    /// Whether a failed switch was reported already (reported once per lane).
    reported: AtomicBool,
}

impl LaneClass {
    /// The class switch of a lane whose batch work runs as `priorities` say.
    pub fn new(priorities: &LanePriorities) -> Arc<LaneClass> {
        let mut lane = Self::with_batch(priorities.batch());
        lane.regime = priorities.regime.clone();
        let lane = Arc::new(lane);
        if lane.batch == BatchPriority::Auto {
            let mut lanes = priorities.regime.lanes.lock().unwrap_or_else(|e| e.into_inner());
            lanes.retain(|l| l.strong_count() > 0);
            lanes.push(Arc::downgrade(&lane));
        }
        lane
    }

    /// A lane that never switches (every job at normal priority).
    pub fn normal() -> Arc<LaneClass> {
        Arc::new(Self::with_batch(BatchPriority::Normal))
    }

    /// Unchecked: only for resolved settings, or for the probe that resolves them.
    fn with_batch(batch: BatchPriority) -> LaneClass {
        LaneClass {
            batch,
            regime: Arc::default(),
            class: AtomicU8::new(Class::Latency as u8),
            members: Mutex::new(Members {
                threads: Vec::new(),
                class: Class::Latency,
            }),
            reported: AtomicBool::new(false),
        }
    }

    /// The lane's batch priority now (for `auto`, `idle` or `batch`).
    pub fn batch_priority(&self) -> BatchPriority {
        effective(self.batch, &self.regime)
    }

    /// Makes the calling thread one of the lane's: it follows the lane's class (now, and at each
    /// change) until the returned guard is dropped.
    pub fn join(self: &Arc<Self>) -> Membership {
        if self.batch == BatchPriority::Normal {
            return Membership { lane: None, tid: 0 };
        }
        let member = Member {
            tid: gettid(),
            base_nice: nice_of(gettid()).unwrap_or(0),
        };
        let mut members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        if members.class == Class::Batch {
            if let Err(e) = apply(self.batch_priority(), member, Class::Batch) {
                self.report(&e);
            }
        }
        members.threads.push(member);
        Membership {
            lane: Some(self.clone()),
            tid: member.tid,
        }
    }

    /// Puts the lane's threads in `class`: a system call per thread when the class changes,
    /// nothing otherwise.
    pub fn set(&self, class: Class) {
        if let Err(e) = self.try_set(class) {
            self.report(&e);
        }
    }

    /// The class the lane's threads are in now.
    pub fn class(&self) -> Class {
        if self.class.load(Ordering::Acquire) == Class::Batch as u8 {
            Class::Batch
        } else {
            Class::Latency
        }
    }

    fn try_set(&self, class: Class) -> Result<(), String> {
        if self.batch == BatchPriority::Normal || self.class.load(Ordering::Acquire) == class as u8 {
            return Ok(());
        }
        let mut members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        if members.class == class {
            return Ok(());
        }
        members.class = class;
        self.class.store(class as u8, Ordering::Release);
        // Read under the lock: a switch of `auto` (which takes it after changing the setting)
        // either sees this class or this read sees the new setting.
        let batch = self.batch_priority();
        let mut result = Ok(());
        for member in &members.threads {
            if let Err(e) = apply(batch, *member, class) {
                result = Err(e);
            }
        }
        result
    }

    /// `auto` switched: a lane running batch work moves its threads to the new priority.
    fn reapply(&self) {
        let members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        if members.class != Class::Batch {
            return;
        }
        let batch = self.batch_priority();
        for member in &members.threads {
            if let Err(e) = apply(batch, *member, Class::Batch) {
                self.report(&e);
            }
        }
    }

    fn report(&self, error: &str) {
        if !self.reported.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                batch_priority = %self.batch_priority(),
                "cannot change a lane thread's OS priority: {error} (reported once per lane)"
            );
        }
    }
}

/// A thread's membership of a lane ([`LaneClass::join`]): the lane stops changing the thread's
/// priority when it is dropped (the thread ends).
#[derive(Debug)]
pub struct Membership {
    lane: Option<Arc<LaneClass>>,
    tid: i32,
}

impl Drop for Membership {
    fn drop(&mut self) {
        if let Some(lane) = &self.lane {
            let mut members = lane.members.lock().unwrap_or_else(|e| e.into_inner());
            members.threads.retain(|m| m.tid != self.tid);
        }
    }
}

/// Tries the round trip of `batch` on a scratch thread: down to the batch priority, back to
/// normal, and checks the thread really is back where it started.
fn probe(batch: BatchPriority) -> Result<(), String> {
    let scratch = std::thread::Builder::new()
        .name("agora-prio-probe".into())
        .spawn(move || -> Result<(), String> {
            let lane = Arc::new(LaneClass::with_batch(batch));
            let _member = lane.join();
            let before = (policy_of(gettid())?, nice_of(gettid())?);
            lane.try_set(Class::Batch)
                .map_err(|e| format!("cannot lower a thread's priority: {e}"))?;
            lane.try_set(Class::Latency).map_err(|e| {
                let (rlimit, nice) = (nice_rlimit(), before.1);
                format!(
                    "a thread cannot return to normal priority ({e}): that needs CAP_SYS_NICE or \
                     RLIMIT_NICE of at least {} (here {rlimit}; sched(7), setpriority(2))",
                    20 - nice
                )
            })?;
            let after = (policy_of(gettid())?, nice_of(gettid())?);
            if after != before {
                return Err(format!(
                    "a thread came back as (policy {}, nice {}) instead of (policy {}, nice {})",
                    after.0, after.1, before.0, before.1
                ));
            }
            Ok(())
        })
        .map_err(|e| format!("cannot start a thread to try it: {e}"))?;
    scratch
        .join()
        .unwrap_or_else(|_| Err("the thread trying it panicked".into()))
}

/// Puts thread `member` in `class` under `batch` (as it is now: never `Auto`).
fn apply(batch: BatchPriority, member: Member, class: Class) -> Result<(), String> {
    match (batch, class) {
        // Never passed (callers apply what `auto` means now); `batch` is its safe meaning.
        (BatchPriority::Auto, class) => apply(BatchPriority::Batch, member, class),
        (BatchPriority::Normal, _) => Ok(()),
        (BatchPriority::Batch, Class::Batch) => set_policy(member.tid, sys::SCHED_BATCH),
        (BatchPriority::Idle, Class::Batch) => set_policy(member.tid, sys::SCHED_IDLE),
        (BatchPriority::Batch | BatchPriority::Idle, Class::Latency) => set_policy(member.tid, sys::SCHED_OTHER),
        (BatchPriority::Nice(n), Class::Batch) => set_nice(member.tid, (member.base_nice + i32::from(n)).min(19)),
        (BatchPriority::Nice(_), Class::Latency) => set_nice(member.tid, member.base_nice),
    }
}

/// Changes the calling thread's nice value by `delta` (negative: higher priority, which needs
/// `CAP_SYS_NICE` or a sufficient `RLIMIT_NICE`); returns the new nice value. For the daemon's
/// dispatcher thread.
pub fn renice_current_thread(delta: i32) -> Result<i32, String> {
    let tid = gettid();
    let now = nice_of(tid)?;
    let target = (now + delta).clamp(-20, 19);
    set_nice(tid, target).map_err(|e| {
        if target < now {
            format!(
                "{e}: raising a thread's priority needs CAP_SYS_NICE or RLIMIT_NICE of at least {} (here {})",
                20 - target,
                nice_rlimit()
            )
        } else {
            e
        }
    })?;
    Ok(target)
}

/// Runs the calling thread under `SCHED_FIFO` at priority 1 (the lowest real-time priority),
/// so no thread of the normal classes (lanes, clients) preempts it; threads it starts later do
/// not inherit it. Needs `CAP_SYS_NICE` or an `RLIMIT_RTPRIO` of at least 1; the error says which
/// is missing. The kernel's real-time throttling (`sched_rt_runtime_us`, 95 % by default) still
/// leaves the other threads a share of a core that such a thread keeps busy.
pub fn make_current_thread_realtime() -> Result<(), String> {
    set_fifo(gettid(), 1).map_err(|e| {
        format!(
            "{e}: a real-time thread needs CAP_SYS_NICE or RLIMIT_RTPRIO of at least 1 (here {}; \
             `ulimit -r`, `LimitRTPRIO=` in systemd)",
            rtprio_rlimit()
        )
    })
}

/// The scheduling policy of the calling thread (`SCHED_OTHER` 0, `SCHED_BATCH` 3, `SCHED_IDLE`
/// 5, ...), and its nice value. For tests and diagnostics.
pub fn current_thread_priority() -> Result<(i32, i32), String> {
    Ok((policy_of(gettid())?, nice_of(gettid())?))
}

#[cfg(target_os = "linux")]
mod sys {
    pub(super) const SCHED_OTHER: i32 = libc::SCHED_OTHER;
    pub(super) const SCHED_BATCH: i32 = libc::SCHED_BATCH;
    pub(super) const SCHED_IDLE: i32 = libc::SCHED_IDLE;

    fn last_error(what: &str) -> String {
        format!("{what}: {}", std::io::Error::last_os_error())
    }

    pub(super) fn gettid() -> i32 {
        // SAFETY: gettid takes no arguments and cannot fail.
        unsafe { libc::syscall(libc::SYS_gettid) as i32 }
    }

    fn set_scheduler(tid: i32, policy: i32, priority: i32, what: &str) -> Result<(), String> {
        let param = libc::sched_param {
            sched_priority: priority,
        };
        // SAFETY: `param` is a valid sched_param for the duration of the call; on Linux the pid
        // argument names one thread.
        if unsafe { libc::sched_setscheduler(tid, policy, &param) } == 0 {
            Ok(())
        } else {
            Err(last_error(what))
        }
    }

    pub(super) fn set_policy(tid: i32, policy: i32) -> Result<(), String> {
        let what = match policy {
            libc::SCHED_BATCH => "sched_setscheduler(SCHED_BATCH)",
            libc::SCHED_IDLE => "sched_setscheduler(SCHED_IDLE)",
            _ => "sched_setscheduler(SCHED_OTHER)",
        };
        set_scheduler(tid, policy, 0, what)
    }

    pub(super) fn policy_of(tid: i32) -> Result<i32, String> {
        // SAFETY: no pointers; on Linux the pid argument names one thread.
        let policy = unsafe { libc::sched_getscheduler(tid) };
        if policy < 0 {
            Err(last_error("sched_getscheduler"))
        } else {
            // Without SCHED_RESET_ON_FORK, which lanes never set.
            Ok(policy & !libc::SCHED_RESET_ON_FORK)
        }
    }

    pub(super) fn set_nice(tid: i32, nice: i32) -> Result<(), String> {
        // SAFETY: no pointers; on Linux PRIO_PROCESS with a thread id names that thread.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) } == 0 {
            Ok(())
        } else {
            Err(last_error(&format!("setpriority(nice {nice})")))
        }
    }

    pub(super) fn nice_of(tid: i32) -> Result<i32, String> {
        // getpriority may return -1 as a value: errno tells.
        // SAFETY: errno is thread-local; clearing it is what getpriority's contract asks.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: no pointers.
        let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) };
        // SAFETY: reading this thread's errno.
        if nice == -1 && unsafe { *libc::__errno_location() } != 0 {
            Err(last_error("getpriority"))
        } else {
            Ok(nice)
        }
    }

    pub(super) fn set_fifo(tid: i32, priority: i32) -> Result<(), String> {
        // Threads the caller starts later do not inherit it (clone counts as fork here).
        let policy = libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK;
        set_scheduler(
            tid,
            policy,
            priority,
            &format!("sched_setscheduler(SCHED_FIFO, {priority})"),
        )
    }

    /// The soft limit of `resource` (0 where it cannot be read).
    fn soft_limit(resource: libc::__rlimit_resource_t) -> u64 {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `limit` is a valid rlimit to write.
        if unsafe { libc::getrlimit(resource, &mut limit) } == 0 {
            #[allow(clippy::useless_conversion)] // rlim_t is narrower on some 32-bit targets
            u64::from(limit.rlim_cur)
        } else {
            0
        }
    }

    pub(super) fn rtprio_rlimit() -> u64 {
        soft_limit(libc::RLIMIT_RTPRIO)
    }

    pub(super) fn nice_rlimit() -> u64 {
        soft_limit(libc::RLIMIT_NICE)
    }
}

#[cfg(not(target_os = "linux"))]
mod sys {
    pub(super) const SCHED_OTHER: i32 = 0;
    pub(super) const SCHED_BATCH: i32 = 3;
    pub(super) const SCHED_IDLE: i32 = 5;
    const UNSUPPORTED: &str = "per-thread scheduling classes are only supported on Linux";
    pub(super) fn gettid() -> i32 {
        0
    }
    pub(super) fn set_policy(_: i32, _: i32) -> Result<(), String> {
        Err(UNSUPPORTED.into())
    }
    pub(super) fn policy_of(_: i32) -> Result<i32, String> {
        Ok(SCHED_OTHER)
    }
    pub(super) fn set_nice(_: i32, _: i32) -> Result<(), String> {
        Err(UNSUPPORTED.into())
    }
    pub(super) fn nice_of(_: i32) -> Result<i32, String> {
        Ok(0)
    }
    pub(super) fn nice_rlimit() -> u64 {
        0
    }
    pub(super) fn set_fifo(_: i32, _: i32) -> Result<(), String> {
        Err(UNSUPPORTED.into())
    }
    pub(super) fn rtprio_rlimit() -> u64 {
        0
    }
}

use sys::{gettid, nice_of, nice_rlimit, policy_of, rtprio_rlimit, set_fifo, set_nice, set_policy};

/// `SCHED_FIFO`'s number, for tests.
pub const SCHED_FIFO: i32 = 1;

/// The kernel's numbers for the policies, for tests.
pub const SCHED_OTHER: i32 = sys::SCHED_OTHER;
/// `SCHED_BATCH`.
pub const SCHED_BATCH: i32 = sys::SCHED_BATCH;
/// `SCHED_IDLE`.
pub const SCHED_IDLE: i32 = sys::SCHED_IDLE;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Either the thread becomes `SCHED_FIFO` (root, or a granted limit) or the refusal names what
    /// is missing; a thread it starts afterwards is back to `SCHED_OTHER`.
    #[test]
    fn a_realtime_thread_or_a_refusal_that_says_why() {
        std::thread::spawn(|| match make_current_thread_realtime() {
            Ok(()) => {
                assert_eq!(current_thread_priority().unwrap().0, SCHED_FIFO);
                let child = std::thread::spawn(|| current_thread_priority().unwrap().0)
                    .join()
                    .unwrap();
                assert_eq!(
                    child, SCHED_OTHER,
                    "a thread started by a real-time one must not inherit it"
                );
            }
            Err(why) => assert!(why.contains("RLIMIT_RTPRIO") && why.contains("CAP_SYS_NICE"), "{why}"),
        })
        .join()
        .unwrap();
    }

    #[test]
    fn names_parse_back() {
        for p in [
            BatchPriority::Normal,
            BatchPriority::Batch,
            BatchPriority::Idle,
            BatchPriority::Nice(7),
            BatchPriority::Auto,
        ] {
            assert_eq!(BatchPriority::parse(&p.name()), Ok(p));
        }
        assert!(BatchPriority::parse("nice:0").is_err());
        assert!(BatchPriority::parse("nice:20").is_err());
        assert!(BatchPriority::parse("fifo")
            .unwrap_err()
            .contains("auto, normal, batch, idle"));
    }

    #[test]
    fn a_setting_whose_way_back_fails_falls_back_to_one_that_needs_no_privilege() {
        // Only SCHED_BATCH works (an unprivileged user): idle and nice fall back to it.
        let unprivileged = |p: BatchPriority| match p {
            BatchPriority::Batch => Ok(()),
            _ => Err("EPERM".to_string()),
        };
        let idle = LanePriorities::resolve_with(BatchPriority::Idle, unprivileged);
        assert_eq!(idle.requested(), BatchPriority::Idle);
        assert_eq!(idle.batch(), BatchPriority::Batch);
        assert!(idle.fallback().unwrap().contains("idle: EPERM"));
        let nice = LanePriorities::resolve_with(BatchPriority::Nice(5), unprivileged);
        assert_eq!(nice.batch(), BatchPriority::Batch);
        // Nothing works (e.g. a seccomp filter): normal, never a priority that cannot come back.
        let nothing = LanePriorities::resolve_with(BatchPriority::Idle, |_| Err("EPERM".to_string()));
        assert_eq!(nothing.batch(), BatchPriority::Normal);
        assert_eq!(nothing.fallback(), Some("idle: EPERM; batch: EPERM"));
        // What works is kept, and normal is never tried.
        let ok = LanePriorities::resolve_with(BatchPriority::Idle, |_| Ok(()));
        assert_eq!((ok.batch(), ok.fallback()), (BatchPriority::Idle, None));
        let normal = LanePriorities::resolve_with(BatchPriority::Normal, |_| panic!("tried"));
        assert_eq!(normal, LanePriorities::normal());
    }

    #[test]
    fn batch_round_trips_without_privilege() {
        // SCHED_BATCH <-> SCHED_OTHER at the same nice value is always allowed.
        let p = LanePriorities::resolve(BatchPriority::Batch);
        assert_eq!((p.batch(), p.fallback()), (BatchPriority::Batch, None));
    }

    /// Drops `CAP_SYS_NICE` from the calling thread's effective capabilities (capabilities are
    /// per thread, and threads it starts inherit them). Returns whether the thread now lacks it.
    pub(crate) fn drop_cap_sys_nice() -> bool {
        const CAP_SYS_NICE: u32 = 23;
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        let mut header = Header {
            version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
            pid: 0,
        };
        let mut data = [Data::default(); 2];
        // SAFETY: header and data are valid for the kernel to read and write (version 3: two
        // data structs).
        if unsafe { libc::syscall(libc::SYS_capget, &mut header as *mut Header, data.as_mut_ptr()) } != 0 {
            return false;
        }
        data[0].effective &= !(1 << CAP_SYS_NICE);
        // SAFETY: as above; only this thread's effective set changes.
        if unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) } != 0 {
            return false;
        }
        // Without the capability, the way back from SCHED_IDLE also needs RLIMIT_NICE below 20.
        nice_rlimit() < 20
    }

    #[test]
    fn without_cap_sys_nice_idle_falls_back_to_batch() {
        std::thread::spawn(|| {
            if !drop_cap_sys_nice() {
                eprintln!("cannot drop CAP_SYS_NICE here (or RLIMIT_NICE allows the way back): skipped");
                return;
            }
            let p = LanePriorities::resolve(BatchPriority::Idle);
            assert_eq!(p.batch(), BatchPriority::Batch, "{p:?}");
            let why = p.fallback().unwrap();
            assert!(why.contains("CAP_SYS_NICE") && why.contains("RLIMIT_NICE"), "{why}");
            // And this thread is where it was.
            assert_eq!(current_thread_priority().unwrap().0, SCHED_OTHER);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn auto_goes_where_idle_goes_and_falls_back_to_batch() {
        let unprivileged = |p: BatchPriority| match p {
            BatchPriority::Batch => Ok(()),
            _ => Err("EPERM".to_string()),
        };
        let auto = LanePriorities::resolve_with(BatchPriority::Auto, unprivileged);
        assert_eq!(auto.batch(), BatchPriority::Batch);
        assert!(auto.fallback().unwrap().contains("idle: EPERM"), "{auto:?}");
        assert!(!auto.set_latency_live(true), "batch never switches");
        assert_eq!(auto.batch_now(), BatchPriority::Batch);
        let ok = LanePriorities::resolve_with(BatchPriority::Auto, |p| {
            assert_eq!(p, BatchPriority::Idle, "auto must prove the way back from idle");
            Ok(())
        });
        assert_eq!((ok.batch(), ok.fallback()), (BatchPriority::Auto, None));
        assert_eq!(ok.batch_now(), BatchPriority::Batch, "no latency work yet");
    }

    /// A thread that joins a lane and stays a member, idle, until [`HeldMember::leave`]: the
    /// test changes its policy from other threads and reads it by its id.
    struct HeldMember {
        tid: i32,
        go: std::sync::mpsc::Sender<()>,
        thread: std::thread::JoinHandle<()>,
    }

    impl HeldMember {
        fn join(lane: &Arc<LaneClass>) -> HeldMember {
            let (tid_tx, tid_rx) = std::sync::mpsc::channel();
            let (go, go_rx) = std::sync::mpsc::channel::<()>();
            let lane = lane.clone();
            let thread = std::thread::spawn(move || {
                let _membership = lane.join();
                tid_tx.send(gettid()).unwrap();
                let _ = go_rx.recv();
            });
            HeldMember {
                tid: tid_rx.recv().unwrap(),
                go,
                thread,
            }
        }

        fn leave(self) {
            drop(self.go);
            self.thread.join().unwrap();
        }
    }

    /// `auto`: a lane's threads run batch work at `SCHED_BATCH`, move to `SCHED_IDLE` when
    /// latency work becomes live (switched from another thread, as the dispatcher does) and back
    /// when it is over; latency work runs at `SCHED_OTHER` throughout, and a lane made from a
    /// clone of the priorities switches too.
    #[test]
    fn auto_moves_batch_work_to_idle_while_latency_work_is_live() {
        let p = LanePriorities::resolve(BatchPriority::Auto);
        if p.batch() != BatchPriority::Auto {
            // Unprivileged: `auto` is `batch` (the fallback is tested above).
            assert_eq!(p.batch(), BatchPriority::Batch, "{p:?}");
            return;
        }
        let lane = LaneClass::new(&p.clone());
        let member = HeldMember::join(&lane);
        let tid = member.tid;
        let policy = || policy_of(tid).unwrap();
        lane.set(Class::Batch);
        assert_eq!(policy(), SCHED_BATCH, "no latency work: batch");
        assert!(p.set_latency_live(true));
        assert!(!p.set_latency_live(true), "no change, nothing done");
        assert_eq!(policy(), SCHED_IDLE, "latency work live: the running batch lane yields");
        assert_eq!(p.batch_now(), BatchPriority::Idle);
        lane.set(Class::Latency);
        assert_eq!(policy(), SCHED_OTHER);
        assert!(p.set_latency_live(false));
        assert_eq!(policy(), SCHED_OTHER, "a lane running latency work is left alone");
        lane.set(Class::Batch);
        assert_eq!(policy(), SCHED_BATCH);
        assert!(p.set_latency_live(true));
        assert_eq!(policy(), SCHED_IDLE);
        assert!(p.set_latency_live(false));
        assert_eq!(policy(), SCHED_BATCH, "and back once latency work is over");
        member.leave();
        drop(lane);
        assert!(p.set_latency_live(true), "a switch with no lane left is fine");
    }

    /// A lane switching class on its own thread while `auto` switches from another never ends
    /// in a state that contradicts both: once both stop, the member's policy is what the last
    /// class and the last setting say (a switch takes the lane's lock after changing the
    /// setting; a class change reads the setting under that lock).
    #[test]
    fn auto_switches_racing_class_changes_end_where_both_say() {
        let p = LanePriorities::resolve(BatchPriority::Auto);
        if p.batch() != BatchPriority::Auto {
            assert_eq!(p.batch(), BatchPriority::Batch, "{p:?}");
            return;
        }
        let lane = LaneClass::new(&p);
        let member = HeldMember::join(&lane);
        let tid = member.tid;
        for round in 0..200u32 {
            let switcher = {
                let p = p.clone();
                std::thread::spawn(move || {
                    for i in 0..20u32 {
                        p.set_latency_live((i + round) % 2 == 0);
                    }
                    p.set_latency_live(round % 3 == 0);
                })
            };
            for i in 0..20u32 {
                lane.set(if (i + round) % 2 == 0 {
                    Class::Batch
                } else {
                    Class::Latency
                });
            }
            let class = if round % 5 == 0 { Class::Latency } else { Class::Batch };
            lane.set(class);
            switcher.join().unwrap();
            let expected = match (class, round % 3 == 0) {
                (Class::Latency, _) => SCHED_OTHER,
                (Class::Batch, true) => SCHED_IDLE,
                (Class::Batch, false) => SCHED_BATCH,
            };
            assert_eq!(policy_of(tid).unwrap(), expected, "round {round}: {class:?}");
        }
        p.set_latency_live(false);
        member.leave();
    }

    #[test]
    fn nice_raises_the_nice_value_for_batch_work_and_restores_it() {
        std::thread::spawn(|| {
            let p = LanePriorities::resolve(BatchPriority::Nice(5));
            if p.batch() != BatchPriority::Nice(5) {
                // Unprivileged: the fallback is SCHED_BATCH (tested above).
                assert_eq!(p.batch(), BatchPriority::Batch, "{p:?}");
                return;
            }
            let lane = LaneClass::new(&p);
            let _member = lane.join();
            let (policy, base) = current_thread_priority().unwrap();
            lane.set(Class::Batch);
            assert_eq!(current_thread_priority().unwrap(), (policy, (base + 5).min(19)));
            lane.set(Class::Latency);
            assert_eq!(current_thread_priority().unwrap(), (policy, base));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_class_change_moves_every_member_and_only_on_a_change() {
        let lane = Arc::new(LaneClass::with_batch(BatchPriority::Batch));
        let (tx, rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let helper = {
            let lane = lane.clone();
            std::thread::spawn(move || {
                let _member = lane.join();
                for () in go_rx {
                    tx.send(current_thread_priority().unwrap().0).unwrap();
                }
            })
        };
        let _me = lane.join();
        let (sync_tx, sync_rx) = (go_tx, rx);
        let check = |class: Class, expected: i32| {
            lane.set(class);
            assert_eq!(lane.class(), class);
            assert_eq!(current_thread_priority().unwrap().0, expected);
            sync_tx.send(()).unwrap();
            assert_eq!(sync_rx.recv().unwrap(), expected, "the other member follows");
        };
        check(Class::Batch, SCHED_BATCH);
        check(Class::Batch, SCHED_BATCH);
        check(Class::Latency, SCHED_OTHER);
        check(Class::Batch, SCHED_BATCH);
        lane.set(Class::Latency);
        drop(sync_tx);
        helper.join().unwrap();
        // The helper left: a change no longer touches its (possibly reused) thread id.
        assert_eq!(lane.members.lock().unwrap().threads.len(), 1);
    }
}
