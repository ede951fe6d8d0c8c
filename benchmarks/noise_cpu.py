"""ES's reference noise on the CPU (`vrl.weights.noise.update_reference`, what ES's update, replay, `vrl export`
and `vrl eval --model RUN` run without a GPU) at several chunk sizes: seconds for the update of one iteration
of `--members` members over a tensor of `--numel` elements. Results: docs/benchmarks.md, "ES noise on the CPU".

    python benchmarks/noise_cpu.py --out result.json

Chunk sizes are interleaved within each repeat and the medians reported; every size's θ is checked bit for bit
against the first's. Run it on an idle machine for absolute figures; the ratios hold on a loaded one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--chunks", type=int, nargs="+", default=[23, 17, 16, 15, 14, 13], help="log2 of the chunk sizes")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    from vrl.weights import noise as nz

    words = [nz.name_words("model.layers.0.mlp.up_proj.weight")]
    terms = [(1000 + i, nz.round_sig(1e-3 * (i - args.members / 2), nz.SCALE_BITS)) for i in range(args.members)]

    def run(log2: int) -> tuple[float, torch.Tensor]:
        nz._CPU_CHUNK = 1 << log2
        master = torch.zeros(args.numel)
        weights = torch.zeros(args.numel, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        nz.update_reference([master], [weights], words, terms)
        return time.perf_counter() - t0, master

    seconds: dict[int, list[float]] = {c: [] for c in args.chunks}
    reference = None
    for _ in range(args.repeats):
        for c in args.chunks:
            dt, theta = run(c)
            if reference is None:
                reference = theta
            assert torch.equal(theta, reference), f"chunk 2^{c} changed θ"
            seconds[c].append(dt)
    base = statistics.median(seconds[args.chunks[0]])
    result = {"numel": args.numel, "members": args.members, "threads": torch.get_num_threads(),
              "median_s": {f"2^{c}": statistics.median(v) for c, v in seconds.items()},
              "speedup_vs_first": {f"2^{c}": base / statistics.median(v) for c, v in seconds.items()},
              "runs_s": {f"2^{c}": v for c, v in seconds.items()}}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_s", "speedup_vs_first")}, indent=2))


if __name__ == "__main__":
    main()
