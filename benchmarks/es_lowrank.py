"""Low-rank vs full-rank ES: update cost, member perturbation cost, population factor memory and the
batched population forward, on the tiny model and a small Qwen2-shaped random model.

Both modes move the same tensors (the linear layers' weights, es.include=['*']), with N members
and the paper's σ, α. The update is what replay costs per iteration.

    python benchmarks/es_lowrank.py                        # CPU: tiny + small Qwen2 shapes
    python benchmarks/es_lowrank.py --device cuda --out r.json   # GPU (Triton kernels)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from vrl.generate.hf_population import population
from vrl.optim.es import IterationRecord, member_seeds, update_terms
from vrl.weights.flat import FlatParams
from vrl.weights.lowrank import LowRankParams, select_linear
from vrl.weights.update import LowRankUpdate


def build(kind: str, device: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vrl.generate import tiny

    if kind == "tiny":
        return tiny.build_model().to(device)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg).to(device).eval()


def timed(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(kind: str, device: str, n: int, rank: int, repeats: int) -> dict[str, Any]:
    sigma, alpha = 1e-3, 5e-4
    rng = random.Random(0)
    record = IterationRecord(seed=12345, z=[round(rng.gauss(0, 1), 4) for _ in range(n)])
    members = member_seeds(record, antithetic=False)

    model = build(kind, device)
    layers = select_linear(model, ["*"], [])
    low = LowRankParams.from_model(model, ["*"], [], rank)
    update = LowRankUpdate.from_members(members, record.z, alpha, rank)
    shapes = [tuple(m.weight.shape) for _, m in layers]
    out: dict[str, Any] = {
        "model": kind, "device": device, "members": n, "rank": rank, "matrices": len(shapes),
        "matrix_params": sum(a * b for a, b in shapes),
        "lowrank_update_s": timed(lambda: low.update(update), device, repeats),
        "lowrank_perturb_s": timed(lambda: (low.perturb(7, 1, sigma), low.restore()), device, repeats),
        # fp32 factors of all members for the batched forward: 4·N·r·Σ(m+n) bytes
        "population_factor_bytes": 4 * n * rank * sum(a + b for a, b in shapes),
    }
    batch = torch.randint(0, 256, (n, 16), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        out["forward_base_s"] = timed(lambda: model(input_ids=batch), device, repeats)
        with population(layers, members, sigma, rank, list(range(n))):
            out["forward_population_s"] = timed(lambda: model(input_ids=batch), device, repeats)

    model = build(kind, device)  # the same tensors, full-rank
    full = FlatParams([(name, m.weight) for name, m in select_linear(model, ["*"], [])])
    terms = update_terms(record, antithetic=False, alpha=alpha)
    out["full_update_s"] = timed(lambda: full.update(terms), device, repeats)
    out["full_perturb_s"] = timed(lambda: (full.perturb(7, 1, sigma), full.restore()), device, repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {
        "load_average": os.getloadavg(), "threads": args.threads, "torch": torch.__version__,
        "runs": [measure(kind, args.device, args.members, args.rank, args.repeats) for kind in ("tiny", "qwen2-small")],
    }
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
