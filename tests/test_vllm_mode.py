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



def test_an_engine_in_a_driver_process_takes_weights_trained_in_its_parent(monkeypatch):
    """GRPO with the engine in a driver process (`vrl.runtime.driver`): the parent builds the trained copy
    (`trainable_elsewhere`: the run's model on generator.device, in the engine's dtype) and tells the
    child (`trained_elsewhere`): the engine then returns sampling log-probs, and a push copies each
    received bucket before handing it on (torch will not share a CUDA tensor it received by IPC handle
    again), except by NCCL, which broadcasts it as it is. Engines that take no trained weights refuse,
    and so does the adapter transport (it writes the trained module's factors, not weights by name)."""
    import torch

    from vrl.generate import tiny, vllm_trained

    made = VLLMGenerator.trainable_elsewhere(build({"generator": {"backend": "vllm", "device": "cpu"}}))
    reference = tiny.build_model().to(torch.bfloat16)  # the tiny model, in the engine's dtype ('auto': bfloat16)
    assert made.separate and all(torch.equal(a, b) for a, b in zip(made.model.state_dict().values(),
                                                                    reference.state_dict().values()))
    for mode in ("sample", "perturb", "lowrank"):
        with pytest.raises(Unsupported, match=rf"started in mode '{mode}'; a trained copy needs"):
            engine(mode).trained_elsewhere()
    adapter = VLLMGenerator(object(), None, build({}).sampling, mode="trained", weight_transfer="adapter")
    with pytest.raises(Unsupported, match="weight_transfer=adapter .* use generator.vllm.weight_transfer=auto"):
        adapter.trained_elsewhere()

    copied, loaded, broadcast = [], [], []
    own = vllm_trained._own
    monkeypatch.setattr(vllm_trained, "_own", lambda bucket: copied.append([n for n, _ in bucket]) or own(bucket))

    class Workers:
        def collective_rpc(self, method, args):
            loaded.append([n for n, _ in args[0]])
            return [len(args[0])]

    class Broadcast:
        def __init__(self, *args):
            pass

        def send(self, buckets):
            broadcast.extend([n for n, _ in b] for b in buckets)

    monkeypatch.setattr(vllm_trained, "NativeTransfer", Broadcast)
    buckets = [[("a", torch.zeros(2))], [("b", torch.ones(1)), ("c", torch.ones(3))]]
    for transfer in ("extension", "nccl"):
        for elsewhere in (False, True):
            gen = VLLMGenerator(Workers(), None, build({}).sampling, mode="trained", weight_transfer=transfer)
            assert not gen.logprobs
            if elsewhere:
                gen.trained_elsewhere()
                assert gen.logprobs == gen.sampling_logprobs
            copied.clear()
            gen.mover._push_whole(iter(buckets))
            assert copied == ([["a"], ["b", "c"]] if elsewhere and transfer != "nccl" else []), (transfer, elsewhere)
    assert loaded == [["a"], ["b", "c"]] * 2 and broadcast == [["a"], ["b", "c"]] * 2
