"""The `lean` environment: lean_workbook problems, Kimina-Prover prompts, the Lean verifier."""

from __future__ import annotations

from typing import Any

from vrl.environment import Environment
from vrl.types import Task
from vrl.verifier import Verifier
from vrl_lean import data as data_mod
from vrl_lean.data import Problem, parse_jsonl_row
from vrl_lean.policy import DEFAULT_MAX_HEARTBEATS
from vrl_lean.prompts import MODEL, formal_statement, kimina_messages
from vrl_lean.server import KIMINA
from vrl_lean.verifier import NO_SERVER, LeanVerifier


class LeanEnvironment(Environment):
    """Prove lean_workbook theorems (kfdong/STP_Lean_SFT, or local files), checked by kimina-lean-server."""

    name = "lean"
    description = "Lean 4 theorem proving (lean_workbook via STP_Lean_SFT), checked by kimina-lean-server."
    splits = ("train", "test")
    # Sampling from the Kimina-Prover-Preview-Distill model card; its proofs need long completions.
    defaults = {
        "model": MODEL,
        "sampling.temperature": 0.6,
        "sampling.top_p": 0.95,
        "sampling.max_new_tokens": 8192,
    }

    def __init__(
        self,
        server: str | None = None,
        api_key: str | None = None,
        data: str = data_mod.STP_DATASET,
        test_fraction: float = 0.02,
        timeout_s: float = 60.0,
        max_heartbeats: int = DEFAULT_MAX_HEARTBEATS,
        repls: int = 4,
    ):
        """Options (`-o KEY=VALUE`): server URL, api_key, data (STP dataset id, or a .lean/.jsonl path or a
        directory of .lean files), test_fraction (held-out share of theorems), timeout_s (per proof),
        max_heartbeats (Lean's deterministic limit), repls (the server's LEAN_SERVER_MAX_REPLS)."""
        if not server:
            raise ValueError(NO_SERVER)
        if max_heartbeats < 1:
            raise ValueError("max_heartbeats must be positive (0 would mean no limit)")
        if not 0.0 <= float(test_fraction) < 1.0:
            raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
        self.server, self.api_key, self.data = str(server), api_key, str(data)
        self.test_fraction, self.timeout_s = float(test_fraction), float(timeout_s)
        self.max_heartbeats, self.repls = int(max_heartbeats), int(repls)
        self._splits: dict[str, list[Problem]] | None = None

    def _problems(self) -> dict[str, list[Problem]]:
        if self._splits is None:
            if self.data == data_mod.STP_DATASET:
                problems = data_mod.load_stp("train")
            else:
                problems = data_mod.load_local(self.data)
            self._splits = data_mod.split_problems(problems, self.test_fraction)
        return self._splits

    def tasks(self, split: str = "train", limit: int | None = None) -> list[Task]:
        self._check_split(split)
        problems = self._problems()[split]
        return [self.make_task(p) for p in problems[: limit if limit is not None else len(problems)]]

    def make_task(self, problem: Problem) -> Task:
        """A task whose id is the theorem name and whose data is the trusted theorem."""
        theorem = problem.theorem
        return Task(
            id=theorem.name,
            prompt=kimina_messages(problem, self.max_heartbeats),
            data={
                "name": theorem.name,
                "header": theorem.header,
                "statement": theorem.statement,
                "informal": problem.informal,
                "formal_statement": formal_statement(problem, self.max_heartbeats),
            },
        )

    def verifier(self) -> Verifier:
        return LeanVerifier(
            self.server, self.api_key, timeout_s=self.timeout_s, max_heartbeats=self.max_heartbeats, repls=self.repls
        )

    def modal_sandbox(self) -> dict[str, Any]:
        """How the Modal runtime runs this verifier: kimina-lean-server as a sidecar in its own image.

        Inside the sandbox the verifier talks to the sidecar on localhost; `server` here is ignored.
        """
        local = f"http://127.0.0.1:{KIMINA.port}"
        options = {"server": local, "timeout_s": self.timeout_s, "max_heartbeats": self.max_heartbeats, "repls": self.repls}
        return {
            "image": KIMINA.image,
            "sidecar": KIMINA.command,
            "wait_url": f"{local}/health",
            "workdir": KIMINA.workdir,
            "env": KIMINA.environment(self.repls),
            "options": options,
        }

    def task_from_data(self, data: dict[str, Any]) -> Task:
        """Inline tasks for `vrl verify`: {"formal_statement": "theorem ... := by", "header"?, "name"?}."""
        if "formal_statement" in data or "prompt" in data and "id" not in data:
            return self.make_task(parse_jsonl_row(data))
        return super().task_from_data(data)
