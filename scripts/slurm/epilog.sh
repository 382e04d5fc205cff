#!/bin/sh
# Slurm Epilog for Agora (slurm.conf: `Epilog=/opt/agora/scripts/slurm/epilog.sh`): slurmd runs it
# as root on each node of a job when the job ends there (completed, failed, cancelled or
# requeued). It ends the job on the node's Agora daemon (`agora slurm job-end`): every session of
# the job is ended and reclaimed, even one whose process escaped the job and still runs. The
# job's use on this node (sessions, tasks, device time per device kind, bytes moved, energy from
# the daemon's power model; a requeued job's runs added up) is written to the daemon's
# STATE_DIR/jobs/JOB.json, printed to the epilog's output, and offered to the job's AdminComment
# (Slurm 22.05 refuses that update while the job completes, which is when epilogs run: "Job has
# already finished"; the file is the record).
#
# Settings as for prolog.sh (hooks-common.sh). It never fails: Slurm drains a node whose epilog
# fails; problems go to syslog (and AGORA_HOOK_LOG).
. "$(dirname "$0")/hooks-common.sh"
[ -n "${SLURM_JOB_ID:-}" ] || exit 0
if ! agora_found; then
  hook_log "agora epilog: job $SLURM_JOB_ID not ended on the Agora daemon: $agora_missing"
  exit 0
fi
if summary=$("$agora" slurm job-end --job "$SLURM_JOB_ID" 2>&1); then
  echo "agora epilog: job $SLURM_JOB_ID: $summary"
  scontrol update JobId="$SLURM_JOB_ID" AdminComment="$summary" >/dev/null 2>&1 || true
else
  case $summary in
    *"is running on this daemon"*)
      # Registered nowhere here: without `PrologFlags=Alloc` Slurm runs the prolog only on the
      # nodes where a step ran, and the epilog on all of the job's nodes.
      hook_log "agora epilog: job $SLURM_JOB_ID was not registered with the Agora daemon on $node (its prolog did not run here: set PrologFlags=Alloc in slurm.conf so it runs on every node of a job; or the prolog failed, see above): $summary" ;;
    *)
      # Either the daemon did not end the job, or it ended it and could not write its record
      # (the summary is then in $summary, the job's only record: it goes to syslog with the rest).
      hook_log "agora epilog: job $SLURM_JOB_ID not ended, or its use not recorded, by the Agora daemon on $node: $summary" ;;
  esac
fi
exit 0
