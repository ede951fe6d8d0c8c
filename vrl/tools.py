"""Tools in TRL's shape: typed, docstring'd Python functions (sync or async) the model calls in an episode.

    def calculate(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "(3 + 4) * 2".
        '''

Each tool's JSON schema comes from its signature and docstring as transformers builds it
(`get_json_schema`) and reaches the model through its chat template (`apply_chat_template(tools=...)`).
A model turn's tool calls are parsed in the formats chat templates teach: Qwen/Hermes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Llama 3.1's bare JSON
`{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or alone), and DeepSeek-V3's
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME ```json {...}``` <｜tool▁call▁end｜>`. Each call runs with a
timeout; its result, or its error (unknown tool, bad JSON, bad arguments, an exception, a timeout), goes
back as a tool message and is counted. A tool never takes the run down.

`ToolInteraction` is the episode that does this; it also runs TRL `environment_factory` classes unchanged:
one instance per episode, `reset(**row)` (its text, if any, appended to the prompt's last message), its
public methods as tools, and `get_reward()` (sync or async), when it has one, as the episode's reward.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vrl.episodes import Interaction, ModelTurn, Reply
from vrl.types import Prompt, Task

#: Wall-clock cap of one tool call, unless a `ToolInteraction` is given another.
TOOL_TIMEOUT_S = 10.0

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_DEEPSEEK = re.compile(r"<｜tool▁call▁begin｜>\s*(?:function)?\s*<｜tool▁sep｜>\s*([^\n`]+?)\s*\n?```(?:json)?\s*(.*?)\s*```",
                       re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    """A call the model wrote: the tool's name and arguments, or why it could not be read."""

    name: str
    arguments: dict[str, Any] | None = None
    error: str | None = None  # the call is malformed (bad JSON, no name, arguments not an object)


def schema(tool: Callable[..., Any]) -> dict[str, Any]:
    """The tool's JSON schema as transformers builds it from the signature and the Google-style docstring
    (the shape chat templates render); a `ValueError` naming the tool and the fix when it cannot be built."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(tool)
    except Exception as exc:  # transformers' own errors say which argument lacks a type or a description
        name = getattr(tool, "__name__", repr(tool))
        raise ValueError(f"tool {name!r}: {exc} (a tool needs type hints and a docstring with an Args: section, "
                         "as in TRL)") from None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of a model turn (raw text, special tokens kept), in order; [] when it makes none."""
    blocks = _HERMES.findall(text)
    if blocks:
        return [_from_json(b) for b in blocks]
    found = _DEEPSEEK.findall(text)
    if found:
        calls = []
        for name, args in found:
            call = _from_json(args, name=name.strip())
            calls.append(call)
        return calls
    body = text.split(_PYTHON_TAG, 1)[1] if _PYTHON_TAG in text else text
    body = body.replace("<|eom_id|>", "").replace("<|eot_id|>", "").strip()
    if body.startswith("{") and '"name"' in body:  # Llama 3.1: the turn is the call (several joined by ';')
        return [_from_json(part) for part in _split_json_objects(body)]
    return []


def _split_json_objects(text: str) -> list[str]:
    """`{...}; {...}` → its objects' texts (brace depth outside strings); an unclosed one is kept whole."""
    parts, depth, start, quoted, escaped = [], 0, None, False, False
    for i, ch in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                parts.append(text[start : i + 1])
                start = None
    if start is not None:
        parts.append(text[start:])
    return parts or [text]


def _from_json(text: str, name: str | None = None) -> ToolCall:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return ToolCall(name=name or _guess_name(text), error=f"the tool call is not valid JSON ({exc.msg} at "
                        f"character {exc.pos}); write {{\"name\": ..., \"arguments\": {{...}}}}")
    if name is not None:  # DeepSeek: the JSON is the arguments
        data = {"name": name, "arguments": data}
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall(name=name or "?", error="the tool call names no tool; write {\"name\": ..., \"arguments\": {...}}")
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(name=data["name"], error=f"the arguments of {data['name']!r} are not a JSON object")
    return ToolCall(name=data["name"], arguments=args)


def _guess_name(text: str) -> str:
    m = re.search(r'"name"\s*:\s*"([^"]*)"', text)
    return m.group(1) if m else "?"


async def execute(call: ToolCall, tools: dict[str, Callable[..., Any]], timeout_s: float) -> tuple[str, bool]:
    """The call's result as the tool message's text, and whether it failed. Never raises: an unknown tool,
    malformed or wrong arguments, an exception and a timeout each become an error text."""
    if call.error is not None:
        return f"error: {call.error}", True
    fn = tools.get(call.name)
    if fn is None:
        return f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(tools)) or 'none'}", True
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as exc:
        return f"error: bad arguments for {call.name!r}: {exc}", True
    try:
        if inspect.iscoroutinefunction(fn):
            result = await asyncio.wait_for(fn(**call.arguments), timeout_s)
        else:
            result = await asyncio.wait_for(_in_thread(fn, call.arguments), timeout_s)
    except asyncio.TimeoutError:
        return f"error: {call.name!r} timed out after {timeout_s:g} s", True
    except Exception as exc:  # the tool's own failure is the model's to read, not the run's to die of
        return f"error: {call.name!r} raised {type(exc).__name__}: {exc}", True
    return result if isinstance(result, str) else json.dumps(result, default=str), False


def _in_thread(fn: Callable[..., Any], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
    """Run a sync tool in a daemon thread: one that hangs past its timeout is abandoned (it cannot be
    killed), and being a daemon it does not hold the process at exit, as an executor's thread would."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            value, error = fn(**kwargs), None
        except BaseException as exc:  # handed to the waiting coroutine
            value, error = None, exc
        try:
            loop.call_soon_threadsafe(_settle, future, value, error)
        except RuntimeError:  # the loop closed while the tool overran its timeout: nobody waits any more
            pass

    threading.Thread(target=run, name=f"vrl-tool-{getattr(fn, '__name__', 'tool')}", daemon=True).start()
    return future


def _settle(future: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if future.done():  # timed out and cancelled meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


def environment_tools(instance: Any) -> list[Callable[..., Any]]:
    """A TRL environment instance's tools: its public methods other than `reset` and `get_reward` (as TRL)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class ToolInteraction(Interaction):
    """An episode with tools: each model turn's tool calls run and their results come back as tool messages;
    a turn that calls no tool ends the episode (as in TRL)."""

    def __init__(self, tools: Sequence[Callable[..., Any]] = (), environment: Any = None, max_turns: int = 4,
                 timeout_s: float = TOOL_TIMEOUT_S, row: dict[str, Any] | None = None):
        self.environment = environment
        funcs = list(tools) + (environment_tools(environment) if environment is not None else [])
        names = [f.__name__ for f in funcs]
        if len(set(names)) != len(names):
            raise ValueError(f"two tools share a name: {sorted(n for n in names if names.count(n) > 1)}")
        self.functions = dict(zip(names, funcs))
        self.tools = [schema(f) for f in funcs] or None
        self.max_turns, self.timeout_s, self.row = max_turns, timeout_s, row

    def prompt(self, task: Task) -> Prompt:
        """The task's prompt; with an environment, `reset(**row)` first, its text appended to the last message."""
        prompt = task.prompt
        if self.environment is None:
            return prompt
        observation = self.environment.reset(**(self.row if self.row is not None else {"prompt": prompt, **task.data}))
        if not observation:
            return prompt
        if isinstance(prompt, str):
            return prompt + str(observation)
        return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + str(observation)}]

    async def reply(self, turn: ModelTurn) -> Reply:
        if turn.finish_reason == "length" or turn.last:  # a cut-off call is not run, nor one no turn would read
            return Reply(done=True)
        calls = parse_tool_calls(turn.raw)
        if not calls:
            return Reply(done=True)
        results = await asyncio.gather(*(execute(c, self.functions, self.timeout_s) for c in calls))
        messages = [{"role": "tool", "name": c.name, "content": text} for c, (text, _) in zip(calls, results)]
        return Reply(messages=messages, metrics={"tool_calls": float(len(calls)),
                                                 "tool_errors": float(sum(failed for _, failed in results))})

    def reward(self) -> Any:
        get = getattr(self.environment, "get_reward", None)
        return get() if callable(get) else None
