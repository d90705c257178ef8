#!/usr/bin/env bash
# Creates (or reuses) a virtual environment with the kernel-test stack of requirements-kernels.txt
# (a recent PyTorch and Triton, whose interpreter runs the Triton kernels on the CPU), installs
# sn_detection into it (editable, without dependencies), and prints the environment's python on stdout;
# all else goes to stderr. Run the kernel tests with
#
#     TRITON_INTERPRET=1 $(tools/setup_kernel_env.sh) -m pytest tests/kernels -q
#
# Python 3.11 is looked up as: $KERNEL_PYTHON, then python3.11 on PATH, then pyenv's 3.11.*.
# The environment lives in $SN_DETECTION_KERNEL_VENV, by default in the user cache under a name that
# hashes the pinned requirements and the interpreter, so a changed pin builds a new one and an unchanged
# pin reuses it (tools/cached_venv.sh). The first build installs a CUDA build of torch and its CUDA
# libraries: several GB.
set -euo pipefail

tools=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$tools/cached_venv.sh"
cached_venv 3.11 "$tools/../requirements-kernels.txt" KERNEL_PYTHON SN_DETECTION_KERNEL_VENV kernel-venv \
  "the kernel-test stack" "several minutes, several GB"
