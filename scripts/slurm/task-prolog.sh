#!/bin/sh
# Slurm TaskProlog for Agora (slurm.conf: `TaskProlog=/opt/agora/scripts/slurm/task-prolog.sh`):
# runs before each task of a job, as the job's user; each `export` line it prints becomes the
# task's environment and each `print` line goes to the task's output. It points the task at the
# node's Agora daemon (AGORA_SOCKET) and, when no daemon answers there, says so in the job's
# output instead of letting the task fail later with a connection error.
#
# A job that must not run without Agora says so with AGORA_REQUIRED=1 in its environment
# (`sbatch --export=ALL,AGORA_REQUIRED=1`, or an administrator's default below): then a task
# whose node daemon does not answer is not started (the TaskProlog fails, and Slurm fails the
# task), instead of running without Agora.
required=${AGORA_REQUIRED:-${AGORA_REQUIRED_DEFAULT:-0}}
agora=${AGORA:-agora}
socket=${AGORA_SOCKET:-}
if [ -n "$socket" ]; then
  echo "export AGORA_SOCKET=$socket"
  set -- --socket "$socket"
fi
if ! "$agora" status "$@" >/dev/null 2>&1; then
  if [ "$required" = 1 ]; then
    echo "print agora: no Agora daemon answers on $(hostname)${socket:+ at $socket}, and this job requires Agora (AGORA_REQUIRED=1): the task is not started; ask the administrator (agora serve)"
    exit 1
  fi
  echo "print agora: no Agora daemon answers on $(hostname)${socket:+ at $socket}; tasks that use Agora will fail to connect: ask the administrator (agora serve)"
fi
exit 0
