"""The `hf` generator: batched sampling with transformers on CPU or GPU.

Prompts are left-padded so a batch decodes together with the KV cache; `n` samples per prompt come
from `num_return_sequences`. Token ids are kept on each completion so training sees exactly what
was sampled.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from vrl.generate.base import Generator, cut_at_stop, shard_seed, tokens_covering
from vrl.optim.params import FlatParams, select_parameters
from vrl.policy import PerturbationSpec, Trainable
from vrl.types import Completion, Prompt, Task

TINY = "tiny"
_GLOBAL_RNG = threading.Lock()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"generator.device={device!r} but no CUDA GPU is available; use 'cpu' or 'auto'")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_model_and_tokenizer(name: str, device: str = "auto", dtype: str = "auto", revision: str | None = None):
    """Load a causal LM and its tokenizer ('tiny' builds one locally), ready for left-padded batches."""
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if name == TINY:
        from vrl.generate import tiny

        model, tokenizer = tiny.build_model(), tiny.build_tokenizer()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
            model = AutoModelForCausalLM.from_pretrained(name, revision=revision, dtype=torch_dtype)
        except OSError as exc:
            raise RuntimeError(
                f"cannot load model {name!r}: {exc}\n"
                "Give a Hugging Face model id (with network access or a warm cache) or a local directory, "
                "or use --model tiny to build a small local model."
            ) from exc
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(device=dev, dtype=torch_dtype).eval()
    return model, tokenizer


def render_prompt(tokenizer: Any, prompt: Prompt) -> str:
    """Text for the model: chat messages go through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "


def cpu_threads(threads: int | None, model: str, device: torch.device) -> int | None:
    """Torch intra-op threads for a run: the configured number, else 1 for the tiny model on CPU.

    The tiny model's matrices are too small to gain from a thread pool, and when other processes keep
    the cores busy, torch's default of one thread per core waits on descheduled threads at every op
    (an iteration of `letters` went from about 3 s to 16-30 s on 2 busy cores). None: leave torch alone.
    """
    if threads is not None:
        return threads
    if model == TINY and device.type == "cpu":
        return 1
    return None


class HFGenerator(Generator):
    """Sampling with `model.generate`. The model is the one optimizers train or perturb, in place."""

    name = "hf"

    def __init__(self, model: Any, tokenizer: Any, sampling: Any):
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling

    @classmethod
    def from_config(cls, config: Any, device: str | None = None) -> HFGenerator:
        """The run's model on `device` (default generator.device)."""
        g = config.generator
        threads = cpu_threads(g.threads, config.model, resolve_device(device or g.device))
        if threads is not None:  # process-wide: GRPO's training step on CPU runs with the same pool
            torch.set_num_threads(threads)
        model, tokenizer = load_model_and_tokenizer(config.model, device or g.device, g.dtype, g.revision)
        return cls(model, tokenizer, config.sampling)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- how optimizers move the weights ------------------------------------------------------------
    def _perturbable(self, spec: PerturbationSpec) -> FlatParams:
        return FlatParams(select_parameters(self.model, spec.include, spec.exclude))

    def trainable(self) -> Trainable:
        return Trainable(self.model, self.tokenizer, self.sampling)

    def publish(self, model: Any) -> None:
        """Sampling reads `self.model`; weights trained elsewhere (another host's model, or tensors by
        checkpoint name, LoRA merged) are copied in."""
        if model is self.model:
            return
        if isinstance(model, Mapping):
            weights = dict(model)
        else:
            from vrl.generate.weights import weights_for_engine  # checkpoint names, LoRA merged

            weights = dict(weights_for_engine(model))
        own = dict(self.model.named_parameters())
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise ValueError(f"published weights do not match the model: unknown {unknown[:3]}")
        with torch.no_grad():
            for name, t in weights.items():
                own[name].copy_(t)

    def stream(
        self, tasks: Sequence[Task], n: int = 1, variant: int = 0, seed: int | None = None
    ) -> Iterator[list[Completion]]:
        size = self.sampling.batch_size
        for start in range(0, len(tasks), size):
            yield self._generate_batch(tasks[start : start + size], n, variant, shard_seed(seed, start, n))

    @torch.inference_mode()
    def _generate_batch(self, tasks: Sequence[Task], n: int, variant: int, seed: int | None) -> list[Completion]:
        s, tok = self.sampling, self.tokenizer
        texts = [render_prompt(tok, t.prompt) for t in tasks]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        # n rows per prompt (rather than num_return_sequences, which greedy decoding refuses).
        rows = {k: v.repeat_interleave(n, dim=0) for k, v in enc.items()}
        kwargs: dict[str, Any] = dict(
            max_new_tokens=s.max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        if s.temperature > 0:
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if s.stop:
            kwargs.update(stop_strings=list(s.stop), tokenizer=tok)
        # transformers samples from torch's global RNG: hf engines of one process (a pool) take turns.
        with _GLOBAL_RNG, torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(**rows, **kwargs)
        prompt_len = enc["input_ids"].shape[1]
        completions = []
        for row in range(out.shape[0]):
            task_index, sample = divmod(row, n)
            prompt_ids = enc["input_ids"][task_index][enc["attention_mask"][task_index].bool()].tolist()
            completions.append(self._completion(tasks[task_index], prompt_ids, out[row, prompt_len:].tolist(), variant, sample))
        return completions

    def _completion(self, task: Task, prompt_ids: list[int], new_ids: list[int], variant: int, sample: int) -> Completion:
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        finish = "length"
        while new_ids and pad != eos and new_ids[-1] == pad:  # padding after a stop string
            new_ids.pop()
        if eos in new_ids:
            new_ids = new_ids[: new_ids.index(eos) + 1]
            finish = "stop"
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        text, stopped = cut_at_stop(text, self.sampling.stop)
        if stopped:  # keep only the tokens up to the stop string: GRPO trains on these ids
            new_ids, finish = tokens_covering(self.tokenizer, new_ids, text), "stop"
        return Completion(
            task_id=task.id,
            text=text,
            variant=variant,
            sample=sample,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(new_ids),
            finish_reason=finish,
            prompt_token_ids=prompt_ids,
            token_ids=new_ids,
        )
