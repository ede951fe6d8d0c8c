"""A vLLM engine is started in one explicit mode (how its weights move), passed by its caller, and
refuses the others; no GPU and no vLLM needed (nothing here starts an engine)."""

import pytest

from vrl.config import build
from vrl.generate.vllm import VLLMGenerator, mode_for
from vrl.policy import HostNeeds, PerturbationSpec, Unsupported

FULL = PerturbationSpec(("*",), (), 0.01)
LOWRANK = PerturbationSpec(("*",), (), 0.01, noise="lowrank", rank=4)


def test_the_mode_follows_what_the_update_rule_needs():
    assert mode_for(None) == "sample"
    assert mode_for(HostNeeds("trained")) == "trained"
    assert mode_for(HostNeeds("perturbations")) == "perturb"
    assert mode_for(HostNeeds("perturbations", FULL)) == "perturb"
    assert mode_for(HostNeeds("perturbations", LOWRANK, variants=4)) == "lowrank"


def engine(mode: str) -> VLLMGenerator:
    return VLLMGenerator(object(), None, build({}).sampling, mode=mode)


def test_an_engine_refuses_to_move_its_weights_another_way():
    for mode in ("sample", "perturb", "lowrank"):
        with pytest.raises(Unsupported, match=rf"started in mode '{mode}'; a trained copy needs .*mode 'trained'"):
            engine(mode).trainable()
    for mode, spec, wanted in [("trained", FULL, "perturb"), ("sample", FULL, "perturb"), ("lowrank", FULL, "perturb"),
                               ("perturb", LOWRANK, "lowrank")]:
        with pytest.raises(Unsupported, match=rf"started in mode '{mode}'; es.noise=.* needs .*mode '{wanted}'"):
            engine(mode).perturbations(spec)


def test_only_a_trained_engine_drops_its_weights_when_it_sleeps():
    class Sleeper:
        def sleep(self, level):
            self.level = level

    for mode, level in (("trained", 2), ("sample", 1)):
        gen = VLLMGenerator(Sleeper(), None, build({}).sampling, mode=mode, sleep=True)
        gen._sleep()
        assert gen.llm.level == level


def test_engines_are_checked_before_the_tiny_model_is_written(monkeypatch):
    """Several engines share one copy of the tiny model; settings that cannot work fail before it is written."""
    import vrl.generate.vllm as vllm_backend

    monkeypatch.setattr(vllm_backend, "save_tiny", lambda path: pytest.fail("wrote the tiny model"))
    cfg = build({"generator": {"backend": "vllm", "vllm": {"sleep": True}}, "runtime": {"local": {"engines": 2}}})
    with pytest.raises(ValueError, match="generator.vllm.sleep .* only helps optimizer=grpo"):
        VLLMGenerator.engines(cfg, HostNeeds("perturbations", FULL), [None, None])


def test_only_a_trained_engine_samples_while_its_copy_trains():
    """Asynchronous rollouts (grpo.max_staleness > 0) decouple the host: a 'trained' engine already
    samples its own weights while the HF copy trains; an ES or sampling engine refuses."""
    engine("trained").decouple()
    for mode in ("sample", "perturb", "lowrank"):
        with pytest.raises(Unsupported, match=rf"started in mode '{mode}'; asynchronous rollouts need .*'trained'"):
            engine(mode).decouple()

