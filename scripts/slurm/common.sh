# Sourced by scripts/slurm/agora-jobs.sh and bench.sh: what both do to a loopback cluster's
# directory before `cluster.sh start`. Needs `agora` (the binary's absolute path) and `pids` (an
# array the caller kills at exit).

# Starts one Agora daemon per node n1, n2 in DIR (socket DIR/agora-NODE.sock, state
# DIR/agora-NODE) and waits for their sockets; returns non-zero if one did not start.
start_agora_daemons() {
  local dir=$1 node
  for node in n1 n2; do
    AGORA_STATE_DIR="$dir/agora-$node" AGORA_LOG=warn "$agora" serve --socket "$dir/agora-$node.sock" --no-opencl \
      >"$dir/agora-$node.log" 2>&1 &
    pids+=($!)
  done
  for node in n1 n2; do
    for _ in $(seq 1 100); do [ -S "$dir/agora-$node.sock" ] && break; sleep 0.05; done
    [ -S "$dir/agora-$node.sock" ] || { echo "the Agora daemon of $node did not start (see $dir/agora-$node.log)" >&2; return 1; }
  done
}

# Writes DIR/{prolog,epilog,task-prolog}.sh: wrappers that run the project's hooks with this
# node's daemon (two nodes share one host here; an administrator sets AGORA and AGORA_SOCKET once
# per node instead), or, with `empty`, hooks that do nothing. Prints the slurm.conf lines.
write_hooks() {
  local dir=$1 kind=${2:-agora} scripts hook
  scripts=$(realpath "$(dirname "${BASH_SOURCE[0]}")")
  for hook in prolog epilog task-prolog; do
    if [ "$kind" = empty ]; then
      printf '#!/bin/sh\nexit 0\n' >"$dir/$hook.sh"
    else
      printf '#!/bin/sh\nexport AGORA=%s AGORA_SOCKET=%s/agora-$SLURMD_NODENAME.sock SLURM_CONF=%s/slurm.conf\nexec %s/%s.sh\n' \
        "$agora" "$dir" "$dir" "$scripts" "$hook" >"$dir/$hook.sh"
    fi
    chmod 0755 "$dir/$hook.sh"
  done
  printf 'TaskProlog=%s/task-prolog.sh\nProlog=%s/prolog.sh\nEpilog=%s/epilog.sh\n' "$dir" "$dir" "$dir"
}
