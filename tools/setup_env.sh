#!/usr/bin/env bash
# Creates (or reuses) a virtual environment with the reference stack of requirements.txt, installs
# sn_detection into it (editable), and prints the environment's python on stdout; all else goes to stderr.
#
# Python 3.10 is looked up as: $PYTHON, then python3.10 on PATH, then pyenv's 3.10.*.
# The environment lives in $SN_DETECTION_VENV, by default in the user cache under a name that hashes the
# pinned requirements and the interpreter, so a changed pin builds a new one and an unchanged pin reuses it
# (tools/cached_venv.sh).
set -euo pipefail

tools=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$tools/cached_venv.sh"
cached_venv 3.10 "$tools/../requirements.txt" PYTHON SN_DETECTION_VENV venv \
  "the reference stack" "a few minutes"
