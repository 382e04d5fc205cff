#!/bin/sh
# Slurm Prolog for Agora (slurm.conf: `Prolog=/opt/agora/scripts/slurm/prolog.sh`): slurmd runs it
# as root on each node of a job before the job's first step there. It registers the job with the
# node's Agora daemon (`agora slurm job-start`): the job's id, uid and its `agora` GRES shares
# (`--gres=agora:K`, read from `scontrol -d show job`, since Slurm sets no variable for a
# count-only GRES). Sessions of the job's processes then join the job, and the epilog ends them.
#
# Settings (environment of slurmd, or edit here): AGORA (the agora binary, default `agora` on
# PATH), AGORA_SOCKET (the node daemon's socket, default its standard path), AGORA_HEAP_QUOTA
# (heap quota of each of the job's sessions, e.g. 1G; default the daemon's),
# AGORA_DEVICE_QUOTA_PER_SHARE (device memory per `agora` share, in bytes: a job of K shares
# gets K times that as each session's device quota; default the daemon's quota).
#
# It never fails the job: a prolog that fails makes Slurm drain the node. If the daemon is down
# the job runs without Agora's job tracking, the reason goes to slurmd's log, and the
# TaskProlog (task-prolog.sh) tells the job's output.
agora=${AGORA:-agora}
[ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_JOB_UID:-}" ] || exit 0
shares=$(scontrol -d show job "$SLURM_JOB_ID" 2>/dev/null | grep -o 'agora:[0-9][0-9]*' | head -1 | cut -d: -f2)
set -- slurm job-start --job "$SLURM_JOB_ID" --uid "$SLURM_JOB_UID" --shares "${shares:-0}"
[ -n "${AGORA_HEAP_QUOTA:-}" ] && set -- "$@" --heap-quota "$AGORA_HEAP_QUOTA"
if [ -n "${AGORA_DEVICE_QUOTA_PER_SHARE:-}" ] && [ "${shares:-0}" -gt 0 ]; then
  set -- "$@" --device-quota "$((shares * AGORA_DEVICE_QUOTA_PER_SHARE))"
fi
if ! out=$("$agora" "$@" 2>&1); then
  echo "agora prolog: job $SLURM_JOB_ID not registered with the Agora daemon, or not recorded for its restart: $out" >&2
fi
exit 0
