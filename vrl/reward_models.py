"""Models as reward functions: a sequence-classification reward model, and an LLM judge over any
OpenAI-compatible chat-completions endpoint.

Both are reward functions of TRL's shape (`vrl.reward_functions`), so they mix with plain functions
and weights, and their failures follow the verifier-error rule (a completion they cannot score is a verifier
error, never reward 0: unscorable for GRPO, absent from ES's fitness; failing on everything stops the run)::

    vrl train --plugin dataset --optimizer grpo -o data=prompts.jsonl -o reward=model:OpenAssistant/reward-model-deberta-v3-large-v2
    vrl train --plugin dataset --optimizer grpo -o data=prompts.jsonl -o reward=judge:gpt-4o-mini@https://api.openai.com/v1

    from vrl.reward_models import LLMJudge, RewardModel
    env = DatasetEnvironment(data="prompts.jsonl", rewards=[RewardModel("path/to/rm"), LLMJudge("m", "http://host/v1")])

torch and transformers are imported when a reward model loads: `import vrl` stays light.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import json
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from vrl.errors import UsageError

log = logging.getLogger(__name__)

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
    `reward_funcs="model id"` computes it (chat prompts through the reward tokenizer's chat template, with the run's
    `sampling.chat_template_kwargs`, as TRL renders them with its `chat_template_kwargs`: `set_chat_template_kwargs`).

    Batched (`batch_size` texts per forward, right-padded), on `device`: 'auto' is the CUDA GPU with the
    most free memory when there is one, else the CPU. The model loads when this is built, so a path
    that does not load fails before anything is generated. `from_model` wraps a model already loaded (TRL's
    `reward_funcs=[model]`).
    """

    def __init__(self, model: str, *, device: str = "auto", batch_size: int = 16, max_length: int | None = None,
                 revision: str | None = None):
        if batch_size < 1:
            raise RewardModelError(f"reward model batch_size must be at least 1, got {batch_size}")
        self.name_or_path, self.batch_size, self.max_length = model, batch_size, max_length
        self.chat_template_kwargs: dict[str, Any] = {}  # the run's (`set_chat_template_kwargs`)
        self.__name__ = Path(model.rstrip("/")).name or "reward_model"  # logged as reward/<name>, as TRL names it
        self._lock = threading.Lock()  # calls run in threads of their own; one forward at a time
        self.device = _free_device(device)
        self.model, self.tokenizer = self._load(revision)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any = None, *, batch_size: int = 16,
                   max_length: int | None = None) -> RewardModel:
        """A sequence-classification model already loaded (TRL's `reward_funcs=[model]`), on its own device; its
        tokenizer is `tokenizer`, else loaded from the model's name as TRL loads it. A model with more than one
        label is refused in one line (its first logit is one class's)."""
        if batch_size < 1:
            raise RewardModelError(f"reward model batch_size must be at least 1, got {batch_size}")
        name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        labels = getattr(model.config, "num_labels", 1)
        if labels != 1:
            raise RewardModelError(f"reward model {name!r} has {labels} labels, not one: a classifier, whose first logit "
                                   "is one class's score; a reward model has one output (num_labels=1)")
        rm = cls.__new__(cls)
        rm.name_or_path, rm.batch_size, rm.max_length = name, batch_size, max_length
        rm.chat_template_kwargs = {}
        rm.__name__ = Path(name.rstrip("/")).name or "reward_model"  # TRL: the name's last part
        rm._lock = threading.Lock()
        rm.device = next(model.parameters()).device
        if tokenizer is None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(name)
            except (OSError, ValueError) as exc:
                raise RewardModelError(f"reward model {name!r}: cannot load its tokenizer ({type(exc).__name__}); pass "
                                       "it: RewardModel.from_model(model, tokenizer)") from None
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        rm.model, rm.tokenizer = model.eval(), tokenizer
        return rm

    def __repr__(self) -> str:
        return f"RewardModel({self.name_or_path!r}, device={str(self.device)!r})"

    def _load(self, revision: str | None) -> tuple[Any, Any]:
        """The tokenizer and the model, loaded as TRL loads a reward model (`num_labels=1`); a checkpoint whose
        score head is missing (a base or causal-LM checkpoint: the head would be random, another at every load)
        or has more than one label (a classifier: its first logit is one class's) is refused in one line."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        name = self.name_or_path
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
            model, info = AutoModelForSequenceClassification.from_pretrained(
                name, revision=revision, num_labels=1, ignore_mismatched_sizes=True, output_loading_info=True,
                dtype=torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        except (OSError, ValueError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RewardModelError(f"cannot load reward model {name!r}: {first}; give a local directory or "
                                   "a Hugging Face id of a sequence-classification model (network or a warm cache)"
                                   ) from None
        mismatched = sorted(info.get("mismatched_keys") or (), key=str)
        if mismatched:
            key, shape = mismatched[0][0], list(mismatched[0][1])
            raise RewardModelError(f"reward model {name!r} has {shape[0]} labels (its {key} is {shape}), not one: a "
                                   "classifier, whose first logit is one class's score; a reward model has one output "
                                   "(TRL loads it with num_labels=1); give a checkpoint trained as a reward model")
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            raise RewardModelError(f"reward model {name!r} has no score head (the checkpoint lacks {', '.join(missing[:3])}"
                                   f"{', ...' if len(missing) > 3 else ''}): a base or causal-LM checkpoint, whose head "
                                   "would be random and differ at every load (and on --resume); give a checkpoint "
                                   "trained as a reward model (AutoModelForSequenceClassification, num_labels=1)")
        if tokenizer.pad_token_id is None:  # the model finds each row's last token by the pad id
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        return model.to(self.device).eval(), tokenizer

    def set_chat_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """The run's `sampling.chat_template_kwargs` (TRL's `chat_template_kwargs`), for every chat this renders."""
        self.chat_template_kwargs = dict(kwargs)

    def text(self, prompt: Any, completion: Any) -> str:
        """What the reward model reads: a chat through its tokenizer's chat template (with the run's
        `chat_template_kwargs`, as TRL renders prompt + completion for a reward model), else prompt + completion."""
        if isinstance(prompt, list):
            messages = prompt + (completion if isinstance(completion, list) else
                                 [{"role": "assistant", "content": completion}])
            if getattr(self.tokenizer, "chat_template", None):
                return self.tokenizer.apply_chat_template(messages, tokenize=False, **self.chat_template_kwargs)
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
#: The reply a judge must give: the score alone, a number from 0 to max_score, whitespace around it allowed.
REPLY = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*")
MAX_REPLY_BYTES = 1 << 20  # a judge's HTTP answer larger than this is a failure, not read further


def redact(url: str) -> str:
    """`url` with the password of its user info replaced by `***` (what errors, logs and reprs show)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    userinfo, at, host = netloc.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}{slash}{path}"


def is_loopback(url: str) -> bool:
    """Whether `url`'s host is this machine (localhost, 127.0.0.0/8, ::1)."""
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LLMJudge:
    """An LLM judge as an async reward function, over any OpenAI-compatible chat-completions endpoint.

    Each completion is one request: `template` (fields `{prompt}`, `{completion}`, `{max_score}` and any
    dataset column) as the user message, `system` before it. The reply must be the score alone, a number from 0
    to `max_score` (whitespace around it allowed; `REPLY`); the reward is that number / `max_score`. A reply in
    any other form is a failure, never a number read out of it.

    At most `concurrency` requests are in flight (over every batch at once; each in a thread of its own, so no
    thread pool caps it); `timeout_s` bounds each request as a whole (connecting, waiting, reading); connection
    errors, timeouts, 429 and 5xx answers are retried `retries` times (backoff `backoff_s` doubling). A completion
    that still has no score is a `JudgeError` in its place of the returned list: that completion alone fails (a
    verifier error, never reward 0) and the others keep their scores; nothing is asked twice. Told the caller's
    cap on a call (`set_call_timeout`, `reward_timeout_s`), a call returns within it, the completions it could not
    score by then failed, and a judge whose one completion may take longer (`worst_case_s`) is refused.

    The key (`api_key`, else `$api_key_env`) goes only to an https or loopback URL unless `key_over_http`; a
    password in the URL (basic auth) is shown as `***` in every error, log line and repr.
    """

    def __init__(self, model: str, base_url: str, *, template: str = DEFAULT_TEMPLATE, system: str | None = None,
                 api_key: str | None = None, api_key_env: str = "OPENAI_API_KEY", key_over_http: bool = False,
                 max_score: float = 10.0, timeout_s: float = 15.0, retries: int = 2, backoff_s: float = 0.5,
                 concurrency: int = 8, temperature: float = 0.0, max_tokens: int = 16):
        if not base_url.startswith(("http://", "https://")) or not urlsplit(base_url).hostname:
            raise RewardModelError(f"judge base_url {redact(base_url)!r} must be an http(s) URL, e.g. "
                                   "https://api.openai.com/v1")
        if not model:
            raise RewardModelError("judge needs a model name")
        if concurrency < 1 or retries < 0 or not timeout_s > 0 or not max_score > 0 or backoff_s < 0:
            raise RewardModelError("judge needs concurrency >= 1, retries >= 0, timeout_s > 0, backoff_s >= 0 and "
                                   "max_score > 0")
        self.model, self.url = model, base_url.rstrip("/") + "/chat/completions"
        self.shown_url = redact(self.url)  # what messages show: never the password
        self.template, self.system, self.max_score = template, system, float(max_score)
        key = api_key if api_key is not None else os.environ.get(api_key_env)
        self.key_withheld = bool(key) and not key_over_http and self.url.startswith("http://") \
            and not is_loopback(self.url)
        if self.key_withheld:
            log.warning("judge %s: the API key is not sent over plain http to a host other than this machine (give "
                        "an https URL, or key_over_http=True / -o judge_key_over_http=true to send it anyway)",
                        self.shown_url)
        self._api_key = None if self.key_withheld else key
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
        self.concurrency = int(concurrency)
        self.temperature, self.max_tokens = temperature, max_tokens
        self.call_timeout_s: float | None = None  # the caller's cap on a whole call (`set_call_timeout`)
        self.__name__ = "judge"
        self._gates: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def __repr__(self) -> str:
        return f"LLMJudge({self.model!r}, {self.shown_url!r})"

    @property
    def worst_case_s(self) -> float:
        """The longest one completion may take: every try at `timeout_s`, and the backoffs between them."""
        return self.timeout_s * (self.retries + 1) + self.backoff_s * (2 ** self.retries - 1)

    def set_call_timeout(self, seconds: float) -> None:
        """The caller cancels a call after `seconds` (`RewardFunctions`' `reward_timeout_s`): a call returns before
        then, failing only the completions it has no score for. A judge whose one completion may take longer than
        that (`worst_case_s`) is refused: its retries could never all run."""
        if self.worst_case_s > seconds * 0.9:
            raise RewardModelError(
                f"judge {self.shown_url}: one completion may take {self.worst_case_s:g} s (timeout_s={self.timeout_s:g} "
                f"× {self.retries + 1} tries + {self.worst_case_s - self.timeout_s * (self.retries + 1):g} s backoff), "
                f"more than 90% of reward_timeout_s={seconds:g}; raise -o reward_timeout_s, or lower -o judge_timeout_s "
                "or -o judge_retries")
        self.call_timeout_s = float(seconds)

    @classmethod
    def from_spec(cls, spec: str, **settings: Any) -> LLMJudge:
        """`MODEL@BASE_URL` (what `-o reward=judge:MODEL@BASE_URL` gives): the URL starts at the last `@http://` or
        `@https://`, so a model name may hold `@`. A password in the URL must be `$VAR` or `${VAR}` (read from the
        environment here), so that what is recorded (config.json) holds no credentials."""
        match = re.fullmatch(r"(.+)@(https?://.+)", spec, re.S)
        if match is None:
            raise RewardModelError(f"judge {redact(spec)!r} must look like MODEL@BASE_URL, e.g. "
                                   "judge:gpt-4o-mini@https://api.openai.com/v1 (the key comes from OPENAI_API_KEY)")
        model, url = match.groups()
        return cls(model, _password_from_env(url), **settings)

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[Any]:
        """One score per completion, or, in its place, the `JudgeError` of a completion the judge could not score."""
        per_row = {k: v for k, v in columns.items()  # the dataset's columns (not TRL's trainer_state, log_* callables)
                   if k not in ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments",
                                "raw_completions", "environment_rewards")}
        rows = [{k: v[i] for k, v in per_row.items()} for i in range(len(prompts))]
        budget = None if self.call_timeout_s is None else self.call_timeout_s * 0.9

        async def one(prompt: Any, completion: Any, row: dict[str, Any]) -> float:
            if budget is None:
                return await self.score(prompt, completion, row)
            try:
                return await asyncio.wait_for(self.score(prompt, completion, row), budget)
            except asyncio.TimeoutError:
                raise JudgeError(f"judge {self.shown_url} did not score this completion within {budget:g} s of the "
                                 f"call (90% of reward_timeout_s; {self.concurrency} requests at a time)") from None

        scores = await asyncio.gather(*(one(p, c, row) for p, c, row in zip(prompts, completions, rows)),
                                      return_exceptions=True)
        for s in scores:
            if isinstance(s, BaseException) and not isinstance(s, Exception):
                raise s  # a cancellation or an interrupt is the caller's, not a completion's failure
        return list(scores)

    async def score(self, prompt: Any, completion: Any, row: dict[str, Any] | None = None) -> float:
        """One completion's reward (`JudgeError` when there is none)."""
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
                    status, text = await self._request(body)
                except _Transient as exc:
                    last = str(exc)
                    continue
                if status == 429 or status >= 500:
                    last = f"HTTP {status}"
                    continue
                if status != 200:
                    raise JudgeError(f"judge {self.shown_url} answered HTTP {status}"
                                     f"{' (the API key was withheld over plain http)' if self.key_withheld else ''}: "
                                     f"{text[:200]!r}")
                return self._parse(text)
        raise JudgeError(f"judge {self.shown_url} gave no answer after {self.retries + 1} tries; the last: {last}")

    def _gate(self) -> asyncio.Semaphore:
        """The concurrency cap of the running event loop (async rewards share one loop; tests may use others)."""
        loop = asyncio.get_running_loop()
        if loop not in self._gates:
            self._gates[loop] = asyncio.Semaphore(self.concurrency)
        return self._gates[loop]

    async def _request(self, body: dict[str, Any]) -> tuple[int, str]:
        """(status, text) of one POST, bounded as a whole by `timeout_s`; `_Transient` when it times out or
        cannot connect. Runs in a daemon thread of its own (no pool to cap concurrency; an overrun thread stops
        at its own deadline, between reads)."""
        future: concurrent.futures.Future[tuple[int, str]] = concurrent.futures.Future()
        deadline = time.monotonic() + self.timeout_s

        def work() -> None:
            try:
                result = self._post(body, deadline)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # it stopped waiting (timed out)
                    future.set_exception(exc)
            else:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_result(result)

        threading.Thread(target=work, name="vrl-judge", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except asyncio.TimeoutError:
            raise _Transient(f"no complete answer within timeout_s={self.timeout_s:g} s") from None

    def _post(self, body: dict[str, Any], deadline: float) -> tuple[int, str]:
        import requests

        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            with requests.post(self.url, json=body, headers=headers, stream=True,
                               timeout=(self.timeout_s, self.timeout_s)) as reply:
                data = bytearray()
                for chunk in reply.iter_content(chunk_size=1):  # byte by byte: a trickle cannot pass the deadline
                    data += chunk
                    if time.monotonic() > deadline:
                        raise _Transient(f"no complete answer within timeout_s={self.timeout_s:g} s")
                    if len(data) > MAX_REPLY_BYTES:
                        raise JudgeError(f"judge {self.shown_url} answered more than {MAX_REPLY_BYTES} bytes")
                return reply.status_code, data.decode(reply.encoding or "utf-8", errors="replace")
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise _Transient(f"{type(exc).__name__} (connecting or reading)") from None

    def _parse(self, text: str) -> float:
        try:
            content = json.loads(text)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError(f"judge {self.shown_url} answered without choices[0].message.content: {text[:200]!r}") from None
        match = REPLY.fullmatch(content) if isinstance(content, str) else None
        value = float(match.group(1)) if match else None
        if value is None or not 0 <= value <= self.max_score:
            raise JudgeError(f"judge reply {str(content)[:200]!r} is not a score alone from 0 to {self.max_score:g} "
                             "(the reply must be the number only)")
        return value / self.max_score


class _Transient(Exception):
    """A request that timed out or could not connect: retried."""


def _password_from_env(url: str) -> str:
    """`url` with a `$VAR` / `${VAR}` password read from the environment; a literal password is refused (it would be
    recorded with the run's options)."""
    scheme, _, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    userinfo, at, host = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user, password = userinfo.split(":", 1)
    var = re.fullmatch(r"\$\{(\w+)\}|\$(\w+)", password)
    if var is None:
        raise RewardModelError(f"judge URL {redact(url)!r} holds a password, which would be written to the run's "
                               "config.json; give it as an environment variable: https://USER:${VAR}@HOST/... "
                               "(quoted for the shell)")
    name = var.group(1) or var.group(2)
    if not os.environ.get(name):
        raise RewardModelError(f"judge URL {redact(url)!r}: the environment variable {name} holding its password is "
                               "not set")
    return f"{scheme}://{user}:{os.environ[name]}@{host}{slash}{path}"


JUDGE_SETTINGS = ("timeout_s", "retries", "concurrency", "key_over_http")  # what `-o judge_<name>=` sets


def reward_from_spec(spec: str, judge: dict[str, Any] | None = None) -> Any:
    """`model:PATH_OR_ID` (a `RewardModel`) or `judge:MODEL@BASE_URL` (an `LLMJudge`, with `judge`'s settings, e.g.
    `{"timeout_s": 30}`); None for another spec."""
    if spec.startswith(MODEL_PREFIX):
        name = spec[len(MODEL_PREFIX):]
        if not name:
            raise RewardModelError("-o reward=model:PATH_OR_ID needs the reward model's directory or Hugging Face id")
        return RewardModel(name)
    if spec.startswith(JUDGE_PREFIX):
        return LLMJudge.from_spec(spec[len(JUDGE_PREFIX):], **(judge or {}))
    return None
