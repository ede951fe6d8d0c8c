"""The validity policy: cheating attempts rejected with reasons, Lean's answers judged strictly.

The recorded answers come from a real kimina-lean-server (Lean v4.15.0 + Mathlib) in the fixture.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vrl_lean.policy import Rejected, Theorem, extract_code, judge, prepare

from vrl.types import Status

FIXTURE = Path(__file__).parent / "fixtures" / "lean_workbook"
HEADER = "import Mathlib\nimport Aesop\n\nset_option maxHeartbeats 400000\n\nopen BigOperators Real Nat Topology Rat\n"
STATEMENT = "theorem lean_workbook_101 (x : ℕ) (hx : x = 2^9 + 1) : x = 513"
THM = Theorem(name="lean_workbook_101", header=HEADER, statement=STATEMENT)
PROOF = "  rw [hx]\n  norm_num"


def block(proof: str = PROOF, prelude: str = "", statement: str = STATEMENT) -> str:
    """A completion in Kimina's shape: thinking, then the whole file in a ```lean4 block."""
    return f"<think>\nSubstitute and compute.\n</think>\n```lean4\n{HEADER}\n{prelude}{statement} := by\n{proof}\n```\n"


AUDIT = "'lean_workbook_101' depends on axioms: [propext, Classical.choice, Quot.sound]"


def result(messages=(), sorries=None, error=None) -> dict:
    if error:
        return {"id": "1", "time": 1.0, "error": error}
    response = {"env": 0, "messages": list(messages)}
    if sorries is not None:
        response["sorries"] = sorries
    return {"id": "1", "time": 0.5, "response": response}


def info(data: str, severity: str = "info") -> dict:
    return {"severity": severity, "pos": {"line": 12, "column": 0}, "endPos": {"line": 12, "column": 5}, "data": data}


# -- accepted shapes --------------------------------------------------------------------------------------


def test_a_clean_proof_is_rebuilt_from_the_trusted_header_and_original_statement():
    code = prepare(block(prelude="/- informal: x = 2^9+1 -/\n"), THM)
    lines = code.splitlines()
    assert lines[0] == "import Mathlib" and lines[1] == "import Aesop"  # imports first, no leading comment
    assert "set_option maxHeartbeats 400000" in lines
    assert f"{STATEMENT} := by" in code
    assert lines[-1] == "#print axioms lean_workbook_101"
    assert "informal" not in code  # comments are not sent


def test_the_proof_text_sent_is_the_scanned_comment_free_text():
    proof = "  -- sorry, this line is a comment\n  rw [hx] /- a /- nested sorry -/ still a comment -/\n  norm_num"
    code = prepare(block(proof), THM)
    assert "sorry" not in code and "rw [hx]" in code and "norm_num" in code


def test_whitespace_in_the_statement_may_differ():
    compact = "theorem lean_workbook_101 (x:ℕ) (hx:x=2^9+1):\n    x=513"
    assert f"{STATEMENT} := by" in prepare(block(statement=compact), THM)


def test_the_last_block_after_think_is_used():
    text = "<think>\ntry:\n```lean4\nsorry\n```\n</think>\nfirst try:\n```lean4\nwrong\n```\nfinal:" + block().split("</think>")[1]
    assert "sorry" not in prepare(text, THM)


def test_a_finite_heartbeat_option_inside_the_proof_is_allowed():
    code = prepare(block("  set_option maxHeartbeats 200000 in\n  rw [hx]"), THM)
    assert "set_option maxHeartbeats 200000 in" in code


def test_the_trusted_header_replaces_an_unlimited_heartbeat_setting():
    thm = Theorem("lean_workbook_101", "import Mathlib\nset_option maxHeartbeats 0\nopen Real\n", STATEMENT)
    header = thm.trusted_header(123)
    assert "maxHeartbeats 0" not in header and "set_option maxHeartbeats 123" in header
    assert header.splitlines()[0] == "import Mathlib" and "open Real" in header
    with pytest.raises(ValueError, match="no limit"):
        thm.trusted_header(0)


# -- cheating attempts ------------------------------------------------------------------------------------

CHEATS = [
    # (id, completion, expected words in the reason)
    ("sorry", block("  sorry"), "`sorry`"),
    ("admit", block("  admit"), "`admit`"),
    ("sorryAx", block("  exact sorryAx _ false"), "`sorryAx`"),
    ("root-sorryAx", block("  exact _root_.sorryAx _ false"), "`sorryAx`"),
    ("stop", block("  stop\n  rw [hx]"), "`stop`"),
    ("axiom", block("  exact cheat", prelude="axiom cheat : ∀ x : ℕ, x = 513\n"), "`axiom`"),
    ("#exit", block("  rw [hx]\n#exit"), "`#exit`"),
    ("native_decide", block("  subst hx\n  native_decide"), "native_decide"),
    ("decide+native", block("  subst hx\n  decide +native"), "decide +native"),
    ("ofReduceBool", block("  exact Lean.ofReduceBool _ _ rfl"), "ofReduceBool"),
    ("implemented_by", block(PROOF, prelude="@[implemented_by f] def g : Nat := 1\n"), "implemented_by"),
    ("extern", block(PROOF, prelude='@[extern "c_f"] def g : Nat := 1\n'), "extern"),
    ("unsafe", block(PROOF, prelude="unsafe def g : Nat := 1\n"), "unsafe"),
    ("opaque", block(PROOF, prelude="opaque g : Nat\n"), "opaque"),
    ("debug option", block("  set_option debug.skipKernelTC true in\n  rw [hx]"), "debug options"),
    ("other option", block("  set_option maxRecDepth 100000 in\n  rw [hx]"), "only maxHeartbeats"),
    ("unlimited heartbeats", block("  set_option maxHeartbeats 0 in\n  rw [hx]"), "between 1 and 400000"),
    ("huge heartbeats", block("  set_option maxHeartbeats 99999999 in\n  rw [hx]"), "between 1 and 400000"),
    ("elab", block("  trust", prelude='elab "trust" : tactic => pure ()\n'), "`elab`"),
    ("elab_rules", block(PROOF, prelude="elab_rules : tactic | `(tactic| trust) => pure ()\n"), "`elab_rules`"),
    ("macro", block("  easy", prelude="macro \"easy\" : tactic => `(tactic| rfl)\n"), "`macro`"),
    ("macro_rules", block(PROOF, prelude="macro_rules | `(tactic| easy) => `(tactic| rfl)\n"), "`macro_rules`"),
    ("syntax", block(PROOF, prelude='syntax "easy" : tactic\n'), "`syntax`"),
    ("notation", block(PROOF, prelude='notation "T" => True\n'), "`notation`"),
    ("infix", block(PROOF, prelude='infixl:65 " +++ " => HAdd.hAdd\n'), "`infixl`"),
    ("run_tac", block("  run_tac Lean.Elab.Tactic.closeMainGoal (Lean.mkConst ``True.intro)"), "`run_tac`"),
    ("by_elab", block("  exact by_elab pure (Lean.mkConst ``True.intro)"), "`by_elab`"),
    ("run_cmd", block(PROOF, prelude="run_cmd Lean.logInfo \"hi\"\n"), "`run_cmd`"),
    ("#eval", block(PROOF, prelude="#eval 1 + 1\n"), "`#eval`"),
    ("#print forging the audit", block(PROOF + "\n\n#print \"'lean_workbook_101' depends on axioms: [propext]\""), "#print"),
    ("extra import", block(PROOF, prelude="import Mathlib.Tactic.Linarith\n"), "extra `import"),
    ("import in proof", block(PROOF + "\nimport Lean"), "import"),
    ("second declaration", block(PROOF + f"\n\n{STATEMENT} := by\n  sorry_free_but_twice"), "declared 2 times"),
    ("helper declared in proof", block(PROOF + "\n\nlemma helper : True := trivial"), "`lemma`"),
    ("def in proof", block(PROOF + "\n\ndef helper : Nat := 1"), "`def`"),
    ("example", block(statement="example (x : ℕ) (hx : x = 2^9 + 1) : x = 513"), "uses `example`"),
    ("renamed theorem", block(statement="theorem my_easy_thm (x : ℕ) (hx : x = 2^9 + 1) : x = 513"), "renamed"),
    ("changed conclusion", block(statement="theorem lean_workbook_101 (x : ℕ) (hx : x = 2^9 + 1) : x = x"), "differs from the original"),
    ("dropped hypothesis", block(statement="theorem lean_workbook_101 (x : ℕ) : x = 513"), "differs from the original"),
    ("extra hypothesis", block(statement=STATEMENT + " ∧ True"), "differs from the original"),
    (
        "original statement left in a comment",
        block("  rfl", prelude=f"/- {STATEMENT} := by -/\n", statement="theorem lean_workbook_101 (x : ℕ) : x = x"),
        "differs from the original",
    ),
    (
        "original statement in a comment, real theorem renamed",
        block("  rfl", prelude=f"-- {STATEMENT} := by\n", statement="theorem easy (x : ℕ) : x = x"),
        "renamed",
    ),
    ("sorry hidden behind a macro", block("  by_magic", prelude="macro \"by_magic\" : tactic => `(tactic| sorry)\n"), "banned construct"),
    ("sorry hidden behind notation", block("  exact trust_me", prelude='notation "trust_me" => sorry\n'), "banned construct"),
    ("extra axiom", block("  exact my_ax x", prelude="axiom my_ax : ∀ x : ℕ, x = 513\n"), "`axiom`"),
    ("fullwidth sorry", block("  ｓｏｒｒｙ"), "look-alike Unicode"),
    ("bidi override", block("  rw [hx]\u202e -- ]xh[ wr"), "U+202E"),
    ("zero-width space", block("  sor\u200bry"), "U+200B"),
    ("invisible filler letter", block("  exact \u3164"), "U+3164"),
    ("no-break space", block("  rw\u00a0[hx]"), "U+00A0"),
    ("sorry after a closed nested comment", block("  /- a /- b -/ c -/ sorry"), "`sorry`"),
    ("unterminated comment hides the audit", block("  rw [hx]\n  norm_num /- never closed"), "unterminated"),
    ("empty proof", block(""), "empty proof"),
    ("unfinished think", "<think>\nlet me try\n```lean4\n" + HEADER + STATEMENT + " := by\n  norm_num\n```", "unfinished <think>"),
    ("cut-off final block", "<think>ok</think>\n```lean4\n" + HEADER + STATEMENT + " := by\n  rw [hx]", "never closed"),
    ("no block after think", "<think>\n```lean4\nproof\n```\n</think>\nI am done.", "no ```lean4"),
]


@pytest.mark.parametrize("completion,reason", [c[1:] for c in CHEATS], ids=[c[0] for c in CHEATS])
def test_cheating_attempts_are_rejected_with_a_reason(completion, reason):
    with pytest.raises(Rejected) as info:
        prepare(completion, THM)
    assert reason in str(info.value), str(info.value)


def test_a_bare_lean_file_without_think_tags_is_accepted_for_vrl_verify():
    assert extract_code("import Mathlib\ntheorem t : True := trivial") == "import Mathlib\ntheorem t : True := trivial"


# -- judging Lean's answers ---------------------------------------------------------------------------------


def _recorded() -> dict[str, dict]:
    out = {}
    for path in sorted((FIXTURE / "output").glob("*.json")):
        lean = (FIXTURE / "input" / f"{path.stem}.lean").read_text()
        name = lean.split("theorem ", 1)[1].split()[0]
        out[name] = json.loads(path.read_text())["results"][0]
    return out


def test_recorded_server_answers_replay_mode_accepts_the_50_valid_and_times_out_2():
    """Replay mode: these recorded runs never appended `#print axioms`, so the audit is switched off
    explicitly here (and only here); the audit is tested separately below."""
    recorded = _recorded()
    assert len(recorded) == 52
    verdicts = {name: judge(res, name, require_axiom_audit=False) for name, res in recorded.items()}
    passed = [n for n, v in verdicts.items() if v.passed]
    timeouts = sorted(n for n, v in verdicts.items() if v.status is Status.TIMEOUT)
    assert len(passed) == 50
    assert timeouts == ["lean_workbook_10090", "lean_workbook_1036"]
    assert all("timed out" in verdicts[n].detail for n in timeouts)
    assert all("NOT audited" in verdicts[n].detail for n in passed)


def test_in_real_runs_a_missing_axioms_audit_line_fails():
    recorded = _recorded()
    verdicts = [judge(res, name) for name, res in recorded.items() if not res["error"]]
    assert len(verdicts) == 50 and not any(v.passed for v in verdicts)
    assert all("#print axioms" in v.detail for v in verdicts)


AUDITS = [
    ("standard three", AUDIT, True, ""),
    ("subset", "'lean_workbook_101' depends on axioms: [propext]", True, ""),
    ("no axioms", "'lean_workbook_101' does not depend on any axioms", True, ""),
    ("sorryAx", "'lean_workbook_101' depends on axioms: [propext, sorryAx, Classical.choice, Quot.sound]", False, "sorryAx"),
    ("custom axiom", "'lean_workbook_101' depends on axioms: [propext, cheat]", False, "cheat"),
    ("native", "'lean_workbook_101' depends on axioms: [propext, Lean.ofReduceBool]", False, "Lean.ofReduceBool"),
    ("other theorem", "'helper' depends on axioms: [propext]", False, "not `lean_workbook_101`"),
]


@pytest.mark.parametrize("line,ok,reason", [a[1:] for a in AUDITS], ids=[a[0] for a in AUDITS])
def test_axioms_audit_on_lean_v4_15_output(line, ok, reason):
    verdict = judge(result([info("unused variable", "warning"), info(line)]), "lean_workbook_101")
    assert verdict.passed is ok
    assert reason in verdict.detail


def test_a_second_axioms_report_is_treated_as_forged():
    verdict = judge(result([info("'lean_workbook_101' depends on axioms: [propext]", "info"), info(AUDIT)]), "lean_workbook_101")
    assert not verdict.passed and "exactly one" in verdict.detail


@pytest.mark.parametrize(
    "res,status,reason",
    [
        (result([info("unknown identifier 'foo'", "error"), info(AUDIT)]), Status.FAILED, "line 12"),
        (result([info(AUDIT)], sorries=[{"pos": {"line": 3, "column": 2}, "goal": "⊢ False"}]), Status.FAILED, "sorry"),
        (result([info("declaration uses 'sorry'", "warning"), info(AUDIT)]), Status.FAILED, "declaration uses 'sorry'"),
        (result(error="Lean REPL command timed out in 60 seconds"), Status.TIMEOUT, "timed out"),
        (result(error="Lean process timed out"), Status.TIMEOUT, "timed out"),
        ({"id": "1", "time": 0.1, "response": {"message": "Unknown environment."}}, Status.CRASHED, "Unknown environment"),
        ({"id": "1"}, Status.CRASHED, "neither"),
        (result(error="REPL crashed"), Status.CRASHED, "REPL crashed"),
    ],
    ids=["error", "sorries", "sorry warning", "timeout", "legacy timeout", "repl error", "empty", "server error"],
)
def test_judge_failures_carry_status_and_reason(res, status, reason):
    verdict = judge(res, "lean_workbook_101")
    assert not verdict.passed and verdict.status is status and verdict.score == 0.0
    assert reason in verdict.detail


def test_judge_accepts_a_clean_answer_and_reports_elapsed_time():
    verdict = judge(result([info("'rfl' tactic does nothing", "warning"), info(AUDIT)]), "lean_workbook_101")
    assert verdict.passed and verdict.elapsed_s == 0.5 and "1 warnings" in verdict.detail
