"""No Lean server behind the URL: train, eval and verify stop in seconds, before any work, with the
docker command that starts one. Real local sockets stand in for the missing server: a port that
refuses, a server that accepts connections and never answers, and one whose /health says 503."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner
from lean_replay import FIXTURE, ReplayServer, fixture_responder
from vrl_lean.client import KiminaClient
from vrl_lean.verifier import LeanVerifier

from vrl.cli import main
from vrl.verifier import VerifierUnavailable, ensure_ready

DATA = str(FIXTURE / "input")
REFUSED = "http://127.0.0.1:9"  # nothing listens on the discard port


@contextmanager
def silent_server() -> Iterator[str]:
    """Accepts TCP connections (the kernel's backlog does) and never answers a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@contextmanager
def unhealthy_server() -> Iterator[str]:
    """Answers every request with 503 {"status": "starting"} (a server still importing Mathlib, say)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            body = json.dumps({"status": "starting"}).encode()
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


async def test_probe_says_what_is_wrong():
    with ReplayServer(fixture_responder()) as server:
        client = KiminaClient(server.url)
        assert await client.probe() is None
        await client.aclose()
    client = KiminaClient(REFUSED)
    assert "ConnectError" in await client.probe()
    await client.aclose()
    with silent_server() as url:
        client = KiminaClient(url)
        assert await client.probe(timeout_s=0.5) == "/health did not answer within 0.5 s"
        await client.aclose()
    with unhealthy_server() as url:
        client = KiminaClient(url)
        assert "/health answered 503" in await client.probe()
        await client.aclose()


def test_check_ready_fails_with_the_docker_command_and_passes_on_a_healthy_server():
    with pytest.raises(VerifierUnavailable, match=r"no kimina-lean-server is ready at http://127.0.0.1:9 .*docker run .*"
                                                  r"projectnumina/kimina-lean-server:2.0.0"):
        ensure_ready(LeanVerifier(REFUSED))
    with ReplayServer(fixture_responder()) as server:
        ensure_ready(LeanVerifier(server.url))  # no exception
        assert server.requests == []  # a health check sends no proof


def _one_error_line(stderr: str) -> str:
    # recheck=off warns in a line of its own before anything runs; the error is the one other line
    lines = [line for line in stderr.splitlines() if line.strip() and "warning: -o recheck=off" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_verify_stops_before_verifying_when_no_server_answers(tmp_path):
    """Through the real command: exit 2 in seconds (no retries), no verdicts, the docker command."""
    attempts = tmp_path / "a.jsonl"
    attempts.write_text(json.dumps({"task_id": "lean_workbook_101", "completion": "```lean4\nby simp\n```"}) + "\n")
    res = subprocess.run([sys.executable, "-m", "vrl.cli", "verify", str(attempts), "--plugin", "lean", "--server", REFUSED, "-o", "recheck=off",
                          "-o", f"data={DATA}", "--out", str(tmp_path / "v.jsonl")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    line = _one_error_line(res.stderr)
    assert "no kimina-lean-server is ready at http://127.0.0.1:9" in line and "docker run" in line
    assert not (tmp_path / "v.jsonl").exists() and res.stdout == ""


@pytest.mark.slow
def test_train_leaves_no_run_directory_when_the_server_does_not_answer(tmp_path, monkeypatch):
    """In-process (click's runner): what is checked is the exit status, the one error line and the run
    directory, which need no process of their own; the probe waits 1 s instead of its 10."""
    from vrl_lean import client

    monkeypatch.setattr(client, "HEALTH_TIMEOUT_S", 1.0)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    with silent_server() as url:
        res = CliRunner().invoke(main, ["train", "--plugin", "lean", "--model", "tiny", "-o", f"server={url}", "-o",
                                        "recheck=off", "-o", f"data={DATA}", "--name", "lean"], catch_exceptions=False)
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    line = _one_error_line(res.stderr)
    assert "/health did not answer within 1 s" in line and "docker run" in line
    assert not Path(tmp_path / "runs").exists()


def test_eval_checks_the_server_before_generating(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with unhealthy_server() as url:
        res = CliRunner().invoke(main, ["eval", "--plugin", "lean", "--model", "tiny", "-o", f"server={url}", "-o", "recheck=off",
                                        "-o", f"data={DATA}", "--split", "train"], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert "/health answered 503" in _one_error_line(res.stderr)
