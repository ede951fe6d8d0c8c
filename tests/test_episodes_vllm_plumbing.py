"""The vllm backend's episode loop without a GPU: vLLM's `LLM` cannot run here, so a stand-in takes its
request surface (`enqueue`, `llm_engine.step`, `abort_request`) and answers each request greedily with the
real tiny model, finishing them in reverse order and in separate steps as an engine may. Against the hf
backend's greedy episodes on the same model: the same token ids, masks and turns, so requests are joined
to their episodes by id, each turn continues from the episode's exact ids, ended episodes are not sent
again, and an episode's next turn joins the engine while other episodes' turns are still running
(streamed, not one pass per turn). The real engine is checked on the GPU by tests/test_episodes_vllm_gpu.py."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import torch

from tests.test_episodes import EchoEnv
from vrl.config import SamplingConfig, build
from vrl.episodes import Episodes
from vrl.generate.hf import HFGenerator, load_model_and_tokenizer
from vrl.policy import Variant
from vrl.types import Task


class _GreedyLLM:
    """Each request: greedy `max_tokens` tokens of the model after its prompt ids (stopping at EOS)."""

    def __init__(self, model, eos: int):
        self.model, self.eos, self.pending, self.sent = model, eos, [], []
        self.running_at_send: list[int] = []  # how many requests were in the engine when each was sent
        self.llm_engine = SimpleNamespace(has_unfinished_requests=lambda: bool(self.pending), step=self._step,
                                          abort_request=lambda ids: None)

    def enqueue(self, prompts, params, use_tqdm=False, **extra):
        ids = []
        for k, (p, sp) in enumerate(zip(prompts, params)):
            rid = f"{len(self.sent)}"
            self.sent.append(list(p["prompt_token_ids"]))
            self.running_at_send.append(len(self.pending))
            self.pending.append((rid, p["prompt_token_ids"], sp["max_tokens"]))
            ids.append(f"{rid}-abc{k}")
        return ids

    def _step(self):
        time.sleep(0.02)  # a step takes time: the environment's steps (another thread) return meanwhile
        rid, prompt, n = self.pending.pop()  # the newest first: finished out of order, one per step
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=n, do_sample=False, eos_token_id=self.eos, pad_token_id=self.eos)
        new = out[0, len(prompt):].tolist()
        if self.eos in new:
            new = new[: new.index(self.eos) + 1]
        reason = "stop" if new and new[-1] == self.eos else "length"
        done = SimpleNamespace(token_ids=new, finish_reason=reason, index=0, logprobs=None)
        return [SimpleNamespace(request_id=rid, finished=True, outputs=[done])]


def test_vllm_episodes_continue_each_episode_from_its_ids_as_hf_does(monkeypatch):
    from vrl.generate.vllm import VLLMGenerator

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    model, tok = load_model_and_tokenizer("tiny", "cpu", "float32")
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=5, batch_size=8)
    llm = _GreedyLLM(model, tok.eos_token_id)
    gen = VLLMGenerator(llm, tok, build({}).sampling, mode="sample")
    gen.sampling = sampling
    gen.episodes(Episodes(EchoEnv()))
    # Text prompts the random model continues differently (chat prompts all end in the same header).
    tasks = [Task(id=f"t{i}", prompt=p) for i, p in enumerate(["task 0", "zzzzzzzzzzzzzzzz", "9999999999999 ~~~~"])]
    ours = [c for b in gen.sample(tasks, [Variant(0)], seed=1) for c in b]
    hf = HFGenerator(model, tok, sampling)
    hf.episodes(Episodes(EchoEnv()))
    theirs = [c for b in hf.sample(tasks, [Variant(0)], seed=1) for c in b]
    assert [(c.task_id, c.prompt_token_ids, c.token_ids, c.token_mask) for c in ours] == \
           [(c.task_id, c.prompt_token_ids, c.token_ids, c.token_mask) for c in theirs]
    assert all(c.episode.metrics["turns"] == 3 for c in ours)
    assert len({tuple(c.token_ids) for c in ours}) == 3  # the episodes differ: a mix-up would show
    # Nine turns: the three prompts first; each later turn continues one episode (extends exactly one prompt)
    # and every turn of that episode sent before it; some joined the engine while other episodes' turns were
    # still running.
    prompts = llm.sent[:3]
    assert len(llm.sent) == 9 and prompts == [c.prompt_token_ids for c in ours]
    for k, seq in enumerate(llm.sent[3:], 3):
        [own] = [p for p in prompts if seq[: len(p)] == p]
        earlier = [prev for prev in llm.sent[:k] if prev[: len(own)] == own]
        assert all(len(seq) > len(prev) and seq[: len(prev)] == prev for prev in earlier)
    assert any(n > 0 for n in llm.running_at_send[3:])


def test_tasks_that_share_an_id_keep_their_own_completions_in_order(monkeypatch):
    """`generate` puts each completion back by its task's position, not by id: two prompts under one id (a
    batch that drew a task twice, or a caller's own tasks) each get the completion of their own prompt, though
    the engine finishes them newest first."""
    from vrl.generate.vllm import VLLMGenerator

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    model, tok = load_model_and_tokenizer("tiny", "cpu", "float32")
    llm = _GreedyLLM(model, tok.eos_token_id)
    gen = VLLMGenerator(llm, tok, build({}).sampling, mode="sample")
    gen.sampling = SamplingConfig(temperature=0.0, max_new_tokens=3, batch_size=8)
    tasks = [Task(id="same", prompt="first prompt"), Task(id="other", prompt="x"), Task(id="same", prompt="zzzz")]
    out = gen.generate(tasks)
    assert [c.task_id for c in out] == ["same", "other", "same"]
    assert [tok.decode(c.prompt_token_ids) for c in out] == [t.prompt for t in tasks]
