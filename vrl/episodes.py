"""Episodes: environments that answer back (DESIGN.md §6c).

An episode is the one-turn attempt generalised. The model writes a turn; the environment's side of the
episode (an `Interaction`, one fresh object per episode) answers it with a message, with tool results,
or by ending the episode; the model writes the next turn; and so on, up to `Interaction.max_turns`.
The verdict and the reward are the whole episode's: the verifier judges the last model turn (the
completion's `text`) with the whole conversation at hand (`Completion.episode`).

Tokens in, tokens out: each turn continues from the exact token ids sampled so far. The environment's
messages are rendered through the chat template once, tokenised once and appended; `token_mask` marks
which ids the model sampled (1) and which the environment wrote (0), so GRPO trains on exactly what was
sampled and masks the rest out, as TRL masks tool results. Nothing is re-tokenised from text.

`Episodes.run` is the backend-independent loop. A backend gives it one of two primitives:
- `Continue`, "continue these token-id sequences by one model turn" (batched, one seed per row): the loop
  batches one turn of every live episode per call (hf, whose `generate` is a batch);
- a `TurnStream` (vLLM, a continuous-batching engine): each episode's next turn is sent to the engine as
  soon as its environment step returns, and each turn comes back as soon as it finishes, so one episode's
  environment step overlaps the other episodes' generation and no turn waits for the slowest of its batch.
Environment steps run concurrently on an event loop in another thread, each bounded by a timeout
(`Interaction.step_timeout_s`, else `STEP_TIMEOUT_S`); an episode whose step is slow joins a later batch
(or, streamed, the engine's running batch), so it delays only itself.

One budget per episode (`Interaction.max_tokens`, TRL's `max_completion_length`): the model's and the
environment's tokens after the prompt together. As TRL 1.16 does, a model turn is cut to what is left of
the budget (`finish_reason="length"`), and an environment reply that would pass the budget is dropped,
whole, and ends the episode (its step still ran: a tool's effect on its instance stays).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from vrl.errors import UsageError
from vrl.types import Attempt, Completion, Episode, Prompt, Result, Task, Turn, Verdict

#: How long, after the first environment step of a turn finishes, the loop waits for the others before it
#: samples the next turn of those that are ready: long enough that fast steps share one engine call, short
#: enough that a slow one (a tool that hangs until its timeout) holds back only its own episode.
GATHER_S = 0.25

#: Wall-clock cap of one environment step, unless the interaction sets its own (`Interaction.step_timeout_s`).
STEP_TIMEOUT_S = 60.0


@dataclass
class ModelTurn:
    """A model turn as the environment sees it."""

    text: str  # decoded without special tokens (what a verifier reads)
    raw: str  # decoded with them (tool-call markers such as Llama 3.1's <|python_tag|> are special tokens)
    index: int  # 1 for the first turn
    last: bool  # no turn follows, whatever the reply (max_turns reached): a reply's messages are dropped
    finish_reason: str = "stop"


@dataclass
class Reply:
    """The environment's answer to one model turn."""

    messages: list[dict[str, Any]] = field(default_factory=list)  # chat messages (role 'user' or 'tool') to append
    done: bool = False  # the episode ends here (also when `messages` is empty)
    passed: bool | None = None  # the environment's verdict on this turn, if it gives one (metrics: pass rate by turn)
    metrics: dict[str, float] = field(default_factory=dict)  # counters added to the episode's (tool_calls, tool_errors)
    #: The run's verifier's verdict on this turn, when the environment judged the turn with it (a repair episode,
    #: `vrl.repair`): if this turn is the episode's last, its verdict, not judged again (`judged_verdict`).
    verdict: Verdict | None = None


class Interaction(ABC):
    """The environment's side of one episode; `Environment.interaction(task)` makes a fresh one per episode."""

    #: The most model turns of an episode.
    max_turns: int = 1
    #: JSON schemas of the tools the model may call, rendered into the prompt by the chat template (None: no tools).
    tools: list[dict[str, Any]] | None = None
    #: The episode's token budget: model and environment tokens after the prompt (TRL's `max_completion_length`);
    #: None: only `max_turns` and each turn's cap bound it.
    max_tokens: int | None = None
    #: Wall-clock cap of one step (`reply`) of this episode; None: the runner's (`STEP_TIMEOUT_S`, 60 s).
    step_timeout_s: float | None = None
    #: The object reward functions receive for this episode in `environments` (TRL's environment instance), if any.
    environment: Any = None

    def prompt(self, task: Task) -> Prompt:
        """The episode's first prompt (default: the task's)."""
        return task.prompt

    @abstractmethod
    async def reply(self, turn: ModelTurn) -> Reply:
        """Answer a model turn (every one, the last and those cut at the token limit included: see `turn.last`
        and `turn.finish_reason`)."""

    def reward(self) -> float | None:
        """The episode's reward once it ended, when the environment keeps one (TRL's `get_reward`); None: the
        verifier judges the text. May be a coroutine function."""
        return None


@dataclass
class Row:
    """One episode a backend asks for: the task, who samples it, and the seed of its first turn."""

    task: Task
    variant: int = 0
    sample: int = 0
    seed: int | None = None
    member: int = -1  # the low-rank member that samples it (an index into the backend's call), −1: none


@dataclass
class Sampled:
    """One model turn as a backend sampled it (ids already cut at EOS or a stop string)."""

    ids: list[int]
    text: str
    raw: str
    finish_reason: str
    logprobs: list[float] | None = None


#: The backend primitive: continue each token-id sequence by one model turn; row r samples with `seeds[r]`
#: (None: unseeded) as low-rank member `members[r]` (−1: the weights as they are).
Continue = Callable[[list[list[int]], list[int | None], list[int]], list[Sampled]]


@runtime_checkable
class TurnStream(Protocol):
    """The streaming primitive of a continuous-batching engine: turns go in as their episodes are ready and
    come out as they finish, keyed by the caller's `key`; the same seeds and members as `Continue`."""

    def submit(self, keys: list[int], sequences: list[list[int]], seeds: list[int | None], members: list[int]) -> None:
        """Start one model turn per sequence (they join the engine's running batch)."""

    def step(self) -> list[tuple[int, Sampled]]:
        """Advance the engine; the turns that finished since the last call, with their keys."""

    def busy(self) -> bool:
        """Whether any submitted turn has not come back yet."""

    def abort(self) -> None:
        """Drop every turn still in the engine (the loop failed or was interrupted)."""


def attach(host: Any, environment: Any) -> None:
    """Where `environment` answers back (`multi_turn`), `host` samples its tasks as whole episodes; a
    single-turn environment leaves the host as it is. Every place that samples for training or evaluation
    (rank 0's loop, a sampling follower rank, `vrl eval`) attaches through here."""
    if environment.multi_turn:
        host.episodes(Episodes(environment))


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of an episode's turn `turn` (0-based): the first is the row's own seed, so a one-turn episode
    draws what a single completion draws; later ones are spread over [0, 2**31) by a golden-ratio step
    (torch's CPU generator keeps only a seed's low 32 bits, so adding multiples of 2**32 would repeat draws)."""
    return None if seed is None else (seed + turn * 0x9E3779B1) % 2**31


@dataclass
class _State:
    row: Row
    interaction: Interaction | None
    prompt_ids: list[int]
    max_turns: int
    max_tokens: int | None = None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    model_turns: int = 0
    finish_reason: str = "stop"
    text: str = ""
    judged: tuple[int, Verdict] | None = None  # the model turn the environment's verifier judged last, and its verdict
    prompt: Prompt | None = None  # the first prompt, where the interaction changed the task's (a reset() text appended)

    def add(self, key: str, value: float) -> None:
        self.metrics[key] = self.metrics.get(key, 0.0) + value


class Episodes:
    """Runs episodes of an environment on a backend: every live episode's next turn in one engine call."""

    def __init__(self, environment: Any, step_timeout_s: float = STEP_TIMEOUT_S, gather_s: float = GATHER_S):
        self.environment = environment
        self.step_timeout_s = step_timeout_s
        self.gather_s = gather_s
        # One event loop for every run of these episodes, so what an environment keeps across episodes (a
        # verifier's client, a sandbox pool) stays on the loop it was made on.
        self._loop: _LoopThread | None = None

    def run(self, rows: Sequence[Row], tokenizer: Any, generate: Continue | TurnStream,
            chat_template_kwargs: Mapping[str, Any] | None = None) -> list[Completion]:
        """The completions of `rows` (in order): each an episode, or a single turn where the environment
        gives no interaction for the task. `generate` is a backend's `Continue` (one turn of every live
        episode per call) or its `TurnStream` (turns streamed through a continuous-batching engine).
        `chat_template_kwargs` (TRL's name; `sampling.chat_template_kwargs`) reach every rendering through the
        chat template: the first prompt and the environment's messages."""
        chat = dict(chat_template_kwargs or {})
        states = [self._start(row, tokenizer, chat) for row in rows]
        if self._loop is None:
            self._loop = _LoopThread()
        if isinstance(generate, TurnStream):
            self._stream(states, tokenizer, generate, chat)
        else:
            self._batched(states, tokenizer, generate, chat)
        return [self._completion(s, self._loop) for s in states]

    def _batched(self, states: list[_State], tokenizer: Any, generate: Continue, chat: Mapping[str, Any]) -> None:
        """One engine call per round: every ready episode's next turn; a round's environment steps are gathered
        for up to `gather_s` after the first returns, so fast steps share the next call."""
        ready = list(range(len(states)))
        pending: dict[concurrent.futures.Future[tuple[Reply, float]], int] = {}
        try:
            while ready or pending:
                if ready:
                    outs = generate(*_next_turns(states, ready))
                    for i, out in zip(ready, outs):
                        self._sampled(states, i, out, tokenizer, pending)
                    ready = []
                if pending:
                    done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                    more, _ = concurrent.futures.wait(set(pending) - done, timeout=self.gather_s)
                    ready = self._replied(states, done | more, pending, tokenizer, chat)
        finally:
            for fut in pending:
                fut.cancel()

    def _stream(self, states: list[_State], tokenizer: Any, stream: TurnStream, chat: Mapping[str, Any]) -> None:
        """Turns streamed through a continuous-batching engine: a finished turn goes to its environment step at
        once, and the episode's next turn goes back into the engine as soon as that step returns."""
        pending: dict[concurrent.futures.Future[tuple[Reply, float]], int] = {}

        def send(keys: list[int]) -> None:
            if keys:
                stream.submit(keys, *_next_turns(states, keys))

        try:
            send(list(range(len(states))))
            while stream.busy() or pending:
                if stream.busy():
                    for i, out in sorted(stream.step(), key=lambda x: x[0]):
                        self._sampled(states, i, out, tokenizer, pending)
                    done = {f for f in pending if f.done()}
                else:  # only environment steps are running: wait for one
                    done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                send(self._replied(states, done, pending, tokenizer, chat))
        finally:
            for fut in pending:
                fut.cancel()
            stream.abort()

    def _sampled(self, states: list[_State], i: int, out: Sampled, tokenizer: Any,
                 pending: dict[concurrent.futures.Future[tuple[Reply, float]], int]) -> None:
        """A model turn of episode `i` came back: record it, and start its environment step unless it ended."""
        turn = self._model_turn(states[i], out, tokenizer)
        if turn is not None:
            pending[self._loop.submit(self._step(states[i].interaction, turn, self._timeout(states[i])))] = i

    def _replied(self, states: list[_State], done: set[concurrent.futures.Future[tuple[Reply, float]]],
                 pending: dict[concurrent.futures.Future[tuple[Reply, float]], int], tokenizer: Any,
                 chat: Mapping[str, Any]) -> list[int]:
        """Record the finished environment steps (in episode order); the episodes that take another turn."""
        ready = []
        for fut in sorted(done, key=pending.__getitem__):
            i = pending.pop(fut)
            if self._environment_turn(states[i], *fut.result(), tokenizer, chat):
                ready.append(i)
        return ready

    # -- one episode ---------------------------------------------------------------------------------
    def _start(self, row: Row, tokenizer: Any, chat: Mapping[str, Any] | None = None) -> _State:
        interaction = self.environment.interaction(row.task)
        prompt, tools = row.task.prompt, None
        if interaction is not None:
            prompt, tools = interaction.prompt(row.task), interaction.tools
        text = render(tokenizer, prompt, tools, chat)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        turns = 1 if interaction is None else int(interaction.max_turns)
        name = getattr(self.environment, "name", "?")
        if turns < 1:
            raise ValueError(f"environment {name!r}: an interaction's max_turns must be at least 1, got {turns}")
        budget = None if interaction is None else interaction.max_tokens
        if budget is not None and int(budget) < 1:
            raise ValueError(f"environment {name!r}: an interaction's max_tokens must be at least 1, got {budget}")
        return _State(row=row, interaction=interaction, prompt_ids=list(ids), max_turns=turns,
                      max_tokens=None if budget is None else int(budget),
                      prompt=prompt if interaction is not None and prompt != row.task.prompt else None)

    def _timeout(self, s: _State) -> float:
        own = getattr(s.interaction, "step_timeout_s", None)
        return self.step_timeout_s if own is None else float(own)

    def _model_turn(self, s: _State, out: Sampled, tokenizer: Any) -> ModelTurn | None:
        """Append a sampled turn; the turn to show the environment, or None when the episode ends here."""
        if s.max_tokens is not None and len(s.ids) + len(out.ids) > s.max_tokens:  # TRL cuts it to the budget
            out = _cut(out, s.max_tokens - len(s.ids), tokenizer)
        s.ids += out.ids
        s.mask += [1] * len(out.ids)
        if s.logprobs is not None:
            s.logprobs = s.logprobs + out.logprobs if out.logprobs is not None else None
        s.model_turns += 1
        s.finish_reason, s.text = out.finish_reason, out.text
        s.turns.append(Turn(role="assistant", content=out.text, tokens=len(out.ids)))
        if s.interaction is None:
            return None
        return ModelTurn(text=out.text, raw=out.raw, index=s.model_turns, last=s.model_turns >= s.max_turns,
                         finish_reason=out.finish_reason)

    async def _step(self, interaction: Interaction, turn: ModelTurn, timeout_s: float) -> tuple[Reply, float]:
        """The environment's reply, bounded by the step timeout; a step that fails or overruns ends the
        episode (counted in `step_errors`), never the run."""
        start = time.perf_counter()
        try:
            reply = await asyncio.wait_for(interaction.reply(turn), timeout_s)
            if not isinstance(reply, Reply):
                raise TypeError(f"reply() returned {type(reply).__name__}, not a vrl.episodes.Reply")
        except asyncio.TimeoutError:
            reply = Reply(done=True, metrics={"step_errors": 1.0},
                          messages=[{"role": "user", "content": f"[environment step timed out after {timeout_s:g} s]"}])
        except Exception as exc:  # a broken environment step ends its episode; the others go on
            reply = Reply(done=True, metrics={"step_errors": 1.0},
                          messages=[{"role": "user", "content": f"[environment step failed: {type(exc).__name__}: {exc}]"}])
        return reply, time.perf_counter() - start

    def _environment_turn(self, s: _State, reply: Reply, seconds: float, tokenizer: Any,
                          chat: Mapping[str, Any] | None = None) -> bool:
        """Record the reply and append its messages' tokens; whether the episode takes another turn."""
        s.add("env_step_s", seconds)
        for key, value in reply.metrics.items():
            s.add(key, float(value))
        if reply.passed is not None:
            s.turns[-1].passed = bool(reply.passed)
        if reply.verdict is not None:
            s.judged = (s.model_turns, reply.verdict)
        goes_on = bool(reply.messages) and not reply.done and s.model_turns < s.max_turns
        if not goes_on:
            if reply.metrics.get("step_errors"):  # keep the error in the conversation, outside the trajectory
                s.turns += [Turn(role=m.get("role", "user"), content=str(m.get("content", "")), seconds=seconds)
                            for m in reply.messages]
            return False
        ids = environment_ids(tokenizer, reply.messages, chat)
        eos = tokenizer.eos_token_id
        if _turn_ends_with_eos(tokenizer) and (not s.ids or s.ids[-1] != eos):
            ids = [eos] + ids  # a turn cut by a stop string: close it as the template would
        if s.max_tokens is not None and len(s.ids) + len(ids) > s.max_tokens:
            s.add("over_budget", 1.0)  # TRL drops the whole reply and the episode ends as it is
            return False
        s.ids += ids
        s.mask += [0] * len(ids)
        if s.logprobs is not None:
            s.logprobs += [0.0] * len(ids)
        for k, m in enumerate(reply.messages):
            s.turns.append(Turn(role=m.get("role", "user"), content=str(m.get("content", "")), name=m.get("name"),
                                tokens=len(ids) if k == len(reply.messages) - 1 else 0, seconds=seconds if k == 0 else 0.0))
        if s.max_tokens is not None and len(s.ids) >= s.max_tokens:  # no room for a turn: the episode ends cut,
            s.finish_reason = "length"  # its last token not the model's end of turn (truncated, as TRL counts it)
            return False
        return True

    def _completion(self, s: _State, loop: _LoopThread) -> Completion:
        c = Completion(task_id=s.row.task.id, text=s.text, variant=s.row.variant, sample=s.row.sample,
                       prompt_tokens=len(s.prompt_ids), completion_tokens=sum(s.mask), finish_reason=s.finish_reason,
                       prompt_token_ids=s.prompt_ids, token_ids=s.ids, logprobs=s.logprobs or None)
        if s.interaction is None:
            return c
        reward = loop.submit(_call(s.interaction.reward)).result()
        s.add("model_tokens", float(sum(s.mask)))
        s.add("env_tokens", float(len(s.mask) - sum(s.mask)))
        s.add("turns", float(s.model_turns))
        c.token_mask = s.mask
        c.episode = Episode(turns=s.turns, reward=None if reward is None else float(reward), metrics=s.metrics,
                            prompt=s.prompt)
        if s.interaction.environment is not None:
            _keep_environment(c.episode, s.interaction.environment)
        if s.judged is not None and s.judged[0] == s.model_turns:  # the last turn's verdict: the episode's
            _keep_verdict(c.episode, s.row.task.id, s.text, s.judged[1])
        return c


def _next_turns(states: list[_State], keys: list[int]) -> tuple[list[list[int]], list[int | None], list[int]]:
    """What the next model turn of each episode in `keys` continues: its ids so far, its turn's seed, its member."""
    return ([states[i].prompt_ids + states[i].ids for i in keys],
            [turn_seed(states[i].row.seed, states[i].model_turns) for i in keys],
            [states[i].row.member for i in keys])


def _cut(out: Sampled, n: int, tokenizer: Any) -> Sampled:
    """A sampled turn cut to its first `n` ids (the episode's budget), decoded again."""
    ids = out.ids[:n]
    return Sampled(ids=ids, text=tokenizer.decode(ids, skip_special_tokens=True), raw=tokenizer.decode(ids),
                   finish_reason="length", logprobs=None if out.logprobs is None else out.logprobs[:n])


# Each episode's environment instance (TRL's `environments` for reward functions), by the episode it ran in. It
# lives in this process only (an instance is whatever the user's class holds): an episode that crossed to
# another process arrives without one, and a reward function that reads `environments` is told so.
_ENVIRONMENTS: dict[int, tuple[weakref.ref[Episode], Any]] = {}


# Instances handed out by an `InstancePool` and not yet back: id -> (pool, instance) (the instance kept alive, so its
# id is not reused while it is out).
_POOLED: dict[int, tuple[InstancePool, Any]] = {}


class InstancePool:
    """Reusable instances of a TRL environment class (`environment_factory`), as TRL pools them: `take` hands out a
    free instance and calls `factory()` only when none is free, so an expensive `__init__` runs once per instance
    the run needs at a time, not once per episode; each episode resets its instance (`reset(**row)`). An instance
    is free again once the episode that ran on it is gone (its completion, and every result holding it, dropped), so
    a reward function reading `environments` reads its own episode's instance, never a later one's."""

    def __init__(self, factory: Callable[[], Any], probe: Any = None):
        """`probe`: an instance already made (checking the factory), the pool's first."""
        self.factory = factory
        self._free: list[Any] = [] if probe is None else [probe]
        self._lock = threading.Lock()
        self.made = 0 if probe is None else 1  # instances made so far

    def take(self) -> Any:
        with self._lock:
            instance = self._free.pop() if self._free else None
        if instance is None:
            instance = self.factory()
            with self._lock:
                self.made += 1
        _POOLED[id(instance)] = (self, instance)
        return instance

    def give(self, instance: Any) -> None:
        with self._lock:
            self._free.append(instance)


def release(interaction: Any) -> None:
    """Hand back the pooled instance of an interaction that runs no episode (one made only to look at its tools)."""
    pooled = _POOLED.pop(id(getattr(interaction, "environment", None)), None)
    if pooled is not None:
        pooled[0].give(pooled[1])


def _keep_environment(episode: Episode, instance: Any) -> None:
    key = id(episode)
    _ENVIRONMENTS[key] = (weakref.ref(episode), instance)
    weakref.finalize(episode, _forget, key, _POOLED.pop(id(instance), None))


def _forget(key: int, pooled: tuple[InstancePool, Any] | None) -> None:
    """The episode is gone: its instance leaves `environments` and, from a pool, is free for another episode."""
    _ENVIRONMENTS.pop(key, None)
    if pooled is not None:
        pooled[0].give(pooled[1])


# The verdict the run's verifier already gave an episode's last turn (a repair episode), by the episode: (task id,
# the text judged, the verdict). In this process only; an episode from elsewhere is judged by the pool as usual.
_VERDICTS: dict[int, tuple[weakref.ref[Episode], str, str, Verdict]] = {}


def _keep_verdict(episode: Episode, task_id: str, text: str, verdict: Verdict) -> None:
    key = id(episode)
    _VERDICTS[key] = (weakref.ref(episode), task_id, text, verdict)
    weakref.finalize(episode, _VERDICTS.pop, key, None)


def judged_verdict(attempt: Attempt) -> Verdict | None:
    """The verdict the run's verifier gave this attempt's episode on its last turn, when nothing changed since
    (the same task and text): the verification pool takes it as the episode's instead of judging the turn a second
    time (for Lean, a second compile and re-check). A copy: the caller may annotate it. None otherwise."""
    episode = attempt.completion.episode
    kept = _VERDICTS.get(id(episode)) if episode is not None else None
    if kept is None or kept[0]() is not episode or kept[1] != attempt.task.id or kept[2] != attempt.completion.text:
        return None
    return kept[3].model_copy(deep=True)


def environment_of(completion: Completion) -> Any:
    """The environment instance the completion's episode ran on (`Interaction.environment`), or None where it
    had none or the episode was sampled in another process."""
    episode = completion.episode
    kept = _ENVIRONMENTS.get(id(episode)) if episode is not None else None
    return kept[1] if kept is not None and kept[0]() is episode else None


async def _call(fn: Callable[[], Any]) -> Any:
    value = fn()
    return await value if inspect.isawaitable(value) else value


class _LoopThread:
    """An asyncio loop in a daemon thread, for the environment steps of an `Episodes` (it ends with the process)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vrl-episodes", daemon=True)
        self.thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


# -- rendering -----------------------------------------------------------------------------------------
def render(tokenizer: Any, prompt: Prompt, tools: list[dict[str, Any]] | None = None,
           chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The first prompt's text: chat messages through the chat template (with `chat_template_kwargs`, TRL's
    name: `{"enable_thinking": False}` for Qwen3), with the tools' schemas. A text prompt stays as it is, unless
    tools come with it: then it is the user message of a chat, so the template shows the tools. Tools are never
    dropped: a tokenizer without a chat template, or whose template does not render tools, is refused
    (`ToolsNotRendered`, one line)."""
    if tools:
        _check_renders_tools(tokenizer, tools)
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                             **dict(chat_template_kwargs or {}))
    return "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "


class ToolsNotRendered(UsageError, ValueError):
    """An episode offers tools but the model's chat template cannot show them to the model."""


_PROBE_TOOL = {"type": "function", "function": {"name": "vrl_probe_tool", "description": "A probe.",
                                                "parameters": {"type": "object", "properties": {}}}}


def _check_renders_tools(tokenizer: Any, tools: list[dict[str, Any]]) -> None:
    """Refuse a tokenizer that would send a prompt without its tools: no chat template, or one that renders a
    conversation the same with a tool as without (checked once per tokenizer)."""
    names = ", ".join(str(t.get("function", t).get("name", "?")) for t in tools)
    if not getattr(tokenizer, "chat_template", None):
        raise ToolsNotRendered(f"the episode offers tools ({names}) but the model's tokenizer has no chat template "
                               "to show them; use a model with a chat template that renders tools (Qwen2.5, Qwen3, "
                               "Hermes), or give no tools")
    cached = getattr(tokenizer, "_vrl_renders_tools", None)
    if cached is None:
        probe = [{"role": "user", "content": "hi"}]
        cached = (tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True)
                  != tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True))
        try:
            tokenizer._vrl_renders_tools = cached
        except AttributeError:
            pass
    if not cached:
        raise ToolsNotRendered(f"the episode offers tools ({names}) but the model's chat template does not render "
                               "tools (the prompt would reach the model without them); use a model whose template "
                               "renders tools (Qwen2.5, Qwen3, Hermes), or give no tools")


def environment_ids(tokenizer: Any, messages: list[dict[str, Any]],
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The token ids of the environment's messages as the chat template renders them after a model turn that
    ended with EOS, up to the next assistant header: the template's rendering of a short conversation with
    and without them, the first cut after its last EOS (as TRL 1.16 builds tool-result suffixes)."""
    if not getattr(tokenizer, "chat_template", None):
        text = "\n" + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if messages[0].get("role") == "tool":  # templates render tool results after the call that asked for them
        call = {"type": "function", "function": {"name": messages[0].get("name") or "tool", "arguments": {}}}
        assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    else:
        assistant = {"role": "assistant", "content": "x"}
    dummy = [{"role": "user", "content": "dummy"}, assistant]
    kwargs = dict(chat_template_kwargs or {})  # as TRL renders its tool suffixes, with the run's template arguments
    prefix = _ids(tokenizer.apply_chat_template(dummy, tokenize=True, add_generation_prompt=False, **kwargs))
    full = _ids(tokenizer.apply_chat_template(dummy + messages, tokenize=True, add_generation_prompt=True, **kwargs))
    # Where the two renderings part, the dummy assistant turn is being rendered (Qwen3 writes an empty
    # <think></think> into an assistant turn only when it is the conversation's last message); the
    # environment's part starts after that turn's EOS, or where they part when the template ends no turn with it.
    common = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
    if common < len(prefix) and tokenizer.eos_token_id in full[common:]:
        common = full.index(tokenizer.eos_token_id, common) + 1
    elif common == len(prefix) and tokenizer.eos_token_id in prefix:  # cut after the dummy turn's EOS (TRL)
        common = len(prefix) - prefix[::-1].index(tokenizer.eos_token_id)
    return full[common:]


def _ids(rendered: Any) -> list[int]:
    return list(rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered)


def _turn_ends_with_eos(tokenizer: Any) -> bool:
    """The chat template closes an assistant turn with the EOS token (Qwen's <|im_end|>, Llama's <|eot_id|>)."""
    cached = getattr(tokenizer, "_vrl_turn_eos", None)
    if cached is None:
        cached = False
        if getattr(tokenizer, "chat_template", None) and tokenizer.eos_token_id is not None:
            ids = _ids(tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                                     tokenize=True))
            cached = tokenizer.eos_token_id in ids
        try:
            tokenizer._vrl_turn_eos = cached
        except AttributeError:
            pass
    return cached


# -- metrics -------------------------------------------------------------------------------------------
def iteration_metrics(results: Sequence[Result]) -> dict[str, float]:
    """metrics.jsonl entries of an iteration's episodes (nothing when it had none): turns per episode, tool
    calls and errors, environment-step seconds, tokens by role, and the pass rate by turn (the share of
    episodes the environment passed at or before turn k)."""
    episodes = [r.completion.episode for r in results if r.completion.episode is not None]
    if not episodes:
        return {}
    total = {k: sum(e.metrics.get(k, 0.0) for e in episodes)
             for k in ("turns", "tool_calls", "tool_errors", "step_errors", "env_step_s", "model_tokens", "env_tokens",
                       "malformed_tool_calls", "over_budget")}
    out = {"episodes/count": float(len(episodes)), "episodes/turns_mean": total["turns"] / len(episodes),
           "episodes/tool_calls": total["tool_calls"], "episodes/tool_errors": total["tool_errors"],
           "episodes/step_errors": total["step_errors"], "episodes/env_step_s": total["env_step_s"],
           "episodes/tokens_model": total["model_tokens"], "episodes/tokens_env": total["env_tokens"],
           "episodes/malformed_tool_calls": total["malformed_tool_calls"], "episodes/over_budget": total["over_budget"]}
    first_pass = []
    for e in episodes:
        passed = [i for i, t in enumerate([t for t in e.turns if t.role == "assistant"], 1) if t.passed]
        first_pass.append(passed[0] if passed else None)
    if any(t.passed is not None for e in episodes for t in e.turns):
        longest = max(int(e.metrics.get("turns", 0)) for e in episodes)
        for k in range(1, longest + 1):
            out[f"episodes/pass_rate_turn_{k}"] = sum(p is not None and p <= k for p in first_pass) / len(episodes)
    return out
