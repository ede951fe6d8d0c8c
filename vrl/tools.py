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
timeout; a turn's calls run one after another, in order, on the episode's own tools and instance (as
TRL runs them; episodes run concurrently). Arguments are typed by the tool's schema as transformers'
`parse_response` types them (`"7"` becomes 7 for an integer parameter). A tool never takes the run down.

What the model reads back follows TRL 1.16 by default (`feedback="trl"`): a result is `str(result)`, an
error `str({"error": str(exc)})` (`{'error': 'Tool nope not found.'}` for an unknown tool), and a turn with a
malformed call (not JSON, no name, not closed) is a turn without calls, which ends the episode.
`feedback="detailed"` answers a malformed call with an error message instead and goes on, writes results as
JSON and errors as explained sentences (`error: no tool named 'nope'; the tools are ...`).

`parse_message` turns a model turn into the message TRL's reward functions read (`reasoning_content` from
`<think>`, structured `tool_calls`, the rest as `content`).

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
from types import MethodType
from typing import Any, Literal

from vrl.episodes import Interaction, ModelTurn, Reply
from vrl.errors import PluginError, describe
from vrl.types import Prompt, Task

#: Wall-clock cap of one tool call, unless a `ToolInteraction` is given another.
TOOL_TIMEOUT_S = 10.0

#: What the model reads back from its calls: TRL 1.16's texts and malformed-call handling, or vrl's explained ones.
Feedback = Literal["trl", "detailed"]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.DOTALL)
_HERMES_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
_THINK = re.compile(r"<think>(.*?)(?:</think>\s*|$)", re.DOTALL)
_DEEPSEEK = re.compile(r"<｜tool▁call▁begin｜>\s*(?:function)?\s*<｜tool▁sep｜>\s*([^\n`]+?)\s*\n?```(?:json)?\s*(.*?)\s*```",
                       re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    """A call the model wrote: the tool's name and arguments, or why it could not be read."""

    name: str
    arguments: Any = None  # as written: an object, or what the model wrote instead (the call then fails, as in TRL)
    error: str | None = None  # the call is malformed (not JSON, no name, not closed)


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
        return [_from_json(b) if close else ToolCall(name=_guess_name(b), error="the tool call is not closed with "
                                                     "</tool_call>") for b, close in blocks]
    found = _DEEPSEEK.findall(text)
    if found:
        return [_from_json(args, name=name.strip()) for name, args in found]
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
    args = data.get("arguments", data.get("parameters"))
    return ToolCall(name=data["name"], arguments={} if args is None else args)  # no arguments: {} (as TRL)


def _guess_name(text: str) -> str:
    m = re.search(r'"name"\s*:\s*"([^"]*)"', text)
    return m.group(1) if m else "?"


# -- arguments typed by the tool's schema ----------------------------------------------------------------
def _types(prop: Any) -> list[str]:
    """The JSON types a parameter's schema allows (its `type`, a list of them, anyOf/oneOf, `nullable`)."""
    if not isinstance(prop, dict):
        return []
    declared = prop.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared or [] if isinstance(t, str)]
    for key in ("anyOf", "oneOf"):
        for choice in prop.get(key) or []:
            types += _types(choice)
    if prop.get("nullable") and "null" not in types:
        types.append("null")
    return types


def _typed(raw: str, types: list[str]) -> Any:
    """A string argument as the first of `types` it reads as; the string itself when none fits."""
    for kind in types:
        text = raw.strip()
        try:
            if kind == "integer":
                number = float(text)
                if number.is_integer():
                    return int(text) if text.lstrip("+-").isdigit() else int(number)
            elif kind == "number":
                number = float(text)
                if number == number and abs(number) != float("inf"):
                    return int(number) if number.is_integer() and "." not in text else number
            elif kind == "boolean" and text.lower() in ("true", "1", "false", "0"):
                return text.lower() in ("true", "1")
            elif kind == "null" and text in ("null", "None"):
                return None
            elif kind in ("object", "array"):
                value = json.loads(text)
                if isinstance(value, dict if kind == "object" else list):
                    return value
        except ValueError:
            continue
    return raw


def typed_arguments(arguments: Any, tool_schema: dict[str, Any] | None) -> Any:
    """`arguments` with each string value for a parameter whose schema does not allow strings read as its type
    (`"7"` → 7 for an integer), as transformers' `parse_response(tools=...)` types the calls TRL runs."""
    if not isinstance(arguments, dict) or not tool_schema:
        return arguments
    properties = tool_schema.get("function", tool_schema).get("parameters", {}).get("properties", {})
    out = dict(arguments)
    for key, value in arguments.items():
        types = _types(properties.get(key))
        if isinstance(value, str) and types and "string" not in types:
            out[key] = _typed(value, types)
    return out


# -- the message reward functions read ----------------------------------------------------------------------
def parse_message(text: str, schemas: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A model turn (decoded text) as the assistant message TRL 1.16 gives reward functions when tools are in
    play (`parse_response`): the `<think>` part as `reasoning_content` (when not empty), the calls as structured
    `tool_calls` (`{"type": "function", "function": {"name", "arguments"}}`, arguments typed by `schemas`), the
    rest, stripped, as `content`. A turn with a malformed call is its text as `content`, nothing parsed."""
    calls = parse_tool_calls(text)
    if any(c.error is not None for c in calls):
        return {"role": "assistant", "content": text}
    message: dict[str, Any] = {"role": "assistant"}
    rest = text
    think = _THINK.search(rest)
    if think is not None:
        if think.group(1).strip():
            message["reasoning_content"] = think.group(1).strip()
        rest = rest[think.end():]
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {
            "name": c.name, "arguments": typed_arguments(c.arguments, (schemas or {}).get(c.name))}} for c in calls]
        if _HERMES.search(rest):  # the text around the calls: the last part that is not blank (as TRL's parser)
            parts = [p.strip() for p in _HERMES_BLOCK.split(rest)]
            rest = next((p for p in reversed(parts) if p), "")
        else:  # Llama 3.1 / DeepSeek: the turn is the calls
            rest = ""
    message["content"] = rest.strip()
    return message


# -- running a call -----------------------------------------------------------------------------------------
def _trl_error(text: str) -> str:
    return str({"error": text})


async def execute(call: ToolCall, tools: dict[str, Callable[..., Any]], timeout_s: float,
                  feedback: Feedback = "trl") -> tuple[str, bool]:
    """The call's result as the tool message's text, and whether it failed. Never raises: an unknown tool,
    malformed or wrong arguments, an exception and a timeout each become an error text (TRL's, or vrl's
    explained one with `feedback="detailed"`)."""
    detailed = feedback == "detailed"
    if call.error is not None:
        return (f"error: {call.error}" if detailed else _trl_error(call.error)), True
    fn = tools.get(call.name)
    if fn is None:
        if detailed:
            return f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(tools)) or 'none'}", True
        return _trl_error(f"Tool {call.name} not found."), True
    arguments = call.arguments
    if detailed:
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return f"error: the arguments of {call.name!r} are not a JSON object", True
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as exc:
            return f"error: bad arguments for {call.name!r}: {exc}", True
    try:
        if inspect.iscoroutinefunction(fn):
            result = await asyncio.wait_for(_call_async(fn, arguments), timeout_s)
        else:
            result = await asyncio.wait_for(_in_thread(fn, arguments), timeout_s)
    except asyncio.TimeoutError:
        if detailed:
            return f"error: {call.name!r} timed out after {timeout_s:g} s", True
        return _trl_error(f"Tool {call.name} timed out after {timeout_s:g} s."), True
    except Exception as exc:  # the tool's own failure is the model's to read, not the run's to die of
        return (f"error: {call.name!r} raised {type(exc).__name__}: {exc}" if detailed else _trl_error(str(exc))), True
    if detailed:
        return result if isinstance(result, str) else json.dumps(result, default=str), False
    return str(result), False


async def _call_async(fn: Callable[..., Any], arguments: Any) -> Any:
    return await fn(**arguments)  # `**` of a non-object raises TypeError here, as in TRL's call


def _in_thread(fn: Callable[..., Any], kwargs: Any) -> asyncio.Future[Any]:
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


# -- environment classes ------------------------------------------------------------------------------------
def environment_tools(instance: Any) -> list[Callable[..., Any]]:
    """A TRL environment instance's tools: its public methods other than `reset` and `get_reward` (as TRL).
    Given the class, its methods bound to the class (for their schemas, without building an instance)."""
    cls = instance if isinstance(instance, type) else type(instance)
    names = [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
             if name not in ("reset", "get_reward") and not name.startswith("_")]
    if isinstance(instance, type):
        return [MethodType(getattr(cls, name), cls) for name in names]
    return [getattr(instance, name) for name in names]


def tool_schemas(tools: Sequence[Callable[..., Any]] = (), factory: Any = None) -> dict[str, dict[str, Any]]:
    """The schemas of `tools` and of an environment class's methods, by tool name."""
    funcs = list(tools) + (environment_tools(factory) if isinstance(factory, type) else [])
    return {f.__name__: schema(f) for f in funcs}


class ToolInteraction(Interaction):
    """An episode with tools: each model turn's tool calls run, in order, and their results come back as tool
    messages; a turn that calls no tool ends the episode (as in TRL)."""

    def __init__(self, tools: Sequence[Callable[..., Any]] = (), environment: Any = None, max_turns: int = 4,
                 timeout_s: float = TOOL_TIMEOUT_S, row: dict[str, Any] | None = None, feedback: Feedback = "trl",
                 max_tokens: int | None = None, step_timeout_s: float | None = None):
        if feedback not in ("trl", "detailed"):
            raise ValueError(f"feedback must be 'trl' or 'detailed', got {feedback!r}")
        self.environment = environment
        funcs = list(tools) + (environment_tools(environment) if environment is not None else [])
        names = [f.__name__ for f in funcs]
        if len(set(names)) != len(names):
            raise ValueError(f"two tools share a name: {sorted(n for n in names if names.count(n) > 1)}")
        self.functions = dict(zip(names, funcs))
        self.schemas = {n: schema(f) for n, f in zip(names, funcs)}
        self.tools = list(self.schemas.values()) or None
        self.max_turns, self.timeout_s, self.row, self.feedback = max_turns, timeout_s, row, feedback
        self.max_tokens, self.step_timeout_s = max_tokens, step_timeout_s

    def prompt(self, task: Task) -> Prompt:
        """The task's prompt; with an environment, `reset(**row)` first, its text appended to the last message. A
        reset that raises stops the run (as in TRL) in one line naming the class (`PluginError`)."""
        prompt = task.prompt
        if self.environment is None:
            return prompt
        try:
            observation = self.environment.reset(**(self.row if self.row is not None else {"prompt": prompt, **task.data}))
        except Exception as exc:
            raise PluginError(f"environment class {type(self.environment).__name__}: reset() raised {describe(exc)} "
                              f"on task {task.id!r}") from exc
        if not observation:
            return prompt
        if isinstance(prompt, str):
            return prompt + str(observation)
        return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + str(observation)}]

    async def reply(self, turn: ModelTurn) -> Reply:
        if turn.last:  # no turn would read the results (TRL's last tool-calling iteration)
            return Reply(done=True)
        if turn.finish_reason == "length" and self.feedback == "detailed":  # a cut-off call is not run
            return Reply(done=True)
        calls = parse_tool_calls(turn.raw)
        if not calls:
            return Reply(done=True)
        malformed = sum(c.error is not None for c in calls)
        if malformed and self.feedback == "trl":  # TRL parses such a turn as text: no calls, the episode ends
            return Reply(done=True, metrics={"malformed_tool_calls": float(malformed)})
        messages, failures = [], 0
        for call in calls:  # one after another on this episode's instance, as TRL runs a turn's calls
            if call.error is None:
                call.arguments = typed_arguments(call.arguments, self.schemas.get(call.name))
            text, failed = await execute(call, self.functions, self.timeout_s, self.feedback)
            messages.append({"role": "tool", "name": call.name, "content": text})
            failures += failed
        metrics = {"tool_calls": float(len(calls)), "tool_errors": float(failures)}
        if malformed:  # (feedback="detailed": answered with their errors)
            metrics["malformed_tool_calls"] = float(malformed)
        return Reply(messages=messages, metrics=metrics)

    def reward(self) -> Any:
        get = getattr(self.environment, "get_reward", None)
        return get() if callable(get) else None
