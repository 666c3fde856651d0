#!/usr/bin/env bash
# What each call of a GPU lease carries, against the run tool's 64 MiB a call; it downloads nothing:
#   bash benchmarks/gpu_carry.sh     a line for each call that benchmarks/gpu.sh's header plans (its lines
#                                    "NAME, carry PATHS:  COMMAND"), with what travels with every call: the working tree
# The working tree that travels is the tracked files, the untracked ones git does not ignore, and a shared/ folder
# inside the checkout, ignored or not. Exit 1 where a call is over the limit, or where a call of the next lease's plan
# ("call N") lacks a path it carries (the other calls' missing paths are listed: those calls cannot run yet).
# benchmarks/gpu_prepare.sh runs it last, once it has made what the calls carry.
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY_LIMIT=$((64 * 1024 * 1024))  # bytes one call of the run tool carries, the working tree included

plan=$(sed -nE 's/^#[[:space:]]{2,}([a-z0-9 -]*call( [0-9]+)?), carry ([^:]+):.*/\1|\3/p' benchmarks/gpu.sh)
[ -n "$plan" ] || { echo "benchmarks/gpu_carry.sh: no line \"call N, carry PATHS:\" in gpu.sh's header" >&2; exit 2; }
files() {  # what travels with every call, NUL-separated
  git ls-files -z -co --exclude-standard
  if [ -d shared ]; then git ls-files -z -oi --exclude-standard -- shared; fi
}
tree=$(files | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{bytes += $1} END {print bytes + 0}')
mib() { printf '%.1f MiB' "$(echo "$1 / 1048576" | bc -l)"; }
echo "the working tree, with every call: $(mib "$tree")"
status=0
while IFS='|' read -r name paths; do
  missing="" bytes=$tree
  for path in $paths; do
    if [ -e "$path" ]; then bytes=$((bytes + $(du -sb "$path" | cut -f1))); else missing+=" $path"; fi
  done
  verdict=fits
  [ "$bytes" -le $CARRY_LIMIT ] || { verdict="OVER the 64 MiB a call carries"; status=1; }
  if [ -n "$missing" ]; then
    verdict+="; lacks$missing"
    [[ $name =~ ^call\ [0-9]+$ ]] && status=1
  fi
  printf '%-14s carry %-30s %s with the tree: %s\n' "$name" "$paths" "$(mib "$bytes")" "$verdict"
done <<< "$plan"
exit $status
