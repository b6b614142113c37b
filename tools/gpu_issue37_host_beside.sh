#!/usr/bin/env bash
# Issue 37's next GPU call (not run yet): the OLMoE per-expert validation with eager launches and
# the host's time measured beside each scenario (calibrate validate --host-beside), twice in one
# call, so the two runs show whether a prediction that carries the host's speed of the moment
# holds where the H100 replicate of 2026-11-26 did not (validation/h100/eager/report.md, section 5).
#   tools/gpu_issue37_host_beside.sh OUT PROFILE   (DEVICE=cpu SMALL=1: a rehearsal on the CPU)
set -u
out=$1; profile=${2:-validation/h100/eager/profile.yaml}; mkdir -p "$out"; work=$(mktemp -d)
exec > >(tee "$out/log.txt") 2>&1
dev=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 NUMBA_DISABLE_JIT=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
log() { echo "[$(date +%H:%M:%S)] $*"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv; uname -r; } > "$out/env.txt" 2>&1; cat "$out/env.txt"
tok=${SMALL:+8}
python3 -m moesim trace synth --preset olmoe-1b-7b ${SMALL:+--layers 2} --tokens "${tok:-128}" --prompt-tokens 64 --out "$work/olmoe.parquet"
for run in beside1 beside2; do
  log "validate $run"
  timeout "${RUN_S:-130}" python3 -m moesim calibrate validate --profile "$profile" --trace "$work/olmoe.parquet" \
    --device "$dev" --set expert_compute=per-expert --launch eager --host-beside \
    --scenarios 'moesim/scenarios/validation/*.yaml' --out "$work/$run"
  tar -C "$work" -czf "$out/runs.tar.gz" beside1 ${run/beside1/}
done
log "done"
