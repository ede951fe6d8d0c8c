"""Kimina-Prover prompts, as on the AI-MO/Kimina-Prover-Preview-Distill model cards.

The model sees chat messages (its tokenizer's chat template renders them), thinks inside
`<think> ... </think>`, then writes the full Lean file in a ```lean4 block.
"""

from __future__ import annotations

from vrl.types import ChatMessage
from vrl_lean.data import Problem
from vrl_lean.policy import DEFAULT_MAX_HEARTBEATS

MODEL = "AI-MO/Kimina-Prover-Preview-Distill-1.5B"
SYSTEM = "You are an expert in mathematics and Lean 4."
INSTRUCTION = "Think about and solve the following problem step by step in Lean 4."


def formal_statement(problem: Problem, max_heartbeats: int = DEFAULT_MAX_HEARTBEATS) -> str:
    """The trusted header and the statement, ending in `:= by`, as the model should complete it."""
    return f"{problem.theorem.trusted_header(max_heartbeats)}\n{problem.theorem.statement} := by"


def kimina_messages(problem: Problem, max_heartbeats: int = DEFAULT_MAX_HEARTBEATS) -> list[ChatMessage]:
    """System + user messages: the instruction, `# Problem:` (informal text) and `# Formal statement:`."""
    user = INSTRUCTION
    user += f"\n# Problem:{problem.informal}"
    user += f"\n# Formal statement:\n```lean4\n{formal_statement(problem, max_heartbeats)}\n```\n"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
