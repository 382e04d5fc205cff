#!/usr/bin/env bash
# Builds the shared object of every example kernel package: the C files of
# examples/packages/NAME/ into the library its package.toml declares ([package] library = "...").
# Idempotent: a library newer than its C files and agora_kernel.h is left alone. A rebuilt library
# replaces the old file by rename, so a daemon that has it loaded is not disturbed.
set -euo pipefail
cd "$(dirname "$0")/.."

CC="${CC:-cc}"
header=crates/capi/include/agora_kernel.h
for manifest in examples/packages/*/package.toml; do
  [ -e "$manifest" ] || continue
  dir=$(dirname "$manifest")
  # The [package] table's `library = "..."` (the first such key in the file).
  library=$(sed -n 's/^[[:space:]]*library[[:space:]]*=[[:space:]]*"\([^"]*\)".*/\1/p' "$manifest" | head -n 1)
  sources=("$dir"/*.c)
  if [ -z "$library" ] || [ ! -e "${sources[0]}" ]; then
    continue
  fi
  out="$dir/$library"
  stale=0
  [ -e "$out" ] || stale=1
  for input in "${sources[@]}" "$header" "$manifest"; do
    [ "$input" -nt "$out" ] && stale=1
  done
  [ "$stale" -eq 1 ] || continue
  echo "build-packages: $out"
  tmp=$(mktemp "$dir/.${library}.XXXXXX")
  trap 'rm -f "$tmp"' EXIT
  "$CC" -O2 -shared -fPIC -I crates/capi/include -o "$tmp" "${sources[@]}"
  chmod 0644 "$tmp"
  mv -f "$tmp" "$out"
  trap - EXIT
done
