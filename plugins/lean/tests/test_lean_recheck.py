"""The out-of-process re-check of every pass, and the canary false theorems.

What runs here and what does not. Lean + Mathlib cannot run on the test machine. The re-check host
(`recheck_host.py`) runs for real, in its own processes and as an HTTP server, but `lake env lean` is
replaced by `fake_lean.py` (a separate process that acts out a compile and a check), and the
checker's JSON lines are written by hand in `VrlCheck.lean`'s format (fixtures/recheck/README.md).
`VrlCheck.lean` itself has not run; docs/plugins/lean.md gives the command that checks it on a real
server. The kimina server is `lean_replay` (recorded answers, canary answers synthesised).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shlex
import socket
import sys
import threading
from pathlib import Path

import pytest
from lean_replay import ReplayServer, fixture_problems, fixture_responder, fixture_source
from lean_replay import fixture_attempt as attempt
from vrl_lean import recheck_host
from vrl_lean.canary import CanaryPlan, planted
from vrl_lean.client import KiminaClient
from vrl_lean.policy import Rejected, Theorem, prepare
from vrl_lean.recheck import HttpRechecker, LocalRechecker, interpret, job
from vrl_lean.verifier import LeanVerifier

from vrl.types import Status

HERE = Path(__file__).parent
FAKE_LEAN = [sys.executable, str(HERE / "fake_lean.py")]
RECORDS = HERE / "fixtures" / "recheck"
HEADER = "import Mathlib\nimport Aesop\n\nset_option maxHeartbeats 400000\n\nopen BigOperators Real Nat Topology Rat\n"
STATEMENT = "theorem lean_workbook_101 (x : ℕ) (hx : x = 2^9 + 1) : x = 513"
THM = Theorem(name="lean_workbook_101", header=HEADER, statement=STATEMENT)
PROBLEMS = fixture_problems()


def completion(statement: str = STATEMENT, proof: str = "  rw [hx]", prelude: str = "") -> str:
    return f"<think>ok</think>\n```lean4\n{HEADER}\n{prelude}{statement} := by\n{proof}\n```"


def record(name: str) -> dict:
    return {"status": "checked", "detail": "", "check": json.loads((RECORDS / f"{name}.json").read_text()), "elapsed_s": 3.0}


@pytest.fixture
def fake_lean(tmp_path, monkeypatch):
    """Script what the fake Lean does: `fake_lean(candidate=..., reference=..., check=...)`."""

    def script(**acts: str) -> list[str]:
        path = tmp_path / "fake_lean_script.json"
        path.write_text(json.dumps(acts))
        monkeypatch.setenv("LEAN_FAKE_SCRIPT", str(path))
        return FAKE_LEAN

    script()
    return script


# -- what each checker answer means ------------------------------------------------------------------------

PATHS = [
    ("agree", "agree", Status.PASSED, "type and axioms agree"),
    ("type_mismatch", "type_mismatch", Status.FAILED, "differs from the trusted statement"),
    ("unchecked", "unchecked_declaration", Status.FAILED, "the kernel refuses a declaration"),
    ("extra_axiom", "extra_axiom", Status.FAILED, "sorryAx"),
    ("declared_axiom", "extra_axiom", Status.FAILED, "cheat"),
    ("unsafe", "unchecked_declaration", Status.FAILED, "unsafe or partial code: loop"),
    ("not_theorem", "not_a_theorem", Status.FAILED, "is a definition"),
    ("heartbeats", "timeout", Status.TIMEOUT, "ran out of its limit"),
]


@pytest.mark.parametrize("name,outcome,status,words", PATHS, ids=[p[0] for p in PATHS])
def test_each_checker_answer_has_its_verdict(name, outcome, status, words):
    decision = interpret(record(name), "lean_workbook_101")
    assert (decision.outcome, decision.status, decision.agrees) == (outcome, status, outcome == "agree")
    assert words in decision.detail


@pytest.mark.parametrize("raw,outcome,status", [
    ({"status": "compile_error", "detail": "unknown identifier"}, "compile_error", Status.FAILED),
    ({"status": "timeout", "detail": "the checker did not finish within 300 s"}, "timeout", Status.TIMEOUT),
    ({"status": "error", "detail": "checker crashed"}, "unavailable", Status.CRASHED),
    ({"status": "reference_error", "detail": "unknown identifier 'x'"}, "defective_statement", Status.FAILED),
    ({"status": "unavailable", "detail": "ConnectError"}, "unavailable", Status.CRASHED),
    ({"status": "checked", "check": {**json.loads((RECORDS / "agree.json").read_text()), "name": "other"}}, "unavailable", Status.CRASHED),
    ({}, "unavailable", Status.CRASHED),
], ids=["compile error", "timeout", "checker error", "reference error", "host down", "answer for another theorem", "empty"])
def test_host_failures_never_pass(raw, outcome, status):
    decision = interpret(raw, "lean_workbook_101")
    assert (decision.outcome, decision.status) == (outcome, status) and not decision.agrees


# -- the host: fresh processes, stage by stage ----------------------------------------------------------------


def run_host(tmp_path, lean, sub=None, timeout_s=30.0, **kw):
    sub = sub or prepare(completion(), THM)
    return recheck_host.recheck(job(sub, timeout_s), str(tmp_path), lean, **kw)


needs_bwrap = pytest.mark.skipif(recheck_host.check_sandbox("/") is not None,
                                 reason=f"needs a working bubblewrap: {recheck_host.check_sandbox('/')}")
GVISOR = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "gvisor"


@pytest.fixture(autouse=True)
def gvisor_rules(monkeypatch):
    """Every sandboxed stage of this module runs under gVisor's rules for bubblewrap (`tests/fixtures/gvisor/bwrap`
    refuses what Modal's gVisor refuses): the jail then keeps the host's network namespace and relies on its
    seccomp filter alone, the weaker of its two set-ups; tests/test_jail.py starts the other."""
    monkeypatch.setenv("PATH", f"{GVISOR}:{os.environ['PATH']}")


def test_host_compiles_reference_then_candidate_then_runs_the_checker(tmp_path, fake_lean):
    raw = run_host(tmp_path, fake_lean(check="agree"))
    assert raw["status"] == "checked" and raw["check"]["name"] == "lean_workbook_101"
    assert raw["check"]["fake_heartbeats"] == "400000"  # the kernel replay gets the header's limit
    assert recheck_host.header_heartbeats("import Mathlib\n") == recheck_host.header_heartbeats(
        "set_option maxHeartbeats 0\n") == 200_000
    assert list(raw["stages"]) == ["compile_reference_s", "compile_candidate_s", "check_s"]
    assert interpret(raw, "lean_workbook_101").agrees


def test_the_reference_is_the_trusted_statement_proved_by_sorry():
    sub = prepare(completion(prelude="open Finset in\n"), THM, rechecked=True)
    assert sub.reference == f"{THM.trusted_header()}\n{STATEMENT} := by\n  sorry\n"
    assert "open Finset in" in sub.code and "open Finset" not in sub.reference


@pytest.mark.parametrize("acts,status,words,logged", [
    ({"candidate": "error"}, "compile_error", "compiling the candidate; errors at 3:2", "unknown identifier"),
    ({"reference": "error"}, "reference_error", "compiling the trusted statement; errors at 3:2", "unknown identifier"),
    ({"check": "crash"}, "error", "exited with 1 without its JSON line", "could not run"),
    ({"check": "garbage"}, "error", "without its JSON line", "not json"),
    # The sandbox does not show the candidate's compile the reference's folder.
    ({"candidate": "tamper"}, "compile_error", "compiling the candidate; no error position", "tamper failed"),
], ids=["candidate compile error", "reference compile error", "checker crash", "checker garbage", "candidate tampers"])
def test_host_stage_failures(tmp_path, fake_lean, acts, status, words, logged, caplog):
    """Each failure has its status and a fixed sentence with Lean's error positions at most; what the stage
    printed goes to the host's log, never into the answer (which reaches samples.jsonl and repair prompts)."""
    with caplog.at_level("WARNING", logger="vrl_lean.recheck_host"):
        raw = run_host(tmp_path, fake_lean(**acts))
    assert raw["status"] == status and words in raw["detail"], raw
    assert logged not in raw["detail"] and logged in caplog.text
    assert not interpret(raw, "lean_workbook_101").agrees


def test_without_the_sandbox_the_hashes_still_catch_a_tampering_compile(tmp_path, fake_lean):
    raw = run_host(tmp_path, fake_lean(candidate="tamper"), sandbox="off")
    assert raw["status"] == "error" and "reference.olean changed while the candidate compiled" in raw["detail"], raw


# A cheat: the candidate proves another statement (as if something had changed its meaning), and its
# compile runs code that rewrites the reference to match once the hashes are taken. `compare` says
# `agree` only if that succeeded.


@needs_bwrap
@pytest.mark.parametrize("sandbox", ["bwrap", "off"])
def test_a_daemon_that_rewrites_the_reference_after_hashing_never_gets_a_pass(tmp_path, fake_lean, sandbox):
    """The stand-in compiler double-forks a daemon that outlives the compile and, 0.5 s later, writes the
    candidate's statement over the reference .olean and its copy. In the sandbox it dies with the
    compile (and sees neither file); without one, the copies' hashes after the checker give it away."""
    honest = prepare(completion(), THM)
    sub = dataclasses.replace(honest, code=honest.code.replace(": x = 513 :=", ": x = x :="))
    assert sub.code != honest.code
    raw = run_host(tmp_path, fake_lean(candidate="daemon", check="compare"), sub=sub, sandbox=sandbox)
    decision = interpret(raw, "lean_workbook_101")
    assert decision.status in (Status.FAILED, Status.CRASHED) and not decision.agrees, raw
    assert raw["status"] == ("checked" if sandbox == "bwrap" else "error"), raw  # bwrap: type_mismatch, honestly
    # The same cheat with nobody rewriting: the stand-in checker sees the mismatch (the test is not vacuous).
    raw = run_host(tmp_path, fake_lean(check="compare"), sub=sub, sandbox=sandbox)
    assert interpret(raw, "lean_workbook_101").outcome == "type_mismatch", raw


@needs_bwrap
def test_writes_into_the_project_and_the_toolchain_fail_inside_the_sandbox(tmp_path, fake_lean, monkeypatch):
    toolchain = tmp_path / "toolchain"
    toolchain.mkdir()
    monkeypatch.setenv("LEAN_FAKE_TOOLCHAIN", str(toolchain))
    raw = run_host(tmp_path, fake_lean(candidate="write_project", check="agree"))
    assert raw["status"] == "checked", raw
    assert not (tmp_path / "Mathlib.olean").exists() and not (toolchain / "Init.olean").exists()
    # Without the sandbox the same compile plants both (what the sandbox prevents is real).
    run_host(tmp_path, fake_lean(candidate="write_project", check="agree"), sandbox="off")
    assert (tmp_path / "Mathlib.olean").exists() and (toolchain / "Init.olean").exists()


@needs_bwrap
def test_no_key_reaches_a_sandboxed_compile(tmp_path, fake_lean, monkeypatch, caplog):
    monkeypatch.setenv("LEAN_SERVER_API_KEY", "kimina-secret")  # the container's other server's key
    monkeypatch.setenv(recheck_host.API_KEY_VAR, "host-secret")
    monkeypatch.setenv("LEAN_PATH", "/toolchain/lib")
    with caplog.at_level("WARNING", logger="vrl_lean.recheck_host"):
        raw = run_host(tmp_path, fake_lean(candidate="show_env"))
    shown = caplog.text
    assert raw["status"] == "compile_error" and "LEAN_PATH" in shown and " PATH" in shown, raw
    assert "LEAN_SERVER_API_KEY" not in shown and recheck_host.API_KEY_VAR not in shown, raw


def test_a_job_runs_no_longer_than_the_hosts_limit(tmp_path, fake_lean):
    raw = run_host(tmp_path, fake_lean(candidate="hang"), timeout_s=3600, max_timeout_s=1.5)
    assert raw["status"] == "timeout" and "1.5 s" in raw["detail"] and raw["elapsed_s"] < 20, raw


@pytest.mark.parametrize("acts", [{"candidate": "hang"}, {"check": "hang"}], ids=["compile hangs", "checker hangs"])
def test_host_kills_a_stage_that_outlives_the_job(tmp_path, fake_lean, acts):
    raw = run_host(tmp_path, fake_lean(**acts), timeout_s=1.5)
    assert raw["status"] == "timeout" and "1.5 s" in raw["detail"]
    assert interpret(raw, "lean_workbook_101").status is Status.TIMEOUT


def test_host_refuses_bad_jobs_and_a_missing_project(tmp_path, fake_lean):
    lean = fake_lean()
    assert "bad job" in recheck_host.recheck({"name": "x"}, str(tmp_path), lean)["detail"]
    assert "not a plain theorem name" in recheck_host.recheck({"name": "a b", "code": "c", "reference": "r"}, str(tmp_path), lean)["detail"]
    sub = prepare(completion(), THM)
    assert "no Lean project" in recheck_host.recheck(job(sub, 10), str(tmp_path / "nope"), lean)["detail"]


# -- the host over HTTP ----------------------------------------------------------------------------------------


@pytest.fixture
def host(tmp_path, fake_lean):
    servers = []

    def start(api_key: str | None = None, **acts: str) -> str:
        server = recheck_host.serve(str(tmp_path), port=0, host="127.0.0.1", lean=fake_lean(**acts), api_key=api_key)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


async def test_http_host_round_trip_and_key(host):
    url = host(api_key="k", check="type_mismatch")
    sub = prepare(completion(), THM)
    checker = HttpRechecker(url, "k", timeout_s=30)
    assert await checker.probe() is None
    decision = await checker.recheck(sub)
    assert decision.outcome == "type_mismatch" and "Fact False" in decision.detail
    wrong = HttpRechecker(url, "nope", timeout_s=30)
    refused = await wrong.recheck(sub)
    assert refused.outcome == "unavailable" and "401" in refused.detail
    await checker.aclose()
    await wrong.aclose()


async def test_an_unreachable_host_withholds_the_pass():
    checker = HttpRechecker("http://127.0.0.1:9", timeout_s=5)
    decision = await checker.recheck(prepare(completion(), THM))
    assert decision.status is Status.CRASHED and "withheld" in decision.detail
    assert "ConnectError" in (await checker.probe())
    await checker.aclose()


# -- the verifier: a pass stands only after the re-check agrees --------------------------------------------


NAMES = ["lean_workbook_10009", "lean_workbook_10012", "lean_workbook_10090"]  # two proofs, one recorded timeout


def lean_verifier(url: str, **kw) -> LeanVerifier:
    return LeanVerifier(client=KiminaClient(url, repls=4, timeout_s=30, max_retries=1, backoff_s=0.01), **kw)


@pytest.mark.parametrize("check,status,words", [
    ("agree", Status.PASSED, "re-checked out of process"),
    ("type_mismatch", Status.FAILED, "differs from the trusted statement"),
    ("extra_axiom", Status.FAILED, "sorryAx"),
])
async def test_passes_go_through_the_recheck(tmp_path, fake_lean, check, status, words):
    rechecker = LocalRechecker(str(tmp_path), lean=fake_lean(check=check), timeout_s=30)
    with ReplayServer(fixture_responder()) as server:
        v = lean_verifier(server.url, recheck=rechecker)
        verdicts = await v.verify([attempt(n) for n in NAMES])
        await v.aclose()
    assert [x.status for x in verdicts[:2]] == [status, status] and verdicts[2].status is Status.TIMEOUT
    assert all(words in x.detail for x in verdicts[:2])
    assert [x.metrics.get("lean/rechecks") for x in verdicts] == [1, 1, None]  # positives only
    assert all(x.metrics["lean/recheck_s"] > 0 for x in verdicts[:2])
    overturned = [x.metrics.get("lean/recheck_overturned", 0) for x in verdicts[:2]]
    assert overturned == ([0, 0] if status is Status.PASSED else [1, 1])


async def test_no_pass_reaches_the_reward_when_the_recheck_cannot_run():
    with ReplayServer(fixture_responder()) as server:
        v = lean_verifier(server.url, recheck=HttpRechecker("http://127.0.0.1:9", timeout_s=5))
        verdicts = await v.verify([attempt(n) for n in NAMES])
        await v.aclose()
    assert not any(x.passed for x in verdicts) and all(x.score == 0 for x in verdicts)
    assert [x.status for x in verdicts] == [Status.CRASHED, Status.CRASHED, Status.TIMEOUT]
    assert "the Lean server had accepted it" in verdicts[0].detail


async def test_open_in_before_the_theorem_is_sent_when_rechecked_and_judged_by_the_type(tmp_path, fake_lean):
    name = "lean_workbook_10009"
    text = attempt(name).completion.text.replace(f"theorem {name}", f"open Finset in\ntheorem {name}", 1)
    with pytest.raises(Rejected, match="could change how the original statement is read"):
        prepare(text, PROBLEMS[name].theorem)
    rechecker = LocalRechecker(str(tmp_path), lean=fake_lean(check="type_mismatch"), timeout_s=30)
    with ReplayServer(fixture_responder()) as server:
        v = lean_verifier(server.url, recheck=rechecker)
        (verdict,) = await v.verify([attempt(name, text)])
        await v.aclose()
    assert "open Finset in" in server.requests[0]["snippets"][0]["code"]
    assert verdict.status is Status.FAILED and "differs from the trusted statement" in verdict.detail


# -- canaries ------------------------------------------------------------------------------------------------


def test_every_planted_attack_is_refused_by_the_policy():
    for name in ("lean_workbook_101",):
        for label, text in planted(THM):
            with pytest.raises(Rejected):
                prepare(text, THM, target=f"theorem {name} : False")
            assert label


def test_a_canary_is_the_attempt_re_targeted_at_false():
    sub = prepare(completion(), THM, target="theorem lean_workbook_101 : False")
    assert "theorem lean_workbook_101 : False := by" in sub.code and STATEMENT not in sub.code
    assert sub.reference.endswith("theorem lean_workbook_101 : False := by\n  sorry\n")


async def test_canaries_hold_on_an_honest_server():
    with ReplayServer(fixture_responder()) as server:
        v = lean_verifier(server.url, canary_rate=1.0, canary_seed=1)
        verdicts = await v.verify([attempt(n) for n in NAMES])
        await v.aclose()
    assert [x.passed for x in verdicts] == [True, True, False]
    assert all(x.alarm is None for x in verdicts)
    # rate 1: each attempt gets a re-targeted and a planted canary; the planted ones never reach Lean
    assert [x.metrics["lean/canaries"] for x in verdicts] == [2, 2, 2]
    assert [x.metrics["lean/canaries_refused"] for x in verdicts] == [1, 1, 1]
    assert not any(x.metrics.get("lean/canary_exploits") for x in verdicts)
    sent = [s["code"] for r in server.requests for s in r["snippets"]]
    assert sum(": False :=" in code for code in sent) == 3


async def test_every_pass_gets_a_canary_even_at_rate_zero_plus():
    """A tiny rate still watches every pass: the canary for a pass is added after Lean's answer."""
    with ReplayServer(fixture_responder()) as server:
        v = lean_verifier(server.url, canary_rate=1e-9, canary_seed=3)
        verdicts = await v.verify([attempt(n) for n in NAMES])
        await v.aclose()
    assert [x.metrics.get("lean/canaries", 0) for x in verdicts] == [1, 1, 0]
    assert len(server.requests) == 2  # the attempts, then the passes' canaries


@pytest.mark.parametrize("on_exploit", ["stop", "count"])
async def test_a_server_fooled_into_passing_anything_trips_the_canary(on_exploit):
    with ReplayServer(fixture_responder(canary=False)) as server:  # Lean accepts `theorem NAME : False` too
        v = lean_verifier(server.url, canary_rate=1e-9, canary_seed=3, on_exploit=on_exploit)
        verdicts = await v.verify([attempt(n) for n in NAMES])
        await v.aclose()
    assert [x.metrics.get("lean/canary_exploits", 0) for x in verdicts] == [1, 1, 0]
    if on_exploit == "stop":
        assert all("a canary passed" in x.alarm and ": False" in x.alarm for x in verdicts[:2])
    else:
        assert all(x.alarm is None for x in verdicts)


def test_canary_plan_rate_bounds_and_unpredictability():
    with pytest.raises(ValueError):
        CanaryPlan(1.5)
    plan = CanaryPlan(0.25, seed=0)
    assert 150 < sum(plan.draw() for _ in range(1000)) < 350
    assert not any(CanaryPlan(0.0).draw() for _ in range(100))


# -- the loop: canary metrics in metrics.jsonl, and an exploit stops the run ----------------------------------


class WritesFixtureProofs:
    """The local runtime, with the tiny model's text replaced by the fixture's proof of each task: a
    model that has learned to prove these theorems (the tiny random model cannot write Lean)."""

    def __new__(cls):
        from vrl.runtime.local import LocalRuntime

        class Runtime(LocalRuntime):
            def policy(self, config, needs=None):
                host = super().policy(config, needs)
                original = host.sample

                def sample(tasks, variants, seed=None):
                    for batch in original(tasks, variants, seed=seed):
                        yield [c.model_copy(update={"text": attempt(c.task_id).completion.text}) for c in batch]

                host.sample = sample
                return host

        return Runtime()


def lean_run(tmp_path, server_url: str, **options):
    from vrl_lean.environment import LeanEnvironment

    from vrl.config import build
    from vrl.trainer import Trainer

    data = tmp_path / "problems"
    data.mkdir()
    for name in NAMES[:2]:
        src = fixture_source(name)
        (data / src.name).write_text(src.read_text())
    env = LeanEnvironment(server=server_url, data=str(data), test_fraction=0.0, **options)
    cfg = build({"plugin": "lean", "iterations": 2, "tasks_per_iteration": 2, "es": {"population_size": 2},
                 "sampling": {"max_new_tokens": 4, "batch_size": 4},
                 "logging": {"runs_dir": str(tmp_path / "runs"), "name": "lean"}})
    return Trainer(cfg, environment=env, runtime=WritesFixtureProofs())


@pytest.mark.slow
def test_canary_and_recheck_metrics_reach_metrics_jsonl(tmp_path, fake_lean):
    lean = fake_lean(check="agree")
    with ReplayServer(fixture_responder()) as server:
        trainer = lean_run(tmp_path, server.url, recheck="local", lean_project=str(tmp_path), lean_command=shlex.join(lean),
                           canary_rate=0.01)
        summary = trainer.run()
    assert summary["status"] == "finished" and "notes" not in summary  # re-checked: nothing to say
    for m in trainer.run_dir.metrics():
        assert m["pass_rate"] == 1.0 and m["lean/rechecks"] == 4 and m["lean/recheck_s_mean"] > 0
        assert m["lean/canaries"] >= 4 and m["lean/canary_exploits"] == 0 and m["lean/exploit_rate"] == 0.0
    from vrl.report import render

    page = render([trainer.run_dir.path], tmp_path / "report").read_text()
    assert "Verifier counters" in page and "lean/exploit_rate" in page and "<td>lean/rechecks</td><td>8</td>" in page


def test_an_exploit_caught_by_a_canary_stops_the_run_before_the_update(tmp_path):
    """Lean fooled into accepting `theorem NAME : False` (the planted exploit): the run stops at iteration
    0 with a one-line reason, keeps the attempts in alarms.jsonl, and never updates on them."""
    from vrl.errors import IntegrityAlarm

    with ReplayServer(fixture_responder(canary=False)) as server:
        trainer = lean_run(tmp_path, server.url, recheck="off", canary_rate=0.01)
        with pytest.raises(IntegrityAlarm, match="broke the verifier's integrity") as info:
            trainer.run()
    assert "a canary passed" in str(info.value) and "alarms.jsonl" in str(info.value)
    rows = [json.loads(x) for x in (trainer.run_dir.path / "alarms.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["iteration"] == 0 and "```lean4" in r["completion"] for r in rows)
    assert trainer.run_dir.completed_iterations() == 0
    # recheck=off: the run's summary says its passes were not re-checked.
    assert any("NOT re-checked" in n for n in trainer.run_dir.summary()["notes"])


# -- round 4: the host's defaults and its self-test ---------------------------------------------------------


def test_the_http_host_refuses_a_non_numeric_content_length_and_listens_on_loopback(tmp_path, fake_lean):
    import http.client

    server = recheck_host.serve(str(tmp_path), port=0, lean=fake_lean(), api_key="k")
    assert server.server_address[0] == "127.0.0.1"  # unless told otherwise
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
        conn.putrequest("POST", "/recheck")
        conn.putheader("Authorization", "Bearer k")
        conn.putheader("Content-Length", "12abc")
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 400 and b"Content-Length" in resp.read()
        conn.close()
    finally:
        server.shutdown()
        server.server_close()


def test_the_host_will_not_start_without_a_key_unless_told(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(recheck_host.API_KEY_VAR, raising=False)
    with pytest.raises(SystemExit) as info:
        recheck_host.main(["--project", str(tmp_path), "--lean", sys.executable])
    assert info.value.code == 2 and recheck_host.API_KEY_VAR in capsys.readouterr().err


async def test_the_client_sends_the_shared_key_from_the_environment(host, monkeypatch):
    url = host(api_key="s3cret", check="agree")
    monkeypatch.setenv(recheck_host.API_KEY_VAR, "s3cret")
    checker = HttpRechecker(url, timeout_s=30)
    assert (await checker.recheck(prepare(completion(), THM))).agrees
    await checker.aclose()


@pytest.mark.slow
async def test_the_self_test_passes_an_honest_host_and_stops_a_run_on_a_broken_one(tmp_path, fake_lean):
    from vrl.verifier import VerifierUnavailable

    honest = LocalRechecker(str(tmp_path), lean=fake_lean(), timeout_s=30)
    assert await honest.self_test() is None
    v = LeanVerifier(client=KiminaClient("http://127.0.0.1:9", repls=1, max_retries=1), recheck=honest)
    await v._check_recheck()  # no exception
    await v.aclose()

    class AgreesWithAnything(LocalRechecker):  # a host whose checker compares nothing
        async def _run(self, job):
            return record("agree") | {"check": {**record("agree")["check"], "name": job["name"]}}

    class CannotCompileItsChecker(LocalRechecker):
        async def _run(self, job):
            return {"status": "error", "detail": "the checker exited with 1 without its JSON line: unknown constant"}

    for broken, words in ((AgreesWithAnything, "proof of another statement"), (CannotCompileItsChecker, "true statement")):
        v = LeanVerifier(client=KiminaClient("http://127.0.0.1:9", repls=1, max_retries=1),
                         recheck=broken(str(tmp_path), lean=fake_lean(), timeout_s=30))
        with pytest.raises(VerifierUnavailable) as info:
            await v._check_recheck()
        assert "self-test" in str(info.value) and words in str(info.value) and "\n" not in str(info.value)
        await v.aclose()


def test_a_toolchain_under_tmp_stays_visible_in_the_sandbox(tmp_path):
    """The sandbox shows the host nothing but what it names, and replaces /tmp with its own; a Lean command
    whose files live under /tmp (a checkout and its virtualenv there, as a CI runner may have) is bound
    read-only: a program in bin/ brings its virtualenv, a script its folder; never /tmp itself."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    script = tmp_path / "tools" / "fake_lean.py"
    script.parent.mkdir()
    script.write_text("")
    argv = recheck_host.sandbox_argv(str(tmp_path / "project"), None, lean=(str(venv / "bin" / "python"), str(script)))
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"]
    assert str(venv) in binds and str(script.parent) in binds and "/tmp" not in binds and "/" not in binds
    assert argv.index("--tmpfs") < argv.index(str(venv))  # bound on top of the private /tmp, not hidden by it


# -- round 5: what a compile that runs code can see, touch and exhaust on the host --------------------------


@needs_bwrap
def test_a_compile_that_runs_code_finds_nothing_of_the_host(tmp_path, fake_lean, monkeypatch, caplog, request):
    """The stand-in compile acts out code the model got to run at compile time, with TMPDIR elsewhere than /tmp
    (the round-4 finding: another job's .olean was readable there): it reads a token in the user's home, a
    0600 file, another job's folder, connects to a host socket and writes outside its folder. Nothing is
    reached, and the failing compile's answer carries none of what it printed."""
    import shutil
    import tempfile
    # Outside /tmp, which the sandbox always replaced: the round-4 finding was a TMPDIR of /var/tmp.
    host = Path(tempfile.mkdtemp(prefix="vrl-round5-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    request.addfinalizer(lambda: shutil.rmtree(host, ignore_errors=True))
    home, jobs = host / "home", host / "var-tmp"
    home.mkdir(parents=True)
    jobs.mkdir()
    token = home / ".hf_token"
    token.write_text("hf_SECRET_TOKEN")
    token.chmod(0o600)
    other = jobs / "vrl-recheck-other" / "candidate"
    other.mkdir(parents=True)
    (other / "candidate.olean").write_text("an honest job's olean")
    sock_path = str(jobs / "daemon.sock")
    daemon = socket.socket(socket.AF_UNIX)
    daemon.bind(sock_path)
    daemon.listen(1)
    daemon.settimeout(0.2)
    project = tmp_path
    monkeypatch.setenv("TMPDIR", str(jobs))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("LEAN_FAKE_READ", json.dumps([str(token), str(other / "candidate.olean"), "/etc/hostname"]))
    monkeypatch.setenv("LEAN_FAKE_SOCKETS", json.dumps([sock_path]))
    monkeypatch.setenv("LEAN_FAKE_WRITE", json.dumps([str(home / "planted"), str(jobs / "planted")]))
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read again
    try:
        with caplog.at_level("WARNING", logger="vrl_lean.recheck_host"):
            raw = run_host(project, fake_lean(candidate="attack"))
        with pytest.raises(socket.timeout):
            daemon.accept()
    finally:
        daemon.close()
    assert raw["status"] == "compile_error" and raw["detail"] == "lean exited with 1 compiling the candidate; no error position"
    line = next(ln for ln in caplog.text.splitlines() if ln.startswith("attack: "))
    seen = json.loads(line.removeprefix("attack: "))
    assert all(v.startswith("denied") for k, v in seen.items() if k.startswith(("read", "connect"))), seen
    # A write may land in the sandbox's private /tmp (where bwrap made the job folder's mount point), never on the host.
    assert not (home / "planted").exists() and not (jobs / "planted").exists()
    assert "hf_SECRET_TOKEN" not in json.dumps(raw)


@needs_bwrap
def test_a_compile_cannot_exhaust_memory_file_space_or_the_hosts_memory(tmp_path, fake_lean, monkeypatch, caplog):
    monkeypatch.setattr(recheck_host, "LIMITS", recheck_host.jail.Limits(memory_mb=256, file_mb=2))
    monkeypatch.setenv("LEAN_FAKE_ALLOC_MB", "512")
    monkeypatch.setenv("LEAN_FAKE_FILE_MB", "4")
    with caplog.at_level("WARNING", logger="vrl_lean.recheck_host"):
        run_host(tmp_path, fake_lean(candidate="attack"))
    seen = json.loads(next(ln for ln in caplog.text.splitlines() if ln.startswith("attack: ")).removeprefix("attack: "))
    assert seen["memory"] == "denied: MemoryError" and seen["big file"].startswith("denied"), seen
    # 400 MB of output: the host keeps 64 KiB of each stream (it held 3x the output when it read it whole).
    monkeypatch.setenv("LEAN_FAKE_FLOOD_MB", "400")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    raw = run_host(tmp_path, fake_lean(candidate="flood"))
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert raw["status"] == "compile_error" and len(raw["detail"]) < 200 and grown_mb < 100, (raw["detail"], grown_mb)


@needs_bwrap
@pytest.mark.parametrize("sandbox", ["bwrap", "off"])
def test_an_olean_left_as_a_symlink_is_never_followed(tmp_path, fake_lean, monkeypatch, sandbox):
    """A compile leaves candidate.olean as a link to the host's /proc/self/environ (the host's keys): the host
    refuses it rather than copy what it points to into the checker's input, with or without the sandbox."""
    monkeypatch.setenv("VRL_RECHECK_API_KEY", "host-secret")
    raw = run_host(tmp_path, fake_lean(candidate="symlink"), sandbox=sandbox)
    assert raw["status"] == "error" and "no usable .olean" in raw["detail"], raw
    assert "host-secret" not in json.dumps(raw)


def test_a_jail_that_cannot_start_is_named_never_a_defective_statement(tmp_path, fake_lean, monkeypatch):
    """Where bubblewrap cannot make its sandbox (a kernel without user namespaces), the answer names
    bubblewrap and withholds the pass as an infrastructure failure; it never blames the statement."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    (broken / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{broken}:{os.environ['PATH']}")
    raw = run_host(tmp_path, fake_lean())
    assert raw["status"] == "error" and raw["detail"].startswith("bubblewrap cannot create its sandbox here"), raw
    decision = interpret(raw, "lean_workbook_101")
    assert (decision.outcome, decision.status) == ("unavailable", Status.CRASHED)
    assert recheck_host.check_sandbox(str(tmp_path)).startswith("bubblewrap cannot create its sandbox here")


def test_the_host_runs_where_vrl_is_not_installed(tmp_path, fake_lean):
    """The kimina image has no vrl: recheck_host.py runs there beside a copy of vrl/jail.py (docs/plugins/lean.md).
    Both files under an interpreter that cannot import vrl answer a job as the installed host does."""
    import shutil
    import subprocess

    python = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    if python is None or subprocess.run([python, "-I", "-c", "import vrl"], capture_output=True, cwd="/").returncode == 0:
        pytest.skip("needs a Python without vrl installed")
    host = tmp_path / "host"
    (host / "checker").mkdir(parents=True)
    shutil.copy(Path(recheck_host.__file__), host / "recheck_host.py")
    shutil.copy(Path(recheck_host.jail.__file__), host / "jail.py")
    shutil.copy(recheck_host.CHECKER, host / "checker" / "VrlCheck.lean")
    lean = fake_lean(check="agree")
    code = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nimport recheck_host\n"
            "print(json.dumps(recheck_host.recheck(json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]),"
            " sandbox='off')))")
    out = subprocess.run([python, "-I", "-c", code, str(host), json.dumps(job(prepare(completion(), THM), 30)),
                          str(tmp_path), json.dumps(lean)], capture_output=True, text=True, timeout=60, cwd="/")
    raw = json.loads(out.stdout.strip().splitlines()[-1])
    assert raw["status"] == "checked" and interpret(raw, "lean_workbook_101").agrees, (raw, out.stderr)
