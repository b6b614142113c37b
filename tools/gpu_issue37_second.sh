#!/usr/bin/env bash
# Issue 37's second GPU call (after tools/gpu_issue37.sh found, on an H200, that the per-expert
# slowdown with more cache slots follows the number of distinct CUDA graphs, and that the
# software link's sleeps overshot 79 us a copy):
#   1. graphs' first launches (every graph replayed once before timing) vs graphs beside a second stream
#   2. SpecMD's drop-in again with the link's waits ending in a spin (hf_loop.Link.wait)
set -u
out=$1; mkdir -p "$out"
dev=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 NUMBA_DISABLE_JIT=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
log() { echo "[$(date +%H:%M:%S)] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$out/env2.txt"
log "slots, second"; timeout "${SLOTS_S:-120}" python3 tools/gpu_perexpert_slots.py "$out/slots2.csv" --second --device "$dev" --repeats 2 ${SMALL:+--tokens 3 --layers 2}
log "specmd, spin"; timeout "${SPECMD_S:-150}" python3 tools/gpu_specmd.py "$out/specmd2.csv" "$out/specmd_micro2.csv" --device "$dev" --repeats 1 ${SMALL:+--requests 1 --prompt 8 --layers 2}
log "done"
