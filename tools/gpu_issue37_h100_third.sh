#!/usr/bin/env bash
# Issue 37's third H100 call: the judged run again on a fresh machine (a replicate), with this
# machine's microbenchmarks (calibrate measure: the executor's host calls now with the main-thread
# prefetch queue) taken in the same call.
#   tools/gpu_issue37_h100_third.sh OUT   (DEVICE=cpu SMALL=1: a rehearsal on the CPU)
set -u
out=$1; mkdir -p "$out"; work=$(mktemp -d)
exec > >(tee "$out/log3.txt") 2>&1
dev=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 NUMBA_DISABLE_JIT=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
log() { echo "[$(date +%H:%M:%S)] $*"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv; uname -r; } > "$out/env3.txt" 2>&1; cat "$out/env3.txt"
log "measure"
timeout 60 python3 -m moesim calibrate measure --device "$dev" --model-shapes olmoe-1b-7b ${SMALL:+--quick} --out "$out/raw3.parquet"
timeout 30 python3 -m moesim calibrate fit "$out/raw3.parquet" --out "$out/profile3.yaml"
tok=${SMALL:+8}
python3 -m moesim trace synth --preset olmoe-1b-7b ${SMALL:+--layers 2} --tokens "${tok:-128}" --prompt-tokens 64 --out "$work/olmoe.parquet"
log "validate main2"
timeout "${MAIN_S:-120}" python3 -m moesim calibrate validate --profile "$out/profile3.yaml" --trace "$work/olmoe.parquet" \
  --device "$dev" --set expert_compute=per-expert --launch eager --prefetch-from main \
  --scenarios 'moesim/scenarios/validation/*.yaml' --out "$work/main2"
tar -C "$work" -czf "$out/runs3.tar.gz" main2
log "done"
