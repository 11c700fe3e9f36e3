#!/usr/bin/env bash
# Deploy recipe: tune once on a build machine, ship one JSON bundle, import it on the fleet.
#
#   MODEL=/models/Llama-3.1-70B-Instruct-FP4 TP=8 bash examples/deploy_recipe.sh
#
# The build machine must match the fleet: same GPU kind and the same versions of torch, CUDA,
# flashinfer and fp4select (decisions are keyed on all of them; `fp4select doctor` prints
# them). Without MODEL the recipe runs on a small made-up Llama config, so it can be tried
# anywhere, a CPU included. BUILD_CACHE and FLEET_CACHE stand for the two machines' caches.
set -euo pipefail
PY=${PYTHON:-python3}
FP4="$PY -m fp4select"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -z "${MODEL:-}" ]; then
  MODEL=$WORK/tiny-llama
  mkdir -p "$MODEL"
  cat > "$MODEL/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
 "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "head_dim": 64}
JSON
fi
TP=${TP:-1}
MAX_M=${MAX_M:-8192}      # the largest batch (tokens) the server will run
BUNDLE=${BUNDLE:-$WORK/fp4select-bundle.json}
DEVICES=${DEVICES:-}      # "all" on a multi-GPU build machine: keys split over its GPUs

echo "== build machine: what will be tuned (one tensor-parallel rank's FP4 layers)"
FP4SELECT_CACHE_DIR=${BUILD_CACHE:-$WORK/build} $FP4 warm --model "$MODEL" --tp "$TP" \
  --max-m "$MAX_M" --dry-run

echo "== build machine: tune and write the bundle"
FP4SELECT_CACHE_DIR=${BUILD_CACHE:-$WORK/build} $FP4 warm --model "$MODEL" --tp "$TP" \
  --max-m "$MAX_M" ${DEVICES:+--devices "$DEVICES"} --export "$BUNDLE" --quiet

echo "== fleet machine: which entries apply here (another GPU or version would be listed)"
$PY - "$BUNDLE" <<'PY'
import sys, torch
from fp4select.bundle import applicability
from fp4select.keys import environment_for
device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
report = applicability(sys.argv[1], environment_for(device))
print(f"{report['apply']} of {report['entries']} entries apply here")
for why, count in report["reasons"].items():
    print(f"  {count} do not: {why}")
PY

echo "== fleet machine: import, then check that nothing is left to tune (each entry is proven here)"
FP4SELECT_CACHE_DIR=${FLEET_CACHE:-$WORK/fleet} $FP4 import "$BUNDLE"
FP4SELECT_CACHE_DIR=${FLEET_CACHE:-$WORK/fleet} $FP4 warm --model "$MODEL" --tp "$TP" \
  --max-m "$MAX_M" --json > "$WORK/fleet.json"
$PY - "$WORK/fleet.json" <<'PY'
import json, sys
stats = json.load(open(sys.argv[1]))["stats"]
# A decision received from elsewhere is proven here (its winner validated alone) on first use.
read = stats["disk_hits"] + stats["proofs"]
print(f"tuned on the fleet: {stats['tunings']}, read from the bundle: {read} "
      f"({stats['proofs']} proven here first)")
sys.exit(1 if stats["tunings"] else 0)
PY

# Later: record the keys production really meets, and tune exactly those next time.
#   FP4SELECT_RECORD=/var/tmp/fp4select-record.jsonl <your serve command>
#   fp4select warm --from-record /var/tmp/fp4select-record.jsonl --export "$BUNDLE"
