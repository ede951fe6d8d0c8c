"""GRPO checkpoints off the critical path: written in the background from a host-memory snapshot, on a
cadence, a configurable number kept, and refused in one line when the disk cannot hold them.

The real Trainer and the tiny model; the only stand-in is the free-space probe
(`vrl.optim.checkpoints.free_bytes`), replaced to play a nearly full disk.
"""

from __future__ import annotations

import io
import logging

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from tests.test_grpo import _final_weights, _toy_config, make_generator, make_grpo, sample_results
from vrl.envs.letters import LettersEnvironment
from vrl.optim import checkpoints
from vrl.optim.checkpoints import Cadence, CheckpointRefused
from vrl.rundir import RunDir
from vrl.trainer import Trainer

FILE = "model.safetensors"


def _names(run: RunDir) -> list[str]:
    return sorted(p.name for p in (run.path / "grpo").iterdir())


def _disk(monkeypatch, refuse: set[int]) -> list[int]:
    """A disk that is nearly full on the n-th checkpoint check for n in `refuse` (1-based), roomy otherwise."""
    calls: list[int] = []

    def free(path):
        calls.append(1)
        return 999 if len(calls) in refuse else 10**15

    monkeypatch.setattr(checkpoints, "free_bytes", free)
    return calls


def test_a_full_disk_stops_the_run_with_one_line_and_loses_no_finished_iteration(tmp_path, monkeypatch):
    """grpo.on_disk_full=stop (the default): the 3rd checkpoint does not fit. The run records iteration 3
    (metrics, samples, state), stops with one line naming what it needs and what is free, and keeps
    the last good checkpoint; a resume redoes iteration 3 from it and ends as an uninterrupted run."""
    straight = Trainer(_toy_config(tmp_path, "straight", 4), environment=LettersEnvironment(), console=Console(file=io.StringIO()))
    assert straight.run()["status"] == "finished"

    _disk(monkeypatch, refuse={3})
    cfg = _toy_config(tmp_path, "full", 4)
    first = Trainer(cfg, environment=LettersEnvironment(), console=Console(file=io.StringIO()))
    with pytest.raises(CheckpointRefused) as err:
        first.run()
    message = str(err.value)
    assert "\n" not in message
    assert "checkpoint refused: it needs" in message and "has 999 B free" in message
    assert "the last good one, iter-000002, is kept" in message and "grpo.on_disk_full=stop" in message
    assert first.run_dir.completed_iterations() == 3  # the iteration whose checkpoint was refused is recorded
    assert [r["iteration"] for r in first.run_dir.metrics()] == [0, 1, 2]
    assert first.run_dir.summary()["status"] == "failed"
    assert _names(first.run_dir) == ["iter-000002"]  # nothing half-written, the last good one kept

    monkeypatch.setattr(checkpoints, "free_bytes", lambda path: 10**15)
    out = io.StringIO()
    second = Trainer(cfg, run_dir=RunDir.open(first.run_dir.path), environment=LettersEnvironment(),
                     console=Console(file=out, width=200))
    assert second.run()["status"] == "finished"
    assert "redoing iterations 3..3" in out.getvalue()
    assert [r["reward_mean"] for r in second.run_dir.metrics()] == [r["reward_mean"] for r in straight.run_dir.metrics()]
    a, b = _final_weights(straight.run_dir, 4, FILE), _final_weights(second.run_dir, 4, FILE)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_disk_with_continue_skips_that_checkpoint_and_goes_on(tmp_path, monkeypatch, caplog):
    """grpo.on_disk_full=continue: the 2nd checkpoint is refused with one warning line, the run goes on
    and finishes; grpo.keep_checkpoints=3 keeps three."""
    calls = _disk(monkeypatch, refuse={2})
    cfg = _toy_config(tmp_path, "goes-on", 4, on_disk_full="continue", keep_checkpoints=3)
    trainer = Trainer(cfg, environment=LettersEnvironment(), console=Console(file=io.StringIO()))
    with caplog.at_level(logging.WARNING, logger="vrl.optim.grpo"):
        assert trainer.run()["status"] == "finished"
    refused = [r.getMessage() for r in caplog.records if "checkpoint refused" in r.getMessage()]
    assert len(refused) == 1 and "\n" not in refused[0] and "the run goes on" in refused[0]
    assert len(calls) == 4
    assert _names(trainer.run_dir) == ["iter-000001", "iter-000003", "iter-000004"]
    assert [r["iteration"] for r in trainer.run_dir.metrics()] == [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_background_write_holds_the_state_at_save_time(tmp_path, dtype):
    """save() copies the state to host memory and returns; training goes on while the files are written.
    The checkpoint holds the weights and AdamW state of the iteration it was taken at, not later ones,
    and loads back to those bits (bf16: the fp32 masters too)."""
    gen = make_generator(dtype=dtype)
    opt = make_grpo(gen, learning_rate=1e-2, save_every=1)
    opt.tell(sample_results(gen, seed=1))
    masters = [m.detach().clone() for m in opt.master]
    at_save = {k: v.clone() for k, v in gen.model.state_dict().items()}
    moments = [opt.optim.state[m]["exp_avg"].clone() for m in opt.master]
    opt.save(tmp_path)
    opt.tell(sample_results(gen, seed=2))  # changes every weight while the checkpoint is written
    opt.close()  # waits for the write
    assert any(not torch.equal(at_save[k], v) for k, v in gen.model.state_dict().items())
    saved = _final_weights(RunDir(tmp_path), 1, FILE)
    assert all(torch.equal(saved[k], at_save[k]) for k in saved)
    fresh = make_grpo(make_generator(dtype=dtype), learning_rate=1e-2)
    fresh.load(tmp_path, 1)
    assert all(torch.equal(a, b) for a, b in zip(fresh.master, masters))
    assert all(torch.equal(fresh.host.model.state_dict()[k], v) for k, v in at_save.items())
    assert all(torch.equal(fresh.optim.state[m]["exp_avg"], v) for m, v in zip(fresh.master, moments))


def test_cadence_by_iterations_and_by_time():
    now = [0.0]
    by_time = Cadence(every=0, interval_s=600, total=100, clock=lambda: now[0])
    now[0] = 599
    assert not by_time.due(5)
    now[0] = 600
    assert by_time.due(6)
    by_time.done()
    now[0] = 1000
    assert not by_time.due(7) and by_time.due(100)  # the last iteration always
    by_count = Cadence(every=3, interval_s=0, total=10, clock=lambda: now[0])
    assert [i for i in range(1, 11) if by_count.due(i)] == [3, 6, 9, 10]


@pytest.mark.parametrize("how", ["policy", "auto_over_the_limit"])
def test_the_last_iteration_writes_the_policy_alone_and_a_resume_redoes_the_run(tmp_path, monkeypatch, how):
    """save_last=policy, or auto with a whole state over its limit (the limit lowered to 0 bytes: a
    1.5B full fine-tune's 18 GB of masters and AdamW state is over the real 2 GB): the run's only
    checkpoint, after its last iteration, is grpo/policy-000003, a Hugging Face folder holding the same
    weights as a whole checkpoint's policy. Resuming that run for one more iteration redoes all of them
    from the start and ends as a straight 4-iteration run."""
    import vrl.optim.grpo as grpo_mod

    whole = Trainer(_toy_config(tmp_path, "whole", 3, save_every=0, save_last="full"),
                    environment=LettersEnvironment(), console=Console(file=io.StringIO()))
    assert whole.run()["status"] == "finished" and _names(whole.run_dir) == ["iter-000003"]
    grpo = {"save_every": 0, "save_last": "policy"}
    if how == "auto_over_the_limit":
        monkeypatch.setattr(grpo_mod, "AUTO_FULL_BYTES", 0)
        grpo["save_last"] = "auto"
    light = Trainer(_toy_config(tmp_path, "light", 3, **grpo), environment=LettersEnvironment(),
                    console=Console(file=io.StringIO()))
    assert light.run()["status"] == "finished"
    assert _names(light.run_dir) == ["policy-000003"]
    folder = light.run_dir.path / "grpo" / "policy-000003"
    assert (folder / "config.json").is_file() and not (folder / "train").exists()
    a, b = _final_weights(whole.run_dir, 3, FILE), load_file(str(folder / FILE))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    again = Trainer(_toy_config(tmp_path, "light", 3, **grpo), run_dir=RunDir.open(light.run_dir.path),
                    environment=LettersEnvironment(), console=Console(file=io.StringIO()))
    rows = light.run_dir.metrics()
    assert again.run()["status"] == "finished"  # resumed as it ended: nothing redone, nothing rewound
    assert again.run_dir.metrics() == rows and _names(again.run_dir) == ["policy-000003"]

    straight = Trainer(_toy_config(tmp_path, "straight", 4, save_every=0, save_last="full"),
                       environment=LettersEnvironment(), console=Console(file=io.StringIO()))
    assert straight.run()["status"] == "finished"
    out = io.StringIO()
    more = Trainer(_toy_config(tmp_path, "light", 4, **grpo), run_dir=RunDir.open(light.run_dir.path),
                   environment=LettersEnvironment(), console=Console(file=out, width=200))
    assert more.run()["status"] == "finished" and more.start_iteration == 0
    assert "redoing iterations 1..3" in out.getvalue()
    assert [r["reward_mean"] for r in more.run_dir.metrics()] == [r["reward_mean"] for r in straight.run_dir.metrics()]
    a = _final_weights(straight.run_dir, 4, FILE)
    b = load_file(str(more.run_dir.path / "grpo" / "policy-000004" / FILE))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _names(more.run_dir) == ["policy-000004"]  # the newest policy alone is kept


def test_a_background_write_that_fails_is_reported_at_the_next_checkpoint(tmp_path, monkeypatch):
    """The disk fills *while* the 2nd checkpoint is written in the background (after its space was
    checked): the next checkpoint reports it in one line, removes what the write left, keeps the last
    good one and stops the run, with every finished iteration recorded."""
    import safetensors.torch

    real, calls = safetensors.torch.save_file, []

    def save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    trainer = Trainer(_toy_config(tmp_path, "fails", 4), environment=LettersEnvironment(), console=Console(file=io.StringIO()))
    with pytest.raises(CheckpointRefused) as err:
        trainer.run()
    message = str(err.value)
    assert "\n" not in message
    assert "writing the checkpoint of iteration 2 failed (OSError: [Errno 28] No space left on device)" in message
    assert "the last good one, iter-000001, is kept" in message
    assert trainer.run_dir.completed_iterations() == 3
    assert _names(trainer.run_dir) == ["iter-000001"]


def test_a_checkpoint_from_before_sharded_checkpoints_still_loads(tmp_path):
    """The layout written before `train/` existed (policy/ + state.pt holding the AdamW state dict and the
    fp32 masters, written here as that code wrote it) loads to the same bits."""
    gen = make_generator(dtype=torch.bfloat16)
    opt = make_grpo(gen, learning_rate=1e-3)
    opt.tell(sample_results(gen))
    ckpt = tmp_path / "grpo" / "iter-000001"
    opt.model.save_pretrained(ckpt / "policy")
    opt.tokenizer.save_pretrained(ckpt / "policy")
    torch.save({"iteration": 1, "step": opt.step, "config": opt.config.model_dump(mode="json"),
                "optimizer": opt.optim.state_dict(), "scheduler": opt.scheduler.state_dict(),
                "master": [m.detach().cpu() for m in opt.master], "rng_cpu": torch.get_rng_state(), "rng_cuda": None},
               ckpt / "state.pt")
    fresh = make_grpo(make_generator(dtype=torch.bfloat16), learning_rate=1e-3)
    fresh.load(tmp_path, 1)
    assert fresh.iteration == 1 and fresh.step == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.master, opt.master))
    assert all(torch.equal(a, b) for a, b in zip(fresh.params, opt.params))
    for a, b in zip(fresh.master, opt.master):
        assert all(torch.equal(fresh.optim.state[a][k], opt.optim.state[b][k]) for k in opt.optim.state[b])


def test_a_checkpoint_keeps_the_moving_reference_and_the_entropy_controller(tmp_path):
    """sync_ref_model moves the reference and adaptive entropy control moves its coefficient: both are state, so a
    checkpoint restores them (not the initial policy, not the starting coefficient)."""
    fields = dict(learning_rate=1e-2, save_every=1, beta=0.04, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5,
                  entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=100.0, entropy_coef_delta=0.05)
    gen = make_generator()
    opt = make_grpo(gen, **fields)
    opt.tell(sample_results(gen, seed=1))
    ref = {k: v.detach().clone() for k, v in opt.ref_model.state_dict().items()}
    coef, last = opt.entropy_coef, opt._last_entropy
    opt.save(tmp_path)
    opt.close()
    fresh = make_grpo(make_generator(), **fields)
    assert coef == pytest.approx(0.15) and fresh.entropy_coef == 0.1  # moved up once (entropy below the target)
    assert any(not torch.equal(fresh.ref_model.state_dict()[k], v) for k, v in ref.items())
    fresh.load(tmp_path, 1)
    assert all(torch.equal(fresh.ref_model.state_dict()[k], v) for k, v in ref.items())
    assert (fresh.entropy_coef, fresh._last_entropy) == (coef, last)
