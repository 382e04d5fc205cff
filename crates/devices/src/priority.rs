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
}

impl BatchPriority {
    /// Parses `normal`, `batch`, `idle` or `nice:N` (N from 1 to 19).
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        match t {
            "normal" => Ok(BatchPriority::Normal),
            "batch" => Ok(BatchPriority::Batch),
            "idle" => Ok(BatchPriority::Idle),
            _ => match t.strip_prefix("nice:").map(|n| n.trim().parse::<u8>()) {
                Some(Ok(n)) if (1..=19).contains(&n) => Ok(BatchPriority::Nice(n)),
                _ => Err(format!(
                    "unknown batch priority '{text}': choose normal, batch, idle or nice:N (N from 1 to 19)"
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
        }
    }

    /// The next weaker setting that needs less privilege.
    fn weaker(self) -> BatchPriority {
        match self {
            BatchPriority::Idle | BatchPriority::Nice(_) => BatchPriority::Batch,
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
/// batch priority and back to normal) was tried, or the one it fell back to.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LanePriorities {
    requested: BatchPriority,
    batch: BatchPriority,
    fallback: Option<String>,
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

    /// [`LanePriorities::resolve`] with the round trip tried by `probe`.
    fn resolve_with(requested: BatchPriority, probe: impl Fn(BatchPriority) -> Result<(), String>) -> Self {
        let mut batch = requested;
        let mut reasons = Vec::new();
        while batch != BatchPriority::Normal {
            match probe(batch) {
                Ok(()) => break,
                Err(why) => {
                    reasons.push(format!("{batch}: {why}"));
                    batch = batch.weaker();
                }
            }
        }
        LanePriorities {
            requested,
            batch,
            fallback: (!reasons.is_empty()).then(|| reasons.join("; ")),
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
    /// Mirrors `members.class`, for the check without the lock (written under it).
    class: AtomicU8,
    members: Mutex<Members>,
    /// Whether a failed switch was reported already (reported once per lane).
    reported: AtomicBool,
}

impl LaneClass {
    /// The class switch of a lane whose batch work runs as `priorities` say.
    pub fn new(priorities: &LanePriorities) -> Arc<LaneClass> {
        Arc::new(Self::with_batch(priorities.batch()))
    }

    /// A lane that never switches (every job at normal priority).
    pub fn normal() -> Arc<LaneClass> {
        Arc::new(Self::with_batch(BatchPriority::Normal))
    }

    /// Unchecked: only for resolved settings, or for the probe that resolves them.
    fn with_batch(batch: BatchPriority) -> LaneClass {
        LaneClass {
            batch,
            class: AtomicU8::new(Class::Latency as u8),
            members: Mutex::new(Members {
                threads: Vec::new(),
                class: Class::Latency,
            }),
            reported: AtomicBool::new(false),
        }
    }

    /// The lane's batch priority.
    pub fn batch_priority(&self) -> BatchPriority {
        self.batch
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
            if let Err(e) = apply(self.batch, member, Class::Batch) {
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
        let mut result = Ok(());
        for member in &members.threads {
            if let Err(e) = apply(self.batch, *member, class) {
                result = Err(e);
            }
        }
        result
    }

    fn report(&self, error: &str) {
        if !self.reported.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                batch_priority = %self.batch,
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

/// Puts thread `member` in `class` under `batch`.
fn apply(batch: BatchPriority, member: Member, class: Class) -> Result<(), String> {
    match (batch, class) {
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
        ] {
            assert_eq!(BatchPriority::parse(&p.name()), Ok(p));
        }
        assert!(BatchPriority::parse("nice:0").is_err());
        assert!(BatchPriority::parse("nice:20").is_err());
        assert!(BatchPriority::parse("fifo")
            .unwrap_err()
            .contains("normal, batch, idle"));
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
