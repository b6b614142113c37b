#!/usr/bin/env bash
# Issue 37's GPU run, in one device call (docs/execution.md, validation/h200/README.md):
#   1. the host's time per CUDA call (tools/gpu_host_overhead.py)
#   2. why OLMoE per-expert passes take longer with 51 cache slots than with 10 (tools/gpu_perexpert_slots.py)
#   3. SpecMD's drop-in experiment with SpecMD's kind of executor (tools/gpu_specmd.py)
#   4. the compute microbenchmarks for an OLMoE profile of this device (moesim calibrate measure --quick)
# Every step writes under OUT as it goes and has its own time limit, so a slow step loses only itself.
#   tools/gpu_issue37.sh OUT            (DEVICE=cpu SMALL=1 for a rehearsal on the CPU)
set -u
out=$1; mkdir -p "$out"
dev=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 NUMBA_DISABLE_JIT=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
log() { echo "[$(date +%H:%M:%S)] $*"; }
small=${SMALL:+--layers 2}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv
  python3 -c "import sys, torch, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no gpu', 'numpy', numpy.__version__)"
  nproc; lscpu | grep -i "model name"; git log -1 --format=%H 2>/dev/null; } > "$out/env.txt" 2>&1
cat "$out/env.txt"
if [ "$dev" = cuda ]; then log "host call times"; timeout 60 python3 tools/gpu_host_overhead.py "$out/host_overhead.csv"; fi
log "slots"; timeout "${SLOTS_S:-170}" python3 tools/gpu_perexpert_slots.py "$out/slots.csv" --device "$dev" --repeats 2 ${SMALL:+--tokens 3 --layers 2}
log "specmd"; timeout "${SPECMD_S:-230}" python3 tools/gpu_specmd.py "$out/specmd.csv" "$out/specmd_micro.csv" --device "$dev" --repeats 2 ${SMALL:+--requests 1 --prompt 8 --layers 2}
if [ "$dev" = cuda ]; then log "measure"; timeout "${MEASURE_S:-80}" python3 -m moesim calibrate measure --device cuda --model-shapes olmoe-1b-7b --quick --out "$out/raw.parquet"; fi
log "done"
