"""The out-of-process re-check of a Lean pass, run where Lean and Mathlib are installed.

Standard library only, with vrl's jail (`vrl/jail.py`, itself standard library only): this file also runs
as a script inside the kimina-lean-server image, where vrl is not installed, with a copy of `jail.py`
beside it (`python recheck_host.py --project DIR --port 8001`, see docs/plugins/lean.md).

For one job (`name`, `code`: the file the server accepted, `reference`: the trusted header and
statement proved by `sorry`) it
1. compiles `reference`, then `code`, to .olean files, each by a fresh Lean process (`lake env lean -o`)
   in a throw-away jail of its own (`vrl.jail`, `sandbox_argv`): of the host only the system's
   programs and libraries, the toolchain and the project (Mathlib), read-only, and the stage's own
   folder, writable; a private /tmp; no socket; no secrets in the environment; limits on memory, CPU,
   file size and kept output; its own pid namespace, so every process the compile started (a
   double-forked daemon too) is killed when it ends: nothing the model wrote outlives its compile,
   reaches what judges it, or sees another job;
2. copies the two .olean files and the checker into a fresh folder once the candidate's sandbox is
   gone, hashes the copies, and runs the trusted checker (`checker/VrlCheck.lean`,
   `lake env lean --run`) on them in another fresh sandbox where that folder is read-only: it
   replays every declaration of the candidate through the kernel (with the header's heartbeat limit), compares NAME's type with the
   reference's, and lists NAME's axioms; it prints one line of JSON.
The answer is `{"status": "checked" | "compile_error" | "reference_error" | "timeout" | "error",
"detail", "check" (the checker's JSON), "stages" (seconds per stage), "elapsed_s"}`; what it means
for the verdict is decided by the caller (`vrl_lean.recheck.interpret`), not here. `detail` is a fixed
sentence with, at most, Lean's error positions: a compile's output never leaves the host (it goes to
this host's log), since a verdict's detail reaches samples.jsonl and, with proof repair, the model.

The HTTP server (`main`) needs a key (`VRL_RECHECK_API_KEY`, the same value on the client), listens on
127.0.0.1 unless told otherwise, and caps every job's `timeout_s` at its own `--max-timeout-s`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

try:
    from vrl import jail
except ImportError:  # run as a script beside a copy of vrl/jail.py (the kimina image, where vrl is not installed)
    import jail  # type: ignore[no-redef]

log = logging.getLogger("vrl_lean.recheck_host")

CHECKER = Path(__file__).resolve().parent / "checker" / "VrlCheck.lean"
MAX_JOB_BYTES = 4 << 20
"""A job larger than this is refused (a Lean file of a few hundred KB is already absurd)."""
MAX_TIMEOUT_S = 600.0
"""The longest job a host runs by default, whatever the client asks (`--max-timeout-s`)."""
API_KEY_VAR = "VRL_RECHECK_API_KEY"
"""The environment variable holding the key, on the host and on the client (`HttpRechecker`)."""
SANDBOXES = ("bwrap", "off")
# What a stage's Lean process keeps of the host's environment: how to find Lean, Lake and elan. No
# key or token reaches code the model wrote.
_ENV_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "USER")
_ENV_PREFIXES = ("LEAN", "LAKE", "ELAN")


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
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise JobError("timeout_s must be a positive number of seconds")
    return name, code, reference, float(timeout)


def sandbox_argv(project: str, writable: str | None, readable: tuple[str, ...] = (), lean: tuple[str, ...] = (),
                 seccomp_fd: int | None = None) -> list[str]:
    """vrl's jail (`vrl.jail`) around one Lean process. It shows only what the stage needs: the system's
    program and library folders, the toolchain (`lean`'s installation: elan's home, a virtualenv), the
    project (Mathlib), read-only; `readable`: folders it may read; `writable`: the one folder it may
    write (its own output). Nothing else of the host exists inside: no home, no /etc, no /run (no
    sockets), no other job's folder wherever TMPDIR is. A private /tmp and /dev/shm, 64 MiB each; no
    socket, no capabilities, its own pid namespace (killed with it, so no process outlives the stage)."""
    argv = [jail.bwrap(), *jail.namespace_args(), *jail.system_binds(), "--proc", "/proc", "--dev", "/dev",
            "--size", str(64 << 20), "--tmpfs", "/tmp", "--size", str(64 << 20), "--tmpfs", "/dev/shm"]
    for folder in dict.fromkeys([*jail.program_roots(list(lean)), *_elan_home(), project, *readable]):
        argv += ["--ro-bind", folder, folder]
    if writable is not None:
        argv += ["--bind", writable, writable]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--remount-ro", "/", "--chdir", project, "--"]


def _elan_home() -> list[str]:
    """elan's home when set apart from the programs' (ELAN_HOME): the toolchains `lake` starts."""
    home = os.environ.get("ELAN_HOME")
    return [home] if home and os.path.isdir(home) else []


def check_sandbox(project: str) -> str | None:
    """None if the jail can run a sandboxed process here; else why not, in one line naming bubblewrap."""
    why = jail.self_check()
    if why is None and not Path(project).is_dir():
        why = f"no Lean project directory {project!r}"
    return why


_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
LIMITS = jail.Limits(memory_mb=16384, file_mb=1024)
"""Per stage: 16 GiB of private writable memory (Lean with Mathlib needs a few; its .olean files are mapped
read-only and not counted), files of at most 1 GiB, no core dumps; CPU time is set per job from its timeout."""
OUTPUT_CAP = 64 << 10
"""Bytes of each stream of a stage kept for the host's log; the rest is read and dropped."""
MAX_OLEAN_BYTES = 512 << 20
"""The largest .olean the host copies out of a stage's folder (one file's, not Mathlib's)."""


def _stage_env() -> dict[str, str]:
    """The environment of a sandboxed stage: how to find Lean, never a key (LEAN_SERVER_API_KEY is a
    LEAN* variable of the kimina container this host shares)."""
    return {k: v for k, v in os.environ.items()
            if (k in _ENV_KEEP or k.startswith(_ENV_PREFIXES)) and not any(w in k.upper() for w in _SECRET_WORDS)}


def _run(cmd: list[str], cwd: str, timeout_s: float, box: list[str] | None = None, fds: tuple[int, ...] = ()) -> jail.Ran:
    """A fresh process, its output capped, killed with its session at the deadline. With `box` (a jail's
    argv), the process runs inside it, under `LIMITS`, with the kept environment only."""
    if box is None:
        return jail.run(cmd, cwd=cwd, timeout_s=timeout_s, cap=OUTPUT_CAP)
    cpu = jail.Limits(LIMITS.memory_mb, int(timeout_s * max(1, os.cpu_count() or 1)) + 1, LIMITS.file_mb)
    return jail.run(jail.limited([*box, *cmd], cpu), cwd=cwd, timeout_s=timeout_s, env=_stage_env(), pass_fds=fds,
                    cap=OUTPUT_CAP)


_POSITION = re.compile(r"(?:^|[/\\])(candidate|reference)\.lean:(\d+):(\d+): error", re.MULTILINE)


def positions(output: str, stem: str) -> str:
    """Lean's own error positions in the stage's file (`3:2, 7:5`): all of a compile's output that may
    reach a verdict, a repair prompt or samples.jsonl. The text itself goes to the host's log only."""
    found = [f"{m.group(2)}:{m.group(3)}" for m in _POSITION.finditer(output) if m.group(1) == stem]
    return ", ".join(dict.fromkeys(found[:20]))


def recheck(job: Any, project: str, lean: list[str] | None = None, checker: Path = CHECKER,
            sandbox: str = "bwrap", max_timeout_s: float = MAX_TIMEOUT_S) -> dict[str, Any]:
    """Re-check one job in fresh, sandboxed processes; see the module docstring. `lean`: the command
    that runs Lean inside the Mathlib project (default `lake env lean`). `sandbox="off"` runs the
    stages as plain processes (for debugging only: then code run by the candidate's compile is
    contained by nothing but the hashes). The job's `timeout_s` is capped at `max_timeout_s`."""
    start = time.monotonic()
    stages: dict[str, float] = {}

    def answer(status: str, detail: str, check: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"status": status, "detail": detail, "check": check, "stages": stages,
                "elapsed_s": round(time.monotonic() - start, 3)}

    try:
        name, code, reference, timeout_s = _validate(job)
    except JobError as exc:
        return answer("error", f"bad job: {exc}")
    if sandbox not in SANDBOXES:
        return answer("error", f"sandbox must be one of {', '.join(SANDBOXES)}, got {sandbox!r}")
    timeout_s = min(timeout_s, max_timeout_s)
    lean = list(lean or ["lake", "env", "lean"])
    if not Path(project).is_dir():
        return answer("error", f"no Lean project directory {project!r} (give the Mathlib project with --project)")
    project = str(Path(project).resolve())
    if not checker.is_file():
        return answer("error", f"the trusted checker {checker} is missing")
    if sandbox == "bwrap":
        why = jail.self_check()  # once per process (cached): a jail that cannot start is not a defective statement
        if why:
            return answer("error", why)
    deadline = start + timeout_s
    with tempfile.TemporaryDirectory(prefix="vrl-recheck-") as tmp:
        # Each stage writes only its own folder and sees no other (nor any other job's); the checker reads
        # copies made (regular files only, links not followed) and hashed once the candidate's sandbox is gone.
        dirs = {stem: Path(tmp) / stem for stem in ("reference", "candidate", "check")}
        texts = {"reference": reference, "candidate": code}
        for folder in dirs.values():
            folder.mkdir()
        olean = {stem: dirs[stem] / f"{stem}.olean" for stem in texts}
        copies = {"reference": dirs["check"] / "reference.olean", "candidate": dirs["check"] / "candidate.olean",
                  "checker": dirs["check"] / checker.name}
        shutil.copyfile(checker, copies["checker"])
        guarded = {copies["checker"]: _digest(copies["checker"])}  # each copy hashed when made
        if guarded[copies["checker"]] != _digest(checker):
            return answer("error", "the checker's copy differs from the trusted checker")
        for stem in ("reference", "candidate"):
            source = dirs[stem] / f"{stem}.lean"
            source.write_text(texts[stem], encoding="utf-8")
            t0 = time.monotonic()
            ran = _stage([*lean, "-o", str(olean[stem]), str(source)], project, deadline, sandbox, lean, str(dirs[stem]))
            stages[f"compile_{stem}_s"] = round(time.monotonic() - t0, 3)
            what = "the candidate" if stem == "candidate" else "the trusted statement"
            if ran.returncode is None:
                return answer("timeout", f"compiling {what} did not finish within {timeout_s:g} s")
            if ran.returncode != 0:
                status = "compile_error" if stem == "candidate" else "reference_error"
                _log(name, f"compile_{stem}", ran)
                at = positions(ran.text(), stem)
                return answer(status, f"lean exited with {ran.returncode} compiling {what}"
                              + (f"; errors at {at}" if at else "; no error position"))
            try:
                data = jail.read_regular(olean[stem], MAX_OLEAN_BYTES)
            except OSError as exc:
                return answer("error", f"compiling {what} left no usable .olean ({type(exc).__name__}: "
                              f"{os.strerror(exc.errno) if exc.errno else 'unreadable'})")
            copies[stem].write_bytes(data)
            guarded[copies[stem]] = _digest(copies[stem])
        for original, copy in ((olean["reference"], copies["reference"]), (checker, copies["checker"])):
            if _digest(original) != guarded[copy] or _digest(copy) != guarded[copy]:
                return answer("error", f"{copy.name} changed while the candidate compiled: the candidate ran code")
        t0 = time.monotonic()
        ran = _stage([*lean, "--run", str(copies["checker"]), str(copies["candidate"]), str(copies["reference"]), name,
                      str(header_heartbeats(reference))], project, deadline, sandbox, lean, None, (str(dirs["check"]),))
        stages["check_s"] = round(time.monotonic() - t0, 3)
        if ran.returncode is None:
            return answer("timeout", f"the checker did not finish within {timeout_s:g} s")
        changed = [f.name for f, digest in guarded.items() if _digest(f) != digest]
        if changed:
            return answer("error", f"{', '.join(changed)} changed while the checker ran")
        lines = [ln for ln in ran.stdout.decode("utf-8", errors="replace").strip().splitlines() if ln.strip()]
        try:
            check = json.loads(lines[-1]) if lines else None
        except ValueError:
            check = None
        if ran.returncode != 0 or not isinstance(check, dict) or check.get("vrl_check") != 1:
            _log(name, "check", ran)
            return answer("error", f"the checker exited with {ran.returncode} without its JSON line")
        return answer("checked", "the checker ran", check)


def _stage(cmd: list[str], project: str, deadline: float, sandbox: str, lean: list[str], writable: str | None,
           readable: tuple[str, ...] = ()) -> jail.Ran:
    if sandbox != "bwrap":
        return _run(cmd, project, deadline - time.monotonic())
    fd = jail.seccomp_fd()
    try:
        box = sandbox_argv(project, writable, readable, tuple(lean), seccomp_fd=fd)
        return _run(cmd, project, deadline - time.monotonic(), box, (fd,))
    finally:
        os.close(fd)


def _log(name: str, stage: str, ran: jail.Ran) -> None:
    """A failed stage's output, for the operator: the host's log, never the answer (what reaches the model)."""
    tail = ran.text().strip()[-4000:]
    log.warning("re-check of %s: stage %s exited with %s%s:\n%s", name, stage, ran.returncode,
                " (output truncated)" if ran.truncated else "", tail)


_HEARTBEATS = re.compile(r"^set_option\s+maxHeartbeats\s+(\d+)\s*$", re.MULTILINE)
LEAN_DEFAULT_HEARTBEATS = 200_000


def header_heartbeats(reference: str) -> int:
    """The trusted header's `set_option maxHeartbeats N` (the limit the server checked under), for the
    checker's kernel replay; Lean's default where the header sets none (or 0, which means none)."""
    match = _HEARTBEATS.search(reference)
    value = int(match.group(1)) if match else 0
    return value if value > 0 else LEAN_DEFAULT_HEARTBEATS


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "missing"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], project: str, lean: list[str], jobs: int, api_key: str | None,
                 sandbox: str = "bwrap", max_timeout_s: float = MAX_TIMEOUT_S):
        super().__init__(address, _Handler)
        self.project, self.lean, self.api_key = project, lean, api_key
        self.sandbox, self.max_timeout_s = sandbox, max_timeout_s
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
        try:
            size = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return self._send(400, {"detail": "Content-Length is not a number"})
        if size <= 0 or size > MAX_JOB_BYTES:
            return self._send(413 if size else 400, {"detail": f"a job is 1 to {MAX_JOB_BYTES} bytes of JSON"})
        try:
            job = json.loads(self.rfile.read(size))
        except ValueError:
            return self._send(400, {"detail": "the body is not JSON"})
        with self.server.slots:
            result = recheck(job, self.server.project, self.server.lean, sandbox=self.server.sandbox,
                             max_timeout_s=self.server.max_timeout_s)
        self._send(200, result)


def serve(project: str, port: int = 8001, host: str = "127.0.0.1", lean: list[str] | None = None, jobs: int = 2,
          api_key: str | None = None, sandbox: str = "bwrap", max_timeout_s: float = MAX_TIMEOUT_S) -> _Server:
    """A started server (call `serve_forever()`); `port=0` picks a free port (`server.server_port`).
    `api_key=None` serves without authentication (tests, or `--no-auth` behind another gate)."""
    if sandbox not in SANDBOXES:
        raise ValueError(f"sandbox must be one of {', '.join(SANDBOXES)}, got {sandbox!r}")
    if not max_timeout_s > 0:
        raise ValueError("max_timeout_s must be positive")
    return _Server((host, port), project, list(lean or ["lake", "env", "lean"]), jobs, api_key, sandbox, max_timeout_s)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="vrl's out-of-process re-check of Lean passes (POST /recheck, GET /health).")
    ap.add_argument("--project", required=True, help="the Lake project with Mathlib built (where `lake env lean` works)")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--jobs", type=int, default=2, help="re-checks at once (each loads Mathlib up to three times)")
    ap.add_argument("--max-timeout-s", type=float, default=MAX_TIMEOUT_S, help="the longest job, whatever a client asks")
    ap.add_argument("--lean", default="lake env lean", help="the command that runs Lean in the project")
    ap.add_argument("--sandbox", choices=SANDBOXES, default="bwrap",
                    help="bwrap: every Lean process in a throw-away bubblewrap sandbox; off: debugging only")
    ap.add_argument("--no-auth", action="store_true", help=f"serve without a key (default: {API_KEY_VAR} is required)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="recheck_host: %(message)s")  # failed stages' output: here only
    if shutil.which(args.lean.split()[0]) is None:
        ap.error(f"{args.lean.split()[0]!r} is not on PATH")
    key = os.environ.get(API_KEY_VAR) or None
    if key is None and not args.no_auth:
        ap.error(f"set {API_KEY_VAR} to a secret shared with the client (the same variable, or -o recheck_api_key=, "
                 "where vrl runs), or pass --no-auth behind another gate")
    if args.sandbox == "bwrap":
        why = check_sandbox(args.project)
        if why:
            ap.error(f"{why}; or pass --sandbox off (debugging only: then code the model's proof runs at compile "
                     "time sees this machine as this user does)")
    server = serve(args.project, args.port, args.host, args.lean.split(), args.jobs, key, args.sandbox, args.max_timeout_s)
    print(f"recheck_host: serving on {args.host}:{server.server_port} for {args.project} (sandbox {args.sandbox}, "
          f"{'key required' if key else 'NO authentication'}, jobs of at most {args.max_timeout_s:g} s)", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
