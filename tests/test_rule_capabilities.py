"""The loop, the launch and preflight ask what an update rule declares (`Optimizer.moves`, `staleness`,
`ranks`), never its name: a plugin's rule that trains weights runs with asynchronous rollouts under a
setting of its own, and what it does not declare is refused naming its own settings.

The rule is registered through the `register_optimizers` hook, as an installed plugin's is; it trains
the tiny model (REINFORCE with a mean baseline) on the real Trainer, hf backend, CPU.
"""

from __future__ import annotations

import io
import json
import types

import pytest
import torch
from pydantic import Field
from rich.console import Console

import vrl
from vrl import launch, rollouts
from vrl.config import Section, build
from vrl.envs.letters import LettersEnvironment
from vrl.errors import UsageError
from vrl.plugins import Registry
from vrl.trainer import Trainer


class ReinforceConfig(Section):
    """REINFORCE with a mean-reward baseline."""

    samples: int = Field(3, ge=1, description="Samples per task.")
    learning_rate: float = Field(0.05, gt=0, description="SGD step size.")
    lag: int = Field(0, ge=0, description="Updates sampling may run ahead of training (asynchronous rollouts).")


class Reinforce(vrl.Optimizer):
    """Trains the host's in-process model and publishes it: a plugin's rule with moves='trained'."""

    name = "reinforce"
    Config = ReinforceConfig
    moves = "trained"
    staleness = "lag"  # its own setting: reinforce.lag

    def __init__(self, config: ReinforceConfig):
        self.config, self._iteration = config, 0
        self.seen: list[list[int | None]] = []  # per tell: the weights versions of its completions

    @classmethod
    def from_config(cls, config):
        made = cls(config.reinforce)
        MADE.append(made)
        return made

    def setup(self, host):
        super().setup(host)
        self.model = host.trainable().model
        self.start = [p.detach().clone() for p in self.model.parameters()]
        self.sgd = torch.optim.SGD(self.model.parameters(), lr=self.config.learning_rate)

    @property
    def iteration(self) -> int:
        return self._iteration

    def ask(self):
        return [vrl.Variant(index=0, samples_per_task=self.config.samples)]

    def samples_per_task(self) -> int:
        return self.config.samples

    def tell(self, results):
        self.seen.append(sorted({r.completion.weights_version for r in results}, key=str))
        rewards = torch.tensor([r.reward for r in results])
        loss = torch.zeros(())
        for r, advantage in zip(results, rewards - rewards.mean()):
            c = r.completion
            ids = torch.tensor([c.prompt_token_ids + c.token_ids])
            logits = self.model(ids).logits[0, len(c.prompt_token_ids) - 1 : -1]
            logp = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None]).sum()
            loss = loss - advantage * logp / len(results)
        self.sgd.zero_grad()
        loss.backward()
        self.sgd.step()
        self.host.publish(self.model)
        self._iteration += 1
        return {"reinforce/loss": float(loss.detach())}


MADE: list[Reinforce] = []


@pytest.fixture
def installed(monkeypatch):
    """The rule registered through the hook, as an installed plugin's would be, for this process."""
    plugin = types.SimpleNamespace(register_optimizers=vrl.hookimpl(lambda register: register("reinforce", Reinforce)))
    reg = Registry().load(entry_points=False, plugins={"reinforce": plugin})
    monkeypatch.setattr("vrl.plugins.registry", lambda: reg)
    MADE.clear()
    return reg


def config(tmp_path, **fields):
    return build({"plugin": "letters", "optimizer": "reinforce", "iterations": 3, "tasks_per_iteration": 2,
                  "sampling": {"max_new_tokens": 6, "temperature": 1.0, "batch_size": 3},
                  "logging": {"runs_dir": str(tmp_path), "name": "r"}}, fields)


def test_a_plugin_rule_that_trains_weights_runs_with_asynchronous_rollouts(installed, tmp_path):
    """reinforce.lag=1: iteration j trains on a batch sampled by the weights after update j-1 (none before
    the first), the loop reports the staleness under the rule's name, and the trained weights move."""
    cfg = config(tmp_path, reinforce={"lag": 1})
    assert rollouts.staleness(cfg) == ("reinforce.lag", 1) and rollouts.asynchronous(cfg)
    Trainer(cfg, environment=LettersEnvironment(), console=Console(file=io.StringIO())).run()
    rule = MADE[-1]  # (preflight builds one too, to ask its needs)
    assert rule.seen == [[0], [0], [1]]  # sampled one update behind, exactly as the schedule says
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [row["reinforce/staleness/max"] for row in rows] == [0, 1, 1]
    assert all("reinforce/loss" in row for row in rows)
    assert any(not torch.equal(a, b) for a, b in zip(rule.start, rule.model.parameters()))


def test_what_a_plugin_rule_does_not_declare_is_refused_with_its_own_settings(installed, tmp_path, monkeypatch):
    """One line each, naming the rule's own setting: asynchronous rollouts off the local runtime, its
    setting given to a run of another rule, a rule that moves perturbations asked to run ahead, a torchrun
    launch of a rule without `ranks`."""
    with pytest.raises(UsageError, match=r"^reinforce.lag=2 needs runtime.kind=local .* set reinforce.lag=0$"):
        rollouts.check(config(tmp_path, reinforce={"lag": 2}, runtime={"kind": "modal"}))
    with pytest.raises(UsageError, match=r"^reinforce.lag=1 pipelines reinforce's rollouts; optimizer=es .* "
                                         r"leave reinforce.lag at 0$"):
        rollouts.check(config(tmp_path, optimizer="es", reinforce={"lag": 1}))
    rollouts.check(config(tmp_path))  # lag 0: a synchronous run, nothing to refuse
    monkeypatch.setattr(Reinforce, "moves", "perturbations")
    with pytest.raises(UsageError, match=r"^reinforce.lag=1: optimizer=reinforce moves perturbations, .* set reinforce.lag=0$"):
        rollouts.check(config(tmp_path, reinforce={"lag": 1}))
    monkeypatch.undo()
    monkeypatch.setattr("vrl.plugins.registry", lambda: installed)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match=r"^a torchrun launch \(2 processes\) trains with optimizer=es\|grpo only; "
                                         r"optimizer=reinforce runs as one process"):
        launch.check(config(tmp_path))
    monkeypatch.setattr(Reinforce, "ranks", True)  # declared: the launch asks the rule, not its name
    launch.check(config(tmp_path))
