#!/bin/sh
# Slurm TaskProlog for Agora (slurm.conf: `TaskProlog=/opt/agora/scripts/slurm/task-prolog.sh`):
# runs before each task of a job, as the job's user; each `export` line it prints becomes the
# task's environment and each `print` line goes to the task's output. It points the task at the
# node's Agora daemon (AGORA_SOCKET from the hooks' settings, hooks-common.sh, over one in the
# job's environment: `srun` in a batch script passes on the first node's to every node) and, when
# no daemon answers there, says so in the job's output instead of letting the task fail later
# with a connection error.
#
# A job that must not run without Agora says so with AGORA_REQUIRED=1 in its environment
# (`sbatch --export=ALL,AGORA_REQUIRED=1`, or AGORA_REQUIRED_DEFAULT=1 in the settings): then a
# task whose node daemon does not answer is not started (the TaskProlog fails, and Slurm fails
# the task), instead of running without Agora.
job_required=${AGORA_REQUIRED:-}
. "$(dirname "$0")/hooks-common.sh"
socket=${AGORA_SOCKET:-}
required=${job_required:-${AGORA_REQUIRED_DEFAULT:-0}}
if [ -n "$socket" ]; then
  echo "export AGORA_SOCKET=$socket"
  set -- --socket "$socket"
fi
if ! agora_found; then
  problem="$agora_missing; tell the administrator"
elif why=$("$agora" status "$@" 2>&1 >/dev/null); then
  exit 0
else
  why=$(printf '%s\n' "$why" | head -1 | sed 's/^error: //')
  where="$node${socket:+ at $socket}"
  case $why in
    *"Permission denied"* | *"does not admit"*)
      problem="the Agora daemon on $where does not admit this job's user ($(id -un 2>/dev/null || id -u)): ask the administrator (agora serve --socket-access)" ;;
    *"cannot reach the Agora daemon"*)
      problem="no Agora daemon answers on $where: ask the administrator to start the node's daemon" ;;
    *)
      problem="the Agora daemon on $where did not answer \`agora status\`: $why; tell the administrator" ;;
  esac
fi
if [ "$required" = 1 ]; then
  echo "print agora: this job requires Agora (AGORA_REQUIRED=1) and $problem: the task is not started"
  exit 1
fi
echo "print agora: $problem; tasks that use Agora will fail to connect"
exit 0
