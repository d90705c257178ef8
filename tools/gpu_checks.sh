#!/usr/bin/env bash
# What a CUDA GPU adds to `make test` and to the CPU benchmarks, in one command:
#
#   tests     the Triton kernels compiled and run on the GPU against float64 references, the layers
#             through them, the fused path, host synchronisations and CUDA-graph capture (tests/kernels),
#             and the mixed-precision tests that need CUDA;
#   counts    every layer's kernel launches and syncs per training step, with the profiler's kernel count
#             beside them, and the host's work of the step with its Triton launches skipped
#             (counts.json; tools/count_launches.py --host-time);
#   norms     every layer's forward + backward, fp32 and under AMP, with a profile of one step of each
#             (norms.json, norms_amp.json; tools/benchmark_norms.py);
#   train     a Mask R-CNN R50-FPN training step and inference at 2 images of 800 px per GPU, the SN paper's
#             detection setting, on images of the embedded detection set, generated on first use
#             (train.json; tools/benchmark_train.py);
#   pretrain  a ResNet-50 pretraining step at 224 px, 32 images per GPU (256 over 8), fp32 and with AMP, and
#             the hours per ImageNet epoch at that speed (pretrain_fp32.json, pretrain_amp.json;
#             tools/benchmark_pretrain.py).
#
#     tools/gpu_checks.sh OUTDIR [STEP...]     # default: every step; PYTHON=... picks the interpreter
#
# Needs torch with CUDA, Triton 3 or newer, detectron2 and pytest (pytest-xdist is used where installed).
# Every step runs, with a time limit, whatever the previous ones gave; the log is OUTDIR/gpu_checks.log,
# and the exit status is that of the first step that failed.
set -uo pipefail

out=${1:?usage: tools/gpu_checks.sh OUTDIR [tests|counts|norms|train|pretrain ...]}
shift
steps=${*:-tests counts norms train pretrain}
for name in $steps; do
  case $name in tests|counts|norms|train|pretrain) ;; *) echo "unknown step '$name': tests, counts, norms, train or pretrain" >&2; exit 2;; esac
done
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

wanted() { [[ " $steps " == *" $1 "* ]]; }

if ! "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "torch sees no CUDA device: nothing to check here" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$log"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$log"
workers=$("$py" -c "import xdist, os; print(min(16, os.cpu_count()))" 2>/dev/null)

if wanted tests; then
  step kernels 240 "$py" -m pytest -q ${workers:+-n $workers} tests/kernels
  step "cuda tests" 120 "$py" -m pytest -q ${workers:+-n $workers} -k cuda tests/d2/test_mixed_precision.py tests/d2/test_trainers.py
fi
if wanted counts; then
  step counts 120 "$py" tools/count_launches.py --device cuda --host-time --json "$out/counts.json"
fi
if wanted norms; then
  step norms 150 "$py" tools/benchmark_norms.py --device cuda --repeats 20 --profile --json "$out/norms.json"
  step "norms amp" 150 "$py" tools/benchmark_norms.py --device cuda --amp --repeats 20 --json "$out/norms_amp.json"
fi
if wanted train; then
  step train 300 "$py" tools/benchmark_train.py --config-file configs/mask_rcnn_gn_2x.yaml --norms GN,SN,DN,MGN,FrozenBN \
    --rounds 8 --json "$out/train.json" MODEL.DEVICE cuda DATASETS.TRAIN '("sn_shapes_train",)' SOLVER.IMS_PER_BATCH 2 \
    INPUT.MASK_FORMAT bitmask
fi
if wanted pretrain; then
  for precision in fp32 amp; do
    amp=$([ $precision = amp ] && echo True || echo False)
    step "pretrain $precision" 120 "$py" tools/benchmark_pretrain.py --norms BN,GN,SN,DN,MGN --devices 8 --rounds 10 \
      --json "$out/pretrain_$precision.json" MODEL.DEVICE cuda PRETRAIN.AMP $amp
  done
fi

echo "gpu_checks: exit $status (log: $log)"
exit $status
