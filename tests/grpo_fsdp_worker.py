"""One rank of GRPO steps under FSDP2, started by `torchrun` from tests/test_grpo_fsdp.py (not a test module).

For each scenario (OUT RUN_DIR FIELDS, one triple per scenario, run in order in one launch: a launch
costs each rank its interpreter, torch and transformers, several CPU-seconds, and each scenario starts
and releases a process group of its own) every rank builds the tiny model's generator and GRPO as `vrl train` does; rank 0 samples the batch,
trains on it (the other ranks follow its commands), checkpoints into RUN_DIR, and writes what it saw
to OUT: the metrics, the whole pre-clipping gradient of every step, the weights after the step, and
the AdamW state gathered from the shards.

    torchrun --standalone --nproc-per-node 2 tests/grpo_fsdp_worker.py OUT RUN_DIR '{"beta": 0.1, ...}' [OUT2 RUN_DIR2 FIELDS2 ...]

or as a job of tests/torchrun_jobs.py (`{"worker": "tests.grpo_fsdp_worker", "args": [OUT, RUN_DIR, FIELDS, ...]}`),
as tests/test_grpo_fsdp.py runs it: in the launch of its `vrl train` jobs.

(`"_dtype": "bfloat16"` in the fields loads the model in bf16; `"_load": RUN` resumes RUN's checkpoint of
iteration 1 first, and `"_seed"` seeds the sampled batch. With `"use_peft": true` the ranks train a
LoRA adapter data-parallel, and OUT also holds every rank's adapter after the step, `replicas`.
With `"sample_on_every_rank": true`, rank 0 first samples a batch through every rank (`GRPO.sampler`)
and alone, recording both, `pooled` and `alone` (with `"_break_rank_1": true` rank 1's sampling fails,
and `pooled` is what rank 0 raised); OUT also holds every rank's sampling model after
the step, `samplers`. `"_pause": S` makes rank 0 wait S seconds before it sends the batch (the other
ranks wait for its command meanwhile). OUT always holds how many all-gathers FSDP2 ran on rank 0, `gathers`.
`"_separate": BYTES` samples from a copy apart from the trained one (a decoupled host, as an engine is)
and gathers the published weights in buckets of BYTES; OUT then holds whether rank 0's trained copy
is the sharded model itself, `trainable_sharded`, and the names of each published bucket, `buckets`.
With `"compile": true` (`grpo.compile`), OUT holds how many graphs dynamo compiled on each rank in the
scenario, `graphs`, and how many layers of each rank's sharded training copy run compiled,
`compiled_layers`: the proof that the sharded copy's layers ran compiled.)
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import torch
from torch.distributed.tensor import DTensor

from tests.test_grpo import make_generator, sample_results
from tests.torchrun_jobs import fresh_group
from vrl.optim.grpo import GRPO, GRPOConfig
from vrl.optim.grpo_dist import full


def main(out: str, run_dir: str, fields: dict) -> None:
    """One scenario; what it patches (the step's spy, the gather count, the bucket size) is restored after."""
    import torch.distributed as dist

    from vrl.optim import grpo_dist

    saved = GRPO._apply_step, dist.all_gather_single, grpo_dist.BUCKET_BYTES
    try:
        scenario(out, run_dir, fields)
    finally:
        GRPO._apply_step, dist.all_gather_single, grpo_dist.BUCKET_BYTES = saved


def scenario(out: str, run_dir: str, fields: dict) -> None:
    from torch._dynamo.utils import counters

    compiled_before = counters["stats"]["unique_graphs"]
    grads: list[list[torch.Tensor]] = []
    step = GRPO._apply_step

    def spy(self):  # every rank gathers (a collective); rank 0 keeps them
        grads.append([full(m.grad).clone() for m in self.master])
        return step(self)

    GRPO._apply_step = spy
    gen = make_generator(dtype=getattr(torch, fields.pop("_dtype", "float32")))
    resume, seed = fields.pop("_load", None), fields.pop("_seed", 1)
    separate = fields.pop("_separate", None)
    broken = fields.pop("_break_rank_1", False)
    pause = fields.pop("_pause", 0)
    gathers = [0]  # FSDP2's all-gathers (`dist.all_gather_single`) on this rank, over the whole run
    import torch.distributed as dist

    all_gather_single = dist.all_gather_single

    def counted(*args, **kwargs):
        gathers[0] += 1
        return all_gather_single(*args, **kwargs)

    dist.all_gather_single = counted
    buckets: list[list[str]] = []
    if separate is not None:
        from vrl.optim import grpo_dist
        from vrl.policy import WeightStream

        grpo_dist.BUCKET_BYTES = separate
        gen.decouple()
        publish = gen.publish

        def recorded(stream):  # rank 0's host: the names of each bucket as it is drawn
            assert isinstance(stream, WeightStream)
            publish(WeightStream(buckets.append([n for n, _ in b]) or b for b in stream))

        gen.publish = recorded
    opt = GRPO(GRPOConfig(**fields), seed=0, total_iterations=10)
    opt.setup(gen)
    leader = opt.group.leader
    pooled = alone = pooled_counts = None
    if leader:
        if resume is not None:  # every rank loads that run's checkpoint of iteration 1 (`load` leads them)
            opt.load(resume, 1)
        if opt.config.sample_on_every_rank:
            from vrl.policy import Variant
            from vrl.types import Task

            tasks = [Task(id=f"t{i}", prompt=f"Task {i}: letters.\n") for i in range(20)]
            v = [Variant(index=0, samples_per_task=3)]
            ranks = opt.sampler(gen)
            try:
                pooled = [c for batch in ranks.sample(tasks, v, seed=4) for c in batch]
            except RuntimeError as exc:  # "_break_rank_1": what rank 0 says of it
                pooled = str(exc)
            pooled_counts = ranks.counts
            alone = [c for batch in gen.sample(tasks, v, seed=4) for c in batch]
        time.sleep(pause)  # "_pause": the other ranks wait for the next command meanwhile
        metrics = opt.tell(sample_results(gen, seed=seed))
        opt.save(run_dir, final=True)
        opt.stop_followers()
    else:
        if broken:  # this rank's engine fails while it samples its share
            def fail(*args, **kwargs):
                raise RuntimeError("CUDA error: an illegal memory access was encountered\n(rank 1's engine)")
                yield  # pragma: no cover

            gen.sample = fail
        opt.follow()
    # Every rank takes part in gathering the AdamW state from its shards.
    optim = {name: {k: full(v).clone() for k, v in opt.optim.state[m].items()}
             for name, m in zip(opt.param_names, opt.master)}
    # Every rank gathers the trained masters, rounded to the sampling copy's dtype.
    dtype = next(gen.model.parameters()).dtype
    masters = {name: full(m.detach()).to(dtype) for name, m in zip(opt.param_names, opt.master)}
    replicas = samplers = graphs = compiled_layers = None
    if opt.config.compile:  # every rank's count of compiled graphs and of its trained copy's compiling layers, to rank 0
        import torch.distributed as dist

        graphs, compiled_layers = [None] * opt.group.world, [None] * opt.group.world
        dist.all_gather_object(graphs, counters["stats"]["unique_graphs"] - compiled_before, group=opt.group.objects)
        mine = sum(getattr(type(m), "_vrl_eager_class", None) is not None for m in opt.model.modules())
        dist.all_gather_object(compiled_layers, mine, group=opt.group.objects)
    if opt.config.sample_on_every_rank:  # every rank's sampling model, to rank 0
        import torch.distributed as dist

        samplers = [None] * opt.group.world
        dist.all_gather_object(samplers, {k: v.clone() for k, v in gen.model.state_dict().items()},
                               group=opt.group.objects)
    if opt.peft_model is not None:  # every rank's whole adapter, to rank 0
        import torch.distributed as dist

        replicas = [None] * opt.group.world
        dist.all_gather_object(replicas, [p.detach().clone() for p in opt.params], group=opt.group.objects)
    if leader:
        torch.save({"metrics": metrics, "grads": grads, "optim": optim, "world": opt.group.world, "replicas": replicas,
                    "syncs": gen.syncs,  # the trained weights handed to rank 0's sampling host
                    "trainable_sharded": gen.trainable().model is opt.model and isinstance(
                        next(opt.model.parameters()), DTensor), "buckets": buckets, "masters": masters,
                    "pooled": pooled, "alone": alone, "samplers": samplers, "pooled_counts": pooled_counts,
                    "gathers": gathers[0], "graphs": graphs, "compiled_layers": compiled_layers,
                    "weights": {k: v.clone() for k, v in gen.model.state_dict().items()}}, out)
    opt.close()  # every rank: checkpoint writes finished, process group released


def run(args: list[str], job: int = 0) -> None:
    """Every scenario of `args` (OUT RUN_DIR FIELDS, each), in order, as job `job` of a launch: each in a
    process group of its own, but the launch's first, which takes the one torch's rendezvous set up."""
    for i in range(0, len(args), 3):
        first = job == 0 and i == 0
        with contextlib.nullcontext() if first else fresh_group(f"{job}.{i // 3}"):
            main(args[i], args[i + 1], json.loads(args[i + 2]))


if __name__ == "__main__":
    run(sys.argv[1:])
