# Each target sets up (or reuses) the reference-stack environment, then runs. See README.md.
SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c
.PHONY: env demo test

env:
	tools/setup_env.sh

# Train the demo, then write what its norms chose (OUTPUT_DIR/norm_analysis) and its predictions on
# val images (OUTPUT_DIR/demo) for the model it trained; each step prints where its files are.
demo:
	py=$$(tools/setup_env.sh)
	$$py tools/train_net.py --config-file configs/demo_mask_rcnn_sn.yaml
	$$py tools/analyze_norms.py --config-file configs/demo_mask_rcnn_sn.yaml
	$$py tools/demo.py --config-file configs/demo_mask_rcnn_sn.yaml

test:
	py=$$(tools/setup_env.sh)
	$$py -m pytest tests
