#!/bin/sh
# Slurm Prolog for Agora (slurm.conf: `Prolog=/opt/agora/scripts/slurm/prolog.sh`): slurmd runs it
# as root on each node of a job before the job's first step there. It registers the job with the
# node's Agora daemon (`agora slurm job-start`): the job's id, uid, its `agora` GRES shares on
# this node (`--gres=agora:K`) and Slurm's restart count. Sessions of the job's processes then
# join the job, and the epilog ends them.
#
# Settings: hooks-common.sh (a file beside the hooks or /etc/agora/slurm-hooks.env; slurmd's
# environment does not reach a Prolog). AGORA_HEAP_QUOTA (heap quota of each of the job's
# sessions, e.g. 1G; default the daemon's), AGORA_DEVICE_QUOTA_PER_SHARE (device memory per
# `agora` share, in bytes: a job of K shares gets K times that as each session's device quota;
# default the daemon's quota).
#
# It never fails the job: a prolog that fails makes Slurm drain the node. If the daemon is down
# the job runs without Agora's job tracking, the reason goes to syslog (and AGORA_HOOK_LOG), and
# the TaskProlog (task-prolog.sh) tells the job's output.
. "$(dirname "$0")/hooks-common.sh"
[ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_JOB_UID:-}" ] || exit 0
if ! agora_found; then
  hook_log "agora prolog: job $SLURM_JOB_ID not registered with the Agora daemon: $agora_missing"
  exit 0
fi
# The job's `agora` GRES per node from Slurm's own field for it (squeue's tres-per-node:
# "gres:agora:2", "gres/agora:2", "gres:agora:TYPE:2"; `--gres` counts per node), never from
# `scontrol show job`'s text: a job's name, comment and paths are its user's and may spell
# "agora:64", and its JOB_GRES is the total over all its nodes.
tres=$(squeue -h -j "$SLURM_JOB_ID" -o %b 2>/dev/null) || hook_log "agora prolog: job $SLURM_JOB_ID: squeue failed; registering it with 0 shares"
# `--gres=agora` (or `agora:TYPE`) without a count is one, as Slurm counts it.
shares=$(printf '%s\n' "$tres" | tr ',' '\n' | sed -n \
  -e 's#^\(gres[:/]\)\{0,1\}agora\(:[A-Za-z_][A-Za-z0-9_.-]*\)\{0,1\}:\([0-9][0-9]*\)$#\3#p' \
  -e 's#^\(gres[:/]\)\{0,1\}agora\(:[A-Za-z_][A-Za-z0-9_.-]*\)\{0,1\}$#1#p' | head -1)
# Slurm's restart count (0 on a job's first run): the epilog then adds a requeued run's use to
# the earlier runs' record.
restarts=${SLURM_JOB_RESTART_COUNT:-0}
case $restarts in '' | *[!0-9]*) restarts=0 ;; esac
set -- slurm job-start --job "$SLURM_JOB_ID" --uid "$SLURM_JOB_UID" --shares "${shares:-0}" --restarts "$restarts"
[ -n "${AGORA_HEAP_QUOTA:-}" ] && set -- "$@" --heap-quota "$AGORA_HEAP_QUOTA"
# A job without the GRES gets one share's device memory: never more than a job that asked.
if [ -n "${AGORA_DEVICE_QUOTA_PER_SHARE:-}" ]; then
  quota_shares=${shares:-0}
  [ "$quota_shares" -gt 0 ] || quota_shares=1
  set -- "$@" --device-quota "$((quota_shares * AGORA_DEVICE_QUOTA_PER_SHARE))"
fi
if ! out=$("$agora" "$@" 2>&1); then
  hook_log "agora prolog: job $SLURM_JOB_ID not registered with the Agora daemon on $node, or not recorded for its restart: $out"
fi
exit 0
