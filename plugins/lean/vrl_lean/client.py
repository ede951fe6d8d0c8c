"""An async client for kimina-lean-server (`POST /api/check`, `GET /health`).

Facts about the server it relies on (kimina-lean-server 2.0): a request carries
`{"snippets": [{"id", "code"}], "timeout", "reuse", "debug"}` with unique ids; every snippet waits up
to LEAN_SERVER_MAX_WAIT (60 s) for a free REPL, then the whole request fails with 429; one crashing
REPL fails the whole request with 500; the header (leading `import` lines) is split off by position
and its REPL reused. Hence: batches no larger than the server's REPL count, one batch in flight at a
time, an HTTP timeout above queueing + header + proof time, retries only where a retry can help, and a
500 split in halves until only the bad snippet fails.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Sequence
from typing import Any

import httpx

log = logging.getLogger(__name__)

Result = dict[str, Any]


class LeanServerError(RuntimeError):
    """The server refused the request in a way no retry can fix (bad key, wrong URL, bad request)."""


HEALTH_TIMEOUT_S = 10.0
"""Seconds a `/health` probe waits for its answer (the preflight's, before a run starts)."""


async def probe_health(http: httpx.AsyncClient, timeout_s: float | None = None) -> str | None:
    """None if `GET /health` at `http`'s base URL answers `{"status": "ok"}` within `timeout_s` (default
    `HEALTH_TIMEOUT_S`); else what went wrong, in one line. No retries. kimina-lean-server and
    `recheck_host` answer it alike."""
    timeout_s = HEALTH_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        resp = await http.get("/health", timeout=timeout_s)
    except httpx.TimeoutException:
        return f"/health did not answer within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    try:
        status = resp.json().get("status") if resp.status_code == 200 else None
    except (ValueError, AttributeError):
        status = None
    if status != "ok":
        return f"/health answered {resp.status_code} {resp.text[:80]!r}, not {{\"status\": \"ok\"}}"
    return None


class KiminaClient:
    """One connection pool to one kimina-lean-server; results are joined to snippets by id."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        repls: int = 4,
        timeout_s: float = 60.0,
        queue_wait_s: float = 60.0,
        max_retries: int = 5,
        backoff_s: float = 1.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Lean server URL must start with http:// or https://, got {url!r}")
        if repls < 1:
            raise ValueError("repls (the server's REPL count, LEAN_SERVER_MAX_REPLS) must be at least 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s (per-proof Lean timeout) must be positive")
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.repls = repls
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        # The server times the header import and the proof separately, after queueing for a REPL;
        # the margin covers the transfer and the server's own bookkeeping.
        self.http_timeout_s = queue_wait_s + 2 * timeout_s + min(10.0, timeout_s)
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._gate: asyncio.Semaphore | None = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            limits = httpx.Limits(max_connections=self.repls + 2, max_keepalive_connections=self.repls + 2)
            self._http = httpx.AsyncClient(
                base_url=self.url, headers=headers, timeout=httpx.Timeout(self.http_timeout_s, connect=min(10.0, self.http_timeout_s)),
                limits=limits, transport=self._transport,
            )
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def health(self) -> bool:
        """True if `GET /health` answers `{"status": "ok"}`."""
        return await self.probe() is None

    async def probe(self, timeout_s: float | None = None) -> str | None:
        """None if `GET /health` answers `{"status": "ok"}` within `timeout_s` (default `HEALTH_TIMEOUT_S`);
        else what went wrong. No retries."""
        return await probe_health(self._client(), timeout_s)

    async def check(self, snippets: Sequence[tuple[str, str]]) -> dict[str, Result]:
        """Check `(id, code)` pairs; return each id's result (`error` or `response`, and `time`).

        Transport failures become results with an `error` (a timeout says "timed out"), so every id
        gets an answer. Raises `LeanServerError` only for refusals that retrying cannot fix.
        """
        ids = [sid for sid, _ in snippets]
        if len(set(ids)) != len(ids):
            raise ValueError("snippet ids must be unique within one check() call")
        if self._gate is None:
            self._gate = asyncio.Semaphore(1)  # a batch already fills every REPL
        results: dict[str, Result] = {}
        for start in range(0, len(snippets), self.repls):
            batch = list(snippets[start : start + self.repls])
            async with self._gate:
                results.update(await self._run(batch))
        return results

    async def _run(self, batch: list[tuple[str, str]]) -> dict[str, Result]:
        """Send one batch; on a server error split it so only the crashing snippet fails."""
        status, payload = await self._post(batch)
        if status == 200:
            return self._join(batch, payload)
        if status >= 500 and len(batch) > 1:
            mid = len(batch) // 2
            log.info("Lean server answered %d for a batch of %d; retrying in halves", status, len(batch))
            left, right = await asyncio.gather(self._run(batch[:mid]), self._run(batch[mid:]))
            return {**left, **right}
        # status 0: the request never got an answer (timeout, connection lost): the server may be hung.
        return {sid: {"error": str(payload), "transport_failure": status == 0} for sid, _ in batch}

    async def _post(self, batch: list[tuple[str, str]]) -> tuple[int, Any]:
        """(status, JSON results) for 200; (status or 0, reason) after retries are exhausted."""
        body = {
            "snippets": [{"id": sid, "code": code} for sid, code in batch],
            "timeout": math.ceil(self.timeout_s),
            "reuse": True,
            "debug": False,
        }
        reason, retry_after = "", None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._delay(attempt, retry_after))
                retry_after = None
            try:
                resp = await self._client().post("/api/check", json=body)
            except httpx.TimeoutException as exc:
                if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
                    reason = f"could not connect to the Lean server at {self.url} ({type(exc).__name__})"
                    continue
                return 0, f"HTTP request timed out after {self.http_timeout_s:.0f} s waiting for the Lean server"
            except httpx.TransportError as exc:  # refused, reset, dropped mid-answer
                reason = f"connection to the Lean server at {self.url} failed: {type(exc).__name__}: {exc}"
                continue
            if resp.status_code == 200:
                try:
                    return 200, resp.json()
                except ValueError:
                    return 502, "the Lean server answered 200 with a body that is not JSON"
            detail = _detail(resp)
            if resp.status_code in (429, 503):
                reason = f"Lean server busy ({resp.status_code}: {detail})"
                retry_after = resp.headers.get("retry-after")
                continue
            if resp.status_code >= 500:
                return resp.status_code, f"Lean server error {resp.status_code}: {detail}"
            raise LeanServerError(_explain_4xx(resp.status_code, detail, self.url))
        return 0, f"{reason} (gave up after {self.max_retries} retries)"

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        """Exponential backoff with jitter, or the server's Retry-After when it gives one."""
        if retry_after and retry_after.replace(".", "", 1).isdigit():
            return min(float(retry_after), 60.0)
        return min(self.backoff_s * 2 ** (attempt - 1), 30.0) * random.uniform(0.5, 1.0)

    def _join(self, batch: list[tuple[str, str]], payload: Any) -> dict[str, Result]:
        """Match results to snippets by id, never by position."""
        rows = payload.get("results") if isinstance(payload, dict) else None
        if not isinstance(rows, list):
            return {sid: {"error": "the Lean server's answer has no `results` list"} for sid, _ in batch}
        by_id: dict[str, Result] = {}
        for row in rows:
            if isinstance(row, dict):
                rid = row.get("id", row.get("custom_id"))
                by_id[str(rid)] = row
        unknown = set(by_id) - {sid for sid, _ in batch}
        if unknown:
            log.warning("Lean server returned results for unknown ids %s; ignored", sorted(unknown)[:5])
        return {sid: by_id.get(sid, {"error": f"the Lean server returned no result for snippet {sid!r}"}) for sid, _ in batch}


def _detail(resp: httpx.Response) -> str:
    try:
        data = resp.json()
        return str(data.get("detail", data)) if isinstance(data, dict) else str(data)
    except ValueError:
        return resp.text[:200] or resp.reason_phrase


def _explain_4xx(status: int, detail: str, url: str) -> str:
    hints = {
        401: "the server wants an API key: pass -o api_key=KEY (the server's LEAN_SERVER_API_KEY)",
        403: "the API key was refused: check -o api_key",
        404: f"no /api/check at {url}: is this a kimina-lean-server 2.x URL (without a path)?",
        422: "the server rejected the request's shape (is the server version 2.x?)",
    }
    return f"Lean server refused the request ({status}: {detail}); {hints.get(status, 'not retried')}"
