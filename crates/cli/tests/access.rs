//! Who may connect to a daemon (`agora serve --socket-access`), with real processes of other
//! uids: a personal daemon's socket admits its own user only, and says so to anyone else; a
//! node-wide one (`all`) serves every local user, each as a tenant of its own; `group:NAME`
//! admits the group's members only; a user gets its part of a lane, and of a device's memory,
//! however many sessions it opens. The socket's mode and group are checked whoever runs the
//! tests; the connections as other uids need root (CI runs the suite as root), which the tests
//! say when they cannot switch uids.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use agora_test_support::{temp_dir, Daemon, TempDir};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// A directory every user may enter, holding a copy of the `agora` binary every user may run
/// (the build's own directory may be closed to them).
fn open_dir(tag: &str) -> (TempDir, PathBuf) {
    let dir = temp_dir(tag);
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let binary = dir.path().join("agora-client");
    std::fs::copy(AGORA, &binary).unwrap();
    std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
    (dir, binary)
}

fn root() -> bool {
    rustix::process::geteuid().is_root()
}

/// `program` to be run as `uid`:`gid` (no supplementary groups), with an environment of its
/// own (no HOME of root's).
fn as_user(program: &Path, uid: u32, gid: u32) -> Command {
    let mut command = Command::new(program);
    command
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", "/nonexistent")
        .uid(uid)
        .gid(gid);
    command
}

/// `agora ARGS --socket SOCKET` run as `uid`:`gid` ([`as_user`]), to its end.
fn agora_as(binary: &Path, uid: u32, gid: u32, socket: &Path, args: &[&str]) -> Output {
    as_user(binary, uid, gid)
        .args(args)
        .arg("--socket")
        .arg(socket)
        .stdin(Stdio::null())
        .output()
        .expect("the client starts")
}

/// `agora ARGS --socket SOCKET` started as `uid` (and its group of the same number), its
/// output thrown away.
fn spawn_agora_as(binary: &Path, uid: u32, socket: &Path, args: &[&str]) -> std::process::Child {
    as_user(binary, uid, uid)
        .args(args)
        .arg("--socket")
        .arg(socket)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the client starts")
}

fn mode_and_group(path: &Path) -> (u32, u32) {
    let meta = std::fs::metadata(path).unwrap();
    (meta.mode() & 0o777, meta.gid())
}

#[test]
fn a_personal_daemon_admits_its_own_user_only_and_tells_others_why() {
    let (dir, binary) = open_dir("access-user");
    let daemon = Daemon::start_in(AGORA, dir, &["--no-opencl"]);
    assert_eq!(
        mode_and_group(daemon.socket()).0,
        0o600,
        "the socket of a daemon with the default access (user)"
    );
    // Its own user gets in.
    let status = daemon.agora(&["status"]);
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    if !root() {
        eprintln!("not root: the connection of another uid is not tried (the mode above says it would be refused)");
        return;
    }
    let refused = agora_as(&binary, 65534, 65534, daemon.socket(), &["status"]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "another uid was admitted: {err}");
    assert!(
        err.contains("Permission denied")
            && err.contains("does not admit your user")
            && err.contains("--socket-access all"),
        "{err}"
    );
}

#[test]
fn a_node_wide_daemon_serves_every_local_user_each_as_a_tenant_of_its_own() {
    let (dir, binary) = open_dir("access-all");
    let mut daemon = Daemon::start_in(AGORA, dir, &["--no-opencl", "--socket-access", "all"]);
    assert_eq!(mode_and_group(daemon.socket()).0, 0o666);
    if !root() {
        eprintln!("not root: the connections of other uids are not tried (the mode above admits them)");
        return;
    }
    // Two other users at once, each a verified workload of its own.
    let run = |uid: u32| {
        let binary = binary.clone();
        let socket = daemon.socket().to_path_buf();
        std::thread::spawn(move || {
            agora_as(
                &binary,
                uid,
                uid,
                &socket,
                &["run", "saxpy", "--size", "262144", "--device-kind", "cpu"],
            )
        })
    };
    let runs = [run(65534), run(4242)];
    for (uid, run) in [65534, 4242].into_iter().zip(runs) {
        let out = run.join().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && text.contains("verified OK"),
            "uid {uid}: {text}"
        );
    }
    // Each was a tenant of its own: the daemon counted a connection for each uid. A session of
    // uid 4242 held open shows under its uid in the operator's status.
    let session = spawn_agora_as(
        &binary,
        4242,
        daemon.socket(),
        &["run", "saxpy", "--size", "16777216", "--device-kind", "cpu"],
    );
    let mut seen = false;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && !seen {
        let status = daemon.agora(&["status"]);
        seen = String::from_utf8_lossy(&status.stdout).contains("uid 4242");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut session = session;
    let _ = session.wait();
    assert!(seen, "the operator's status never listed uid 4242");
    // A tenant is no operator: admin requests stay refused to other uids.
    let drain = agora_as(&binary, 4242, 4242, daemon.socket(), &["drain", "cpu0"]);
    let err = String::from_utf8_lossy(&drain.stderr);
    assert!(
        !drain.status.success() && err.contains("admin_uids"),
        "uid 4242 drained a device: {err}"
    );
    daemon.assert_alive();
}

#[test]
fn a_groups_daemon_admits_the_groups_members_only() {
    let (dir, binary) = open_dir("access-group");
    // A group by number (root may give a file any group; the name form is resolved the same
    // way once the system knows the name).
    let group = 4243u32;
    if !root() {
        // Without root the daemon's user may give the socket only to its own groups.
        let own = rustix::process::getgid().as_raw();
        let daemon = Daemon::start_in(AGORA, dir, &["--no-opencl", "--socket-access", &format!("group:{own}")]);
        assert_eq!(mode_and_group(daemon.socket()), (0o660, own));
        eprintln!("not root: the connections of other uids are not tried");
        return;
    }
    let daemon = Daemon::start_in(
        AGORA,
        dir,
        &["--no-opencl", "--socket-access", &format!("group:{group}")],
    );
    assert_eq!(mode_and_group(daemon.socket()), (0o660, group));
    let member = agora_as(&binary, 4242, group, daemon.socket(), &["status"]);
    assert!(
        member.status.success(),
        "a member of the group: {}",
        String::from_utf8_lossy(&member.stderr)
    );
    let outsider = agora_as(&binary, 4242, group + 1, daemon.socket(), &["status"]);
    let err = String::from_utf8_lossy(&outsider.stderr);
    assert!(
        !outsider.status.success() && err.contains("does not admit your user"),
        "an outsider: {err}"
    );
}

/// `agora ARGS --socket SOCKET` run as `uid` with primary group `gid` and supplementary
/// groups `groups` (`Command::groups` is unstable, and `Command::uid` as root drops every
/// supplementary group), to its end. The ids need no entry in /etc/passwd or /etc/group: the
/// kernel hands the daemon numbers.
fn agora_in_groups(binary: &Path, uid: u32, gid: u32, groups: &[u32], socket: &Path, args: &[&str]) -> Output {
    use rustix::process::{Gid, Uid};
    let groups: Vec<Gid> = groups.iter().map(|&g| Gid::from_raw(g)).collect();
    let (uid, gid) = (Uid::from_raw(uid), Gid::from_raw(gid));
    let mut command = Command::new(binary);
    command
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", "/nonexistent")
        .args(args)
        .arg("--socket")
        .arg(socket)
        .stdin(Stdio::null());
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe
    // work is allowed: it makes three raw system calls (rustix's thread-level calls, which in
    // the single-threaded child are the whole process's), allocates nothing and takes no
    // lock; `groups` was built before the fork. Groups first, then gid, then uid: once the
    // uid is not root the others can no longer be changed.
    unsafe {
        command.pre_exec(move || {
            rustix::thread::set_thread_groups(&groups)?;
            rustix::thread::set_thread_gid(gid)?;
            rustix::thread::set_thread_uid(uid)?;
            Ok(())
        });
    }
    command.output().expect("the client starts")
}

#[test]
fn a_member_of_an_admin_group_by_a_supplementary_group_is_an_admin() {
    let (dir, binary) = open_dir("access-admin-groups");
    if !root() {
        eprintln!("not root: a client in other groups cannot be started");
        return;
    }
    // A user whose primary group is its own, in the admins' group as a supplementary one, as
    // `usermod -aG` makes it (the audit's tenant1 in agorausers).
    let (uid, own_group, admins) = (64000u32, 64000u32, 64001u32);
    std::fs::write(
        dir.path().join("agora.toml"),
        format!("[daemon]\nadmin_gids = [{admins}]\n"),
    )
    .unwrap();
    let daemon = Daemon::start_in(
        AGORA,
        dir,
        &["--no-opencl", "--socket-access", "all", "--config", "{dir}/agora.toml"],
    );
    let member = agora_in_groups(
        &binary,
        uid,
        own_group,
        &[own_group, admins],
        daemon.socket(),
        &["drain", "cpu0"],
    );
    assert!(
        member.status.success(),
        "a member of admin_gids by a supplementary group was refused: {}",
        String::from_utf8_lossy(&member.stderr)
    );
    let drained = daemon.status();
    assert!(
        drained.devices.iter().any(|d| d.name == "cpu0" && d.draining),
        "the member's drain did not take"
    );
    // The same user outside the group stays no admin.
    let outsider = agora_in_groups(
        &binary,
        uid,
        own_group,
        &[own_group],
        daemon.socket(),
        &["undrain", "cpu0"],
    );
    let err = String::from_utf8_lossy(&outsider.stderr);
    assert!(
        !outsider.status.success() && err.contains("admin_gids") && err.contains("members of groups [64001]"),
        "a user outside admin_gids undrained a device: {err}"
    );
}

/// `agora serve ARGS` in `dir` with its log at `info`, until its socket appears or it exits:
/// whether it listens, and its log so far. The process is killed before returning.
fn serve_and_log(dir: &Path, args: &[&str]) -> (bool, String) {
    let socket = dir.join("agora.sock");
    let log = dir.join("serve.log");
    let mut child = Command::new(AGORA)
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(args)
        .env("AGORA_LOG", "info")
        .env("AGORA_STATE_DIR", dir.join("state"))
        .env_remove("AGORA_SOCKET")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let listening = loop {
        if socket.exists() {
            break true;
        }
        if child.try_wait().unwrap().is_some() || Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = child.kill();
    let _ = child.wait();
    (listening, std::fs::read_to_string(&log).unwrap())
}

#[test]
fn an_unknown_group_is_refused_and_a_closed_directory_is_warned_about() {
    let dir = temp_dir("access-refusals");
    let (listening, log) = serve_and_log(
        dir.path(),
        &["--no-opencl", "--socket-access", "group:no-such-agora-group"],
    );
    assert!(!listening, "a daemon started for a group that does not exist:\n{log}");
    assert!(log.contains("no group named 'no-such-agora-group'"), "{log}");
    let (listening, log) = serve_and_log(dir.path(), &["--no-opencl", "--socket-access", "nobody-at-all"]);
    assert!(!listening, "{log}");
    assert!(log.contains("choose user"), "{log}");
    // The temporary directory is private (0700): a socket for all users behind it is useless.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let (listening, log) = serve_and_log(dir.path(), &["--no-opencl", "--socket-access", "all"]);
    assert!(listening, "{log}");
    assert!(
        log.contains("keeps them out"),
        "no warning for a socket behind a private directory:\n{log}"
    );
    // The same directory opened: no warning.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (listening, log) = serve_and_log(dir.path(), &["--no-opencl", "--socket-access", "all"]);
    assert!(listening, "{log}");
    assert!(!log.contains("keeps them out"), "{log}");
}

#[test]
fn a_user_gets_no_more_of_a_lane_for_opening_more_sessions() {
    let (dir, binary) = open_dir("access-fair");
    // One CPU lane, so every session's tasks queue on it.
    let daemon = Daemon::start_in(
        AGORA,
        dir,
        &["--no-opencl", "--cpu-lanes", "1", "--socket-access", "all"],
    );
    if !root() {
        eprintln!("not root: two users cannot be started; the two-level order is tested in agora-devices (lane::fair)");
        return;
    }
    // User 4242 runs three pipelining clients, user 4243 one, all with equal tasks (saxpy of
    // 2^18 floats, too long to run inline) for longer than the test lasts.
    let client = |uid: u32| {
        spawn_agora_as(
            &binary,
            uid,
            daemon.socket(),
            &[
                "run",
                "saxpy",
                "--size",
                "262144",
                "--iterations",
                "1000000",
                "--device-kind",
                "cpu",
            ],
        )
    };
    let mut clients = vec![client(4242), client(4242), client(4242), client(4243)];
    let completed = |uid: u32| -> u64 {
        daemon
            .status()
            .sessions
            .iter()
            .filter(|s| s.uid == uid)
            .map(|s| s.tasks_completed)
            .sum()
    };
    let running = agora_test_support::eventually(Duration::from_secs(20), || {
        let sessions = daemon.status().sessions;
        sessions
            .iter()
            .filter(|s| s.uid == 4242 && s.tasks_completed > 20)
            .count()
            == 3
            && sessions.iter().any(|s| s.uid == 4243 && s.tasks_completed > 20)
    });
    let before = (completed(4242), completed(4243));
    std::thread::sleep(Duration::from_secs(3));
    let after = (completed(4242), completed(4243));
    for client in &mut clients {
        let _ = client.kill();
        let _ = client.wait();
    }
    assert!(running, "all four clients ran tasks");
    let (three, one) = (after.0 - before.0, after.1 - before.1);
    assert!(one > 0, "the one-session user starved: {before:?} → {after:?}");
    // Equal tasks: their counts are their lane time. Fair by session it would be about 3:1.
    let ratio = three as f64 / one as f64;
    eprintln!("tasks in 3 s on one lane: the user of three sessions {three}, of one {one} (ratio {ratio:.2})");
    assert!(
        (0.6..=1.6).contains(&ratio),
        "each user should get about half of the lane: {three} against {one} tasks ({ratio:.2})"
    );
}

#[test]
fn a_private_daemon_shows_each_user_its_own_sessions_only() {
    let json = |out: &Output| -> serde_json::Value {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("agora status --json prints JSON")
    };
    // The (session, uid) pairs a report lists, and the uids of its per-uid usage.
    let listed = |report: &serde_json::Value| -> (Vec<(u64, u64)>, Vec<u64>) {
        let mut sessions: Vec<(u64, u64)> = report["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["id"].as_u64().unwrap(), s["uid"].as_u64().unwrap()))
            .collect();
        sessions.sort_by_key(|&(id, uid)| (uid, id));
        let mut uids: Vec<u64> = report["uids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u["uid"].as_u64().unwrap())
            .collect();
        uids.sort_unstable();
        (sessions, uids)
    };
    for private in [false, true] {
        let extra: &[&str] = if private { &["--private-status"] } else { &[] };
        let (mut daemon, tests, client) = holders_daemon("access-private", extra);
        if !root() {
            eprintln!("not root: other users cannot be started; what each sees is not tried");
            return;
        }
        // One session of uid 4242 and one of uid 4243, each held open.
        let hold = |uid: u32| spawn_holder(&tests, daemon.socket(), uid, 1);
        let holders = [hold(4242), hold(4243)];
        // A Slurm job of each user, as the prolog registers them.
        for (job, uid) in [("91", "4242"), ("92", "4243")] {
            let started = daemon.agora(&["slurm", "job-start", "--job", job, "--uid", uid]);
            assert!(started.status.success(), "{}", String::from_utf8_lossy(&started.stderr));
        }
        let jobs = |report: &serde_json::Value| -> Vec<u64> {
            report["jobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|j| j["job"].as_u64().unwrap())
                .collect()
        };
        let operator = json(&daemon.agora(&["status", "--json"]));
        let tenant = json(&agora_as(&client, 4243, 4243, daemon.socket(), &["status", "--json"]));
        let tenant_text = agora_as(&client, 4243, 4243, daemon.socket(), &["status"]);
        let (all_sessions, all_uids) = listed(&operator);
        let theirs = all_sessions
            .iter()
            .find(|&&(_, uid)| uid == 4242)
            .expect("uid 4242's session")
            .0;
        let mine = all_sessions
            .iter()
            .find(|&&(_, uid)| uid == 4243)
            .expect("uid 4243's session")
            .0;
        let details = |uid: u32, id: u64| {
            agora_as(
                &client,
                uid,
                uid,
                daemon.socket(),
                &["status", "--session", &id.to_string()],
            )
        };
        let theirs_to_me = details(4243, theirs);
        let mine_to_me = details(4243, mine);
        for (mut child, lines) in holders {
            drop(child.stdin.take());
            lines.for_each(drop);
            let _ = child.wait();
        }
        // The operator (root: an admin) sees every user, private or not.
        assert!(operator["private"].is_null(), "{operator}");
        assert!(
            all_uids.contains(&4242) && all_uids.contains(&4243),
            "the operator's uids (its own connection's too): {all_uids:?}"
        );
        assert_eq!(jobs(&operator), vec![91, 92], "the operator's jobs");
        assert!(
            mine_to_me.status.success(),
            "a user's own session: {}",
            String::from_utf8_lossy(&mine_to_me.stderr)
        );
        let (sessions, uids) = listed(&tenant);
        assert_eq!(tenant["live_sessions"], 2, "the node's count stays: {tenant}");
        let text = String::from_utf8_lossy(&tenant_text.stdout);
        if private {
            assert_eq!(
                sessions,
                vec![(mine, 4243)],
                "a private daemon's tenant sees its own session only"
            );
            assert_eq!(uids, vec![4243]);
            assert_eq!(tenant["private"]["uid"], 4243);
            assert_eq!(tenant["private"]["sessions"], 1);
            assert_eq!(
                jobs(&tenant),
                vec![92],
                "a private daemon's tenant sees its own job only"
            );
            assert!(
                !text.contains("uid 4242") && text.contains("1 of other users not shown"),
                "{text}"
            );
            let err = String::from_utf8_lossy(&theirs_to_me.stderr);
            assert!(
                !theirs_to_me.status.success() && err.contains(&format!("no live session #{theirs} you may see")),
                "another user's session: {err}"
            );
        } else {
            assert_eq!(sessions, all_sessions, "an open daemon's tenant sees every session");
            assert!(uids.contains(&4242) && uids.contains(&4243), "{uids:?}");
            assert!(tenant["private"].is_null());
            assert_eq!(jobs(&tenant), vec![91, 92]);
            assert!(text.contains("uid 4242"), "{text}");
            assert!(
                theirs_to_me.status.success(),
                "{}",
                String::from_utf8_lossy(&theirs_to_me.stderr)
            );
        }
        daemon.assert_alive();
    }
}

/// A node-wide daemon (`--socket-access all` and `extra` flags) with a 12 MiB sim device, and
/// a copy of this test binary that other uids may run as [`holder`]s.
fn holders_daemon(tag: &str, extra: &[&str]) -> (Daemon, PathBuf, PathBuf) {
    let (dir, client) = open_dir(tag);
    let tests = dir.path().join("access-tests");
    std::fs::copy(std::env::current_exe().unwrap(), &tests).unwrap();
    std::fs::set_permissions(&tests, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(
        dir.path().join("agora.toml"),
        "[[sim]]\nname = \"sim\"\nmemory = \"12M\"\n",
    )
    .unwrap();
    let mut args = vec!["--no-opencl", "--socket-access", "all", "--config", "{dir}/agora.toml"];
    args.extend_from_slice(extra);
    (Daemon::start_in(AGORA, dir, &args), tests, client)
}

/// The lines a [`holder`] prints.
type HolderLines = std::io::Lines<std::io::BufReader<std::process::ChildStdout>>;

/// A [`holder`] run as `uid` (`tests` from [`holders_daemon`]) holding `buffers` buffers, once
/// it holds them; its input takes `more`, its end ends it.
fn spawn_holder(tests: &Path, socket: &Path, uid: u32, buffers: usize) -> (std::process::Child, HolderLines) {
    use std::io::BufRead;
    let mut child = as_user(tests, uid, uid)
        .args(["--ignored", "--exact", "holder", "--nocapture", "--test-threads", "1"])
        .env(HOLDER_SOCKET, socket)
        .env(HOLDER_BUFFERS, buffers.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.by_ref().map_while(Result::ok).any(|l| l.ends_with("held")),
        "the holder of uid {uid} did not hold its buffers"
    );
    (child, lines)
}

/// The environment of a copy of this test binary run as another uid for [`holder`]: the
/// daemon's socket, and how many 3 MiB buffers to hold on the sim device.
const HOLDER_SOCKET: &str = "AGORA_TEST_HOLDER_SOCKET";
const HOLDER_BUFFERS: &str = "AGORA_TEST_HOLDER_BUFFERS";

/// Not a test of its own: what a tenant process of
/// [`a_user_gets_no_more_of_a_device_s_memory_for_opening_more_sessions`] and
/// [`a_private_daemon_shows_each_user_its_own_sessions_only`] runs (they run
/// this binary again, as another uid, with `--ignored --exact holder`). Holds
/// `AGORA_TEST_HOLDER_BUFFERS` buffers of 3 MiB on the sim device (filled there, never read
/// back), says `held` (at the end of a line: the test harness may have begun it); each line
/// `more` on its input adds one more and says `more`; it ends at the end of its input.
#[test]
#[ignore = "a role of another test, run by it as another uid"]
fn holder() {
    use std::io::BufRead;
    let socket = PathBuf::from(std::env::var(HOLDER_SOCKET).expect("run by the memory fairness test"));
    let count: usize = std::env::var(HOLDER_BUFFERS).unwrap().parse().unwrap();
    let session = agora_test_support::connect(&socket, Some("holder"));
    let queue = agora_test_support::queue_preferring(&session, "hold", agora::DeviceKind::Sim);
    let fill = session.kernel("fill").unwrap();
    let floats = 3 << 18; // 3 MiB of f32
    let mut held = Vec::new();
    let mut hold = || {
        let buffer = session.buffer((floats * 4) as u64).unwrap();
        queue
            .launch(&fill, &[agora::Arg::F32(1.0), (&buffer).into()], floats)
            .unwrap();
        queue.finish().unwrap();
        held.push(buffer);
    };
    for _ in 0..count {
        hold();
    }
    println!("held");
    for line in std::io::stdin().lock().lines() {
        if line.unwrap() == "more" {
            hold();
            println!("more");
        }
    }
}

#[test]
fn a_user_gets_no_more_of_a_device_s_memory_for_opening_more_sessions() {
    use std::io::Write;
    // The tenants are this test binary, copied where other uids may run it.
    let (daemon, tests, _client) = holders_daemon("access-memory", &[]);
    if !root() {
        eprintln!("not root: two users cannot be started; the two-level share is tested in agora-daemon (memory)");
        return;
    }
    let holder = |uid: u32, buffers: usize| spawn_holder(&tests, daemon.socket(), uid, buffers);
    // User 4242: two sessions of 3 MiB each, first (least recently used); user 4243: one
    // session of 6 MiB. The 12 MiB device is full.
    let a1 = holder(4242, 1);
    let a2 = holder(4242, 1);
    let (mut b, mut b_lines) = holder(4243, 2);
    let on_sim = |uid: u32| -> Vec<u64> {
        let status = daemon.status();
        let sim = status
            .devices
            .iter()
            .position(|d| d.name == "sim")
            .expect("the sim device");
        let mut held: Vec<u64> = status
            .sessions
            .iter()
            .filter(|s| s.uid == uid)
            .map(|s| s.device_memory.get(sim).copied().unwrap_or(0) >> 20)
            .collect();
        held.sort_unstable();
        held
    };
    assert_eq!((on_sim(4242), on_sim(4243)), (vec![3, 3], vec![6]), "the device before");
    // User 4243 needs 3 MiB more. Counted per session it holds 6 MiB against a share of 4 and
    // may only evict its own; per user it is within its half (6 of 6), so the least recently
    // used idle buffer goes: user 4242's first session's.
    writeln!(b.stdin.as_mut().unwrap(), "more").unwrap();
    assert!(b_lines.by_ref().map_while(Result::ok).any(|l| l.ends_with("more")));
    let after = (on_sim(4242), on_sim(4243));
    for (mut child, _) in [a1, a2] {
        drop(child.stdin.take());
        let _ = child.wait();
    }
    drop(b.stdin.take());
    let _ = b.wait();
    assert_eq!(
        after,
        (vec![0, 3], vec![9]),
        "(user 4242's sessions, user 4243's) MiB on the device after user 4243 asked for 3 more"
    );
}
