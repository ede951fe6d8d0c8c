"""Starting, health-polling and restarting a Lean server, with real local processes.

The process is `lean_replay.py` (kimina's API, replaying the fixture) standing in for
`python -m server` of kimina-lean-server, which needs Lean + Mathlib that the test machine lacks.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from test_lean_client import attempt
from vrl_lean.client import KiminaClient
from vrl_lean.server import KIMINA, ProcessServer, ServerSupervisor, ServerUnavailable, is_healthy
from vrl_lean.verifier import LeanVerifier

from vrl.types import Status

REPLAY = str(Path(__file__).parent / "lean_replay.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replay_process(*extra: str) -> ProcessServer:
    port = free_port()
    return ProcessServer([sys.executable, REPLAY, str(port), *extra], f"http://127.0.0.1:{port}")


def test_kimina_spec_for_docker_and_modal():
    assert KIMINA.image == "projectnumina/kimina-lean-server:2.0.0"
    assert KIMINA.command == ("python", "-m", "server") and KIMINA.port == 8000
    env = KIMINA.environment(repls=6, api_key="k")
    assert env["LEAN_SERVER_MAX_REPLS"] == "6" and env["LEAN_SERVER_API_KEY"] == "k" and env["LEAN_SERVER_PORT"] == "8000"
    cmd = KIMINA.docker_command(repls=3, host_port=9000)
    assert cmd[:2] == ["docker", "run"] and cmd[-1] == KIMINA.image and "9000:8000" in cmd
    assert "LEAN_SERVER_MAX_REPLS=3" in cmd and not any("API_KEY" in c for c in cmd)
    with pytest.raises(ValueError):
        KIMINA.environment(repls=0)


async def test_supervisor_starts_polls_health_and_restarts_a_dead_server():
    sup = ServerSupervisor(replay_process(), start_timeout_s=20, poll_s=0.1)
    try:
        await sup.ensure_healthy()
        assert sup.starts == 1 and await is_healthy(sup.url)
        await sup.ensure_healthy()  # healthy: nothing to do
        assert sup.starts == 1
        sup.handle._proc.kill()
        await sup.handle._proc.wait()
        await sup.ensure_healthy()
        assert sup.starts == 2 and await is_healthy(sup.url)
    finally:
        await sup.stop()
    assert not sup.handle.running()


async def test_a_server_that_exits_or_never_answers_is_reported():
    dead = ServerSupervisor(ProcessServer([sys.executable, "-c", "pass"], "http://127.0.0.1:9"), start_timeout_s=5, poll_s=0.1)
    with pytest.raises(ServerUnavailable, match="exited before it became healthy"):
        await dead.ensure_healthy()
    mute = ServerSupervisor(ProcessServer([sys.executable, "-c", "import time; time.sleep(30)"], "http://127.0.0.1:9"),
                            start_timeout_s=0.5, poll_s=0.1)
    with pytest.raises(ServerUnavailable, match="not healthy after"):
        await mute.ensure_healthy()
    await mute.stop()


async def test_verifier_restarts_the_server_after_a_hung_request():
    sup = ServerSupervisor(replay_process("5"), start_timeout_s=20, poll_s=0.1)  # answers /api/check after 5 s
    client = KiminaClient(sup.url, timeout_s=0.2, queue_wait_s=0.0, max_retries=0)
    verifier = LeanVerifier(client=client, supervisor=sup)
    try:
        verdicts = await verifier.verify([attempt("lean_workbook_101")])
        assert verdicts[0].status is Status.TIMEOUT
        assert sup.starts == 2 and await is_healthy(sup.url)  # first start + restart after the hang
    finally:
        await verifier.aclose()
    assert not sup.handle.running()


async def test_verifier_with_a_healthy_supervised_server_passes():
    sup = ServerSupervisor(replay_process(), start_timeout_s=20, poll_s=0.1)
    verifier = LeanVerifier(supervisor=sup, max_retries=1)
    try:
        verdicts = await verifier.verify([attempt("lean_workbook_101"), attempt("lean_workbook_10090")])
    finally:
        await verifier.aclose()
    assert verdicts[0].passed and verdicts[1].status is Status.TIMEOUT and sup.starts == 1
