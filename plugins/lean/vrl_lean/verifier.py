"""The Lean verifier: validity policy before and after, kimina-lean-server in between."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vrl.types import Attempt, Status, Verdict
from vrl.verifier import Verifier, VerifierUnavailable
from vrl_lean import canary
from vrl_lean.canary import CanaryPlan
from vrl_lean.client import KiminaClient, LeanServerError
from vrl_lean.policy import DEFAULT_MAX_HEARTBEATS, Rejected, Submission, Theorem, judge, prepare
from vrl_lean.recheck import Rechecker
from vrl_lean.server import KIMINA, ServerSupervisor, ServerUnavailable

log = logging.getLogger(__name__)

START_SERVER = (
    f"start one with `docker run -d --rm -p 8000:8000 -e LEAN_SERVER_MAX_REPLS=4 {KIMINA.image}` and pass its URL "
    "with -o server=http://localhost:8000 (or `vrl verify --server URL`); see docs/plugins/lean.md (Docker or Modal)"
)
NO_SERVER = f"the lean verifier needs a kimina-lean-server: {START_SERVER}"
START_RECHECK = (
    "start recheck_host.py beside the Lean server (docs/plugins/lean.md, 'The re-check') and pass -o recheck=URL, "
    "or -o recheck=local -o lean_project=DIR where Lean and Mathlib are installed"
)


def theorem_of(data: Mapping[str, Any]) -> Theorem:
    """The trusted theorem stored in a task's data."""
    try:
        return Theorem(name=str(data["name"]), header=str(data["header"]), statement=str(data["statement"]))
    except KeyError as exc:
        raise ValueError(f"task data lacks {exc.args[0]!r}; a lean task needs name, header and statement") from None


@dataclass
class _Job:
    """One file sent to Lean: a real attempt's, or a canary's (attached to the attempt at `index`)."""

    index: int
    submission: Submission
    canary: str | None = None  # what the canary is ("re-targeted attempt", "planted: ..."), None for a real attempt
    verdict: Verdict | None = None


class LeanVerifier(Verifier):
    """Judges Lean proofs: `prepare` (reject or rebuild, with a fresh nonce), check on the server,
    `judge` Lean's answer against that submission, then re-check every pass out of process
    (`recheck`; a pass without a re-check never stands while one is configured) and judge the
    canaries mixed in (`canary_rate`; see `vrl_lean.canary`)."""

    name = "lean"

    def __init__(
        self,
        server: str | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = 60.0,
        max_heartbeats: int = DEFAULT_MAX_HEARTBEATS,
        repls: int = 4,
        max_retries: int = 5,
        client: KiminaClient | None = None,
        supervisor: ServerSupervisor | None = None,
        recheck: Rechecker | None = None,
        canary_rate: float = 0.0,
        on_exploit: str = "stop",
        canary_seed: int | None = None,
    ):
        if client is None:
            url = server or (supervisor.url if supervisor else None)
            if not url:
                raise ValueError(NO_SERVER)
            client = KiminaClient(url, api_key, repls=repls, timeout_s=timeout_s, max_retries=max_retries)
        if max_heartbeats < 1:
            raise ValueError("max_heartbeats must be positive (0 would mean no limit)")
        if on_exploit not in ("stop", "count"):
            raise ValueError("on_exploit must be 'stop' or 'count'")
        self.client = client
        self.max_heartbeats = max_heartbeats
        self.supervisor = supervisor
        self.rechecker = recheck
        self.canaries = CanaryPlan(canary_rate, canary_seed) if canary_rate > 0 else None
        self.on_exploit = on_exploit
        self._counter = 0

    def _prepare(self, text: str, theorem: Theorem, target: str | None = None) -> Submission:
        return prepare(text, theorem, self.max_heartbeats, rechecked=self.rechecker is not None, target=target)

    def _canary(self, jobs: list[_Job], metrics: Counter[str], index: int, text: str, theorem: Theorem, label: str) -> None:
        """Add a canary for attempt `index`; one the policy refuses is counted and never sent."""
        metrics["lean/canaries"] += 1
        try:
            jobs.append(_Job(index, self._prepare(text, theorem, canary.false_statement(theorem)), canary=label))
        except Rejected:
            metrics["lean/canaries_refused"] += 1

    async def verify(self, attempts: Sequence[Attempt]) -> list[Verdict]:
        verdicts: list[Verdict | None] = [None] * len(attempts)
        metrics: list[Counter[str]] = [Counter() for _ in attempts]  # each attempt's counters (Verdict.metrics)
        exploits: dict[int, str] = {}  # attempt -> the first of its canaries that passed
        theorems: list[Theorem | None] = [None] * len(attempts)
        jobs: list[_Job] = []
        for i, attempt in enumerate(attempts):
            try:
                theorem = theorems[i] = theorem_of(attempt.task.data)
                jobs.append(_Job(i, self._prepare(attempt.completion.text, theorem)))
            except Rejected as exc:
                verdicts[i] = Verdict.fail(Status.REJECTED, str(exc))
            except ValueError as exc:
                verdicts[i] = Verdict.fail(Status.REJECTED, f"bad task: {exc}")
                continue
            if self.canaries is not None:
                if self.canaries.draw():
                    self._canary(jobs, metrics[i], i, attempt.completion.text, theorem, "re-targeted attempt")
                if self.canaries.draw():
                    label, text = self.canaries.pick_planted(theorem)
                    self._canary(jobs, metrics[i], i, text, theorem, f"planted: {label}")
        await self._check(jobs)
        # Every attempt Lean passed gets a re-targeted canary (unless it has one), checked while the passes are re-checked.
        later: list[_Job] = []
        if self.canaries is not None:
            watched = {j.index for j in jobs if j.canary == "re-targeted attempt"}
            for j in jobs:
                if j.canary is None and j.verdict.passed and j.index not in watched:
                    self._canary(later, metrics[j.index], j.index, attempts[j.index].completion.text, theorems[j.index],
                                 "re-targeted attempt")
        await asyncio.gather(self._check(later), self._recheck(jobs, metrics))
        await self._recheck(later, metrics)
        for j in jobs + later:
            if j.canary is None:
                verdicts[j.index] = j.verdict
            elif j.verdict.passed:
                metrics[j.index]["lean/canary_exploits"] += 1
                exploits.setdefault(j.index, j.canary)
                log.error("canary exploit on task %s (%s): %s", attempts[j.index].task.id, j.canary, j.verdict.detail)
        out = []
        for i, verdict in enumerate(verdicts):
            assert verdict is not None
            alarm = None
            if i in exploits and self.on_exploit == "stop":
                label = exploits[i]
                alarm = (f"a canary passed: with its statement replaced by `theorem {theorems[i].name} : False`, the "
                         f"{'completion' if label == 're-targeted attempt' else 'planted attack'} ({label}) was accepted")
            counted = Counter(verdict.metrics)
            counted.update(metrics[i])  # judge's own counters (a defective statement) and this batch's
            out.append(verdict.model_copy(update={"metrics": dict(counted), "alarm": alarm}) if metrics[i] or alarm else verdict)
        return out

    async def _check(self, jobs: list[_Job]) -> None:
        """Send the jobs' files to the server and judge each answer (sets `job.verdict`)."""
        if not jobs:
            return
        snippets: list[tuple[str, str]] = []
        sent: dict[str, _Job] = {}
        for j in jobs:
            self._counter += 1
            sid = f"{self._counter}-{j.submission.name}"  # unique per process, so a result can only match its snippet
            snippets.append((sid, j.submission.code))
            sent[sid] = j
        if self.supervisor is not None:
            await self.supervisor.ensure_healthy()
        try:
            results = await self.client.check(snippets)
        except LeanServerError as exc:
            results = {sid: {"error": str(exc)} for sid, _ in snippets}
        for sid, j in sent.items():
            j.verdict = judge(results[sid], j.submission)
        if self.supervisor is not None and any(r.get("transport_failure") for r in results.values()):
            await self.supervisor.restart("a request to the server timed out or lost its connection")

    async def _recheck(self, jobs: list[_Job], metrics: list[Counter[str]]) -> None:
        """Re-check every pass out of process; a pass stands only if the re-check agrees."""
        if self.rechecker is None:
            return
        passed = [j for j in jobs if j.verdict is not None and j.verdict.passed]
        checks = await asyncio.gather(*(self.rechecker.recheck(j.submission) for j in passed))
        for j, check in zip(passed, checks):
            m = metrics[j.index]
            m["lean/rechecks"] += 1
            m["lean/recheck_s"] += check.elapsed_s
            elapsed = j.verdict.elapsed_s + check.elapsed_s
            if check.outcome == "defective_statement":
                m["lean/defective_statement"] += 1
            if check.agrees:
                j.verdict = Verdict.ok(f"{j.verdict.detail}; {check.detail}", elapsed_s=elapsed)
            else:
                if check.status is not Status.CRASHED:
                    m["lean/recheck_overturned"] += 1
                j.verdict = Verdict.fail(check.status, f"{check.detail} (the Lean server had accepted it)", elapsed_s=elapsed)

    async def check_ready(self) -> None:
        """Fail fast, with how to start a server, when none answers `GET /health` at the URL."""
        if self.supervisor is not None:
            try:
                await self.supervisor.ensure_healthy()
            except ServerUnavailable as exc:
                raise VerifierUnavailable(f"{exc}; see docs/plugins/lean.md") from None
            await self._check_recheck()
            return
        why = await self.client.probe()
        if why:
            raise VerifierUnavailable(f"no kimina-lean-server is ready at {self.client.url} ({why}): {START_SERVER}")
        await self._check_recheck()

    async def _check_recheck(self) -> None:
        if self.rechecker is not None:
            why = await self.rechecker.probe()
            if why:
                raise VerifierUnavailable(f"the re-check host cannot take jobs ({why}): {START_RECHECK}")
            why = await self.rechecker.self_test()
            if why:
                raise VerifierUnavailable(f"the re-check host failed its self-test: {why}; see docs/plugins/lean.md "
                                          "('The re-check')")

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.rechecker is not None:
            await self.rechecker.aclose()
        if self.supervisor is not None:
            await self.supervisor.stop()
