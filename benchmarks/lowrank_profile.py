"""Where the time of low-rank ES's vLLM pass goes: one decode step with the members' LoRA adapters against
the same requests without, kernel by kernel (issue 44, item 3).

    python benchmarks/lowrank_profile.py --out result.json [--traces DIR] [--batches 30 120 240 480]
                                         [--members 30] [--rank 8] [--new-tokens 128] [--budget-s 540]
                                         [--no-eager] [--sweep] [--tuned-engine] [--engines graph tuned]
    python benchmarks/lowrank_profile.py --out result.json --configs-out DIR   # the sweep alone (~20 s)

Qwen2.5-1.5B shapes with random bf16 weights, engines started by vrl exactly as `vrl train --set
es.noise=lowrank` starts them (30 LoRA slots of rank 8, the members of one ES iteration written into
them). Requests are those of one low-rank pass: B = tasks × members, request j served by member
j mod members; "no LoRA" is the same requests without adapters, on the same engine.

1. **Eager engine** (`enforce_eager`: every kernel launched from Python): torch.profiler over a few
   decode steps (every request running, B tokens a step), kernels classified by name and by their
   order in the step (each decoder layer runs qkv, o, gate_up, down; each LoRA layer a zero-fill, a
   shrink and an expand kernel). Each LoRA layer's `apply` is also wrapped in a record_function range,
   a second attribution by torch's own kernel-to-op links.
2. **Graph engine** (vrl's default, torch.compile + CUDA graphs): decode-step time with and without
   LoRA at each `--batches` size, from the engine's own step loop (the interval between two forward
   launches), the host time inside the step, tokens/s, raw vLLM on 256 prompts (the baseline of
   docs/benchmarks.md) and vrl's own pass; then the same profile over graph replays.
3. `--sweep`: vLLM's LoRA shrink/expand kernels alone for each layer kind at B tokens, captured in a
   CUDA graph: the default launch configs, a few others, a grouped torch `bmm` formulation and the base
   GEMM; the best configs are written as vLLM tuned-config files (`VLLM_TUNED_CONFIG_FOLDER`).
4. `--tuned-engine`: a graph engine started with those files, timed as in 2 (`--engines tuned`: that
   one alone, its requests without adapters being the same-run baseline).

`--configs-out DIR` runs the sweep alone and writes its files to DIR: `export VLLM_TUNED_CONFIG_FOLDER=DIR`
before `vrl train` then starts vrl's engines with them. Results: docs/benchmarks.md ("The decode step
kernel by kernel").

Each section is skipped when less than its share of `--budget-s` is left (a device call is limited to
600 s), and the JSON is rewritten after each, so a run cut short reports what it measured.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import random
import shutil
import statistics
import string
import sys
import time
import traceback
from pathlib import Path
from typing import Any

KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the order of a decoder layer's linear layers
# Input size and output slices of each LoRA layer (q, k, v and gate, up are slices): Qwen2.5-1.5B (the
# profiled engines' model) and Qwen2.5-0.5B (benchmarks/es_torchrun.py's), for `--shape`.
SHAPES_BY_MODEL = {
    "1.5b": {"qkv_proj": (1536, (1536, 256, 256)), "o_proj": (1536, (1536,)),
             "gate_up_proj": (1536, (8960, 8960)), "down_proj": (8960, (1536,))},
    "0.5b": {"qkv_proj": (896, (896, 128, 128)), "o_proj": (896, (896,)),
             "gate_up_proj": (896, (4864, 4864)), "down_proj": (4864, (896,))},
}
SHAPES = SHAPES_BY_MODEL["1.5b"]


# -- classifying a profile (pure Python: tested on the CPU, tests/test_lowrank_profile.py) -------------
def kernel_class(name: str) -> str:
    """The kind of GPU work a kernel (or memcpy/memset) record is, from its name."""
    n = name.lower()
    if "lora_shrink" in n:
        return "lora_shrink"
    if "lora_expand" in n:
        return "lora_expand"
    if n.startswith("memcpy"):
        return "memcpy"
    if n.startswith("memset") or "fillfunctor" in n:
        return "fill"
    if any(k in n for k in ("flash", "fmha", "attn", "attention", "paged")):
        return "attention"
    if "splitk" in n and "reduce" in n:  # cuBLAS's split-K epilogue: part of the GEMM before it
        return "gemm_reduce"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "cublas")):
        return "gemm"
    return "other"


def summarize(kernels: list[dict[str, Any]], steps: int, layers: int) -> dict[str, Any]:
    """Per-step GPU time of `kernels` ({name, start, dur} in µs, from `steps` whole decode steps, in any
    order), by class, by layer kind and by name.

    Kinds come from the order within a step: the g-th GEMM of the window is the (g mod 4·layers+1)-th of
    its step (qkv, o, gate_up, down per layer, then the output head); the e-th expand (and shrink) is of
    kind e mod 4 (vLLM has no LoRA on the output head here); a fill right before a shrink is that
    shrink's zeroing of its buffer. A count that does not fit the pattern leaves those kinds out
    (`*_by_kind: null`) rather than guessing.
    """
    ks = sorted(kernels, key=lambda k: k["start"])
    per_gemm_step = 4 * layers + 1
    classes = [kernel_class(k["name"]) for k in ks]
    # a fill directly followed by a shrink is the shrink's `output_tensor.zero_()`
    for i in range(len(ks) - 1):
        if classes[i] == "fill" and classes[i + 1] == "lora_shrink":
            classes[i] = "lora_zero"
    by_class: dict[str, float] = {}
    count: dict[str, int] = {}
    for k, c in zip(ks, classes):
        by_class[c] = by_class.get(c, 0.0) + k["dur"]
        count[c] = count.get(c, 0) + 1
    gemm = [k for k, c in zip(ks, classes) if c == "gemm"]
    gemm_kind: dict[str, float] | None = None
    if gemm and len(gemm) == steps * per_gemm_step:
        gemm_kind = {}
        g, kind = -1, None
        for k, c in zip(ks, classes):
            if c == "gemm":
                g += 1
                at = g % per_gemm_step
                kind = "lm_head" if at == per_gemm_step - 1 else KINDS[at % 4]
            if c in ("gemm", "gemm_reduce") and kind is not None:
                gemm_kind[kind] = gemm_kind.get(kind, 0.0) + k["dur"]
    lora_kind: dict[str, dict[str, float]] | None = None
    lora = [(k, c) for k, c in zip(ks, classes) if c in ("lora_shrink", "lora_expand", "lora_zero")]
    n_expand = sum(c == "lora_expand" for _, c in lora)
    n_shrink = sum(c == "lora_shrink" for _, c in lora)
    if lora and n_expand == n_shrink == 4 * layers * steps:
        lora_kind = {kind: {"zero": 0.0, "shrink": 0.0, "expand": 0.0} for kind in KINDS}
        seen = {"lora_shrink": 0, "lora_expand": 0}
        for k, c in lora:
            if c == "lora_zero":  # belongs to the shrink that follows it
                kind = KINDS[seen["lora_shrink"] % 4]
            else:
                kind = KINDS[seen[c] % 4]
                seen[c] += 1
            lora_kind[kind][c.removeprefix("lora_")] += k["dur"]
    names: dict[str, list[float]] = {}
    for k in ks:
        entry = names.setdefault(k["name"], [0, 0.0])
        entry[0] += 1
        entry[1] += k["dur"]
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:30]
    per = 1.0 / steps
    span = (ks[-1]["start"] + ks[-1]["dur"] - ks[0]["start"]) if ks else 0.0
    return {
        "steps": steps,
        "gpu_us_per_step": sum(k["dur"] for k in ks) * per,
        "span_us_per_step": span * per,  # first kernel start to last kernel end, per step: GPU busy + idle
        "kernels_per_step": len(ks) * per,
        "us_per_step_by_class": {c: t * per for c, t in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "kernels_per_step_by_class": {c: n * per for c, n in count.items()},
        "gemm_us_per_step_by_kind": None if gemm_kind is None else {k: t * per for k, t in gemm_kind.items()},
        "lora_us_per_step_by_kind": None if lora_kind is None else
        {kind: {part: t * per for part, t in parts.items()} for kind, parts in lora_kind.items()},
        "gemms_per_step": len(gemm) * per,
        "top_kernels": [{"name": name[:160], "per_step": n * per, "us_per_step": t * per} for name, (n, t) in top],
    }


def step_stats(steps: list[tuple[float, float, int, str]], tokens: int) -> dict[str, Any] | None:
    """Decode steps of a pass from the engine's step log [(start s, end s, scheduled tokens, 'exec'|'sample')]:
    the median interval between two consecutive forward launches that both ran `tokens` tokens (every
    request decoding), and the median host time inside execute_model and sample_tokens."""
    execs = [s for s in steps if s[3] == "exec"]
    intervals = [b[0] - a[0] for a, b in zip(execs, execs[1:]) if a[2] == tokens and b[2] == tokens]
    if not intervals:
        return None
    exec_host = [s[1] - s[0] for s in execs if s[2] == tokens]
    samples = [s for s in steps if s[3] == "sample"]
    sample_host = [s[1] - s[0] for s in samples]
    return {"step_ms": 1e3 * statistics.median(intervals), "steps": len(intervals),
            "step_ms_p10": 1e3 * sorted(intervals)[len(intervals) // 10],
            "execute_model_host_ms": 1e3 * statistics.median(exec_host),
            "sample_tokens_host_ms": 1e3 * statistics.median(sample_host) if sample_host else None}


def tuned_configs(best: dict[str, dict[str, dict[str, Any]]], defaults: dict[str, dict[str, dict[str, Any]]],
                  max_loras: int, tokens: int, rank: int, shapes: dict[str, Any] | None = None,
                  large: bool = True) -> dict[str, dict]:
    """vLLM's tuned LoRA kernel config files ({file name suffix: content}): for each layer kind, its best
    config at `tokens` tokens where the sweep found one, else vLLM's default (`defaults[kind]`: 'shrink',
    'expand', and 'shrink_large' / 'expand_large' for prefill-sized batches).

    vLLM reads config[max_loras + 1][num_slices][m][k][n] ((hidden, rank) for shrink, (rank, largest
    slice) for expand), taking the nearest key at each level but num_slices, which must be present: so
    every kind is written, batches up to 4.5·`tokens` get the `tokens` entry and larger ones (prefill
    chunks) the defaults keyed 8·`tokens` (`large=False`: not those; `merge_configs` joins the files of
    sweeps at several batch sizes, the largest one's with them)."""
    files: dict[str, dict] = {"SHRINK.json": {}, "EXPAND_TRUE.json": {}}
    big = str(8 * tokens)
    for kind, (k_in, slices) in (shapes or SHAPES).items():
        for part, fname in (("shrink", "SHRINK.json"), ("expand", "EXPAND_TRUE.json")):
            k, n = (str(k_in), str(rank)) if part == "shrink" else (str(rank), str(max(slices)))
            level = files[fname].setdefault(str(max_loras + 1), {}).setdefault(str(len(slices)), {})
            level.setdefault(str(tokens), {}).setdefault(k, {})[n] = best.get(kind, {}).get(part, defaults[kind][part])
            if large:
                level.setdefault(big, {}).setdefault(k, {})[n] = defaults[kind][part + "_large"]
    return files


def merge_configs(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """One set of config files from several sweeps' (`tuned_configs` at several batch sizes): nested
    dicts joined key by key; where two give the same leaf, the later one's."""
    def join(a: dict, b: dict) -> dict:
        out = dict(a)
        for key, value in b.items():
            out[key] = join(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
                and not {"block_m", "num_warps"} & set(value) else value
        return out

    merged: dict[str, dict] = {}
    for part in parts:
        merged = join(merged, part)
    return merged


def write_configs(files: dict[str, dict], folder: str | Path) -> Path:
    """Write `lora_sweep`'s tuned_files ({file name: content}) into `folder`, emptied first: a folder to
    give vLLM as VLLM_TUNED_CONFIG_FOLDER (it reads the files of its own GPU's name)."""
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=1))
    return folder


# -- inside the engine's worker (sent by collective_rpc; `self` is the worker) ------------------------
def _install_hooks(self: Any, annotate: bool) -> int:
    """Log every execute_model / sample_tokens call (start, end, scheduled tokens) and let `_arm` start
    the profiler at a chosen decode step; with `annotate`, wrap each LoRA layer's `apply` and its LoRA
    part in record_function ranges (eager engines only: a compiled model must not see new attributes)."""
    import time as _time

    import torch as _torch

    state = self.__dict__.setdefault("_vrl_lp", {"steps": [], "arm": None, "result": None})
    runner = self.model_runner
    if getattr(runner, "_vrl_lp_hooked", False):
        return 0
    exec_model, sample = runner.execute_model, runner.sample_tokens

    def execute_model(*args: Any, **kwargs: Any) -> Any:
        so = args[0] if args else kwargs.get("scheduler_output")
        n = int(getattr(so, "total_num_scheduled_tokens", -1))
        arm = state["arm"]
        if arm is not None and n == arm["tokens"]:
            arm["seen"] += 1
            if arm["seen"] == arm["skip"] + 1:
                _torch.cuda.synchronize()
                arm["prof"] = _torch.profiler.profile(
                    activities=[_torch.profiler.ProfilerActivity.CPU, _torch.profiler.ProfilerActivity.CUDA])
                arm["prof"].start()
                arm["t0"] = _time.perf_counter()
            elif arm["seen"] == arm["skip"] + arm["steps"] + 1:
                _finish(self, state)
        t0 = _time.perf_counter()
        out = exec_model(*args, **kwargs)
        state["steps"].append((t0, _time.perf_counter(), n, "exec"))
        return out

    def sample_tokens(*args: Any, **kwargs: Any) -> Any:
        t0 = _time.perf_counter()
        out = sample(*args, **kwargs)
        state["steps"].append((t0, _time.perf_counter(), -1, "sample"))
        return out

    runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
    runner._vrl_lp_hooked = True
    wrapped = 0
    if annotate:
        manager = runner.lora_manager._adapter_manager
        for name, module in manager.modules.items():
            if not hasattr(module, "lora_a_stacked") or not hasattr(module, "_apply_lora_to_output"):
                continue
            kind = name.rsplit(".", 1)[-1]

            def apply(x: Any, bias: Any = None, _f: Any = module.apply, _k: str = kind) -> Any:
                with _torch.profiler.record_function(f"vrl:layer:{_k}"):
                    return _f(x, bias)

            def lora(x: Any, output: Any, _f: Any = module._apply_lora_to_output, _k: str = kind) -> Any:
                with _torch.profiler.record_function(f"vrl:lora:{_k}"):
                    return _f(x, output)

            module.apply, module._apply_lora_to_output = apply, lora
            wrapped += 1
    return wrapped


def _finish(self: Any, state: dict[str, Any]) -> None:
    """Stop the armed profiler: write its trace, summarise its kernels (in the worker, where the events are)."""
    import torch as _torch
    from torch.autograd import DeviceType

    arm = state["arm"]
    state["arm"] = None
    _torch.cuda.synchronize()
    prof = arm["prof"]
    prof.stop()
    steps = arm["seen"] - arm["skip"] - 1
    result: dict[str, Any] = {"label": arm["label"], "tokens": arm["tokens"], "steps": steps}
    try:
        result["window_ms_per_step"] = 1e3 * (time.perf_counter() - arm["t0"]) / max(steps, 1)
        events = prof.events()
        kernels, annotated = [], {}
        for e in events:
            if e.device_type == DeviceType.CUDA:
                if getattr(e, "is_user_annotation", False) or e.name.startswith(("vrl:", "gpu_model_runner")):
                    continue
                kernels.append({"name": e.name, "start": float(e.time_range.start), "dur": float(e.time_range.elapsed_us())})
            elif e.name.startswith("vrl:"):
                entry = annotated.setdefault(e.name, [0, 0.0, 0.0])
                entry[0] += 1
                entry[1] += float(e.device_time_total)
                entry[2] += float(e.cpu_time_total)
        result["annotated_per_step"] = {k: {"calls": n / steps, "gpu_us": g / steps, "cpu_us": c / steps}
                                        for k, (n, g, c) in sorted(annotated.items())}
        result["summary"] = summarize(kernels, steps, arm["layers"])
    except Exception:  # the trace below still holds the events
        result["error"] = traceback.format_exc()[-2000:]
    if arm.get("trace"):
        try:
            raw = arm["trace"] + ".json"
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as f, gzip.open(arm["trace"] + ".json.gz", "wb") as g:
                g.write(f.read())
            os.remove(raw)
        except Exception:
            result["trace_error"] = traceback.format_exc()[-1000:]
    state["result"] = result


def _arm(self: Any, label: str, tokens: int, skip: int, steps: int, layers: int, trace: str | None) -> None:
    """Profile steps skip+1 .. skip+steps of those that schedule exactly `tokens` tokens (pure decode)."""
    state = self.__dict__["_vrl_lp"]
    state["result"] = None
    state["arm"] = {"label": label, "tokens": tokens, "skip": skip, "steps": steps, "seen": 0, "layers": layers,
                    "trace": trace}


def _collect(self: Any) -> dict[str, Any] | None:
    """The armed profile's result (stopping it if the pass ended first)."""
    state = self.__dict__["_vrl_lp"]
    if state["arm"] is not None and state["arm"].get("prof") is not None:
        _finish(self, state)
    state["arm"] = None
    return state["result"]


def _take_steps(self: Any) -> list[tuple[float, float, int, str]]:
    state = self.__dict__["_vrl_lp"]
    steps, state["steps"] = state["steps"], []
    return steps


# -- the driver --------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t_start = time.perf_counter()
        self.res: dict[str, Any] = {"args": vars(args), "errors": [], "sections": {}}

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t_start)

    def save(self) -> None:
        self.res["elapsed_s"] = time.perf_counter() - self.t_start
        with open(self.args.out, "w") as f:
            json.dump(self.res, f, indent=1)

    def section(self, name: str, need_s: float, fn: Any, *a: Any) -> Any:
        if self.left() < need_s:
            self.res["sections"][name] = f"skipped: {self.left():.0f} s left, needs {need_s:.0f}"
            self.save()
            return None
        t0 = time.perf_counter()
        try:
            out = fn(*a)
            self.res["sections"][name] = f"done in {time.perf_counter() - t0:.1f} s"
            return out
        except Exception:
            self.res["errors"].append({"section": name, "error": traceback.format_exc()[-3000:]})
            self.res["sections"][name] = f"failed after {time.perf_counter() - t0:.1f} s"
            return None
        finally:
            self.save()
            print(f"[{time.perf_counter() - self.t_start:.0f} s] {name}: {self.res['sections'][name]}", flush=True)


def start_engine(args: argparse.Namespace, eager: bool, memory: float, tuned_dir: str | None = None) -> tuple:
    """An engine as `vrl train --set es.noise=lowrank` starts it, its LoRA slots holding one iteration's members."""
    from vrl.config import build
    from vrl.optim.es import ES
    from vrl.runtime.local import LocalRuntime

    if tuned_dir:
        os.environ["VLLM_TUNED_CONFIG_FOLDER"] = tuned_dir
    else:
        os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None)
    cfg = build({"model": args.path, "optimizer": "es", "seed": 1,
                 "sampling": {"temperature": 1.0, "max_new_tokens": args.new_tokens, "batch_size": 32},
                 "es": {"population_size": args.members, "noise": "lowrank", "rank": args.rank, "exclude": ["lm_head*"]},
                 "generator": {"backend": "vllm", "vllm": {"gpu_memory_utilization": memory, "max_model_len": 1024,
                                                           "enforce_eager": eager}}})
    t0 = time.perf_counter()
    es = ES(cfg.es, seed=1, base={"model": args.path})
    host = LocalRuntime().policy(cfg, es.needs())
    es.setup(host)
    return host, es, time.perf_counter() - t0


class Engine:
    """One engine with the step log installed, and the requests of a low-rank pass."""

    def __init__(self, bench: Bench, host: Any, es: Any, annotate: bool, prompts: list[list[int]]):
        import vllm
        from vllm.lora.request import LoRARequest

        self.bench, self.host, self.es, self.llm = bench, host, es, host.llm
        self.vllm, self.LoRARequest, self.prompts = vllm, LoRARequest, prompts
        self.wrapped = self.llm.collective_rpc(_install_hooks, args=(annotate,))[0]
        self.layers = int(json.loads((Path(bench.args.path) / "config.json").read_text())["num_hidden_layers"])

    def requests(self, batch: int, lora: bool, new_tokens: int) -> tuple[list, list, list | None]:
        """Request j: prompt j // members (8 distinct prompts at 240), member j mod members, seed 7 + j (as vrl)."""
        m = self.bench.args.members
        prompts = [{"prompt_token_ids": self.prompts[(j // m) % len(self.prompts)]} for j in range(batch)]
        params = [self.vllm.SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=7 + j)
                  for j in range(batch)]
        loras = [self.LoRARequest(f"vrl-member-{j % m}", j % m + 1, "vrl://lora-slot") for j in range(batch)] if lora else None
        return prompts, params, loras

    def generate(self, batch: int, lora: bool, new_tokens: int) -> dict[str, Any]:
        prompts, params, loras = self.requests(batch, lora, new_tokens)
        self.llm.collective_rpc(_take_steps)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = self.llm.collective_rpc(_take_steps)[0]
        return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "decode": step_stats(steps, batch)}

    def raw256(self) -> float:
        """docs/benchmarks.md's raw baseline: 256 distinct prompts, no adapter, one shared seed."""
        prompts = [{"prompt_token_ids": self.prompts[i % len(self.prompts)]} for i in range(256)]
        params = self.vllm.SamplingParams(temperature=1.0, max_tokens=self.bench.args.new_tokens, ignore_eos=True, seed=0)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    def vrl_pass(self, tasks: list) -> dict[str, Any]:
        """vrl's own low-rank ES iteration (benchmarks/es_engines.py's), at len(tasks) tasks."""
        from es_engines import iteration

        return iteration(self.host, self.es, tasks)

    def profile(self, label: str, batch: int, lora: bool, skip: int, steps: int) -> dict[str, Any] | None:
        trace = str(Path(self.bench.args.traces) / label) if self.bench.args.traces else None
        self.llm.collective_rpc(_arm, args=(label, batch, skip, steps, self.layers, trace))
        prompts, params, loras = self.requests(batch, lora, skip + steps + 4)
        self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return self.llm.collective_rpc(_collect)[0]


def lora_sweep(bench: Bench, tokens: int, large: bool = True) -> dict[str, Any]:
    """vLLM's LoRA kernels alone per layer kind, each timed inside a CUDA graph of 20 calls (the
    layer shapes of `--shape`; `large`: see `tuned_configs`)."""
    import torch
    import torch.nn.functional as F
    from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_expand_op, lora_shrink, lora_shrink_op, utils

    args = bench.args
    members, rank, dev = args.members, args.rank, torch.device("cuda")
    shapes = SHAPES_BY_MODEL[args.shape]
    torch.manual_seed(0)

    def timed(fn: Any, reps: int = 20, replays: int = 5) -> float:
        """µs per call, from replays of a CUDA graph holding `reps` calls."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(replays):
                g.replay()
            b.record()
            b.synchronize()
            best = min(best, 1e3 * a.elapsed_time(b) / (reps * replays))
        return best

    def default(part: str, m: int, k_in: int, slices: tuple[int, ...]) -> dict[str, Any]:
        hidden = k_in if part == "shrink" else max(slices)
        return dict(utils.get_lora_op_configs(part, members + 1, m, hidden, rank, len(slices),
                                              **({"add_inputs": True} if part == "expand" else {})))

    defaults = {kind: {"shrink": default("shrink", tokens, k_in, slices), "expand": default("expand", tokens, k_in, slices),
                       "shrink_large": default("shrink", 8 * tokens, k_in, slices),
                       "expand_large": default("expand", 8 * tokens, k_in, slices)}
                for kind, (k_in, slices) in shapes.items()}
    # vLLM's grids launch cdiv(B, block_m) row blocks for every adapter although each adapter has only
    # B / members rows (8 at 240): most blocks exit at once. Candidates with one or two row blocks, and
    # smaller ones.
    def shrink_cfg(bm: int, bk: int, sk: int, warps: int) -> dict[str, Any]:
        return dict(block_m=bm, block_n=16, block_k=bk, split_k=sk, num_warps=warps, num_ctas=1, group_size_m=8, num_stages=2)

    def expand_cfg(bm: int, bn: int, warps: int) -> dict[str, Any]:
        return dict(block_m=bm, block_n=bn, block_k=16, num_warps=warps, num_ctas=1, num_stages=2)

    shrink_cands = [None, shrink_cfg(16, 64, 8, 4), shrink_cfg(16, 128, 8, 4), shrink_cfg(32, 64, 16, 4),
                    shrink_cfg(64, 128, 4, 4)]
    expand_cands = [None, expand_cfg(16, 64, 4), expand_cfg(16, 128, 4), expand_cfg(16, 256, 4), expand_cfg(16, 256, 8),
                    expand_cfg(32, 128, 4), expand_cfg(64, 128, 4)]
    original = (lora_shrink_op.get_lora_op_configs, lora_expand_op.get_lora_op_configs)
    chosen: dict[str, Any] = {"shrink": None, "expand": None}

    def patched(op_type: str, *a: Any, **k: Any) -> dict[str, Any]:
        cfg = chosen.get(op_type)
        return dict(cfg) if cfg is not None else original[0](op_type, *a, **k)

    out: dict[str, Any] = {"tokens": tokens, "members": members, "rank": rank, "defaults": defaults, "kinds": {}}
    bench.res["sweep"] = out  # saved as it fills
    best: dict[str, dict[str, Any]] = {}
    mapping = torch.arange(tokens, device=dev) % members
    meta = LoRAKernelMeta.make(members, tokens, dev)
    meta.prepare_tensors(mapping)
    margs = meta.meta_args(tokens, False)
    def measure(k_in: int, slices: tuple[int, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
        """One layer kind: its base GEMM, shrink and expand under each candidate, the grouped-bmm form;
        and the configs at least 10 % faster than vLLM's default."""
        x = torch.randn(tokens, k_in, device=dev, dtype=torch.bfloat16)
        w = torch.randn(sum(slices), k_in, device=dev, dtype=torch.bfloat16) * 0.02
        y = torch.zeros(tokens, sum(slices), device=dev, dtype=torch.bfloat16)
        la = [torch.randn(members, 1, rank, k_in, device=dev, dtype=torch.bfloat16) * 0.02 for _ in slices]
        lb = [torch.randn(members, 1, n, rank, device=dev, dtype=torch.bfloat16) * 0.02 for n in slices]
        buf = torch.empty(len(slices), tokens, rank, device=dev, dtype=torch.float32)
        calls = {"shrink": lambda: lora_shrink(x, la, buf, *margs, 1.0),
                 "expand": lambda: lora_expand(buf, lb, y, *margs, offset_start=0, add_inputs=True)}
        row: dict[str, Any] = {"base_gemm_us": timed(lambda: F.linear(x, w))}
        faster: dict[str, Any] = {}
        for part, cands in (("shrink", shrink_cands), ("expand", expand_cands)):
            results = []
            for cand in cands:
                chosen[part] = cand
                try:
                    results.append({"config": cand or "default", "us": timed(calls[part])})
                except Exception as exc:
                    results.append({"config": cand or "default", "error": repr(exc)[:300]})
                finally:
                    chosen[part] = None
            row[part] = results
            ok = [r for r in results if "us" in r]
            default_us = next((r["us"] for r in ok if r["config"] == "default"), None)
            fastest = min(ok, key=lambda r: r["us"]) if ok else None
            if fastest and default_us and fastest["config"] != "default" and fastest["us"] < 0.9 * default_us:
                faster[part] = fastest["config"]
        # The LoRA term as one grouped matmul per member (rows sorted by member), the shape a fused
        # path of vrl's own would compute: gather, two bmm, scatter-add.
        order = torch.argsort(mapping)
        a_all = torch.cat([a[:, 0] for a in la], dim=1).transpose(1, 2).contiguous()  # members × k_in × r·slices
        b_bd = torch.zeros(members, rank * len(slices), sum(slices), device=dev, dtype=torch.bfloat16)
        at = 0
        for i, (b, n) in enumerate(zip(lb, slices)):
            b_bd[:, i * rank:(i + 1) * rank, at:at + n] = b[:, 0].transpose(1, 2)
            at += n

        def grouped() -> None:
            xs = x.index_select(0, order).view(members, tokens // members, k_in)
            y.index_add_(0, order, torch.bmm(torch.bmm(xs, a_all), b_bd).view(tokens, -1))

        if tokens % members == 0:
            row["grouped_bmm_us"] = timed(grouped)
        row["lora_weight_mb"] = 2 * members * rank * (k_in * len(slices) + sum(slices)) / 1e6
        return row, faster

    lora_shrink_op.get_lora_op_configs = lora_expand_op.get_lora_op_configs = patched
    try:
        for kind, (k_in, slices) in shapes.items():
            if bench.left() < (30 if args.configs_out else 220):  # leave the graph engines their time
                out["cut_short"] = f"stopped before {kind}: {bench.left():.0f} s left"
                break
            out["kinds"][kind], faster = measure(k_in, slices)
            if faster:
                best[kind] = faster
            bench.save()
    finally:
        lora_shrink_op.get_lora_op_configs, lora_expand_op.get_lora_op_configs = original
    out["best"] = best
    name = torch.cuda.get_device_name().replace(" ", "_").replace("-", "_")
    files = tuned_configs(best, defaults, members, tokens, rank, shapes, large)
    out["tuned_files"] = {f"{name}_{suffix}": content for suffix, content in files.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--traces", default=None, help="folder for the profiles' chrome traces (.json.gz)")
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=8, help="tasks of vrl's pass; the profiled batch is tasks × members")
    ap.add_argument("--batches", type=int, nargs="+", default=[30, 120, 240, 480])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--memory", type=float, default=0.3)
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager engine's profile")
    ap.add_argument("--sweep", action="store_true", help="time vLLM's LoRA kernels alone under other launch configs")
    ap.add_argument("--tuned-engine", action="store_true", help="a graph engine with the sweep's best configs")
    ap.add_argument("--configs-out", default=None,
                    help="only the kernel sweep: write vLLM's config files to this folder (for VLLM_TUNED_CONFIG_FOLDER)")
    ap.add_argument("--engines", nargs="+", default=["graph", "tuned"], choices=["graph", "tuned"],
                    help="which graph engines to start: vrl's default, and (with --tuned-engine) the tuned one")
    ap.add_argument("--shape", choices=sorted(SHAPES_BY_MODEL), default="1.5b",
                    help="the layer shapes the sweep times (the profiled engines are Qwen2.5-1.5B's)")
    ap.add_argument("--sweep-tokens", type=int, nargs="+", default=None,
                    help="with --configs-out: sweep at each of these batch sizes (tokens per decode step), "
                    "one set of files for all (default: tasks × members)")
    ap.add_argument("--path", default="/tmp/vrl-bench-model")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(Path(__file__).parent))
    if args.traces:
        Path(args.traces).mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    import torch
    import vllm
    from vllm_generation import build_model

    from vrl.types import Task

    res = bench.res
    res.update(device=torch.cuda.get_device_name(), vllm=vllm.__version__, torch=torch.__version__)
    if not args.configs_out:
        build_model(args.path, False)
    rng = random.Random(0)
    texts = ["".join(rng.choice(string.ascii_letters + " ") for _ in range(64)) for _ in range(256)]
    tasks = [Task(id=f"p{i}", prompt=t) for i, t in enumerate(texts)]
    batch = args.tasks * args.members

    def prompts_of(host: Any) -> list[list[int]]:
        return [host.tokenizer(t.prompt, add_special_tokens=False)["input_ids"] for t in tasks]

    # 1. eager: the kernel breakdown
    def eager() -> None:
        host, es, startup = start_engine(args, eager=True, memory=args.memory)
        try:
            eng = Engine(bench, host, es, annotate=True, prompts=prompts_of(host))
            out: dict[str, Any] = {"startup_s": startup, "annotated_layers": eng.wrapped, "layers": eng.layers}
            res["eager"] = out
            out["vrl_pass"] = eng.vrl_pass(tasks[:args.tasks])  # writes the members into the slots
            for lora in (True, False):
                label = f"eager_{'lora' if lora else 'nolora'}_{batch}"
                out[label] = eng.profile(label, batch, lora, skip=2, steps=4)
                bench.save()
        finally:
            host.close()

    if not args.no_eager and not args.configs_out:
        bench.section("eager profile", 150, eager)

    # 2. the LoRA kernels alone under other launch configs (before the graph engines: its best configs
    # go to a second graph engine, timed beside the default one)
    tuned_dir = None
    if args.configs_out:
        points = sorted(args.sweep_tokens or [batch])
        sweeps = [bench.section(f"kernel sweep at {m}", 0, lora_sweep, bench, m, m == points[-1]) for m in points]
        res["sweeps"] = sweeps
        bench.save()
        done = [s for s in sweeps if s]
        if done:
            files = merge_configs([s["tuned_files"] for s in done])
            print(f"vLLM LoRA kernel configs for {[s['tokens'] for s in done]} tokens written to "
                  f"{write_configs(files, args.configs_out)}")
        return
    if args.sweep:
        sweep = bench.section("kernel sweep", 260, lora_sweep, bench, batch)
        res["sweep"] = sweep
        if sweep and sweep.get("best") and args.tuned_engine:
            tuned_dir = str(write_configs(sweep["tuned_files"], "/tmp/vrl-lora-tuned"))
        bench.save()

    # 3. the graph engine vrl runs (and the tuned one): step times and tokens/s, interleaved; then profiles
    def graphs() -> None:
        engines: dict[str, Engine] = {}
        try:
            for key, folder in (("graph", None), ("tuned", tuned_dir)):
                if key not in args.engines or key == "tuned" and (folder is None or bench.left() < 200):
                    continue
                host, es, startup = start_engine(args, eager=False, memory=args.memory, tuned_dir=folder)
                engines[key] = Engine(bench, host, es, annotate=False, prompts=prompts_of(host))
                res[key] = {"startup_s": startup, "runs": [], "raw256_tok_s": [], "vrl": [], "tuned_dir": folder}
                bench.save()
            for eng in engines.values():
                eng.vrl_pass(tasks[:args.tasks])  # warm-up; the slots hold members from here on
                eng.raw256()
            for rep in range(args.repeats):
                for key, eng in engines.items():
                    out = res[key]
                    out["raw256_tok_s"].append(eng.raw256())
                    for b in args.batches:
                        for lora in (True, False):
                            out["runs"].append({"repeat": rep, "batch": b, "lora": lora, **eng.generate(b, lora, args.new_tokens)})
                    run = eng.vrl_pass(tasks[:args.tasks])
                    run.update({k: v for k, v in eng.host.counters().items() if k in ("members_s", "update_worker_s")})
                    out["vrl"].append(run)
                    bench.save()
            for key in engines:
                res[key]["summary"] = graph_summary(res[key], args.batches, batch)
            bench.save()
            for key, eng in engines.items():
                for lora in (True, False):
                    if bench.left() < 30:
                        break
                    label = f"{key}_{'lora' if lora else 'nolora'}_{batch}"
                    res[key][label] = eng.profile(label, batch, lora, skip=4, steps=8)
                    bench.save()
        finally:
            for eng in engines.values():
                eng.host.close()

    bench.section("graph engines", 200, graphs)
    print(json.dumps({k: res[k].get("summary") for k in ("graph", "tuned") if k in res}, indent=1), flush=True)
    bench.save()


def graph_summary(out: dict[str, Any], batches: list[int], batch: int) -> dict[str, Any]:
    """Medians per batch size: step ms and tok/s with and without LoRA, their ratio; vrl's pass against raw."""
    summary: dict[str, Any] = {"raw256_tok_s": statistics.median(out["raw256_tok_s"]) if out["raw256_tok_s"] else None}
    for b in batches:
        row = {}
        for lora in (True, False):
            runs = [r for r in out["runs"] if r["batch"] == b and r["lora"] == lora]
            key = "lora" if lora else "nolora"
            row[f"{key}_tok_s"] = statistics.median(r["tok_s"] for r in runs)
            steps = [r["decode"]["step_ms"] for r in runs if r.get("decode")]
            hosts = [r["decode"]["execute_model_host_ms"] for r in runs if r.get("decode")]
            row[f"{key}_step_ms"] = statistics.median(steps) if steps else None
            row[f"{key}_exec_host_ms"] = statistics.median(hosts) if hosts else None
        row["lora_vs_nolora_tok_s"] = row["lora_tok_s"] / row["nolora_tok_s"]
        if row["lora_step_ms"] and row["nolora_step_ms"]:
            row["nolora_vs_lora_step"] = row["nolora_step_ms"] / row["lora_step_ms"]
        summary[f"batch={b}"] = row
    if out["vrl"]:
        vrl = statistics.median(r["tok_s"] for r in out["vrl"])
        summary["vrl_tok_s"] = vrl
        if summary["raw256_tok_s"]:
            summary["vrl_vs_raw256"] = vrl / summary["raw256_tok_s"]
        if f"batch={batch}" in summary:
            summary["vrl_vs_nolora_same_requests"] = vrl / summary[f"batch={batch}"]["nolora_tok_s"]
    return summary


if __name__ == "__main__":
    main()
