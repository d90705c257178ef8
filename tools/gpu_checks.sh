#!/usr/bin/env bash
# What a CUDA GPU adds to `make test` and to the CPU benchmarks, in one command, step by step. Each step's
# commands run under a time limit each (`step NAME SECONDS ...` below); the header gives each step's
# limits, which bound how long it takes. The steps' times in this form have not been measured on a GPU:
# the log has each command's ("=== NAME: exit STATUS, N s").
#
#   tests     (at most 5 min 30 s: 240 + 90 s) the Triton kernels compiled and run on the GPU against
#             float64 references, the layers through them, the direct launch of the compiled kernels
#             against Triton's JIT, host synchronisations and CUDA-graph capture (tests/kernels);
#             pretraining's graphed step against eager training (PRETRAIN.CUDA_GRAPH) and the graphed
#             backbone against the eager one; then the mixed-precision and trainer tests that need CUDA;
#   counts    (at most 2 min 30 s: 90 + 60 s) every layer's kernel launches and syncs per training step,
#             with the profiler's kernel count beside them, the host's work of a training step and an
#             evaluation forward with the Triton launches skipped (counts.json; tools/count_launches.py
#             --host-time); then each layer's step with Triton's ordinary launch path and the direct
#             launch, side by side (launch.json; tools/benchmark_launch.py);
#   norms     (at most 2 min 30 s: 90 + 60 s) SN's, DN's and MGN's forward + backward at the four
#             detection shapes beside torch's GroupNorm, fp32 with a profile of one step of each, then
#             under AMP (norms.json, norms_amp.json; tools/benchmark_norms.py);
#   train     (at most 5 min: 150 + 150 s) a Mask R-CNN R50-FPN training step and inference at 2 images
#             of 800 px, the SN paper's setting, GN, SN, DN and MGN everywhere (train.json); then at 2
#             images of 1024 x 1024, the large-scale-jitter recipe with AMP, GN and SN with the backbone
#             and FPN replayed as CUDA graphs and GN without (train_lsj.json; tools/benchmark_train.py
#             --graphed-backbone); on the embedded detection set (generated on first use);
#   inference (at most 5 min: 150 + 150 s) every norm's inference as built and folded (d2.fold_norms), the
#             backbone + FPN and the whole Mask R-CNN at 2 images of 800 x 1088 px, beside GN
#             (inference.json); then the folded models exported to ONNX and run by onnxruntime's CUDA
#             provider (inference_onnx.json; tools/benchmark_inference.py), where onnxruntime-gpu is
#             installed (the log says when it is not, and that part waits);
#   pretrain  (at most 1 min 30 s: 90 s) a ResNet-50 pretraining step at 224 px, 32 images per GPU (256
#             over 8), BN and SN, eager and captured in a CUDA graph (NORM+graph), fp32, and the hours per
#             ImageNet epoch at that speed (pretrain.json; tools/benchmark_pretrain.py --cuda-graph).
#
#     tools/gpu_checks.sh OUTDIR [STEP...]     # default: every step; PYTHON=... picks the interpreter
#
# Every step runs whatever the previous ones gave; the log is OUTDIR/gpu_checks.log, and the exit status is
# that of the first step that failed.
#
# Needs torch with CUDA, Triton 3 or newer, detectron2, pytest and pytest-xdist. On a machine without
# detectron2 and without a registry, carry what tools/gpu_carry.sh assembles here, in .gpu/, and run
#
#     export PYTHONPATH=$PWD/.gpu/site:$PWD SN_DETECTION_DATA=$PWD/.gpu/data; tools/gpu_checks.sh OUTDIR STEP...
set -uo pipefail

out=${1:?usage: tools/gpu_checks.sh OUTDIR [tests|counts|norms|train|inference|pretrain ...]}
shift
steps=${*:-tests counts norms train inference pretrain}
for name in $steps; do
  case $name in tests|counts|norms|train|inference|pretrain) ;; *) echo "unknown step '$name': tests, counts, norms, train, inference or pretrain" >&2; exit 2;; esac
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
(cd "$repo" && git log -1 --format='commit %h %cd' --date=iso 2>/dev/null) | tee -a "$log"
workers=$("$py" -c "import xdist, os; print(min(16, os.cpu_count()))" 2>/dev/null)
# the detection settings run on the embedded detection set (generated on first use, or carried)
detection=(DATASETS.TRAIN '("sn_shapes_train",)' SOLVER.IMS_PER_BATCH 2 INPUT.MASK_FORMAT bitmask)
lsj=(dataloader.train.dataset.names=sn_shapes_train dataloader.train.total_batch_size=2
     dataloader.train.mapper.instance_mask_format=bitmask)

if wanted tests; then
  step "cuda tests" 240 "$py" -m pytest -q ${workers:+-n $workers --dist loadfile} tests/kernels \
    tests/d2/test_graphed_backbone.py tests/pretraining/test_graph_sgd.py tests/pretraining/test_graphed_pretraining_cuda.py
  step "cuda amp" 90 "$py" -m pytest -q ${workers:+-n $workers} -k cuda tests/d2/test_mixed_precision.py \
    tests/d2/test_trainers.py
fi
if wanted counts; then
  step counts 90 "$py" tools/count_launches.py --device cuda --host-time --rounds 10 --json "$out/counts.json"
  step "direct launch" 60 "$py" tools/benchmark_launch.py --rounds 10 --json "$out/launch.json"
fi
if wanted norms; then
  step norms 90 "$py" tools/benchmark_norms.py --device cuda --norms SN,DN,MGN --repeats 10 --profile \
    --json "$out/norms.json"
  step "norms amp" 60 "$py" tools/benchmark_norms.py --device cuda --norms SN,DN,MGN --amp --repeats 10 \
    --json "$out/norms_amp.json"
fi
if wanted train; then
  step train 150 "$py" tools/benchmark_train.py --config-file configs/mask_rcnn_gn_2x.yaml --norms GN,SN,DN,MGN \
    --rounds 6 --json "$out/train.json" MODEL.DEVICE cuda "${detection[@]}"
  step "train lsj" 150 "$py" tools/benchmark_train.py --config-file configs/lazy/mask_rcnn_sn_lsj_100ep.py \
    --norms GN,SN --graphed-backbone --rounds 6 --json "$out/train_lsj.json" train.device=cuda "${lsj[@]}"
fi
if wanted inference; then
  step inference 150 "$py" tools/benchmark_inference.py --parts backbone,mask_rcnn --size 800,1088 --rounds 5 \
    --json "$out/inference.json" MODEL.DEVICE cuda
  if "$py" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
    step "inference onnx" 150 "$py" tools/benchmark_inference.py --parts onnx --norms GN,SN,SSN,DN,FrozenBN \
      --size 800,1088 --rounds 5 --json "$out/inference_onnx.json" MODEL.DEVICE cuda
  else
    echo "=== inference onnx: not run: this Python's onnxruntime has no CUDAExecutionProvider (onnxruntime-gpu)" | tee -a "$log"
  fi
fi
if wanted pretrain; then
  step pretrain 90 "$py" tools/benchmark_pretrain.py --norms BN,SN --devices 8 --rounds 6 --cuda-graph \
    --json "$out/pretrain.json" MODEL.DEVICE cuda
fi

echo "gpu_checks: exit $status (log: $log)"
exit $status
