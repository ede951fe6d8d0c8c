"""GRPO over several processes with PyTorch's FSDP2 (`fully_shard`), and its sharded checkpoints (DCP).

Who does what (see `vrl.distributed` for the launch):

- Rank 0 samples (alone, or with every rank sampling and verifying its share: `RankHosts`,
  `sample_calls`, `grpo.sample_on_every_rank`, the same seeds either way), has the whole batch's
  verdicts, and sends the rewarded results to every rank (`broadcast_object_list`), so every rank
  sees the whole batch: advantages and every loss normaliser (sequences, tokens) are those of the
  whole batch, as on one process.
- The batch, sorted by length, is cut into `world × k` micro-batches of near-equal size; rank r
  trains on micro-batches r, r + world, ... Each micro-batch loss is divided by the whole-batch
  normalisers, so the micro-batch losses of all ranks sum to the batch loss; FSDP2 *sums* the
  gradients over ranks (reduce-scatter with the divide factor set to 1), so the gradient equals the
  one-process gradient up to summation order.
- Parameters, gradients and AdamW state are sharded (DTensor, dim 0): the trainable parameters are
  kept in fp32 (they are the master weights) and cast to the model's dtype for forward and
  backward (`MixedPrecisionPolicy`), gradients reduced in fp32.
- After each step the full weights are gathered bucket by bucket (`gathered`, `BUCKET_BYTES`) and
  handed to rank 0's host as a `WeightStream`: an engine (vLLM) takes each bucket as it comes, so
  rank 0 keeps no whole copy of the model besides its shard; an in-process sampler (hf) copies each
  bucket into its own whole model.

LoRA (`use_peft`) trains *data-parallel* instead: every rank holds the whole frozen base and the whole
adapter (rank 0's bits, broadcast once: `replicate`), trains its micro-batches, and the adapter's
gradients are summed over the ranks (`Group.add_grads`, one all-reduce of a flat buffer) before
clipping; AdamW then takes the same step on every rank. The adapter is megabytes: sharding it saves
nothing, while FSDP2 would hold the frozen base in fp32 (its shards are masters, one dtype per unit).
Rank 0's model is both the one trained and the one its host samples from, as on one process.

ES under torchrun uses the same `Group` (its commands, `gather`, a lost rank named: `RankLost`) and
`RankHosts` (its members dealt over the ranks): `vrl.optim.es`.

Checkpoints: `train/` is a `torch.distributed.checkpoint` folder of the fp32 masters and the AdamW
state, keyed by parameter name, so any number of ranks (one process included) loads it. (A LoRA
adapter's tensors are whole on every rank; DCP writes each once.)
"""

from __future__ import annotations

import copy
import datetime
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vrl.errors import UsageError
from vrl.policy import PolicyHost, Trainable, Variant
from vrl.types import Attempt, Completion, Task, Verified
from vrl.verifier import VerifierUnavailable, down_after_crashes

COMMAND_WAIT = datetime.timedelta(days=365)  # how long a rank > 0 waits for rank 0's next command: no real bound


class Group:
    """The ranks that train together; rank 0 leads (sends commands and the batch), the others follow."""

    def __init__(self, device: torch.device, timeout_s: float):
        """`timeout_s`: how long a collective waits for the other ranks (`grpo.ddp_timeout`); commands
        wait without a bound (`COMMAND_WAIT`)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timeout)
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.leader = self.rank == 0
        self.lost: int | None = None  # rank 0: the rank that stopped answering (`gather`); nothing is sent after
        self.stopped = False  # rank 0: "stop" was sent (`stop`)
        self.device = device
        self.mesh = init_device_mesh(device.type, (self.world,))
        # Objects travel over gloo (CPU) whatever the device; background checkpoint writes get a group of
        # their own, so their collectives never interleave with the training step's.
        self.objects = dist.new_group(backend="gloo", timeout=timeout)
        self.checkpoints = dist.new_group(backend="gloo", timeout=timeout)
        # Commands only: a rank > 0 waits here while rank 0 samples and verifies, for as long as that takes
        # (a Lean batch can take longer than any collective should). If rank 0 dies, torchrun ends the others.
        self.commands = dist.new_group(backend="gloo", timeout=COMMAND_WAIT)

    # -- rank 0 leads -------------------------------------------------------------------------------
    def send(self, command: str, *args: Any) -> None:
        if self.lost is not None:  # the launch is ending: a broadcast would fail on the lost rank's connection
            return
        dist.broadcast_object_list([(command, args)], src=0, group=self.commands)

    def receive(self) -> tuple[str, tuple[Any, ...]]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.commands)
        return box[0]

    def stop(self) -> None:
        """Rank 0: end the other ranks' `serve` (once; marked first, so a failed send is not repeated)."""
        if self.leader and not self.stopped:
            self.stopped = True
            self.send("stop")

    def serve(self, run: Callable[..., None]) -> None:
        """A rank > 0: `run(command, *args)` for each of rank 0's commands, until it sends "stop"."""
        if self.leader:
            raise RuntimeError("only the ranks > 0 of a torchrun launch follow rank 0's commands")
        while (message := self.receive())[0] != "stop":
            run(message[0], *message[1])

    def share(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.objects)
        return box[0]

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value`, in rank order, on rank 0 (None on the others). Rank 0 receives from one
        rank after another, so a rank whose process died (its connection closed) is named: `RankLost`."""
        if not self.leader:
            dist.send_object_list([value], dst=0, group=self.objects)
            return None
        out = [value]
        for r in range(1, self.world):
            box: list[Any] = [None]
            try:
                dist.recv_object_list(box, src=r, group=self.objects)
            except RuntimeError as exc:  # gloo: "Connection closed by peer", a timeout, ...
                self.lost = r
                raise RankLost(r, self.world, exc) from exc
            out.append(box[0])
        return out

    def close(self) -> None:
        """Every rank, once, at the end: wait for the others, then release the process groups, so their
        communication threads end before the interpreter does (a gloo or DCP thread still joinable at
        exit aborts the process: "terminate called without an active exception")."""
        if dist.is_initialized():
            if self.lost is None:  # a lost rank would fail the barrier: the others end with the launch
                dist.barrier(group=self.objects)
            dist.destroy_process_group()

    # -- reductions ---------------------------------------------------------------------------------
    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each key summed over the ranks (every rank passes the same keys, in any order)."""
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t, group=self.objects)
        return dict(zip(keys, t.tolist()))

    def add_grads(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients of `params` (whole tensors, the same on every rank) over the ranks, in place:
        one all-reduce of one flat buffer. A parameter without a gradient counts as zeros."""
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # SUM, over the device's backend (NCCL on GPUs, gloo on CPUs)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).clone()
            offset += n

    def max(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.objects)
        return float(t)

    def min(self, value: float) -> float:
        return -self.max(-value)


class RankLost(UsageError, RuntimeError):
    """A rank stopped answering rank 0 (its process died, or its node was lost): the launch ends, in one
    line naming the rank (a `UsageError`: what happened and what to do, no traceback)."""

    def __init__(self, rank: int, world: int, cause: BaseException):
        reason = re.sub(r"\[[^\]]*\.cc:\d+\]\s*", "", " ".join(str(cause).split()))  # gloo's source location
        super().__init__(f"rank {rank} of {world} stopped answering ({reason.split('. ')[0][:120]}): its process died "
                         "or its node was lost, so the launch ends (a run resumes on any number of ranks)")
        self.rank = rank


class RankHosts(PolicyHost):
    """Rank 0's host and every other rank's, sampled as one host (`grpo.sample_on_every_rank`).

    `sample` deals the batch's tasks over the ranks as a `HostPool` deals them over engines (`deal`: the
    same shards and seeds, so the samples are one engine's), sends every rank its calls (the other ranks
    run `GRPO.sample_share` or ES's from their command loop), streams rank 0's own batches as they
    finish, then gathers the other ranks' completions, each rank's share `Verified` where that rank has
    a verification pool (`sample_calls`). Everything else is rank 0's host's: every rank's GRPO pushes
    the trained weights into its own host (`GRPO._publish`)."""

    name = "ranks"
    collective = True  # sends the calls and gathers the shares

    def __init__(self, host: PolicyHost, group: Group, granule: int = 1,
                 check: Callable[[list[Any]], None] | None = None):
        """`check(notes)`: run on rank 0 with what every other rank sent beside its share (`send_share`),
        before any share is used; a rule compares the ranks there without a round trip of its own (ES:
        the fingerprints of the θ each rank sampled from)."""
        self.host, self.group, self.granule, self.check = host, group, granule, check
        self.counts: list[int] = []  # completions each rank sampled in the last `sample`

    def sample(self, tasks: Sequence[Task], variants: Sequence[Variant], seed: int | None = None
               ) -> Iterator[list[Completion]]:
        from vrl.policy import deal

        work = deal(tasks, variants, seed, self.group.world, self.granule)
        self.group.send("sample_share", work)
        own = 0
        try:
            for shard, vs, s in work[0]:
                stream = self.host.sample(shard, vs, s)
                try:
                    for batch in stream:
                        own += len(batch)
                        yield batch
                finally:
                    stream.close()
        finally:  # the other ranks sample meanwhile; their results come back even when this rank failed
            answers = (self.group.gather(None) or [None])[1:]
        shares = [share for share, _ in answers]
        self.counts = [own] + [len(share) if isinstance(share, list) else 0 for share in shares]
        if self.check is not None:
            self.check([note for _, note in answers])
        for rank, share in enumerate(shares, start=1):
            yield from share_batches(rank, share)

    def trainable(self) -> Trainable:
        return self.host.trainable()

    def publish(self, model: Any) -> None:
        self.host.publish(model)

    def counters(self) -> dict[str, float]:
        return self.host.counters()

    def close(self) -> None:
        self.host.close()


def send_share(group: Group, share: list[Completion] | str | VerifierUnavailable, note: Any = None) -> None:
    """A rank > 0: its answer to `RankHosts.sample` (`sample_calls`'s), and `note` for the rule's `check`."""
    group.gather((share, note))


def share_batches(rank: int, share: list[Completion] | str | VerifierUnavailable) -> Iterator[list[Completion]]:
    """What rank `rank`'s answer to `sample_calls` gives rank 0's loop: its share as one batch, or the
    one-line error of a rank that could not sample it or whose verifier is down."""
    if isinstance(share, VerifierUnavailable):
        raise VerifierUnavailable(f"rank {rank}'s share: {share}")
    if isinstance(share, str):
        raise RuntimeError(f"rank {rank} could not sample its share of the batch: {share}")
    if share:
        yield share


def sample_calls(host: PolicyHost, calls: list[tuple[Sequence[Task], list[Variant], int | None]],
                 verification: Any = None) -> list[Completion] | str | VerifierUnavailable:
    """Every completion of `calls` on `host`, or why sampling failed (one line, for rank 0 to raise).

    `verification`: this rank's verification pool (a `vrl.runtime.base.VerificationPool` of the run's
    verifier, built by `vrl.launch.follow`): each batch is queued to it as it finishes, so this rank
    verifies while it samples, and the share comes back `Verified` (its verdicts and the verifier's busy
    seconds); rank 0 then only shapes and records it. None: rank 0 verifies the completions. When half
    the share or more crashed and the verifier says it is down, the share is that `VerifierUnavailable`
    (rank 0 raises it, naming this rank), not verdicts that would score this rank's members 0."""
    out: list[Completion] = []
    pending: list[tuple[list[Attempt], Any]] = []
    busy = verification.busy_s if verification is not None else 0.0
    try:
        for shard, vs, s in calls:
            by_id = {t.id: t for t in shard}
            for batch in host.sample(shard, vs, s):
                out.extend(batch)
                if verification is not None:
                    pending += verification.submit([Attempt(task=by_id[c.task_id], completion=c) for c in batch])
        if verification is None:
            return out
        verdicts = [v for _, done in pending for v in done.result()]  # a verifier's failure is a verdict
        down = down_after_crashes(verdicts, verification.check_ready)  # down here only, say: rank 0 would score it 0
        if down is not None:
            return down
    except Exception as exc:  # noqa: BLE001 - rank 0 raises it; this rank must still answer the gather
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"
    return Verified(out, verdicts, verification.busy_s - busy)


def share_rows(order: list[int], world: int, micro_batch_size: int, rank: int) -> list[list[int]]:
    """This rank's micro-batches (row indices), the same number on every rank (FSDP2's collectives need
    equal work). The `order`ed rows are cut into `world × k` contiguous chunks of near-equal size, k as
    small as `micro_batch_size` allows; rank r takes chunks r, r + world, ... An empty chunk (fewer rows
    than chunks) is returned as [] and trained as a filler micro-batch with no weight in the loss."""
    n = len(order)
    k = max(1, -(-n // (world * micro_batch_size)))
    chunks = world * k
    bounds = [n * i // chunks for i in range(chunks + 1)]
    return [order[bounds[c] : bounds[c + 1]] for c in range(rank, chunks, world)]


def replicate(model: nn.Module) -> None:
    """Every rank's `model` takes rank 0's parameters and buffers, in place (however each loaded its
    copy, and whatever each one's random initialisation of new modules, such as LoRA adapters, drew)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


def shard(model: nn.Module, group: Group, compute_dtype: torch.dtype, trainable: bool = True,
          reshard_after_forward: bool = True, in_place: bool = False) -> nn.Module:
    """A sharded copy of `model` for training: fp32 parameters sharded over the ranks (the masters),
    forward and backward in `compute_dtype`, gradients summed (not averaged) in fp32 over the ranks.
    `in_place`: shard `model` itself (no whole copy beside it while it is converted and sharded; for a
    model nothing samples from afterwards).
    `reshard_after_forward=False` keeps each layer's gathered weights from its forward to its backward
    (one all-gather per layer and micro-batch instead of two, for a whole model's weights in
    `compute_dtype` held during a micro-batch)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    replicate(model)  # every rank starts from rank 0's weights
    train = model if in_place else copy.deepcopy(model)
    if trainable:
        train = train.float()
    mp = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                              reduce_dtype=torch.float32)
    layers = set(getattr(train, "_no_split_modules", None) or ())
    for module in train.modules():
        if type(module).__name__ in layers:
            fully_shard(module, mesh=group.mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(train, mesh=group.mesh, mp_policy=mp)
    # `completion_logprobs` runs the decoder and then the output head chunk by chunk, never the model's
    # own forward; but FSDP2 gathers the root's parameters (embeddings, final norm, head, tied or not)
    # around the root's call. So the decoder is reached *through* the root: its call gathers them, and
    # the root keeps them gathered after forward (FSDP2's root default), for the head's chunks and for
    # their recomputation in backward, which then reduce-scatters their gradients.
    decoder = train.get_decoder()
    train.forward = lambda *args, **kwargs: decoder(*args, **kwargs)
    train.get_decoder = lambda: train
    for module in train.modules():
        if isinstance(module, FSDPModule):
            # Every rank's micro-batch loss is already divided by the whole batch's normalisers: the
            # gradients add up. A plain SUM (gloo has no pre-multiplied sum).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return train


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) tensor; a collective for a DTensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


BUCKET_BYTES = 512 << 20
"""Bytes of whole tensors a publish gathers at a time (one bucket; a larger tensor is a bucket alone)."""


def gathered(sharded: nn.Module, dtypes: dict[str, torch.dtype], bucket_bytes: int | None = None
             ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The whole parameters of `sharded`, cast to `dtypes[name]` (the sampling copy's), in buckets of
    about `bucket_bytes`: a collective on every rank, which must draw every bucket in the same order.
    Each shard is cast before it is gathered (the same bits as casting the whole tensor, half the
    traffic from fp32 masters to bf16); a bucket's tensors are freed once the caller drops them."""
    limit = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    with torch.no_grad():
        for name, p in sharded.named_parameters():
            whole = full(p.detach().to(dtypes[name]))
            bucket.append((name, whole))
            size += whole.numel() * whole.element_size()
            if size >= limit:
                yield bucket
                bucket, size = [], 0
    if bucket:
        yield bucket


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `model.state_dict()` holds (persistent ones), by name."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {name: t for name, t in model.state_dict().items() if name not in params}


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's part of `tensors` (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total
