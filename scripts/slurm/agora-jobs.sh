#!/usr/bin/env bash
# Issue #17, on a real Slurm cluster: jobs share a node's accelerators through Agora.
#
#   bash scripts/slurm/agora-jobs.sh [AGORA]      (AGORA: the agora binary, default target/release/agora)
#
# Starts a two-node Slurm cluster on loopback (scripts/slurm/cluster.sh) with one Agora daemon
# per node and the project's Prolog, Epilog and TaskProlog installed as docs/slurm.md says
# (scripts/slurm/*.sh copied, their settings in agora-hooks.env beside them: Slurm passes
# slurmd's environment to none of them). Then checks:
#   1. `agora slurm conf` prints the node's Features and GRES lines from what the daemon sees;
#   2. two batch jobs on one node at once, each an Agora client running a verified workload,
#      share that node's daemon (both verified, both sessions seen by that node's daemon, none by
#      the other node's);
#   3. a job asking more `agora` shares than a node has is refused by Slurm, with its message;
#   4. `scancel` of a running job ends its Agora session (the daemon reclaims it; checked with
#      `agora status --json`), and the node's daemon serves the next job;
#   5. the epilog records each job's use in the node daemon's STATE_DIR/jobs/JOB.json;
#   6. a process that escaped its job (setsid) and still runs loses its session when the job ends;
#   7. a job's shares are its `agora` GRES per node: a name or comment spelling "agora:64"
#      gives none, a two-node job of --gres=agora:2 has 2 on each node (not the total), and
#      --gres=agora (no count) has 1;
#   8. a requeued job's record adds its runs' use up (Slurm runs the epilog after each run);
#   9. with a node's daemon down, a job runs without Agora and says so, and a job that requires
#      Agora (AGORA_REQUIRED=1) is not started.
# Exits non-zero on any failure, keeping the cluster's directory for its logs.
set -euo pipefail
cd "$(dirname "$0")/../.."
agora=$(realpath "${1:-target/release/agora}")
[ -x "$agora" ] || { echo "slurm/agora-jobs: no agora binary at $agora (build first)" >&2; exit 1; }
command -v slurmctld >/dev/null || { echo "slurm/agora-jobs: Slurm is not installed: bash scripts/slurm/install.sh" >&2; exit 1; }

dir=$(mktemp -d -t agora-slurm-XXXXXX)
chmod 0755 "$dir"
failed=0
pids=()
cleanup() {
  bash scripts/slurm/cluster.sh stop "$dir" >/dev/null 2>&1 || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "$failed" = 0 ]; then rm -rf "$dir"; else echo "slurm/agora-jobs: logs kept in $dir" >&2; fi
}
trap cleanup EXIT
fail() { echo "slurm/agora-jobs: FAILED: $*" >&2; failed=1; exit 1; }
pass() { echo "slurm/agora-jobs: ok: $*"; }

# One Agora daemon per node, each with its own socket and state, and the project's Prolog,
# Epilog and TaskProlog installed with a settings file that names each node's daemon.
. scripts/slurm/common.sh
start_agora_daemons "$dir" || fail "an Agora daemon did not start"
hooks=$(write_hooks "$dir")
started=$(date +%s%N)
SLURM_EXTRA_CONF="$hooks" bash scripts/slurm/cluster.sh start "$dir" >/dev/null
export SLURM_CONF="$dir/slurm.conf"
echo "slurm/agora-jobs: cluster up in $(( ($(date +%s%N) - started) / 1000000 )) ms"

status() { "$agora" status --json --socket "$dir/agora-$1.sock"; }
field() { python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }

# 1. The node description.
conf=$("$agora" slurm conf --socket "$dir/agora-n1.sock" --node n1)
echo "$conf" | grep -q "^NodeName=n1 Features=agora,agora-cpu Gres=agora:" || fail "agora slurm conf printed: $conf"
echo "$conf" | grep -q "^NodeName=n1 Name=agora Count=" || fail "no gres.conf line in: $conf"
pass "agora slurm conf: $(echo "$conf" | grep '^NodeName=n1 Features')"

# Waits until none of the given jobs is pending or running (60 s at most).
wait_jobs() {
  for _ in $(seq 1 600); do
    [ -z "$(squeue -h -j "$(IFS=,; echo "$*")" 2>/dev/null)" ] && return 0
    sleep 0.1
  done
  fail "jobs $* still queued or running after 60 s"
}

# 2. Two jobs on n1 at once, each a verified Agora workload.
a=$(sbatch --parsable -w n1 --gres=agora:2 -o "$dir/job-a.out" --wrap "$agora run saxpy --iterations 2000 --json")
b=$(sbatch --parsable -w n1 --gres=agora:2 -o "$dir/job-b.out" --wrap "$agora run vector-add --json")
wait_jobs "$a" "$b"
for out in job-a job-b; do
  grep -Eq '"verified": ?true' "$dir/$out.out" || fail "$out did not verify: $(cat "$dir/$out.out")"
done
opened_n1=$(status n1 | field sessions_opened)
opened_n2=$(status n2 | field sessions_opened)
[ "$opened_n1" -ge 2 ] && [ "$opened_n2" -eq 0 ] || fail "sessions: n1 opened $opened_n1 (want 2+), n2 $opened_n2 (want 0)"
pass "two jobs shared n1 through its Agora daemon ($opened_n1 sessions there, none on n2), both verified"

# 3. More shares than a node has: Slurm refuses the job; Agora never sees it.
if refusal=$(sbatch -w n1 --gres=agora:99 --wrap true 2>&1); then
  fail "a job asking agora:99 was accepted: $refusal"
fi
echo "$refusal" | grep -q "Requested node configuration is not available" || fail "unexpected refusal: $refusal"
pass "agora:99 refused by Slurm: $refusal"

# 4. scancel of a running job: its Agora session ends.
live_before=$(status n1 | field live_sessions)
c=$(sbatch --parsable -w n1 --gres=agora:1 -o "$dir/job-c.out" --wrap "$agora run saxpy --iterations 1000000")
for _ in $(seq 1 300); do
  [ "$(status n1 | field live_sessions)" -gt "$live_before" ] && break
  sleep 0.1
done
[ "$(status n1 | field live_sessions)" -gt "$live_before" ] || fail "the long job never opened its Agora session"
scancel "$c"
wait_jobs "$c"
for _ in $(seq 1 100); do
  [ "$(status n1 | field live_sessions)" -eq "$live_before" ] && [ "$(status n1 | field closing_sessions)" -eq 0 ] && break
  sleep 0.1
done
[ "$(status n1 | field live_sessions)" -eq "$live_before" ] || fail "the cancelled job's session is still live: $(status n1)"
d=$(sbatch --parsable -w n1 -o "$dir/job-d.out" --wrap "$agora run vector-add --json")
wait_jobs "$d"
grep -Eq '"verified": ?true' "$dir/job-d.out" || fail "the job after the cancel did not verify: $(cat "$dir/job-d.out")"
pass "scancel ended the job's Agora session; the next job on n1 verified"

# 5. The epilog recorded each job's use in a file of the daemon's state.
check_record() {
  python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
assert r["sessions"] >= 1 and r["tasks_completed"] > 0, r
assert r["shares"] == int(sys.argv[2]), r
assert any(kind == "cpu" and seconds > 0 for kind, seconds in r["device_seconds"]), r
assert r["sessions_ended_by_daemon"] == int(sys.argv[3]), r
' "$@"
}
for job in "$a" "$b"; do
  record="$dir/agora-n1/jobs/$job.json"
  for _ in $(seq 1 100); do [ -s "$record" ] && break; sleep 0.1; done
  [ -s "$record" ] || fail "no accounting record $record (epilog: see $dir/slurmd-n1.log)"
  check_record "$record" 2 0 || fail "job record: $(cat "$record")"
done
pass "the epilog recorded each job's use: $(tr -d '\n ' <"$dir/agora-n1/jobs/$a.json" | cut -c1-160)"

# 6. A process that escaped its job (its own session, so Slurm's kill of the job's process group
# misses it) loses its Agora session when the job ends; the job's record counts it.
# Its workload must outlive the job by far (1 M tasks of 1024 items once took 1.0 s here, less than the job's
# 2 s, and it ended on its own, verified); `timeout` bounds it if the daemon failed to end it.
e=$(sbatch --parsable -w n1 --gres=agora:1 -o "$dir/job-e.out" --wrap \
  "setsid timeout 120 $agora run saxpy --size 1048576 --iterations 1000000 >$dir/escaped.out 2>&1 </dev/null & sleep 2")
wait_jobs "$e"
for _ in $(seq 1 100); do
  grep -q "ended this session" "$dir/escaped.out" 2>/dev/null && break
  sleep 0.1
done
grep -q "ended this session" "$dir/escaped.out" || fail "the escaped process kept its session: $(cat "$dir/escaped.out" 2>/dev/null)"
for _ in $(seq 1 50); do [ -s "$dir/agora-n1/jobs/$e.json" ] && break; sleep 0.1; done
check_record "$dir/agora-n1/jobs/$e.json" 1 1 || fail "job record: $(cat "$dir/agora-n1/jobs/$e.json")"
pass "the job's end ended the session of a process that escaped it: $(tail -1 "$dir/escaped.out")"

# 7. Shares come from the job's GRES on each node, nothing else: Slurm validates that, while a
# job's name, comment and paths are whatever its user wrote.
h=$(sbatch --parsable -w n1 -J agora:64 --comment=agora:99 -o "$dir/job-h.out" --wrap "$agora run vector-add --json")
i=$(sbatch --parsable -N2 --gres=agora:2 -J agora:64 -o "$dir/job-i.out" --wrap "srun $agora run vector-add --json")
k=$(sbatch --parsable -w n1 --gres=agora -o "$dir/job-k.out" --wrap "$agora run vector-add --json")
wait_jobs "$h" "$i" "$k"
for _ in $(seq 1 100); do
  [ -s "$dir/agora-n1/jobs/$h.json" ] && [ -s "$dir/agora-n1/jobs/$i.json" ] && [ -s "$dir/agora-n2/jobs/$i.json" ] &&
    [ -s "$dir/agora-n1/jobs/$k.json" ] && break
  sleep 0.1
done
check_record "$dir/agora-n1/jobs/$k.json" 1 0 || fail "a job of --gres=agora (no count): $(cat "$dir/agora-n1/jobs/$k.json" 2>&1)"
check_record "$dir/agora-n1/jobs/$h.json" 0 0 || fail "a job named agora:64 without GRES: $(cat "$dir/agora-n1/jobs/$h.json" 2>&1)"
check_record "$dir/agora-n1/jobs/$i.json" 2 0 || fail "a two-node job of agora:2 on n1: $(cat "$dir/agora-n1/jobs/$i.json" 2>&1)"
check_record "$dir/agora-n2/jobs/$i.json" 2 0 || fail "a two-node job of agora:2 on n2: $(cat "$dir/agora-n2/jobs/$i.json" 2>&1)"
pass "shares are the job's agora GRES per node: a job named agora:64 without GRES has 0, a two-node agora:2 job 2 on each, --gres=agora 1"

# 8. A requeued job: Slurm runs the epilog after the first run and the prolog again before the
# next (once the first run's credential expired: 10 s in this cluster, 120 s by default); the
# record adds both runs up.
j=$(sbatch --parsable --requeue --open-mode=append -w n1 --gres=agora:1 -o "$dir/job-j.out" --wrap "$agora run vector-add --json; sleep 60")
record="$dir/agora-n1/jobs/$j.json"
tasks_of() { python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["tasks_completed"], r.get("runs", 1))' "$1"; }
job_tasks() { status n1 | python3 -c 'import json,sys; print(sum(j["tasks_completed"] for j in json.load(sys.stdin)["jobs"] if j["job"] == int(sys.argv[1])))' "$1"; }
# A run is done with Agora once its workload printed its verdict (its session then ended).
runs_done() { grep -Ec '"verified": ?true' "$dir/job-j.out" 2>/dev/null || true; }
for _ in $(seq 1 300); do [ "$(runs_done)" -ge 1 ] && break; sleep 0.1; done
[ "$(runs_done)" -ge 1 ] || fail "the requeue job's first run never verified: $(cat "$dir/job-j.out" 2>&1)"
scontrol requeue "$j"
for _ in $(seq 1 300); do [ -s "$record" ] && break; sleep 0.1; done
[ -s "$record" ] || fail "no record after the first run of job $j (hooks log: $(cat "$dir/hooks.log" 2>/dev/null))"
read -r first_tasks first_runs < <(tasks_of "$record")
for _ in $(seq 1 400); do [ "$(runs_done)" -ge 2 ] && break; sleep 0.1; done
[ "$(runs_done)" -ge 2 ] || fail "the requeued run never verified: $(cat "$dir/job-j.out" 2>&1)"
second_tasks=$(job_tasks "$j")
scancel "$j"
wait_jobs "$j"
for _ in $(seq 1 100); do
  [ "$(tasks_of "$record" | cut -d' ' -f2)" = 2 ] && break
  sleep 0.1
done
read -r total_tasks runs < <(tasks_of "$record")
[ "$first_runs" = 1 ] && [ "$runs" = 2 ] && [ "$total_tasks" -eq $((first_tasks + second_tasks)) ] ||
  fail "requeued job $j: first run $first_tasks tasks, second $second_tasks, record $total_tasks over $runs runs: $(cat "$record")"
pass "a requeued job's record adds its runs up: $first_tasks + $second_tasks = $total_tasks tasks over $runs runs"

# 9. A node whose daemon is down: a job runs without Agora and its output says why; a job that
# requires Agora (AGORA_REQUIRED=1) is not started, and says why.
n2_pid=$(status n2 | field pid)
kill "$n2_pid"
for _ in $(seq 1 100); do kill -0 "$n2_pid" 2>/dev/null || break; sleep 0.05; done
f=$(sbatch --parsable -w n2 -o "$dir/job-f.out" --wrap "echo ran")
g=$(sbatch --parsable -w n2 -o "$dir/job-g.out" --export=ALL,AGORA_REQUIRED=1 --wrap "echo ran")
wait_jobs "$f" "$g"
grep -q "^ran" "$dir/job-f.out" && grep -q "no Agora daemon answers" "$dir/job-f.out" ||
  fail "the job without a daemon: $(cat "$dir/job-f.out")"
state_g=$(sacct -n -X -j "$g" -o State 2>/dev/null | tr -d ' ' || true)
! grep -q "^ran" "$dir/job-g.out" 2>/dev/null ||
  fail "a job requiring Agora ran without its daemon: $(cat "$dir/job-g.out")"
pass "daemon down: a job ran without Agora and said so; one requiring Agora was not started (${state_g:-no sacct}; $(tr '\n' ' ' <"$dir/job-g.out" 2>/dev/null | cut -c1-120))"

echo "slurm/agora-jobs: all passed"
