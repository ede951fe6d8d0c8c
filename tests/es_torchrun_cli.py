"""`vrl train` that records every rank's θ checksum after each ES update, and can break one rank, started by
tests/test_es_torchrun.py (not a test module), alone or under `torchrun`:

    torchrun --nproc-per-node 2 tests/es_torchrun_cli.py train …

- VRL_TEST_CHECKSUMS=DIR: after each update, rank r appends "iteration checksum" to DIR/rank{r}.txt.
- VRL_TEST_KILL=r:i: rank r kills itself (SIGKILL, as the OOM killer or a lost node does) when it is
  asked for its share of iteration i.
- VRL_TEST_DRIFT=r:i: rank r applies iteration i's update with its first member's weight nudged (a rank
  whose θ drifts silently, as from a nondeterministic kernel).
- VRL_TEST_VERIFIER_ERROR=m: the letters verifier raises on every attempt of member m (a bug of the
  verifier's own, scored as crashed and reported once on rank 0's console), wherever it runs.
- Every verdict counts the rank whose process judged it: `test/verified_by_rank{r}` in metrics.jsonl.

Everything else is the real `vrl train`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from vrl.cli import main
from vrl.envs.letters import LettersVerifier
from vrl.optim.es import ES

RANK = int(os.environ.get("RANK", "0"))


def _at(variable: str) -> int | None:
    """The iteration at which this rank is to be broken by `variable` ("rank:iteration"), or None."""
    value = os.environ.get(variable)
    if not value:
        return None
    rank, iteration = map(int, value.split(":"))
    return iteration if rank == RANK else None


apply, share = ES._apply, ES._follow_sample_share


def recorded_apply(self, record):
    if _at("VRL_TEST_DRIFT") == len(self.history.iterations):
        record = record.model_copy(update={"z": [record.z[0] + 1e-4, *record.z[1:]]})
    apply(self, record)
    if folder := os.environ.get("VRL_TEST_CHECKSUMS"):
        with open(Path(folder) / f"rank{RANK}.txt", "a") as f:
            f.write(f"{len(self.history.iterations)} {self.host.checksum()}\n")


def killed_share(self, work):
    if _at("VRL_TEST_KILL") == len(self.history.iterations):
        os.kill(os.getpid(), signal.SIGKILL)
    share(self, work)


def counted_check(self, attempt):
    if os.environ.get("VRL_TEST_VERIFIER_ERROR") == str(attempt.completion.variant):
        raise RuntimeError(f"the test's verifier fails on member {attempt.completion.variant}")
    verdict = check(self, attempt)
    return verdict.model_copy(update={"metrics": {**verdict.metrics, f"test/verified_by_rank{RANK}": 1.0}})


check = LettersVerifier.check
ES._apply, ES._follow_sample_share = recorded_apply, killed_share
LettersVerifier.check = counted_check

if __name__ == "__main__":
    main()
