"""`guess`: a multi-turn game the tiny random model learns on a CPU, to watch episodes train.

The environment thinks of a digit; the model guesses (the first character of its turn); the
environment answers "higher", "lower" or "correct", and the model guesses again, up to `turns`
times. The verifier replays the episode's guesses against the secret (it trusts nothing the
environment reported): a correct guess passes; otherwise the score is the best guess's closeness,
1 − |guess − secret| / 9, and a turn that does not start with a digit scores 0. A random byte-level
model rarely starts a turn with a digit (10 of 257 tokens), so it starts near 0.05; answering the same
digit every turn reaches about 0.72, and going past 0.8 takes reading the feedback (a higher digit
after "higher", a lower one after "lower"): with the suggested GRPO settings the tiny model gets there in
about 15 iterations and guesses the digit in about a third of the games by iteration 30. Everything is generated from a seed: no download.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import Field

from vrl.environment import Environment, EnvOptions
from vrl.envs import TINY_MODEL_STEPS
from vrl.episodes import Interaction, ModelTurn, Reply
from vrl.reward import PartialCredit
from vrl.types import Attempt, Status, Task, Verdict
from vrl.verifier import SimpleVerifier

PROMPT = "I think of a digit from 0 to 9. Guess it: answer with one digit.\n"
_SPLIT_OFFSET = {"train": 0, "test": 1_000_003}


def read_guess(text: str) -> int | None:
    """The guess of a turn: its first non-space character when that is a digit."""
    text = text.lstrip()
    return int(text[0]) if text[:1].isdigit() else None


def feedback(guess: int | None, secret: int) -> str:
    if guess is None:
        return "Answer with one digit."
    if guess == secret:
        return "correct"
    return "higher" if secret > guess else "lower"


class GuessInteraction(Interaction):
    """One game: answers each guess with higher / lower / correct; ends at the correct one."""

    def __init__(self, secret: int, turns: int):
        self.secret, self.max_turns = secret, turns

    async def reply(self, turn: ModelTurn) -> Reply:
        guess = read_guess(turn.text)
        right = guess == self.secret
        return Reply(messages=[{"role": "user", "content": feedback(guess, self.secret)}], done=right, passed=right)


class GuessVerifier(SimpleVerifier):
    """Replays the model's guesses against the secret (a pure function of the turns and the task's data)."""

    name = "guess"

    def check(self, attempt: Attempt) -> Verdict:
        secret = int(attempt.task.data["secret"])
        c = attempt.completion
        guesses = [read_guess(t) for t in (c.episode.model_turns() if c.episode is not None else [c.text])]
        if secret in guesses:
            return Verdict.ok(f"guessed {secret} at turn {guesses.index(secret) + 1}")
        valid = [g for g in guesses if g is not None]
        if not valid:
            return Verdict.fail(Status.FAILED, "no turn started with a digit")
        best = max(1 - abs(g - secret) / 9 for g in valid)
        return Verdict.fail(Status.FAILED, f"best guess {best:.2f} close in {len(guesses)} turns", score=best)


class GuessOptions(EnvOptions):
    """`-o` options of guess."""

    size: int = Field(16, ge=1, description="Games per split.")
    turns: int = Field(3, ge=1, le=10, description="Most guesses per game (model turns).")
    seed: int = Field(0, description="Seed of the secrets (each split has its own stream).")


class GuessEnvironment(Environment):
    name = "guess"
    description = "Guess a digit with higher/lower feedback: a multi-turn game the tiny model learns on a CPU."
    # Suggested settings for the tiny random model (a pretrained model needs far smaller steps). GRPO trains
    # every weight, so the model can learn to read the feedback; ES on the output layer alone (letters'
    # settings) learns to answer with digits but not to use the feedback, and stays near 0.7.
    defaults = {
        "optimizer": "grpo",
        "iterations": 30,
        "tasks_per_iteration": 8,
        "sampling.max_new_tokens": 2,
        **TINY_MODEL_STEPS,
    }
    Options = GuessOptions

    def __init__(self, **options: Any):
        """Options: see `GuessOptions` (`-o turns=4`)."""
        o = self.parse_options(options)
        self.size, self.turns, self.seed = o.size, o.turns, o.seed

    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        self._check_split(split)
        rng = random.Random(self.seed + _SPLIT_OFFSET[split])
        n = self.size if limit is None else min(limit, self.size)
        return [Task(id=f"{split}-{i}", prompt=PROMPT, data={"secret": rng.randrange(10)}) for i in range(n)]

    def interaction(self, task: Task) -> GuessInteraction:
        return GuessInteraction(int(task.data["secret"]), self.turns)

    def verifier(self) -> GuessVerifier:
        return GuessVerifier()

    def shaper(self) -> PartialCredit:
        return PartialCredit()
