"""The `lean` environment: lean_workbook problems, Kimina-Prover prompts, the Lean verifier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from vrl.environment import Environment, EnvOptions
from vrl.errors import OptionsError
from vrl.types import Task
from vrl.verifier import Verifier
from vrl_lean import data as data_mod
from vrl_lean.data import Problem, parse_jsonl_row
from vrl_lean.policy import DEFAULT_MAX_HEARTBEATS
from vrl_lean.prompts import MODEL, formal_statement, kimina_messages
from vrl_lean.server import KIMINA
from vrl_lean.verifier import NO_SERVER, LeanVerifier


class LeanOptions(EnvOptions):
    """`-o` options of lean."""

    server: str | None = Field(None, description="URL of a kimina-lean-server, e.g. http://localhost:8000.")
    api_key: str | None = Field(None, description="The server's LEAN_SERVER_API_KEY, if it has one.")
    data: str = Field(
        data_mod.STP_DATASET,
        description="Problems: kfdong/STP_Lean_SFT (downloaded once), a .lean file, a directory of .lean files, or a .jsonl file.",
    )
    test_fraction: float = Field(0.02, ge=0.0, lt=1.0, description="Held-out share of theorems (the test split).")
    timeout_s: float = Field(60.0, gt=0, description="Lean's wall-clock limit per proof.")
    max_heartbeats: int = Field(DEFAULT_MAX_HEARTBEATS, ge=1, description="Lean's deterministic limit (0 would mean none).")
    repls: int = Field(4, ge=1, description="The server's LEAN_SERVER_MAX_REPLS: proofs checked at once.")

    @field_validator("server")
    @classmethod
    def _url(cls, server: str | None) -> str | None:
        if server and not server.startswith(("http://", "https://")):
            raise ValueError("the server URL must start with http:// or https://")
        return server

    @field_validator("data")
    @classmethod
    def _data(cls, data: str) -> str:
        if data != data_mod.STP_DATASET and not Path(data).expanduser().exists():
            raise ValueError(
                f"no such file or directory {data!r}: give a .lean file, a directory of .lean files, a .jsonl "
                f"file, or {data_mod.STP_DATASET}"
            )
        return data


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
    Options = LeanOptions

    def __init__(self, **options: Any):
        """Options (`-o KEY=VALUE`): see `LeanOptions`; `server` is required."""
        o = self.parse_options(options)
        if not o.server:
            raise OptionsError(NO_SERVER)
        self.server, self.api_key, self.data = o.server, o.api_key, o.data
        self.test_fraction, self.timeout_s = o.test_fraction, o.timeout_s
        self.max_heartbeats, self.repls = o.max_heartbeats, o.repls
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
