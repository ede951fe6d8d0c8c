"""Data (STP rows, local files), Kimina prompts, the `lean` environment and `vrl verify --plugin lean`."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from lean_replay import FIXTURE, ReplayServer, fixture_responder
from vrl_lean import data
from vrl_lean.environment import LeanEnvironment
from vrl_lean.policy import extract_code, prepare
from vrl_lean.prompts import SYSTEM, kimina_messages
from vrl_lean.server import KIMINA
from vrl_lean.verifier import theorem_of

from vrl.cli import _environment_defaults, main
from vrl.plugins import registry

# Rows in kfdong/STP_Lean_SFT's format: prompt = "Complete the following Lean 4 code:\n\n```lean4\n" + header +
# statement (ending in `:= by`), target = the proof. Written here because the Hub is not reachable in tests.
PROVER = "Complete the following Lean 4 code:\n\n```lean4\n"
STP_ROWS = [
    {"prompt": PROVER + "import Mathlib\nimport Aesop\nset_option maxHeartbeats 0\nopen BigOperators Real Nat Topology Rat\n\n"
     "theorem lean_workbook_plus_1234 (a b : ℝ) (hab : a + b = 2) : a * b ≤ 1 := by", "target": "\n  nlinarith [sq_nonneg (a - b)]\n```"},
    {"prompt": PROVER + "import Mathlib\nimport Aesop\n\nset_option maxHeartbeats 400000\n\nopen BigOperators Real Nat Topology Rat\n\n"
     "/-- Prove that $x^2 \\ge 0$ -/\ntheorem lean_workbook_77 (x : ℝ) : x ^ 2 ≥ 0 := by", "target": "\n  positivity\n```"},
    # the same theorem again (another proof of it): deduplicated by name
    {"prompt": PROVER + "import Mathlib\nopen Real\n\ntheorem lean_workbook_77 (x : ℝ) : x ^ 2 ≥ 0 := by", "target": "\n  nlinarith [sq_nonneg x]\n```"},
    # Mathlib rows and conjecturer rows are not lean_workbook problems
    {"prompt": PROVER + "import Mathlib\n\ntheorem Nat.succ_le_of_lt' (n m : ℕ) (h : n < m) : n + 1 ≤ m := by", "target": "\n  omega\n```"},
    {"prompt": PROVER + "<lemma>\ntheorem lean_workbook_5 : True := by trivial\n<easy theorem>\ntheorem x : True := by\n  trivial\n<hard theorem>\n theorem",
     "target": " lean_workbook_new : 1 = 1 := by rfl"},
    # a malformed row: no statement at all
    {"prompt": PROVER + "import Mathlib\n-- lean_workbook but no theorem\n", "target": ""},
]


def test_stp_rows_parse_to_header_and_statement_and_dedupe():
    problems = data.problems_from_rows(STP_ROWS, data.parse_stp_row, "test")
    assert [p.name for p in problems] == ["lean_workbook_plus_1234", "lean_workbook_77"]
    first, second = problems
    assert first.theorem.statement == "theorem lean_workbook_plus_1234 (a b : ℝ) (hab : a + b = 2) : a * b ≤ 1"
    assert "import Aesop" in first.theorem.header and "open BigOperators Real Nat Topology Rat" in first.theorem.header
    assert second.informal == "Prove that $x^2 \\ge 0$" and second.theorem.statement.endswith("x ^ 2 ≥ 0")


def test_load_stp_uses_datasets(monkeypatch):
    """`datasets.load_dataset` is replaced by an in-memory Dataset: the Hub is not reachable here."""
    import datasets

    calls = []

    def fake_load_dataset(name, split, revision=None):
        calls.append((name, split))
        return datasets.Dataset.from_list(STP_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr("vrl.hub.hub_unreachable", lambda: None)  # as if the Hub answered
    env = LeanEnvironment(server="http://x", recheck="off", test_fraction=0.0)
    assert [t.id for t in env.tasks("train")] == ["lean_workbook_plus_1234", "lean_workbook_77"]
    assert calls == [("kfdong/STP_Lean_SFT", "train")]


def test_default_dataset_without_network_fails_fast_naming_the_way_out(monkeypatch, tmp_path):
    """Not cached and the Hub refuses connections: one error naming -o data, before `load_dataset` runs."""
    import datasets

    from vrl.errors import DatasetUnavailable
    from vrl.hub import hub_unreachable

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("load_dataset must not be called"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    hub_unreachable.cache_clear()
    try:
        with pytest.raises(DatasetUnavailable, match=r"kfdong/STP_Lean_SFT.*not in the local.*127.0.0.1:9.*-o data=PATH"):
            LeanEnvironment(server="http://x", recheck="off").tasks("train")
    finally:
        hub_unreachable.cache_clear()


def test_local_fixture_directory_gives_52_problems_with_informal_text():
    problems = {p.name: p for p in data.load_local(FIXTURE / "input")}
    assert len(problems) == 52
    p = problems["lean_workbook_101"]
    assert p.theorem.statement == "theorem lean_workbook_101 (x : ℕ) (hx : x = 2^9 + 1) : x = 513"
    assert p.informal == "solution $2^9+1=512+1=\\boxed{513}$"
    assert p.theorem.header.splitlines()[:2] == ["import Mathlib", "import Aesop"]


def test_local_jsonl_statement_files(tmp_path):
    path = tmp_path / "problems.jsonl"
    rows = [
        {"name": "lean_workbook_1", "formal_statement": "theorem lean_workbook_1 (n : ℕ) : n + 0 = n := by", "informal": "n+0=n"},
        {"formal_statement": "theorem lean_workbook_1 (n : ℕ) : n = n := by"},  # duplicate name: first wins
        STP_ROWS[0],
        {"formal_statement": 3},  # malformed: skipped with a warning
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    problems = data.load_local(path)
    assert [p.name for p in problems] == ["lean_workbook_1", "lean_workbook_plus_1234"]
    assert problems[0].informal == "n+0=n" and problems[0].theorem.statement.endswith("n + 0 = n")
    path.write_text('{"formal_statement": "theorem a : True := by"}\nnot json\n')
    with pytest.raises(ValueError, match=r"problems.jsonl:2: not JSON"):
        data.load_local(path)
    with pytest.raises(FileNotFoundError, match="not found"):
        data.load_local(tmp_path / "missing.jsonl")


def test_split_is_deterministic_and_disjoint():
    problems = data.load_local(FIXTURE / "input")
    a = data.split_problems(problems, 0.1)
    b = data.split_problems(list(reversed(problems)), 0.1)
    assert {p.name for p in a["test"]} == {p.name for p in b["test"]} and len(a["test"]) == 5
    assert not {p.name for p in a["test"]} & {p.name for p in a["train"]}
    assert len(a["train"]) + len(a["test"]) == 52
    with pytest.raises(ValueError):
        data.split_problems(problems, 1.0)


def test_kimina_prompt_matches_the_model_card():
    problem = next(p for p in data.load_local(FIXTURE / "input") if p.name == "lean_workbook_101")
    system, user = kimina_messages(problem)
    assert system == {"role": "system", "content": SYSTEM} and SYSTEM == "You are an expert in mathematics and Lean 4."
    text = user["content"]
    assert text.startswith("Think about and solve the following problem step by step in Lean 4.\n# Problem:solution $2^9")
    assert "\n# Formal statement:\n```lean4\nimport Mathlib\nimport Aesop\n" in text
    assert text.endswith("theorem lean_workbook_101 (x : ℕ) (hx : x = 2^9 + 1) : x = 513 := by\n```\n")
    assert "maxHeartbeats 400000" in text and "maxHeartbeats 0" not in text


def test_environment_registration_defaults_and_options():
    reg = registry()
    assert reg.factory("environments", "lean") is LeanEnvironment
    defaults = _environment_defaults(reg, "lean")
    assert defaults["model"] == "AI-MO/Kimina-Prover-Preview-Distill-1.5B"
    assert defaults["sampling.temperature"] == 0.6 and defaults["sampling.top_p"] == 0.95
    with pytest.raises(ValueError, match="docker run .*projectnumina/kimina-lean-server:2.0.0"):
        reg.environment("lean").verifier()  # the options are checked where a verifier runs here (not on Modal)
    with pytest.raises(ValueError, match="re-checks every pass out of process"):
        reg.environment("lean", server="http://h:1").verifier()
    with pytest.raises(ValueError, match="test_fraction"):
        LeanEnvironment(server="http://x", recheck="off", test_fraction=1.5)
    env = LeanEnvironment(server="http://h:1", recheck="off", api_key="k", data=str(FIXTURE / "input"), test_fraction=0.1,
                          timeout_s=7, max_heartbeats=1000, repls=3)
    assert len(env.tasks("train")) == 47 and len(env.tasks("test", limit=2)) == 2
    v = env.verifier()
    assert v.client.url == "http://h:1" and v.client.api_key == "k" and v.client.repls == 3
    assert v.client.timeout_s == 7 and v.max_heartbeats == 1000
    task = env.tasks("train")[0]
    assert task.id == task.data["name"] and "set_option maxHeartbeats 1000" in task.prompt[1]["content"]


def test_a_model_style_completion_round_trips_through_extraction():
    env = LeanEnvironment(server="http://x", recheck="off", data=str(FIXTURE / "input"), test_fraction=0.0)
    task = next(t for t in env.tasks() if t.id == "lean_workbook_101")
    completion = "<think>\nrewrite then compute\n</think>\nHere is the proof.\n```lean4\n" + task.data["formal_statement"] + "\n  rw [hx]\n```\n"
    assert extract_code(completion).endswith("  rw [hx]\n")
    code = prepare(completion, theorem_of(task.data)).code
    assert "rw [hx]" in code
    inline = env.task_from_data({"formal_statement": "theorem lean_workbook_9 (a : ℕ) : a = a := by"})
    assert inline.id == "lean_workbook_9" and inline.data["statement"] == "theorem lean_workbook_9 (a : ℕ) : a = a"
    with pytest.raises(ValueError, match="no `theorem"):
        env.task_from_data({"formal_statement": "example : True := by"})


def test_vrl_verify_with_server_flag_scores_ready_made_proofs(tmp_path):
    lines = []
    for path in sorted((FIXTURE / "input").glob("*.lean")):
        name = path.read_text().split("theorem ", 1)[1].split()[0]
        lines.append({"task_id": name, "completion": f"```lean4\n{path.read_text()}\n```"})
    lines.append({"task_id": "lean_workbook_101", "completion": "```lean4\ntheorem lean_workbook_101 (x : ℕ) (hx : x = 2^9 + 1) : x = 513 := by sorry\n```"})
    lines.append({"task": {"formal_statement": "theorem lean_workbook_101 (x : ℕ) (hx : x = 2^9 + 1) : x = 513 := by"},
                  "completion": f"```lean4\n{(FIXTURE / 'input' / 'goedel-lean_workbook_101.lean').read_text()}```"})
    proofs = tmp_path / "proofs.jsonl"
    proofs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "verdicts.jsonl"
    with ReplayServer(fixture_responder()) as server:
        result = CliRunner().invoke(main, ["verify", "--plugin", "lean", str(proofs), "--server", server.url, "-o", "recheck=off",
                                           "-o", f"data={FIXTURE / 'input'}", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 54 and sum(r["passed"] for r in rows) == 51
    assert [r["status"] for r in rows if r["task_id"] in ("lean_workbook_10090", "lean_workbook_1036")] == ["timeout", "timeout"]
    assert rows[52]["status"] == "rejected" and "sorry" in rows[52]["detail"]
    assert rows[53]["passed"]
    assert "51/54 passed" in result.output
    warned = [ln for ln in result.output.splitlines() if "recheck=off" in ln]
    assert len(warned) == 1 and "NOT re-checked" in warned[0], result.output  # one line, on the CLI


def test_vrl_verify_without_a_server_explains_how_to_start_one(tmp_path):
    proofs = tmp_path / "p.jsonl"
    proofs.write_text('{"task_id": "x", "completion": ""}\n')
    result = CliRunner().invoke(main, ["verify", "--plugin", "lean", str(proofs)])
    assert result.exit_code == 2 and "docker run" in result.output


def test_modal_sandbox_runs_kimina_as_a_sidecar():
    sandbox = pytest.importorskip("vrl.runtime.modal.sandbox", reason="the Modal runtime is not installed in this tree")
    spec_for = sandbox.spec_for

    env = LeanEnvironment(server="http://remote:8000", recheck="http://remote:8001", repls=6, timeout_s=30)
    spec = spec_for(env, "lean", {"server": "http://remote:8000", "recheck": "http://remote:8001"})
    assert spec.image == "projectnumina/kimina-lean-server:2.0.0" and spec.sidecar == ("python", "-m", "server")
    assert spec.wait_url == "http://127.0.0.1:8000/health" and spec.workdir == "/root/kimina-lean-server"
    assert spec.env["LEAN_SERVER_MAX_REPLS"] == "6" and not spec.network
    assert spec.options["server"] == "http://127.0.0.1:8000" and spec.options["timeout_s"] == 30
    command = " ".join(spec.command())
    assert "python -m server" in command and "--plugin lean" in command
    rebuilt = LeanEnvironment(**spec.options)  # what the verify server inside the sandbox constructs
    assert rebuilt.verifier().client.url == "http://127.0.0.1:8000"
    # Inside the sandbox Lean is at hand: the re-check runs there, in the image's Mathlib project.
    assert spec.options["recheck"] == "local" and spec.options["lean_project"] == KIMINA.lean_project
    assert rebuilt.verifier().rechecker.project == KIMINA.lean_project
    assert spec.options["recheck_sandbox"] == "bwrap" and rebuilt.verifier().rechecker.sandbox == "bwrap"
    off = LeanEnvironment(server="http://x", recheck="local", lean_project="/p", recheck_sandbox="off")
    assert off.verifier().rechecker.sandbox == "off"


def test_a_lean_sandbox_is_ready_only_with_mathlib_loaded_on_every_repl_and_a_proof_judged():
    """Issue 25 item 5 and issue 40 item 2: kimina's /health answers before Mathlib is imported, so readiness
    is a warm-up the sandbox's own verifier must pass: one proof per REPL, sent at once, so that every REPL
    imports lean_workbook's header, each under a per-proof limit long enough for a slow import (not the run's
    60 s), inside the sandbox's start budget. kimina's own LEAN_SERVER_INIT_REPLS is not used: kimina runs those
    imports inside its start-up under a hard 60 s limit, and one overrun kills the server. The re-check's
    bubblewrap is installed on kimina's image. Emulated: no Lean here, so that the proofs pass in Lean is not
    checked; that each is one the validity policy accepts for its theorem is."""
    from vrl_lean.environment import WARMUP_IMPORTS, WARMUP_TIMEOUT_S, warmup_attempt
    from vrl_lean.policy import prepare
    from vrl_lean.verifier import theorem_of

    from vrl.runtime.modal.runtime import ModalConfig

    sandbox = pytest.importorskip("vrl.runtime.modal.sandbox", reason="the Modal runtime is not installed in this tree")
    env = LeanEnvironment(server="http://remote:8000", recheck="off", repls=3)
    spec = sandbox.spec_for(env, "lean", {"server": "http://remote:8000", "recheck": "off"})
    assert not any(key.startswith("LEAN_SERVER_INIT") for key in spec.env)
    assert spec.memory_mb == 3 * KIMINA.memory_per_repl_mb == 3 * 8192
    assert len(spec.warmup) == 3 and len({w["task"]["id"] for w in spec.warmup}) == 3  # one distinct proof per REPL
    assert spec.warmup[1] == warmup_attempt(1).model_dump(mode="json")
    start_budget = ModalConfig().sandbox_start_timeout_s
    assert 60 < spec.warmup_options["timeout_s"] == WARMUP_TIMEOUT_S < start_budget
    assert spec.options["timeout_s"] == 60.0  # the batches after it keep the run's limit
    command = " ".join(spec.command("python", start_budget))
    assert f"--warmup-option timeout_s={WARMUP_TIMEOUT_S}" in command
    for warm in spec.warmup:
        attempt = warmup_attempt(int(warm["task"]["id"].rsplit("_", 1)[1]))
        header = attempt.task.data["header"]
        assert header.startswith(WARMUP_IMPORTS + "\n")
        submission = prepare(attempt.completion.text, theorem_of(attempt.task.data))
        assert attempt.task.id in submission.code and "norm_num" in submission.code
    assert spec.apt == ()  # recheck=off: no re-check sandbox to install
    checked = sandbox.spec_for(LeanEnvironment(server="http://x", repls=2), "lean", {"server": "http://x"})
    assert checked.apt == ("bubblewrap",) and checked.options["recheck_sandbox"] == "bwrap"


@pytest.mark.slow
def test_a_lean_sandbox_whose_warm_up_outlasts_kiminas_start_up_limit_still_becomes_ready():
    """Issue 40 item 2: kimina 2.0.0 imports LEAN_SERVER_INIT_REPLS's header inside its start-up under a hard
    60 s limit, and one overrun kills the server; a 2-core sandbox importing Mathlib four times at once can
    overrun it. The Lean sandbox's real spec (its env, warm-up attempts and warm-up options) runs as a local
    process against a stand-in kimina that keeps those rules time-scaled (`kimina_startup.py`: the import
    takes 1.5 s against a 1 s start-up limit and a 1 s per-proof timeout, standing for 90 s against 60 s):
    the sandbox becomes ready and judges, where kimina's own preload kills the server and a warm-up under the
    run's per-proof timeout never passes. Emulated: no Lean here; the sandbox is a local process."""
    import asyncio
    import dataclasses
    import json
    import socket
    import sys
    from pathlib import Path

    from vrl_lean.environment import WARMUP_IMPORTS, warmup_attempt

    sandbox = pytest.importorskip("vrl.runtime.modal.sandbox", reason="the Modal runtime is not installed in this tree")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = LeanEnvironment(server="http://remote:8000", recheck="off", repls=2, timeout_s=1.0, canary_rate=0.0)
    real = sandbox.spec_for(env, "lean", {"server": "http://remote:8000", "recheck": "off"})
    stand_in = (sys.executable, str(Path(__file__).parent / "kimina_startup.py"), str(port), "1.5", "1.0")
    spec = dataclasses.replace(real, sidecar=stand_in, wait_url=f"{url}/health", workdir=None,
                               options={**real.options, "server": url})

    def start(spec):
        async def go():
            pool = sandbox.SandboxPool(lambda: sandbox.ProcessSandbox.for_spec(spec, 8), size=1,
                                       request_timeout_s=30, start_timeout_s=20)
            try:
                await pool.start()
                return await pool.verify([warmup_attempt(7)])
            finally:
                await pool.aclose()

        return asyncio.run(go())

    (verdict,) = start(spec)
    assert verdict.passed, verdict.detail  # ready, and the REPLs it warmed judge in the run's 1 s
    preloading = dataclasses.replace(spec, env={**spec.env, "LEAN_SERVER_INIT_REPLS": json.dumps({WARMUP_IMPORTS: 2})})
    with pytest.raises(sandbox.SandboxUnavailable):
        start(preloading)  # kimina's own preload: the server dies in its start-up
    with pytest.raises(sandbox.SandboxUnavailable, match="warm-up attempt did not pass"):
        start(dataclasses.replace(spec, warmup_options={}))  # the warm-up under the run's 1 s per proof


def test_under_modal_the_lean_plugin_needs_no_server_option():
    """Issue 25 item 5: `--plugin lean --runtime modal` with no `-o server=` (nor `-o recheck=`): the
    environment builds, the trainer builds no verifier here (the sandboxes judge), and the sandbox's own
    environment points at its sidecar and re-checks in the image's Mathlib project."""
    sandbox = pytest.importorskip("vrl.runtime.modal.sandbox", reason="the Modal runtime is not installed in this tree")
    from vrl.config import build
    from vrl.preflight import verifies_in_process

    env = registry().environment("lean")  # what `vrl train --plugin lean --runtime modal` builds
    assert not verifies_in_process(build({"plugin": "lean", "runtime": {"kind": "modal"}}))
    assert verifies_in_process(build({"plugin": "lean", "runtime": {"kind": "modal", "modal": {"verify_in": "local"}}}))
    spec = sandbox.spec_for(env, "lean", {})
    inside = LeanEnvironment(**spec.options).verifier()  # what the verify server in the sandbox builds
    assert inside.client.url == f"http://127.0.0.1:{KIMINA.port}" and inside.rechecker.project == KIMINA.lean_project
