"""Several `vrl` commands one after another in one `torchrun` launch (a test helper, not a test module).

A launch costs its agent a start and every rank its interpreter, torch and transformers: several
CPU-seconds each, more than a small job itself. Tests that need several jobs on the same world size
therefore run them in one launch, in order, each through the real entry point (`vrl.cli.main`, exit
status and all), as `torchrun … -m vrl.cli …` would run each alone:

    torchrun --nproc-per-node 2 tests/torchrun_jobs.py JOBS.json

JOBS.json: `{"patch": MODULE or null, "jobs": [{"args": [...], "env": {...}, "patch": MODULE}, ...]}`.
`patch` names a module whose `patched()` context is held around every job (a test's instrumentation, e.g.
tests/es_torchrun_patches.py), or, given in a job, around that job; each job's `env` is set for that job
only. A job `{"worker": MODULE, "args": [...]}` is no `vrl` command but `MODULE.run(args, N)` (N: the job's
index), which sets up its own process groups (`fresh_group`) and raises what fails, ending the launch:
tests/grpo_fsdp_worker.py's GRPO steps, run in the launch of the `vrl train` jobs they share it with. Before each job rank 0 writes
a line `=== job N ===` to stdout and stderr (`split` cuts its agent's output at them). A job that exits with a
non-zero status ends the launch with that status and the jobs after it do not run, so a job meant
to fail comes last; one that fails on rank 0 alone and releases the other ranks as a run does (an error
raised in rank 0's loop, not a dead rank) may go earlier with `"then": "continue"`: the jobs after it
run, and the launch exits with the first non-zero status.

The first job sets up its process group through torch's own rendezvous, as a launch of one job does.
Each later job's group is set up under a key prefix of its own in the launcher's store
(`fresh_group`): re-initialising under the same keys would read the previous group's addresses, and a
rank that started early would connect to a port already closed.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

MARK = "=== job {} ==="
ROOT = Path(__file__).parent.parent  # the repository: the launches' working folder, on their PYTHONPATH


def commands(*args: str, ranks: int = 2, nodes: int = 1,
             env: dict[str, str] | None = None) -> tuple[list[list[str]], dict[str, str]]:
    """`torchrun`'s command per node on a free port, as a user starts `ranks` ranks: one node of `ranks`
    processes (`--nnodes 1`, c10d rendezvous), or `nodes` agents of `ranks // nodes` processes each
    (`--nnodes N --node-rank i`, as on N hosts, here sharing this machine's filesystem); and their
    environment: this process's, one OMP thread, the repository on PYTHONPATH, then `env`."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}
    with socket.socket() as s:  # a free port: two test sessions on one machine must not meet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks // nodes)]
    if nodes == 1:
        return [[*run, "--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 *args]], environment
    return [[*run, "--nnodes", str(nodes), "--node-rank", str(i), "--master-addr", "127.0.0.1",
             "--master-port", str(port), *args] for i in range(nodes)], environment


def agents(cmds: list[list[str]], env: dict[str, str], timeout: float,
           stop_when: Callable[[], bool] | None = None) -> list[subprocess.CompletedProcess]:
    """Start every command of `cmds` (a launch's agents, or one plain process) and wait for all. One still
    running after `timeout` seconds is killed with its ranks (torchrun starts each rank in a session of its
    own, so they would outlive it) and TimeoutError raised; an agent left when another failed is killed.
    `stop_when`: once it returns True (asked every 0.2 s), every agent gets SIGTERM, as a scheduler stops a
    launch."""
    from vrl import reaper

    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for c in cmds]
    if stop_when is not None:
        def stop() -> None:
            while any(p.poll() is None for p in procs):
                if stop_when():
                    for p in procs:
                        with contextlib.suppress(ProcessLookupError):
                            p.send_signal(signal.SIGTERM)
                    return
                time.sleep(0.2)

        threading.Thread(target=stop, daemon=True).start()
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        for p in procs:
            ranks = reaper.tree(reaper.children(p.pid))
            p.kill()
            for pid, _ in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        raise TimeoutError(f"the launch still ran after {timeout} s") from None
    finally:
        for p in procs:
            if p.poll() is None:  # the other agent failed first
                p.kill()
                p.communicate()
    return [subprocess.CompletedProcess(c, p.returncode, *out) for c, p, out in zip(cmds, procs, outs)]


@contextlib.contextmanager
def fresh_group(index: int | str) -> Iterator[None]:
    """Inside the block, `torch.distributed.init_process_group` called as vrl calls it (backend and
    timeout, no store) starts the default group under the prefix `job-{index}` of the launcher's store."""
    import torch.distributed as dist

    init = dist.init_process_group

    def prefixed(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None, **kwargs):
        if store is None and init_method is None:
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=datetime.timedelta(seconds=300))
            store = dist.PrefixStore(f"job-{index}", client)
            world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        return init(backend, init_method=init_method, timeout=timeout, world_size=world_size, rank=rank, store=store,
                    **kwargs)

    dist.init_process_group = prefixed
    try:
        yield
    finally:
        dist.init_process_group = init


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """`env` set in this process's environment inside the block, and the previous values back after."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def split(output: str) -> list[str]:
    """An output of a launch of this script, cut into each job's part (in job order)."""
    parts = output.split("\n")
    jobs: list[list[str]] = []
    for line in parts:
        if line.startswith("=== job ") and line.endswith(" ==="):
            jobs.append([])
        elif jobs:
            jobs[-1].append(line)
    return ["\n".join(lines) for lines in jobs]


def run(spec: dict) -> int:
    """Every job of `spec` in order; the first non-zero exit status, or 0."""
    from vrl.cli import main

    first = 0

    with contextlib.ExitStack() as stack:
        if spec.get("patch"):
            stack.enter_context(importlib.import_module(spec["patch"]).patched())
        for i, job in enumerate(spec["jobs"]):
            for stream in (sys.stdout, sys.stderr) if os.environ.get("RANK", "0") == "0" else ():
                print(MARK.format(i), file=stream, flush=True)
            if job.get("worker"):
                importlib.import_module(job["worker"]).run(job["args"], i)
                continue
            patch = importlib.import_module(job["patch"]).patched() if job.get("patch") else contextlib.nullcontext()
            with environment(job.get("env", {})), (fresh_group(i) if i else contextlib.nullcontext()), patch:
                try:
                    main.main(job["args"], prog_name="vrl")  # standalone: exits as `vrl` does
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                    if code and job.get("then") != "continue":
                        return code
                    first = first or code
    return first


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.exit(run(json.load(f)))
