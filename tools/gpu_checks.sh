#!/usr/bin/env bash
# What a CUDA GPU adds to `make test` and to the CPU benchmarks, in one command:
#
#   1. tests: the Triton kernels compiled and run on the GPU against float64 references, the layers
#      through them (tests/kernels), and the mixed-precision tests that need CUDA;
#   2. timings, CUDA only, each written as JSON rows:
#      - norms.json: every layer's forward + backward (tools/benchmark_norms.py);
#      - pretrain_fp32.json, pretrain_amp.json: a ResNet-50 pretraining step at 224 px, 32 images per GPU
#        (256 over 8), fp32 and with AMP, and the hours per ImageNet epoch at that speed; plus one loader
#        worker on this machine's CPU, on synthetic 500 x 375 JPEGs (tools/benchmark_pretrain.py);
#      - train.json: a Mask R-CNN R50-FPN training step and inference at 2 images of 800 px per GPU, the
#        SN paper's detection setting, on images of the embedded detection set, generated on first use
#        (tools/benchmark_train.py).
#
#     tools/gpu_checks.sh OUTDIR        # PYTHON=... picks the interpreter (default: python)
#
# Needs torch with CUDA, Triton 3 or newer, detectron2 and pytest (pytest-xdist is used where installed).
# Every step runs, with a time limit, whatever the previous ones gave; the log is OUTDIR/gpu_checks.log,
# and the exit status is that of the first step that failed.
set -uo pipefail

out=${1:?usage: tools/gpu_checks.sh OUTDIR}
py=${PYTHON:-python}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$out"
log="$out/gpu_checks.log"
status=0
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run COMMAND from the repository root, logged, within SECONDS
  local name=$1 seconds=$2 start=$SECONDS rc
  shift 2
  echo "=== $name" | tee -a "$log"
  (cd "$repo" && timeout "$seconds" "$@") 2>&1 | tee -a "$log"
  rc=$?
  echo "=== $name: exit $rc, $((SECONDS - start)) s" | tee -a "$log"
  [ "$status" -ne 0 ] || status=$rc
}

if ! "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "torch sees no CUDA device: nothing to check here" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$log"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$log"

workers=$("$py" -c "import xdist, os; print(min(8, os.cpu_count()))" 2>/dev/null)
step kernels 180 "$py" -m pytest -q ${workers:+-n $workers} tests/kernels
step "cuda tests" 120 "$py" -m pytest -q ${workers:+-n $workers} -k cuda tests/d2/test_mixed_precision.py tests/d2/test_trainers.py

jpegs=$(mktemp -d)
step jpegs 60 "$py" - "$jpegs/train/synthetic" <<'EOF'
# 220 synthetic 500 x 375 JPEGs (ImageNet's most common size): smooth colour fields with noise
import os, sys
import numpy as np
from PIL import Image
folder = sys.argv[1]
os.makedirs(folder)
os.makedirs(folder.replace("/train/", "/val/"))  # the ImageFolder layout wants a val split too
rng = np.random.default_rng(0)
y, x = np.mgrid[0:375, 0:500] / 100.0
for i in range(220):
    phases = rng.uniform(0, 6.3, (3, 1, 1))
    field = 128 + 80 * np.sin(x * rng.uniform(0.5, 3) + y * rng.uniform(0.5, 3) + phases)
    pixels = np.clip(field + rng.normal(0, 20, field.shape), 0, 255).astype(np.uint8).transpose(1, 2, 0)
    Image.fromarray(pixels).save(os.path.join(folder, f"{i}.jpg"), quality=90)
EOF
for precision in fp32 amp; do
  amp=$([ $precision = amp ] && echo True || echo False)
  step "pretrain $precision" 150 "$py" tools/benchmark_pretrain.py --norms BN,GN,SN,DN,MGN --devices 8 --rounds 20 \
    --data "$jpegs" --json "$out/pretrain_$precision.json" MODEL.DEVICE cuda PRETRAIN.AMP $amp
done
rm -rf "$jpegs"

step norms 150 "$py" tools/benchmark_norms.py --device cuda --repeats 20 --json "$out/norms.json"

step train 400 "$py" tools/benchmark_train.py --config-file configs/mask_rcnn_gn_2x.yaml --norms GN,SN,DN,MGN,FrozenBN \
  --rounds 10 --json "$out/train.json" MODEL.DEVICE cuda DATASETS.TRAIN '("sn_shapes_train",)' SOLVER.IMS_PER_BATCH 2 \
  INPUT.MASK_FORMAT bitmask

echo "gpu_checks: exit $status (log: $log)"
exit $status
