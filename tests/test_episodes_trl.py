"""GRPO with environment-token masks against TRL 1.16's own `_compute_loss` given the same `tool_mask`:
every loss type, with KL and the entropy mask, value and gradient. TRL multiplies its completion mask by
the tool mask in the loss, the KL, the entropy quantile and the token count that normalises the loss
(`num_items_in_batch`); vrl narrows the completion mask the same way (`GRPO._micro_batch`), checked here
on the micro-batch GRPO builds from episode completions, then fed to `grpo_loss`.

Skipped where trl==1.16.0 is not importable (as tests/test_grpo_trl_equality.py, whose stand-in trainer
this reuses).
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.test_grpo_trl_equality import trl_loss
from vrl.optim.grpo import GRPO, GRPOConfig
from vrl.optim.grpo_loss import grpo_loss, high_entropy_mask
from vrl.types import Completion, Result, Task, Verdict


def _episode_masks(b: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A completion mask (right padding) and a tool mask with environment spans inside each completion."""
    lengths = torch.randint(3, n + 1, (b,), generator=gen)
    mask = (torch.arange(n)[None] < lengths[:, None]).float()
    tool = torch.ones(b, n)
    for row in range(b):
        start = int(torch.randint(1, int(lengths[row]) - 1, (), generator=gen))
        tool[row, start : start + int(torch.randint(1, 3, (), generator=gen))] = 0.0  # the environment's tokens
    return mask, tool


def test_grpo_builds_the_masks_trl_builds_from_episode_completions() -> None:
    """GRPO's micro-batch mask is TRL's `completion_mask * tool_mask` for episode completions, also with
    mask_truncated_completions (TRL masks a truncated completion's tool mask too)."""
    gen = torch.Generator().manual_seed(0)
    mask, tool = _episode_masks(4, 7, gen)
    comps, results = [], []
    for row in range(4):
        n = int(mask[row].sum())
        c = Completion(task_id="t", text="", prompt_token_ids=[1, 2], token_ids=list(range(3, 3 + n)),
                       token_mask=[int(x) for x in tool[row, :n]], finish_reason="length" if row == 1 else "stop")
        comps.append(c)
        results.append(Result(task=Task(id="t", prompt="p"), completion=c, verdict=Verdict.ok(), reward=1.0))
    grpo = GRPO(GRPOConfig(mask_truncated_completions=True))
    grpo.pad_id, grpo.device = 0, torch.device("cpu")  # what `setup` sets; no model needed to build a batch
    b = grpo._micro_batch(results, [0, 1, 2, 3], torch.zeros(4), [c.finish_reason == "length" for c in comps])
    expected = mask * tool
    expected[1] = 0.0
    assert torch.equal(b.mask, expected[:, : b.mask.shape[1]])
    assert b.mask.shape[1] == int(mask.sum(1).max())


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"])
def test_loss_and_gradient_with_environment_masks_equal_trl(loss: str) -> None:
    gen = torch.Generator().manual_seed(1)
    b, n, max_len = 6, 10, 12
    for level, beta, q in [("token", 0.0, 1.0), ("token", 0.04, 0.3), ("sequence", 0.04, 1.0)]:
        if loss == "vespo" and level == "sequence":
            continue  # TRL refuses it
        mask, tool = _episode_masks(b, n, gen)
        base = -torch.rand(b, n, generator=gen) * 3
        old = base + 0.3 * torch.randn(b, n, generator=gen)
        ref = base + 0.3 * torch.randn(b, n, generator=gen)
        adv, entropies = torch.randn(b, generator=gen), torch.rand(b, n, generator=gen) * 4
        o = {"q": q, "level": level, "beta": beta, "loss": loss, "eps_high": None, "L": max_len, "bc": False,
             "delta": None}
        theirs_lp = base.clone().requires_grad_(True)
        import tests.test_grpo_trl_equality as eq

        original = eq.grpo_trainer()._compute_loss

        def with_tool_mask(self, model, inputs, tool=tool, mask=mask, original=original):
            # TRL's inputs carry the tool mask; its token count is of both masks
            inputs = {**inputs, "tool_mask": tool, "num_items_in_batch": (mask * tool).sum()}
            return original(self, model, inputs)

        eq.grpo_trainer()._compute_loss = with_tool_mask
        try:
            theirs = trl_loss(theirs_lp, old, ref, adv, mask, entropies, None, o)
        finally:
            eq.grpo_trainer()._compute_loss = original
        theirs.backward()
        narrowed = mask * tool  # what GRPO._micro_batch hands the loss
        ours_lp = base.clone().requires_grad_(True)
        ours, _ = grpo_loss(ours_lp, old, adv, narrowed, loss_type=loss, epsilon=0.2, beta=beta, ref_logps=ref,
                            max_completion_length=max_len, importance_sampling_level=level,
                            num_tokens=float(narrowed.sum()),
                            entropy_mask=high_entropy_mask(entropies, narrowed, q) if q < 1 else None)
        ours.backward()
        assert torch.allclose(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-7), (level, beta, q)
        assert torch.allclose(ours_lp.grad, theirs_lp.grad, rtol=1e-5, atol=1e-7), (level, beta, q)
        assert float(theirs_lp.grad[tool == 0].abs().max()) == 0.0  # no gradient through environment tokens


# -- whole episodes against TRL 1.16's own tool loop ------------------------------------------------------------
# TRL's `_tool_call_loop` runs on a stand-in trainer with the real Qwen3 tokenizer (npm, as tests/test_tools.py) and a
# scripted model: each turn's ids are what the script says for the conversation so far. vrl's `Episodes` runs the
# same script. Everything after the model is each side's own: call parsing, the order the calls run in on the
# instance, the texts the model reads back, the suffix ids, the masks, the episode budget (TRL's
# max_completion_length: turns cut, tool results over budget dropped), and the messages reward functions read.


class Ledger:
    """A TRL environment class whose tool is stateful: a call reads the state, waits, then writes it back."""

    def reset(self, **row):
        self.seen = []

    def record(self, n: int) -> str:
        """Record a number.

        Args:
            n: The number.
        """
        seen = list(self.seen)
        __import__("time").sleep(0.02)  # two calls at once would both read the old state
        self.seen = seen + [n]
        return {"recorded": n, "count": len(self.seen)}

    def fail(self, why: str) -> str:
        """Fail.

        Args:
            why: The reason.
        """
        raise RuntimeError(why)


SCRIPT = [  # the model's turns, the same for every episode (a turn that calls no tool ends it)
    '<think>\nI will record two.\n</think>\n\nRecording.\n<tool_call>\n{"name": "record", "arguments": {"n": 1}}\n'
    '</tool_call>\n<tool_call>\n{"name": "record", "arguments": {"n": "2"}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "fail", "arguments": '
    '{"why": "it\'s broken"}}\n</tool_call>\n<tool_call>\n{"name": "record", "arguments": {"m": 3}}\n</tool_call>'
    '<|im_end|>',
    '<tool_call>\n{"name": "record", "arguments": [4]}\n</tool_call><|im_end|>',
    'Now a broken one: <tool_call>\n{"name": "record", "arguments": {"n": 5}\n</tool_call><|im_end|>',  # ends it
]


def _scripted(tok):
    turns = [tok(t, add_special_tokens=False)["input_ids"] for t in SCRIPT]

    def next_turn(ids: list[int]) -> list[int]:
        return list(turns[tok.decode(ids).count("<|im_start|>assistant") - 1])

    return next_turn


def _trl_episode(tok, budget: int):
    """TRL 1.16's ids, tool mask, completion messages and Ledger state for one episode of SCRIPT."""
    import trl.chat_template_utils as U
    from trl.chat_template_utils import parse_response

    from tests.test_grpo_trl_equality import grpo_trainer

    Trainer = grpo_trainer()
    tok.response_template = U.qwen3_template  # what add_response_schema sets for Qwen3's template
    env = Ledger()
    env.reset()
    tools = [env.fail, env.record]  # the class's public methods by name, as TRL lists them
    prompt = [{"role": "user", "content": "Record."}]
    template = U.qwen3_training_chat_template  # TRL's prefix-preserving Qwen3 template, which it trains with
    prompt_ids = tok.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, chat_template=template)
    next_turn = _scripted(tok)
    first = next_turn(prompt_ids)[:budget]  # TRL's first generation is capped at max_completion_length
    fake = types.SimpleNamespace(
        _sync_tool_dicts=[{"record": env.record, "fail": env.fail}], _async_tool_dicts=[{}],
        max_tool_calling_iterations=10, max_completion_length=budget, use_vllm=False, _is_vlm=False,
        model=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=10**6)), tools=tools,
        environment_factories=None, _tokenizer=tok, processing_class=tok, chat_template=template, chat_template_kwargs={},
        _generate_single_turn=lambda seqs, *a, **k: ([next_turn(s) for s in seqs], None))
    fake._get_tool_suffix_ids = types.MethodType(Trainer._get_tool_suffix_ids, fake)
    completions = [[parse_response(tok, first, prefix=prompt_ids, tools=tools)]]
    mask, completions, ids, _, calls, failures, _ = Trainer._tool_call_loop(
        fake, [list(prompt)], [prompt_ids], [first], completions, None, None, {})
    del tok.response_template
    return prompt_ids, ids[0], mask[0], completions[0], env.seen, (calls, failures)


@pytest.fixture(scope="module")
def qwen3():
    """The real Qwen3 tokenizer (npm, cached; tests/test_tools.py), loaded once for this module's episodes."""
    from tests.test_tools import _tokenizer

    return _tokenizer("qwen3")


def test_episodes_equal_trls_tool_loop_ids_masks_messages_and_state_within_the_budget(tmp_path, qwen3) -> None:
    """For budgets from one that cuts the first turn to none at all: vrl's trajectory (ids and mask), the parsed
    completion its reward functions read, and the instance's state equal TRL's; no episode passes its budget."""
    import json

    from vrl.envs.dataset import DatasetEnvironment
    from vrl.episodes import Episodes, Row, Sampled, environment_of
    from vrl.reward_functions import batch_arguments
    from vrl.types import Attempt

    tok = qwen3
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "Record."}]}) + "\n")
    next_turn = _scripted(tok)

    def generate(seqs, seeds, members):
        out = []
        for seq in seqs:
            ids = next_turn(seq)
            out.append(Sampled(ids=ids, text=tok.decode(ids, skip_special_tokens=True), raw=tok.decode(ids),
                               finish_reason="stop"))
        return out

    full = None
    for budget in (10, 40, 75, 90, 120, 160, 200, 260, 100_000):
        env = DatasetEnvironment(data=str(data), environment_factory=Ledger, max_completion_length=budget, max_turns=20,
                                 reward=[lambda completions, **kw: [0.0] * len(completions)])
        [task] = env.tasks()
        [c] = Episodes(env).run([Row(task=task, seed=0)], tok, generate)
        prompt_ids, ids, mask, messages, seen, (calls, failures) = _trl_episode(tok, budget)
        assert c.prompt_token_ids == prompt_ids
        assert (c.token_ids, c.token_mask) == (ids, mask), budget
        assert len(c.token_ids) <= budget  # the model's and the environment's tokens together
        assert environment_of(c).seen == seen, budget  # the calls ran in order on the episode's one instance
        assert c.episode.metrics.get("tool_calls", 0) == calls and c.episode.metrics.get("tool_errors", 0) == failures
        kwargs = batch_arguments([Attempt(task=task, completion=c)], env.rewards.tools)
        assert kwargs["completions"] == [messages], budget  # TRL's parsed messages, tool messages between
        assert kwargs["environments"] == [environment_of(c)]
        full = (c, seen) if budget == 100_000 else full
    c, seen = full
    assert seen == [1, 2] and c.episode.metrics["malformed_tool_calls"] == 1  # the last turn's call is not run
    tool_texts = [t.content for t in c.episode.turns if t.role == "tool"]
    assert tool_texts[:5] == ["{'recorded': 1, 'count': 1}", "{'recorded': 2, 'count': 2}",
                          "{'error': 'Tool nope not found.'}", '{\'error\': "it\'s broken"}',
                          "{'error': \"Ledger.record() got an unexpected keyword argument 'm'\"}"]
    assert tool_texts[5].endswith("Ledger.record() argument after ** must be a mapping, not list'}")


# TRL 1.16's docs' environment shapes, run through vrl's episodes with a scripted model (the calls are written, so every
# tool runs): what reward functions receive is what TRL passes them.
TRL_DOCS_ENVS = '''
import asyncio
import functools
import random
from typing import Literal, Optional


class CodingEnv:
    def reset(self, **kwargs) -> str:
        self.n = random.randint(1, 20)
        return f"Compute the {self.n}th Fibonacci number."

    def run_code(self, code: str) -> str:
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        return "ran"


class GameEnv:
    def __init__(self, size: int = 3):
        self.size = size

    def reset(self, **kwargs) -> str | None:
        self.position, self.reward = 0, 0.0
        return f"Reach the goal tile of a {self.size}x{self.size} grid."

    async def move(self, action: Literal["up", "down"], times: Optional[int] = None) -> dict:
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down".
            times: How many moves (one if not given).
        """
        await asyncio.sleep(0)
        self.position += times or 1
        self.reward = float(self.position == self.size)
        return {"position": self.position}

    def look(self) -> str:
        """Look around.

        Returns:
            What is in sight.
        """
        return f"{self.size - self.position} tiles to go"

    async def get_reward(self) -> float:
        return self.reward


big_game = functools.partial(GameEnv, size=4)


def reward_func(environments, **kwargs):
    return [float(env.n % 2) if isinstance(env, CodingEnv) else env.reward for env in environments]
'''


def test_trl_docs_environments_run_unchanged_and_rewards_get_what_trl_passes(tmp_path, qwen3) -> None:
    """TRL 1.16's docs' shapes: a dict environment_factory over rows with only an `environment` column (env-owned
    prompts), a factory that is a functools.partial, async tool methods with Literal/Optional arguments (a string
    number typed by the schema), a tool without arguments, an async get_reward, and `reward_func(environments,
    **kwargs)` branching on the instance's class. Reward functions get `prompts` with reset's text (TRL's), each
    episode's own instance, and TRL's parsed completions; a routed row is offered its own environment's tools."""
    import asyncio
    import json

    from vrl.envs.dataset import DatasetEnvironment
    from vrl.episodes import Episodes, Row, Sampled
    from vrl.reward_functions import load_reward_function
    from vrl.types import Attempt

    module = tmp_path / "docs_envs.py"
    module.write_text(TRL_DOCS_ENVS)
    ns = load_reward_function(f"{module}:reward_func").__globals__
    data = tmp_path / "routes.jsonl"
    data.write_text("".join(json.dumps({"environment": e}) + "\n" for e in ("coding", "game")))
    tok = qwen3
    script = ['<tool_call>\n{"name": "move", "arguments": {"action": "up", "times": "3"}}\n</tool_call>'
              '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'
              '<tool_call>\n{"name": "move", "arguments": {"action": "down"}}\n</tool_call><|im_end|>', "Done.<|im_end|>"]

    def generate(seqs, seeds, members):
        turns = [tok(script[min(tok.decode(s).count("<|im_start|>assistant") - 1, 1)], add_special_tokens=False)["input_ids"]
                 for s in seqs]
        return [Sampled(ids=t, text=tok.decode(t, skip_special_tokens=True), raw=tok.decode(t), finish_reason="stop")
                for t in turns]

    seen = {}

    def spy(prompts, completions, environments, environment, **kwargs):
        seen.update(prompts=prompts, completions=completions, environments=environments, environment=environment)
        return [0.0] * len(prompts)

    for game in ("GameEnv", "big_game"):
        env = DatasetEnvironment(data=str(data), environment_factory={"coding": ns["CodingEnv"], "game": ns[game]},
                                 reward=[f"{module}:reward_func", spy])
        tasks = env.tasks()
        assert [[t["function"]["name"] for t in env.interaction(task).tools] for task in tasks] == [["run_code"],
                                                                                                  ["look", "move"]]
        completions = Episodes(env).run([Row(task=t, seed=i) for i, t in enumerate(tasks)], tok, generate)
        verdicts = asyncio.run(env.verifier().verify([Attempt(task=t, completion=c) for t, c in zip(tasks, completions)]))
        coding, game_env = seen["environments"]
        size = 4 if game == "big_game" else 3
        assert isinstance(coding, ns["CodingEnv"]) and game_env.size == size and seen["environment"] == ["coding", "game"]
        assert seen["prompts"] == [[{"role": "user", "content": f"Compute the {coding.n}th Fibonacci number."}],
                                   [{"role": "user", "content": f"Reach the goal tile of a {size}x{size} grid."}]]
        assert [m.get("content") for m in seen["completions"][1]] == [
            "", "{'position': 3}", f"{size - 3} tiles to go", "{'position': 4}", "Done."]
        assert seen["completions"][1][0]["tool_calls"][0]["function"]["arguments"] == {"action": "up", "times": 3}
        assert seen["completions"][0][1] == {"role": "tool", "name": "move", "content": "{'error': 'Tool move not found.'}"}
        rewards = [float(v.detail.split("reward_func=")[1].split(",")[0]) for v in verdicts]
        assert rewards == [float(coding.n % 2), float(size == 4)]  # the instance's own state, as reward_func reads it
        assert [c.episode.reward for c in completions] == [None, float(size == 4)]  # async get_reward: GameEnv's rows


def test_an_environment_class_whose_reset_cannot_take_the_row_or_raises_is_named_in_one_line(tmp_path) -> None:
    """TRL calls reset(**row): a class whose reset cannot take the row's columns (TRL would raise at the first
    rollout) is refused when the tasks load, before any model loads, naming the class, the row and the fix, with
    data and without; a reset that raises stops the run in one line naming the class and the task."""
    import json

    from vrl.envs.dataset import DatasetEnvironment
    from vrl.errors import OptionsError, PluginError

    class NoKwargs:
        def reset(self) -> str:
            return "Go."

    class Named:
        def reset(self, target, **kwargs) -> None:  # TRL's docs' shape: a named column
            self.target = target

    class Broken:
        def reset(self, **kwargs) -> str:
            raise RuntimeError("the simulator is down")

    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "Go.", "target": 1}) + "\n" + json.dumps({"prompt": "Go."}) + "\n")
    with pytest.raises(OptionsError, match=r"^environment 'dataset': NoKwargs.reset cannot take the row of task 'train-0' "
                       r"\(training without data; its columns: prompt\): .*unexpected keyword argument 'prompt'; TRL "
                       r"calls reset\(\*\*row\), so give it \*\*kwargs"):
        DatasetEnvironment(environment_factory=NoKwargs, reward=[zero]).tasks()
    with pytest.raises(OptionsError, match=r"Named.reset cannot take the row of task 'train-1' \(.*rows.jsonl; its "
                       r"columns: prompt\): missing a required argument: 'target'"):
        DatasetEnvironment(data=str(data), environment_factory=Named, reward=[zero]).tasks()
    data.write_text(json.dumps({"prompt": "Go.", "target": 1}) + "\n")
    env = DatasetEnvironment(data=str(data), environment_factory=Named, reward=[zero])
    [task] = env.tasks()
    env.interaction(task).prompt(task)  # accepted: the row has its target
    env = DatasetEnvironment(data=str(data), environment_factory=Broken, reward=[zero])
    [task] = env.tasks()
    with pytest.raises(PluginError, match=r"^environment class Broken: reset\(\) raised RuntimeError: the simulator is "
                       r"down .* on task 'train-0'$"):
        env.interaction(task).prompt(task)
