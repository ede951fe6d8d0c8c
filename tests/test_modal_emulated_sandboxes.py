"""vrl's verifier sandboxes on the Modal emulator (tests/modal_emulator): issue 25, defects 6 and 10.

The real `SandboxPool` drives real `ModalSandbox` handles; each sandbox is an emulated Modal Sandbox
running vrl's verify server in the verifier image. Each test reproduces one defect and fails on the
code it was written against (strict xfail: the fix turns it into a pass); its docstring says what real
Modal would do.
"""

from __future__ import annotations

import asyncio
import json
import warnings

import pytest

from tests.modal_emulated import modal_config


def countdown_pool(tmp_path, **runtime):
    """A sandbox pool for countdown as the Modal runtime builds it, and its app (to run)."""
    from vrl.runtime.modal.app import build_app
    from vrl.runtime.modal.runtime import ModalRuntime

    cfg = modal_config(tmp_path, runtime={"verify_in": "sandbox", "sandboxes": 1, **runtime})
    runtime_ = ModalRuntime(cfg, app=build_app(cfg))
    return runtime_.sandboxes(cfg), runtime_.app.app


def countdown_attempts(n: int, size: int):
    from vrl.plugins import registry
    from vrl.types import Attempt, Completion

    task = registry().environment("countdown").tasks()[0]
    text = "<answer>1 + 1</answer>" + "x" * max(0, size - 22)
    return [Attempt(task=task, completion=Completion(task_id=task.id, sample=i, text=text)) for i in range(n)]


def judge(pool, attempts):
    async def go():
        try:
            return await pool.verify(attempts)
        finally:
            await pool.aclose()

    return asyncio.run(go())


def test_a_batch_over_2_mib_is_judged(emu, tmp_path):
    """Defect 6 (stdin). 64 attempts of 34 kB each (a Lean batch of 64 × 8k tokens is 1.6-2.2 MiB).

    Real Modal: `sb.stdin.write` queues into a buffer of at most 2 MiB and raises BufferError past it
    ("Buffer size exceed limit. Call drain to flush the buffer.", modal/io_streams.py
    `_StreamWriterThroughServer`, MAX_BUFFER_SIZE = 2 * 1024 * 1024). `ModalSandbox.send` writes the
    whole request line at once: SandboxDied, restart, the same again, and every attempt scores crashed.
    """
    from vrl.types import Status

    pool, app = countdown_pool(tmp_path)
    attempts = countdown_attempts(64, 34_000)
    line = json.dumps({"id": 1, "op": "verify", "attempts": [a.model_dump(mode="json") for a in attempts]})
    assert len(line) > 2 * 1024 * 1024
    with app.run():
        verdicts = judge(pool, attempts)
    assert [v.status for v in verdicts if v.status is Status.CRASHED] == []


@pytest.mark.xfail(strict=True, reason="issue 25 defect 6: the pool calls the blocking sb.poll() inside its event "
                   "loop (Modal warns AsyncUsageWarning; every batch stalls for one round trip)")
def test_the_pool_uses_modals_async_interface_in_its_event_loop(emu, tmp_path):
    """Defect 6 (event loop). Judging a batch raises no AsyncUsageWarning.

    Real Modal: `ModalSandbox.running()` calls `self._sb.poll()`, the blocking interface, from the
    pool's coroutine; synchronicity warns "A blocking Modal interface is being used in an async
    context" (AsyncUsageWarning, modal/_utils/async_utils.py) and the loop waits for the RPC.
    """
    import modal

    pool, app = countdown_pool(tmp_path)
    with app.run(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        judge(pool, countdown_attempts(2, 30))
    assert [str(w.message)[:60] for w in caught if issubclass(w.category, modal.exception.AsyncUsageWarning)] == []


@pytest.mark.slow  # two sandbox restarts and a GPU worker: about 10 s
@pytest.mark.xfail(strict=True, reason="issue 25 defect 10: a verifier sandbox that dies on every batch scores the "
                   "attempts `crashed` with reward 0, and the run learns from it silently")
def test_a_dead_sandbox_never_scores_as_a_wrong_answer(emu, tmp_path):
    """Defect 10. The verifier sandbox dies during every batch of an ES run.

    Real Modal: a sandbox that is killed (out of memory, a crash of what it runs) closes its streams;
    the pool restarts it and retries once, then returns `crashed` verdicts, which the reward turns
    into 0 and ES ranks like wrong answers: no error, no count of excluded members. An infrastructure
    failure must fail the iteration with a clear error or exclude the member explicitly (in metrics).
    """
    from vrl.rundir import read_jsonl
    from vrl.runtime import make_runtime
    from vrl.trainer import Trainer

    def kill_on_verify(service, sandbox, data):
        if b'"op": "verify"' in data:
            service.kill_sandbox(sandbox.sid)

    emu.on("sandbox_stdin", kill_on_verify)
    cfg = modal_config(tmp_path, name="dead", iterations=1, runtime={"verify_in": "sandbox", "sandboxes": 1})
    try:
        Trainer(cfg, runtime=make_runtime(cfg)).run()
    except Exception as exc:  # noqa: BLE001 - failing the iteration clearly is one right answer
        assert "sandbox" in str(exc).lower(), exc
        return
    rows = read_jsonl(tmp_path / "runs" / "dead" / "metrics.jsonl")
    assert rows and all(any("excluded" in key and value for key, value in row.items()) for row in rows), \
        "every verifier sandbox died, yet the iteration was scored as if its attempts were wrong"
