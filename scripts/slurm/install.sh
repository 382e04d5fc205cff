#!/usr/bin/env bash
# Installs Debian's Slurm (22.05 on Debian 12) and MUNGE, for scripts/slurm/cluster.sh and the
# Slurm integration (issue #17). Idempotent: installs only what is missing, prints what it installs.
#
#   slurmctld slurmd slurm-client  the controller, the node daemon, and srun/sbatch/squeue/sinfo/scancel
#                                  (slurm-wlm is only a metapackage for these three)
#   munge                          the authentication daemon Slurm's auth/munge talks to
#   libslurm-dev                   /usr/include/slurm/spank.h (and slurm.h) for building a SPANK plugin
#
# The packages' own services (munge, slurmctld, slurmd under systemd, with /etc/slurm) are not
# used: cluster.sh starts its own daemons with everything in a directory of its own. The
# packages enable those services where systemd runs; slurmctld/slurmd there need an
# /etc/slurm/slurm.conf, which nothing here writes, and a system munged would only use its own
# default socket and key, not cluster.sh's.
set -euo pipefail

need_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

pkgs=(slurmctld slurmd slurm-client munge libslurm-dev)
missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "slurm/install: already installed: ${pkgs[*]}"
else
  echo "slurm/install: installing ${missing[*]}"
  need_root apt-get update -qq
  need_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

for b in slurmctld slurmd srun sbatch squeue sinfo scancel scontrol munged mungekey; do
  command -v "$b" >/dev/null 2>&1 || { echo "slurm/install: $b missing after install" >&2; exit 1; }
done
[ -f /usr/include/slurm/spank.h ] || { echo "slurm/install: /usr/include/slurm/spank.h missing" >&2; exit 1; }
echo "slurm/install: ok ($(slurmctld -V), munge $(dpkg-query -W -f='${Version}' munge), spank.h at /usr/include/slurm/spank.h)"
