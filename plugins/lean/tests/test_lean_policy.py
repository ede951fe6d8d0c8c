"""The validity policy: cheating attempts rejected with reasons, Lean's answers judged strictly.

The recorded answers come from a real kimina-lean-server (Lean v4.15.0 + Mathlib) in the fixture;
answers to files with our trailer are crafted in the format Lean v4.15.0 prints (see lean_replay).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vrl_lean.policy import Rejected, Submission, Theorem, extract_code, judge, prepare

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


NONCE = "0123456789abcdef" * 2


def submission() -> Submission:
    return prepare(block(), THM, nonce=NONCE)


def trailer(sub: Submission | None = None, relative: bool = True) -> list[dict]:
    """The two messages Lean prints for the trailer, at the lines kimina-lean-server 2.0.0 reports
    (relative to the body after the import header) or absolute (`relative=False`)."""
    sub = sub or submission()
    shift = sub.header_lines if relative else 0
    return [info(AUDIT, line=sub.audit_line - shift), info(sub.marker, line=sub.nonce_line - shift)]


def result(messages=(), sorries=None, error=None) -> dict:
    if error:
        return {"id": "1", "time": 1.0, "error": error}
    response = {"env": 0, "messages": list(messages)}
    if sorries is not None:
        response["sorries"] = sorries
    return {"id": "1", "time": 0.5, "response": response}


def info(data: str, severity: str = "info", line: int = 12, column: int = 0) -> dict:
    return {"severity": severity, "pos": {"line": line, "column": column}, "endPos": {"line": line, "column": 6}, "data": data}


# -- accepted shapes --------------------------------------------------------------------------------------


def test_a_clean_proof_is_rebuilt_from_the_trusted_header_and_original_statement():
    sub = prepare(block(prelude="/- informal: x = 2^9+1 -/\n"), THM)
    code = sub.code
    lines = code.splitlines()
    assert lines[0] == "import Mathlib" and lines[1] == "import Aesop"  # imports first, no leading comment
    assert "set_option maxHeartbeats 400000" in lines
    assert f"{STATEMENT} := by" in code
    assert lines[-2:] == ["#print axioms lean_workbook_101", f'#print "vrl audit {sub.nonce}"']
    assert (sub.audit_line, sub.nonce_line) == (len(lines) - 1, len(lines)) and sub.header_lines == 3
    assert "informal" not in code  # comments are not sent


def test_every_request_draws_a_fresh_nonce():
    nonces = {prepare(block(), THM).nonce for _ in range(20)}
    assert len(nonces) == 20 and all(len(n) == 32 for n in nonces)


def test_the_proof_text_sent_is_the_scanned_comment_free_text():
    proof = "  -- sorry, this line is a comment\n  rw [hx] /- a /- nested sorry -/ still a comment -/\n  norm_num"
    code = prepare(block(proof), THM).code
    assert "sorry" not in code and "rw [hx]" in code and "norm_num" in code


def test_whitespace_in_the_statement_may_differ():
    compact = "theorem lean_workbook_101 (x:ℕ) (hx:x=2^9+1):\n    x=513"
    assert f"{STATEMENT} := by" in prepare(block(statement=compact), THM).code


def test_the_last_block_after_think_is_used():
    text = "<think>\ntry:\n```lean4\nsorry\n```\n</think>\nfirst try:\n```lean4\nwrong\n```\nfinal:" + block().split("</think>")[1]
    assert "sorry" not in prepare(text, THM).code


def test_a_finite_heartbeat_option_inside_the_proof_is_allowed():
    code = prepare(block("  set_option maxHeartbeats 200000 in\n  rw [hx]"), THM).code
    assert "set_option maxHeartbeats 200000 in" in code


# Issue 15: legitimate proofs that the word-regex policy rejected. Each must now reach Lean unchanged.
LEGITIMATE = [
    ("hypothesis named stop", "  have stop : x = 513 := by rw [hx]\n  exact stop", "exact stop"),
    ("bounded maxRecDepth", "  set_option maxRecDepth 10000 in\n  rw [hx]", "set_option maxRecDepth 10000 in"),
    ("linter option", "  set_option linter.unusedVariables false in\n  rw [hx]", "linter.unusedVariables false"),
    ("banned word in a string", '  have h : "sorry, #eval! admit" ≠ "" := by decide\n  rw [hx]', '"sorry, #eval! admit"'),
    ("char literal '\"' then a comment", "  have : '\"' = '\"' := rfl -- it's a \" quote\n  rw [hx]", "have : '\"' = '\"' := rfl"),
    ("escaped char literal", "  have : '\\'' ≠ 'a' := by decide\n  rw [hx]", "'\\''"),
    ("aesop unsafe rule", "  subst hx\n  aesop (add unsafe 50% apply Nat.le_refl)", "(add unsafe 50% apply Nat.le_refl)"),
    ("identifier with sorry inside", "  have sorry_free : x = 513 := by rw [hx]\n  exact sorry_free", "exact sorry_free"),
    ("preimage and tsum tokens", "  have : (fun n : ℕ => n) ⁻¹' {1} = {1} := rfl\n  rw [hx]", "⁻¹' {1}"),
]


@pytest.mark.parametrize("proof,sent", [c[1:] for c in LEGITIMATE], ids=[c[0] for c in LEGITIMATE])
def test_legitimate_proofs_are_sent(proof, sent):
    assert sent in prepare(block(proof), THM).code


def test_unicode_spaces_are_normalised_not_rejected():
    code = prepare(block("  rw\u00a0[hx]\u2009\n\u3000norm_num"), THM).code
    assert "  rw [hx] \n norm_num" in code and "\u00a0" not in code


def test_helper_declarations_are_sent_in_order_and_checked_by_the_same_policy():
    helpers = (
        "open Finset in\n"
        "/-- a doc comment -/\n@[simp] lemma helper (x : ℕ) (hx : x = 2^9 + 1) : x = 513 := by\n  rw [hx]\n\n"
        "noncomputable def twice (n : ℕ) : ℕ := 2 * n\n\n"
        "set_option maxHeartbeats 200000 in\n"
    )
    code = prepare(block("  exact helper x hx", prelude=helpers), THM).code
    body = code.split("open BigOperators Real Nat Topology Rat\n", 1)[1]
    order = ["open Finset in", "@[simp] lemma helper", "noncomputable def twice", "set_option maxHeartbeats 200000 in", STATEMENT]
    assert [body.index(x) for x in order] == sorted(body.index(x) for x in order)
    with pytest.raises(Rejected, match="`sorry`"):
        prepare(block("  exact helper x hx", prelude="lemma helper (x : ℕ) (hx : x = 2^9 + 1) : x = 513 := by\n  sorry\n"), THM)
    after = prepare(block(PROOF + "\n\ntheorem later : True := trivial"), THM).code
    assert after.index("theorem later") > after.index(STATEMENT)


def test_opens_that_cannot_reach_the_statement_are_sent():
    helper = "lemma h (x : ℕ) (hx : x = 2^9 + 1) : x = 513 := by\n  rw [hx]\n"
    for proof, prelude in [
        ("  exact h x hx", "open Real Nat\nopen scoped BigOperators\n" + "open Finset in\n" + helper),  # header's own, or scoped to a helper
        ("  open Finset in\n  rw [hx]", ""),  # inside the proof
        (PROOF + "\nopen Finset\nlemma later : True := trivial", ""),  # after the theorem
    ]:
        code = prepare(block(proof, prelude=prelude), THM).code
        assert "open Finset" in code or "open Real Nat" in code


def test_a_copied_global_heartbeat_setting_is_replaced_by_the_trusted_header():
    code = prepare(block(PROOF, prelude="set_option maxHeartbeats 0\n"), THM).code
    assert "maxHeartbeats 0" not in code and code.count("set_option maxHeartbeats") == 1


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
    ("unbounded maxRecDepth", block("  set_option maxRecDepth 1000000 in\n  rw [hx]"), "between 1 and 100000"),
    ("option changing the statement", block(PROOF, prelude="set_option autoImplicit true in\n"), "auto-bound names"),
    ("global option between declarations", block(PROOF + "\nset_option maxHeartbeats 0\nlemma h : True := trivial"), "between 1 and"),
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
    ("sorry after a closed nested comment", block("  /- a /- b -/ c -/ sorry"), "`sorry`"),
    ("unterminated comment hides the audit", block("  rw [hx]\n  norm_num /- never closed"), "unterminated"),
    ("empty proof", block(""), "empty proof"),
    ("unfinished think", "<think>\nlet me try\n```lean4\n" + HEADER + STATEMENT + " := by\n  norm_num\n```", "unfinished <think>"),
    ("cut-off final block", "<think>ok</think>\n```lean4\n" + HEADER + STATEMENT + " := by\n  rw [hx]", "never closed"),
    ("no block after think", "<think>\n```lean4\nproof\n```\n</think>\nI am done.", "no ```lean4"),
    # -- issue 15: the `#eval!` class (code that runs inside Lean can forge the server's answer)
    ("#eval! forging the REPL's stdout", block(PROOF + '\n\n#eval! show IO Unit from do\n  let h ← IO.FS.Handle.mk "/proc/self/fd/1" .write\n  h.putStrLn (toString (Lean.Json.mkObj [("env", 0), ("messages", Lean.Json.arr #[])]))\n  h.putStrLn ""'), "`#eval!`"),
    ("#eval! before the theorem", block(PROOF, prelude="#eval! (1 : Nat)\n"), "`#eval!`"),
    ("#eval! indented inside the proof", block("  rw [hx]\n  #eval! (1 : Nat)"), "`#eval!`"),
    ("#eval! glued to a number", block("  rw [hx]\n  norm_num\n2#eval! (1 : Nat)"), "`#eval!`"),
    ("fullwidth #eval", block(PROOF + "\n＃ｅｖａｌ 1"), "look-alike Unicode"),
    ("eval% term", block("  exact eval% (1 : ℕ)"), "eval%"),
    ("run_cmd", block(PROOF + '\nrun_cmd Lean.logInfo "x"'), "`run_cmd`"),
    ("initialize", block(PROOF, prelude="initialize pure ()\n"), "`initialize`"),
    ("simproc", block(PROOF, prelude="simproc s (_) := fun _ => pure .continue\n"), "`simproc`"),
    ("attribute command", block(PROOF, prelude="attribute [simp] Nat.add_comm\n"), "`attribute`"),
    ("instance", block(PROOF, prelude="instance : OfNat ℕ 513 := ⟨512⟩\n"), "`instance`"),
    ("sudo set_option", block(PROOF, prelude="sudo set_option debug.skipKernelTC true\n"), "`sudo`"),
    ("meta attribute", block(PROOF, prelude="@[tactic Lean.Parser.Tactic.decide] def d : Nat := 1\n"), "attribute `tactic`"),
    ("instance attribute", block(PROOF, prelude="@[instance] def d : Inhabited ℕ := ⟨0⟩\n"), "attribute `instance`"),
    ("namespace", block(PROOF, prelude="namespace Foo\n"), "`namespace`"),
    ("stray text before the theorem", block(PROOF, prelude=":= by rfl\n"), "unexpected `:=`"),
    ("dangling in", block(PROOF + "\nopen Nat in"), "ends with `in`"),
    ("import after other commands", block(PROOF, prelude="import Mathlib\n"), "imports must come first"),
    ("unsafe term", block("  exact unsafe (rfl : x = x) ▸ sorry"), "`sorry`"),
    ("unsafe outside aesop", block("  exact (unsafe_thing : x = 513)", prelude="unsafe def unsafe_thing : Nat := 1\n"), "`unsafe`"),
    ("helper named like the theorem", block("  exact Nat.lean_workbook_101 x hx", prelude=STATEMENT.replace("theorem ", "theorem Nat.") + " := by\n  rw [hx]\n"), "named like the theorem"),
    ("attribute on the theorem", block(PROOF, statement="@[simp] " + STATEMENT), "may not carry"),
    ("private theorem", block(PROOF, statement="private " + STATEMENT), "may not carry"),
    ("new namespace opened at the theorem", block(PROOF, prelude="open Polynomial\n"), "could change how the original statement is read"),
    ("new namespace opened for the theorem", block(PROOF, prelude="open Polynomial in\nset_option maxHeartbeats 1000 in\n"), "`open Polynomial`"),
    ("example beside the theorem", block(PROOF, prelude="example : True := trivial\n"), "`example`"),
    # -- issue 15: tokenise as Lean does
    ("0sorry is a number then sorry", block("  rw [hx]\n  exact 0sorry"), "`sorry`"),
    ("1set_option is a number then set_option", block("  rw [hx]\n  1set_option debug.skipKernelTC true in\n  norm_num"), "debug options"),
    ("sorry inside an interpolation", block('  have : s!"{sorry}" = "" := rfl\n  rw [hx]'), "inside a string literal"),
    ("string read two ways", block('  have : s!"{ "}" ++ sorry ++ "{" }" = "" := rfl\n  rw [hx]'), "cannot be told apart"),
    ("raw string before sorry", block('  exact (r"\\" ++ sorry ++ "a\\"")'), "`sorry`"),
    ("comment glued to an operator", block("  rw [hx] <-- sorry"), "glued"),
    ("quote glued to an operator", block("  exact x +'\"' sorry \"'"), "glued"),
    ("invalid escape (Lean re-reads the string as code)", block('  have : "\\q #eval! x" = "" := rfl\n  rw [hx]'), "invalid escape"),
    ("unterminated string", block('  have : "abc = "" := rfl'), "unterminated string"),
    ("escaped keyword is still a sorry", block("  exact «sorry»"), "`«sorry»`"),
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
    """Replay mode (`submission=None`): these recorded runs were made without our trailer, so there is
    no axioms report and no nonce to check; only this test judges them that way."""
    recorded = _recorded()
    assert len(recorded) == 52
    verdicts = {name: judge(res, None) for name, res in recorded.items()}
    passed = [n for n, v in verdicts.items() if v.passed]
    timeouts = sorted(n for n, v in verdicts.items() if v.status is Status.TIMEOUT)
    assert len(passed) == 50
    assert timeouts == ["lean_workbook_10090", "lean_workbook_1036"]
    assert all("timed out" in verdicts[n].detail for n in timeouts)
    assert all("NOT audited" in verdicts[n].detail for n in passed)


def test_in_real_runs_an_answer_without_the_trailer_fails():
    """A real, clean answer from Lean that lacks our trailer's echo is not an answer to our file."""
    recorded = _recorded()
    verdicts = [judge(res, submission()) for name, res in recorded.items() if not res["error"]]
    assert len(verdicts) == 50 and not any(v.passed for v in verdicts)
    assert all("nonce" in v.detail for v in verdicts)


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
    sub = submission()
    audit, echo = trailer(sub)
    audit["data"] = line
    verdict = judge(result([info("unused variable", "warning"), audit, echo]), sub)
    assert verdict.passed is ok
    assert reason in verdict.detail


def test_a_second_axioms_report_is_treated_as_forged():
    sub = submission()
    verdict = judge(result([info("'lean_workbook_101' depends on axioms: [propext]"), *trailer(sub)]), sub)
    assert not verdict.passed and "exactly one" in verdict.detail


@pytest.mark.parametrize("relative", [True, False], ids=["kimina 2.0.0 body lines", "absolute lines"])
def test_judge_accepts_a_clean_answer_and_reports_elapsed_time(relative):
    sub = submission()
    verdict = judge(result([info("'rfl' tactic does nothing", "warning"), *trailer(sub, relative)]), sub)
    assert verdict.passed and verdict.elapsed_s == 0.5 and "1 warnings" in verdict.detail


def _forged(sub: Submission) -> list[tuple[str, list[dict]]]:
    audit, echo = trailer(sub)
    other = prepare(block(), THM)  # another request: its own nonce
    return [
        ("no echo (the #eval! forgery: a clean answer with a plausible axioms report)", [audit]),
        ("another request's echo (a stale answer read out of step)", [audit, {**echo, "data": other.marker}]),
        ("echo text around the nonce", [audit, {**echo, "data": f"{sub.marker} ok"}]),
        ("echo twice", [audit, echo, echo]),
        ("echo as a warning", [audit, {**echo, "severity": "warning"}]),
        ("echo on the wrong line", [audit, info(sub.marker, line=sub.nonce_line + 1)]),
        ("echo in the wrong column", [audit, info(sub.marker, line=echo["pos"]["line"], column=2)]),
        ("echo without a position", [audit, {"severity": "info", "data": sub.marker}]),
    ]


@pytest.mark.parametrize("case", range(8), ids=[c[0] for c in _forged(prepare(block(), THM, nonce=NONCE))])
def test_an_answer_that_does_not_echo_the_nonce_where_lean_prints_it_is_not_a_pass(case):
    sub = submission()
    _, messages = _forged(sub)[case]
    verdict = judge(result(messages), sub)
    assert not verdict.passed and verdict.score == 0.0
    assert "nonce" in verdict.detail


def test_the_axioms_report_must_sit_on_the_trusted_print_line():
    sub = submission()
    audit, echo = trailer(sub)
    verdict = judge(result([{**audit, "pos": {"line": 9, "column": 2}}, echo]), sub)
    assert not verdict.passed and "not where Lean prints" in verdict.detail


@pytest.mark.parametrize(
    "res,status,reason",
    [
        (result([info("unknown identifier 'foo'", "error"), *trailer()]), Status.FAILED, "line 12"),
        (result(trailer(), sorries=[{"pos": {"line": 3, "column": 2}, "goal": "⊢ False"}]), Status.FAILED, "sorry"),
        (result([info("declaration uses 'sorry'", "warning"), *trailer()]), Status.FAILED, "declaration uses 'sorry'"),
        (result(error="Lean REPL command timed out in 60 seconds"), Status.TIMEOUT, "timed out"),
        (result(error="Lean process timed out"), Status.TIMEOUT, "timed out"),
        ({"id": "1", "time": 0.1, "response": {"message": "Unknown environment."}}, Status.CRASHED, "Unknown environment"),
        ({"id": "1"}, Status.CRASHED, "neither"),
        (result(error="REPL crashed"), Status.CRASHED, "REPL crashed"),
    ],
    ids=["error", "sorries", "sorry warning", "timeout", "legacy timeout", "repl error", "empty", "server error"],
)
def test_judge_failures_carry_status_and_reason(res, status, reason):
    verdict = judge(res, submission())
    assert not verdict.passed and verdict.status is status and verdict.score == 0.0
    assert reason in verdict.detail


# -- issue 24: integrity round 3 ---------------------------------------------------------------------------
# Each of these reached Lean (or a pass) before; the first two are the forged passes found in round 3.

META_TACTIC = "open Lean Elab Tactic Meta in\ndef t : TacticM Unit := do\n  let g ← getMainGoal\n  g.assign (mkConst ``True.intro)\n"
ROUND3 = [
    # a command hidden in a word: identifiers may end in `?`/`!`, and Mathlib defines such commands
    ("variable? adds a hidden instance hypothesis",
     block("  exact (Fact.out (p := False)).elim", prelude="lemma h0 : True := trivial\nvariable? [Fact False]\n"), "`variable?`"),
    ("count_heartbeats! lifts the heartbeat limit", block(PROOF, prelude="lemma h0 : True := trivial\ncount_heartbeats! in\n"), "`count_heartbeats!`"),
    ("variable! after a helper", block(PROOF, prelude="lemma h0 : True := trivial\nvariable! (h : False)\n"), "`variable!`"),
    ("include? a section variable", block(PROOF, prelude="lemma h0 : True := trivial\ninclude? h\n"), "`include?`"),
    ("omit! a section variable", block(PROOF, prelude="lemma h0 : True := trivial\nomit! [Fact False] in\n"), "`omit!`"),
    ("universe? u", block(PROOF, prelude="lemma h0 : True := trivial\nuniverse? u\n"), "`universe?`"),
    ("instance! inside a helper's range", block(PROOF, prelude="lemma h0 : True := trivial\ninstance! : Fact False := ⟨h⟩\n"), "`instance!`"),
    ("attribute? inside a helper's range", block(PROOF, prelude="lemma h0 : True := trivial\nattribute? [simp] h0\n"), "`attribute?`"),
    ("export? after a helper", block(PROOF, prelude="lemma h0 : True := trivial\nexport? Nat (succ)\n"), "`export?`"),
    ("whatsnew in before the theorem", block(PROOF, prelude="whatsnew in\n"), "`whatsnew`"),
    ("section game around the theorem", block(PROOF + "\nend", prelude="section\nvariable [Fact False]\n"), "`section`"),
    ("variable? inside an interpolated string", block('  have : s!"{variable?}" = "" := rfl\n  rw [hx]'), "inside a string literal"),
    # meta code run while the file is checked
    ("meta helper run by aesop's tactic builder", block("  aesop (add safe 1 tactic t)", prelude=META_TACTIC), "a proof needs none"),  # refused at its `getMainGoal` first
    ("fully qualified meta monad", block(PROOF, prelude="def t : Lean.Elab.Tactic.TacticM Unit := pure ()\n"), "`Lean.Elab.Tactic.TacticM`"),
    ("_root_-qualified meta monad", block(PROOF, prelude="def t : _root_.Lean.Meta.MetaM Unit := pure ()\n"), "meta code"),
    ("IO helper", block(PROOF, prelude='def t : IO Unit := IO.println "x"\n'), "`IO`"),
    ("meta monad abbreviated", block(PROOF, prelude="abbrev M := Lean.Elab.Command.CommandElabM\n"), "meta code"),
    ("open of a meta namespace for the proof", block("  open Lean in\n  rw [hx]"), "`Lean`"),
    ("global open of a meta namespace", block(PROOF, prelude="open Lean.Elab.Tactic\nlemma h0 : True := trivial\n"), "meta code"),
    ("Qq quotation", block(PROOF, prelude="open Qq in\nlemma h0 : True := trivial\n"), "`Qq`"),
    ("aesop tactic builder with a Mathlib tactic", block("  aesop (add safe tactic Mathlib.Tactic.Ring.ring)"), "meta code"),
    ("run_conv", block("  conv => run_conv pure ()\n  rw [hx]"), "`run_conv`"),
    ("unsafeBaseIO in a term", block("  exact (unsafeBaseIO (pure rfl))"), "`unsafeBaseIO`"),
    ("evalTactic through a name", block("  exact evalTactic"), "`evalTactic`"),
    ("meta monad after open Lean Meta", block(PROOF, prelude="open Lean Meta in\ndef t : MetaM Unit := pure ()\n"), "meta code"),
    # native evaluation spelled so the old scan missed it
    ("decide with a positional config", block("  subst hx\n  decide (config := ⟨false, false, true⟩)"), "anonymous-constructor config"),
    ("decide +native inside an interpolation", block('  have : s!"{(by decide +native : 1 = 1)}" = "" := rfl\n  rw [hx]'), "inside a string literal"),
    ("native := true in a config", block("  subst hx\n  decide (config := { native := true })"), "decide +native"),
    # options set from code
    ("trace option", block("  set_option trace.Meta.synthInstance true in\n  rw [hx]"), "banned option"),
    ("elaborator option", block("  set_option Elab.async false in\n  rw [hx]"), "banned option"),
]


@pytest.mark.parametrize("completion,reason", [c[1:] for c in ROUND3], ids=[c[0] for c in ROUND3])
def test_round3_attacks_are_refused_with_a_reason(completion, reason):
    with pytest.raises(Rejected) as info:
        prepare(completion, THM, rechecked=True)
    assert reason in str(info.value), str(info.value)


ROUND3_LEGITIMATE = [
    ("emoji variation selector in a comment", block("  rw [hx] -- checked ✔️\n  norm_num"), "rw [hx]"),
    ("ZWJ emoji in a comment", block("  /- 👨‍👩‍👧 family -/ rw [hx]\n  norm_num"), "rw [hx]"),
    ("emoji sequence in a string", block('  have : "✔️" ≠ "" := by decide\n  rw [hx]'), '"✔️"'),
    ("identifier ending in ! or ?", block("  have h! : x = 513 := by rw [hx]\n  exact h!"), "exact h!"),
    ("exact? is a tactic, not a command", block("  subst hx\n  exact?"), "exact?"),
]


@pytest.mark.parametrize("completion,sent", [c[1:] for c in ROUND3_LEGITIMATE], ids=[c[0] for c in ROUND3_LEGITIMATE])
def test_round3_legitimate_styles_are_sent(completion, sent):
    assert sent in prepare(completion, THM).code


def test_emoji_parts_outside_comments_and_strings_are_still_refused():
    with pytest.raises(Rejected, match="U\\+FE0F"):
        prepare(block("  rw [hx]\ufe0f"), THM)
    with pytest.raises(Rejected, match="U\\+200D"):
        prepare(block("  rw\u200d [hx]"), THM)


def test_open_before_the_theorem_is_accepted_only_when_every_pass_is_rechecked():
    text = block(PROOF, prelude="open Finset in\n")
    with pytest.raises(Rejected, match="could change how the original statement is read"):
        prepare(text, THM)
    assert "open Finset in\ntheorem lean_workbook_101" in prepare(text, THM, rechecked=True).code


def test_the_recorded_proofs_pass_the_round3_policy():
    """The 52 real Goedel-Prover proofs of the fixture are all still sent (none uses meta code)."""
    for path in sorted((FIXTURE / "input").glob("*.lean")):
        source = path.read_text()
        name = source.split("theorem ", 1)[1].split()[0]
        header, statement = source.split(f"theorem {name}", 1)
        thm = Theorem(name, header, f"theorem {name}" + statement.split(":= by", 1)[0])
        assert prepare(f"```lean4\n{source}\n```", thm, rechecked=True).name == name


# -- one meaning per statement (round 4) ------------------------------------------------------------------

# A lean_workbook-style statement with names it does not bind: with auto-bound implicits it means
# "for all x y"; a helper declared first could make it mean something true by `rfl`.
FREE = Theorem(name="lean_workbook_free", header=HEADER, statement="theorem lean_workbook_free (h : x + y = 10) : x = 6")


def free_block(prelude: str, proof: str = "  rfl") -> str:
    return f"```lean4\n{HEADER}\n{prelude}{FREE.statement} := by\n{proof}\n```"


def test_the_header_and_the_reference_turn_auto_bound_names_off():
    sub = prepare(block(), THM, nonce=NONCE)
    for text in (sub.code, sub.reference):
        assert "set_option autoImplicit false\nset_option relaxedAutoImplicit false\n" in text
    assert THM.trusted_header().index("autoImplicit false") < THM.trusted_header().index("open BigOperators")
    # A header that turns them on is overridden, not obeyed.
    loose = Theorem(THM.name, HEADER + "set_option autoImplicit true\n", STATEMENT)
    assert "autoImplicit true" not in loose.trusted_header()
    # A completion that copies the header's lines keeps working: they are dropped, the header sets them.
    copied = block(prelude="set_option autoImplicit false\nset_option relaxedAutoImplicit false\n")
    body = prepare(copied, THM, nonce=NONCE).code
    assert body.count("set_option autoImplicit false") == 1


@pytest.mark.parametrize("prelude, reason", [
    ("def x : ℕ := 6\ndef y : ℕ := 4\n", "named like `x` in the statement"),
    ("def Nat.x : ℕ := 6\ndef Nat.y : ℕ := 4\n", "named like `x` in the statement"),  # reached through `open Nat`
    ("noncomputable def _root_.y : ℕ := 4\n", "named like `y` in the statement"),
    ("@[simp] abbrev Real.x : ℕ := 6\n", "named like `x` in the statement"),
    ("open Nat renaming succ → x\n", "renaming"),
    ("open Nat hiding add\n", "hiding"),
    ("set_option autoImplicit true in\n", "auto-bound names"),
    ("set_option relaxedAutoImplicit true\n", "auto-bound names"),
], ids=["def-x", "def-Nat.x", "root-y", "abbrev-Real.x", "open-renaming", "open-hiding", "autoImplicit-in",
        "relaxed"])
def test_a_helper_or_open_cannot_give_the_statement_another_meaning(prelude, reason):
    with pytest.raises(Rejected) as info:
        prepare(free_block(prelude), FREE)
    assert reason in str(info.value), str(info.value)


def test_helpers_with_other_names_are_still_accepted():
    prepare(free_block("lemma key_step : (6 : ℕ) = 6 := rfl\ndef Nat.helper_x : ℕ := 6\n"), FREE)
    # `Nat` is spelled by no part of this statement, so a helper in namespace Nat is fine.
    prepare(block(prelude="theorem Nat.my_aux : (2 : ℕ) ^ 9 + 1 = 513 := by norm_num\n"), THM)


def test_an_unbound_name_in_the_statement_makes_the_row_defective_and_counted():
    """Lean's answer when the header turns auto-bound names off and the statement spells `x` unbound:
    errors at the statement's line (kimina 2.0.0 reports lines relative to the body). Synthesised in the
    format Lean 4.28 prints (checked with lean-wasm); Lean 4.15 says `unknown identifier 'x'`."""
    sub = prepare(free_block("", "  omega"), FREE, nonce=NONCE)
    first, last = sub.statement_lines
    assert sub.code.split("\n")[first - 1].startswith("theorem lean_workbook_free") and first == last
    line = first - sub.header_lines
    unbound = info("Unknown identifier `x`\n\nNote: It is not possible to treat `x` as an implicitly bound variable "
                   "here because the `autoImplicit` option is set to `false`.", "error", line=line, column=37)
    verdict = judge(result([unbound, *trailer(sub)]), sub)
    assert verdict.status is Status.FAILED and "defective task" in verdict.detail, verdict.detail
    assert verdict.metrics == {"lean/defective_statement": 1.0}
    # The same error in the proof is the proof's: an ordinary failure, not counted.
    in_proof = {**unbound, "pos": {"line": line + 1, "column": 2}, "data": "unknown identifier 'y'"}
    verdict = judge(result([in_proof, *trailer(sub)]), sub)
    assert verdict.status is Status.FAILED and "defective" not in verdict.detail and not verdict.metrics


# -- config terms are data; no output, no monadic state (round 4) --------------------------------------------

ROUND4 = [
    # (id, completion, words in the reason): each shape from the round-4 audit; each passed `prepare` before.
    ("decide .mk positional", block("  subst hx\n  exact absurd (by decide (config := .mk false true true false) : "
                                    "(1 : ℕ) = 1) (by simp)"), "positional constructor"),
    ("config from a helper", block("  decide (config := cfg)", prelude="def cfg : Bool := true\n"), "not a literal"),
    ("config field from a helper", block("  decide (config := { kernel := slow 10 })",
                                         prelude="def slow (n : ℕ) : Bool := n == n\n"), "must be a literal"),
    ("config with", block("  simp (config := { base with decide := true })", prelude="def base : Nat := 1\n"),
     "only `field := literal`"),
    ("linarith discharger", block("  linarith (config := { discharger := done })"), "holds code"),
    ("discharger item", block("  linarith (discharger := done)"), "holds code"),
    ("nlinarith preprocessors", block("  nlinarith (config := { preprocessors := [] })"), "holds code"),
    ("polyrith oracle", block("  linarith (config := { oracle := .simplexAlgorithmSparse })"), "holds code"),
    ("nested action on the state", block("  exact (← get).goals.head!.assign default"), "monadic state"),
    ("monadic set", block("  set { goals := [] }"), "not Mathlib's `set"),
    ("modify", block("  modify fun s => s"), "monadic state"),
    ("liftMetaM", block("  liftMetaM (pure ())"), "monadic state"),
    ("println! forges an answer", block('  have := println! "messages: none"\n  rw [hx]'), "stdout"),
    ("dbg_trace", block('  dbg_trace "x"; rw [hx]'), "output"),
    ("dbgTrace", block('  exact dbgTrace "x" fun _ => by rw [hx]'), "output"),
    ("config item from a helper", block("  subst hx\n  decide (kernel := slow 10)",
                                        prelude="def slow (n : ℕ) : Bool := n == n\n"), "runs a definition of the proof"),
    ("leading-dot helper in a config", block("  subst hx\n  decide (config := { kernel := .slow })",
                                            prelude="def Bool.slow : Bool := true\n"), "runs a definition of the proof"),
    ("StateT.get", block("  exact (StateT.get).run"), "monadic state"),
    ("spaced nested action", block("  exact ( <- read).x"), "nested action"),
    ("unreachable!", block("  exact unreachable!"), "panics"),
    ("aesop runs a def", block("  aesop (add safe 1 t)", prelude="def t := 0\n"), "names a definition"),
    ("aesop runs a dotted def", block("  aesop (add unsafe 50% Nat.t)", prelude="def Nat.t := 0\n"), "names a definition"),
]


@pytest.mark.parametrize("completion,reason", [c[1:] for c in ROUND4], ids=[c[0] for c in ROUND4])
def test_round4_attacks_are_refused_with_a_reason(completion, reason):
    for rechecked in (False, True):
        with pytest.raises(Rejected) as info:
            prepare(completion, THM, rechecked=rechecked)
        assert reason in str(info.value), str(info.value)


@pytest.mark.parametrize("proof", [
    "  simp (config := { decide := true, maxSteps := 100000, zeta := .all }) [hx]",
    "  subst hx\n  decide +kernel",
    "  subst hx\n  simp -zeta +arith",
    "  omega (config := { splitDisjunctions := false })",
    "  set y := x + 1 with hy\n  omega",
    "  set y : ℕ := x + 1 with hy\n  omega",
    "  rw [← Nat.add_zero x, hx]",
    "  aesop (add safe Nat.succ_le_of_lt) (rule_sets := [-builtin])",
    "  nlinarith [sq_nonneg (x - 1), hx]",
    "  have := Nat.le_of_lt_succ (m := x) (by omega)\n  omega",
    "  obtain ⟨k, hk⟩ : ∃ k, x = k := ⟨x, rfl⟩\n  omega",
    "  have h := ([x].get ⟨0, by simp⟩)\n  omega",
])
def test_legitimate_configs_and_lookalikes_are_accepted(proof):
    prepare(block(proof), THM)


# -- names as Lean reads them; `where` and `let rec` helpers are definitions (round 5) ---------------------

WHERE = "def vrl_h : ℕ := go 0 where go (n : ℕ) : ℕ := n\n"
# Helpers under a theorem: a theorem's `where`/`let rec` helper is a `def` (Lean 4.28), though its parent is not.
WHERE_LINES = "theorem vrl_t : True := trivial where\n  a (n : ℕ) : ℕ := n\n  b (n : ℕ) : ℕ := n\n"
WHERE_SEMICOLON = "theorem vrl_t : True := trivial where a (n : ℕ) : ℕ := n; b (n : ℕ) : ℕ := n\n"
LET_REC = "theorem vrl_t : True := let rec a (n : ℕ) : ℕ := n, b (n : ℕ) : ℕ := n; trivial\n"
SLOW = "def slow (n : ℕ) : Bool := n == n\n"

ROUND5 = [
    # (id, completion, words in the reason): each passed `prepare` before; each shape checked in Lean 4.28.
    ("escaped native field in a config", block("  subst hx\n  decide (config := { «native» := true })"), "decide +native"),
    ("escaped native flag", block("  subst hx\n  decide +«native»"), "decide +native"),
    ("escaped native item", block("  subst hx\n  decide («native» := true)"), "decide +native"),
    ("escaped config with .mk", block("  subst hx\n  decide («config» := .mk false true true false)"), "positional constructor"),
    ("escaped config with code", block("  simp («config» := id { maxSteps := 1 }) [hx]"), "not a literal"),
    ("escaped meta field item", block("  linarith («discharger» := done)"), "holds code"),
    ("escaped meta field in a config", block("  linarith (config := { «oracle» := .simplexAlgorithmSparse })"), "holds code"),
    ("escaped aesop tactic builder", block("  aesop (add safe 1 «tactic» t)"), "meta code"),
    ("escaped monadic get", block("  exact («get»).x"), "monadic state"),
    ("escaped helper name in a config item", block("  subst hx\n  decide (kernel := slow 10)", prelude="def «slow» (n : ℕ) : Bool := n == n\n"),
     "runs a definition of the proof"),
    ("helper reached by dot notation", block("  simp (maxSteps := vrl_z.succ) [hx]", prelude="def vrl_z : ℕ := 0\n"),
     "runs a definition of the proof"),
    ("where helper in a config item", block("  simp (maxSteps := vrl_h.go 2) [hx]", prelude=WHERE), "runs a definition of the proof"),
    ("where helper as an aesop rule", block("  aesop (add safe 1 vrl_h.go)", prelude=WHERE), "names a definition"),
    ("theorem's where helper in a config item", block("  simp (maxSteps := vrl_t.a 2) [hx]", prelude=WHERE_LINES),
     "runs a definition of the proof"),
    ("second where helper, next line", block("  simp (maxSteps := vrl_t.b 2) [hx]", prelude=WHERE_LINES),
     "runs a definition of the proof"),
    ("second where helper, after ;", block("  aesop (add safe 1 vrl_t.b)", prelude=WHERE_SEMICOLON), "names a definition"),
    ("let rec helper", block("  simp (maxSteps := vrl_t.a 2) [hx]", prelude=LET_REC), "runs a definition of the proof"),
    ("second let rec helper", block("  aesop (add safe 1 vrl_t.b)", prelude=LET_REC), "names a definition"),
    ("where helper named like the theorem", block(PROOF, prelude="def vrl_h : ℕ := 0 where lean_workbook_101 : ℕ := 1\n"),
     "named like the theorem"),
    ("helper renamed by open ... renaming", block("  open Nat renaming vrl_one → fast in\n  simp (maxSteps := fast 0) [hx]",
                                                  prelude="def Nat.vrl_one (n : ℕ) : ℕ := n + 1\n"), "runs a definition of the proof"),
    # inside a string that may be an interpolation: `s!"{e}"` elaborates `e`, `by` blocks included
    ("escaped native inside an interpolation", block('  have : s!"{(by decide +«native» : 1 = 1)}" = "" := rfl\n  rw [hx]'),
     "inside a string literal"),
    ("meta field inside an interpolation", block('  have : s!"{(by linarith (discharger := done) : 1 = 1)}" = "" := rfl\n  rw [hx]'),
     "holds code"),
    ("let rec inside an interpolation", block("  simp (maxSteps := vrl_t.go 0) [hx]", prelude='theorem vrl_t : True := by\n'
                                             '  have : s!"{let rec go (n : ℕ) : ℕ := n + 1; go 0}" = "1" := rfl\n  trivial\n'),
     "runs a definition of the proof"),
    ("helper in a config item inside an interpolation",
     block('  have : s!"{(by decide (kernel := slow 10) : 1 = 1)}" = "" := rfl\n  rw [hx]', prelude=SLOW), "runs a definition"),
]


@pytest.mark.parametrize("completion,reason", [c[1:] for c in ROUND5], ids=[c[0] for c in ROUND5])
def test_round5_names_as_lean_reads_them_and_where_helpers_are_refused(completion, reason):
    for rechecked in (False, True):
        with pytest.raises(Rejected) as info:
            prepare(completion, THM, rechecked=rechecked)
        assert reason in str(info.value), str(info.value)


def test_a_where_helper_named_like_the_statement_is_refused_as_a_def_is():
    with pytest.raises(Rejected, match="named like `x` in the statement"):
        prepare(free_block("def vrl_h : ℕ := 0 where x : ℕ := 6\n"), FREE)
    with pytest.raises(Rejected, match="named like `y` in the statement"):
        prepare(free_block("theorem vrl_t : True := let rec y : ℕ := 4; trivial\n"), FREE)


@pytest.mark.parametrize("completion,sent", [
    # a `where` helper lemma used as a term, the theorem's own and a helper's
    (block("  exact aux x hx\nwhere\n  aux (y : ℕ) (hy : y = 2^9 + 1) : y = 513 := by\n    rw [hy]"), "where\n  aux (y : ℕ)"),
    (block("  rw [hx]", prelude="def vrl_h (n : ℕ) : ℕ := go n where go (m : ℕ) : ℕ := m + 1\n"), "where go (m : ℕ)"),
    (block("  exact vrl_t.a 1 ▸ hx", prelude=LET_REC), "let rec a (n : ℕ)"),
    # rules that name a word still let other words through: `-native`, named arguments, aesop lemmas
    (block("  subst hx\n  decide -native"), "decide -native"),
    (block("  aesop (add safe Nat.le_refl)", prelude=WHERE), "aesop (add safe Nat.le_refl)"),
    (block("  have := Nat.le_of_lt_succ (m := x) (by omega)\n  omega", prelude=WHERE), "(m := x)"),
    # an `open` compared as Lean reads it: `«Real»` is the header's `Real`
    (block(PROOF, prelude="open «Real»\n"), "open «Real»"),
], ids=["theorem's where lemma", "helper's where def", "let rec", "-native", "aesop lemma beside a where helper",
        "named argument beside a where helper", "escaped open of a header namespace"])
def test_round5_legitimate_styles_are_sent(completion, sent):
    assert sent in prepare(completion, THM).code
