"""The Lean verifier: validity policy before and after, kimina-lean-server in between."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from vrl.types import Attempt, Status, Verdict
from vrl.verifier import Verifier, VerifierUnavailable
from vrl_lean.client import KiminaClient, LeanServerError
from vrl_lean.policy import DEFAULT_MAX_HEARTBEATS, Rejected, Submission, Theorem, judge, prepare
from vrl_lean.server import KIMINA, ServerSupervisor, ServerUnavailable

log = logging.getLogger(__name__)

START_SERVER = (
    f"start one with `docker run -d --rm -p 8000:8000 -e LEAN_SERVER_MAX_REPLS=4 {KIMINA.image}` and pass its URL "
    "with -o server=http://localhost:8000 (or `vrl verify --server URL`); see docs/plugins/lean.md (Docker or Modal)"
)
NO_SERVER = f"the lean verifier needs a kimina-lean-server: {START_SERVER}"


def theorem_of(data: Mapping[str, Any]) -> Theorem:
    """The trusted theorem stored in a task's data."""
    try:
        return Theorem(name=str(data["name"]), header=str(data["header"]), statement=str(data["statement"]))
    except KeyError as exc:
        raise ValueError(f"task data lacks {exc.args[0]!r}; a lean task needs name, header and statement") from None


class LeanVerifier(Verifier):
    """Judges Lean proofs: `prepare` (reject or rebuild, with a fresh nonce), check on the server,
    `judge` Lean's answer against that submission."""

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
    ):
        if client is None:
            url = server or (supervisor.url if supervisor else None)
            if not url:
                raise ValueError(NO_SERVER)
            client = KiminaClient(url, api_key, repls=repls, timeout_s=timeout_s, max_retries=max_retries)
        if max_heartbeats < 1:
            raise ValueError("max_heartbeats must be positive (0 would mean no limit)")
        self.client = client
        self.max_heartbeats = max_heartbeats
        self.supervisor = supervisor
        self._counter = 0

    async def verify(self, attempts: Sequence[Attempt]) -> list[Verdict]:
        verdicts: list[Verdict | None] = [None] * len(attempts)
        snippets: list[tuple[str, str]] = []
        sent: dict[str, tuple[int, Submission]] = {}
        for i, attempt in enumerate(attempts):
            try:
                theorem = theorem_of(attempt.task.data)
                submission = prepare(attempt.completion.text, theorem, self.max_heartbeats)
            except Rejected as exc:
                verdicts[i] = Verdict.fail(Status.REJECTED, str(exc))
                continue
            except ValueError as exc:
                verdicts[i] = Verdict.fail(Status.REJECTED, f"bad task: {exc}")
                continue
            self._counter += 1
            sid = f"{self._counter}-{attempt.task.id}"  # unique per process, so a result can only match its snippet
            snippets.append((sid, submission.code))
            sent[sid] = (i, submission)
        if snippets:
            if self.supervisor is not None:
                await self.supervisor.ensure_healthy()
            try:
                results = await self.client.check(snippets)
            except LeanServerError as exc:
                results = {sid: {"error": str(exc)} for sid, _ in snippets}
            for sid, (i, submission) in sent.items():
                verdicts[i] = judge(results[sid], submission)
            if self.supervisor is not None and any(r.get("transport_failure") for r in results.values()):
                await self.supervisor.restart("a request to the server timed out or lost its connection")
        return [v for v in verdicts if v is not None]

    async def check_ready(self) -> None:
        """Fail fast, with how to start a server, when none answers `GET /health` at the URL."""
        if self.supervisor is not None:
            try:
                await self.supervisor.ensure_healthy()
            except ServerUnavailable as exc:
                raise VerifierUnavailable(f"{exc}; see docs/plugins/lean.md") from None
            return
        why = await self.client.probe()
        if why:
            raise VerifierUnavailable(f"no kimina-lean-server is ready at {self.client.url} ({why}): {START_SERVER}")

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.supervisor is not None:
            await self.supervisor.stop()
