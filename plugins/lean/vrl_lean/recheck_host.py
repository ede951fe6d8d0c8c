"""The out-of-process re-check of a Lean pass, run where Lean and Mathlib are installed.

Standard library only: this file also runs as a script inside the kimina-lean-server image, where vrl
is not installed (`python recheck_host.py --project DIR --port 8001`, see docs/plugins/lean.md).

For one job (`name`, `code`: the file the server accepted, `reference`: the trusted header and
statement proved by `sorry`) it
1. compiles `reference`, then `code`, to .olean files, each in a fresh Lean process (`lake env lean -o`)
   in a directory of its own: nothing the model wrote runs in the process that judges it, and the
   reference's .olean and the checker must hash the same after the candidate's compile as before;
2. runs the trusted checker (`checker/VrlCheck.lean`, `lake env lean --run`) in another fresh
   process: it loads the compiled candidate, replays every declaration through the kernel, compares
   NAME's type with the reference's, and lists NAME's axioms; it prints one line of JSON.
The answer is `{"status": "checked" | "compile_error" | "reference_error" | "timeout" | "error",
"detail", "check" (the checker's JSON), "stages" (seconds per stage), "elapsed_s"}`; what it means
for the verdict is decided by the caller (`vrl_lean.recheck.interpret`), not here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CHECKER = Path(__file__).resolve().parent / "checker" / "VrlCheck.lean"
MAX_JOB_BYTES = 4 << 20
"""A job larger than this is refused (a Lean file of a few hundred KB is already absurd)."""


class JobError(ValueError):
    """A malformed job."""


def _validate(job: Any) -> tuple[str, str, str, float]:
    if not isinstance(job, dict):
        raise JobError("a job is a JSON object")
    name, code, reference = job.get("name"), job.get("code"), job.get("reference")
    if not all(isinstance(v, str) and v for v in (name, code, reference)):
        raise JobError("a job needs non-empty strings `name`, `code` and `reference`")
    if not all(c.isalnum() or c in "_.'!?" for c in name):
        raise JobError(f"not a plain theorem name: {name!r}")
    timeout = job.get("timeout_s", 300)
    if not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
        raise JobError("timeout_s must be a number of seconds in (0, 3600]")
    return name, code, reference, float(timeout)


def _run(cmd: list[str], cwd: str, timeout_s: float) -> tuple[int | None, str, str]:
    """(exit code or None on timeout, stdout, stderr) of a fresh process, killed with its group on timeout."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(timeout_s, 0.001))
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, out, err


def _tail(text: str, lines: int = 6) -> str:
    kept = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(kept[:lines])[:1500]


def recheck(job: Any, project: str, lean: list[str] | None = None, checker: Path = CHECKER) -> dict[str, Any]:
    """Re-check one job in fresh processes; see the module docstring. `lean`: the command that runs
    Lean inside the Mathlib project (default `lake env lean`)."""
    start = time.monotonic()
    stages: dict[str, float] = {}

    def answer(status: str, detail: str, check: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"status": status, "detail": detail, "check": check, "stages": stages,
                "elapsed_s": round(time.monotonic() - start, 3)}

    try:
        name, code, reference, timeout_s = _validate(job)
    except JobError as exc:
        return answer("error", f"bad job: {exc}")
    lean = list(lean or ["lake", "env", "lean"])
    if not Path(project).is_dir():
        return answer("error", f"no Lean project directory {project!r} (give the Mathlib project with --project)")
    if not checker.is_file():
        return answer("error", f"the trusted checker {checker} is missing")
    deadline = start + timeout_s
    with tempfile.TemporaryDirectory(prefix="vrl-recheck-") as tmp:
        # The reference is compiled first, in a directory of its own; the candidate after it. Before the
        # checker runs, the reference's .olean and the checker itself must still hash as they did before
        # the candidate's process ran: nothing the candidate's compile did can reach what judges it.
        dirs = {stem: Path(tmp) / stem for stem in ("reference", "candidate")}
        texts = {"reference": reference, "candidate": code}
        for stem, folder in dirs.items():
            folder.mkdir()
            (folder / f"{stem}.lean").write_text(texts[stem], encoding="utf-8")
        olean = {stem: dirs[stem] / f"{stem}.olean" for stem in dirs}
        guarded: dict[Path, str] = {}
        for stem in ("reference", "candidate"):
            t0 = time.monotonic()
            rc, out, err = _run([*lean, "-o", str(olean[stem]), str(dirs[stem] / f"{stem}.lean")], project,
                                deadline - time.monotonic())
            stages[f"compile_{stem}_s"] = round(time.monotonic() - t0, 3)
            if rc is None:
                return answer("timeout", f"compiling the {stem} did not finish within {timeout_s:g} s")
            if rc != 0:
                status = "compile_error" if stem == "candidate" else "reference_error"
                return answer(status, f"lean exited with {rc} compiling the {stem}: {_tail(out + chr(10) + err)}")
            if stem == "reference":
                guarded = {f: _digest(f) for f in (olean["reference"], checker)}
        changed = [f.name for f, digest in guarded.items() if _digest(f) != digest]
        if changed:
            return answer("error", f"{', '.join(changed)} changed while the candidate compiled: the candidate ran code")
        t0 = time.monotonic()
        rc, out, err = _run([*lean, "--run", str(checker), str(olean["candidate"]), str(olean["reference"]), name],
                            project, deadline - time.monotonic())
        stages["check_s"] = round(time.monotonic() - t0, 3)
        if rc is None:
            return answer("timeout", f"the checker did not finish within {timeout_s:g} s")
        lines = [ln for ln in out.strip().splitlines() if ln.strip()]
        try:
            check = json.loads(lines[-1]) if lines else None
        except ValueError:
            check = None
        if rc != 0 or not isinstance(check, dict) or check.get("vrl_check") != 1:
            return answer("error", f"the checker exited with {rc} without its JSON line: {_tail(err or out)}")
        return answer("checked", "the checker ran", check)


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "missing"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], project: str, lean: list[str], jobs: int, api_key: str | None):
        super().__init__(address, _Handler)
        self.project, self.lean, self.api_key = project, lean, api_key
        self.slots = threading.Semaphore(jobs)  # each job holds up to three Lean processes with Mathlib loaded


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        sys.stderr.write("recheck_host: " + fmt % args + "\n")

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        if status >= 400:
            self.close_connection = True  # the request body may be unread: do not read it as the next request
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        key = self.server.api_key
        return not key or self.headers.get("Authorization") == f"Bearer {key}"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.rstrip("/") != "/health":
            return self._send(404, {"detail": "not found"})
        ok = Path(self.server.project).is_dir() and CHECKER.is_file()
        self._send(200 if ok else 503, {"status": "ok" if ok else "misconfigured", "checker": str(CHECKER)})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/recheck":
            return self._send(404, {"detail": "not found"})
        if not self._authorised():
            return self._send(401, {"detail": "missing or wrong API key"})
        size = int(self.headers.get("Content-Length") or 0)
        if size <= 0 or size > MAX_JOB_BYTES:
            return self._send(413 if size else 400, {"detail": f"a job is 1 to {MAX_JOB_BYTES} bytes of JSON"})
        try:
            job = json.loads(self.rfile.read(size))
        except ValueError:
            return self._send(400, {"detail": "the body is not JSON"})
        with self.server.slots:
            result = recheck(job, self.server.project, self.server.lean)
        self._send(200, result)


def serve(project: str, port: int = 8001, host: str = "0.0.0.0", lean: list[str] | None = None, jobs: int = 2,
          api_key: str | None = None) -> _Server:
    """A started server (call `serve_forever()`); `port=0` picks a free port (`server.server_port`)."""
    return _Server((host, port), project, list(lean or ["lake", "env", "lean"]), jobs, api_key)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="vrl's out-of-process re-check of Lean passes (POST /recheck, GET /health).")
    ap.add_argument("--project", required=True, help="the Lake project with Mathlib built (where `lake env lean` works)")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--jobs", type=int, default=2, help="re-checks at once (each loads Mathlib up to three times)")
    ap.add_argument("--lean", default="lake env lean", help="the command that runs Lean in the project")
    args = ap.parse_args(argv)
    if shutil.which(args.lean.split()[0]) is None:
        ap.error(f"{args.lean.split()[0]!r} is not on PATH")
    server = serve(args.project, args.port, args.host, args.lean.split(), args.jobs, os.environ.get("VRL_RECHECK_API_KEY"))
    print(f"recheck_host: serving on {args.host}:{server.server_port} for {args.project}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
