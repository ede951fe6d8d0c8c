"""One GRPO step on CPU with varied lengths, to compare two checkouts of vrl (e.g. before and after a
change to the training rows' layout): run it once per checkout, interleaved, on an idle machine.

    for r in 1 2 3; do for tree in /tmp/old .; do python benchmarks/grpo_layout_cpu.py $tree; done; done

A 4-layer Qwen2 model (hidden 256, vocab 1000, random fp32 weights, sdpa, one torch thread), 64
sequences of `grpo_step.py --lengths varied` at half its lengths (prompts 64–192, completions 32–224
tokens), `dapo`, micro-batches of 8; one warm-up `GRPO.tell`, then the median of 3. Prints one JSON
line: the step time, `grpo/pad_fraction` and the loss (which must agree between layouts). The GPU
figure is `grpo_step.py --lengths varied` (MFU); this one only shows what a layout saves where compute
goes with the positions computed. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

tree = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent).resolve()
sys.path[:0] = [str(tree), str(tree / "benchmarks")]

import torch  # noqa: E402
from grpo_step import batch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from vrl.config import SamplingConfig  # noqa: E402
from vrl.generate import tiny  # noqa: E402
from vrl.generate.hf import HFGenerator  # noqa: E402
from vrl.optim.grpo import GRPO, GRPOConfig  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    results = batch(64, 128, 128, cfg.vocab_size, group=8, varied=True)
    gen = HFGenerator(model, tiny.build_tokenizer(), SamplingConfig(temperature=1.0, max_new_tokens=128))
    opt = GRPO(GRPOConfig(num_generations=8, learning_rate=1e-6, lr_scheduler_type="constant", loss_type="dapo",
                          micro_batch_size=8), seed=0)
    opt.setup(gen)
    metrics = opt.tell(results)  # warm-up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        metrics = opt.tell(results)
        times.append(time.perf_counter() - start)
    print(json.dumps({"tree": str(tree), "step_s": statistics.median(times), "pad_fraction": metrics["grpo/pad_fraction"],
                      "loss": metrics["grpo/loss"]}))


if __name__ == "__main__":
    main()
