#!/usr/bin/env bash
# Issue 37's third GPU call: an OLMoE profile of this device (full `calibrate measure`, fit), then
# the OLMoE per-expert validation with the executor's kernels launched eagerly (the second call
# showed the per-expert CUDA graphs, waiting on the demand stream, cost what eager launches do not).
set -u
out=$1; mkdir -p "$out/val"
export PYTHONUNBUFFERED=1 NUMBA_DISABLE_JIT=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
log() { echo "[$(date +%H:%M:%S)] $*"; }
log "measure"; timeout "${MEASURE_S:-80}" python3 -m moesim calibrate measure --device cuda --model-shapes olmoe-1b-7b --out "$out/raw_olmoe.parquet"
log "fit"; timeout 25 python3 -m moesim calibrate fit "$out/raw_olmoe.parquet" --out "$out/profile.yaml"
profile=$out/profile.yaml; [ -f "$profile" ] || profile=profiles/h100.yaml
python3 -m moesim trace synth --preset olmoe-1b-7b --tokens 200 --prompt-tokens 64 --out /tmp/olmoe.parquet
log "validate (eager, per-expert) with $profile"
timeout "${VALIDATE_S:-125}" python3 -m moesim calibrate validate --profile "$profile" --trace /tmp/olmoe.parquet \
  --scenarios 'moesim/scenarios/validation/*.yaml' --set expert_compute=per-expert --launch eager --device cuda --out "$out/val"
log "done"
