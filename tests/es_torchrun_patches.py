"""What tests/test_es_torchrun.py adds to the real `vrl train` (not a test module): every rank's θ checksum
after each ES update, a rank to break, and the rank that judged each verdict. Held around a run with
`patched()`: in the test's own process for one-process runs, and in every rank of a torchrun launch
(tests/torchrun_jobs.py with `"patch": "tests.es_torchrun_patches"`).

- VRL_TEST_CHECKSUMS=DIR: after each update, rank r appends "iteration checksum" to DIR/rank{r}.txt.
- VRL_TEST_KILL=r:i: rank r kills itself (SIGKILL, as the OOM killer or a lost node does) when it is
  asked for its share of iteration i.
- VRL_TEST_DRIFT=r:i: rank r applies iteration i's update with its first member's weight nudged (a rank
  whose θ drifts silently, as from a nondeterministic kernel).
- VRL_TEST_VERIFIER_ERROR=m: the letters verifier raises on every attempt of member m (a bug of the
  verifier's own, crashed verdicts with no reward, reported once on rank 0's console), wherever it runs.
- Every verdict counts the rank whose process judged it: `test/verified_by_rank{r}` in metrics.jsonl.

The variables are read when they are used, so each job of a launch may set its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from vrl.envs.letters import LettersVerifier
from vrl.optim.es import ES

apply, share, check = ES._apply, ES._follow_sample_share, LettersVerifier.check


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _at(variable: str) -> int | None:
    """The iteration at which this rank is to be broken by `variable` ("rank:iteration"), or None."""
    value = os.environ.get(variable)
    if not value:
        return None
    rank, iteration = map(int, value.split(":"))
    return iteration if rank == _rank() else None


def recorded_apply(self, record):
    if _at("VRL_TEST_DRIFT") == len(self.history.iterations):
        record = record.model_copy(update={"z": [record.z[0] + 1e-4, *record.z[1:]]})
    apply(self, record)
    if folder := os.environ.get("VRL_TEST_CHECKSUMS"):
        with open(Path(folder) / f"rank{_rank()}.txt", "a") as f:
            f.write(f"{len(self.history.iterations)} {self.host.checksum()}\n")


def killed_share(self, work):
    if _at("VRL_TEST_KILL") == len(self.history.iterations):
        os.kill(os.getpid(), signal.SIGKILL)
    share(self, work)


def counted_check(self, attempt):
    if os.environ.get("VRL_TEST_VERIFIER_ERROR") == str(attempt.completion.variant):
        raise RuntimeError(f"the test's verifier fails on member {attempt.completion.variant}")
    verdict = check(self, attempt)
    return verdict.model_copy(update={"metrics": {**verdict.metrics, f"test/verified_by_rank{_rank()}": 1.0}})


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """ES and the letters verifier instrumented as above inside the block; the originals back after."""
    ES._apply, ES._follow_sample_share, LettersVerifier.check = recorded_apply, killed_share, counted_check
    try:
        yield
    finally:
        ES._apply, ES._follow_sample_share, LettersVerifier.check = apply, share, check
