#!/usr/bin/env bash
# Creates (or reuses) a virtual environment with the reference stack of requirements.txt, installs
# sn_detection into it (editable), and prints the environment's python on stdout; all else goes to stderr.
#
# Python 3.10 is looked up as: $PYTHON, then python3.10 on PATH, then pyenv's 3.10.*.
# The environment lives in $SN_DETECTION_VENV, by default in the user cache under a name that hashes the
# pinned requirements and the interpreter, so a changed pin builds a new one and an unchanged pin reuses it.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
requirements="$repo/requirements.txt"

is_python310() {
  "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' >/dev/null 2>&1
}

find_python() {
  if [ -n "${PYTHON:-}" ]; then
    if ! "$PYTHON" -c 'import sys' >/dev/null 2>&1; then
      echo "error: PYTHON=$PYTHON is not a working Python interpreter" >&2
      return 1
    fi
    is_python310 "$PYTHON" || echo "warning: PYTHON=$PYTHON is not CPython 3.10; the pinned stack may not install" >&2
    echo "$PYTHON"
    return
  fi
  # A pyenv shim can be on PATH and still fail to run, so each candidate is tried, not just found.
  if command -v python3.10 >/dev/null 2>&1 && is_python310 python3.10; then
    command -v python3.10
    return
  fi
  local pyenv_root candidate
  pyenv_root=$( (command -v pyenv >/dev/null 2>&1 && pyenv root) || echo "$HOME/.pyenv")
  for candidate in "$pyenv_root"/versions/3.10.*/bin/python3.10; do
    if [ -x "$candidate" ] && is_python310 "$candidate"; then
      echo "$candidate"
      return
    fi
  done
  echo "error: CPython 3.10 not found (tried \$PYTHON, python3.10 on PATH, $pyenv_root/versions/3.10.*)." >&2
  echo "       Install it (e.g. 'pyenv install 3.10') or run with PYTHON=/path/to/python3.10." >&2
  return 1
}

python=$(find_python)
stack_id=$( (cat "$requirements"; "$python" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-12)
venv=${SN_DETECTION_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/sn_detection/venv-$stack_id}
mkdir -p "$(dirname "$venv")"

# The lock keeps a concurrent `make demo` and `make test` from building the same environment twice;
# the `.complete` stamp tells a finished environment from one a killed build left half-made.
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  echo "setting up the reference stack in $venv (first run only: a few minutes)" >&2
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
