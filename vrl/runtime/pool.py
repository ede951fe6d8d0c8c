"""A pool of hosts with identical weights, sampled as one host.

`HostPool.sample` deals an iteration's variants over the hosts (ES: members round-robin, each host
running its members in turn on its own copy of the weights) or, when there are fewer variants than
hosts (GRPO's one variant), shards the tasks; every host runs in its own thread and completion
batches stream back as each host finishes them. Weight changes go to every host, so the copies stay
identical: the same seeded updates, or the same trained weights published to each; the hosts apply
them side by side (one thread each), so a pool's update costs about one host's, not the sum. A
streamed push (`WeightStream`, FSDP2's gathered buckets) reaches every host a bucket at a time, in
lockstep, without a whole copy.

Sampling seeds depend on the task's position in the iteration, not on the host (`shard_seed`), so a
pool returns what a single host returns.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from vrl.policy import PerturbationSpec, PolicyHost, Trainable, Variant, WeightsInfo, WeightStream, deal
from vrl.types import Completion, Task
from vrl.weights.update import Update

_DONE = object()


class HostPool(PolicyHost):
    """K hosts holding the same weights; see the module docstring."""

    name = "pool"

    def __init__(self, hosts: Sequence[PolicyHost], granule: int = 1):
        if not hosts:
            raise ValueError("a host pool needs at least one host")
        self.hosts = list(hosts)
        self.granule = max(1, granule)  # task shards start at multiples of this (the hosts' batch size)
        self._followed = False  # the other hosts were told they sample the first host's trained copy

    # -- sampling ------------------------------------------------------------------------------------
    def plan(self, tasks: Sequence[Task], variants: Sequence[Variant], seed: int | None
             ) -> list[list[tuple[Sequence[Task], list[Variant], int | None]]]:
        """Per host, the (tasks, variants, seed) calls it makes this iteration (`deal`)."""
        return deal(tasks, variants, seed, len(self.hosts), self.granule)

    def sample(self, tasks: Sequence[Task], variants: Sequence[Variant], seed: int | None = None
               ) -> Iterator[list[Completion]]:
        if len(self.hosts) == 1:
            yield from self.hosts[0].sample(tasks, variants, seed)
            return
        work = self.plan(tasks, variants, seed)
        out: queue.Queue[Any] = queue.Queue()
        stop = threading.Event()

        def run(host: PolicyHost, calls: list[tuple[Sequence[Task], list[Variant], int | None]]) -> None:
            try:
                for shard, vs, s in calls:
                    stream = host.sample(shard, vs, s)
                    try:
                        for batch in stream:
                            out.put(batch)
                            if stop.is_set():
                                return
                    finally:
                        stream.close()  # an engine aborts what it still has running
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer's thread
                out.put(exc)
            finally:
                out.put(_DONE)

        threads = [threading.Thread(target=run, args=(host, calls), name=f"vrl-host-{i}", daemon=True)
                   for i, (host, calls) in enumerate(zip(self.hosts, work)) if calls]
        for t in threads:
            t.start()
        running = len(threads)
        try:
            while running:
                item = out.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            stop.set()
            for t in threads:
                t.join()

    # -- weights: every copy changes the same way ---------------------------------------------------
    def _each(self, fn: Any) -> list[Any]:
        """`fn(host)` for every host, side by side (one thread each); results in host order. Every
        host finishes before the first error, if any, is raised."""
        if len(self.hosts) == 1:
            return [fn(self.hosts[0])]
        return self._side_by_side(lambda i, host: fn(host))()

    def _side_by_side(self, fn: Any) -> Any:
        """Start `fn(i, host)` for every host, one thread each, and return the wait: it joins them all, then
        raises the first error, if any, or returns the results in host order. The caller's thread is free
        meanwhile (`_fan_out` draws the stream there)."""
        results: list[Any] = [None] * len(self.hosts)
        errors: list[BaseException] = []

        def run(i: int, host: PolicyHost) -> None:
            try:
                results[i] = fn(i, host)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the wait, after every host finished
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i, h), name=f"vrl-host-{i}") for i, h in enumerate(self.hosts)]
        for t in threads:
            t.start()

        def wait() -> list[Any]:
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            return results

        return wait

    def episodes(self, runner: Any) -> None:
        self._each(lambda h: h.episodes(runner))

    def perturbations(self, spec: PerturbationSpec) -> WeightsInfo:
        infos = self._each(lambda h: h.perturbations(spec))
        if any(i != infos[0] for i in infos[1:]):
            raise RuntimeError(f"the pool's hosts select different parameters: {[(i.numel, i.dtype) for i in infos]}")
        return infos[0]

    def update(self, update: Update) -> None:
        self._each(lambda h: h.update(update))

    def state(self) -> dict[str, Any]:
        return self.hosts[0].state()  # the copies are identical

    def load_state(self, state: dict[str, Any]) -> None:
        self._each(lambda h: h.load_state(state))

    def trainable(self) -> Trainable:
        """The first host's copy; on the first call every other host is told it samples that copy's weights
        (`follow_trained`), so each engine's completions carry what the first one's do (vLLM: sampling log-probs)."""
        trainable = self.hosts[0].trainable()
        if not self._followed:
            for host in self.hosts[1:]:
                host.follow_trained()
            self._followed = True
        return trainable

    def publish(self, model: Any) -> None:
        if isinstance(model, WeightStream) and len(self.hosts) > 1:
            self._fan_out(model)
        else:
            self._each(lambda h: h.publish(model))

    def _fan_out(self, stream: WeightStream) -> None:
        """Publish one `WeightStream` to every host, bucket by bucket in lockstep: each host publishes
        from a stream of its own (in its thread), and the next bucket is drawn here, in the caller's thread
        (under torchrun the draws are collectives), only once every host is done with this one, as the
        stream's contract asks. No whole copy is made. A host that stops early (skips the push or fails)
        is left out of the rest; the stream is drawn to its end whatever the hosts do, and the first
        error is raised once every host has finished."""
        k = len(self.hosts)
        cond = threading.Condition()
        state: dict[str, Any] = {"index": -1, "bucket": None, "over": False, "failed": None}
        wants = [0] * k  # the bucket each host asks for next (it is done with every earlier one)
        ended = [False] * k

        def buckets(i: int) -> Iterator[list[tuple[str, Any]]]:
            b = 0
            while True:
                with cond:
                    wants[i] = b
                    cond.notify_all()
                    cond.wait_for(lambda b=b: state["index"] >= b or state["over"])
                    if state["failed"] is not None:
                        raise RuntimeError(f"the weight stream failed while host {i} loaded it: {state['failed']}")
                    if state["index"] < b:
                        return
                    bucket = state["bucket"]
                yield bucket
                b += 1

        def publish(i: int, host: PolicyHost) -> None:
            try:
                host.publish(WeightStream(buckets(i)))
            finally:
                with cond:
                    ended[i] = True
                    cond.notify_all()

        wait = self._side_by_side(publish)
        try:
            for b, bucket in enumerate(stream):
                with cond:
                    state["index"], state["bucket"] = b, bucket
                    cond.notify_all()
                    cond.wait_for(lambda b=b: all(ended[i] or wants[i] > b for i in range(k)))
                    state["bucket"] = None
        except BaseException as exc:
            state["failed"] = exc
            raise
        finally:
            with cond:
                state["over"] = True
                cond.notify_all()
            if state["failed"] is None:
                wait()
            else:  # the hosts fail because the stream did: the stream's error is the one raised
                with contextlib.suppress(BaseException):
                    wait()

    def decouple(self) -> None:
        for h in self.hosts:
            h.decouple()

    def counters(self) -> dict[str, float]:
        """Each counter's slowest value over the hosts (they move their weights side by side)."""
        out: dict[str, float] = {}
        for h in self.hosts:
            for name, value in h.counters().items():
                out[name] = max(value, out.get(name, value))
        return out

    def close(self) -> None:
        errors = []
        for h in self.hosts:
            try:
                h.close()
            except Exception as exc:  # noqa: BLE001 - close every host, then report
                errors.append(exc)
        if errors:
            raise errors[0]
