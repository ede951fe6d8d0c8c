"""One GRPO training step (`GRPO.tell`) on a Qwen2.5-1.5B-shaped model with random weights, bf16.

Measures training tokens/s, MFU and peak GPU memory for 64 sequences × (512 prompt + 512
completion) tokens, with and without gradient checkpointing, over a few micro-batch sizes. The step
is the real one: packing, chunked log-probs, the dapo loss, gradient accumulation into fp32 master
weights, clipping, fused AdamW, and the bf16 write-back.

MFU counts 6 · N · tokens FLOPs per step (N = all parameters, embeddings included; every one of the
1024 tokens of a sequence counted), against 989.4 TFLOP/s (H100 SXM dense bf16) — the convention of
the floor in shared/notes/es-noise.md. Checkpointing's recompute is not counted as useful work.

    python benchmarks/grpo_step.py --out result.json            # GPU
    python benchmarks/grpo_step.py --small --out /tmp/r.json    # CPU dry run with small shapes
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import time
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from vrl.config import SamplingConfig
from vrl.generate import tiny
from vrl.generate.hf import HFGenerator
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


def batch(n_seq: int, prompt_len: int, completion_len: int, vocab: int, group: int) -> list[Result]:
    rng = random.Random(0)
    out = []
    for i in range(n_seq):
        task = Task(id=f"t{i // group}", prompt="p")
        completion = Completion(task_id=task.id, text="x", sample=i % group, finish_reason="stop",
                                prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
                                token_ids=[rng.randrange(vocab) for _ in range(completion_len)])
        reward = rng.random()
        out.append(Result(task=task, completion=completion, verdict=Verdict.fail("failed", "bench", score=reward),
                          reward=reward))
    return out


def measure(gen: HFGenerator, results: list[Result], ckpt: bool, micro: int, steps: int, n_params: int,
            device: torch.device) -> dict[str, Any]:
    cfg = GRPOConfig(num_generations=8, learning_rate=1e-6, lr_scheduler_type="constant", loss_type="dapo",
                     micro_batch_size=micro, gradient_checkpointing=ckpt, logprob_chunk_size=2048)
    row: dict[str, Any] = {"gradient_checkpointing": ckpt, "micro_batch_size": micro}
    opt = None
    try:
        opt = GRPO(cfg, seed=0)
        opt.setup(gen)
        opt.tell(results)  # warm-up: allocator, kernels, AdamW state
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
            opt.tell(results)
            _sync(device)
            times.append(time.perf_counter() - t0)
        tokens = sum(len(r.completion.prompt_token_ids) + len(r.completion.token_ids) for r in results)
        best = min(times)
        row.update(step_s=best, step_s_all=times, optimizer_s=min(update_times), tokens=tokens,
                   tokens_per_s=tokens / best)
        if device.type in PEAK_FLOPS:
            row["mfu"] = 6 * n_params * tokens / best / PEAK_FLOPS[device.type]
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    finally:
        if opt is not None and ckpt:
            off = getattr(gen.model, "activation_checkpointing_disable", None) or gen.model.gradient_checkpointing_disable
            off()
        del opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    log.info("%s", {k: v for k, v in row.items() if k != "step_s_all"})
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on CPU (a dry run of the script)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per setting (best is reported)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = qwen25_15b(args.small)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    n_seq, prompt_len, completion_len = (8, 32, 32) if args.small else (64, 512, 512)
    results = batch(n_seq, prompt_len, completion_len, config.vocab_size, group=8)
    gen = HFGenerator(model, tiny.build_tokenizer(), SamplingConfig(temperature=1.0, max_new_tokens=completion_len))
    settings = [(False, 4), (False, 8), (True, 16), (True, 32), (True, 64)]
    if args.small:
        settings = [(False, 4), (True, 8)]
    rows = [measure(gen, results, ckpt, micro, args.steps, n_params, device) for ckpt, micro in settings]
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": n_params,
        "sequences": n_seq,
        "prompt_tokens": prompt_len,
        "completion_tokens": completion_len,
        "dtype": str(dtype),
        "loss_type": "dapo",
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
