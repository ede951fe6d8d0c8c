"""ES optimizer on the tiny model: exact perturb/restore, the update rule, every config field, history and replay."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from vrl.config import SamplingConfig
from vrl.errors import SelectionError
from vrl.generate import tiny
from vrl.generate.hf import HFGenerator
from vrl.optim.es import ES, ESConfig, ESHistory, normalize
from vrl.types import Completion, Result, Task, Verdict
from vrl.weights import noise as nz

BASE = {"model": "tiny", "revision": None}


def _generator(dtype: torch.dtype = torch.float32) -> HFGenerator:
    return HFGenerator(tiny.build_model().to(dtype), tiny.build_tokenizer(), SamplingConfig(max_new_tokens=4))


def _es(dtype: torch.dtype = torch.float32, seed: int = 0, **config) -> ES:
    es = ES(ESConfig(**config), seed=seed, base=BASE)
    es.setup(_generator(dtype))
    return es


def _weights(es: ES) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in es.host.model.named_parameters()}


def _finished(run_dir: Path) -> int:
    """The run's finished iterations, as the trainer passes them to `load` (state.json)."""
    return json.loads((run_dir / "state.json").read_text())["iteration"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _results(rewards: list[float] | list[list[float]], tasks: int = 1) -> list[Result]:
    """Rewarded results: rewards[i] for member i (a list: one reward per task)."""
    out = []
    for i, r in enumerate(rewards):
        per_task = r if isinstance(r, list) else [r] * tasks
        for t, value in enumerate(per_task):
            task = Task(id=f"t{t}", prompt="p")
            completion = Completion(task_id=task.id, text="x", variant=i)
            out.append(Result(task=task, completion=completion, verdict=Verdict.ok(), reward=value))
    return out


def _step(es: ES, rewards: list[float]) -> dict[str, float]:
    es.ask()
    return es.tell(_results(rewards))


# -- config ---------------------------------------------------------------------------------------------


def test_config_defaults_follow_the_paper() -> None:
    c = ESConfig()
    assert (c.population_size, c.sigma, c.step_size, c.normalization, c.antithetic) == (30, 1e-3, 5e-4, "zscore", False)
    assert ESConfig(sigma=0.02, alpha=0.5).step_size == 0.5


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"antithetic": True, "population_size": 5}, "even population_size"),
        ({"include": []}, "at least one parameter pattern"),
        ({"normalization": "softmax"}, "zscore"),
        ({"sigma": 0}, "greater than 0"),
        ({"snapshot_every": -1}, "greater than or equal to 0"),
        ({"population_size": 1}, "greater than or equal to 2"),
    ],
)
def test_config_rejects_bad_values(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ESConfig(**fields)


def test_selection_that_matches_nothing_names_the_parameters() -> None:
    with pytest.raises(SelectionError, match="select no parameter; .* look like: model.embed_tokens.weight"):
        _es(include=["nothing.*"])


# -- ask / sampling a member -------------------------------------------------------------------------------------


def test_ask_gives_population_size_members_with_reproducible_seeds() -> None:
    es = _es(population_size=6)
    variants = es.ask()
    assert [v.index for v in variants] == list(range(6))
    assert len({v.seed for v in variants}) == 6 and all(v.sign == 1 for v in variants)
    assert [v.seed for v in _es(population_size=6).ask()] == [v.seed for v in variants]  # pure function of run seed
    assert [v.seed for v in _es(population_size=6, seed=1).ask()] != [v.seed for v in variants]
    es.tell(_results([0.0, 1, 2, 3, 4, 5]))
    assert es.ask()[0].seed != variants[0].seed  # a new iteration draws new noise


def test_antithetic_members_come_in_pairs() -> None:
    variants = _es(population_size=6, antithetic=True).ask()
    assert [(v.seed - variants[0].seed, v.sign) for v in variants] == [(0, 1), (0, -1), (1, 1), (1, -1), (2, 1), (2, -1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_member_is_sampled_from_sigma_noise_and_restored_bit_exactly_by_sigma_noise_and_restores_bit_exactly(dtype: torch.dtype) -> None:
    sigma = 0.01
    es = _es(dtype, population_size=4, sigma=sigma)
    before = _weights(es)
    v = es.ask()[1]
    with es.host.applied(v):
        inside = _weights(es)
    assert _same_bits(_weights(es), before)
    assert not _same_bits(inside, before)
    scale = nz.noise_scale(sigma)
    for name, w in before.items():
        s = nz.noise_int(nz.tensor_keys(v.seed, nz.name_words(name)), 0, w.numel()).float().view(w.shape)
        expected = (w.float() + s * scale).to(dtype)
        assert torch.equal(_bits(inside[name]), _bits(expected)), name
    if dtype == torch.float32:  # the perturbation has standard deviation σ
        delta = torch.cat([(inside[n] - before[n]).flatten() for n in before])
        assert abs(delta.std().item() / sigma - 1) < 0.02


def test_a_member_restores_after_an_exception_and_negative_sign() -> None:
    es = _es(population_size=2, antithetic=True, sigma=0.05)
    before = _weights(es)
    plus, minus = es.ask()
    with es.host.applied(plus):
        w_plus = _weights(es)
    with pytest.raises(RuntimeError, match="boom"), es.host.applied(minus):
        w_minus = _weights(es)
        raise RuntimeError("boom")
    assert _same_bits(_weights(es), before)
    for n in before:  # fp32 model: θ+σε and θ−σε sit symmetrically around θ (to rounding)
        assert torch.allclose(w_plus[n] + w_minus[n], 2 * before[n], atol=1e-6)


def test_generation_sees_the_perturbed_weights() -> None:
    es = _es(population_size=2, sigma=0.5)
    tasks = [Task(id="a", prompt="hello ")]
    base = es.host.generate(tasks, seed=1)[0].text
    with es.host.applied(es.ask()[0]):
        perturbed = es.host.generate(tasks, seed=1)[0].text
    assert es.host.generate(tasks, seed=1)[0].text == base
    assert perturbed != base


# -- tell: the update rule ------------------------------------------------------------------------------


@pytest.mark.parametrize("antithetic", [False, True])
def test_update_is_alpha_over_n_sum_z_eps(antithetic: bool) -> None:
    es = _es(population_size=4, sigma=0.01, alpha=0.3, antithetic=antithetic)
    before = _weights(es)
    variants = es.ask()
    rewards = [0.1, 0.7, 0.4, 0.0]
    metrics = es.tell(_results(rewards))
    z = normalize(rewards, "zscore")
    assert metrics["es/member_reward_max"] == 0.7 and es.history.iterations[0].z == [round(v, 4) for v in z]
    after = _weights(es)
    for name, w in before.items():
        step = sum(v.sign * zi * nz.noise(v.seed, name, w.shape).double() for v, zi in zip(variants, z))
        expected = w.double() + 0.3 / 4 * step
        assert torch.allclose(after[name].double(), expected, rtol=0, atol=1e-4), name
        assert not torch.equal(after[name], w)


@pytest.mark.parametrize("antithetic", [False, True])
def test_a_lost_member_is_dropped_and_the_step_is_the_one_without_it(antithetic: bool, tmp_path: Path) -> None:
    """A member with no result (its remote call failed after its retries) is dropped with its antithetic
    partner; θ moves bit for bit as an iteration of only the other members would move it (α/N over
    those), the loss is counted, and replaying the history gives the same θ. Above es.max_lost_share
    of N lost, the iteration fails."""
    from vrl.weights.update import FullRankUpdate

    es = _es(population_size=8, alpha=0.3, antithetic=antithetic, max_lost_share=0.25)
    variants = es.ask()
    rewards = [0.1, 0.7, 0.4, 0.0, 0.9, 0.2, 0.6, 0.3]
    metrics = es.tell([r for r in _results(rewards) if r.completion.variant != 2])
    lost = {2, 3} if antithetic else {2}
    kept = [v for v in variants if v.index not in lost]
    z = [round(v, 4) for v in normalize([rewards[v.index] for v in kept], "zscore")]
    alone = _es(population_size=8, alpha=0.3, antithetic=antithetic)
    alone.host.update(FullRankUpdate.from_members([(v.seed, v.sign) for v in kept], z, 0.3))
    assert _same_bits(_weights(es), _weights(alone))
    record = es.history.iterations[0]
    assert record.lost == sorted(lost) and metrics["es/lost_members"] == len(lost)
    assert [record.z[i] for i in sorted(lost)] == [0.0] * len(lost)
    es.save(tmp_path)
    replayed = _es(population_size=8, alpha=0.3, antithetic=antithetic, max_lost_share=0.25)
    replayed.load(tmp_path, 1)
    assert _same_bits(_weights(replayed), _weights(es))
    es.ask()
    with pytest.raises(ValueError, match=rf"{6 if antithetic else 3} of 8 members lost is more than es.max_lost_share"):
        es.tell([r for r in _results(rewards) if r.completion.variant not in (0, 2, 4)])


def test_alpha_defaults_to_half_sigma() -> None:
    a, b = _es(population_size=2, sigma=0.02), _es(population_size=2, sigma=0.02, alpha=0.01)
    theta0 = _weights(a)
    _step(a, [0.0, 1.0])
    _step(b, [0.0, 1.0])
    assert _same_bits(_weights(a), _weights(b))
    assert a.history.alpha == 0.01
    c = _es(population_size=2, sigma=0.02, alpha=0.02)
    _step(c, [0.0, 1.0])
    d_a = sum((_weights(a)[n] - theta0[n]).abs().sum() for n in theta0)
    d_c = sum((_weights(c)[n] - theta0[n]).abs().sum() for n in theta0)
    assert abs(d_c / d_a - 2) < 1e-3


def test_equal_rewards_leave_the_weights_alone() -> None:
    es = _es(population_size=3)
    before = _weights(es)
    metrics = _step(es, [0.5, 0.5, 0.5])
    assert _same_bits(_weights(es), before) and metrics["es/member_reward_std"] == 0.0
    assert es.history.iterations[0].z == [0.0, 0.0, 0.0]


def test_bf16_model_accumulates_small_steps_in_the_fp32_master() -> None:
    es = _es(torch.bfloat16, population_size=2, sigma=1e-3, alpha=1e-5)
    before = _weights(es)
    master0 = es.host.state()
    for _ in range(3):
        _step(es, [0.0, 1.0])
    master = es.host.state()
    total = sum(w.numel() for w in before.values())
    moved = sum(int((master[n] != master0[n]).sum()) for n in master)
    changed_bf16 = sum(int((_weights(es)[n] != before[n]).sum()) for n in before)
    # Steps of ~1e-5 move almost every fp32 master weight but fewer bf16 weights (they sit below half a
    # bf16 step on most weights): the master keeps what a bf16 update would round away.
    assert moved > 0.99 * total and changed_bf16 < 0.8 * total
    for n, w in _weights(es).items():
        assert torch.equal(_bits(w), _bits(master[n].to(torch.bfloat16)))  # weights are exactly cast(θ)


def test_normalizations() -> None:
    r = [1.0, 3.0, 2.0, 2.0]
    z = normalize(r, "zscore")
    assert abs(sum(z)) < 1e-12 and abs(sum(v * v for v in z) / 4 - 1) < 1e-12 and z[1] > z[2] > z[0]
    assert normalize(r, "rank") == [-0.5, 0.5, 0.0, 0.0]  # ties share the average rank
    assert normalize([5.0, 5.0], "rank") == [0.0, 0.0]
    # group: member 0 best on task a, member 1 best on task b; task c carries no signal, so the mean is
    # over a and b alone (issue 58: a constant task does not shrink the step).
    per_task = [[1.0, 0.0, 0.3], [0.0, 1.0, 0.3], [0.0, 0.0, 0.3]]
    g = normalize([0.43, 0.43, 0.1], "group", per_task)
    za = normalize([1.0, 0.0, 0.0], "zscore")
    assert g == pytest.approx([(za[0] + za[1]) / 2, (za[1] + za[0]) / 2, (za[1] + za[1]) / 2])
    with pytest.raises(ValueError, match="unknown ES normalization"):
        normalize(r, "softmax")


def test_normalization_needs_no_torch(monkeypatch) -> None:
    """The detached Modal orchestrator normalises member rewards and holds no weights: `normalize` must not
    import torch (1-2 CPU-seconds of each orchestrator container's start). A task whose members all scored
    the same carries no signal (exactly zero, not a z-score of rounding noise)."""
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # `import torch` now raises ImportError
    assert normalize([1.0, 3.0, 2.0, 2.0], "rank") == [-0.5, 0.5, 0.0, 0.0]
    assert normalize([0.1, 0.1, 0.1], "zscore") == [0.0, 0.0, 0.0]
    z = normalize([0.1, 0.2, 0.7], "zscore")
    assert abs(sum(z)) < 1e-12 and abs(sum(v * v for v in z) / 3 - 1) < 1e-12
    assert normalize([0.5, 0.5], "group", [[1.0, 0.3], [0.0, 0.3]]) == [1.0, -1.0]  # task 2: no signal
    with pytest.raises(ValueError, match="same tasks for every member"):
        normalize([0.5, 0.5], "group", [[1.0, 0.3], [0.0]])


@pytest.mark.parametrize("method", ["rank", "group"])
def test_tell_uses_the_configured_normalization(method: str) -> None:
    es = _es(population_size=3, normalization=method)
    es.ask()
    # Member rewards per task (t0, t1): the means tie members 0 and 1, their per-task spread does not.
    results = _results([[1.0, 0.0], [0.2, 0.8], [0.0, 0.0]])
    es.tell(results)
    z = es.history.iterations[0].z
    if method == "rank":
        assert z == [0.25, 0.25, -0.5]
    else:
        assert z == [round(v, 4) for v in normalize([0.5, 0.5, 0.0], "group", [[1.0, 0.0], [0.2, 0.8], [0.0, 0.0]])]
        assert z[0] != z[1]


def test_tell_refuses_incomplete_or_foreign_results() -> None:
    es = _es(population_size=3)
    es.ask()
    with pytest.raises(ValueError, match=r"members \[2\] have no results"):
        es.tell(_results([0.1, 0.2]))
    with pytest.raises(ValueError, match="members 0..2"):
        es.tell(_results([0.1, 0.2, 0.3, 0.4]))
    g = _es(population_size=2, normalization="group")
    g.ask()
    both_tasks = _results([[1.0, 0.0]])  # member 0 answered t0 and t1
    only_t0 = [r.model_copy(update={"completion": r.completion.model_copy(update={"variant": 1})}) for r in both_tasks[:1]]
    with pytest.raises(ValueError, match="every member to answer every task"):
        g.tell(both_tasks + only_t0)
    with pytest.raises(RuntimeError, match="without a preceding ask"):
        _es(population_size=2).tell(_results([0.0, 1.0]))


def test_include_and_exclude_select_the_trained_parameters() -> None:
    es = _es(population_size=2, sigma=0.05, include=["model.layers.*", "lm_head.*"], exclude=["*norm*"])
    selected = set(es.info.names)
    assert "lm_head.weight" in selected and "model.embed_tokens.weight" not in selected
    assert not any("norm" in n for n in selected)
    before = _weights(es)
    with es.host.applied(es.ask()[0]):
        inside = _weights(es)
    es.tell(_results([0.0, 1.0]))
    after = _weights(es)
    for n in before:
        assert torch.equal(inside[n], before[n]) == (n not in selected), n
        assert torch.equal(after[n], before[n]) == (n not in selected), n


# -- history, save, load, replay ------------------------------------------------------------------------


def _run(es: ES, iterations: int, run_dir: Path | None = None) -> None:
    g = torch.Generator().manual_seed(es.iteration)
    for _ in range(iterations):
        es.ask()
        es.tell(_results(torch.rand(es.config.population_size, generator=g).tolist()))
        if run_dir is not None:
            es.save(run_dir)
            (run_dir / "state.json").write_text(json.dumps({"iteration": es.iteration}))


def test_history_file_is_small_and_complete(tmp_path: Path) -> None:
    es = _es(population_size=30, sigma=0.01)
    _run(es, 2, tmp_path)
    text = (tmp_path / "es_history.json").read_text()
    data = json.loads(text)
    assert data["noise"] == "vrl-hash32-v1" and data["base"] == {"model": "tiny", "revision": None, "dtype": "float32"}
    assert (data["sigma"], data["alpha"], data["normalization"], data["population_size"]) == (0.01, 0.005, "zscore", 30)
    assert len(data["iterations"]) == 2 and len(data["iterations"][0]["z"]) == 30
    lines = [line for line in text.splitlines() if '"seed"' in line]
    assert len(lines) == 2 and all(len(line) < 300 for line in lines)  # ~250 bytes per iteration at N=30
    assert ESHistory.read(tmp_path / "es_history.json") == es.history


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_reproduces_the_trained_weights_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    trained = _es(dtype, population_size=4, sigma=0.02, antithetic=True)
    _run(trained, 3, tmp_path)
    assert not _same_bits(_weights(trained), _weights(_es(dtype)))
    fresh = _es(dtype, population_size=4, sigma=0.02, antithetic=True)
    fresh.load(tmp_path, _finished(tmp_path))
    assert _same_bits(_weights(fresh), _weights(trained))
    assert _same_bits(fresh.host.state(), trained.host.state())  # the fp32 master too
    assert fresh.iteration == 3 and fresh.ask()[0].seed == trained.ask()[0].seed


def test_load_ignores_an_update_saved_after_the_last_finished_iteration(tmp_path: Path) -> None:
    es = _es(population_size=3)
    _run(es, 2, tmp_path)
    expected = _weights(es)
    _run(es, 1)
    es.save(tmp_path)  # crash between es.save and state.json: the history is one iteration ahead
    fresh = _es(population_size=3)
    fresh.load(tmp_path, _finished(tmp_path))
    assert fresh.iteration == 2 and _same_bits(_weights(fresh), expected)


def test_snapshots_bound_the_replay(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    es = _es(population_size=3, snapshot_every=2)
    _run(es, 5, tmp_path)
    snaps = sorted(p.name for p in (tmp_path / "es_snapshots").iterdir())
    assert snaps == ["iter-000002.safetensors", "iter-000004.safetensors"]
    fresh = _es(population_size=3, snapshot_every=2)
    with caplog.at_level(logging.INFO, logger="vrl.optim.es"):
        fresh.load(tmp_path, _finished(tmp_path))
    assert "snapshot 4, replayed 1" in caplog.text
    assert _same_bits(_weights(fresh), _weights(es))
    _run(es, 2, tmp_path)  # iteration 6 writes a snapshot and keeps the two newest
    assert sorted(p.name for p in (tmp_path / "es_snapshots").iterdir()) == ["iter-000004.safetensors", "iter-000006.safetensors"]


def test_a_long_replay_says_how_far_it_is(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Rebuilding θ replays every member's noise (72-80 s an iteration for 135M weights on 2 cores): the
    replay announces its length and reports its progress every REPLAY_REPORT_S seconds, never after the last
    iteration (the caller reports the end); a one-iteration replay stays quiet."""
    from vrl.optim import es as es_module

    es = _es(population_size=3)
    _run(es, 4, tmp_path)
    monkeypatch.setattr(es_module, "REPLAY_REPORT_S", 0.0)
    fresh = _es(population_size=3)
    with caplog.at_level(logging.INFO, logger="vrl.optim.es"):
        fresh.load(tmp_path, _finished(tmp_path))
    lines = [r.getMessage() for r in caplog.records]
    assert "ES: rebuilding θ: replaying 4 iterations of 3 members" in lines
    assert [m.split(" (")[0] for m in lines if m.startswith("ES: replayed")] == \
        [f"ES: replayed {i} of 4 iterations" for i in (1, 2, 3)]
    assert _same_bits(_weights(fresh), _weights(es))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vrl.optim.es"):
        es_module.replay(fresh.history, fresh.host, 3, 4)  # one iteration
    assert not [r for r in caplog.records if "replay" in r.getMessage()]


def test_snapshot_from_another_history_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    es = _es(population_size=3, snapshot_every=2)
    _run(es, 3, tmp_path)
    other = _es(population_size=3, snapshot_every=2, seed=5)  # a different run writes its snapshot here
    _run(other, 2)
    other._save_snapshot(tmp_path)
    fresh = _es(population_size=3, snapshot_every=2)
    with caplog.at_level(logging.INFO, logger="vrl.optim.es"):
        fresh.load(tmp_path, _finished(tmp_path))
    assert "snapshot 0, replayed 3" in caplog.text and _same_bits(_weights(fresh), _weights(es))


@pytest.mark.parametrize(
    "change,message",
    [({"sigma": 0.5}, "sigma=0.01"), ({"alpha": 0.1}, "alpha=0.005"), ({"exclude": ["lm_head.*"]}, "exclude=")],
)
def test_load_refuses_a_history_from_other_settings(tmp_path: Path, change: dict, message: str) -> None:
    _run(_es(population_size=2, sigma=0.01), 1, tmp_path)
    with pytest.raises(ValueError, match=f"cannot resume: .*{message}"):
        _es(population_size=2, **{"sigma": 0.01, **change}).load(tmp_path, _finished(tmp_path))


def test_load_refuses_other_base_models_and_noise_versions(tmp_path: Path) -> None:
    _run(_es(population_size=2), 1, tmp_path)
    with pytest.raises(ValueError, match="base="):
        _es(torch.bfloat16, population_size=2).load(tmp_path, _finished(tmp_path))
    data = json.loads((tmp_path / "es_history.json").read_text())
    data["noise"] = "vrl-hash32-v0"
    (tmp_path / "es_history.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="noise scheme 'vrl-hash32-v0'"):
        _es(population_size=2).load(tmp_path, _finished(tmp_path))
    (tmp_path / "state.json").write_text(json.dumps({"iteration": 5}))
    data["noise"] = "vrl-hash32-v1"
    (tmp_path / "es_history.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="has 1 iterations but the run finished 5"):
        _es(population_size=2).load(tmp_path, _finished(tmp_path))
