# Sourced by prolog.sh, epilog.sh and task-prolog.sh; install it beside them.
#
# Settings. Slurm runs the Prolog and Epilog with an environment of its own (slurmd's is not
# passed on: an AGORA or AGORA_SOCKET set for slurmd never reaches them), and the TaskProlog
# with the job's. So the hooks read their settings from a file, the first that exists of
#   agora-hooks.env beside the hooks, /etc/agora/slurm-hooks.env
# in sh syntax, every variable exported, e.g.
#   AGORA=/opt/agora/bin/agora              # the agora binary (default: `agora` on PATH)
#   AGORA_SOCKET=/run/agora/agora.sock      # the node daemon's socket (default: its standard path)
#   AGORA_HEAP_QUOTA=1G                     # heap quota of each session of a job (prolog)
#   AGORA_DEVICE_QUOTA_PER_SHARE=1073741824 # device memory per `agora` share (prolog)
#   AGORA_REQUIRED_DEFAULT=1                # no task starts where no daemon answers (TaskProlog)
#   AGORA_HOOK_LOG=/var/log/agora-slurm.log # also append the hooks' problems here
#   SLURM_CONF=/etc/slurm/slurm.conf        # for squeue, when not at Slurm's default
# `$SLURMD_NODENAME` may be used in it (several slurmd on one host). The Prolog and Epilog
# source it as root: make it writable by root only (and readable by all: the TaskProlog runs as
# the job's user).
hooks_dir=$(dirname "$0")
for agora_settings in "$hooks_dir/agora-hooks.env" /etc/agora/slurm-hooks.env; do
  if [ -r "$agora_settings" ]; then
    set -a
    . "$agora_settings"
    set +a
    break
  fi
done
agora=${AGORA:-agora}
node=${SLURMD_NODENAME:-$(hostname -s 2>/dev/null || hostname)}

# Says what went wrong where an administrator looks. slurmd logs a hook's output only at its
# debug2 level (and a Prolog or Epilog that exits non-zero would drain the node), so the
# message also goes to syslog (tag agora-slurm: `journalctl -t agora-slurm`) and to
# AGORA_HOOK_LOG when set.
hook_log() {
  echo "$*" >&2
  if command -v logger >/dev/null 2>&1; then
    logger -t agora-slurm -p daemon.warning -- "$*" 2>/dev/null || true
  fi
  if [ -n "${AGORA_HOOK_LOG:-}" ]; then
    printf '%s %s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$node" "$*" >>"$AGORA_HOOK_LOG" 2>/dev/null || true
  fi
  return 0
}

# Whether the agora binary can be run here; if not, `agora_missing` says why.
agora_missing="the agora command is not found on $node (AGORA=${AGORA:-unset}, PATH=$PATH): set AGORA in $hooks_dir/agora-hooks.env or /etc/agora/slurm-hooks.env"
agora_found() {
  command -v "$agora" >/dev/null 2>&1
}
