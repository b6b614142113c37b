#!/usr/bin/env bash
# Issue 37's next GPU call: this machine's microbenchmarks (calibrate measure + fit), then the
# OLMoE per-expert validation with eager launches and the host's time measured beside each
# scenario (calibrate validate --host-beside), three times in one call, so the runs show whether a
# prediction that carries the host's speed of the moment holds where the H100 replicate of
# 2026-11-26 did not (validation/h100/eager/report.md, section 5). The prediction from the
# microbenchmarks alone is made again from the same rows afterwards (tools/repredict_beside.py).
#   tools/gpu_issue37_host_beside.sh OUT   (DEVICE=cpu SMALL=1: a rehearsal on the CPU)
set -u
out=$1; mkdir -p "$out"; work=$(mktemp -d)
exec > >(tee "$out/log.txt") 2>&1
dev=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 NUMBA_DISABLE_JIT=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
log() { echo "[$(date +%H:%M:%S)] $*"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem,power.limit --format=csv
  python3 -c 'import sys, torch, numpy; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "-", "numpy", numpy.__version__)'
  grep -m1 'model name' /proc/cpuinfo; nproc; uname -r; } > "$out/env.txt" 2>&1; cat "$out/env.txt"
log "measure"
timeout 90 python3 -m moesim calibrate measure --device "$dev" --model-shapes olmoe-1b-7b ${SMALL:+--quick} --out "$out/raw.parquet"
timeout 30 python3 -m moesim calibrate fit "$out/raw.parquet" --out "$out/profile.yaml"
tok=${SMALL:+8}
python3 -m moesim trace synth --preset olmoe-1b-7b ${SMALL:+--layers 2} --tokens "${tok:-128}" --prompt-tokens 64 --out "$work/olmoe.parquet"
runs=""
for run in beside1 beside2 beside3; do
  log "validate $run"
  timeout "${RUN_S:-130}" python3 -m moesim calibrate validate --profile "$out/profile.yaml" --trace "$work/olmoe.parquet" \
    --device "$dev" --set expert_compute=per-expert --launch eager --host-beside \
    --scenarios 'moesim/scenarios/validation/*.yaml' --out "$work/$run"
  runs="$runs $run"
  tar -C "$work" -czf "$out/runs.tar.gz" $runs
done
log "done"
