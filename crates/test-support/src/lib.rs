//! The harness of Agora's integration tests (dev-only, never published): a daemon on a private
//! socket in a temporary directory, either a real `agora serve` process ([`Daemon`]) or one
//! embedded in the test process ([`EmbeddedDaemon`]).
//!
//! Every directory comes from [`temp_dir`]: it is removed when its owner is dropped, also when a
//! test panics, so test runs leave nothing in `/tmp` (a test killed by a signal still can). Each
//! daemon has its own directory, so tests run in parallel.
//!
//! A dev crate cannot see the `agora` binary Cargo builds for the cli's tests, so process tests
//! pass its path in: `Daemon::start(env!("CARGO_BIN_EXE_agora"), "tag", &[])`.
//!
//! Must not be a dependency of anything but tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use agora::{Session, SessionOptions, StatusReport};
use agora_daemon::{DaemonConfig, DaemonError, DaemonHandle};

pub use tempfile::TempDir;

/// How long a daemon may take to answer on its socket before the test fails.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A new empty directory `agora-TAG-XXXXXX` in the system's temporary directory, removed (with
/// everything in it) when the returned value is dropped.
pub fn temp_dir(tag: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("agora-{tag}-"))
        .tempdir()
        .expect("a temporary directory can be created")
}

/// Opens a session with the daemon on `socket`, named `name` when given.
pub fn connect(socket: &Path, name: Option<&str>) -> Session {
    Session::connect_with(SessionOptions {
        socket: Some(socket.to_path_buf()),
        name: name.map(str::to_string),
        ..Default::default()
    })
    .expect("session opens")
}

/// Runs a saxpy over `n` elements on a fresh queue of `session` and checks every result: the
/// "a neighbour still gets correct answers" probe of the robustness and hardening tests.
pub fn saxpy_ok(session: &Session, n: usize) {
    let queue = session.queue("check").unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let x = session.buffer_from(&vec![1.0f32; n]).unwrap();
    let y = session.buffer_from(&vec![2.0f32; n]).unwrap();
    queue
        .launch(&saxpy, &[agora::Arg::F32(3.0), (&x).into(), (&y).into()], n)
        .unwrap();
    queue.sync_from(&y).unwrap().wait().unwrap();
    assert!(
        y.as_slice::<f32>().iter().all(|v| *v == 5.0),
        "saxpy computed a wrong result"
    );
}

/// Polls `condition` every 10 ms for up to `within`; whether it became true.
pub fn eventually(within: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The device on which the last task that queue `queue` of `session` handed to a lane ran.
pub fn last_device(session: &Session, queue: &str) -> Option<String> {
    let status = session.status().unwrap();
    status
        .sessions
        .iter()
        .find(|x| x.id == session.id())
        .and_then(|x| x.queues.iter().find(|q| q.name == queue))
        .and_then(|q| q.last_device.clone())
}

/// Jobs the lanes of every device of kind `kind` (`cpu`, `opencl`, `cuda`, `sim`) ran to the end:
/// whether a kind preference (only a hint) was honoured. Inline runs on the dispatcher are not
/// counted.
pub fn jobs_on(session: &Session, kind: &str) -> u64 {
    session
        .status()
        .unwrap()
        .devices
        .iter()
        .filter(|d| d.kind == kind)
        .flat_map(|d| d.lanes.iter())
        .map(|l| l.completed)
        .sum()
}

/// Checks the daemon's books of device memory, once the sessions' tasks are finished: on every
/// device with memory of its own, the live sessions' device memory adds up to what the device
/// has allocated for buffers. A byte charged to the wrong session, or never given back, shows
/// here (an attached buffer allocated late in a device host was charged to the attacher, which
/// then waited for room forever). Needs every live session in the status (small tests).
pub fn assert_device_memory_adds_up(session: &Session) {
    let status = session.status().unwrap();
    assert_eq!(
        status.sessions.len() as u64,
        status.live_sessions,
        "the status lists only some sessions"
    );
    for (index, device) in status.devices.iter().enumerate() {
        if device.memory_bytes == 0 {
            continue;
        }
        let charged: u64 = status
            .sessions
            .iter()
            .map(|s| s.device_memory.get(index).copied().unwrap_or(0))
            .sum();
        assert_eq!(
            charged, device.memory_used,
            "device {}: the sessions are charged {charged} bytes, the device holds {} (closing sessions: {})",
            device.name, device.memory_used, status.closing_sessions
        );
    }
}

/// A queue named `name` that prefers devices of `kind`.
pub fn queue_preferring(session: &Session, name: &str, kind: agora::DeviceKind) -> agora::Queue {
    session
        .queue_with(agora::QueueOptions {
            name: name.into(),
            preferred_device: Some(kind),
            ..Default::default()
        })
        .unwrap()
}

/// A long task on `queue`: an sgemm of `n`² with all-ones inputs (a few hundred milliseconds on
/// a CPU lane for n = 768), and its output, whose every element will be `n` once read back.
pub fn long_sgemm(session: &Session, queue: &agora::Queue, n: i32) -> (agora::Task, agora::Buffer) {
    let elements = (n * n) as usize;
    let a = session.buffer_from(&vec![1.0f32; elements]).unwrap();
    let c = session.buffer((elements * 4) as u64).unwrap();
    let sgemm = session.kernel("sgemm").unwrap();
    queue.sync_to(&a).unwrap();
    let args = [
        agora::Arg::I32(n),
        agora::Arg::I32(n),
        agora::Arg::I32(n),
        agora::Arg::F32(1.0),
        (&a).into(),
        (&a).into(),
        agora::Arg::F32(0.0),
        (&c).into(),
    ];
    let task = queue.launch(&sgemm, &args, (n as u64, n as u64)).unwrap();
    (task, c)
}

/// Fails (never skips) when the daemon has no OpenCL device.
pub fn require_opencl(session: &Session) {
    let status = session.status().unwrap();
    assert!(
        status.devices.iter().any(|d| d.kind == "opencl"),
        "no OpenCL device found: run `make setup` (installs PoCL); devices: {:?}",
        status.devices.iter().map(|d| &d.name).collect::<Vec<_>>()
    );
}

/// An `agora serve` process on `DIR/agora.sock`, with `AGORA_LOG=warn` and its state in
/// `DIR/state`; killed, and its directory removed, when dropped.
#[derive(Debug)]
pub struct Daemon {
    child: Option<Child>,
    agora: PathBuf,
    socket: PathBuf,
    /// The arguments after `serve --socket SOCKET`, for [`Daemon::restart`].
    args: Vec<String>,
    // Last, so it is removed after the process is gone.
    dir: TempDir,
}

impl Daemon {
    /// Starts `AGORA serve --socket DIR/agora.sock ARGS` in a new directory named after `tag`
    /// and waits until it answers on its socket. `{dir}` in an argument is the directory.
    pub fn start(agora: impl AsRef<Path>, tag: &str, args: &[&str]) -> Daemon {
        Daemon::start_in(agora, temp_dir(tag), args)
    }

    /// [`Daemon::start`] with `config` written to `DIR/agora.toml` and passed as `--config`
    /// after `args`.
    pub fn start_with_config(agora: impl AsRef<Path>, tag: &str, config: &str, args: &[&str]) -> Daemon {
        let dir = temp_dir(tag);
        std::fs::write(dir.path().join("agora.toml"), config).unwrap();
        let args: Vec<&str> = args.iter().copied().chain(["--config", "{dir}/agora.toml"]).collect();
        Daemon::start_in(agora, dir, &args)
    }

    /// [`Daemon::start`] in a directory the test prepared (e.g. with a configuration file).
    pub fn start_in(agora: impl AsRef<Path>, dir: TempDir, args: &[&str]) -> Daemon {
        Daemon::start_in_with(agora, dir, args, |_| {})
    }

    /// [`Daemon::start_in`], with the command changed by `env` last (e.g. to remove
    /// `AGORA_STATE_DIR`, so the daemon picks its own state directory).
    pub fn start_in_with(
        agora: impl AsRef<Path>,
        dir: TempDir,
        args: &[&str],
        env: impl FnOnce(&mut Command),
    ) -> Daemon {
        let agora = agora.as_ref().to_path_buf();
        // Found by the binary next to the repository's examples/packages: built first.
        example_packages();
        let socket = dir.path().join("agora.sock");
        let here = dir.path().display().to_string();
        let args: Vec<String> = args.iter().map(|a| a.replace("{dir}", &here)).collect();
        let child = spawn_listening(&agora, &socket, dir.path(), &args, env);
        Daemon {
            child: Some(child),
            agora,
            socket,
            args,
            dir,
        }
    }

    /// Kills the daemon with SIGKILL (if it runs) and starts it again on the same socket, state
    /// directory and arguments (not the environment changes of [`Daemon::start_in_with`]);
    /// returns once the new one listens.
    pub fn restart(&mut self) {
        self.kill();
        self.child = Some(spawn_listening(
            &self.agora,
            &self.socket,
            self.dir.path(),
            &self.args,
            |_| {},
        ));
    }

    /// Its control socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Its directory (socket, state, whatever the test puts there).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Its state directory (`AGORA_STATE_DIR`).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the daemon runs").id()
    }

    /// A session with default options.
    pub fn session(&self) -> Session {
        connect(&self.socket, None)
    }

    /// A session with this name.
    pub fn session_named(&self, name: &str) -> Session {
        connect(&self.socket, Some(name))
    }

    /// A session with this name that does not reconnect when the daemon goes away (calls then
    /// fail with `Disconnected` at once): for tests of what a daemon's death does.
    pub fn session_without_resume(&self, name: &str) -> Session {
        Session::connect_with(SessionOptions {
            socket: Some(self.socket.clone()),
            name: Some(name.into()),
            reconnect_timeout: Some(Duration::ZERO),
            ..Default::default()
        })
        .expect("session opens")
    }

    /// What `agora status` reports.
    pub fn status(&self) -> StatusReport {
        agora::daemon_status(Some(self.socket.clone())).expect("daemon answers status")
    }

    /// `AGORA ARGS --socket SOCKET` with the daemon's state directory and no `AGORA_SOCKET`,
    /// ready to run.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.agora);
        c.args(args)
            .arg("--socket")
            .arg(&self.socket)
            .env_remove("AGORA_SOCKET")
            .env("AGORA_STATE_DIR", self.state_dir());
        c
    }

    /// Runs [`Daemon::command`] to the end.
    pub fn agora(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("agora runs")
    }

    /// Panics if the daemon process has exited (e.g. killed by a signal from a device runtime).
    pub fn assert_alive(&mut self) {
        if let Some(child) = self.child.as_mut() {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("the daemon exited: {status}");
            }
        }
    }

    /// Stops the daemon with SIGTERM (it saves its model and removes its socket) and waits.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
            let _ = child.wait();
        }
    }

    /// The process, which the caller now owns (to signal it and wait for it); the directory
    /// stays until the `Daemon` is dropped.
    pub fn take_child(&mut self) -> Child {
        self.child.take().expect("the daemon runs")
    }

    /// Kills the daemon with SIGKILL and waits.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts `AGORA serve --socket SOCKET ARGS` with its state in `DIR/state` and waits until it
/// answers on its socket.
fn spawn_listening(agora: &Path, socket: &Path, dir: &Path, args: &[String], env: impl FnOnce(&mut Command)) -> Child {
    let mut command = Command::new(agora);
    command
        .arg("serve")
        .arg("--socket")
        .arg(socket)
        .args(args)
        // AGORA_TEST_DAEMON_LOG (an `AGORA_LOG` filter) shows more of the daemons' logs when a
        // test is being investigated.
        .env(
            "AGORA_LOG",
            std::env::var("AGORA_TEST_DAEMON_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .env("AGORA_STATE_DIR", dir.join("state"))
        .stdout(Stdio::null());
    // The project's NVRTC, given to the daemon rather than set in this process's environment:
    // `set_var` beside another test thread's spawn can fail that spawn (EFAULT).
    if std::env::var_os("AGORA_NVRTC").is_none_or(|v| v.is_empty()) {
        if let Some(nvrtc) = project_nvrtc() {
            command.env("AGORA_NVRTC", nvrtc);
        }
    }
    env(&mut command);
    let mut child = command.spawn().expect("agora serve starts");
    let deadline = Instant::now() + START_TIMEOUT;
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("agora serve exited before it listened: {status}");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the daemon did not listen on {} within 20 s", socket.display());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    child
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A daemon on a background thread of the test process (`agora_daemon::spawn`), on
/// `DIR/agora.sock` with its state in `DIR/state`; stopped, and its directory removed, when
/// dropped.
#[derive(Debug)]
pub struct EmbeddedDaemon {
    handle: Option<DaemonHandle>,
    socket: PathBuf,
    // Last, so it is removed after the daemon stopped.
    dir: TempDir,
}

/// A tenant's CUDA C program (`saxpy`, `count`) and its manifest, for `Session::program_cuda`.
pub const TENANT_CUDA: (&str, &str) = (
    include_str!("../data/tenant.cu"),
    include_str!("../data/tenant-cuda.toml"),
);
/// A tenant's PTX program (`fill`, entry `fill_value`) and its manifest, for `Session::program_ptx`.
pub const TENANT_PTX: (&str, &str) = (
    include_str!("../data/tenant.ptx"),
    include_str!("../data/tenant-ptx.toml"),
);

/// The NVRTC that `scripts/setup.sh` installs into the project's virtual environment, if it is
/// there.
pub fn project_nvrtc() -> Option<PathBuf> {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/lib");
    std::fs::read_dir(&lib).ok().and_then(|entries| {
        entries
            .flatten()
            .map(|e| e.path().join("site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
            .find(|p| p.exists())
    })
}

/// Checks that the daemons the test starts get an NVRTC: `AGORA_NVRTC` if set, else the one
/// `scripts/setup.sh` installs into the project's virtual environment (which the daemons are
/// given, see `spawn_listening`). Panics, saying what to run, when there is none. Never sets the
/// environment: `set_var` beside another test thread's spawn can fail that spawn.
pub fn use_project_nvrtc() {
    if std::env::var_os("AGORA_NVRTC").is_some_and(|v| !v.is_empty()) {
        return;
    }
    assert!(
        project_nvrtc().is_some(),
        "no NVRTC under {}/../../.venv/lib: run `bash scripts/setup.sh`",
        env!("CARGO_MANIFEST_DIR")
    );
}

/// The repository's `examples/packages`, with their shared objects built
/// (`scripts/build-packages.sh`, once per test process).
pub fn example_packages() -> PathBuf {
    static BUILT: std::sync::Once = std::sync::Once::new();
    let repository = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    BUILT.call_once(|| {
        let status = Command::new("bash")
            .arg(repository.join("scripts/build-packages.sh"))
            .status()
            .expect("bash runs scripts/build-packages.sh");
        assert!(status.success(), "scripts/build-packages.sh failed");
    });
    repository
        .join("examples/packages")
        .canonicalize()
        .expect("examples/packages exists")
}

impl EmbeddedDaemon {
    /// Starts a daemon with the default settings, changed by `tweak`, in a new directory named
    /// after `tag`.
    pub fn start(tag: &str, tweak: impl FnOnce(&mut DaemonConfig)) -> EmbeddedDaemon {
        let dir = temp_dir(tag);
        let mut config = DaemonConfig {
            socket: dir.path().join("agora.sock"),
            state_dir: Some(dir.path().join("state")),
            // The repository's example packages (Rodinia's hotspot and pathfinder among them): a
            // test binary does not live where the default paths look.
            kernel_paths: vec![example_packages()],
            ..Default::default()
        };
        tweak(&mut config);
        let socket = config.socket.clone();
        let handle = agora_daemon::spawn(config).expect("daemon starts");
        EmbeddedDaemon {
            handle: Some(handle),
            socket,
            dir,
        }
    }

    /// Its control socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A session with default options.
    pub fn session(&self) -> Session {
        connect(&self.socket, None)
    }

    /// Stops the daemon and waits for it.
    pub fn stop(mut self) -> Result<(), DaemonError> {
        match self.handle.take() {
            Some(handle) => handle.stop(),
            None => Ok(()),
        }
    }
}

impl Drop for EmbeddedDaemon {
    fn drop(&mut self) {
        drop(self.handle.take());
    }
}

/// A TCP port on 127.0.0.1 free now (for a daemon's `--metrics`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The body of `GET /metrics` from a daemon's metrics endpoint on `port` (a 200 reply).
pub fn scrape_metrics(port: u16) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("metrics endpoint answers");
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.") && head.contains(" 200 "), "{head}");
    body.to_string()
}

/// CPU time (user + system) of process `pid`, in seconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) in parentheses.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name and state.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let hz: f64 = String::from_utf8(
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .trim()
    .parse()
    .unwrap();
    ticks as f64 / hz
}
