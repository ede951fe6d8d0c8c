"""One update under `torch.profiler` (`grpo.profile_dir`): where a step's time goes, per rank.

Writes `<name>.txt`, torch's table of the operations with the most time on the device (on the CPU
where there is no GPU), and `<name>.json`, the device time by kind of kernel, summed over the step:
matrix multiplies, attention, NCCL collectives (FSDP2's all-gathers and reduce-scatters, the push's
gathers), everything else, and the step's wall time. On several GPUs the NCCL share against the wall
time says how much of the step waits on communication (kernels on other streams overlap compute, so
the kinds may add up to more than the wall time).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

#: Kernel-name fragments of each kind (lower case), tried in this order; the rest is "other".
KINDS = {
    "nccl": ("nccl",),
    "attention": ("flash", "attention", "fmha", "sdpa", "efficient_attention"),
    "gemm": ("gemm", "cutlass", "matmul", "xmma", "cublas", "nvjet", "aten::mm", "addmm", "bmm"),
}


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, parts in KINDS.items() if any(p in low for p in parts)), "other")


@contextlib.contextmanager
def profiled(folder: Path, name: str) -> Iterator[None]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    # Device kernels on a GPU; on a CPU the aten operators' own time (a profile of the Python-side step).
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    seconds: dict[str, float] = {kind: 0.0 for kind in (*KINDS, "other")}
    for e in events:
        t = float(getattr(e, attr, 0.0) or 0.0) / 1e6
        if t > 0 and (cuda or e.key.startswith("aten::")):
            seconds[kind_of(e.key)] += t
    folder.mkdir(parents=True, exist_ok=True)
    summary = {"wall_s": wall, "device": "cuda" if cuda else "cpu", "seconds_by_kind": seconds}
    (folder / f"{name}.json").write_text(json.dumps(summary, indent=1))
    (folder / f"{name}.txt").write_text(events.table(sort_by=attr, row_limit=40))
    log.info("profiled the update into %s (%.1f s wall; %s)", folder / name, wall,
             ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()))
