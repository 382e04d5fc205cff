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

# Installs the project's hooks into DIR/hooks as an administrator would (the scripts copied, their
# settings in DIR/hooks/agora-hooks.env: slurmd's environment does not reach them, and two nodes
# share this host here, so the socket names $SLURMD_NODENAME), or, with `empty`, hooks that do
# nothing. Prints the slurm.conf lines.
write_hooks() {
  local dir=$1 kind=${2:-agora} scripts hook
  scripts=$(realpath "$(dirname "${BASH_SOURCE[0]}")")
  mkdir -p "$dir/hooks"
  for hook in prolog epilog task-prolog; do
    if [ "$kind" = empty ]; then
      printf '#!/bin/sh\nexit 0\n' >"$dir/hooks/$hook.sh"
    else
      cp "$scripts/$hook.sh" "$dir/hooks/$hook.sh"
    fi
    chmod 0755 "$dir/hooks/$hook.sh"
  done
  if [ "$kind" != empty ]; then
    cp "$scripts/hooks-common.sh" "$dir/hooks/"
    printf 'AGORA=%s\nAGORA_SOCKET=%s/agora-$SLURMD_NODENAME.sock\nSLURM_CONF=%s/slurm.conf\nAGORA_HOOK_LOG=%s/hooks.log\n' \
      "$agora" "$dir" "$dir" "$dir" >"$dir/hooks/agora-hooks.env"
    chmod 0644 "$dir/hooks/agora-hooks.env" "$dir/hooks/hooks-common.sh"
  fi
  printf 'TaskProlog=%s/hooks/task-prolog.sh\nProlog=%s/hooks/prolog.sh\nEpilog=%s/hooks/epilog.sh\nPrologFlags=Alloc\n' "$dir" "$dir" "$dir"
}
