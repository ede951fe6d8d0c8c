"""One orchestrator per detached run: a lease in a `modal.Dict`, checked with `FunctionCall.from_id`.

A Volume has no cross-container lock and its last writer wins, so two orchestrators on one run would
interleave its metrics and ES history. The lease says which function call owns run NAME on Volume V:

    ("V", "NAME", 1) -> "fc-first"      claimed with put(skip_if_exists=True): one claimant wins
    ("V", "NAME", 2) -> "fc-resumed"    each later owner claims the next generation
    ("V", "NAME")    -> 2               where the newest generation is (a hint; a reader probes past it)

The owner is the call of the newest generation. A call takes over only when that owner is finished
(`FunctionCall.from_id(owner).get(timeout=0)` no longer raises TimeoutError), when it is that owner
(Modal restarted its input after a preemption or a crash: the call id stays), or when the owner handed
the run to it (self-continuation before the function timeout). An owner checks at each iteration
that no later generation exists, so one that lost its lease stops before it writes again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vrl.errors import UsageError

#: The `modal.Dict` of run leases (one per workspace; keys carry the Volume and the run name).
LEASES = "vrl-run-leases"


class RunLeaseError(UsageError):
    """Another orchestrator owns the run (or took it over): one line saying which call and what to do."""


def already_exists(name: str, volume: str) -> str:
    """The refusal of a new detached run whose name exists on the Volume."""
    return (f"detached run {name!r} already exists on the Volume {volume!r}; continue it with "
            f"`vrl modal resume {name}` or choose another --name")


@dataclass(frozen=True)
class Owner:
    generation: int
    call_id: str


def call_outcome(call_id: str) -> tuple[str, str | None]:
    """'running', 'finished' or 'failed' of a function call, with the remote exception (one line) when it
    failed: what `FunctionCall.get` raises, e.g. a DeserializationError before any vrl code ran."""
    import modal

    try:
        modal.FunctionCall.from_id(call_id).get(timeout=0)
    except TimeoutError:  # the builtin: modal's poll raises it while the call is unfinished
        return "running", None
    except Exception as exc:  # noqa: BLE001 - it failed, was cancelled, or its output expired
        return "failed", f"{type(exc).__name__}: {exc}".splitlines()[0]
    return "finished", None


def call_alive(call_id: str) -> bool:
    """Whether a function call still has an unfinished input (running, queued or about to be restarted)."""
    return call_outcome(call_id)[0] == "running"


class RunLease:
    """The lease of run `name` on Volume `volume` (`store`: the Dict; `alive(call_id)`: is that call running)."""

    def __init__(self, volume: str, name: str, store: Any = None, alive: Any = call_alive, outcome: Any = None):
        if store is None:
            import modal

            store = modal.Dict.from_name(LEASES, create_if_missing=True)
        self.volume, self.name, self.store, self.alive = volume, name, store, alive
        if outcome is None:  # `call_outcome`, or what a given `alive` says (tests pass one)
            outcome = call_outcome if alive is call_alive else (lambda call: ("running" if alive(call) else "finished",
                                                                              None))
        self.outcome = outcome

    def _key(self, generation: int) -> tuple[str, str, int]:
        return (self.volume, self.name, generation)

    def owner(self) -> Owner | None:
        """The newest claim, or None if the run was never claimed."""
        generation = max(int(self.store.get((self.volume, self.name), 0) or 0), 0)
        while self.store.contains(self._key(generation + 1)):
            generation += 1
        if generation == 0:
            return None
        record = self.store.get(self._key(generation))
        return Owner(generation, record["call"])

    def check_free(self, predecessor: str | None = None) -> Owner | None:
        """Refuse while another live call owns the run (not `predecessor`, which is handing it over)."""
        owner = self.owner()
        busy = owner.call_id if owner is not None and owner.call_id != predecessor else None
        if busy is not None and not self.alive(busy):
            busy = self.latest_call()  # a continuation that was spawned but has not claimed the run yet
        if busy is not None and busy != predecessor and self.alive(busy):
            raise RunLeaseError(
                f"detached run {self.name!r} on Volume {self.volume!r} is being trained by Modal call "
                f"{busy}; wait for it (`vrl modal status {self.name}`) or stop it "
                f"(`vrl modal stop {self.name}`) first"
            )
        return owner

    def claim(self, call_id: str, predecessor: str | None = None) -> int:
        """Own the run as `call_id` (its own restart keeps its generation); return the generation."""
        owner = self.owner()
        if owner is not None and owner.call_id == call_id:
            return owner.generation  # Modal restarted this call's input: it still owns the run
        owner = self.check_free(predecessor)
        generation = owner.generation + 1 if owner else 1
        if not self.store.put(self._key(generation), {"call": call_id, "at": time.time()}, skip_if_exists=True):
            winner = self.store.get(self._key(generation))["call"]
            raise RunLeaseError(f"detached run {self.name!r} on Volume {self.volume!r} was just started by Modal "
                                f"call {winner}; see `vrl modal status {self.name}`")
        self.store.put((self.volume, self.name), generation)
        return generation

    def check_owned(self, generation: int) -> None:
        """Raise if a later call claimed the run since `generation` (this orchestrator must stop writing)."""
        if self.store.contains(self._key(generation + 1)):
            newer = self.owner()
            raise RunLeaseError(f"detached run {self.name!r} was taken over by Modal call "
                                f"{newer.call_id if newer else '?'}; this orchestrator stops")

    def hand_over(self, call_id: str, successor: str) -> None:
        """Record that `call_id` passed the run to `successor` (a continuation): a re-run of `call_id`'s
        input must not take the run back."""
        self.store.put((self.volume, self.name, "successor", call_id), successor)

    def successor_of(self, call_id: str) -> str | None:
        return self.store.get((self.volume, self.name, "successor", call_id))

    # -- the launch record: kept in the Dict, so it outlives a run directory that a failed start removed --
    def record_launch(self, call_id: str, app_id: str | None) -> None:
        """Note the call that starts (or resumes) the run and its app (`vrl modal stop` stops it); a record
        of a call still running stays (a start that its orchestrator will refuse does not replace it)."""
        record = self.launch()
        if record and record.get("call") and record.get("ended") is None and self.alive(record["call"]):
            return
        self.store.put((self.volume, self.name, "launch"), {"call": call_id, "app": app_id, "started": time.time(),
                                                             "ended": None, "error": None})

    def record_end(self, error: str | None) -> None:
        """Note how the run's last call ended (None: without an error)."""
        record = self.launch() or {"call": None, "app": None, "started": None}
        self.store.put((self.volume, self.name, "launch"), {**record, "ended": time.time(), "error": error})

    def launch(self) -> dict[str, Any] | None:
        """The launch record: call, app, started, ended, error (None: never launched from this workspace)."""
        return self.store.get((self.volume, self.name, "launch"))

    def latest_call(self) -> str | None:
        """The owner's call, or the call it handed the run to if that one has not claimed it yet."""
        owner = self.owner()
        call = owner.call_id if owner else None
        while call is not None and (successor := self.successor_of(call)) is not None:
            call = successor
        return call
