"""Episodes on the hf backend (DESIGN.md §6c): what GRPO trains on is exactly what was sampled over
three turns, the masks tell the model's tokens from the environment's, a slow or broken environment
step holds back only its own episode, low-rank ES members keep their slot through every turn, and
ES replay stays bit-exact with episodes. The tiny local model; no download."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from vrl.config import SamplingConfig, TrainConfig
from vrl.envs.guess import GuessEnvironment
from vrl.envs.letters import LettersEnvironment
from vrl.episodes import Episodes, Interaction, ModelTurn, Reply, environment_ids, turn_seed
from vrl.generate.hf import HFGenerator, load_model_and_tokenizer
from vrl.optim.es import ES, ESConfig
from vrl.optim.grpo import GRPO, GRPOConfig
from vrl.optim.logprobs import completion_logprobs
from vrl.policy import Variant
from vrl.runtime.local import LocalRuntime
from vrl.trainer import Trainer
from vrl.types import Result, Task, Verdict


class Echo(Interaction):
    """Answers every turn with a message naming the turn (never ends early); optionally slow or broken."""

    def __init__(self, turns: int = 3, delay: float = 0.0, fail: bool = False):
        self.max_turns, self.delay, self.fail = turns, delay, fail
        self.seen: list[ModelTurn] = []

    async def reply(self, turn: ModelTurn) -> Reply:
        self.seen.append(turn)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("the environment broke")
        return Reply(messages=[{"role": "user", "content": f"turn {turn.index} heard"}], passed=turn.index == 2)


class EchoEnv:
    name = "echo"

    def __init__(self, **by_task: Echo):
        self.by_task, self.made = by_task, []

    def interaction(self, task: Task) -> Interaction | None:
        made = self.by_task.get(task.id, Echo()) if self.by_task else Echo()
        self.made.append(made)
        return made


def _host(temperature: float = 1.0, max_new_tokens: int = 5, decoupled: bool = False) -> HFGenerator:
    model, tok = load_model_and_tokenizer("tiny", "cpu", "float32")
    host = HFGenerator(model, tok, SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, batch_size=8))
    if decoupled:
        host.decouple()
    return host


TASKS = [Task(id=f"t{i}", prompt=[{"role": "user", "content": f"task {i}"}]) for i in range(3)]


def test_three_turn_episodes_train_on_exactly_the_sampled_ids_with_exact_masks() -> None:
    host = _host(decoupled=True)  # records each token's log-prob under the distribution it was drawn from
    host.episodes(Episodes(EchoEnv()))
    completions = [c for batch in host.sample(TASKS, [Variant(0, samples_per_task=2)], seed=11) for c in batch]
    assert [(c.task_id, c.sample) for c in completions] == [(t.id, j) for t in TASKS for j in range(2)]
    tok = host.tokenizer
    for c in completions:
        turns = c.episode.turns
        assert [t.role for t in turns] == ["assistant", "user", "assistant", "user", "assistant"]
        # The trajectory is the turns' tokens back to back: model, environment, model, environment, model.
        runs, k = [], 0
        for t in turns:
            runs.append((t.role, c.token_ids[k : k + t.tokens], c.token_mask[k : k + t.tokens]))
            k += t.tokens
        assert k == len(c.token_ids) == len(c.token_mask) == len(c.logprobs)
        for role, ids, mask in runs:
            assert mask == [1 if role == "assistant" else 0] * len(ids)
        for i, (role, ids, _) in enumerate(runs):
            if role == "user":  # the environment's text tokenised once, as the chat template renders it
                assert ids == environment_ids(tok, [{"role": "user", "content": f"turn {(i + 1) // 2} heard"}])
        assert c.completion_tokens == sum(c.token_mask)
        assert c.text == turns[-1].content and [t.passed for t in turns if t.role == "assistant"] == [False, True, False]
        assert c.episode.metrics["turns"] == 3 and c.episode.metrics["env_tokens"] == len(c.token_mask) - sum(c.token_mask)

    # Tokens in, tokens out: one forward over prompt + trajectory gives, at every model token, the log-prob
    # the sampler recorded when it drew that token turn by turn. Were any earlier turn re-tokenised or the
    # environment's tokens not the ones the model saw, the contexts would differ and so would these.
    grpo = GRPO(GRPOConfig(num_generations=2, micro_batch_size=8, learning_rate=1e-3, lr_scheduler_type="constant"), seed=0)
    grpo.setup(host)
    results = [Result(task=TASKS[int(c.task_id[1])], completion=c, verdict=Verdict.ok(), reward=float(i % 2))
               for i, c in enumerate(completions)]
    batch = grpo._micro_batch(results, list(range(len(results))), torch.zeros(len(results)), [False] * len(results))
    for row, c in enumerate(completions):
        n, p = len(c.token_ids), len(c.prompt_token_ids)
        assert batch.packed.input_ids[row, : p + n].tolist() == c.prompt_token_ids + c.token_ids
        assert batch.mask[row, :n].tolist() == [float(m) for m in c.token_mask]  # GRPO's mask is the model's tokens
        assert batch.mask[row, n:].sum() == 0
    model = grpo.model
    with torch.no_grad():
        logps = completion_logprobs(model, batch.packed, 1.0)
    for row, c in enumerate(completions):
        model_at = torch.tensor(c.token_mask, dtype=torch.bool)
        trained = logps[row, : len(c.token_ids)][model_at]
        sampled = torch.tensor(c.logprobs)[model_at]
        assert torch.allclose(trained, sampled, atol=2e-4), (trained - sampled).abs().max()
    # The environment's tokens get no gradient; a model token does.
    metrics = grpo.tell(results)
    assert metrics["grpo/trained_tokens"] == sum(sum(c.token_mask) for c in completions)


def test_one_turn_episode_samples_what_a_single_completion_samples() -> None:
    """A task whose environment gives no interaction is the one-turn case of the same path: with the
    same seed it draws exactly the tokens the single-turn (recorded) sampler draws."""
    single = _host(decoupled=True)
    plain = list(single.sample(TASKS, [Variant(0, samples_per_task=2)], seed=5))[0]

    class NoInteraction:
        name = "none"

        def interaction(self, task: Task) -> None:
            return None

    host = _host(decoupled=True)
    host.episodes(Episodes(NoInteraction()))
    episodic = list(host.sample(TASKS, [Variant(0, samples_per_task=2)], seed=5))[0]
    assert [c.token_ids for c in episodic] == [c.token_ids for c in plain]
    assert [c.prompt_token_ids for c in episodic] == [c.prompt_token_ids for c in plain]
    assert all(c.episode is None and c.token_mask is None for c in episodic)
    assert turn_seed(5, 0) == 5 and len({turn_seed(5, t) for t in range(4)}) == 4


def test_a_slow_or_broken_step_holds_back_only_its_own_episode() -> None:
    slow, broken, hung = Echo(delay=1.0), Echo(fail=True), Echo(delay=30.0)
    env = EchoEnv(t0=slow, t1=broken, t2=hung)
    host = _host(temperature=0.0)
    calls: list[list[int]] = []
    runner = Episodes(env, step_timeout_s=2.0, gather_s=0.05)
    original = host._continue

    def recording(seqs, seeds, members, *rest):
        calls.append([len(s) for s in seqs])
        return original(seqs, seeds, members, *rest)

    tasks = TASKS + [Task(id="t3", prompt=[{"role": "user", "content": "task 3"}])]
    start = time.perf_counter()
    out = runner.run([__import__("vrl.episodes", fromlist=["Row"]).Row(task=t, seed=i) for i, t in enumerate(tasks)],
                     host.tokenizer, recording)
    elapsed = time.perf_counter() - start
    by_id = {c.task_id: c for c in out}
    assert by_id["t3"].episode.metrics["turns"] == 3  # the healthy episode went on
    assert by_id["t0"].episode.metrics["turns"] == 3  # the slow one too, in batches of its own
    assert by_id["t1"].episode.metrics == {**by_id["t1"].episode.metrics, "turns": 1.0, "step_errors": 1.0}
    assert "the environment broke" in by_id["t1"].episode.turns[-1].content
    assert by_id["t2"].episode.metrics["step_errors"] == 1.0 and "timed out" in by_id["t2"].episode.turns[-1].content
    assert 2.0 <= elapsed < 10.0  # the hung step cost its timeout, not its 30 s
    # t3 finished its three turns in calls that did not wait for t0's slow steps: the first call has every
    # episode, later ones only those whose step had returned.
    assert len(calls[0]) == 4 and min(len(c) for c in calls[1:]) == 1


@pytest.mark.parametrize("noise", ["full", "lowrank"])
def test_es_with_episodes_replays_bit_exact(tmp_path: Path, noise: str) -> None:
    """ES scores whole episodes per member; the weights rebuilt from the run's history equal the run's own,
    bit for bit. With es.noise=lowrank every member's episodes run in one batch per turn, each row keeping
    its member: a member sampled alone draws the same episodes."""

    class Recording(LocalRuntime):
        def policy(self, config: Any, moves=None):
            self.built = super().policy(config, moves)
            return self.built

    es = {"population_size": 4, "sigma": 0.3, "alpha": 0.3, "include": ["*"]}
    if noise == "lowrank":
        es.update(noise="lowrank", rank=2)
    class LettersEpisodes(LettersEnvironment):  # letters' partial credit (never all zero) on 3-turn episodes
        def interaction(self, task: Task) -> Interaction:
            return Echo()

    config = TrainConfig(plugin="letters", model="tiny", iterations=2, tasks_per_iteration=2, seed=1,
                         sampling={"max_new_tokens": 3, "temperature": 1.0}, generator={"device": "cpu"},
                         logging={"runs_dir": str(tmp_path), "name": "run", "samples_per_iteration": 4}, es=es)
    runtime = Recording()
    summary = Trainer(config, environment=LettersEpisodes(size=4), runtime=runtime,
                      console=Console(file=io.StringIO())).run()
    assert summary["status"] == "finished"
    metrics = [__import__("json").loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["episodes/count"] == 2 * 4 and metrics[-1]["episodes/turns_mean"] == 3
    assert metrics[-1]["episodes/pass_rate_turn_1"] == 0 and metrics[-1]["episodes/pass_rate_turn_2"] == 1
    samples = (tmp_path / "run" / "samples.jsonl").read_text()
    assert '"episode"' in samples and '"role":"user"' in samples.replace(" ", "")

    fresh = HFGenerator(*load_model_and_tokenizer("tiny", "cpu", "float32"), SamplingConfig(max_new_tokens=3))
    opt = ES(ESConfig(**config.es.model_dump()), seed=config.seed, base={"model": "tiny", "revision": None})
    opt.setup(fresh)
    opt.load(tmp_path / "run", 2)
    run_state = dict(runtime.built.model.named_parameters())
    assert all(torch.equal(p, run_state[n]) for n, p in fresh.model.named_parameters())
    if noise == "full":  # (the tiny model's low-rank members differ too little here for the rewards to differ)
        assert any(not torch.equal(p, q) for p, q in zip(fresh.model.parameters(), _host().model.parameters()))

    if noise == "lowrank":
        env = GuessEnvironment(size=4)
        fresh.sampling = SamplingConfig(max_new_tokens=3, temperature=1.0, batch_size=8)
        fresh.episodes(Episodes(env))
        tasks = env.tasks()[:2]
        members = [Variant(i, samples_per_task=2, seed=100 + i // 2, sign=1 if i % 2 == 0 else -1) for i in range(4)]
        together = [c for b in fresh.sample(tasks, members, seed=9) for c in b]
        for m in members:
            alone = [c for b in fresh.sample(tasks, [m], seed=9) for c in b]
            assert [c.token_ids for c in together if c.variant == m.index] == [c.token_ids for c in alone]
        by_row: dict[tuple[str, int], set[tuple[int, ...]]] = {}
        for c in together:
            by_row.setdefault((c.task_id, c.sample), set()).add(tuple(c.token_ids))
        assert any(len(v) > 1 for v in by_row.values())  # members do sample differently from one seed


def test_asynchronous_grpo_trains_on_episodes_and_unsupported_places_are_refused_first(tmp_path: Path, monkeypatch,
                                                                                       emu) -> None:
    """grpo.max_staleness=1: sampling runs a pass ahead on weights only `publish` changes, and each episode
    carries its model tokens' sampling log-probs (0 at the environment's, which the mask drops). A runtime
    or backend that cannot run episodes is refused in one line before anything starts."""
    from vrl.config import resolve_config
    from vrl.errors import UsageError
    from vrl.preflight import check_episodes
    from vrl.runtime import runtime_class

    config = resolve_config({"plugin": "guess", "model": "tiny", "iterations": 3, "tasks_per_iteration": 2,
                             "grpo": {"max_staleness": 1, "num_generations": 2},
                             "logging": {"runs_dir": str(tmp_path), "name": "async", "samples_per_iteration": 2}})
    summary = Trainer(config, environment=GuessEnvironment(size=4), console=Console(file=io.StringIO())).run()
    assert summary["status"] == "finished"
    rows = [__import__("json").loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["episodes/count"] for r in rows] == [4, 4, 4]
    assert all(r["grpo/trained_tokens"] == r["episodes/tokens_model"] for r in rows)  # only the model's tokens
    assert "grpo/sampling_logprob_diff_mean" in rows[-1]  # the sampler's log-probs reached the update

    env = GuessEnvironment()
    from vrl.generate.vllm import VLLMGenerator
    from vrl.runtime.modal.runtime import ModalRuntime

    modal = resolve_config({"plugin": "guess", "model": "tiny", "runtime": {"kind": "modal"}})
    check_episodes(modal, env, ModalRuntime)  # Modal's workers run them (tests/test_modal_generation.py)
    monkeypatch.setattr(ModalRuntime, "runs_episodes", False)  # a runtime that cannot
    monkeypatch.setattr(VLLMGenerator, "runs_episodes", False)  # a backend that cannot (vllm can)
    for settings, fix in [({"runtime": {"kind": "modal"}}, "--set runtime.kind=local"),
                          ({"generator": {"backend": "vllm"}}, "--set generator.backend=hf")]:
        cfg = resolve_config({"plugin": "guess", "model": "tiny", **settings})
        with pytest.raises(UsageError, match=f"^environment 'guess' runs multi-turn episodes, .* {fix}$"):
            check_episodes(cfg, env, runtime_class(cfg.runtime.kind))
    from click.testing import CliRunner

    from vrl.cli import main

    runs = tmp_path / "refused"  # on the Modal emulator (credentials and all): refused by the preflight, first
    res = CliRunner().invoke(main, ["train", "--plugin", "guess", "--set", "runtime.kind=modal",
                                    "--set", f"logging.runs_dir={runs}"])
    assert res.exit_code != 0 and "runs multi-turn episodes, which runtime 'modal' does not support yet" in res.output
    assert not runs.exists()  # refused before anything started


def test_an_interactions_own_step_timeout_and_token_budget() -> None:
    """`Interaction.step_timeout_s` bounds its steps in place of the runner's 60 s; `Interaction.max_tokens`
    bounds the model's and the environment's tokens of the episode together (turns cut, a reply that would
    pass it dropped)."""
    from vrl.episodes import Row

    hung = Echo(delay=30.0)
    hung.step_timeout_s = 0.3
    host = _host(temperature=1.0, max_new_tokens=5)
    start = time.perf_counter()
    [out] = Episodes(EchoEnv(t0=hung)).run([Row(task=TASKS[0], seed=0)], host.tokenizer, host._continue)
    assert time.perf_counter() - start < 10 and "timed out after 0.3 s" in out.episode.turns[-1].content
    for budget in (1, 3, 6, 9, 14, 20):
        budgeted = {t.id: Echo(turns=4) for t in TASKS}
        for echo in budgeted.values():
            echo.max_tokens = budget
        done = Episodes(EchoEnv(**budgeted)).run([Row(task=t, seed=i) for i, t in enumerate(TASKS)], host.tokenizer,
                                                 host._continue)
        for c in done:
            assert len(c.token_ids) == len(c.token_mask) <= budget, budget
            assert c.episode.metrics["model_tokens"] + c.episode.metrics["env_tokens"] <= budget
            assert len(c.token_ids) == budget or c.episode.metrics["over_budget"] or c.episode.metrics["turns"] == 4


@pytest.mark.parametrize("env", ["guess", "echo-with-a-slow-step"])
def test_hf_keeps_each_episodes_kv_cache_across_turns(env: str) -> None:
    """With `generator.hf.turn_cache` (the default), a turn's `generate` computes only what its episode's cached row
    does not hold (the environment's reply and the new turn), not the whole sequence again: the model is fed far
    fewer tokens, and every episode samples the same ids, masks and log-probs as with the cache off (games of
    different lengths; an episode whose slow step makes it join a later turn)."""
    def play(cache: bool) -> tuple[list[Any], int]:
        host = _host(max_new_tokens=4, decoupled=True)
        host.turn_cache = cache
        fed = [0]
        host.model.register_forward_pre_hook(lambda m, args, kw: fed.__setitem__(0, fed[0] + kw["input_ids"].numel()),
                                             with_kwargs=True)
        environment = GuessEnvironment(turns=3) if env == "guess" else EchoEnv(t1=Echo(delay=0.6))
        tasks = environment.tasks(limit=3) if env == "guess" else TASKS
        host.episodes(Episodes(environment, gather_s=0.05))
        out = [c for b in host.sample(tasks, [Variant(0, samples_per_task=3)], seed=5) for c in b]
        return out, fed[0]

    (plain, fed_plain), (cached, fed_cached) = play(False), play(True)
    assert [c.episode.metrics["turns"] for c in cached] == [c.episode.metrics["turns"] for c in plain]
    assert max(c.episode.metrics["turns"] for c in plain) == 3
    for a, b in zip(plain, cached):
        assert (a.prompt_token_ids, a.token_ids, a.token_mask) == (b.prompt_token_ids, b.token_ids, b.token_mask)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert fed_cached < 0.7 * fed_plain, (fed_cached, fed_plain)


def test_no_turn_cache_under_a_repetition_penalty() -> None:
    """transformers' repetition penalty reads every id of a row, the cache's masked positions (pad ids) included,
    so with a penalty every turn recomputes the whole sequence and samples exactly as it did."""
    host = _host()
    assert host._turn_cache() is not None
    host.sampling = SamplingConfig(max_new_tokens=5, repetition_penalty=1.3)
    assert host._turn_cache() is None
