"""One GRPO training step (`GRPO.tell`) on a Qwen2.5-1.5B-shaped model with random weights, bf16.

Measures training tokens/s, MFU and peak memory for 64 sequences of 1024 tokens on average, with
and without gradient checkpointing, over a few micro-batch sizes, padded or padding-free
(`grpo.padding_free`). The step is the real one: packing, chunked log-probs, the dapo loss,
gradient accumulation into fp32 master weights, clipping, fused AdamW, and the bf16 write-back.

`--lengths fixed` gives every sequence 512 prompt + 512 completion tokens (no padding at all, so
padding-free changes nothing but the attention path); `--lengths varied` draws prompts of 256–768 and
completions of 128–896 tokens (uniform, seeded; 1024 on average), as a real batch of completions
is, so the padded layout computes on pad tokens (`pad_fraction` in the report) and padding-free
does not. Padding-free saves compute only under flash-attention (`--attn flash_attention_2`, needs
the flash-attn package): under sdpa the samples of a packed row are kept apart by a block-diagonal
mask over the whole row.

`--compile on` sets `grpo.compile` (each decoder layer through `torch.compile`, dynamic shapes). Every
setting first runs one untimed step over the whole batch (`warmup_s`), which pays the compile: in full
for the first compiled setting, again in part when a later one changes what the graph depends on
(gradient checkpointing on: one recompile); other micro-batch sizes and lengths reuse the graph. The
timed steps train on the same batch, so they compile nothing (`timed_compiles` counts the graphs
dynamo compiled during them: 0 expected). Between settings the layers are made eager again.

MFU counts 6 · N · tokens FLOPs per step (N = all parameters, embeddings included; every real token
of a sequence counted, padding not), against 989.4 TFLOP/s (H100 SXM dense bf16) — the convention
of the floor in shared/notes/es-noise.md. Checkpointing's recompute is not counted as useful work.
Peak memory: `peak_gb` is torch's peak allocated GPU memory over the timed steps (reset per
setting); `peak_rss_gb` the process's peak resident host memory so far (not reset per setting).

    python benchmarks/grpo_step.py --out result.json                                  # GPU, as before
    python benchmarks/grpo_step.py --lengths varied --attn flash_attention_2 --padding-free both --out r.json
    python benchmarks/grpo_step.py --small --padding-free both --lengths varied --out /tmp/r.json  # CPU dry run
    python benchmarks/grpo_step.py --lengths varied --attn sdpa --compile both --out r.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import resource
import sys
import time
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from vrl.config import SamplingConfig
from vrl.generate import tiny
from vrl.generate.hf import HFGenerator
from vrl.optim.compile import restore_layers
from vrl.optim.grpo import GRPO, GRPOConfig
from vrl.types import Completion, Result, Task, Verdict

log = logging.getLogger("grpo_step")
PEAK_FLOPS = {"cuda": 989.4e12}


def qwen25_15b(small: bool) -> Qwen2Config:
    if small:
        return Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    # The shape of Qwen/Qwen2.5-1.5B (config.json), weights random.
    return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def batch(n_seq: int, prompt_len: int, completion_len: int, vocab: int, group: int, varied: bool = False
          ) -> list[Result]:
    """`varied`: prompt lengths uniform in [prompt_len/2, 3·prompt_len/2], completions in
    [completion_len/4, 7·completion_len/4] (the same means as fixed lengths)."""
    rng = random.Random(0)
    out = []
    for i in range(n_seq):
        task = Task(id=f"t{i // group}", prompt="p")
        n_p = rng.randint(prompt_len // 2, 3 * prompt_len // 2) if varied else prompt_len
        n_c = rng.randint(completion_len // 4, 7 * completion_len // 4) if varied else completion_len
        completion = Completion(task_id=task.id, text="x", sample=i % group, finish_reason="stop",
                                prompt_token_ids=[rng.randrange(vocab) for _ in range(n_p)],
                                token_ids=[rng.randrange(vocab) for _ in range(n_c)])
        reward = rng.random()
        out.append(Result(task=task, completion=completion, verdict=Verdict.fail("failed", "bench", score=reward),
                          reward=reward))
    return out


def measure(gen: HFGenerator, results: list[Result], ckpt: bool, micro: int, steps: int, n_params: int,
            device: torch.device, padding_free: bool = False, compile: bool = False) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    cfg = GRPOConfig(num_generations=8, learning_rate=1e-6, lr_scheduler_type="constant", loss_type="dapo",
                     micro_batch_size=micro, gradient_checkpointing=ckpt, logprob_chunk_size=2048,
                     padding_free=padding_free, compile=compile)
    row: dict[str, Any] = {"gradient_checkpointing": ckpt, "micro_batch_size": micro, "padding_free": padding_free,
                           "compile": compile}
    opt = None
    try:
        opt = GRPO(cfg, seed=0)
        opt.setup(gen)
        t0 = time.perf_counter()
        opt.tell(results)  # warm-up: allocator, kernels, AdamW state, and the compile (every length of the batch)
        _sync(device)
        row["warmup_s"] = time.perf_counter() - t0
        graphs = counters["stats"]["unique_graphs"]
        update_times: list[float] = []
        apply_step = opt._apply_step

        def timed_step() -> float:  # clip + AdamW + bf16 write-back, timed on its own
            _sync(device)
            t = time.perf_counter()
            norm = apply_step()
            _sync(device)
            update_times.append(time.perf_counter() - t)
            return norm

        opt._apply_step = timed_step
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            metrics = opt.tell(results)
            _sync(device)
            times.append(time.perf_counter() - t0)
        tokens = sum(len(r.completion.prompt_token_ids) + len(r.completion.token_ids) for r in results)
        best = min(times)
        row.update(step_s=best, step_s_all=times, optimizer_s=min(update_times), tokens=tokens,
                   tokens_per_s=tokens / best, pad_fraction=metrics["grpo/pad_fraction"],
                   timed_compiles=counters["stats"]["unique_graphs"] - graphs,
                   graphs=graphs)  # compiled so far in this process (one per layer would mean a recompile per layer)
        if device.type in PEAK_FLOPS:
            row["mfu"] = 6 * n_params * tokens / best / PEAK_FLOPS[device.type]
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    finally:
        row["peak_rss_gb"] = _peak_rss_bytes() / 1e9
        if opt is not None and ckpt:
            off = getattr(gen.model, "activation_checkpointing_disable", None) or gen.model.gradient_checkpointing_disable
            off()
        if compile:  # the next setting trains the same model: eager again unless it compiles too
            restore_layers(gen.model)
        del opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    log.info("%s", {k: v for k, v in row.items() if k != "step_s_all"})
    return row


def _peak_rss_bytes() -> int:
    """The process's peak resident set size (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on CPU (a dry run of the script)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per setting (best is reported)")
    ap.add_argument("--lengths", choices=["fixed", "varied"], default="fixed",
                    help="fixed: 512 + 512 tokens per sequence; varied: random lengths, 1024 on average")
    ap.add_argument("--padding-free", choices=["off", "on", "both"], default="off",
                    help="grpo.padding_free for every setting (both: each setting padded, then padding-free)")
    ap.add_argument("--compile", choices=["off", "on", "both"], default="off",
                    help="grpo.compile for every setting (both: each setting eager, then compiled)")
    ap.add_argument("--attn", default=None,
                    help="attention implementation (sdpa, eager, flash_attention_2, ...; default: transformers')")
    ap.add_argument("--settings", nargs="+", metavar="{ckpt,nockpt}:MICRO",
                    help="only these settings, e.g. nockpt:8 ckpt:16 (default: the five of the table)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = qwen25_15b(args.small)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    if args.attn:
        model.set_attn_implementation(args.attn)
    n_params = sum(p.numel() for p in model.parameters())
    n_seq, prompt_len, completion_len = (8, 32, 32) if args.small else (64, 512, 512)
    results = batch(n_seq, prompt_len, completion_len, config.vocab_size, group=8, varied=args.lengths == "varied")
    gen = HFGenerator(model, tiny.build_tokenizer(), SamplingConfig(temperature=1.0, max_new_tokens=completion_len))
    settings = [(False, 4), (False, 8), (True, 16), (True, 32), (True, 64)]
    if args.small:
        settings = [(False, 4), (True, 8)]
    if args.settings:
        settings = [(ckpt == "ckpt", int(micro)) for ckpt, micro in (s.split(":") for s in args.settings)]
    free = {"off": [False], "on": [True], "both": [False, True]}[args.padding_free]
    compiled = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    rows = [measure(gen, results, ckpt, micro, args.steps, n_params, device, padding_free=f, compile=c)
            for ckpt, micro in settings for f in free for c in compiled]
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": n_params,
        "sequences": n_seq,
        "prompt_tokens": prompt_len,
        "completion_tokens": completion_len,
        "lengths": args.lengths,
        "attn_implementation": model.config._attn_implementation,
        "dtype": str(dtype),
        "loss_type": "dapo",
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
