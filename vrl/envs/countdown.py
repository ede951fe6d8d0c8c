"""Countdown: reach a target number with + - * / over given numbers (the ES-at-scale benchmark).

Problems are generated from a seed, so every split is reproducible and needs no download. The
answer inside <answer>...</answer> is parsed with `ast` and evaluated exactly over fractions by a
whitelist walker: no `eval`, no names, no calls, no powers, bounded size. Each given number may be
used at most once.
"""

from __future__ import annotations

import ast
import random
import re
from fractions import Fraction
from typing import Any

from pydantic import Field, model_validator

from vrl.environment import Environment, EnvOptions
from vrl.episodes import Interaction
from vrl.reward import Binary, FormatBonus, RewardShaper
from vrl.types import Attempt, Status, Task, Verdict
from vrl.verifier import SimpleVerifier, Verifier

PROMPT = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> "
    "tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FORMAT_RE = r"<think>.*?</think>\s*<answer>.*?</answer>"
MAX_ANSWER_CHARS = 200
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_SPLIT_OFFSET = {"train": 0, "test": 1_000_003}


def make_problem(rng: random.Random, min_numbers: int = 3, max_numbers: int = 4) -> tuple[list[int], int, str]:
    """Draw numbers and combine them with random operations until the result is a usable target."""
    while True:
        numbers = [rng.randint(1, 99) for _ in range(rng.randint(min_numbers, max_numbers))]
        values: list[tuple[Fraction, str]] = [(Fraction(n), str(n)) for n in numbers]
        rng.shuffle(values)
        while len(values) > 1:
            (a, ea), (b, eb) = values.pop(), values.pop()
            op = rng.choice("+-*/")
            if op == "/" and b == 0:
                op = "+"
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
            values.append((value, f"({ea} {op} {eb})"))
        value, expr = values[0]
        if value.denominator == 1 and 1 <= value <= 999:
            return numbers, int(value), expr[1:-1] if expr.startswith("(") else expr


class CountdownOptions(EnvOptions):
    """`-o` options of countdown."""

    size: int = Field(1000, ge=1, description="Problems per split.")
    seed: int = Field(0, description="Seed of the problem generator (each split has its own stream).")
    min_numbers: int = Field(3, ge=2, le=6, description="Fewest numbers in a problem.")
    max_numbers: int = Field(4, ge=2, le=6, description="Most numbers in a problem.")
    calculator: bool = Field(False, description="Give the model a `calculate` tool (multi-turn episodes, up to "
                             "max_turns model turns; docs/multi-turn.md): the built-in tool-use environment.")
    max_turns: int = Field(4, ge=1, description="Most model turns of an episode with the calculator.")
    chat: bool = Field(False, description="Send the prompt as a user message through the model's chat template "
                       "(instruct models; the default sends the text as it is, which a base model continues).")

    @model_validator(mode="after")
    def _check(self) -> CountdownOptions:
        if self.min_numbers > self.max_numbers:
            raise ValueError(f"min_numbers ({self.min_numbers}) must not exceed max_numbers ({self.max_numbers})")
        return self


class CountdownEnvironment(Environment):
    name = "countdown"
    description = "Reach a target with + - * / over 3-4 numbers (procedural, seeded, offline)."
    splits = ("train", "test")
    defaults = {"sampling.max_new_tokens": 64}
    Options = CountdownOptions

    def __init__(self, **options: Any):
        """Options: see `CountdownOptions` (`-o size=200 -o max_numbers=5`)."""
        o = self.parse_options(options)
        self.size, self.seed = o.size, o.seed
        self.min_numbers, self.max_numbers = o.min_numbers, o.max_numbers
        self.calculator, self.max_turns = o.calculator, o.max_turns
        self.chat = o.chat

    @property
    def multi_turn(self) -> bool:
        return self.calculator

    def interaction(self, task: Task) -> Interaction | None:
        """With `-o calculator=true`: an episode in which the model may call `calculate` before answering."""
        if not self.calculator:
            return None
        from vrl.tools import ToolInteraction

        return ToolInteraction([calculate], max_turns=self.max_turns)

    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        self._check_split(split)
        count = self.size if limit is None else min(limit, self.size)
        return [self.task(split, i) for i in range(count)]

    def task(self, split: str, index: int) -> Task:
        rng = random.Random(self.seed * 7_919 + _SPLIT_OFFSET[split] + index)
        numbers, target, solution = make_problem(rng, self.min_numbers, self.max_numbers)
        return self._form(make_task(f"{split}-{index}", numbers, target, solution))

    def _form(self, task: Task) -> Task:
        """The task's prompt as `-o chat` asks: the text, or one user message holding it."""
        if self.chat and isinstance(task.prompt, str):
            return task.model_copy(update={"prompt": [{"role": "user", "content": task.prompt}]})
        return task

    def verifier(self) -> Verifier:
        return CountdownVerifier()

    def shaper(self) -> RewardShaper:
        # Correctness dominates; a small bonus teaches the <think>/<answer> format first.
        return Binary() + 0.1 * FormatBonus(FORMAT_RE)

    def task_from_data(self, data: dict[str, Any]) -> Task:
        if "numbers" in data and "target" in data and "prompt" not in data:
            numbers, target = [int(n) for n in data["numbers"]], int(data["target"])
            return self._form(make_task(str(data.get("id", f"inline-{target}")), numbers, target, data.get("solution")))
        return super().task_from_data(data)


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers, + - * / and parentheses.

    Args:
        expression: The expression, e.g. "(25 - 5) * 3".
    """
    try:
        return _show(evaluate(expression)[0])
    except _Rejected as exc:
        raise ValueError(str(exc)) from None


def make_task(task_id: str, numbers: list[int], target: int, solution: str | None = None) -> Task:
    shown = "[" + " ".join(str(n) for n in numbers) + "]"
    data: dict[str, Any] = {"numbers": numbers, "target": target}
    if solution is not None:
        data["solution"] = solution
    return Task(id=task_id, prompt=PROMPT.format(numbers=shown, target=target), data=data)


class _Rejected(Exception):
    pass


def parse(expr: str) -> tuple[ast.expr, list[int]]:
    """Parse an answer; return its tree and the integer literals it uses.

    Raises `_Rejected` for anything outside + - * / over non-negative integer literals and
    parentheses.
    """
    if len(expr) > MAX_ANSWER_CHARS:
        raise _Rejected(f"answer longer than {MAX_ANSWER_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError as exc:
        raise _Rejected(f"not an arithmetic expression: {exc.msg}") from None
    used: list[int] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            stack += [node.right, node.left]
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
            used.append(node.value)
        else:
            raise _Rejected(f"only + - * / over the given numbers are allowed, found {type(node).__name__}")
    return tree, used


def value_of(node: ast.expr) -> Fraction:
    """Exact value of a tree accepted by `parse` (ZeroDivisionError for a division by zero)."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)
    left, right = value_of(node.left), value_of(node.right)
    op = type(node.op)
    if op is ast.Add:
        return left + right
    if op is ast.Sub:
        return left - right
    if op is ast.Mult:
        return left * right
    return left / right


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Value and literals of an answer expression (see `parse` and `value_of`)."""
    tree, used = parse(expr)
    return value_of(tree), used


class CountdownVerifier(SimpleVerifier):
    name = "countdown"

    def check(self, attempt: Attempt) -> Verdict:
        task, text = attempt.task, attempt.completion.text
        matches = ANSWER_RE.findall(text)
        if not matches:
            return Verdict.fail(Status.REJECTED, "no <answer>...</answer> in the completion")
        expr = matches[-1].strip()
        if "=" in expr:  # "1 + 2 = 3": judge the left-hand side
            expr = expr.split("=", 1)[0].strip()
        try:
            tree, used = parse(expr)
        except _Rejected as exc:
            return Verdict.fail(Status.REJECTED, str(exc))
        except RecursionError:
            return Verdict.fail(Status.REJECTED, "expression nested too deeply")
        available = list(task.data["numbers"])
        for n in used:
            if n not in available:
                why = "used more often than given" if n in task.data["numbers"] else "not among the given numbers"
                return Verdict.fail(Status.FAILED, f"{n} is {why} ({task.data['numbers']})")
            available.remove(n)
        try:
            value = value_of(tree)
        except ZeroDivisionError:
            return Verdict.fail(Status.FAILED, "division by zero")
        target = task.data["target"]
        if value != target:
            return Verdict.fail(Status.FAILED, f"{expr} = {_show(value)}, not {target}")
        return Verdict.ok(f"{expr} = {target}")


def _show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"
