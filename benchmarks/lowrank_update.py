"""The low-rank ES update on a GPU: the Triton int64 kernel against float64 matmuls, same bits.

    python benchmarks/lowrank_update.py --out r.json [--members 30] [--antithetic] [--rank 8] [--repeats 5]

The 196 linear matrices of Qwen2.5-1.5B (1.31 B parameters, fp32 master + bf16 weights, random),
one iteration's update of N members (ES's default: N terms; `--antithetic`: pairs merged, N/2) with
z-scores as ES stores them. Paths, interleaved over `--repeats` rounds (medians reported), each from
the same θ:

* `triton`: `lowrank_kernels.update_triton` (`lowrank_triton.update`, one launch per matrix; every tile
  regenerates its factors and accumulates Σ multₜ·aₜ·bₜᵀ in int64);
* `matmul_chunk<c>`: `lowrank_kernels.update_reference` on the GPU: the factors of all terms generated once
  per matrix, the exact integer sum as one float64 matmul (exact below 2⁵³), in row blocks of `c`
  elements, one matrix at a time;
* `batched`: `lowrank_kernels.update_batched`: the matrices of one shape together, one float64 `bmm` per
  batch of up to 2²⁵ output elements.

`--profile` prints the CUDA kernels each path spends its time in (torch.profiler, one round).

Each path's θ must equal the others' bit for bit (the run fails otherwise).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from vrl.optim.es import IterationRecord, member_seeds
from vrl.weights import lowrank_kernels
from vrl.weights.flat import FlatParams
from vrl.weights.lowrank import LowRankParams
from vrl.weights.lowrank_kernels import update_batched, update_reference, update_triton
from vrl.weights.update import LowRankUpdate

QWEN_1_5B = {"q_proj": (1536, 1536), "k_proj": (256, 1536), "v_proj": (256, 1536), "o_proj": (1536, 1536),
             "gate_proj": (8960, 1536), "up_proj": (8960, 1536), "down_proj": (1536, 8960)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--antithetic", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1 << 22, 1 << 25], help="matmul row-block sizes (elements)")
    args = ap.parse_args()
    torch.manual_seed(0)
    named = [(f"model.layers.{i}.{'mlp' if k.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}.{k}.weight",
              torch.nn.Parameter((torch.randn(*shape, device="cuda") * 0.02).to(torch.bfloat16)))
             for i in range(args.layers) for k, shape in QWEN_1_5B.items()]
    params = LowRankParams(FlatParams(named), args.rank)
    assert params.flat.use_triton, "the Triton path needs a CUDA device and triton"
    rng = random.Random(0)
    record = IterationRecord(seed=12345, z=[round(rng.gauss(0, 1), 4) for _ in range(args.members)])
    members = member_seeds(record, antithetic=args.antithetic)
    update = LowRankUpdate.from_members(members, record.z, 5e-4, args.rank)
    names, masters, weights = zip(*params._tensors())
    start = {k: v.clone() for k, v in params.state().items()}

    def run_triton() -> None:
        update_triton(masters, weights, names, update)

    def run_matmul(chunk: int):
        def go() -> None:
            old, lowrank_kernels._CHUNK = lowrank_kernels._CHUNK, chunk
            try:
                update_reference(masters, weights, names, update)
            finally:
                lowrank_kernels._CHUNK = old
        return go

    def run_batched() -> None:
        update_batched(masters, weights, names, update)

    paths = {"triton": run_triton, "batched": run_batched, **{f"matmul_chunk{c}": run_matmul(c) for c in args.chunks}}
    times: dict[str, list[float]] = {k: [] for k in paths}
    results: dict[str, dict[str, torch.Tensor]] = {}
    for rep in range(args.repeats + 1):  # round 0 warms up (Triton compiles) and is not timed
        for key, fn in paths.items():
            params.load_state(start)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if rep:
                times[key].append(time.perf_counter() - t0)
            else:
                results[key] = {k: v.clone() for k, v in params.state().items()}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for key, fn in paths.items():
            params.load_state(start)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            print(f"== {key}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
    ref = results["triton"]
    equal = {k: all(torch.equal(ref[n], r[n]) for n in ref) for k, r in results.items()}
    moved = sum(int((ref[n] != start[n]).sum()) for n in ref)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "members": args.members,
           "terms": len(update.terms), "rank": args.rank, "matrices": len(named),
           "matrix_params": sum(p.numel() for _, p in named), "elements_moved": moved,
           "bits_equal_to_triton": equal, "times_s": times,
           "median_s": {k: statistics.median(v) for k, v in times.items()}}
    print(json.dumps({k: out[k] for k in ("terms", "matrix_params", "elements_moved", "bits_equal_to_triton", "median_s")}, indent=1))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if not all(equal.values()):
        raise SystemExit(f"paths disagree: {equal}")


if __name__ == "__main__":
    main()
