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
# pin reuses it. The first build installs a CUDA build of torch and its CUDA libraries: several GB.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
requirements="$repo/requirements-kernels.txt"

is_python311() {
  "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' >/dev/null 2>&1
}

find_python() {
  if [ -n "${KERNEL_PYTHON:-}" ]; then
    if ! "$KERNEL_PYTHON" -c 'import sys' >/dev/null 2>&1; then
      echo "error: KERNEL_PYTHON=$KERNEL_PYTHON is not a working Python interpreter" >&2
      return 1
    fi
    is_python311 "$KERNEL_PYTHON" || echo "warning: KERNEL_PYTHON=$KERNEL_PYTHON is not CPython 3.11; the pinned stack may not install" >&2
    echo "$KERNEL_PYTHON"
    return
  fi
  # A pyenv shim can be on PATH and still fail to run, so each candidate is tried, not just found.
  if command -v python3.11 >/dev/null 2>&1 && is_python311 python3.11; then
    command -v python3.11
    return
  fi
  local pyenv_root candidate
  pyenv_root=$( (command -v pyenv >/dev/null 2>&1 && pyenv root) || echo "$HOME/.pyenv")
  for candidate in "$pyenv_root"/versions/3.11.*/bin/python3.11; do
    if [ -x "$candidate" ] && is_python311 "$candidate"; then
      echo "$candidate"
      return
    fi
  done
  echo "error: CPython 3.11 not found (tried \$KERNEL_PYTHON, python3.11 on PATH, $pyenv_root/versions/3.11.*)." >&2
  echo "       Install it (e.g. 'pyenv install 3.11') or run with KERNEL_PYTHON=/path/to/python3.11." >&2
  return 1
}

python=$(find_python)
stack_id=$( (cat "$requirements"; "$python" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-12)
venv=${SN_DETECTION_KERNEL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/sn_detection/kernel-venv-$stack_id}
mkdir -p "$(dirname "$venv")"

# The lock keeps two concurrent runs from building the same environment twice; the `.complete` stamp
# tells a finished environment from one a killed build left half-made.
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  echo "setting up the kernel-test stack in $venv (first run only: several minutes, several GB)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade "pip" "setuptools<81" wheel >&2
  "$venv/bin/python" -m pip install --quiet -r "$requirements" >&2
  touch "$venv/.complete"
fi
# Editable and without dependencies: quick, and points the environment at this checkout.
"$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$repo" >&2
flock -u 9
echo "$venv/bin/python"
