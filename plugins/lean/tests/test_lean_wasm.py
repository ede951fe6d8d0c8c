"""The policy's assumptions about Lean, checked against a real Lean 4 (lean-wasm: Lean 4.28, core only).

There is no native Lean here, but `../shared/tools/lean-wasm` runs a WebAssembly build of Lean 4.28
(Init, Std, Lean; no Mathlib) under Node. `scripts/test` builds it into a cache outside the checkout
(`scripts/lean-wasm`; `lean_wasm.py` finds it, or builds it on the first `lean()` call); these tests skip,
with the reason, only where it cannot be built (no tool, no npm), and fail where its build failed.
4.28 is not the kimina image's v4.15.0: what is checked here is what both versions share (auto-bound
names, name resolution through `open`, which config terms Lean accepts and evaluates), and that
`checker/VrlCheck.lean` names only things that exist. Each file is
checked once (30-60 s on the shared machine), so each test checks many facts on one run.
"""

from __future__ import annotations

import pytest
from lean_wasm import REPO, lean, missing
from vrl_lean.policy import Rejected, Theorem, prepare

CHECKER = REPO / "plugins" / "lean" / "vrl_lean" / "checker" / "VrlCheck.lean"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing() is not None, reason=str(missing()))]


def errors(messages: dict[int, list[dict]], line: int) -> list[str]:
    return [m["data"] for m in messages.get(line, []) if m["severity"] == "error"]


# Each fact: (a marker on the theorem's line, whether Lean accepts that line, what the policy does with
# the same shape in a completion: None = accepts, else words of its refusal).
FACTS = """\
set_option autoImplicit false
set_option relaxedAutoImplicit false
theorem unbound_off (h : x + y = 10) : x = 6 := by sorry
set_option autoImplicit true in
theorem unbound_on (h : x + y = 10) : x = 6 := by sorry
def x : Nat := 6
def y : Nat := 4
set_option autoImplicit true in
theorem captured (h : x + y = 10) : x = 6 := by rfl
namespace Nat
def zz : Nat := 6
end Nat
open Nat in
theorem captured_open : zz = 6 := rfl
theorem cfg_mk : 2 + 2 = 4 := by decide (config := .mk false true true false)
theorem cfg_anon : 2 + 2 = 4 := by decide (config := ⟨false, true, true, false⟩)
theorem cfg_flags : 2 + 2 = 4 := by decide +kernel
theorem cfg_literal : 2 + 2 = 4 := by simp (config := { decide := true, maxSteps := 1000, zeta := false })
def cfgFromHelper : Lean.Meta.Simp.Config := { decide := true }
theorem cfg_helper : 2 + 2 = 4 := by simp (config := cfgFromHelper)
"""


def _line(name: str) -> int:
    return next(i for i, text in enumerate(FACTS.splitlines(), 1) if f"theorem {name} " in text)


def test_the_policy_refuses_what_real_lean_would_accept_with_another_meaning(tmp_path):
    path = tmp_path / "Facts.lean"
    path.write_text(FACTS)
    messages = lean(path)
    # 1. Auto-bound names: off (the trusted header), an unbound name is an error on the statement's line,
    # in words `judge` recognises as the row's defect; on (Lean's default), the same text elaborates.
    off = errors(messages, _line("unbound_off"))
    assert off and all("unknown identifier" in e.lower() for e in off), off
    assert not errors(messages, _line("unbound_on"))
    # 2. Capture: with helpers named like the statement's names, the text means something true by `rfl`;
    # reached through `open Nat` too. Both shapes are refused by `prepare`.
    assert not errors(messages, _line("captured")) and not errors(messages, _line("captured_open"))
    header = "import Mathlib\nopen Nat\n"
    free = Theorem("captured", header, "theorem captured (h : x + y = 10) : x = 6")
    for helpers in ("def x : Nat := 6\ndef y : Nat := 4\n", "def Nat.x : Nat := 6\n"):
        with pytest.raises(Rejected, match="named like"):
            prepare(f"```lean4\n{helpers}{free.statement} := by\n  rfl\n```", free)
    # 3. Config terms: Lean accepts a positional `.mk`, an anonymous constructor and a helper's value
    # (each evaluated as code), as well as flags and literal fields. The policy keeps the last two only.
    for name in ("cfg_mk", "cfg_anon", "cfg_flags", "cfg_literal", "cfg_helper"):
        assert not errors(messages, _line(name)), (name, messages.get(_line(name)))
    thm = Theorem("t", "import Mathlib\n", "theorem t : 2 + 2 = 4")
    for tactic, refused in (("decide (config := .mk false true true false)", "positional"),
                            ("decide (config := ⟨false, true, true, false⟩)", "anonymous-constructor"),
                            ("simp (config := cfgFromHelper)", "not a literal"),
                            ("decide +kernel", None),
                            ("simp (config := { decide := true, maxSteps := 1000, zeta := false })", None)):
        text = f"```lean4\ntheorem t : 2 + 2 = 4 := by\n  {tactic}\n```"
        if refused is None:
            prepare(text, thm)
        else:
            with pytest.raises(Rejected, match=refused):
                prepare(text, thm)


def test_the_checker_names_only_what_exists_in_real_lean():
    """VrlCheck.lean elaborates: every error left is the kit's code generation (see its README), none
    a missing name, signature or instance (4.15's `String.take` returned a String; 4.28's a Slice)."""
    messages = lean(CHECKER)
    codegen = ("Unknown constant `_private.", "failed to compile definition", "compiler IR check failed")
    other = [(line, e) for line, ms in messages.items() for e in errors(messages, line)
             if not any(c in e for c in codegen)]
    assert not other, other
