//! Issue 17, the daemon's side of Slurm jobs, without Slurm (scripts/slurm/agora-jobs.sh runs
//! the same through a real slurmctld/slurmd with the prolog and epilog): `agora slurm job-start`
//! registers a job, sessions of processes whose environment names it join it, `agora slurm
//! job-end` ends them even while their process runs and records the job's use; with
//! `[slurm] require_job` a process outside a running job is refused; a restart keeps the jobs.

use std::process::{Child, Stdio};
use std::time::Duration;

use agora::{Error, Session, SessionOptions};
use agora_protocol::control::ControlError;
use agora_test_support::{eventually, temp_dir, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// A daemon that serves only processes of running jobs. Root is not an admin here (admins are
/// exempt), but registers jobs as Slurm's prolog would.
fn daemon(tag: &str) -> Daemon {
    let dir = temp_dir(tag);
    std::fs::write(
        dir.path().join("agora.toml"),
        "[daemon]\nadmin_uids = [4242]\n\n[slurm]\nrequire_job = true\n",
    )
    .unwrap();
    Daemon::start_in(AGORA, dir, &["--no-opencl", "--config", "{dir}/agora.toml"])
}

/// `agora run saxpy` for a long while, as a process of job `job`.
fn job_process(daemon: &Daemon, job: u64) -> Child {
    daemon
        .command(&["run", "saxpy", "--size", "1024", "--iterations", "1000000"])
        .env("SLURM_JOB_ID", job.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn agora_ok(daemon: &Daemon, args: &[&str]) -> String {
    let out = daemon.agora(args);
    assert!(
        out.status.success(),
        "agora {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_job_s_sessions_join_it_end_with_it_and_its_use_is_recorded() {
    let daemon = daemon("slurm-jobs");
    // Outside a job: refused, saying why and what to do.
    match Session::connect_with(SessionOptions {
        socket: Some(daemon.socket().to_path_buf()),
        ..Default::default()
    }) {
        Err(Error::Control(ControlError::NotPermitted(message))) => {
            assert!(message.contains("require_job") && message.contains("srun"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }

    let uid = rustix::process::getuid().as_raw().to_string();
    agora_ok(
        &daemon,
        &[
            "slurm",
            "job-start",
            "--job",
            "77",
            "--uid",
            &uid,
            "--shares",
            "2",
            "--heap-quota",
            "256M",
        ],
    );
    let mut process = job_process(&daemon, 77);
    assert!(
        eventually(Duration::from_secs(10), || daemon.status().live_sessions == 1),
        "the job's process never opened its session"
    );
    let status = daemon.status();
    let job = status.jobs.iter().find(|j| j.job == 77).expect("the job in status");
    assert_eq!((job.sessions, job.shares), (1, 2), "{job:?}");
    let text = agora_ok(&daemon, &["status"]);
    assert!(text.contains("Slurm jobs") && text.contains("job 77"), "{text}");

    // A process naming a job that is not running is refused.
    let refused = daemon
        .command(&["run", "vector-add"])
        .env("SLURM_JOB_ID", "78")
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("Slurm job 78 is not running"), "{stderr}");

    // The epilog: the session ends though its process still runs, and the job's use comes back.
    assert!(
        eventually(Duration::from_secs(20), || daemon
            .status()
            .jobs
            .iter()
            .any(|j| j.job == 77 && j.tasks_completed > 0)),
        "the job's process ran no task"
    );
    let out = agora_ok(&daemon, &["slurm", "job-end", "--job", "77", "--json"]);
    let account: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(account["sessions"], 1, "{account}");
    assert_eq!(account["sessions_ended_by_daemon"], 1, "{account}");
    assert!(account["tasks_completed"].as_u64().unwrap() > 0, "{account}");
    let cpu = account["device_seconds"]
        .as_array()
        .unwrap()
        .iter()
        .find(|entry| entry[0] == "cpu")
        .and_then(|entry| entry[1].as_f64())
        .unwrap();
    assert!(cpu > 0.0, "{account}");
    assert!(account["energy_model_joules"].as_f64().unwrap() > 0.0, "{account}");
    let record = daemon.state_dir().join("jobs/77.json");
    let recorded: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&record).unwrap()).unwrap();
    assert_eq!(recorded["tasks_completed"], account["tasks_completed"]);

    assert!(
        eventually(Duration::from_secs(10), || matches!(process.try_wait(), Ok(Some(_)))),
        "the job's process kept running without its session"
    );
    let output = process.wait_with_output().unwrap();
    assert!(!output.status.success(), "its session was ended under it");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("ended this session") && stderr.contains("Slurm job"),
        "{stderr}"
    );
    assert!(eventually(Duration::from_secs(5), || {
        let s = daemon.status();
        s.live_sessions == 0 && s.closing_sessions == 0 && s.jobs.is_empty()
    }));

    // The epilog twice: a clear error.
    let again = daemon.agora(&["slurm", "job-end", "--job", "77"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("no Slurm job 77"));
}

#[test]
fn running_jobs_outlive_a_daemon_restart() {
    let mut daemon = daemon("slurm-jobs-restart");
    let uid = rustix::process::getuid().as_raw().to_string();
    agora_ok(&daemon, &["slurm", "job-start", "--job", "79", "--uid", &uid]);
    daemon.restart();
    assert!(
        daemon.status().jobs.iter().any(|j| j.job == 79),
        "the job was forgotten"
    );
    let mut process = job_process(&daemon, 79);
    assert!(
        eventually(Duration::from_secs(10), || daemon.status().live_sessions == 1),
        "the job's process was not served after the restart"
    );
    let out = agora_ok(&daemon, &["slurm", "job-end", "--job", "79"]);
    assert!(out.starts_with("agora: 1 sessions (1 ended by the daemon)"), "{out}");
    let _ = process.kill();
    let _ = process.wait();
}

#[test]
fn a_job_s_device_quota_bounds_its_sessions_and_not_its_neighbours() {
    let dir = temp_dir("slurm-device-quota");
    std::fs::write(dir.path().join("agora.toml"), "[slurm]\nrequire_job = true\n").unwrap();
    let daemon = Daemon::start_in(AGORA, dir, &["--config", "{dir}/agora.toml"]);
    let uid = rustix::process::getuid().as_raw().to_string();
    for (job, quota) in [("81", Some("1M")), ("82", None)] {
        let mut args = vec!["slurm", "job-start", "--job", job, "--uid", &uid, "--shares", "1"];
        if let Some(quota) = quota {
            args.extend(["--device-quota", quota]);
        }
        agora_ok(&daemon, &args);
    }
    // saxpy over 2^18 floats: a working set of 2 MiB on the OpenCL device.
    let run = |job: &str| {
        daemon
            .command(&["run", "saxpy", "--size", "262144", "--device-kind", "opencl"])
            .env("SLURM_JOB_ID", job)
            .output()
            .unwrap()
    };
    let limited = run("81");
    let stderr = String::from_utf8_lossy(&limited.stderr);
    assert!(
        !limited.status.success(),
        "a 2 MiB working set passed a 1 MiB job quota"
    );
    assert!(
        stderr.contains("quota") && stderr.contains("1048576"),
        "the error names the job's quota: {stderr}"
    );
    let free = run("82");
    assert!(
        free.status.success(),
        "the other job has the daemon's quota (none): {}",
        String::from_utf8_lossy(&free.stderr)
    );
}

#[test]
fn a_job_s_shares_weigh_its_lane_time_against_its_neighbour_s() {
    // One CPU lane, so both jobs' tasks queue on it: job 91 has 3 shares, job 92 one.
    let dir = temp_dir("slurm-shares");
    std::fs::write(dir.path().join("agora.toml"), "[slurm]\nrequire_job = true\n").unwrap();
    let daemon = Daemon::start_in(
        AGORA,
        dir,
        &["--no-opencl", "--cpu-lanes", "1", "--config", "{dir}/agora.toml"],
    );
    let uid = rustix::process::getuid().as_raw().to_string();
    for (job, shares) in [("91", "3"), ("92", "1")] {
        agora_ok(
            &daemon,
            &["slurm", "job-start", "--job", job, "--uid", &uid, "--shares", shares],
        );
    }
    // Each job pipelines saxpy launches of 2^20 floats (a millisecond or so each) for longer
    // than the test lasts. Tasks this long keep both jobs backlogged on the lane even when the
    // clients get little CPU: with tasks of tens of microseconds, a client starved of CPU on a
    // loaded machine could not submit its share, and the test measured the clients.
    let mut processes: Vec<Child> = [91, 92]
        .into_iter()
        .map(|job| {
            daemon
                .command(&[
                    "run",
                    "saxpy",
                    "--size",
                    "1048576",
                    "--iterations",
                    "1000000",
                    "--device-kind",
                    "cpu",
                ])
                .env("SLURM_JOB_ID", job.to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let pids: Vec<i32> = processes.iter().map(|p| p.id() as i32).collect();
    // Lane time (the lane's measured execution) of each job, and the tasks each client's
    // session has on the lane.
    let lane_seconds = |status: &agora_protocol::control::StatusReport, job: u64| {
        status
            .jobs
            .iter()
            .find(|j| j.job == job)
            .map_or(0.0, |j| j.device_seconds.iter().map(|(_, s)| s).sum::<f64>())
    };
    let backlogs = |status: &agora_protocol::control::StatusReport| -> Vec<u64> {
        pids.iter()
            .map(|pid| {
                status
                    .sessions
                    .iter()
                    .find(|s| s.pid == *pid)
                    .map_or(0, |s| s.in_flight)
            })
            .collect()
    };
    assert!(
        eventually(Duration::from_secs(30), || {
            let status = daemon.status();
            backlogs(&status).iter().all(|&b| b >= 8)
        }),
        "both jobs queue work on the lane: {:?} tasks in flight",
        backlogs(&daemon.status())
    );
    let first = daemon.status();
    let before = (lane_seconds(&first, 91), lane_seconds(&first, 92));
    // Both stay backlogged throughout, or the measurement would say how fast a client submits.
    for _ in 0..15 {
        std::thread::sleep(Duration::from_millis(200));
        let backlog = backlogs(&daemon.status());
        assert!(
            backlog.iter().all(|&b| b >= 2),
            "a job ran out of queued work during the measurement: {backlog:?} tasks in flight"
        );
    }
    let last = daemon.status();
    let after = (lane_seconds(&last, 91), lane_seconds(&last, 92));
    for process in &mut processes {
        let _ = process.kill();
        let _ = process.wait();
    }
    let (heavy, light) = (after.0 - before.0, after.1 - before.1);
    assert!(light > 0.0, "the one-share job starved: {before:?} → {after:?}");
    // A FIFO lane gives about 1:1 here.
    let ratio = heavy / light;
    eprintln!("lane seconds in 3 s on one lane: 3 shares {heavy:.3}, 1 share {light:.3} (ratio {ratio:.2})");
    assert!(
        (2.2..=4.5).contains(&ratio),
        "3 shares against 1 should get about 3 times the lane: {heavy:.3} s against {light:.3} s ({ratio:.2})"
    );
}

#[test]
fn job_start_and_job_end_fail_when_the_daemon_cannot_record_the_job() {
    let daemon = daemon("slurm-jobs-unrecorded");
    // A regular file where the jobs directory goes: nothing can be written under it (root
    // writes through permissions, so the test does not rely on them).
    let jobs = daemon.state_dir().join("jobs");
    let _ = std::fs::remove_dir_all(&jobs);
    std::fs::write(&jobs, "not a directory").unwrap();
    let uid = rustix::process::getuid().as_raw().to_string();

    let start = daemon.agora(&["slurm", "job-start", "--job", "83", "--uid", &uid]);
    let stderr = String::from_utf8_lossy(&start.stderr);
    assert!(!start.status.success(), "job-start passed an unrecorded job: {stderr}");
    assert!(
        stderr.contains("jobs/running/83.json") && stderr.contains("restart would forget"),
        "the error names the file and what it costs: {stderr}"
    );
    assert!(
        daemon.status().jobs.iter().any(|j| j.job == 83),
        "the job is registered all the same"
    );

    let end = daemon.agora(&["slurm", "job-end", "--job", "83"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&end.stdout),
        String::from_utf8_lossy(&end.stderr),
    );
    assert!(
        !end.status.success(),
        "job-end passed a job with no accounting record: {stderr}"
    );
    assert!(
        stdout.starts_with("agora: 0 sessions"),
        "the summary is still printed: {stdout}"
    );
    assert!(
        stderr.contains("jobs/83.json") && stderr.contains("only record"),
        "the error names the record's file and says the summary is all there is: {stderr}"
    );
}

#[test]
fn job_start_again_keeps_the_job_s_use_and_refuses_another_uid() {
    let daemon = daemon("slurm-jobs-requeue");
    let uid = rustix::process::getuid().as_raw().to_string();
    agora_ok(
        &daemon,
        &["slurm", "job-start", "--job", "85", "--uid", &uid, "--shares", "1"],
    );
    let mut process = job_process(&daemon, 85);
    let completed = || {
        daemon
            .status()
            .jobs
            .iter()
            .find(|j| j.job == 85)
            .map_or(0, |j| j.tasks_completed)
    };
    assert!(
        eventually(Duration::from_secs(20), || completed() > 0),
        "the job's process ran no task"
    );
    let _ = process.kill();
    let _ = process.wait();
    assert!(eventually(Duration::from_secs(10), || {
        let s = daemon.status();
        s.live_sessions == 0 && s.closing_sessions == 0
    }));
    let used = completed();

    // The prolog again (a requeue): the use stays, the settings are the new ones.
    let out = agora_ok(
        &daemon,
        &["slurm", "job-start", "--job", "85", "--uid", &uid, "--shares", "3"],
    );
    assert!(
        out.contains("registered already") && out.contains("use so far is kept"),
        "{out}"
    );
    let status = daemon.status();
    let job = status.jobs.iter().find(|j| j.job == 85).expect("the job in status");
    assert_eq!((job.tasks_completed, job.sessions, job.shares), (used, 1, 3), "{job:?}");

    // Another uid under the same id: refused, the job untouched.
    let other = (rustix::process::getuid().as_raw() + 1).to_string();
    let refused = daemon.agora(&["slurm", "job-start", "--job", "85", "--uid", &other]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "a second uid took over job 85");
    assert!(
        stderr.contains(&format!("already registered for uid {uid}")) && stderr.contains("job-end"),
        "{stderr}"
    );
    let status = daemon.status();
    let job = status.jobs.iter().find(|j| j.job == 85).expect("the job in status");
    assert_eq!((job.uid.to_string(), job.tasks_completed), (uid, used), "{job:?}");
}

#[test]
fn job_start_refuses_a_heap_quota_of_zero() {
    let daemon = daemon("slurm-jobs-zero-quota");
    let uid = rustix::process::getuid().as_raw().to_string();
    let out = daemon.agora(&["slurm", "job-start", "--job", "86", "--uid", &uid, "--heap-quota", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a heap quota of 0 was accepted");
    assert!(
        stderr.contains("heap quota of 0") && stderr.contains("256M"),
        "{stderr}"
    );
    assert!(daemon.status().jobs.is_empty(), "the job was registered anyway");
}

#[test]
fn resume_undrains_only_the_devices_suspend_drained() {
    let dir = temp_dir("slurm-power");
    std::fs::write(
        dir.path().join("agora.toml"),
        "[[sim]]\nname = \"sim0\"\n\n[[sim]]\nname = \"sim1\"\n",
    )
    .unwrap();
    let daemon = Daemon::start_in(AGORA, dir, &["--no-opencl", "--config", "{dir}/agora.toml"]);
    let draining = |name: &str| {
        daemon
            .status()
            .devices
            .iter()
            .find(|d| d.name == name)
            .unwrap_or_else(|| panic!("no device {name}"))
            .draining
    };
    agora_ok(&daemon, &["drain", "sim0"]);
    let out = agora_ok(&daemon, &["slurm", "suspend"]);
    assert!(
        out.contains("sim0: was drained already") && out.contains("sim1: drained"),
        "{out}"
    );
    assert!(draining("cpu0") && draining("sim0") && draining("sim1"));

    let out = agora_ok(&daemon, &["slurm", "resume"]);
    assert!(
        out.contains("sim0: stays drained") && out.contains("sim1: usable again"),
        "{out}"
    );
    assert!(
        draining("sim0"),
        "resume undrained a device drained by hand before the suspend"
    );
    assert!(
        !draining("sim1") && !draining("cpu0"),
        "resume left a device it had drained"
    );

    // A device the operator undrains and drains again between the two is theirs, too.
    agora_ok(&daemon, &["slurm", "suspend"]);
    agora_ok(&daemon, &["undrain", "sim1"]);
    agora_ok(&daemon, &["drain", "sim1"]);
    agora_ok(&daemon, &["slurm", "resume"]);
    assert!(draining("sim0") && draining("sim1") && !draining("cpu0"));
}
