#!/usr/bin/env bash
# The engine plugins against the real SGLang and vLLM, on a CPU machine.
#
# Builds (once) a Python 3.11 virtual environment with sglang 0.5.23 and vllm 0.33.0 installed
# without their GPU dependencies, plus the pure-Python packages their modules import, with
# flashinfer-python 0.7.4 and torch 2.14.1 + torchvision 0.29.1 (a CUDA build that runs CPU
# tensors; the registry's torchvision does not load beside a CPU-only torch): the list is
# .ci/engines-requirements.txt, the versions .ci/engines-constraints.txt. Then installs this
# checkout into it (editable, so the entry points are this checkout's) and runs the tests marked
# `engines`. Exits non-zero if the environment cannot be built, if the engines are not the
# versions the tests were written for, or if a test fails.
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
VLLM=0.33.0
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

set +e
PYTHONPATH="$repo" "$venv/bin/python" -m pytest -m engines -p no:cacheprovider \
  -W ignore::FutureWarning -W ignore::UserWarning \
  tests/test_integrations_sglang.py tests/test_integrations_vllm.py
rc=$?
set -e
echo "engines: done in $(( $(date +%s) - started )) s (pytest exit $rc)"
# No test collected (exit 5) means the engine tests did not run: that is a failure here.
exit "$rc"
