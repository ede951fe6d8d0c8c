"""The countdown environment: seeded problems and a verifier that cannot be talked into a pass."""

import asyncio

import pytest

from vrl.envs.countdown import CountdownEnvironment, CountdownVerifier, evaluate, make_task
from vrl.types import Attempt, Completion, Status

TASK = make_task("t", [44, 19, 35], 98)


def judge(text, task=TASK):
    return CountdownVerifier().check(Attempt(task=task, completion=Completion(task_id=task.id, text=text)))


def test_tasks_are_seeded_and_solvable():
    env = CountdownEnvironment(size=50)
    a, b = env.tasks("train"), CountdownEnvironment(size=50).tasks("train")
    assert a == b
    assert a != env.tasks("test")
    assert a != CountdownEnvironment(size=50, seed=1).tasks("train")
    assert "<answer>" in a[0].prompt and str(a[0].data["target"]) in a[0].prompt
    for task in a:  # the recorded construction is itself a passing answer
        assert judge(f"<answer>{task.data['solution']}</answer>", task).passed, task


def test_unknown_split_is_a_clear_error():
    with pytest.raises(ValueError, match="no split 'dev'.*train, test"):
        CountdownEnvironment().tasks("dev")


def test_correct_answer_passes_and_last_answer_counts():
    v = judge("<think>44 + 19 = 63, 63 + 35 = 98</think> <answer>44 + 19 + 35</answer>")
    assert v.passed and v.status is Status.PASSED and v.score == 1.0
    assert judge("<answer>1</answer> no wait <answer>(44 + 19) + 35</answer>").passed
    assert judge("<answer>44 + 19 + 35 = 98</answer>").passed


@pytest.mark.parametrize(
    "text, status, reason",
    [
        ("<answer>44 + 44 + 10</answer>", Status.FAILED, "used more often"),
        ("<answer>44 + 19 + 35 + 0</answer>", Status.FAILED, "not among the given"),
        ("<answer>44 + 19 - 35</answer>", Status.FAILED, "= 28, not 98"),
        ("<answer>44 / (19 - 19)</answer>", Status.FAILED, "used more often"),
        ("<answer>35 / (44 - 44)</answer>", Status.FAILED, "used more often"),
        ("<answer>2 ** 99999999999</answer>", Status.REJECTED, "only + - * /"),
        ("<answer>9 ** 9 ** 9 ** 9</answer>", Status.REJECTED, "only + - * /"),
        ("<answer>__import__('os').system('echo pwned')</answer>", Status.REJECTED, "only + - * /"),
        ("<answer>(lambda: 98)()</answer>", Status.REJECTED, "only + - * /"),
        ("<answer>[98][0]</answer>", Status.REJECTED, "only + - * /"),
        ("<answer>98.0</answer>", Status.REJECTED, "only + - * /"),
        ("<answer>-44 + 19</answer>", Status.REJECTED, "only + - * /"),
        ("<answer>44 +</answer>", Status.REJECTED, "not an arithmetic expression"),
        ("<answer>44 + 19 + 35", Status.REJECTED, "no <answer>"),
        ("answer: 44 + 19 + 35", Status.REJECTED, "no <answer>"),
        ("<answer></answer>", Status.REJECTED, "not an arithmetic expression"),
        ("<answer>" + "(" * 60 + "44" + ")" * 60 + "</answer>", Status.FAILED, "not 98"),
        ("<answer>" + "1+" * 150 + "1</answer>", Status.REJECTED, "longer than"),
    ],
)
def test_tricky_answers(text, status, reason):
    v = judge(text)
    assert not v.passed and v.score == 0.0
    assert v.status is status
    assert reason in v.detail


def test_division_by_zero_is_a_failed_verdict():
    task = make_task("z", [5, 3, 3, 7], 5)
    v = judge("<answer>5 / (3 - 3)</answer>", task)
    assert v.status is Status.FAILED and v.detail == "division by zero"


def test_exact_fractions_not_floats():
    task = make_task("f", [1, 3, 3], 1)
    assert judge("<answer>1 / 3 * 3</answer>", task).passed  # 0.333..*3 is not 1 in floats
    value, used = evaluate("(1 + 2) / 3")
    assert value == 1 and used == [1, 2, 3]


def test_verify_batch_keeps_order_and_times_each():
    attempts = [
        Attempt(task=TASK, completion=Completion(task_id="t", text=t))
        for t in ["<answer>44+19+35</answer>", "nothing", "<answer>44*19</answer>"]
    ]
    verdicts = asyncio.run(CountdownVerifier().verify(attempts))
    assert [v.status for v in verdicts] == [Status.PASSED, Status.REJECTED, Status.FAILED]
    assert all(v.elapsed_s > 0 for v in verdicts)


def test_shaper_rewards_format_and_correctness():
    env = CountdownEnvironment()
    shaper = env.shaper()
    good = "<think>sum</think> <answer>44 + 19 + 35</answer>"
    c = Completion(task_id="t", text=good)
    assert shaper(TASK, c, judge(good)) == pytest.approx(1.1)
    wrong = "<think>hmm</think><answer>44 + 19</answer>"
    assert shaper(TASK, Completion(task_id="t", text=wrong), judge(wrong)) == pytest.approx(0.1)
    assert shaper(TASK, Completion(task_id="t", text="44+19+35"), judge("44+19+35")) == 0.0


def test_inline_task_form():
    task = CountdownEnvironment().task_from_data({"numbers": [3, 5, 7], "target": 22})
    assert judge("<answer>3 * 5 + 7</answer>", task).passed


def test_the_calculator_option_makes_countdown_a_tool_use_environment():
    from vrl.episodes import ModelTurn

    plain, tools = CountdownEnvironment(size=2), CountdownEnvironment(size=2, calculator=True, max_turns=3)
    task = tools.tasks()[0]
    assert not plain.multi_turn and plain.interaction(task) is None
    episode = tools.interaction(task)
    assert tools.multi_turn and episode.max_turns == 3
    assert [t["function"]["name"] for t in episode.tools] == ["calculate"]

    def answer(text: str):
        return asyncio.run(episode.reply(ModelTurn(text=text, raw=text, index=1, last=False)))

    reply = answer('<tool_call>{"name": "calculate", "arguments": {"expression": "(25 - 5) * 3 / 8"}}</tool_call>')
    assert reply.messages == [{"role": "tool", "name": "calculate", "content": "7.5"}] and not reply.done
    reply = answer('<tool_call>{"name": "calculate", "arguments": {"expression": "2 ** 8"}}</tool_call>')
    assert reply.messages[0]["content"].startswith("{'error': 'only + - * /")  # TRL 1.16's error text
    assert reply.metrics == {"tool_calls": 1.0, "tool_errors": 1.0}
    assert answer("<answer> 1 + 2 </answer>").done  # no call: the episode ends, the verifier judges the answer


def test_the_calculator_reaches_the_model_in_a_real_chat_template():
    """`-o calculator=true` with the real Qwen3 tokenizer (npm, as tests/test_tools.py fetches it): the episode's
    prompt ids are the chat template's rendering of the task as a user message with the `calculate` schema in its
    <tools> block (before, the text prompt went out as it was, with no tool anywhere)."""
    import json

    from tests.test_tools import _tokenizer
    from vrl.episodes import Episodes, Row, Sampled

    qwen3 = _tokenizer("qwen3")
    env = CountdownEnvironment(size=1, calculator=True, max_turns=2)
    task = env.tasks()[0]

    def generate(seqs, seeds, members):
        ids = qwen3("<answer>1</answer><|im_end|>", add_special_tokens=False)["input_ids"]
        return [Sampled(ids=ids, text="<answer>1</answer>", raw="<answer>1</answer><|im_end|>", finish_reason="stop")
                for _ in seqs]

    [c] = Episodes(env).run([Row(task=task, seed=0)], qwen3, generate)
    prompt = qwen3.decode(c.prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    tools = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in tools] == ["calculate"]
    assert f"<|im_start|>user\n{task.prompt}<|im_end|>" in prompt  # the task, as the user's message
    # chat_template_kwargs reach the same rendering: Qwen3's enable_thinking=False closes an empty think block.
    [c] = Episodes(env).run([Row(task=task, seed=0)], qwen3, generate, {"enable_thinking": False})
    assert qwen3.decode(c.prompt_token_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_chat_option_sends_the_task_as_a_user_message_through_the_template():
    """`-o chat=true` (instruct models such as SmolLM2-135M-Instruct, which continues the bare text with
    anything but an <answer>): the same task, as one user message, rendered by a real chat template with the
    assistant's turn opened; the verifier's data and the default (plain text) are unchanged."""
    from tests.test_tools import _tokenizer
    from vrl.generate.hf import render_prompt

    plain, chat = CountdownEnvironment(size=3), CountdownEnvironment(size=3, chat=True)
    for a, b in zip(plain.tasks(), chat.tasks(), strict=True):
        assert isinstance(a.prompt, str) and b.prompt == [{"role": "user", "content": a.prompt}]
        assert (a.id, a.data) == (b.id, b.data)
    inline = chat.task_from_data({"numbers": [3, 5, 7], "target": 22})
    assert inline.prompt[0]["role"] == "user" and judge("<answer>3 * 5 + 7</answer>", inline).passed
    qwen3 = _tokenizer("qwen3")
    text = render_prompt(qwen3, chat.tasks()[0].prompt)
    assert f"<|im_start|>user\n{plain.tasks()[0].prompt}<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert render_prompt(qwen3, plain.tasks()[0].prompt) == plain.tasks()[0].prompt  # text goes as it is
