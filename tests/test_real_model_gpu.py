"""The real-model tier on the GPU: vLLM against hf on SmolLM2-135M-Instruct's real weights, greedy, token for
token, both loaded from `--model PATH.gguf` (run on the device: `pytest -m "gpu and real_model"`, with the GGUF
file carried and named by VRL_REAL_MODEL). float32 on both sides: bf16 kernels differ between transformers and
vLLM, so a greedy near-tie could flip; float32 also checks that the conversion's dtype follows the run's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.real_model import require_real_model
from tests.test_real_model import HEADER, greedy_tasks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.real_model,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'vrl-core[vllm]')"),
]


def test_vllm_and_hf_agree_greedy_token_for_token_on_the_real_model():
    from vrl.config import build
    from vrl.generate.hf import HFGenerator, load_model_and_tokenizer
    from vrl.generate.vllm import VLLMGenerator

    gguf_file = str(require_real_model())
    tasks = greedy_tasks()
    config = build({"model": gguf_file, "optimizer": "grpo", "seed": 0,
                    "sampling": {"temperature": 0.0, "max_new_tokens": 32, "batch_size": 8},
                    "generator": {"backend": "vllm", "dtype": "float32", "device": "cuda", "vllm": {
                        "enforce_eager": True, "gpu_memory_utilization": 0.2, "max_model_len": 512}}})
    engine = VLLMGenerator.from_config(config)
    try:
        served = engine.generate(tasks)
    finally:
        engine.close()
    model, tokenizer = load_model_and_tokenizer(gguf_file, "cuda", "float32")
    hf = HFGenerator(model, tokenizer, config.sampling).generate(tasks)
    assert all(tokenizer.decode(c.prompt_token_ids, skip_special_tokens=False).endswith(HEADER) for c in served)
    assert [c.prompt_token_ids for c in served] == [c.prompt_token_ids for c in hf]
    assert [c.token_ids for c in served] == [c.token_ids for c in hf], [(a.text, b.text) for a, b in zip(served, hf)]
    assert [c.text for c in served] == [c.text for c in hf]
