#!/usr/bin/env bash
# ES vs GRPO on the built-in `letters` environment with the tiny local model (each with the
# environment's suggested settings), then a report comparing them. This is how docs/report/ was
# made. Run from the repository root with vrl installed; PLUGIN=countdown compares on countdown.
set -euo pipefail
runs=${RUNS_DIR:-runs}
iterations=${ITERATIONS:-12}
plugin=${PLUGIN:-letters}
vrl train --plugin "$plugin" --optimizer es --iterations "$iterations" --name compare-es --set logging.runs_dir="$runs"
vrl train --plugin "$plugin" --optimizer grpo --iterations "$iterations" --name compare-grpo --set logging.runs_dir="$runs"
vrl report "$runs/compare-es" "$runs/compare-grpo" --out "${OUT:-report}"
