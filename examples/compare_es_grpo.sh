#!/usr/bin/env bash
# ES vs GRPO on countdown with the tiny local model, then a report comparing them.
# This is how docs/report/ was made. Run from the repository root with vrl installed.
set -euo pipefail
runs=${RUNS_DIR:-runs}
iterations=${ITERATIONS:-8}
vrl train --optimizer es --iterations "$iterations" --name compare-es --set logging.runs_dir="$runs"
vrl train --optimizer grpo --iterations "$iterations" --name compare-grpo --set logging.runs_dir="$runs"
vrl report "$runs/compare-es" "$runs/compare-grpo" --out "${OUT:-report}"
