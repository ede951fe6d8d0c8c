"""A local HTTP server that speaks kimina-lean-server's API and replays recorded or crafted answers.

Runs in a thread of the test process (`ReplayServer`) or as a child process
(`python lean_replay.py PORT`, serving the fixture) for the supervisor tests. It stands in for a real
server, which needs Docker and Lean + Mathlib (several GB) that the test machine does not have.

What is recorded and what is synthesised: each theorem's messages (warnings, positions, timeouts)
are the ones a real kimina-lean-server (Lean v4.15.0 + Mathlib) returned for the fixture's proof.
Those runs had no trailer, so the two trailer messages are SYNTHESISED here from the snippet sent,
in the format Lean v4.15.0 prints them (`Lean/Elab/Print.lean`: `#print axioms` logs
`'NAME' depends on axioms: [...]` and `#print "text"` logs `text`, both at the `#print` token, column
0) and at the line kimina-lean-server 2.0.0 reports: counted from the first line after the leading
import/blank lines it splits off, as in the recorded messages. A real Lean has not run these files.
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


@functools.cache
def fixture_problems() -> dict[str, Any]:
    """Theorem name -> the fixture's problem (`vrl_lean.data.Problem`)."""
    from vrl_lean.data import load_local

    return {p.name: p for p in load_local(FIXTURE / "input")}


def fixture_source(name: str) -> Path:
    """The fixture's .lean file that proves theorem `name`."""
    return next(p for p in (FIXTURE / "input").glob("*.lean") if re.search(rf"theorem {name}\b", p.read_text()))


def fixture_attempt(name: str, completion: str | None = None) -> Any:
    """An attempt at fixture theorem `name`; by default its completion is the fixture's own proved file
    in a ```lean4 block."""
    from vrl.types import Attempt, Completion, Task

    theorem = fixture_problems()[name].theorem
    task = Task(id=name, prompt="", data={"name": name, "header": theorem.header, "statement": theorem.statement})
    if completion is None:
        completion = f"<think>\nok\n</think>\n```lean4\n{fixture_source(name).read_text()}\n```"
    return Attempt(task=task, completion=Completion(task_id=name, text=completion))


def trailer_lines(code: str) -> dict[str, int]:
    """Lines (as kimina-lean-server 2.0.0 numbers them) of the trusted `#print` trailer in a snippet."""
    lines = code.split("\n")
    header = 0
    while header < len(lines) and (not lines[header].strip() or lines[header].strip().startswith("import ")):
        header += 1
    found = {}
    for number, line in enumerate(lines, start=1):
        if line.startswith("#print axioms "):
            found["audit"] = number - header
        elif line.startswith('#print "'):
            found["echo"] = number - header
    return found


def fixture_result(sid: str, code: str, audit: str | None = AUDIT_OK, echo: bool = True, canary: bool = True) -> dict[str, Any]:
    """An `/api/check` result for a snippet: the recorded answer for its theorem, plus the trailer's
    messages (`audit=None`: no axioms report; `echo=False`: no nonce echo, as in a forged answer).
    `canary=False` answers a canary (`theorem NAME : False`) with the theorem's recorded clean answer:
    Lean fooled by an exploit that makes any statement pass."""
    name = re.search(r"#print axioms (\S+)", code).group(1)
    recorded = recorded_results()[name]
    if canary and re.search(rf"^theorem {re.escape(name)} : False :=", code, re.MULTILINE):
        # A canary (the proof re-targeted at `False`): SYNTHESISED, as Lean reports a proof whose
        # hypotheses are gone, an `unknown identifier` error; the trailer is printed as usual.
        recorded = {"error": None, "response": {"env": 0, "time": 0.4, "messages": [
            {"severity": "error", "pos": {"line": 4, "column": 2}, "endPos": {"line": 4, "column": 8},
             "data": "unknown identifier 'h₀'"}]}}
    if recorded["error"]:
        return {"id": sid, "time": 60.0, "error": recorded["error"]}
    response = dict(recorded["response"])
    time_s = response.pop("time", 0.0)
    messages = list(response.get("messages") or [])
    lines = trailer_lines(code)
    if audit is not None:
        messages.append(_info(lines["audit"], audit.format(name=name)))
    if echo:
        marker = re.search(r'^#print "(.*)"$', code, re.MULTILINE).group(1)
        messages.append(_info(lines["echo"], marker))
    response["messages"] = messages
    return {"id": sid, "time": time_s, "response": response}


def _info(line: int, data: str) -> dict[str, Any]:
    return {"severity": "info", "pos": {"line": line, "column": 0}, "endPos": {"line": line, "column": 6}, "data": data}


def fixture_responder(audit: str | None = AUDIT_OK, echo: bool = True, canary: bool = True) -> Responder:
    """Answers every snippet with its theorem's recorded result, results in reverse order (join by id!)."""

    def respond(payload: dict[str, Any]) -> Answer:
        results = [fixture_result(s["id"], s["code"], audit, echo, canary) for s in payload["snippets"]]
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
