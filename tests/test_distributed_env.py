"""Rank 0's vLLM engine under torchrun: the environment its processes start with.

vLLM is not installed on this machine; what is tested is the mechanism that stalled the engine on 2
GPUs, with the real torch: a process started by a torchrun rank inherits TORCHELASTIC_USE_AGENT_STORE=True,
and then torch's `init_process_group` on a private tcp:// address (what vLLM 0.26's one-GPU worker
calls, world size 1) connects as a client of a store nobody serves and times out instead of starting
one. The child here is started as vLLM starts its engine core (multiprocessing, spawn) and makes that
same call; the launch variables are the ones torchrun exports (set here, not by a real torchrun).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing
import os
import socket

import pytest
from rich.console import Console

from vrl import distributed

TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"}


def _engine_worker(port: int, out) -> None:
    """What vLLM's one-GPU worker does first: a torch.distributed world of one on its own tcp:// port."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0,
                                timeout=datetime.timedelta(seconds=2))
        dist.destroy_process_group()
        out.put("ready")
    except Exception as exc:  # the client socket timed out: nobody serves the store it looked for
        out.put(f"{type(exc).__name__}: {exc}".splitlines()[0])


def _start_engine() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_engine_worker, args=(port, out))
    child.start()
    child.join(60)
    return out.get(timeout=10)


@pytest.mark.slow  # spawns Python twice, one of them waiting out a connect timeout
def test_an_engine_started_outside_the_launch_sets_up_its_own_world(monkeypatch):
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    assert _start_engine() != "ready"  # the defect: inside the launch's environment it cannot start
    before = dict(os.environ)
    with distributed.outside_launch():
        assert not any(k in os.environ for k in TORCHRUN)
        assert _start_engine() == "ready"
    assert dict(os.environ) == before  # vrl's own rank and world size come back for the rest of the run
    assert distributed.rank() == 0 and distributed.world_size() == 2


def test_a_launch_refuses_an_engine_inside_rank_0s_process(tmp_path, monkeypatch):
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 puts the engine in rank 0's own process, where its
    torch.distributed set-up meets rank 0's: refused in one line before a run directory exists."""
    from vrl.config import build
    from vrl.envs.letters import LettersEnvironment
    from vrl.errors import UsageError
    from vrl.trainer import Trainer

    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    runs = tmp_path / "runs"
    cfg = build({"plugin": "letters", "optimizer": "grpo", "generator": {"backend": "vllm"},
                 "logging": {"runs_dir": str(runs), "name": "r"}})
    with pytest.raises(UsageError, match="VLLM_ENABLE_V1_MULTIPROCESSING") as err:
        Trainer(cfg, environment=LettersEnvironment(), console=Console(file=io.StringIO()))
    assert "\n" not in str(err.value) and not runs.exists()
