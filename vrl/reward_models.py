"""Models as reward functions: a sequence-classification reward model, and an LLM judge over any
OpenAI-compatible chat-completions endpoint.

Both are reward functions of TRL's shape (`vrl.reward_functions`), so they mix with plain functions
and weights, and their failures follow the verifier-error rule (a call that raises costs its
completions, never scores them 0; failing on everything stops the run)::

    vrl train --plugin dataset --optimizer grpo -o data=prompts.jsonl -o reward=model:OpenAssistant/reward-model-deberta-v3-large-v2
    vrl train --plugin dataset --optimizer grpo -o data=prompts.jsonl -o reward=judge:gpt-4o-mini@https://api.openai.com/v1

    from vrl.reward_models import LLMJudge, RewardModel
    env = DatasetEnvironment(data="prompts.jsonl", rewards=[RewardModel("path/to/rm"), LLMJudge("m", "http://host/v1")])

torch and transformers are imported when a reward model loads: `import vrl` stays light.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vrl.errors import UsageError

MODEL_PREFIX, JUDGE_PREFIX = "model:", "judge:"


class RewardModelError(UsageError, ValueError):
    """A reward model or judge that cannot be built as given (one line: what, and what to do)."""


class JudgeError(RuntimeError):
    """The judge gave no usable score (down, refused, timed out, unparseable): a verifier error, never reward 0."""


def _text(prompt: Any) -> str:
    """A prompt or completion as text: chat messages' contents one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt)


class RewardModel:
    """A sequence-classification model (`AutoModelForSequenceClassification`) with its tokenizer, as a reward
    function: the reward of a completion is the model's first logit on prompt + completion, as TRL's
    `reward_funcs="model id"` computes it (chat prompts through the reward tokenizer's chat template).

    Batched (`batch_size` texts per forward, right-padded), on `device`: 'auto' is the CUDA GPU with the
    most free memory when there is one, else the CPU. The model loads when this is built, so a path
    that does not load fails before anything is generated.
    """

    def __init__(self, model: str, *, device: str = "auto", batch_size: int = 16, max_length: int | None = None,
                 revision: str | None = None):
        if batch_size < 1:
            raise RewardModelError(f"reward model batch_size must be at least 1, got {batch_size}")
        self.name_or_path, self.batch_size, self.max_length = model, batch_size, max_length
        self.__name__ = Path(model.rstrip("/")).name or "reward_model"  # logged as reward/<name>, as TRL names it
        self._lock = threading.Lock()  # calls run in threads of their own; one forward at a time
        self.device = _free_device(device)
        self.model, self.tokenizer = self._load(revision)

    def __repr__(self) -> str:
        return f"RewardModel({self.name_or_path!r}, device={str(self.device)!r})"

    def _load(self, revision: str | None) -> tuple[Any, Any]:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.name_or_path, revision=revision)
            model = AutoModelForSequenceClassification.from_pretrained(
                self.name_or_path, revision=revision,
                dtype=torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RewardModelError(f"cannot load reward model {self.name_or_path!r}: {first}; give a local directory or "
                                   "a Hugging Face id of a sequence-classification model (network or a warm cache)"
                                   ) from None
        if tokenizer.pad_token_id is None:  # the model finds each row's last token by the pad id
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        return model.to(self.device).eval(), tokenizer

    def text(self, prompt: Any, completion: Any) -> str:
        """What the reward model reads: a chat through its tokenizer's chat template, else prompt + completion."""
        if isinstance(prompt, list):
            messages = prompt + (completion if isinstance(completion, list) else
                                 [{"role": "assistant", "content": completion}])
            if getattr(self.tokenizer, "chat_template", None):
                return self.tokenizer.apply_chat_template(messages, tokenize=False)
            return _text(messages)
        return prompt + (completion if isinstance(completion, str) else _text(completion))

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        import torch

        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        out: list[float] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                                     padding_side="right", add_special_tokens=False,
                                     truncation=self.max_length is not None, max_length=self.max_length)
                logits = self.model(**enc.to(self.device)).logits
                out += logits[:, 0].float().cpu().tolist()
        return out


def _free_device(device: str) -> Any:
    """'auto': the CUDA device with the most free memory, else the CPU; anything else as torch names it."""
    import torch

    if device != "auto":
        return torch.device(device)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
    return torch.device(f"cuda:{max(range(len(free)), key=free.__getitem__)}")


DEFAULT_TEMPLATE = (
    "Rate how well the response answers the prompt, from 0 (useless or wrong) to {max_score:g} (fully correct and "
    "helpful). Reply with the number only.\n\nPrompt:\n{prompt}\n\nResponse:\n{completion}"
)


class LLMJudge:
    """An LLM judge as an async reward function, over any OpenAI-compatible chat-completions endpoint.

    Each completion is one request: `template` (fields `{prompt}`, `{completion}`, `{max_score}` and any
    dataset column) as the user message, `system` before it; the reply's first number divided by
    `max_score` is the reward. At most `concurrency` requests are in flight (over every batch at once);
    each has `timeout_s`; connection errors, timeouts, 429 and 5xx answers are retried `retries` times
    (backoff `backoff_s` doubling). What still fails, or a reply with no number in [0, max_score],
    raises `JudgeError`: a verifier error for those completions, never reward 0.
    """

    def __init__(self, model: str, base_url: str, *, template: str = DEFAULT_TEMPLATE, system: str | None = None,
                 api_key: str | None = None, api_key_env: str = "OPENAI_API_KEY", max_score: float = 10.0,
                 timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.5, concurrency: int = 8,
                 temperature: float = 0.0, max_tokens: int = 16):
        if not base_url.startswith(("http://", "https://")):
            raise RewardModelError(f"judge base_url {base_url!r} must be an http(s) URL, e.g. https://api.openai.com/v1")
        if concurrency < 1 or retries < 0 or not timeout_s > 0 or not max_score > 0:
            raise RewardModelError("judge needs concurrency >= 1, retries >= 0, timeout_s > 0 and max_score > 0")
        self.model, self.url = model, base_url.rstrip("/") + "/chat/completions"
        self.template, self.system, self.max_score = template, system, float(max_score)
        self.api_key = api_key if api_key is not None else os.environ.get(api_key_env)
        self.timeout_s, self.retries, self.backoff_s, self.concurrency = timeout_s, retries, backoff_s, concurrency
        self.temperature, self.max_tokens = temperature, max_tokens
        self.__name__ = "judge"
        self._gates: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def __repr__(self) -> str:
        return f"LLMJudge({self.model!r}, {self.url!r})"

    @classmethod
    def from_spec(cls, spec: str) -> LLMJudge:
        """`MODEL@BASE_URL` (what `-o reward=judge:MODEL@BASE_URL` gives)."""
        model, sep, url = spec.partition("@")
        if not sep or not model or not url:
            raise RewardModelError(f"judge {spec!r} must look like MODEL@BASE_URL, e.g. "
                                   "judge:gpt-4o-mini@https://api.openai.com/v1 (the key comes from OPENAI_API_KEY)")
        return cls(model, url)

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        per_row = {k: v for k, v in columns.items()  # the dataset's columns (not TRL's trainer_state, log_* callables)
                   if k not in ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")}
        rows = [{k: v[i] for k, v in per_row.items()} for i in range(len(prompts))]
        scores = await asyncio.gather(*(self.score(p, c, row) for p, c, row in zip(prompts, completions, rows)),
                                      return_exceptions=True)
        failed = [s for s in scores if isinstance(s, BaseException)]
        if failed:
            raise JudgeError(f"{len(failed)} of {len(scores)} judge calls failed; first: {failed[0]}")
        return scores  # type: ignore[return-value]

    async def score(self, prompt: Any, completion: Any, row: dict[str, Any] | None = None) -> float:
        """One completion's reward (`JudgeError` when there is none)."""
        import requests

        fields = {**(row or {}), "prompt": _text(prompt), "completion": _text(completion), "max_score": self.max_score}
        try:
            content = self.template.format(**fields)
        except (KeyError, IndexError) as exc:
            raise JudgeError(f"judge template names {exc}, which is not prompt, completion, max_score or a column") from None
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": content}]
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens}
        last = "no attempt"
        async with self._gate():
            for attempt in range(self.retries + 1):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    reply = await asyncio.to_thread(self._post, body)
                except (requests.ConnectionError, requests.Timeout) as exc:
                    last = f"{type(exc).__name__} from {self.url}"
                    continue
                if reply.status_code == 429 or reply.status_code >= 500:
                    last = f"HTTP {reply.status_code} from {self.url}"
                    continue
                if reply.status_code != 200:
                    raise JudgeError(f"judge {self.url} answered HTTP {reply.status_code}: {reply.text[:200]!r}")
                return self._parse(reply)
        raise JudgeError(f"judge gave no answer after {self.retries + 1} tries: {last}")

    def _gate(self) -> asyncio.Semaphore:
        """The concurrency cap of the running event loop (async rewards share one loop; tests may use others)."""
        loop = asyncio.get_running_loop()
        if loop not in self._gates:
            self._gates[loop] = asyncio.Semaphore(self.concurrency)
        return self._gates[loop]

    def _post(self, body: dict[str, Any]) -> Any:
        import requests

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return requests.post(self.url, json=body, headers=headers, timeout=self.timeout_s)

    def _parse(self, reply: Any) -> float:
        try:
            text = reply.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError(f"judge {self.url} answered without choices[0].message.content: {reply.text[:200]!r}") from None
        match = re.search(r"-?\d+(?:\.\d+)?", text or "")
        value = float(match.group()) if match else None
        if value is None or not 0 <= value <= self.max_score:
            raise JudgeError(f"judge reply {text!r} holds no score between 0 and {self.max_score:g}")
        return value / self.max_score


def reward_from_spec(spec: str) -> Any:
    """`model:PATH_OR_ID` (a `RewardModel`) or `judge:MODEL@BASE_URL` (an `LLMJudge`); None for another spec."""
    if spec.startswith(MODEL_PREFIX):
        name = spec[len(MODEL_PREFIX):]
        if not name:
            raise RewardModelError("-o reward=model:PATH_OR_ID needs the reward model's directory or Hugging Face id")
        return RewardModel(name)
    if spec.startswith(JUDGE_PREFIX):
        return LLMJudge.from_spec(spec[len(JUDGE_PREFIX):])
    return None
