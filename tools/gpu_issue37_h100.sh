#!/usr/bin/env bash
# Issue 37's H100 run (validation/h100/eager/): the committed H100 per-expert rows timed the
# executor's CUDA graphs (validation/h200/report.md, section 1), so they are measured again here
# with eager launches, on the committed validation's traces (128 decode tokens, 64-token prompt).
#   1. `calibrate measure --model-shapes olmoe-1b-7b` and `fit`: this H100's link, compute and host
#      costs, the executor's own per-expert host time included (microbenchmarks, disjoint from the
#      validation rows)
#   2. OLMoE per-expert validation, eager launches, Python's default thread switch interval (5 ms)
#   3. the same with a 50 us switch interval: whether the prefetch rows' gap on the H200 was the
#      copy worker's thread waiting for the interpreter
#   4. the 10 rows measured under the old Least-Stale rule (tests/test_h100_calibration.py), with the
#      committed run's launches (graphs), so they join the committed table
# Each step has its own time limit and what it wrote is bundled into OUT at once.
#   tools/gpu_issue37_h100.sh OUT          (DEVICE=cpu SMALL=1: a rehearsal on the CPU)
set -u
out=$1; mkdir -p "$out"; work=$(mktemp -d)
exec > >(tee "$out/log.txt") 2>&1
dev=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 NUMBA_DISABLE_JIT=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
log() { echo "[$(date +%H:%M:%S)] $*"; }
moesim() { python3 -m moesim "$@"; }
bundle() { tar -C "$work" -czf "$out/runs.tar.gz" .; }
layers=${SMALL:+--layers 2}; tokens=${SMALL:+8}; mlayers=${SMALL:+1}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv
  python3 -c "import sys, torch, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no gpu', 'numpy', numpy.__version__)"
  nproc; lscpu | grep -i "model name"; uname -r; git log -1 --format=%H 2>/dev/null; } > "$out/env.txt" 2>&1
cat "$out/env.txt"
log "measure"
timeout "${MEASURE_S:-90}" python3 -m moesim calibrate measure --device "$dev" --model-shapes olmoe-1b-7b ${SMALL:+--quick} --out "$out/raw.parquet"
log "fit"; timeout 30 python3 -m moesim calibrate fit "$out/raw.parquet" --out "$out/profile.yaml"
profile=$out/profile.yaml; [ -f "$profile" ] || profile=profiles/h100.yaml
moesim trace synth --preset olmoe-1b-7b $layers --tokens "${tokens:-128}" --prompt-tokens 64 --out "$work/olmoe.parquet"
moesim trace synth --preset mixtral-8x7b --layers "${mlayers:-4}" --tokens "${tokens:-128}" --prompt-tokens 64 --out "$work/mixtral.parquet"
val() {  # name, limit (s), trace, profile, then calibrate validate's options
  local name=$1 limit=$2 trace=$3 prof=$4; shift 4
  log "validate $name"
  timeout "$limit" python3 -m moesim calibrate validate --profile "$prof" --trace "$work/$trace.parquet" --device "$dev" --out "$work/$name" "$@"
  bundle
}
v=moesim/scenarios/validation
all=(--scenarios "$v/*.yaml")
old=(--scenarios "$v/cap5-pf-least-stale.yaml" --scenarios "$v/cap25-pf-least-stale.yaml")
val eager "${EAGER_S:-120}" olmoe "$profile" "${all[@]}" --set expert_compute=per-expert --launch eager
val eager-switch50 "${EAGER_S:-120}" olmoe "$profile" "${all[@]}" --set expert_compute=per-expert --launch eager --switch-interval-us 50
# the old-rule rows with the committed run's profile, as its other rows were predicted
for mode in layer per-expert; do
  val "oldrule-olmoe-$mode" 45 olmoe profiles/h100.yaml --scenarios "$v/cap1-pf-least-stale.yaml" "${old[@]}" --set expert_compute=$mode --launch graphs
done
for mode in layer per-expert; do
  val "oldrule-mixtral-$mode" 70 mixtral profiles/h100.yaml "${old[@]}" --set expert_compute=$mode --launch graphs
done
log "done"
