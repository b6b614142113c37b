#!/usr/bin/env bash
# The first run after an installation: each form of the replay kernel compiled from an emptied
# numba cache (a new NUMBA_CACHE_DIR), then the same command again with the cache kept; then
# the first and a warm `moesim compare` (10 points, the machine's cores as workers). Prints one
# line per run: name and wall seconds. Run from the repository root with the venv installed:
#   bash benchmarks/first_run.sh > benchmarks/results/first_run.txt
# A form's compile time is its first run less its warm one. MOESIM_NO_JIT_HELPER=1 in the
# environment times the compiles without the helper on the other core (moesim.jitplan).
set -euo pipefail
CACHE=$(mktemp -d)
OUT=$(mktemp -d)
trap 'rm -rf "$CACHE" "$OUT"' EXIT
# wall seconds of a command, or FAILED (never a time for a run that did not finish)
secs() {
    local s e
    s=$(date +%s.%N)
    if ! "$@" > /dev/null 2>&1; then echo FAILED; return; fi
    e=$(date +%s.%N)
    echo "$e - $s" | bc
}
form() {
    local name=$1; shift
    rm -rf "$CACHE"/*
    echo "$name first $(NUMBA_CACHE_DIR=$CACHE secs .venv/bin/moesim run quickstart --no-write -q "$@")"
    echo "$name warm $(NUMBA_CACHE_DIR=$CACHE secs .venv/bin/moesim run quickstart --no-write -q "$@")"
}
form layer_fetch
form per_expert_fetch --set expert_compute=per-expert
form layer_drop --set policies.miss=drop
form per_expert_drop --set expert_compute=per-expert --set policies.miss=drop
rm -rf "$CACHE"/*
echo "compare first $(NUMBA_CACHE_DIR=$CACHE secs .venv/bin/moesim compare --out "$OUT/a")"
echo "compare warm $(NUMBA_CACHE_DIR=$CACHE secs .venv/bin/moesim compare --out "$OUT/b")"
