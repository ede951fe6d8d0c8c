"""A local HTTP server that speaks kimina-lean-server's API and replays recorded or crafted answers.

Runs in a thread of the test process (`ReplayServer`) or as a child process
(`python lean_replay.py PORT`, serving the fixture) for the supervisor tests. It stands in for a real
server, which needs Docker and Lean + Mathlib (several GB) that the test machine does not have.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).parent / "fixtures" / "lean_workbook"
AUDIT_OK = "'{name}' depends on axioms: [propext, Classical.choice, Quot.sound]"


@dataclass
class Answer:
    """What the server does with one request."""

    status: int = 200
    body: Any = None
    delay_s: float = 0.0
    drop: bool = False  # close the connection without answering
    headers: dict[str, str] = field(default_factory=dict)


Responder = Callable[[dict[str, Any]], Answer]


class ReplayServer:
    """`with ReplayServer(responder) as server:` ... `server.url`, `server.requests` (JSON bodies)."""

    def __init__(self, responder: Responder, port: int = 0):
        self.responder = responder
        self.requests: list[dict[str, Any]] = []
        self.auth_headers: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path.rstrip("/") in ("/health", ""):
                    self._send(Answer(body={"status": "ok"}))
                else:
                    self._send(Answer(404, {"detail": "Not Found"}))

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                payload = json.loads(self.rfile.read(length) or b"{}")
                if self.path != "/api/check":
                    self._send(Answer(404, {"detail": "Not Found"}))
                    return
                outer.requests.append(payload)
                outer.auth_headers.append(self.headers.get("Authorization"))
                self._send(outer.responder(payload))

            def _send(self, answer: Answer) -> None:
                if answer.delay_s:
                    time.sleep(answer.delay_s)
                if answer.drop:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                data = json.dumps(answer.body).encode()
                self.send_response(answer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in answer.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ReplayServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@functools.cache
def recorded_results() -> dict[str, dict[str, Any]]:
    """Theorem name -> the recorded legacy `/verify` result for it."""
    out = {}
    for lean in sorted((FIXTURE / "input").glob("*.lean")):
        name = re.search(r"^theorem\s+(\S+)", lean.read_text(), re.MULTILINE).group(1)
        recorded = json.loads((FIXTURE / "output" / f"{lean.stem}.json").read_text())["results"][0]
        out[name] = recorded
    return out


def fixture_result(sid: str, code: str, audit: str | None = AUDIT_OK) -> dict[str, Any]:
    """An `/api/check` result for a snippet: the recorded answer for its theorem, plus an axioms line."""
    name = re.search(r"#print axioms (\S+)", code).group(1)
    recorded = recorded_results()[name]
    if recorded["error"]:
        return {"id": sid, "time": 60.0, "error": recorded["error"]}
    response = dict(recorded["response"])
    time_s = response.pop("time", 0.0)
    messages = list(response.get("messages") or [])
    if audit is not None:
        line = code.count("\n")
        messages.append({"severity": "info", "pos": {"line": line, "column": 0}, "endPos": {"line": line, "column": 14},
                         "data": audit.format(name=name)})
    response["messages"] = messages
    return {"id": sid, "time": time_s, "response": response}


def fixture_responder(audit: str | None = AUDIT_OK) -> Responder:
    """Answers every snippet with its theorem's recorded result, results in reverse order (join by id!)."""

    def respond(payload: dict[str, Any]) -> Answer:
        results = [fixture_result(s["id"], s["code"], audit) for s in payload["snippets"]]
        return Answer(body={"results": results[::-1]})

    return respond


def _slow(respond: Responder, delay_s: float) -> Responder:
    def slow(payload: dict[str, Any]) -> Answer:
        answer = respond(payload)
        answer.delay_s = delay_s
        return answer

    return slow


if __name__ == "__main__":  # python lean_replay.py PORT [SLOW_SECONDS]
    respond = fixture_responder()
    if len(sys.argv) > 2:
        respond = _slow(respond, float(sys.argv[2]))
    ReplayServer(respond, port=int(sys.argv[1])).httpd.serve_forever()
