"""Running kimina-lean-server: the image and start command, health polling, restart after a hang.

The Modal runtime (and anyone else) starts a server from `KIMINA` (image, command, port, env) and
wraps it in a `ServerHandle`; `ServerSupervisor` keeps it healthy. `ProcessServer` is the handle for
a local process (a kimina-lean-server checkout started with `python -m server`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from vrl_lean.client import probe_health

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSpec:
    """How to start kimina-lean-server in a container: image, command, port, working directory."""

    image: str = "projectnumina/kimina-lean-server:2.0.0"
    command: tuple[str, ...] = ("python", "-m", "server")
    port: int = 8000
    workdir: str = "/root/kimina-lean-server"
    lean_version: str = "v4.15.0"
    lean_project: str = "/mathlib4"
    """The Lake project with Mathlib built, inside the image (where `lake env lean` finds Mathlib)."""

    memory_per_repl_mb: int = 8192
    """What kimina lets one REPL take (its LEAN_SERVER_MAX_REPL_MEM default, 8G): a machine or sandbox
    for `repls` REPLs needs this much memory per REPL."""

    def environment(self, repls: int, api_key: str | None = None, max_wait_s: int = 60) -> dict[str, str]:
        """The server's settings (LEAN_SERVER_* variables) for `repls` REPLs. No LEAN_SERVER_INIT_REPLS:
        kimina imports those inside its start-up under a hard 60 s limit, and one overrun kills the
        server; a Modal sandbox warms its REPLs up through the verifier instead (`modal_sandbox`)."""
        if repls < 1:
            raise ValueError("repls must be at least 1")
        env = {
            "LEAN_SERVER_HOST": "0.0.0.0",
            "LEAN_SERVER_PORT": str(self.port),
            "LEAN_SERVER_MAX_REPLS": str(repls),
            "LEAN_SERVER_MAX_WAIT": str(max_wait_s),
            "LEAN_SERVER_ENVIRONMENT": "prod",
        }
        if api_key:
            env["LEAN_SERVER_API_KEY"] = api_key
        return env

    def docker_command(self, repls: int, api_key: str | None = None, host_port: int | None = None) -> list[str]:
        """A `docker run` command line that starts the server on this machine."""
        cmd = ["docker", "run", "-d", "--rm", "--name", "kimina-lean-server", "-p", f"{host_port or self.port}:{self.port}"]
        for key, value in self.environment(repls, api_key).items():
            cmd += ["-e", f"{key}={value}"]
        return [*cmd, self.image]


KIMINA = ServerSpec()
"""The server this plugin is tested against (Lean v4.15.0 + Mathlib)."""


class ServerUnavailable(RuntimeError):
    """The server did not become healthy in time."""


class ServerHandle(ABC):
    """A kimina-lean-server that can be started and stopped: a local process, a Modal sandbox..."""

    url: str

    @abstractmethod
    async def start(self) -> None:
        """Start the server (return once it is launched; health is polled separately)."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop the server and release what it holds."""

    @abstractmethod
    def running(self) -> bool:
        """Whether the server's process (or sandbox) is still alive."""


class ProcessServer(ServerHandle):
    """A server running as a local child process."""

    def __init__(self, command: Sequence[str], url: str, env: Mapping[str, str] | None = None, cwd: str | None = None):
        self.command, self.url, self.cwd = list(command), url.rstrip("/"), cwd
        self.env = {**os.environ, **(env or {})}
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            *self.command, cwd=self.cwd, env=self.env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()

    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None


async def is_healthy(url: str, timeout_s: float = 5.0) -> bool:
    """True if `GET {url}/health` answers `{"status": "ok"}`."""
    async with httpx.AsyncClient(base_url=url.rstrip("/")) as http:
        return await probe_health(http, timeout_s) is None


async def wait_healthy(handle: ServerHandle, timeout_s: float = 600.0, poll_s: float = 2.0) -> float:
    """Poll until the server is healthy; return the seconds it took. Importing Mathlib takes a while."""
    start = time.monotonic()
    while True:
        if await is_healthy(handle.url):
            return time.monotonic() - start
        if not handle.running():
            raise ServerUnavailable(f"the Lean server at {handle.url} exited before it became healthy")
        if time.monotonic() - start > timeout_s:
            raise ServerUnavailable(f"the Lean server at {handle.url} was not healthy after {timeout_s:.0f} s")
        await asyncio.sleep(poll_s)


@dataclass
class ServerSupervisor:
    """Keeps one server healthy: starts it, and restarts it when it dies or stops answering."""

    handle: ServerHandle
    start_timeout_s: float = 600.0
    poll_s: float = 2.0
    starts: int = 0
    _lock: asyncio.Lock | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.handle.url

    async def ensure_healthy(self) -> None:
        """Start the server if it is not running; restart it if it runs but does not answer."""
        async with self._guard():
            if self.handle.running() and await is_healthy(self.handle.url):
                return
            await self._restart("not running" if not self.handle.running() else "health check failed")

    async def restart(self, reason: str) -> None:
        """Stop and start the server (after a hung request, for instance)."""
        async with self._guard():
            await self._restart(reason)

    async def stop(self) -> None:
        await self.handle.stop()

    async def _restart(self, reason: str) -> None:
        if self.starts:
            log.warning("restarting the Lean server at %s: %s", self.handle.url, reason)
        await self.handle.stop()
        await self.handle.start()
        self.starts += 1
        took = await wait_healthy(self.handle, self.start_timeout_s, self.poll_s)
        log.info("Lean server at %s healthy after %.1f s", self.handle.url, took)

    def _guard(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock
