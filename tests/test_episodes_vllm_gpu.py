"""Episodes on the vllm backend with a real engine (run on the device: `pytest -m gpu`): over 3-turn
episodes the ids GRPO trains on are the ones vLLM sampled (its recorded log-probs equal the trained
model's at every model token, the environment's tokens masked), and greedy episodes equal the hf
backend's token for token. A 2-layer random Qwen2 in float32 with the byte tokenizer (`small_qwen2_dir`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'vrl-core[vllm]')"),
]

from tests.test_episodes import EchoEnv  # noqa: E402
from vrl.config import SamplingConfig, build  # noqa: E402
from vrl.episodes import Episodes, environment_ids  # noqa: E402
from vrl.generate.hf import HFGenerator  # noqa: E402
from vrl.optim.logprobs import completion_logprobs, pack  # noqa: E402
from vrl.policy import HostNeeds, Variant  # noqa: E402
from vrl.types import Task  # noqa: E402

TASKS = [Task(id=f"t{i}", prompt=p) for i, p in enumerate(["Hello there", "2 + 2 =", "def f(x):", "Lean 4"])]


def test_vllm_episodes_train_on_the_sampled_ids_and_equal_hf_greedy(small_qwen2_dir):
    from vrl.generate import make_generator

    cfg = build({"model": small_qwen2_dir, "optimizer": "grpo", "seed": 3,
                 "sampling": {"temperature": 1.0, "max_new_tokens": 8, "batch_size": 8},
                 "generator": {"backend": "vllm", "dtype": "float32", "vllm": {
                     "enforce_eager": True, "gpu_memory_utilization": 0.2, "max_model_len": 512}}})
    gen = make_generator(cfg, HostNeeds("trained"))
    try:
        gen.logprobs = True  # record each sampled token's log-prob (as asynchronous GRPO does)
        model = gen.trainable().model
        gen.episodes(Episodes(EchoEnv()))
        comps = [c for b in gen.sample(TASKS, [Variant(0, samples_per_task=2)], seed=7) for c in b]
        assert len(comps) == 8
        for c in comps:
            roles = [t.role for t in c.episode.turns]
            assert roles == ["assistant", "user", "assistant", "user", "assistant"]
            k = 0
            for i, t in enumerate(c.episode.turns):
                assert c.token_mask[k : k + t.tokens] == [int(t.role == "assistant")] * t.tokens
                if t.role == "user":
                    env = environment_ids(gen.tokenizer, [{"role": "user", "content": f"turn {(i + 1) // 2} heard"}])
                    assert c.token_ids[k : k + t.tokens] == env
                k += t.tokens
            assert k == len(c.token_ids) == len(c.logprobs)
        packed = pack([c.prompt_token_ids for c in comps], [c.token_ids for c in comps], 256, model.device)
        with torch.no_grad():
            logps = completion_logprobs(model, packed, 1.0).cpu()
        for row, c in enumerate(comps):
            at = torch.tensor(c.token_mask, dtype=torch.bool)
            diff = (logps[row, : len(c.token_ids)][at] - torch.tensor(c.logprobs)[at]).abs().max()
            assert diff < 2e-3, diff  # what vLLM sampled, in the context it sampled it, is what GRPO trains on

        gen.sampling = SamplingConfig(temperature=0.0, max_new_tokens=8, batch_size=8)
        hf = HFGenerator(model, gen.tokenizer, gen.sampling)
        hf.episodes(Episodes(EchoEnv()))
        ours = [c for b in gen.sample(TASKS, [Variant(0)], seed=1) for c in b]
        theirs = [c for b in hf.sample(TASKS, [Variant(0)], seed=1) for c in b]
        assert [(c.prompt_token_ids, c.token_ids, c.token_mask) for c in ours] == \
               [(c.prompt_token_ids, c.token_ids, c.token_mask) for c in theirs]
    finally:
        gen.close()
