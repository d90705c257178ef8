# Sourced by tools/setup_env.sh and tools/setup_kernel_env.sh: one cached virtual environment per pinned
# stack and interpreter, with sn_detection installed into it.
#
#     cached_venv VERSION REQUIREMENTS PYTHON_VARIABLE VENV_VARIABLE NAME LABEL DURATION [CHECKOUT]
#
# finds CPython VERSION (as $PYTHON_VARIABLE, then pythonVERSION on PATH, then pyenv's VERSION.*), creates
# or reuses the environment $VENV_VARIABLE, by default NAME-<hash> in the user cache, where the hash covers
# the pinned REQUIREMENTS and the interpreter (a changed pin builds a new one, an unchanged pin reuses it),
# installs this checkout into it (editable, without dependencies; CHECKOUT=no leaves it out, for a tools'
# environment) and prints its python on stdout; all else goes to stderr. LABEL and DURATION (how long a
# first build takes) make its progress message.

is_python_version() {
  "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$2'.split('.'))))" >/dev/null 2>&1
}

find_python() {
  local version=$1 variable=$2
  local chosen=${!variable:-}
  if [ -n "$chosen" ]; then
    if [ "$("$chosen" -c 'print("python")' 2>/dev/null)" != python ]; then
      echo "error: $variable=$chosen is not a working Python interpreter" >&2
      return 1
    fi
    is_python_version "$chosen" "$version" ||
      echo "warning: $variable=$chosen is not CPython $version; the pinned stack may not install" >&2
    echo "$chosen"
    return
  fi
  # A pyenv shim can be on PATH and still fail to run, so each candidate is tried, not just found.
  if command -v "python$version" >/dev/null 2>&1 && is_python_version "python$version" "$version"; then
    command -v "python$version"
    return
  fi
  local pyenv_root candidate
  pyenv_root=$( (command -v pyenv >/dev/null 2>&1 && pyenv root) || echo "$HOME/.pyenv")
  for candidate in "$pyenv_root"/versions/"$version".*/bin/python"$version"; do
    if [ -x "$candidate" ] && is_python_version "$candidate" "$version"; then
      echo "$candidate"
      return
    fi
  done
  echo "error: CPython $version not found (tried \$$variable, python$version on PATH, $pyenv_root/versions/$version.*)." >&2
  echo "       Install it (e.g. 'pyenv install $version') or run with $variable=/path/to/python$version." >&2
  return 1
}

cached_venv() {
  local version=$1 requirements=$2 python_variable=$3 venv_variable=$4 name=$5 label=$6 duration=$7
  local checkout=${8:-yes}
  local repo python stack_id venv
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  python=$(find_python "$version" "$python_variable")
  stack_id=$( (cat "$requirements"; "$python" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-12)
  venv=${!venv_variable:-${XDG_CACHE_HOME:-$HOME/.cache}/sn_detection/$name-$stack_id}
  mkdir -p "$(dirname "$venv")"

  # The lock keeps concurrent runs (`make demo` and `make test`, say) from building the same environment
  # twice; the `.complete` stamp tells a finished environment from one a killed build left half-made.
  exec 9>"$venv.lock"
  flock 9
  if [ ! -f "$venv/.complete" ]; then
    echo "setting up $label in $venv (first run only: $duration)" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade "pip" "setuptools<81" wheel >&2
    "$venv/bin/python" -m pip install --quiet -r "$requirements" >&2
    touch "$venv/.complete"
  fi
  # Editable and without dependencies: quick. It points the environment at this checkout until another
  # one is set up; the make targets put their own checkout first on PYTHONPATH.
  if [ "$checkout" != no ]; then
    "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$repo" >&2
  fi
  flock -u 9
  echo "$venv/bin/python"
}
