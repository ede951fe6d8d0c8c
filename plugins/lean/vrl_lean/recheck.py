"""Every Lean pass re-checked out of process before it stands.

The server's answer, the policy and the nonce show that Lean accepted this file; they cannot show that
no code of the model's ran in that Lean process, nor that the theorem proved means what the dataset's
statement means (an `open` or a hidden instance hypothesis can change that). So a pass is sent to a
re-check host (`vrl_lean.recheck_host`): the file is compiled in a fresh Lean process, and a trusted
checker in another fresh process replays every declaration through the kernel, compares the theorem's
type with the type of the trusted statement compiled on its own, and lists its axioms.

Hosts: `HttpRechecker` (a `recheck_host.py` server beside kimina-lean-server, e.g. in the same
container) and `LocalRechecker` (Lean on this machine, e.g. inside the kimina image on Modal).
`interpret` turns the host's answer into a decision; a host that cannot answer withholds the pass
(status `crashed`: an infrastructure failure, never a pass and never a wrong answer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import httpx

from vrl.types import Status
from vrl_lean import recheck_host
from vrl_lean.client import probe_health
from vrl_lean.policy import ALLOWED_AXIOMS, Submission, Theorem, prepare

SELF_TEST = "vrl_selftest"
SELF_TEST_HEADER = "import Mathlib\nimport Aesop\n"


@dataclass(frozen=True)
class Recheck:
    """What the re-check decided: `agree` (the pass stands) or why not, with the status to give."""

    outcome: str  # agree | defective_statement | type_mismatch | unchecked_declaration | extra_axiom | not_a_theorem | compile_error | timeout | unavailable
    status: Status
    detail: str
    elapsed_s: float

    @property
    def agrees(self) -> bool:
        return self.outcome == "agree"


def interpret(raw: dict[str, Any], name: str, elapsed_s: float | None = None) -> Recheck:
    """The decision for a host's answer (`recheck_host.recheck`'s format) about theorem `name`."""
    took = float(raw.get("elapsed_s") or 0.0) if elapsed_s is None else elapsed_s
    status, detail = raw.get("status"), str(raw.get("detail", ""))[:600]

    def no(outcome: str, verdict: Status, why: str) -> Recheck:
        return Recheck(outcome, verdict, f"re-check: {why}", took)

    if status == "timeout":
        return no("timeout", Status.TIMEOUT, f"{detail}; a pass that cannot be re-checked in time scores 0")
    if status == "reference_error":
        return no("defective_statement", Status.FAILED, f"the trusted statement alone does not compile ({detail}): "
                  "the row is defective (an unbound name is no longer auto-bound) and withheld from training")
    if status == "compile_error":
        return no("compile_error", Status.FAILED, f"a fresh Lean process refuses the file the server accepted ({detail})")
    if status != "checked":
        return no("unavailable", Status.CRASHED, f"could not run ({status}: {detail}); the pass is withheld")
    check = raw.get("check") or {}
    if not isinstance(check, dict) or check.get("name") != name:
        return no("unavailable", Status.CRASHED, f"the checker answered for {check.get('name')!r}, not {name!r}; the pass is withheld")
    if check.get("error") and any(w in str(check["error"]) for w in ("deterministic timeout", "heartbeats", "maximum recursion")):
        return no("timeout", Status.TIMEOUT, f"the kernel replay ran out of its limit ({str(check['error'])[:200]})")
    if check.get("error"):
        return no("unchecked_declaration", Status.FAILED,
                  f"the kernel refuses a declaration the server accepted: {str(check['error'])[:300]}")
    if check.get("kind") != "theorem":
        return no("not_a_theorem", Status.FAILED, f"`{name}` is a {check.get('kind')}, not a theorem checked by the kernel")
    if not check.get("type_matches"):
        return no("type_mismatch", Status.FAILED,
                  f"the type of `{name}` differs from the trusted statement's: "
                  f"`{str(check.get('candidate_type', '?'))[:200]}` vs `{str(check.get('reference_type', '?'))[:200]}`")
    axioms = [str(a) for a in check.get("axioms") or []]
    declared = [str(a) for a in check.get("declared_axioms") or []]
    unsafe = [str(a) for a in check.get("unsafe") or []]
    extra = [a for a in axioms if a not in ALLOWED_AXIOMS]
    if extra or declared:
        return no("extra_axiom", Status.FAILED, f"axioms beyond propext, Classical.choice, Quot.sound: {', '.join(extra + declared)}")
    if unsafe:
        return no("unchecked_declaration", Status.FAILED, f"`{name}` depends on unsafe or partial code: {', '.join(unsafe)}")
    replayed = check.get("replayed")
    return Recheck("agree", Status.PASSED, f"re-checked out of process ({replayed} declarations replayed, type and "
                   f"axioms agree, {took:.1f} s)", took)


def job(submission: Submission, timeout_s: float) -> dict[str, Any]:
    return {"name": submission.name, "code": submission.code, "reference": submission.reference, "timeout_s": timeout_s}


class Rechecker(ABC):
    """Where re-checks run. `recheck` never raises for a bad proof or a lost host: it returns a `Recheck`."""

    def __init__(self, timeout_s: float = 300.0, jobs: int = 2):
        if timeout_s <= 0 or jobs < 1:
            raise ValueError("a re-check needs a positive timeout and at least one job at a time")
        self.timeout_s = timeout_s
        self.jobs = jobs
        self._gate: asyncio.Semaphore | None = None

    async def recheck(self, submission: Submission) -> Recheck:
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.jobs)
        async with self._gate:
            start = time.monotonic()
            try:
                raw = await self._run(job(submission, self.timeout_s))
            except Exception as exc:  # noqa: BLE001 - a lost host withholds the pass, it never takes the batch down
                raw = {"status": "unavailable", "detail": f"{type(exc).__name__}: {exc}"}
            return interpret(raw, submission.name, time.monotonic() - start)

    @abstractmethod
    async def _run(self, job: dict[str, Any]) -> dict[str, Any]:
        """The host's raw answer for one job."""

    async def probe(self) -> str | None:
        """None if the host can take jobs; else what is wrong."""
        return None

    async def self_test(self) -> str | None:
        """None if the host re-checks as it must: a true statement comes back agreed, one whose proof
        proves another statement is refused. Else what went wrong, in one line. Run before the first
        iteration: a checker that does not compile on the host would otherwise withhold every pass
        while the run trains on."""
        checks = []
        for stated, proved in (("(2 : ℕ) + 2 = 4", "(2 : ℕ) + 2 = 4"), ("(2 : ℕ) + 2 = 5", "(2 : ℕ) + 3 = 5")):
            theorem = Theorem(SELF_TEST, SELF_TEST_HEADER, f"theorem {SELF_TEST} : {stated}")
            sub = prepare(f"```lean4\ntheorem {SELF_TEST} : {stated} := by\n  norm_num\n```", theorem, rechecked=True)
            sub = dataclasses.replace(sub, code=sub.code.replace(f": {stated} :=", f": {proved} :="))
            checks.append(await self.recheck(sub))
        true, false = checks
        if not true.agrees:
            return f"a true statement was not re-checked ({true.detail})"
        if false.agrees or false.outcome != "type_mismatch":
            return f"a proof of another statement was not refused as a type mismatch ({false.outcome}: {false.detail})"
        return None

    async def aclose(self) -> None:
        """Release connections."""


class LocalRechecker(Rechecker):
    """Lean on this machine: `lean` (default `lake env lean`) run in the Mathlib project `project`."""

    def __init__(self, project: str, lean: list[str] | None = None, timeout_s: float = 300.0, jobs: int = 2,
                 sandbox: str = "bwrap"):
        super().__init__(timeout_s, jobs)
        if sandbox not in recheck_host.SANDBOXES:
            raise ValueError(f"sandbox must be one of {', '.join(recheck_host.SANDBOXES)}, got {sandbox!r}")
        self.project, self.lean, self.sandbox = project, list(lean or ["lake", "env", "lean"]), sandbox

    async def _run(self, job: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(recheck_host.recheck, job, self.project, self.lean, sandbox=self.sandbox,
                                       max_timeout_s=self.timeout_s)

    async def probe(self) -> str | None:
        import shutil
        from pathlib import Path

        if not Path(self.project).is_dir():
            return f"no Lean project at {self.project!r}"
        if shutil.which(self.lean[0]) is None:
            return f"{self.lean[0]!r} is not on PATH"
        if self.sandbox == "bwrap":
            return await asyncio.to_thread(recheck_host.check_sandbox, self.project)
        return None


class HttpRechecker(Rechecker):
    """A `recheck_host.py` server at `url` (POST /recheck). `api_key`: the host's key; by default the
    value of VRL_RECHECK_API_KEY, the variable the host reads it from."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 300.0, jobs: int = 2,
                 transport: httpx.AsyncBaseTransport | None = None):
        super().__init__(timeout_s, jobs)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the re-check URL must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get(recheck_host.API_KEY_VAR) or None
        self._transport = transport
        self._http: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._http = httpx.AsyncClient(base_url=self.url, headers=headers, transport=self._transport,
                                           timeout=httpx.Timeout(self.timeout_s + 30.0, connect=10.0))
        return self._http

    async def _run(self, job: dict[str, Any]) -> dict[str, Any]:
        resp = await self._client().post("/recheck", json=job)
        if resp.status_code != 200:
            return {"status": "unavailable", "detail": f"HTTP {resp.status_code}: {resp.text[:200]}"}
        body = resp.json()
        return body if isinstance(body, dict) else {"status": "unavailable", "detail": "the answer is not a JSON object"}

    async def probe(self) -> str | None:
        return await probe_health(self._client())

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
