#!/usr/bin/env bash
# Issue 37's H200 call after the host-beside one (tools/gpu_issue37_host_beside.sh): does the
# eager executor's host speed depend on the CPU core (tools/gpu_host_modes.py), and does the
# OLMoE per-expert validation measure steadily with the process pinned to the fastest core
# (calibrate validate --host-beside under taskset, twice)? Uses the first call's profile.
#   tools/gpu_issue37_pinned.sh OUT PROFILE   (DEVICE=cpu SMALL=1: a rehearsal on the CPU)
set -u
out=$1; profile=$2; mkdir -p "$out"; work=$(mktemp -d)
exec > >(tee "$out/log.txt") 2>&1
dev=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 NUMBA_DISABLE_JIT=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
log() { echo "[$(date +%H:%M:%S)] $*"; }
log "host modes"
timeout 120 python3 tools/gpu_host_modes.py "$out/host_modes.csv" --device "$dev" --free-s "${FREE_S:-20}" --core-s "${CORE_S:-1.5}" | tee "$work/modes.txt"
c=$(tail -1 "$work/modes.txt"); log "fastest core: $c"
tok=${SMALL:+8}
python3 -m moesim trace synth --preset olmoe-1b-7b ${SMALL:+--layers 2} --tokens "${tok:-128}" --prompt-tokens 64 --out "$work/olmoe.parquet"
runs=""
for run in pinned1 pinned2; do
  log "validate $run (core $c)"
  timeout "${RUN_S:-130}" taskset -c "$c" python3 -m moesim calibrate validate --profile "$profile" --trace "$work/olmoe.parquet" \
    --device "$dev" --set expert_compute=per-expert --launch eager --host-beside \
    --scenarios 'moesim/scenarios/validation/*.yaml' --out "$work/$run"
  runs="$runs $run"
  tar -C "$work" -czf "$out/runs.tar.gz" $runs
done
log "done"
