#!/usr/bin/env bash
# Issue 37's second H100 call: the OLMoE per-expert validation with eager launches and the
# prefetches issued from the main thread (calibrate validate --prefetch-from main), against the
# copy worker on the same machine. The first call (tools/gpu_issue37_h100.sh) showed the rows
# with prefetch at 1% and 5% 27-39% slower than predicted with either thread switch interval.
#   tools/gpu_issue37_h100_second.sh OUT   (DEVICE=cpu SMALL=1: a rehearsal on the CPU)
set -u
out=$1; mkdir -p "$out"; work=$(mktemp -d)
exec > >(tee "$out/log2.txt") 2>&1
dev=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 NUMBA_DISABLE_JIT=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
log() { echo "[$(date +%H:%M:%S)] $*"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv; uname -r; } > "$out/env2.txt" 2>&1; cat "$out/env2.txt"
tok=${SMALL:+8}
profile=validation/h100/eager/profile.yaml
python3 -m moesim trace synth --preset olmoe-1b-7b ${SMALL:+--layers 2} --tokens "${tok:-128}" --prompt-tokens 64 --out "$work/olmoe.parquet"
v=moesim/scenarios/validation
pf=(--scenarios "$v/cap1-pf-*.yaml" --scenarios "$v/cap5-pf-*.yaml")
val() {  # name, limit (s), then calibrate validate's options
  local name=$1 limit=$2; shift 2
  log "validate $name"
  timeout "$limit" python3 -m moesim calibrate validate --profile "$profile" --trace "$work/olmoe.parquet" --device "$dev" \
    --set expert_compute=per-expert --launch eager --out "$work/$name" "$@"
  tar -C "$work" -czf "$out/runs2.tar.gz" .
}
val main "${MAIN_S:-130}" --scenarios "$v/*.yaml" --prefetch-from main
val pf-worker 50 "${pf[@]}" --prefetch-from worker
val pf-main 50 "${pf[@]}" --prefetch-from main
log "done"
