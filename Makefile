# Each target sets up (or reuses) the reference-stack environment, then runs. See README.md.
SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c
.PHONY: env demo test

env:
	tools/setup_env.sh

demo:
	py=$$(tools/setup_env.sh)
	$$py tools/train_net.py --config-file configs/demo_mask_rcnn_sn.yaml

test:
	py=$$(tools/setup_env.sh)
	$$py -m pytest tests
