"""A kimina-lean-server stand-in that keeps kimina 2.0.0's start-up and REPL rules, time-scaled, for the
sandbox warm-up tests (no Docker, Lean or Mathlib here).

    python kimina_startup.py PORT IMPORT_S START_LIMIT_S

What it keeps of the real server (kimina-lean-server 2.0.0, read from its source; the times are scaled):
- `LEAN_SERVER_INIT_REPLS` ({header: count}) starts that many REPLs inside the server's start-up, each
  importing the header, under a hard start-up limit: an import longer than START_LIMIT_S ends the server
  before it ever answers /health.
- A REPL that has not imported the header yet does so inside the first proof it is given, so that proof
  takes IMPORT_S on top, within the request's `timeout`; a proof that overruns it gets kimina's timeout
  error, and its REPL is dropped (still cold). `LEAN_SERVER_MAX_REPLS` REPLs import side by side.
- Every proof answers as Lean does for a clean one: no messages but the trusted trailer's (`#print axioms`
  lists the standard axioms, `#print` echoes the nonce), in kimina's line numbering (`lean_replay`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from typing import Any

from lean_replay import AUDIT_OK, Answer, ReplayServer, _info, trailer_lines


def clean_result(sid: str, code: str) -> dict[str, Any]:
    name = re.search(r"#print axioms (\S+)", code).group(1)
    marker = re.search(r'^#print "(.*)"$', code, re.MULTILINE).group(1)
    lines = trailer_lines(code)
    messages = [_info(lines["audit"], AUDIT_OK.format(name=name)), _info(lines["echo"], marker)]
    return {"id": sid, "time": 0.05, "response": {"env": 0, "messages": messages}}


def main() -> None:
    port, import_s, start_limit_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    repls = int(os.environ.get("LEAN_SERVER_MAX_REPLS", "1"))
    warm = 0
    lock = threading.Lock()
    preload = json.loads(os.environ.get("LEAN_SERVER_INIT_REPLS", "{}") or "{}")
    if preload:
        time.sleep(min(import_s, start_limit_s))
        if import_s > start_limit_s:
            print(f"start-up: importing {list(preload)} did not finish within {start_limit_s:g} s", file=sys.stderr)
            sys.exit(1)
        warm = min(repls, sum(preload.values()))

    def respond(payload: dict[str, Any]) -> Answer:
        nonlocal warm
        snippets = payload["snippets"]
        with lock:
            cold = min(len(snippets), repls - warm)  # these snippets import the header first, side by side
        if cold and import_s > float(payload.get("timeout", 60)):
            time.sleep(float(payload["timeout"]))
            timed_out = [{"id": s["id"], "time": float(payload["timeout"]), "error": "Lean REPL command timed out."}
                         for s in snippets[:cold]]
            return Answer(body={"results": timed_out + [clean_result(s["id"], s["code"]) for s in snippets[cold:]]})
        if cold:
            time.sleep(import_s)
            with lock:
                warm += cold
        return Answer(body={"results": [clean_result(s["id"], s["code"]) for s in snippets]})

    ReplayServer(respond, port=port).httpd.serve_forever()


if __name__ == "__main__":
    main()
