#!/usr/bin/env bash
# The engine plugins against the real SGLang and vLLM, on a CPU machine.
#
# Builds (once) a Python 3.11 virtual environment with sglang 0.5.23 and vllm 0.34.0 installed
# without their GPU dependencies, plus the pure-Python packages their modules import, with
# flashinfer-python 0.7.4 and torch 2.14.1 + torchvision 0.29.1 (a CUDA build that runs CPU
# tensors; the registry's torchvision does not load beside a CPU-only torch): the list is
# .ci/engines-requirements.txt, the versions .ci/engines-constraints.txt. Then installs this
# checkout into it (editable, so the entry points are this checkout's) and runs the tests marked
# `engines`. The vLLM tests then run once more for each earlier vLLM the plugin still claims
# (VLLM_EARLIER), installed without dependencies into a folder beside the environment that goes
# first on PYTHONPATH, as .ci/run's oldest-flashinfer step does. Exits non-zero if the
# environment cannot be built, if the engines are not the versions the tests were written for,
# or if a test fails.
#
#   FP4SELECT_ENGINES_VENV    where the environment lives (default .venv-engines in this
#                             clone, which .gitignore leaves out); it takes about 8.5 GB of
#                             disk, plus its build log beside it (<venv>.build.log)
#   FP4SELECT_ENGINES_PYTHON  the interpreter to build it with (default python3.11)
#
# A second run reuses the environment while the requirements and pins below are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

SGLANG=0.5.23
VLLM=0.34.0
VLLM_EARLIER=(0.33.0)
venv=${FP4SELECT_ENGINES_VENV:-$repo/.venv-engines}
python=${FP4SELECT_ENGINES_PYTHON:-python3.11}
requirements=.ci/engines-requirements.txt
constraints=.ci/engines-constraints.txt
started=$(date +%s)

stamp_of() {
  { cat "$requirements" "$constraints"; echo "sglang==$SGLANG vllm==$VLLM"; "$python" --version; } | sha256sum | cut -d' ' -f1
}

if ! command -v "$python" >/dev/null; then
  echo "engines: $python not found (set FP4SELECT_ENGINES_PYTHON)" >&2
  exit 1
fi
want=$(stamp_of)
log="$venv.build.log"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.fp4select-stamp" 2>/dev/null)" != "$want" ]; then
  echo "engines: building $venv (several minutes; log in $log)"
  rm -f "$venv/.fp4select-stamp"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  {
    "$venv/bin/python" -m pip install -q -r "$requirements" -c "$constraints" &&
      "$venv/bin/python" -m pip install -q --no-deps "sglang==$SGLANG" "vllm==$VLLM"
  } >"$log" 2>&1 || {
    grep -v "is ignored: it is neither" "$log" | tail -40 >&2
    echo "engines: building the environment failed (full log: $log)" >&2
    exit 1
  }
  echo "$want" >"$venv/.fp4select-stamp"
fi
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$repo" >"$log.fp4select" 2>&1 || {
  tail -20 "$log.fp4select" >&2
  exit 1
}

# The tests skip when an engine is missing; here a missing engine is a failure, not a skip.
"$venv/bin/python" - "$SGLANG" "$VLLM" "$repo" <<'EOF'
import importlib.metadata as md
import os
import sys

sglang, vllm, repo = sys.argv[1:]
found = {d: md.version(d) for d in ("sglang", "vllm")}
if found != {"sglang": sglang, "vllm": vllm}:
    sys.exit(f"engines: expected sglang {sglang} and vllm {vllm}, found {found}")
import fp4select

here = os.path.realpath(os.path.dirname(fp4select.__file__))
if not here.startswith(os.path.realpath(repo) + os.sep):
    sys.exit(f"engines: fp4select comes from {here}, not from this checkout {repo}")
EOF
echo "engines: environment ready in $(( $(date +%s) - started )) s"

# An earlier vLLM, installed once into its own folder: the path of that folder.
earlier_vllm() {
  local version=$1 folder="$venv.vllm-$1"
  if [ ! -f "$folder/.fp4select-done" ]; then
    rm -rf "$folder"
    "$venv/bin/python" -m pip install -q --no-deps --target "$folder" "vllm==$version" \
      >>"$log" 2>&1 || return 1
    touch "$folder/.fp4select-done"
  fi
  echo "$folder"
}

# Runs the engine tests with $1 first on PYTHONPATH (may be empty); checks first that vllm $2 is
# the one imported. No test collected (pytest's exit 5) means they did not run: a failure here.
run_tests() {
  local path="$1${1:+:}$repo" want=$2
  shift 2
  PYTHONPATH="$path" "$venv/bin/python" -c '
import importlib.metadata as md, sys
found = md.version("vllm")
sys.exit(None if found == sys.argv[1] else f"engines: expected vllm {sys.argv[1]}, found {found}")
' "$want" || return 1
  PYTHONPATH="$path" "$venv/bin/python" -m pytest -m engines -p no:cacheprovider \
    -W ignore::FutureWarning -W ignore::UserWarning "$@"
}

set +e
run_tests "" "$VLLM" tests/test_integrations_sglang.py tests/test_integrations_vllm.py
rc=$?
for version in "${VLLM_EARLIER[@]}"; do
  echo "engines: the vLLM tests with vllm $version"
  if folder=$(earlier_vllm "$version"); then
    run_tests "$folder" "$version" tests/test_integrations_vllm.py
    earlier=$?
  else
    echo "engines: installing vllm $version failed (log: $log)" >&2
    earlier=1
  fi
  [ "$rc" -eq 0 ] && rc=$earlier
done
set -e
echo "engines: done in $(( $(date +%s) - started )) s (exit $rc)"
exit "$rc"
