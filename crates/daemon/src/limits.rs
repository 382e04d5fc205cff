//! Limits on what one local user can take from the others (issue 20): the books of what each
//! uid holds across all its connections and sessions, the token bucket that paces each
//! connection's control requests, the decisions "allow or refuse" and the count of refusals.
//!
//! The adversary is a local user with a shell: it may open as many processes, connections and
//! sessions as it likes, never say hello, ask for the largest heaps, flood the control socket.
//! Every per-uid limit bounds one resource of the node or of the daemon (see [`Limit`] and
//! `docs/ARCHITECTURE.md`, *Threat model and limits*); a refusal is a typed
//! [`ControlError::LimitReached`] naming the limit, the use, the value and the setting that
//! raises it, and it leaves the session as it was.
//!
//! Owns: the settings ([`LimitSettings`]), the per-uid books ([`Books`]), the refusal counts.
//! Must not: touch rings, the scheduler or devices. Limits are checked on control requests and
//! at connect time only, never on the task path; what a uid's sessions hold in queues and
//! buffers is counted by the caller from the sessions' own tables when a request asks for more.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use agora_protocol::control::{ControlError, LimitUse, UidUsage};
use prometheus_client::metrics::counter::Counter;

/// One limit of the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Limit {
    /// Open connections of a uid (sessions, observers, connections before their hello): each
    /// holds a socket descriptor and a read buffer in the daemon.
    Connections,
    /// Live sessions of a uid: each holds a segment, a doorbell, rings and maybe an executor.
    Sessions,
    /// Heap bytes granted to a uid's sessions: shared memory its clients can fill whether or
    /// not they allocate buffers.
    HeapBytes,
    /// Live queues of a uid, all its sessions (daemon memory).
    Queues,
    /// Live buffers of a uid, all its sessions (daemon memory).
    Buffers,
    /// Control requests of a uid handed to the control thread and not answered yet (each holds
    /// a duplicated socket descriptor and a place in the control thread's queue).
    ControlRequests,
    /// Control requests per second on one connection (token bucket).
    ControlRate,
    /// A connection that sent no request within the hello timeout.
    HelloTimeout,
    /// The daemon's own open-file limit (`RLIMIT_NOFILE`): not a uid's, but refused the same way.
    DaemonFiles,
}

impl Limit {
    /// Every limit, in the order status and metrics list them.
    pub(crate) const ALL: [Limit; 9] = [
        Limit::Connections,
        Limit::Sessions,
        Limit::HeapBytes,
        Limit::Queues,
        Limit::Buffers,
        Limit::ControlRequests,
        Limit::ControlRate,
        Limit::HelloTimeout,
        Limit::DaemonFiles,
    ];

    /// Its name in messages, `agora status` and the metrics' `limit` label.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Limit::Connections => "connections per uid",
            Limit::Sessions => "sessions per uid",
            Limit::HeapBytes => "heap bytes per uid",
            Limit::Queues => "queues per uid",
            Limit::Buffers => "buffers per uid",
            Limit::ControlRequests => "outstanding control requests per uid",
            Limit::ControlRate => "control requests per second per connection",
            Limit::HelloTimeout => "milliseconds before the first request",
            Limit::DaemonFiles => "open files of the daemon",
        }
    }

    /// The configuration key and `agora serve` flag that set it.
    pub(crate) fn setting(self) -> &'static str {
        match self {
            Limit::Connections => "[limits] connections_per_uid, agora serve --limit-connections-per-uid",
            Limit::Sessions => "[limits] sessions_per_uid, agora serve --limit-sessions-per-uid",
            Limit::HeapBytes => {
                "[limits] heap_bytes_per_uid, agora serve --limit-heap-per-uid; each session holds its whole heap \
                 (the daemon's --session-quota unless it asks for less) whether or not it allocates, so open \
                 sessions with smaller heaps (Rust SessionOptions::heap_bytes, Python agora.Session(heap_bytes=...), \
                 C AgoraSessionOptions.heap_bytes with agora_session_open_with, or AGORA_HEAP_BYTES=256M in any \
                 client's environment)"
            }
            Limit::Queues => "[limits] queues_per_uid, agora serve --limit-queues-per-uid",
            Limit::Buffers => "[limits] buffers_per_uid, agora serve --limit-buffers-per-uid",
            Limit::ControlRequests => {
                "[limits] control_requests_per_uid, agora serve --limit-control-requests-per-uid"
            }
            Limit::ControlRate => {
                "[limits] control_rate / control_burst, agora serve --limit-control-rate / --limit-control-burst"
            }
            Limit::HelloTimeout => "[limits] hello_timeout_ms, agora serve --hello-timeout-ms",
            Limit::DaemonFiles => {
                "the daemon's RLIMIT_NOFILE (ulimit -n, LimitNOFILE= in systemd); the daemon raises its soft limit to the hard one at start"
            }
        }
    }
}

/// The limits a daemon enforces (`[limits]`). Each default protects a node shared by several
/// users without being noticed by an honest one; the reasons are beside each.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitSettings {
    /// Most open connections per uid. Default 256: one per client process plus observers
    /// (`agora top`, `agora status`) leaves room for [`LimitSettings::sessions_per_uid`] with
    /// tools watching, while a few uids cannot take a 1024-descriptor table.
    pub connections_per_uid: u64,
    /// Most live sessions per uid. Default 64: a session is one client process, and a user
    /// rarely runs more processes on a node than it has cores; each costs the daemon about four
    /// descriptors (socket, memfd, eventfd, executor) and its rings.
    pub sessions_per_uid: u64,
    /// Most heap bytes granted to one uid's sessions together (ended sessions count until they
    /// are reclaimed). Default: half of the node's physical memory (at least 1 GiB). The heap is
    /// shared memory a client can fill whether or not it allocates buffers, and each session may
    /// ask for `sessions.quota` (2 GiB): without this bound, a dozen sessions of one user take a
    /// 24 GiB node. Half leaves the rest for other users and the system.
    pub heap_bytes_per_uid: u64,
    /// Most live queues per uid, all sessions. Default 16384 (four sessions' worth of
    /// `sessions.max_queues`): bounds the daemon's own memory (a few hundred bytes each).
    pub queues_per_uid: u64,
    /// Most live buffers per uid, all sessions. Default 262144 (four sessions' worth of
    /// `sessions.max_buffers`): bounds the daemon's own memory (buffer records, placement).
    pub buffers_per_uid: u64,
    /// Most control requests of one uid waiting for the control thread (status replies,
    /// kernel lists and lookups, trace saves, program builds, and replies queued behind them).
    /// Default 4096: each holds a duplicated socket descriptor until answered, so this bounds
    /// the descriptors one uid can make the daemon hold; honest clients wait for each reply,
    /// but one that pipelines (the control tests send 2000 listings unread) must not lock its
    /// user's other clients out.
    pub control_requests_per_uid: u64,
    /// Control requests per second one connection may make on average (token bucket).
    /// Default 100 000: honest clients are fast too — a verified loop that allocates two
    /// buffers per task made about 40 000 requests per second here (`programs.rs`'s
    /// neighbour), and 1000/s refused it. At 100 000/s a flooding connection gets a share of
    /// the dispatcher (a request costs it a few microseconds), not all of it; lower it where
    /// tenants are known to be slow callers.
    pub control_rate: u64,
    /// Control requests one connection may make at once before the rate applies. Default
    /// 100 000: a program that sets up its buffers and queues at start does so in a burst.
    pub control_burst: u64,
    /// How long a connection may stay without its first request before the daemon closes it.
    /// Default 10 s: clients send their hello at once; this only ends connections that never
    /// will (each holds a descriptor).
    pub hello_timeout: Duration,
    /// Uids exempt from the per-uid limits and the rate (they are still counted and shown).
    /// Default none: the limits guard the node against runaway clients whoever runs them, the
    /// daemon's own user and root included (as the tests do), and the defaults are generous;
    /// a node whose daemon user runs trusted bulk work lists it here.
    pub exempt_uids: Vec<u32>,
}

impl Default for LimitSettings {
    fn default() -> Self {
        LimitSettings {
            connections_per_uid: 256,
            sessions_per_uid: 64,
            heap_bytes_per_uid: (physical_memory() / 2).max(1 << 30),
            queues_per_uid: 16_384,
            buffers_per_uid: 262_144,
            control_requests_per_uid: 4096,
            control_rate: 100_000,
            control_burst: 100_000,
            hello_timeout: Duration::from_secs(10),
            exempt_uids: Vec::new(),
        }
    }
}

impl LimitSettings {
    /// The value of a per-uid limit (and of the rate, for messages).
    pub(crate) fn max(&self, limit: Limit) -> u64 {
        match limit {
            Limit::Connections => self.connections_per_uid,
            Limit::Sessions => self.sessions_per_uid,
            Limit::HeapBytes => self.heap_bytes_per_uid,
            Limit::Queues => self.queues_per_uid,
            Limit::Buffers => self.buffers_per_uid,
            Limit::ControlRequests => self.control_requests_per_uid,
            Limit::ControlRate => self.control_rate,
            Limit::HelloTimeout => self.hello_timeout.as_millis() as u64,
            Limit::DaemonFiles => u64::MAX,
        }
    }

    /// Values that cannot work (a zero limit would lock every client out).
    pub(crate) fn validate(&self) -> Result<(), String> {
        for (key, value) in [
            ("connections_per_uid", self.connections_per_uid),
            ("sessions_per_uid", self.sessions_per_uid),
            ("heap_bytes_per_uid", self.heap_bytes_per_uid),
            ("queues_per_uid", self.queues_per_uid),
            ("buffers_per_uid", self.buffers_per_uid),
            ("control_requests_per_uid", self.control_requests_per_uid),
            ("control_rate", self.control_rate),
            ("control_burst", self.control_burst),
        ] {
            if value == 0 {
                return Err(format!(
                    "limits.{key} = 0 would refuse every client: give at least 1 (list trusted uids in limits.exempt_uids instead)"
                ));
            }
        }
        if self.hello_timeout.is_zero() {
            return Err("limits.hello_timeout_ms must be at least 1".into());
        }
        Ok(())
    }
}

/// A byte count as a person reads it: `2.0 GiB`, `768.0 KiB`, `512 bytes`.
fn approx_bytes(n: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n >= 1 << shift {
            return format!("{:.1} {unit}", n as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{n} bytes")
}

/// The node's physical memory in bytes (`MemTotal` of `/proc/meminfo`), or 32 GiB when it
/// cannot be read.
pub(crate) fn physical_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024)
        })
        .unwrap_or(32 << 30)
}

/// The memory this process may use: the least of the node's physical memory and every memory
/// limit of the control groups it runs in (cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`,
/// its own group's and its ancestors'). A service under `MemoryMax=` or a container's limit
/// is OOM-killed at that limit, not at the node's size, so bounds derived from memory use this.
///
/// Read by hand (a few files) rather than through a cgroup crate: the crates that exist manage
/// groups (create, move, set) and pull in far more than reading two numbers needs.
pub(crate) fn memory_limit() -> u64 {
    let physical = physical_memory();
    let Ok(groups) = std::fs::read_to_string("/proc/self/cgroup") else {
        return physical;
    };
    cgroup_memory_limit(&groups, std::path::Path::new("/sys/fs/cgroup")).map_or(physical, |limit| limit.min(physical))
}

/// The least memory limit among the groups `proc_self_cgroup` names (the text of
/// `/proc/self/cgroup`) and their ancestors, under the cgroup file system mounted at `root`.
/// `None`: no limit is set, or none could be read. In a container the group's path may not
/// exist inside the mount (it shows the container's own group as its root): the mount's root
/// and what exists of the path are read.
fn cgroup_memory_limit(proc_self_cgroup: &str, root: &std::path::Path) -> Option<u64> {
    let mut least: Option<u64> = None;
    for line in proc_self_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        let (base, file) = if controllers.is_empty() {
            (root.to_path_buf(), "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), "memory.limit_in_bytes")
        } else {
            continue;
        };
        let mut dir = base.clone();
        let mut dirs = vec![base.clone()];
        for part in path.split('/').filter(|p| !p.is_empty()) {
            dir.push(part);
            dirs.push(dir.clone());
        }
        for dir in dirs {
            let Ok(text) = std::fs::read_to_string(dir.join(file)) else {
                continue;
            };
            // "max" (v2) or a huge page-rounded number (v1) means no limit.
            if let Ok(limit) = text.trim().parse::<u64>() {
                if limit < 1 << 60 {
                    least = Some(least.map_or(limit, |l| l.min(limit)));
                }
            }
        }
    }
    least
}

/// A token bucket: `rate` tokens per second, at most `burst` saved; a request takes one.
#[derive(Debug, Clone)]
pub(crate) struct TokenBucket {
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub(crate) fn new(burst: u64, now: Instant) -> Self {
        TokenBucket {
            tokens: burst as f64,
            last: now,
        }
    }

    /// Takes a token if there is one (refilled for the time since the last call).
    pub(crate) fn take(&mut self, now: Instant, rate: u64, burst: u64) -> bool {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * rate as f64).min(burst as f64);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// What one uid holds.
#[derive(Debug, Default, Clone)]
struct UidBook {
    /// Its open connections (ids).
    connections: Vec<u64>,
    /// Its live sessions (connection ids).
    sessions: Vec<u64>,
    /// Heap bytes granted to its sessions, reclaimed ones excluded.
    heap_bytes: u64,
}

impl UidBook {
    fn is_empty(&self) -> bool {
        self.connections.is_empty() && self.sessions.is_empty() && self.heap_bytes == 0
    }
}

/// The books of every uid present and the refusals since start.
pub(crate) struct Books {
    settings: LimitSettings,
    uids: HashMap<u32, UidBook>,
    refusals: [u64; Limit::ALL.len()],
    /// Prometheus counters (`agora_limit_refusals{limit}`), when attached.
    counters: Vec<Counter>,
}

impl Books {
    pub(crate) fn new(settings: LimitSettings) -> Self {
        Books {
            settings,
            uids: HashMap::new(),
            refusals: [0; Limit::ALL.len()],
            counters: Vec::new(),
        }
    }

    /// Counts refusals in these metrics too (`counter(limit name)` per limit).
    pub(crate) fn attach_counters(&mut self, counter: impl Fn(&str) -> Counter) {
        self.counters = Limit::ALL.iter().map(|l| counter(l.name())).collect();
    }

    pub(crate) fn settings(&self) -> &LimitSettings {
        &self.settings
    }

    /// Whether `uid` is exempt from the per-uid limits.
    pub(crate) fn exempt(&self, uid: u32) -> bool {
        self.settings.exempt_uids.contains(&uid)
    }

    /// The refusal of `limit` for `uid` at `value`, counted.
    pub(crate) fn refuse(&mut self, limit: Limit, uid: u32, value: u64, max: u64) -> ControlError {
        self.refuse_saying(limit, uid, value, max, limit.setting().to_string())
    }

    /// [`Books::refuse`] with `setting` for what the message says in its parentheses.
    fn refuse_saying(&mut self, limit: Limit, uid: u32, value: u64, max: u64, setting: String) -> ControlError {
        let index = Limit::ALL.iter().position(|l| *l == limit).unwrap_or(0);
        self.refusals[index] += 1;
        if let Some(counter) = self.counters.get(index) {
            counter.inc();
        }
        ControlError::LimitReached {
            limit: limit.name().to_string(),
            uid,
            value,
            max,
            setting,
        }
    }

    /// `Ok` when `uid`, holding `used` of `limit`, may take `asked` more; else the counted
    /// refusal.
    pub(crate) fn check(&mut self, limit: Limit, uid: u32, used: u64, asked: u64) -> Result<(), ControlError> {
        let max = self.settings.max(limit);
        if self.exempt(uid) || used.saturating_add(asked) <= max {
            return Ok(());
        }
        Err(self.refuse(limit, uid, used, max))
    }

    /// A new connection `id` of `uid`, if its connections allow.
    pub(crate) fn connect(&mut self, uid: u32, id: u64) -> Result<(), ControlError> {
        let used = self.uids.get(&uid).map_or(0, |b| b.connections.len() as u64);
        self.check(Limit::Connections, uid, used, 1)?;
        self.uids.entry(uid).or_default().connections.push(id);
        Ok(())
    }

    /// Whether `uid` may open a session with a heap of `heap` bytes.
    pub(crate) fn may_open_session(&mut self, uid: u32, heap: u64) -> Result<(), ControlError> {
        let (sessions, heap_bytes) = self
            .uids
            .get(&uid)
            .map_or((0, 0), |b| (b.sessions.len() as u64, b.heap_bytes));
        self.check(Limit::Sessions, uid, sessions, 1)?;
        let max = self.settings.max(Limit::HeapBytes);
        if self.exempt(uid) || heap_bytes.saturating_add(heap) <= max {
            return Ok(());
        }
        // What the refused session asked for: without it, "at 10G of 11.8G" reads as if a
        // session of up to 1.8G still fitted.
        let setting = format!(
            "this session asked for a heap of {heap} bytes ({}), which does not fit; {}",
            approx_bytes(heap),
            Limit::HeapBytes.setting()
        );
        Err(self.refuse_saying(Limit::HeapBytes, uid, heap_bytes, max, setting))
    }

    /// Connection `id` of `uid` opened a session with `heap` bytes.
    pub(crate) fn session_opened(&mut self, uid: u32, id: u64, heap: u64) {
        let book = self.uids.entry(uid).or_default();
        book.sessions.push(id);
        book.heap_bytes += heap;
    }

    /// Connection `id` of `uid` closed (its session, if any, ended; its heap stays booked until
    /// [`Books::reclaimed`]).
    pub(crate) fn disconnect(&mut self, uid: u32, id: u64) {
        if let Some(book) = self.uids.get_mut(&uid) {
            book.connections.retain(|c| *c != id);
            book.sessions.retain(|s| *s != id);
        }
        self.forget_if_empty(uid);
    }

    /// A session of `uid` with `heap` bytes was reclaimed.
    pub(crate) fn reclaimed(&mut self, uid: u32, heap: u64) {
        if let Some(book) = self.uids.get_mut(&uid) {
            book.heap_bytes = book.heap_bytes.saturating_sub(heap);
        }
        self.forget_if_empty(uid);
    }

    fn forget_if_empty(&mut self, uid: u32) {
        if self.uids.get(&uid).is_some_and(UidBook::is_empty) {
            self.uids.remove(&uid);
        }
    }

    /// The connections of `uid`.
    pub(crate) fn connections(&self, uid: u32) -> &[u64] {
        self.uids.get(&uid).map_or(&[], |b| &b.connections)
    }

    /// The live sessions of `uid`.
    pub(crate) fn sessions(&self, uid: u32) -> &[u64] {
        self.uids.get(&uid).map_or(&[], |b| &b.sessions)
    }

    /// Every uid present, with its connections, sessions and granted heap.
    pub(crate) fn uids(&self) -> impl Iterator<Item = (u32, usize, usize, u64)> + '_ {
        self.uids
            .iter()
            .map(|(uid, b)| (*uid, b.connections.len(), b.sessions.len(), b.heap_bytes))
    }

    /// One uid's use against the limits, given what the caller counted in its sessions.
    pub(crate) fn usage(&self, uid: u32, queues: u64, buffers: u64, control_requests: u64) -> UidUsage {
        let exempt = self.exempt(uid);
        let book = self.uids.get(&uid).cloned().unwrap_or_default();
        let of = |used: u64, limit: Limit| LimitUse {
            used,
            max: if exempt { u64::MAX } else { self.settings.max(limit) },
        };
        UidUsage {
            uid,
            exempt,
            connections: of(book.connections.len() as u64, Limit::Connections),
            sessions: of(book.sessions.len() as u64, Limit::Sessions),
            heap_bytes: of(book.heap_bytes, Limit::HeapBytes),
            queues: of(queues, Limit::Queues),
            buffers: of(buffers, Limit::Buffers),
            control_requests: of(control_requests, Limit::ControlRequests),
        }
    }

    /// Refusals since start, every limit.
    pub(crate) fn refusals(&self) -> Vec<(String, u64)> {
        Limit::ALL
            .iter()
            .zip(self.refusals)
            .map(|(l, n)| (l.name().to_string(), n))
            .collect()
    }
}

/// A log line that may repeat in a loop, written at most once per `every`: the caller logs when
/// [`LogGate::allow`] says so, with the number of occurrences it suppressed since.
#[derive(Debug)]
pub(crate) struct LogGate {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl LogGate {
    pub(crate) fn new(every: Duration) -> Self {
        LogGate {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(suppressed)` when this occurrence is to be logged, else `None` (counted).
    pub(crate) fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < self.every => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }

    /// Whether it logged less than a period before `now` (so the next occurrence is counted,
    /// not logged).
    fn recent(&self, now: Instant) -> bool {
        self.last
            .is_some_and(|last| now.saturating_duration_since(last) < self.every)
    }
}

/// A [`LogGate`] per key (e.g. per uid and session name), so one key's repeats are counted
/// without silencing another key's first line. It remembers at most `capacity` keys: when a new
/// one finds it full, the keys quiet for a whole period (whose next line would be logged anyway)
/// are forgotten, and if every key is recent, all are: a flood of distinct keys may then log
/// more than once per key and period, but the daemon's memory stays bounded whatever clients
/// send.
#[derive(Debug)]
pub(crate) struct KeyedLogGate<K> {
    every: Duration,
    capacity: usize,
    gates: HashMap<K, LogGate>,
}

impl<K: std::hash::Hash + Eq> KeyedLogGate<K> {
    pub(crate) fn new(every: Duration, capacity: usize) -> Self {
        KeyedLogGate {
            every,
            capacity,
            gates: HashMap::new(),
        }
    }

    /// `Some(suppressed)` when this occurrence for `key` is to be logged, else `None` (counted).
    pub(crate) fn allow(&mut self, key: K, now: Instant) -> Option<u64> {
        if self.gates.len() >= self.capacity && !self.gates.contains_key(&key) {
            self.gates.retain(|_, gate| gate.recent(now));
            if self.gates.len() >= self.capacity {
                self.gates.clear();
            }
        }
        let every = self.every;
        self.gates.entry(key).or_insert_with(|| LogGate::new(every)).allow(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> LimitSettings {
        LimitSettings {
            connections_per_uid: 2,
            sessions_per_uid: 1,
            heap_bytes_per_uid: 100,
            ..Default::default()
        }
    }

    #[test]
    fn cgroup_memory_limits_are_read_from_the_group_and_its_ancestors() {
        let root = tempfile::tempdir().unwrap();
        let v2 = root.path().join("system.slice/agora.service");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(root.path().join("system.slice/memory.max"), "1073741824\n").unwrap();
        std::fs::write(v2.join("memory.max"), "402653184\n").unwrap();
        assert_eq!(
            cgroup_memory_limit("0::/system.slice/agora.service\n", root.path()),
            Some(384 << 20)
        );
        std::fs::write(v2.join("memory.max"), "max\n").unwrap();
        assert_eq!(
            cgroup_memory_limit("0::/system.slice/agora.service\n", root.path()),
            Some(1 << 30)
        );
        // cgroup v1: the memory controller's own hierarchy; "no limit" is a huge number.
        let v1 = root.path().join("memory/docker/abc");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(
            cgroup_memory_limit("4:memory:/docker/abc\n3:cpu:/x\n", root.path()),
            None
        );
        std::fs::write(v1.join("memory.limit_in_bytes"), "268435456\n").unwrap();
        assert_eq!(
            cgroup_memory_limit("4:memory:/docker/abc\n", root.path()),
            Some(256 << 20)
        );
        // A path that does not exist inside the mount (a container's view): nothing read, no limit.
        assert_eq!(
            cgroup_memory_limit("0::/elsewhere\n", tempfile::tempdir().unwrap().path()),
            None
        );
        assert!(memory_limit() <= physical_memory());
    }

    #[test]
    fn connections_are_counted_per_uid_and_freed_on_disconnect() {
        let mut books = Books::new(small());
        books.connect(1000, 1).unwrap();
        books.connect(1000, 2).unwrap();
        // Another uid has its own count.
        books.connect(1001, 3).unwrap();
        let refusal = books.connect(1000, 4).unwrap_err();
        match &refusal {
            ControlError::LimitReached {
                limit,
                uid,
                value,
                max,
                setting,
            } => {
                assert_eq!(
                    (limit.as_str(), *uid, *value, *max),
                    ("connections per uid", 1000, 2, 2)
                );
                assert!(setting.contains("connections_per_uid"), "{setting}");
            }
            other => panic!("{other:?}"),
        }
        let text = refusal.to_string();
        assert!(
            text.contains("connections per uid is 2") && text.contains("uid 1000 is at 2"),
            "{text}"
        );
        books.disconnect(1000, 1);
        books.connect(1000, 4).unwrap();
        assert_eq!(books.connections(1000), &[2, 4]);
        assert_eq!(books.refusals()[0], ("connections per uid".to_string(), 1));
    }

    #[test]
    fn sessions_and_heap_are_checked_before_opening_and_heap_stays_until_reclaimed() {
        let mut books = Books::new(LimitSettings {
            sessions_per_uid: 2,
            ..small()
        });
        books.connect(7, 1).unwrap();
        books.may_open_session(7, 60).unwrap();
        books.session_opened(7, 1, 60);
        // 60 + 50 > 100: the heap refuses although a session is left.
        let e = books.may_open_session(7, 50).unwrap_err();
        assert!(
            matches!(&e, ControlError::LimitReached { limit, value: 60, max: 100, .. } if limit == "heap bytes per uid"),
            "{e:?}"
        );
        // It says what the session asked for, and how each client asks for less.
        let text = e.to_string();
        for needed in [
            "asked for a heap of 50 bytes",
            "SessionOptions::heap_bytes",
            "agora.Session(heap_bytes=...)",
            "AgoraSessionOptions.heap_bytes",
        ] {
            assert!(text.contains(needed), "{needed}: {text}");
        }
        books.may_open_session(7, 40).unwrap();
        // The session ends: its slot is free at once, its heap only once reclaimed.
        books.disconnect(7, 1);
        assert!(books.sessions(7).is_empty());
        assert!(books.may_open_session(7, 50).is_err());
        books.reclaimed(7, 60);
        books.may_open_session(7, 100).unwrap();
        assert_eq!(books.uids().count(), 0, "an empty book is forgotten");
    }

    #[test]
    fn exempt_uids_are_counted_but_never_refused() {
        let mut books = Books::new(LimitSettings {
            exempt_uids: vec![0],
            ..small()
        });
        for id in 0..10 {
            books.connect(0, id).unwrap();
        }
        books.check(Limit::Queues, 0, u64::MAX - 1, 1).unwrap();
        let usage = books.usage(0, 3, 4, 5);
        assert!(usage.exempt);
        assert_eq!(usage.connections.used, 10);
        assert_eq!(usage.connections.max, u64::MAX);
        assert_eq!(
            (usage.queues.used, usage.buffers.used, usage.control_requests.used),
            (3, 4, 5)
        );
        assert!(books.refusals().iter().all(|(_, n)| *n == 0));
    }

    #[test]
    fn the_token_bucket_allows_a_burst_then_the_rate() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(10, start);
        let taken = (0..15).filter(|_| bucket.take(start, 100, 10)).count();
        assert_eq!(taken, 10, "the burst, no more");
        // 50 ms at 100/s: five more.
        let later = start + Duration::from_millis(50);
        let taken = (0..15).filter(|_| bucket.take(later, 100, 10)).count();
        assert_eq!(taken, 5);
        // A long pause refills to the burst only.
        let much_later = later + Duration::from_secs(60);
        let taken = (0..100).filter(|_| bucket.take(much_later, 100, 10)).count();
        assert_eq!(taken, 10);
    }

    #[test]
    fn the_log_gate_writes_once_per_period_and_counts_the_rest() {
        let start = Instant::now();
        let mut gate = LogGate::new(Duration::from_secs(10));
        assert_eq!(gate.allow(start), Some(0));
        for i in 1..1000 {
            assert_eq!(gate.allow(start + Duration::from_millis(i)), None);
        }
        assert_eq!(gate.allow(start + Duration::from_secs(10)), Some(999));
        assert_eq!(gate.allow(start + Duration::from_secs(11)), None);
    }

    #[test]
    fn keyed_log_gates_count_each_keys_repeats_apart_and_stay_bounded() {
        let start = Instant::now();
        let mut gates = KeyedLogGate::new(Duration::from_secs(60), 2);
        assert_eq!(gates.allow((1000, "a"), start), Some(0));
        assert_eq!(gates.allow((1000, "a"), start), None, "a repeat is counted");
        assert_eq!(gates.allow((1000, "b"), start), Some(0), "another name logs its first");
        assert_eq!(gates.allow((1001, "a"), start), Some(0), "another uid logs its first");
        // Full, every key recent: all were forgotten, so a repeat logs again (bounded memory).
        assert_eq!(gates.gates.len(), 1);
        assert_eq!(gates.allow((1000, "a"), start), Some(0));
        let later = start + Duration::from_secs(60);
        assert_eq!(gates.allow((1001, "a"), later), Some(0));
        assert_eq!(gates.allow((1001, "a"), later), None);
        assert_eq!(gates.allow((1001, "a"), later + Duration::from_secs(60)), Some(1));
        // A new key in a full map forgets the quiet keys only.
        let mut gates = KeyedLogGate::new(Duration::from_secs(60), 2);
        assert_eq!(gates.allow("old", start), Some(0));
        assert_eq!(gates.allow("busy", later), Some(0));
        assert_eq!(gates.allow("busy", later), None);
        assert_eq!(gates.allow("new", later), Some(0));
        assert_eq!(
            gates.allow("busy", later + Duration::from_secs(60)),
            Some(1),
            "the busy key kept its count"
        );
    }

    #[test]
    fn defaults_protect_a_node_and_zero_limits_are_refused() {
        let d = LimitSettings::default();
        d.validate().unwrap();
        assert!(d.heap_bytes_per_uid >= 1 << 30);
        assert!(d.heap_bytes_per_uid <= physical_memory().max(2 << 30));
        assert!(d.exempt_uids.is_empty());
        let zero = LimitSettings {
            sessions_per_uid: 0,
            ..Default::default()
        };
        assert!(zero.validate().unwrap_err().contains("sessions_per_uid"));
    }
}
