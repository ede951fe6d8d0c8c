"""ES perturb/restore and replay cost on a Qwen2.5-1.5B-shaped model (random bf16 weights).

Compares, per population member:
  (a) the ES paper's approach: per tensor a seeded torch.Generator, torch.randn, add_; restore by
      regenerating the noise and subtracting it (and how many weights that fails to restore);
  (b) vrl's: one fused kernel (hash noise from the fp32 master into the bf16 weights), restore by one
      cast-copy from the master;
  (c) the memory-bandwidth floor: one copy of all bf16 weights;
plus the replay cost per history iteration (one fused update over N members).

    python benchmarks/es_perturb.py --out result.json            # GPU: Qwen2.5-1.5B shapes
    python benchmarks/es_perturb.py --small --device cpu         # dry run with tiny shapes
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from vrl.generate.hf import HFGenerator
from vrl.optim.es import ES, ESConfig, IterationRecord, update_terms

log = logging.getLogger("benchmarks.es_perturb")


def build_model(small: bool, device: str) -> torch.nn.Module:
    """Qwen2.5-1.5B architecture (or a tiny one) with random bf16 weights, built directly on `device`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if small:
        cfg = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    else:  # the published Qwen2.5-1.5B config
        cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                          num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                          tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval().requires_grad_(False)


def timed(fn: Callable[[], Any], device: str, reps: int, warmup: int = 2) -> float:
    """Median wall time of `fn` in ms, device work included."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class PaperES:
    """The reference implementation's perturbation: seeded generator + randn + add_ per tensor, in place."""

    def __init__(self, params: list[torch.Tensor], sigma: float):
        self.params, self.sigma = params, sigma

    def _apply(self, seed: int, sign: float) -> None:
        for i, p in enumerate(self.params):
            g = torch.Generator(device=p.device).manual_seed(seed + i)  # independent per tensor (the fixed variant)
            noise = torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype)
            p.add_(noise, alpha=sign * self.sigma)

    def perturb(self, seed: int) -> None:
        self._apply(seed, 1.0)

    def restore(self, seed: int) -> None:
        self._apply(seed, -1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a CPU dry run")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--sigma", type=float, default=1e-3)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev, reps = args.device, args.reps
    torch.manual_seed(0)

    model = build_model(args.small, dev)
    params = [p for _, p in model.named_parameters()]
    numel = sum(p.numel() for p in params)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "shapes": "tiny" if args.small else "Qwen2.5-1.5B",
        "parameters": numel,
        "tensors": len(params),
        "sigma": args.sigma,
        "population": args.population,
    }
    log.info("%s: %.3f B parameters in %d tensors", out["shapes"], numel / 1e9, len(params))

    # (a) the paper's approach, on the model's own tensors
    original = [p.detach().clone() for p in params]
    paper = PaperES(params, args.sigma)
    seeds = iter(range(10**6, 10**7, 1000))
    out["paper_perturb_ms"] = timed(lambda: paper.perturb(next(seeds)), dev, reps)
    for p, o in zip(params, original):
        p.copy_(o)

    def paper_round_trip() -> None:
        s = next(seeds)
        paper.perturb(s)
        paper.restore(s)

    out["paper_perturb_restore_ms"] = timed(paper_round_trip, dev, reps, warmup=1)
    for p, o in zip(params, original):
        p.copy_(o)
    paper_round_trip()
    differing = sum(int((p != o).sum()) for p, o in zip(params, original))
    out["paper_restore_mismatch_fraction"] = differing / numel
    for p, o in zip(params, original):
        p.copy_(o)
    del original

    # (c) the floor: one copy of all bf16 weights
    buffers = [torch.empty(numel, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    out["copy_floor_ms"] = timed(lambda: buffers[1].copy_(buffers[0]), dev, reps)
    out["copy_floor_GBps"] = 2 * numel * 2 / out["copy_floor_ms"] / 1e6
    buffers.clear()

    # (b) ours, through the optimizer's own entry points
    before = [p.detach().clone() for p in params]
    es = ES(ESConfig(population_size=args.population, sigma=args.sigma), seed=0, base={"model": "qwen2.5-1.5b-shaped"})
    t0 = time.perf_counter()
    host = HFGenerator(model, None, None)  # the hf backend's host: its weights move in place
    es.setup(host)
    out["setup_s"] = time.perf_counter() - t0
    flat = host._params
    out["fused_kernel"] = flat.use_triton
    variants = iter(es.ask() * (4 * reps + 10))
    out["ours_perturb_ms"] = timed(lambda: flat.perturb(next(variants).seed, 1, args.sigma), dev, reps)
    out["ours_restore_ms"] = timed(flat.restore, dev, reps)

    def ours_round_trip() -> None:
        with host.applied(next(variants)):
            pass

    out["ours_perturb_restore_ms"] = timed(ours_round_trip, dev, reps)
    ours_round_trip()
    out["ours_restore_mismatch_fraction"] = sum(int((p != b).sum()) for p, b in zip(params, before)) / numel
    del before

    # replay: one history iteration = one fused update over the population
    g = torch.Generator().manual_seed(0)
    for antithetic in (False, True):
        z = torch.randn(args.population, generator=g).tolist()
        record = IterationRecord(seed=12345, z=[round(v, 4) for v in z])
        terms = update_terms(record, antithetic, args.sigma / 2)
        key = "replay_iteration_antithetic_ms" if antithetic else "replay_iteration_ms"
        out[key] = timed(lambda terms=terms: flat.update(terms), dev, max(3, reps // 4), warmup=1)

    out["ours_perturb_vs_copy"] = out["ours_perturb_ms"] / out["copy_floor_ms"]
    out["ours_restore_vs_copy"] = out["ours_restore_ms"] / out["copy_floor_ms"]
    out["ours_round_trip_vs_two_copies"] = out["ours_perturb_restore_ms"] / (2 * out["copy_floor_ms"])
    out["paper_vs_ours"] = out["paper_perturb_restore_ms"] / out["ours_perturb_restore_ms"]
    for k, v in out.items():
        log.info("%-34s %s", k, f"{v:.4g}" if isinstance(v, float) else v)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
