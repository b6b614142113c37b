#!/usr/bin/env bash
# Calibration on a GPU machine: measure, fit, validate (README "Calibration"), in as few device
# calls as the lease allows. Everything it writes goes under OUT, bundled so that at most a few
# files come back.
#
#   tools/gpu_calibrate.sh OUT measure            # microbenchmarks + fit -> OUT/raw.parquet, OUT/profile.yaml
#   tools/gpu_calibrate.sh OUT validate MODE PROFILE
#                                                 # both models, expert_compute MODE (layer|per-expert)
#                                                 # -> OUT/val-MODE.tar.gz (traces, reports, per-pass times);
#                                                 # per-expert launches eagerly (calibrate validate --launch auto,
#                                                 # validation/h200/report.md)
#
# Environment: DEVICE (cuda), TOKENS (decode tokens per trace, 200), PROMPT (prefill tokens, 64),
# OLMOE_LAYERS (the preset's 16 unless set), MIXTRAL_LAYERS (4), QUICK (set: --quick measure, for a
# CPU rehearsal), SHAPES (olmoe-1b-7b,mixtral-8x7b).
set -euo pipefail
out=$1; step=$2
dev=${DEVICE:-cuda}; tokens=${TOKENS:-200}; prompt=${PROMPT:-64}
mkdir -p "$out"
moesim() { python3 -m moesim "$@"; }
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

case $step in
measure)
  log "environment"; python3 -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no gpu')"
  log "measure"; moesim calibrate measure --device "$dev" --model-shapes "${SHAPES:-olmoe-1b-7b,mixtral-8x7b}" ${QUICK:+--quick} --out "$out/raw.parquet"
  log "fit"; moesim calibrate fit "$out/raw.parquet" --out "$out/profile.yaml"
  ;;
validate)
  mode=$3; profile=$4
  work=$(mktemp -d)
  mkdir -p "$work/val-$mode"
  moesim trace synth --preset olmoe-1b-7b ${OLMOE_LAYERS:+--layers $OLMOE_LAYERS} --tokens "$tokens" \
    --prompt-tokens "$prompt" --out "$work/val-$mode/olmoe.parquet"
  moesim trace synth --preset mixtral-8x7b --layers "${MIXTRAL_LAYERS:-4}" --tokens "$tokens" \
    --prompt-tokens "$prompt" --out "$work/val-$mode/mixtral.parquet"
  for model in olmoe mixtral; do
    log "validate $model, expert_compute $mode"
    moesim calibrate validate --profile "$profile" --trace "$work/val-$mode/$model.parquet" \
      --scenarios 'moesim/scenarios/validation/*.yaml' --set "expert_compute=$mode" --device "$dev" \
      --out "$work/val-$mode/$model"
    # bundled after each model, so a call stopped at its limit still brings the first back
    tar -C "$work" -czf "$out/val-$mode.tar.gz" "val-$mode"
  done
  ;;
*) echo "usage: $0 OUT measure | OUT validate MODE PROFILE" >&2; exit 2 ;;
esac
log "done"
