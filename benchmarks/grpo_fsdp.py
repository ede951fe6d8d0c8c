"""GRPO under FSDP2: `vrl train` on one GPU against `torchrun --nproc-per-node N vrl train` at the same
global batch, as a user runs them (subprocesses), on countdown with a random bf16 Qwen2.5-shaped model.

    # 1.5B, 1 vs 2 GPUs (2 H100s; ~2 min a run, most of it start-up)
    python benchmarks/grpo_fsdp.py --ranks 1 2 --repeats 2 --out grpo_fsdp_2gpu_h100.json
    # 7B-shaped, 16 bytes/parameter of training state: N=1 is expected to run out of memory (2 H200s)
    python benchmarks/grpo_fsdp.py --shape 7b --ranks 1 2 --repeats 1 --iterations 3 \
        --set generator.vllm.gpu_memory_utilization=0.2 --out grpo_fsdp_7b_2gpu_h200.json
    # CPU dry run of the whole script: vrl's tiny model, the hf backend, 2 ranks over gloo
    python benchmarks/grpo_fsdp.py --small --ranks 1 2 --iterations 3 --new-tokens 64 --out /tmp/r.json

N=1 is the default trainer (`python -m vrl.cli train`, one process); N>1 is
`torchrun --standalone --nproc-per-node N -m vrl.cli train` with the same arguments: rank 0 samples
(`--backend`; vllm with generator.vllm.sleep=true) and every rank trains its FSDP2 shard. Every run
trains `--tasks` × `--generations` sequences per iteration whatever N, with no checkpoint but the
last (the policy alone at these sizes; deleted after each run). Runs go interleaved over `--repeats`.
From each run's metrics.jsonl, the first iteration left out as warm-up: `update_s` (rank 0's `tell`:
the batch's broadcast, forward, backward, AdamW, the weights' publish to the sampler), the sequences'
tokens (prompt + completion; prompts from samples.jsonl, tokenized as the generator does) and the loss
tokens (`grpo/trained_tokens`), and with `grpo.max_staleness` > 0 the waits `vrl.rollouts` logs
(`ASYNC_WAITS`). Reported per N: median update seconds, tokens/s, their ratio to N=1's (goal ≥ 1.8 at
N=2), MFU = 6 · params · tokens / update_s / (N · 989.4e12) (benchmarks/grpo_step.py's convention; GPU only), and the peak memory in use per GPU as nvidia-smi saw it every 0.5 s (vrl's
metrics carry no GPU memory; it includes vLLM's slept engine on GPU 0), with each GPU's memory and use
every 10 s (`gpu_every_10s`: a hung run shows which rank let go of its GPU). A failed run (an OOM) keeps
its stderr tail, and with `--verbose` (`vrl -v`) the failing rank's traceback too; every run's whole
stderr is kept in `<out>.<name>.stderr.log`; `--set KEY=VALUE` goes to every run. The script ends its
run in flight when it stops (an outer `timeout` included). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEAK_FLOPS = 989.4e12  # H100 SXM dense bf16
#: With asynchronous rollouts, the waits `vrl.rollouts` logs (docs/grpo.md): the trainer for its batch, the
#: sampler for its weights, and the update (inside `update_s`) for the pass in flight before its push.
ASYNC_WAITS = ("time/wait_for_rollouts_s", "time/wait_for_trainer_s", "time/publish_wait_s")


def model_facts(model: str) -> tuple[int, object]:
    """All parameters (embeddings included) and the tokenizer of `model`, without loading its weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from vrl.generate import tiny

    if model == "tiny":
        return sum(p.numel() for p in tiny.build_model().parameters()), tiny.build_tokenizer()
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(p.numel() for p in net.parameters()), AutoTokenizer.from_pretrained(model)


class GPUMemory(threading.Thread):
    """The most memory each GPU had in use while a run went (MiB), from nvidia-smi every 0.5 s, and every
    10 s what each GPU held and how busy it was (a run that hangs shows where: which rank let go of its GPU)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak: dict[str, int] = {}
        self.timeline: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.done.wait(0.5):
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,utilization.gpu",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            now = {}
            for line in filter(None, out.splitlines()):
                gpu, used, busy = (x.strip() for x in line.split(","))
                self.peak[gpu] = max(self.peak.get(gpu, 0), int(used))
                now[gpu] = [int(used), busy]
            elapsed = time.monotonic() - t0
            if now and (not self.timeline or elapsed - self.timeline[-1]["s"] >= 10):
                self.timeline.append({"s": round(elapsed, 1), "mib_and_busy_pct": now})


def end(proc: subprocess.Popen) -> None:
    """End a run and everything in its session: SIGTERM (torchrun passes it to its ranks; vLLM's engine
    processes end with rank 0, vrl.reaper), then SIGKILL to whatever is left 60 s later."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:  # already gone
                pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def one_run(n: int, name: str, common: list[str], runs: Path, args, tok, n_params: int) -> dict:
    """One `vrl train` on `n` processes; what its metrics say, or (a run short of its iterations) why it failed."""
    from vrl.generate.hf import render_prompt

    launch = [sys.executable, "-m", "vrl.cli"] if n == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m", "vrl.cli"]
    if args.verbose:
        launch.append("-v")  # a failing rank prints its traceback
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    memory = GPUMemory() if shutil.which("nvidia-smi") else None
    if memory:
        memory.start()
    t0 = time.perf_counter()
    # The whole stderr goes to a file beside --out (the JSON keeps its tail): a run that hangs or is killed
    # still says what each rank printed.
    log = Path(f"{args.out}.{name}.stderr.log")
    with open(log, "w") as sink:
        proc = subprocess.Popen([*launch, "train", "--name", name, *common], stdout=subprocess.DEVNULL,
                                stderr=sink, env=env, cwd=ROOT, start_new_session=True)
        try:
            proc.wait(timeout=args.run_timeout)
            stopped = ""
        except subprocess.TimeoutExpired:  # a hung collective
            stopped = f"\n[grpo_fsdp] stopped after {args.run_timeout} s"
        finally:  # also when this script is interrupted or killed by SIGTERM: the run does not outlive it
            end(proc)
    err = log.read_text(errors="replace") + stopped
    wall = time.perf_counter() - t0
    if memory:
        memory.done.set()
        memory.join()
    peak = memory.peak if memory else None
    timeline = memory.timeline if memory else None
    metrics = runs / name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    out: dict = {"wall_s": wall, "peak_gpu_mib": peak, "gpu_every_10s": timeline}
    if proc.returncode:
        first = err.find("Traceback")  # the first traceback is the failing rank's (with --verbose), torchrun's comes last
        out.update(returncode=proc.returncode, stderr_tail=err[-3000:],
                   oom="OutOfMemory" in err or "out of memory" in err)
        if 0 <= first < len(err) - 3000:
            out["stderr_first_traceback"] = err[first:first + 4000]
        if len(rows) < args.iterations:  # a run that ended after its last iteration (its checkpoint) still counts
            out["error"] = f"exit {proc.returncode} after {len(rows)} of {args.iterations} iterations"
    if not rows:
        return out
    samples = [json.loads(line) for line in (runs / name / "samples.jsonl").read_text().splitlines()]
    iters = []
    for r in rows:
        prompts = [s["prompt"] for s in samples if s["iteration"] == r["iteration"]]
        assert len(prompts) == r["completions"], "samples.jsonl must hold every completion"
        prompt_tokens = sum(len(tok(render_prompt(tok, p), add_special_tokens=False)["input_ids"]) for p in prompts)
        seq = prompt_tokens + r["tokens"]
        iters.append({"update_s": r["update_s"], "loop_s": r["loop_s"], "generation_s": r["generation_s"],
                      "sequence_tokens": seq, "loss_tokens": r["grpo/trained_tokens"],
                      "tokens_per_s": seq / r["update_s"],
                      # asynchronous rollouts (grpo.max_staleness > 0): what the loop waited on
                      **{k: r[k] for k in ASYNC_WAITS if k in r}})
    timed = iters[1:] or iters  # the first iteration is warm-up
    update = statistics.median(i["update_s"] for i in timed)
    tps = statistics.median(i["tokens_per_s"] for i in timed)
    out.update(median_update_s=update, tokens_per_s=tps, iterations=iters)
    if not args.small:
        out["mfu"] = 6 * n_params * tps / (n * PEAK_FLOPS)
    shutil.rmtree(runs / name / "grpo", ignore_errors=True)  # checkpoints: tens of GB each
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="processes (GPUs) per run")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=8, help="tasks_per_iteration")
    ap.add_argument("--generations", type=int, default=8, help="grpo.num_generations")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--shape", choices=["1.5b", "7b"], default="1.5b", help="the Qwen2.5 model whose shape to build")
    ap.add_argument("--backend", choices=["vllm", "hf"], default="vllm", help="rank 0's sampler")
    ap.add_argument("--path", help="where to write the model (default /tmp/vrl-bench-model[-7b])")
    ap.add_argument("--small", action="store_true", help="vrl's tiny model on CPU (gloo), hf backend: a dry run")
    ap.add_argument("--run-timeout", type=float, default=1800, help="seconds before a run is killed")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run")
    ap.add_argument("--verbose", action="store_true", help="`vrl -v`: a failed run keeps its rank's traceback")
    args = ap.parse_args()
    if min(args.ranks) < 1 or args.iterations < 1 or args.repeats < 1:
        ap.error("--ranks, --iterations and --repeats take numbers of at least 1")
    model = "tiny"
    if not args.small:
        sys.path.insert(0, str(Path(__file__).parent))
        from vllm_generation import build_model

        model = args.path or "/tmp/vrl-bench-model" + ("-7b" if args.shape == "7b" else "")
        build_model(model, small=False, shape=args.shape)
    n_params, tok = model_facts(model)
    runs = Path(tempfile.mkdtemp(prefix="vrl-fsdp-"))
    batch = args.tasks * args.generations
    common = ["--optimizer", "grpo", "--model", model, "--iterations", str(args.iterations),
              "--set", f"logging.runs_dir={runs}", "--set", f"logging.samples_per_iteration={batch}",
              "--set", f"sampling.max_new_tokens={args.new_tokens}", "--set", f"tasks_per_iteration={args.tasks}",
              "--set", f"grpo.num_generations={args.generations}", "--set", "grpo.save_interval_s=0"]
    backend = "hf" if args.small else args.backend
    common += ["--set", f"generator.backend={backend}"]
    if not args.small:
        common += ["--set", "grpo.gradient_checkpointing=true"]
    if backend == "vllm":
        common += ["--set", "generator.vllm.max_model_len=1024", "--set", "generator.vllm.sleep=true"]
    for kv in args.set:
        common += ["--set", kv]
    result: dict = {"shape": "tiny" if args.small else args.shape, "params": n_params, "backend": backend,
                    "global_batch": batch, "new_tokens": args.new_tokens, "iterations": args.iterations,
                    "extra_sets": args.set, "runs": {str(n): [] for n in args.ranks}}
    for repeat in range(args.repeats):
        for n in args.ranks:  # interleaved: a slow minute of the machine hits every N
            result["runs"][str(n)].append(one_run(n, f"n{n}-{repeat}", common, runs, args, tok, n_params))
            summarize(result)
            Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))


def summarize(result: dict) -> None:
    """Medians over the repeats that finished, per N, and each N's tokens/s against N=1's."""
    summary = {}
    for n, rs in result["runs"].items():
        ok = [r for r in rs if "error" not in r]
        if ok:
            summary[n] = {k: statistics.median(r[k] for r in ok) for k in ("median_update_s", "tokens_per_s", "mfu")
                          if k in ok[0]}
            summary[n]["peak_gpu_mib"] = ok[-1]["peak_gpu_mib"]
        else:
            summary[n] = {"failed": len(rs), "oom": any(r.get("oom") for r in rs)}
    base = summary.get("1", {}).get("tokens_per_s")
    for s in summary.values():
        if base and "tokens_per_s" in s:
            s["speedup_vs_1"] = s["tokens_per_s"] / base
    result["summary"] = summary


if __name__ == "__main__":
    # An outer `timeout` (SIGTERM) ends this script through its `finally`s: the run in flight ends too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
