#!/usr/bin/env bash
# Assembles .gpu/ (git-ignored) on this machine: what tools/gpu_checks.sh needs on a GPU machine whose Python
# has torch and Triton but not detectron2, and that reaches no package registry:
#
#   .gpu/site   detectron2's Python files, taken from the reference environment (tools/setup_env.sh) without
#               its compiled _C (what gpu_checks.sh runs needs none: ROIAlign and NMS are torchvision's), and
#               its pure-Python needs at the reference stack's versions (fvcore, iopath, yacs, termcolor,
#               omegaconf, hydra-core, antlr4-python3-runtime), plus pycocotools' wheel for that Python;
#   .gpu/data   the embedded detection set (generated here first if needed), so the GPU does not wait for it.
#
#     tools/gpu_carry.sh [PYTHON_VERSION]      # the GPU machine's Python, default 3.12
#
# Then, from this checkout's root, on the GPU machine (the device tool: carry .gpu):
#
#     export PYTHONPATH=$PWD/.gpu/site:$PWD SN_DETECTION_DATA=$PWD/.gpu/data; tools/gpu_checks.sh OUTDIR STEP...
#
# Rerun it when requirements.txt changes; it replaces .gpu/ whole.
set -euo pipefail

version=${1:-3.12}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$("$repo/tools/setup_env.sh")
carry="$repo/.gpu"
staging=$(mktemp -d "$repo/.gpu.XXXXXX")
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging/site" "$staging/data" "$staging/wheels"

detectron2=$("$py" -c "import detectron2, os; print(os.path.dirname(detectron2.__file__))")
(cd "$(dirname "$detectron2")" && tar -cf - --exclude='__pycache__' --exclude='_C*.so' detectron2) | tar -xf - -C "$staging/site"

pure=(fvcore iopath yacs termcolor omegaconf hydra-core antlr4-python3-runtime)
pins=()
for name in "${pure[@]}" pycocotools; do
  pins+=("$("$py" -m pip freeze | grep -i "^${name}==")")
done
"$py" -m pip install --quiet --no-deps --no-compile --target "$staging/site" "${pins[@]:0:${#pure[@]}}" >&2
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$staging/wheels" "${pins[-1]}" >&2
"$py" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
  "$staging/site" "$staging"/wheels/*.whl
rm -rf "$staging/wheels"

SN_DETECTION_DATA="$staging/data" PYTHONPATH="$repo" "$py" -c \
  "from sn_detection.data.datasets import register_shapes_datasets; from detectron2.data import DatasetCatalog; \
register_shapes_datasets(); DatasetCatalog.get('sn_shapes_train'); DatasetCatalog.get('sn_shapes_val')" >&2

rm -rf "$carry"
mv "$staging" "$carry"
trap - EXIT
echo "$(du -sh "$carry" | cut -f1) in $carry" >&2
