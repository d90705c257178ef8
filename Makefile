# Each target sets up (or reuses) the reference-stack environment, then runs. See README.md.
SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c
.PHONY: env demo test

# The cached environments serve every checkout on the machine, and their editable install points at the
# last one set up: the targets import this checkout's package whichever that is.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

env:
	tools/setup_env.sh

# Pretrain the demo's SN backbone on the embedded classification set (first run only: cached), finetune
# the demo from it, then write what its norms chose (OUTPUT_DIR/norm_analysis) and its predictions on
# val images (OUTPUT_DIR/demo) for the model it trained; each step prints where its files are.
demo:
	py=$$(tools/setup_env.sh)
	backbone=$$($$py tools/pretrain_backbone.py --config-file configs/demo_mask_rcnn_sn.yaml --cached | tee /dev/stderr | tail -n 1)
	$$py tools/train_net.py --config-file configs/demo_mask_rcnn_sn.yaml MODEL.WEIGHTS $$backbone
	$$py tools/analyze_norms.py --config-file configs/demo_mask_rcnn_sn.yaml
	$$py tools/demo.py --config-file configs/demo_mask_rcnn_sn.yaml --class-agnostic-nms 0.5

# The linter and the formatter's check first (seconds, in an environment of their own), then the whole
# suite on the reference stack; then the Triton kernels, run by Triton's interpreter on the CPU
# in a second environment with current torch and Triton (the reference stack's Triton 2.3.1 cannot
# interpret them), with the layer tests that go through them there.
KERNEL_TESTS := tests/kernels tests/layers/test_moment_normalizer.py tests/layers/test_edge_cases.py \
	tests/layers/test_layer_export.py tests/layers/test_inference.py \
	tests/layers/test_numerics.py::test_fp32_is_as_accurate_as_batch_norm \
	tests/layers/test_call_plans.py::test_planned_calls_compute_what_a_layer_deciding_anew_computes

# Test files run in parallel, one per CPU core up to 4 (pytest-xdist; a file's tests stay on one worker,
# so a module fixture is built once); tests/conftest.py shares the cores between the workers' threads.
PARALLEL := --numprocesses auto --maxprocesses 4 --dist loadfile

test:
	ruff=$$(tools/setup_lint_env.sh)
	$$ruff check
	$$ruff format --check
	py=$$(tools/setup_env.sh)
	$$py -m pytest $(PARALLEL) tests
	kpy=$$(tools/setup_kernel_env.sh)
	TRITON_INTERPRET=1 $$kpy -m pytest $(PARALLEL) $(KERNEL_TESTS)
