#!/usr/bin/env bash
# Creates (or reuses) a small virtual environment with the linter of requirements-lint.txt (ruff) and
# prints its ruff on stdout; all else goes to stderr. `make test` runs it before the test suite:
#
#     ruff=$(tools/setup_lint_env.sh) && $ruff check && $ruff format --check
#
# Its own environment, not the reference stack's: it builds in seconds, so a lint error shows before the
# stacks are built, and a new ruff pin leaves the reference stack's cache alone. Python 3.10 is looked up
# as for the reference stack (tools/setup_env.sh); the environment lives in $SN_DETECTION_LINT_VENV, by
# default in the user cache under a name that hashes the pin and the interpreter (tools/cached_venv.sh).
set -euo pipefail

tools=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$tools/cached_venv.sh"
python=$(cached_venv 3.10 "$tools/../requirements-lint.txt" PYTHON SN_DETECTION_LINT_VENV lint-venv \
  "the linter" "under a minute" no)
echo "$(dirname "$python")/ruff"
