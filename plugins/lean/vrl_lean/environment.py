"""The `lean` environment: lean_workbook problems, Kimina-Prover prompts, the Lean verifier."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from vrl.environment import Environment, EnvOptions
from vrl.errors import OptionsError
from vrl.repair import RepairEpisodes
from vrl.types import Attempt, Completion, Task
from vrl.verifier import Verifier
from vrl_lean import data as data_mod
from vrl_lean.data import Problem, parse_jsonl_row
from vrl_lean.policy import DEFAULT_MAX_HEARTBEATS
from vrl_lean.prompts import MODEL, formal_statement, kimina_messages
from vrl_lean.recheck import HttpRechecker, LocalRechecker, Rechecker
from vrl_lean.repair import lean_feedback
from vrl_lean.server import KIMINA
from vrl_lean.verifier import NO_SERVER, START_RECHECK, LeanVerifier

log = logging.getLogger(__name__)
NOT_RECHECKED = ("passes were NOT re-checked out of process (recheck=off): they stand on the Lean server's "
                 "answer alone; use it for debugging only")


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
    recheck: str | None = Field(
        None,
        description="Where every pass is re-checked out of process: the URL of a recheck_host.py server, `local` "
        "(Lean on this machine, with lean_project), or `off` (passes stand on the server's answer alone: not "
        "recommended). Required: there is no silent default.",
    )
    recheck_api_key: str | None = Field(None, description="The re-check host's key (its VRL_RECHECK_API_KEY); by "
                                        "default the VRL_RECHECK_API_KEY of this process.")
    recheck_sandbox: Literal["bwrap", "off"] = Field(
        "bwrap", description="With recheck=local: run each Lean process of a re-check in a throw-away bubblewrap "
        "sandbox (bwrap, the default; the `bubblewrap` package must be installed) or not (off: debugging only).")
    lean_project: str | None = Field(None, description="With recheck=local: the Lake project with Mathlib built.")
    lean_command: str = Field("lake env lean", description="With recheck=local: the command that runs Lean in lean_project.")
    recheck_timeout_s: float = Field(300.0, gt=0, description="Wall-clock limit of one re-check (three fresh Lean processes).")
    canary_rate: float = Field(0.02, ge=0.0, le=1.0, description="Share of attempts that also get a canary false theorem "
                               "(every pass gets one too); 0 turns canaries off.")
    turns: int = Field(1, ge=1, le=16, description="Model turns per theorem: with more than 1, a failed proof's Lean "
                       "error (position, message, failing line) goes back and the model repairs it (docs/multi-turn.md).")
    feedback_chars: int = Field(1200, ge=80, description="Characters of a failed proof's report sent back (turns > 1).")
    on_exploit: Literal["stop", "count"] = Field("stop", description="A canary that passes: stop the run (keeping the "
                                                 "attempt in alarms.jsonl) or only count it in lean/exploit_rate.")

    @field_validator("recheck", mode="before")
    @classmethod
    def _recheck(cls, value: Any) -> str | None:
        if value is False:  # `-o recheck=off` reads as the boolean false
            return "off"
        if value is not None and not isinstance(value, str):
            raise ValueError("recheck is the URL of a recheck_host.py server (http://...), `local` or `off`")
        if value is not None and value not in ("local", "off") and not value.startswith(("http://", "https://")):
            raise ValueError("recheck is the URL of a recheck_host.py server (http://...), `local` or `off`")
        return value

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


WARMUP_IMPORTS = "import Mathlib\nimport Aesop"
"""The imports of lean_workbook's header (`data.parse_jsonl_row`'s default), which the sandbox's warm-up imports
on every REPL."""

WARMUP_TIMEOUT_S = 540.0
"""The per-proof limit of a sandbox's warm-up: its REPLs import Mathlib all at once, on a sandbox's few cores and
a lazily fetched image, which can take minutes; it stays inside the sandbox's start budget
(`runtime.modal.sandbox_start_timeout_s`, 600 s by default)."""


def warmup_attempt(index: int | None = None) -> Attempt:
    """A proof every working verifier passes: what a Lean sandbox must judge before it counts as ready.
    `index`: a theorem name of its own (`vrl_warmup_3`), so that several go to several REPLs as distinct proofs."""
    name = "vrl_warmup" if index is None else f"vrl_warmup_{index}"
    header = WARMUP_IMPORTS + "\n\nopen BigOperators Real Nat Topology Rat\n"
    statement = f"theorem {name} : (2 : ℕ) + 2 = 4"  # as tasks hold it: without `:=`
    task = Task(id=name, prompt="", data={"name": name, "header": header, "statement": statement})
    text = f"```lean4\n{header}\n{statement} := by\n  norm_num\n```"
    return Attempt(task=task, completion=Completion(task_id=name, text=text))


class LeanEnvironment(RepairEpisodes, Environment):
    """Prove lean_workbook theorems (kfdong/STP_Lean_SFT, or local files), checked by kimina-lean-server.
    With `-o turns=K`, proof repair (`vrl_lean.repair`)."""

    feedback = staticmethod(lean_feedback)

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
        """Options (`-o KEY=VALUE`): see `LeanOptions`. `server` and `recheck` are required where the
        verifier runs in this process (`verifier()` refuses without them); under `--runtime modal` the
        sandboxes start their own server and re-check (`modal_sandbox`), so neither is needed."""
        o = self.parse_options(options)
        if o.recheck == "local" and not o.lean_project:
            raise OptionsError("-o recheck=local needs -o lean_project=DIR: the Lake project where Mathlib is built")
        self.recheck, self.lean_project, self.recheck_timeout_s = o.recheck, o.lean_project, o.recheck_timeout_s
        self.canary_rate, self.on_exploit, self.lean_command = o.canary_rate, o.on_exploit, o.lean_command
        self.server, self.api_key, self.data = o.server, o.api_key, o.data
        self.recheck_api_key, self.recheck_sandbox = o.recheck_api_key, o.recheck_sandbox
        self.test_fraction, self.timeout_s = o.test_fraction, o.timeout_s
        self.max_heartbeats, self.repls = o.max_heartbeats, o.repls
        self.turns, self.feedback_chars = o.turns, o.feedback_chars  # proof repair: every turn through the verifier
        self._splits: dict[str, list[Problem]] | None = None
        self._warned = False

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

    def rechecker(self) -> Rechecker | None:
        if self.recheck == "off":
            return None
        if self.recheck == "local":
            return LocalRechecker(self.lean_project, shlex.split(self.lean_command), timeout_s=self.recheck_timeout_s,
                                  sandbox=self.recheck_sandbox)
        return HttpRechecker(self.recheck, self.recheck_api_key, timeout_s=self.recheck_timeout_s)

    def verifier(self) -> Verifier:
        if not self.server:
            raise OptionsError(NO_SERVER)
        if self.recheck is None:
            raise OptionsError(f"the lean plugin re-checks every pass out of process before it earns a reward: {START_RECHECK} "
                               "(or -o recheck=off to trust the server's answer alone)")
        if self.recheck == "off" and not self._warned:
            self._warned = True  # once per run, however often the verifier is built
            log.warning("-o recheck=off: %s", NOT_RECHECKED)
        return LeanVerifier(
            self.server, self.api_key, timeout_s=self.timeout_s, max_heartbeats=self.max_heartbeats, repls=self.repls,
            recheck=self.rechecker(), canary_rate=self.canary_rate, on_exploit=self.on_exploit,
        )

    def summary_notes(self) -> list[str]:
        """With recheck=off, the run's summary says its passes were not re-checked."""
        return [NOT_RECHECKED] if self.recheck == "off" else []

    def iteration_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The verifier's counters, with `lean/exploit_rate` (canaries that passed / canaries) and the
        mean re-check latency."""
        out = {key: 0.0 for key in ("lean/canaries", "lean/canaries_refused", "lean/canary_exploits", "lean/rechecks",
                                    "lean/recheck_overturned", "lean/recheck_s", "lean/defective_statement")}
        out.update(sums)
        canaries = sums.get("lean/canaries", 0.0)
        out["lean/exploit_rate"] = sums.get("lean/canary_exploits", 0.0) / canaries if canaries else 0.0
        if sums.get("lean/rechecks"):
            out["lean/recheck_s_mean"] = sums.get("lean/recheck_s", 0.0) / sums["lean/rechecks"]
        return out

    def modal_sandbox(self) -> dict[str, Any]:
        """How the Modal runtime runs this verifier: kimina-lean-server as a sidecar in its own image.

        Inside the sandbox the verifier talks to the sidecar on localhost; `server` here is ignored.
        """
        local = f"http://127.0.0.1:{KIMINA.port}"
        options = {"server": local, "timeout_s": self.timeout_s, "max_heartbeats": self.max_heartbeats, "repls": self.repls,
                   "canary_rate": self.canary_rate, "on_exploit": self.on_exploit, "recheck_timeout_s": self.recheck_timeout_s}
        # In the sandbox, Lean and Mathlib are at hand: re-check there, unless the user turned it off.
        options.update({"recheck": "off"} if self.recheck == "off" else
                       {"recheck": "local", "lean_project": KIMINA.lean_project, "recheck_sandbox": self.recheck_sandbox})
        return {
            "image": KIMINA.image,
            "sidecar": KIMINA.command,
            "wait_url": f"{local}/health",  # liveness only: kimina answers before Mathlib is loaded
            "workdir": KIMINA.workdir,
            # No LEAN_SERVER_INIT_REPLS: kimina imports those inside its own start-up under a hard 60 s limit, and
            # one overrun kills the server. vrl warms up instead: one proof per REPL, at once, each under
            # WARMUP_TIMEOUT_S, through the whole verifier (policy, Lean, re-check); the sandbox is ready only
            # once every one passed, so every REPL has imported Mathlib before the first batch.
            "env": KIMINA.environment(self.repls),
            "memory_mb": KIMINA.memory_per_repl_mb * self.repls,
            "warmup": [warmup_attempt(i).model_dump(mode="json") for i in range(self.repls)],
            "warmup_options": {"timeout_s": WARMUP_TIMEOUT_S, "canary_rate": 0.0},
            # The re-check runs each Lean process in a bubblewrap sandbox, which kimina's image lacks.
            "apt": ["bubblewrap"] if self.recheck != "off" and self.recheck_sandbox == "bwrap" else [],
            "options": options,
        }

    def task_from_data(self, data: dict[str, Any]) -> Task:
        """Inline tasks for `vrl verify`: {"formal_statement": "theorem ... := by", "header"?, "name"?}."""
        if "formal_statement" in data or "prompt" in data and "id" not in data:
            return self.make_task(parse_jsonl_row(data))
        return super().task_from_data(data)
