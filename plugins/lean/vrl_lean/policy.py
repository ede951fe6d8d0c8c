"""The validity policy: what decides whether a Lean proof earns its reward.

kimina-lean-server only returns Lean's messages; everything else is decided here. Before sending,
`prepare` extracts the model's proof, refuses every construct that could make Lean accept a false
statement (after stripping comments, on the raw and the NFKC-normalised text, with suspicious Unicode
refused outright), and rebuilds the file from the trusted header, the ORIGINAL statement and the
proof, with `#print axioms NAME` appended. After checking, `judge` accepts only a run with no error,
no sorry (the `sorries` list and the warning), and an axioms report listing nothing beyond the three
standard axioms. Every refusal carries a reason a researcher can read.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vrl.types import Status, Verdict
from vrl_lean.lexer import LexError, declaration_re, strip_comments, top_level_assign

ALLOWED_AXIOMS = frozenset({"propext", "Classical.choice", "Quot.sound"})
DEFAULT_MAX_HEARTBEATS = 400_000


class Rejected(ValueError):
    """A completion refused before it reaches Lean; the message is the reason."""


@dataclass(frozen=True)
class Theorem:
    """A trusted problem: the theorem's name, the file header and the statement (without `:=`)."""

    name: str
    header: str
    statement: str

    def __post_init__(self) -> None:
        if not declaration_re(self.name).match(self.statement.lstrip()):
            raise ValueError(f"statement must start with `theorem {self.name}`: {self.statement[:80]!r}")

    def trusted_header(self, max_heartbeats: int = DEFAULT_MAX_HEARTBEATS) -> str:
        """Imports first (the server splits them off by position), then a finite heartbeat limit, then the rest."""
        if max_heartbeats < 1:
            raise ValueError("max_heartbeats must be a positive number: 0 would mean no limit")
        lines = [ln.strip() for ln in strip_comments(self.header).splitlines() if ln.strip()]
        imports = [ln for ln in lines if ln.startswith("import ")]
        rest = [ln for ln in lines if not ln.startswith("import ") and not _HEARTBEATS_LINE.match(ln)]
        return "\n".join([*imports, "", f"set_option maxHeartbeats {max_heartbeats}", "", *rest]).strip() + "\n"

    def imports(self) -> set[str]:
        return {ln.strip() for ln in strip_comments(self.header).splitlines() if ln.strip().startswith("import ")}


_HEARTBEATS_LINE = re.compile(r"set_option\s+maxHeartbeats\s+\d+\s*$")

# -- extraction ---------------------------------------------------------------------------------------

_FENCE = re.compile(r"```lean4?[ \t]*\r?\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```lean4?[ \t]*\r?\n")


def extract_code(completion: str) -> str:
    """The last ```lean4 block after `</think>`; an unfinished think block is refused.

    A completion without any think tags may be a fenced block or bare Lean code (for `vrl verify`).
    """
    if "</think>" in completion:
        region = completion.rsplit("</think>", 1)[1]
        where = " after </think>"
    elif "<think>" in completion:
        raise Rejected("unfinished <think> block: no </think>, so there is no final answer (out of tokens?)")
    else:
        region, where = completion, ""
    blocks = list(_FENCE.finditer(region))
    tail = region[blocks[-1].end():] if blocks else region
    if _OPEN_FENCE.search(tail):
        raise Rejected(f"the last ```lean4 block{where} is never closed (the completion was cut off?)")
    if blocks:
        return blocks[-1].group(1)
    if where or "```" in region:
        raise Rejected(f"no ```lean4 code block{where}")
    return region


# -- what may not appear --------------------------------------------------------------------------------

_WORD = r"(?<![\w'!?]){}(?![\w'!?])"  # a whole identifier component, even after a dot (`_root_.sorryAx`)
_CMD = r"(?<![\w'!?.]){}(?![\w'!?])"  # a command keyword: not after a dot (`Foo.syntax` is a name)


def _rule(template: str, word: str, reason: str) -> tuple[re.Pattern[str], str]:
    return re.compile(template.format(re.escape(word))), reason


BANNED: list[tuple[re.Pattern[str], str]] = [
    _rule(_WORD, "sorry", "`sorry` leaves the goal unproved"),
    _rule(_WORD, "admit", "`admit` is `sorry` under another name"),
    _rule(_WORD, "sorryAx", "`sorryAx` is the axiom behind `sorry`"),
    _rule(_WORD, "stop", "`stop` turns the rest of the proof into `sorry`"),
    _rule(_CMD, "axiom", "`axiom` would assume whatever is to be proved"),
    _rule(_WORD, "native_decide", "`native_decide` trusts compiled code instead of the kernel"),
    (re.compile(r"\+\s*native(?![\w'!?])|(?<![\w'!?.])native\s*:="), "`decide +native` trusts compiled code instead of the kernel"),
    _rule(_WORD, "ofReduceBool", "`Lean.ofReduceBool` trusts compiled code instead of the kernel"),
    _rule(_WORD, "ofReduceNat", "`Lean.ofReduceNat` trusts compiled code instead of the kernel"),
    _rule(_WORD, "trustCompiler", "`Lean.trustCompiler` trusts compiled code instead of the kernel"),
    _rule(_WORD, "implemented_by", "`implemented_by` swaps a definition for unchecked code"),
    _rule(_WORD, "extern", "`extern` swaps a definition for unchecked code"),
    _rule(_CMD, "unsafe", "`unsafe` code is outside the kernel's checks"),
    _rule(_CMD, "opaque", "`opaque` declares a constant whose definition is never checked"),
    _rule(_CMD, "elab", "`elab` defines new elaborators (arbitrary meta code)"),
    _rule(_CMD, "elab_rules", "`elab_rules` defines new elaborators (arbitrary meta code)"),
    _rule(_CMD, "macro", "`macro` can hide `sorry` or other banned constructs behind new syntax"),
    _rule(_CMD, "macro_rules", "`macro_rules` can hide `sorry` or other banned constructs behind new syntax"),
    _rule(_CMD, "syntax", "`syntax` declares new syntax (used to hide banned constructs)"),
    _rule(_CMD, "notation", "`notation` can hide `sorry` or other banned constructs behind new syntax"),
    *[_rule(_CMD, w, f"`{w}` declares new notation (used to hide banned constructs)") for w in ("infix", "infixl", "infixr", "prefix", "postfix")],
    _rule(_CMD, "run_tac", "`run_tac` runs arbitrary meta code"),
    _rule(_CMD, "run_cmd", "`run_cmd` runs arbitrary meta code"),
    _rule(_CMD, "run_elab", "`run_elab` runs arbitrary meta code"),
    _rule(_CMD, "run_meta", "`run_meta` runs arbitrary meta code"),
    _rule(_WORD, "by_elab", "`by_elab` runs arbitrary meta code"),
    (re.compile(r"#exit(?![\w'!?])"), "`#exit` stops Lean before the rest of the file is checked"),
    (re.compile(r"#eval(?![\w'!?])"), "`#eval` runs arbitrary code"),
    (
        re.compile(r"#(print|check|reduce|synth|guard_msgs|guard|help|find|simp|norm_num|conv|where|lint|time|html|widget)(?![\w'!?])"),
        "Lean commands (`#print`, `#check`, ...) have no place in a proof (they could forge the axioms report)",
    ),
]

# A proof (the text after the statement's `:=`) must not start new top-level declarations.
_DECLARATIONS = re.compile(
    r"(?<![\w'!?.])(theorem|lemma|def|example|instance|abbrev|structure|class|inductive|namespace|section|mutual|"
    r"universe|variable|initialize|builtin_initialize|declare_syntax_cat)(?![\w'!?])"
)
_SET_OPTION = re.compile(r"(?<![\w'!?.])set_option\s+([^\s]+)(?:\s+([^\s]+))?")
_IMPORT = re.compile(r"(?<![\w'!?.])import\s+([^\s]+)")

# Characters that render as nothing or reorder text: they make what a reviewer reads differ from what Lean reads.
_INVISIBLE = {0x115F, 0x1160, 0x3164, 0xFFA0, 0x2800, 0x034F, 0x180E}


def check_unicode(text: str) -> None:
    """Refuse control, format (bidi, zero-width), private-use, unassigned and look-alike space characters."""
    for offset, ch in enumerate(text):
        if ch in "\n\t\r" or " " <= ch <= "~":
            continue
        cat = unicodedata.category(ch)
        code = ord(ch)
        if cat in ("Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp", "Zs") or code in _INVISIBLE or 0xFE00 <= code <= 0xFE0F or 0xE0100 <= code <= 0xE01EF:
            line = text.count("\n", 0, offset) + 1
            name = unicodedata.name(ch, "unnamed")
            raise Rejected(f"suspicious Unicode character U+{code:04X} ({name}, category {cat}) on line {line} of the proof block")


def check_banned(text: str) -> None:
    """Refuse the first banned construct, on the text and on its NFKC normal form (look-alike letters)."""
    normal = unicodedata.normalize("NFKC", text)
    for candidate, how in ((text, ""), (normal, " (written with look-alike Unicode characters)")):
        for pattern, reason in BANNED:
            match = pattern.search(candidate)
            if match:
                line = candidate.count("\n", 0, match.start()) + 1
                raise Rejected(f"banned construct `{match.group(0).strip()}`{how} on line {line}: {reason}")
        if candidate is normal and normal == text:
            break


def _check_options(text: str, max_heartbeats: int, in_proof: bool) -> None:
    for match in _SET_OPTION.finditer(text):
        option, value = match.group(1), match.group(2) or ""
        if option.startswith("debug."):
            raise Rejected(f"banned option `set_option {option}`: debug options can skip the kernel's checks")
        if option != "maxHeartbeats":
            raise Rejected(f"banned option `set_option {option}`: only maxHeartbeats may be set")
        if in_proof and not (value.isdigit() and 0 < int(value) <= max_heartbeats):
            raise Rejected(
                f"`set_option maxHeartbeats {value}` in the proof: the limit must be between 1 and {max_heartbeats}"
            )


# -- rebuilding the file --------------------------------------------------------------------------------


def prepare(completion: str, theorem: Theorem, max_heartbeats: int = DEFAULT_MAX_HEARTBEATS) -> str:
    """The file to send to Lean for this completion, or `Rejected` with the reason.

    The file is the trusted header, the original statement and the model's proof (comments removed:
    exactly the text that was scanned), followed by `#print axioms NAME`.
    """
    code = extract_code(completion)
    check_unicode(code)
    try:
        code = strip_comments(code)
    except LexError as exc:
        raise Rejected(str(exc)) from None
    check_banned(code)

    decl = declaration_re(theorem.name)
    found = list(decl.finditer(code))
    if not found:
        raise Rejected(_missing_declaration(code, theorem.name))
    if len(found) > 1:
        raise Rejected(f"`{theorem.name}` is declared {len(found)} times; exactly one declaration is allowed")
    match = found[0]

    prelude = code[: match.start()]
    for imp in _IMPORT.finditer(prelude):
        if f"import {imp.group(1)}" not in theorem.imports():
            raise Rejected(f"extra `import {imp.group(1)}`: only the problem's header may import")
    _check_options(prelude, max_heartbeats, in_proof=False)

    expected = strip_comments(theorem.statement).strip()
    end = _match_statement(code, match.end(), expected[decl.match(expected).end():])
    proof = code[end:]
    if proof.strip() in ("", "by"):
        raise Rejected("empty proof after `:=`")
    for bad in (_IMPORT.search(proof), _DECLARATIONS.search(proof)):
        if bad:
            raise Rejected(f"the proof may not contain `{bad.group(0).split()[0]}`: it must be the body of `{theorem.name}` only")
    _check_options(proof, max_heartbeats, in_proof=True)

    header = theorem.trusted_header(max_heartbeats)
    return f"{header}\n{expected} :={proof.rstrip()}\n\n#print axioms {theorem.name}\n"


def _missing_declaration(code: str, name: str) -> str:
    if re.search(r"(?<![\w'!?.])example(?![\w'!?])", code):
        return f"uses `example` instead of `theorem {name}`: the original theorem must be proved under its own name"
    other = re.search(r"(?<![\w'!?.])(theorem|lemma)\s+([^\s(:{\[]+)", code)
    if other:
        return f"declares `{other.group(1)} {other.group(2)}` but no `theorem {name}` (renamed theorem?)"
    return f"no `theorem {name}` declaration in the Lean block"


def _match_statement(code: str, start: int, expected_rest: str) -> int:
    """Compare the model's statement with the original (ignoring whitespace); return where the proof starts."""
    want = "".join(expected_rest.split())
    i, j = start, 0
    while j < len(want):
        while i < len(code) and code[i].isspace():
            i += 1
        if i >= len(code) or code[i] != want[j]:
            assign = top_level_assign(code, start)
            got = " ".join(code[start : assign if assign is not None else start + 200].split())
            raise Rejected(
                "the statement differs from the original: expected "
                f"`{' '.join(expected_rest.split())[:300]}`, got `{got[:300]}`"
            )
        i, j = i + 1, j + 1
    while i < len(code) and code[i].isspace():
        i += 1
    if not code.startswith(":=", i):
        tail = " ".join(code[i : i + 80].split())
        raise Rejected(f"the statement differs from the original: it continues with `{tail}` instead of `:=`")
    return i + 2


# -- judging Lean's answer ------------------------------------------------------------------------------

_AXIOMS = re.compile(r"^'?(?P<name>.+?)'? depends on axioms: \[(?P<axioms>[^\]]*)\]\s*$", re.DOTALL)
_NO_AXIOMS = re.compile(r"^'?(?P<name>.+?)'? does not depend on any axioms\s*$")


def judge(result: Mapping[str, Any], name: str, *, require_axiom_audit: bool = True) -> Verdict:
    """Turn one server result (`/api/check` or legacy `/verify` shape) into a verdict.

    `require_axiom_audit=False` exists only to replay recorded runs that never appended
    `#print axioms`; every real check requires the audit.
    """
    elapsed = _elapsed(result)
    error = result.get("error")
    if error:
        status = Status.TIMEOUT if "timed out" in str(error).lower() else Status.CRASHED
        return Verdict.fail(status, f"Lean server: {error}", elapsed_s=elapsed)
    response = result.get("response")
    if not isinstance(response, Mapping):
        return Verdict.fail(Status.CRASHED, "Lean server returned neither a response nor an error", elapsed_s=elapsed)
    if "message" in response and "messages" not in response:
        return Verdict.fail(Status.CRASHED, f"Lean REPL error: {response['message']}", elapsed_s=elapsed)
    messages = [m for m in response.get("messages") or [] if isinstance(m, Mapping)]
    errors = [m for m in messages if m.get("severity") == "error"]
    if errors:
        extra = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return Verdict.fail(Status.FAILED, f"Lean error {_where(errors[0])}: {_first_line(errors[0])}{extra}", elapsed_s=elapsed)
    if response.get("sorries"):
        return Verdict.fail(Status.FAILED, "the proof contains `sorry` (Lean reported sorries)", elapsed_s=elapsed)
    for m in messages:
        if "declaration uses 'sorry'" in str(m.get("data", "")):
            return Verdict.fail(Status.FAILED, f"Lean warning {_where(m)}: declaration uses 'sorry'", elapsed_s=elapsed)
    if require_axiom_audit:
        problem = _audit(messages, name)
        if problem:
            return Verdict.fail(Status.FAILED, problem, elapsed_s=elapsed)
    warnings = sum(m.get("severity") == "warning" for m in messages)
    audited = "axioms audited" if require_axiom_audit else "axioms NOT audited (replay)"
    return Verdict.ok(f"Lean accepted the proof ({warnings} warnings; {audited})", elapsed_s=elapsed)


def _audit(messages: list[Mapping[str, Any]], name: str) -> str | None:
    """None if exactly one axioms report names `name` and lists only allowed axioms, else the reason."""
    reports = []
    for m in messages:
        data = str(m.get("data", "")).strip()
        hit = _AXIOMS.match(data) or _NO_AXIOMS.match(data)
        if hit:
            reports.append(hit)
    if not reports:
        return f"no `#print axioms {name}` report in Lean's output: the axioms could not be audited"
    if len(reports) > 1:
        return f"{len(reports)} axioms reports in Lean's output (expected exactly one): the proof printed its own"
    report = reports[0]
    if report.group("name").strip("«»") != name:
        return f"the axioms report is for `{report.group('name')}`, not `{name}`"
    axioms = [a.strip() for a in report.groupdict().get("axioms", "").split(",") if a.strip()] if "axioms" in report.groupdict() else []
    extra = [a for a in axioms if a not in ALLOWED_AXIOMS]
    if extra:
        return f"the proof depends on axioms beyond propext, Classical.choice, Quot.sound: {', '.join(extra)}"
    return None


def _elapsed(result: Mapping[str, Any]) -> float:
    for source in (result, result.get("response") if isinstance(result.get("response"), Mapping) else {}):
        value = source.get("time")
        if isinstance(value, (int, float)) and value >= 0:
            return float(value)
    return 0.0


def _where(message: Mapping[str, Any]) -> str:
    pos = message.get("pos") or {}
    return f"at line {pos.get('line', '?')}, column {pos.get('column', '?')}"


def _first_line(message: Mapping[str, Any]) -> str:
    data = str(message.get("data", "")).strip()
    first = data.splitlines()[0] if data else "(no message)"
    return first[:300]
