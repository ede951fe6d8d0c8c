"""The sampling settings are what every backend samples with, whatever the checkpoint's own
`generation_config` says (issue 42): hf on a saved tiny checkpoint whose generation config sets a
repetition penalty, top-k, min-p and more; the Modal worker's sampling call on the same checkpoint
(run in this process, as the emulated Modal tests run it); and the `SamplingParams` arguments the
vllm backend builds (vLLM itself needs a GPU: tests/test_vllm_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from vrl.config import SamplingConfig, build
from vrl.generate import tiny
from vrl.generate.hf import HFGenerator, load_model_and_tokenizer
from vrl.generate.vllm import engine_kwargs, sampling_arguments
from vrl.optim.logprobs import completion_logprobs, pack
from vrl.types import Task

TASKS = [Task(id=f"t{i}", prompt=f"Task {i}: write letters, letters.\n") for i in range(3)]
LEAKY = dict(repetition_penalty=1.5, top_k=3, min_p=0.3, no_repeat_ngram_size=2, temperature=0.2, do_sample=True)


@pytest.fixture(scope="module")
def leaky_checkpoint(tmp_path_factory) -> str:
    """The tiny model saved with a generation_config that sets sampling defaults (as Qwen2.5-Instruct ships
    repetition_penalty and top_k)."""
    path = tmp_path_factory.mktemp("leaky")
    model = tiny.build_model()
    for key, value in LEAKY.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(path)
    tiny.build_tokenizer().save_pretrained(path)
    return str(path)


def clean(model):
    """The same model with transformers' default generation config (only the special token ids)."""
    model.generation_config = GenerationConfig(eos_token_id=256, pad_token_id=256, bos_token_id=256)
    return model


def trainer_logprobs(model, completion, temperature: float, penalty: float = 1.0) -> torch.Tensor:
    packed = pack([completion.prompt_token_ids], [completion.token_ids], 256)
    with torch.no_grad():
        return completion_logprobs(model, packed, temperature, repetition_penalty=penalty)[0]


def test_hf_samples_with_the_config_not_the_checkpoint(leaky_checkpoint):
    """Same-seed tokens equal those of a model with no generation defaults, on the plain and the recorded
    (log-prob reporting) paths; the recorded log-probs equal the trainer's; a repetition penalty set in
    `sampling` is applied by the sampler and modelled by the trainer's log-probs, to 1e-4."""
    model, tok = load_model_and_tokenizer(leaky_checkpoint, device="cpu", dtype="float32")
    assert model.generation_config.repetition_penalty == 1.5  # the checkpoint's own defaults are there
    sampling = SamplingConfig(temperature=0.9, max_new_tokens=12, batch_size=8)
    reference = HFGenerator(clean(tiny.build_model()), tok, sampling)
    leaky = HFGenerator(model, tok, sampling)
    want = [c.token_ids for c in reference.generate(TASKS, n=3, seed=4)]
    assert [c.token_ids for c in leaky.generate(TASKS, n=3, seed=4)] == want
    assert model.generation_config.repetition_penalty == 1.5  # put back: a saved checkpoint keeps it

    leaky.decouple()
    recorded = leaky.generate(TASKS, n=3, seed=4)
    reference.decouple()
    assert [c.token_ids for c in recorded] == [c.token_ids for c in reference.generate(TASKS, n=3, seed=4)]
    worst = max(float((torch.tensor(c.logprobs) - trainer_logprobs(model, c, 0.9)).abs().max()) for c in recorded)
    assert worst < 1e-4

    # A repetition penalty the config asks for: sampled with, and the trainer's log-probs apply it.
    penalised = HFGenerator(model, tok, SamplingConfig(temperature=0.9, max_new_tokens=12, repetition_penalty=1.3))
    penalised.decouple()
    out = penalised.generate(TASKS, n=3, seed=4)
    worst = max(float((torch.tensor(c.logprobs) - trainer_logprobs(model, c, 0.9, 1.3)).abs().max()) for c in out)
    unmodelled = max(float((torch.tensor(c.logprobs) - trainer_logprobs(model, c, 0.9)).abs().max()) for c in out)
    assert worst < 1e-4 < unmodelled

    # generation_kwargs reach the sampler and override the fields they name.
    passed = HFGenerator(model, tok, SamplingConfig(temperature=0.9, max_new_tokens=12, repetition_penalty=1.3,
                                                    generation_kwargs={"repetition_penalty": 1.0}))
    passed.decouple()
    assert [c.token_ids for c in passed.generate(TASKS, n=3, seed=4)] == [c.token_ids for c in recorded]


def test_modal_worker_samples_with_the_config_not_the_checkpoint(leaky_checkpoint):
    """The Modal worker's sampling call (in this process) builds an hf host on the checkpoint and samples what
    a host without the checkpoint's defaults samples."""
    from vrl.policy import Variant
    from vrl.runtime.modal import workers

    cfg = build({"model": leaky_checkpoint, "generator": {"device": "cpu", "dtype": "float32"},
                 "sampling": {"temperature": 0.9, "max_new_tokens": 12}})
    got = workers.sample(workers.variant_to_wire(Variant(index=0, samples_per_task=3)), 0, len(TASKS),
                         config=workers.engine_config(cfg), tasks=workers.tasks_to_wire(TASKS), seed=4)
    _, tok = load_model_and_tokenizer(leaky_checkpoint, device="cpu", dtype="float32")
    reference = HFGenerator(clean(tiny.build_model()), tok, cfg.sampling)
    want = [c.text for c in reference.generate(TASKS, n=3, seed=4)]
    assert [workers.completion_from_wire(c).text for c in got] == want


def test_vllm_sampling_params_name_every_setting():
    """The vllm backend's SamplingParams arguments carry every sampling field (greedy: neutral values), with
    generation_kwargs on top; the engine ignores the checkpoint's generation_config."""
    s = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_new_tokens=9,
                       stop=["\n"], generation_kwargs={"top_k": 7, "presence_penalty": 0.5})
    kw = sampling_arguments(s, n=4, seed=3, logprobs=True)
    assert {k: kw[k] for k in ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                               "frequency_penalty", "max_tokens", "stop", "seed", "logprobs")} == {
        "n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1,
        "presence_penalty": 0.5, "frequency_penalty": 0.0, "max_tokens": 9, "stop": ["\n"], "seed": 3, "logprobs": 0}
    greedy = sampling_arguments(SamplingConfig(temperature=0.0, top_k=20, min_p=0.1), n=1, seed=None, logprobs=False)
    assert (greedy["temperature"], greedy["top_k"], greedy["min_p"], greedy["repetition_penalty"],
            greedy["logprobs"]) == (0.0, 0, 0.0, 1.0, None)
    assert engine_kwargs(build({"generator": {"backend": "vllm"}}), "/models/m")["generation_config"] == "vllm"
