"""The validity policy: what decides whether a Lean proof earns its reward.

kimina-lean-server only returns Lean's messages; everything else is decided here. Before sending,
`prepare` extracts the model's Lean block, tokenises it as Lean does, and accepts only an allow-list
at the top level: the theorem under its original statement, helper `theorem`/`lemma`/`def`/`abbrev`
declarations, `open`, and `set_option` for options that cannot weaken checking (with bounds). Every
other command (`#eval!`, `axiom`, `elab`, ...) and every banned name inside a proof (`sorry`,
`native_decide`, ...) is refused with a reason. The file is rebuilt from the trusted header, the
model's declarations with the ORIGINAL statement, and a trailer that the model cannot write:
`#print axioms NAME` and `#print "vrl audit NONCE"` with a fresh random nonce per request.
After checking, `judge` accepts only an answer that echoes that nonce where Lean prints it, has no
error, no sorry (the `sorries` list and the warning), and an axioms report listing nothing beyond
the three standard axioms. Every refusal carries a reason a researcher can read.
"""

from __future__ import annotations

import functools
import re
import secrets
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from vrl.types import Status, Verdict
from vrl_lean.lexer import LexError, Token, declaration_re, strip_comments, tokenize, top_level_assign

ALLOWED_AXIOMS = frozenset({"propext", "Classical.choice", "Quot.sound"})
DEFAULT_MAX_HEARTBEATS = 400_000
MAX_REC_DEPTH = 100_000
"""Upper bound for `set_option maxRecDepth N` (Lean's default is 512; Mathlib proofs use a few thousand)."""


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
        return _trusted_header(self.header, max_heartbeats)

    def imports(self) -> set[str]:
        return set(_header_lines(self.header)[0])


@functools.lru_cache(maxsize=4096)
def _header_lines(header: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(import lines, other lines) of a trusted header, comments removed (cached: every prepare needs it)."""
    lines = [ln.strip() for ln in strip_comments(header).splitlines() if ln.strip()]
    return tuple(ln for ln in lines if ln.startswith("import ")), tuple(ln for ln in lines if not ln.startswith("import "))


@functools.lru_cache(maxsize=4096)
def _header_opens(header: str) -> frozenset[str]:
    """Namespaces the trusted header opens."""
    return frozenset(w for ln in _header_lines(header)[1] if ln.startswith("open ") for w in ln.split()[1:] if w != "scoped")


# One meaning per statement: with auto-bound implicits on (Lean's default), a name the statement does
# not bind means "for all x", and a helper declared before the theorem can give it another meaning. Off,
# such a statement does not elaborate: the row is defective, and its reference fails the re-check.
NO_AUTO_IMPLICIT = ("set_option autoImplicit false", "set_option relaxedAutoImplicit false")


@functools.lru_cache(maxsize=4096)
def _trusted_header(header: str, max_heartbeats: int) -> str:
    imports, rest = _header_lines(header)
    rest = tuple(ln for ln in rest if not _HEARTBEATS_LINE.match(ln) and not _AUTO_IMPLICIT_LINE.match(ln))
    return "\n".join([*imports, "", f"set_option maxHeartbeats {max_heartbeats}", *NO_AUTO_IMPLICIT, "",
                      *rest]).strip() + "\n"


@functools.lru_cache(maxsize=4096)
def _statement_tail(statement: str, name: str) -> tuple[str, str]:
    """(the statement without comments, its text after `theorem NAME`)."""
    expected = strip_comments(statement).strip()
    return expected, expected[declaration_re(name).match(expected).end():]


_HEARTBEATS_LINE = re.compile(r"set_option\s+maxHeartbeats\s+\d+\s*$")
_AUTO_IMPLICIT_LINE = re.compile(r"set_option\s+(relaxedAutoImplicit|autoImplicit)\s+\w+\s*$")


@functools.lru_cache(maxsize=4096)
def statement_names(statement: str, name: str) -> frozenset[str]:
    """Every name part the statement (after `theorem NAME`) spells: `x`, `Nat`, `succ` of `Nat.succ`,
    `foo` of `a.foo`. A helper with one of these as its last part could give the text another meaning."""
    _, rest = _statement_tail(statement, name)
    return frozenset(part for t in tokenize(rest, strict=False).tokens if t.kind == "word"
                     for part in t.parts if part != "_root_")

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


# -- what may appear ---------------------------------------------------------------------------------

# Names refused wherever they appear in code (as any part of a dotted name: `_root_.sorryAx`).
BANNED_NAMES: dict[str, str] = {
    "sorry": "`sorry` leaves the goal unproved",
    "admit": "`admit` is `sorry` under another name",
    "sorryAx": "`sorryAx` is the axiom behind `sorry`",
    "native_decide": "`native_decide` trusts compiled code instead of the kernel",
    "ofReduceBool": "`Lean.ofReduceBool` trusts compiled code instead of the kernel",
    "ofReduceNat": "`Lean.ofReduceNat` trusts compiled code instead of the kernel",
    "trustCompiler": "`Lean.trustCompiler` trusts compiled code instead of the kernel",
    "implemented_by": "`implemented_by` swaps a definition for unchecked code",
    "extern": "`extern` swaps a definition for unchecked code",
    "run_tac": "`run_tac` runs arbitrary meta code",
    "by_elab": "`by_elab` runs arbitrary meta code",
    "run_conv": "`run_conv` runs arbitrary meta code",
    "unsafeIO": "`unsafeIO` runs IO from pure code",
    "unsafeBaseIO": "`unsafeBaseIO` runs IO from pure code",
    "unsafeEIO": "`unsafeEIO` runs IO from pure code",
    "unsafeCast": "`unsafeCast` bypasses the type checker",
    "evalExpr": "`evalExpr` runs compiled code at check time",
    "evalTactic": "`evalTactic` runs meta code",
    # Output and debugging hooks: what they print lands on the REPL's stdout, the channel that carries
    # Lean's answer (a forged answer, and a stale one for the next request), or they stall the process.
    "println!": "`println!` writes to the Lean REPL's stdout, the channel its answer travels on",
    "dbg_trace": "`dbg_trace` writes to the Lean process's output while the proof is checked",
    "dbgTrace": "`dbgTrace` writes to the Lean process's output while the proof is checked",
    "dbgTraceIfShared": "`dbgTraceIfShared` writes to the Lean process's output while the proof is checked",
    "dbgTraceVal": "`dbgTraceVal` writes to the Lean process's output while the proof is checked",
    "dbgStackTrace": "`dbgStackTrace` writes to the Lean process's output while the proof is checked",
    "dbgSleep": "`dbgSleep` stalls the Lean process",
    "panic!": "`panic!` writes to the Lean process's output",
    "unreachable!": "`unreachable!` panics, writing to the Lean process's output",
    "assert!": "`assert!` panics, writing to the Lean process's output",
}

# Fields of tactic configurations whose values are code (Mathlib's `LinarithConfig.discharger :
# TacticM Unit`, its `preprocessors` and `oracle`): set, they run while the proof is checked.
META_FIELDS: dict[str, str] = {
    f: f"the config field `{f}` holds code that runs while the proof is checked"
    for f in ("discharger", "discharge", "dischargeWrapper", "preprocessors", "preprocessor", "oracle", "prover",
              "tactic", "tac", "run", "elab", "proc", "simprocs")
}
CONFIG_NAMES = frozenset({"config", "simp_config"})
"""`(config := TERM)`: Lean evaluates TERM as compiled code to get the configuration."""
# Monadic state: `(← get).goals.head!.assign ...` reaches the proof state (and `MVarId.assign`) through
# dot notation without spelling a meta name. A proof has no state to read.
MONADIC_STATE: dict[str, str] = {
    w: f"`{w}` reads or changes monadic state (in a tactic monad, the proof state itself)"
    for w in ("get", "getThe", "modify", "modifyThe", "modifyGet", "modifyGetThe", "getModify", "liftMetaM",
              "liftTermElabM", "liftCoreM", "liftMacroM", "liftM", "monadLift", "StateT", "StateM", "StateRefT",
              "MonadState", "MonadStateOf", "MonadLift", "getEnv", "setEnv", "modifyEnv", "getGoals", "setGoals",
              "getMainGoal", "getUnsolvedGoals", "replaceMainGoal")
}
CONFIG_LITERALS = frozenset({"true", "false"})
# Refused as any part of a dotted name too (`StateT.get`, `MonadState.modifyGet`); `get`, `set` and
# `modify` only alone, since `List.get` or `l.modify` are data.
_STATE_PARTS = frozenset(MONADIC_STATE) - {"get", "modify", "getThe", "modifyThe"}

# -- meta code ---------------------------------------------------------------------------------------
# A proof is a term or a tactic script: nothing in it needs Lean's meta level, and meta code that runs
# while Lean checks the file can add unchecked declarations or write Lean's answer itself (the nonce
# proves freshness, not that no code ran). So a name that reaches the meta level is refused wherever it
# appears, in a helper's type, its body or the proof, however it is opened or abbreviated: an
# abbreviation or an `open` must spell the namespace or the monad once, and that spelling is refused.
META_ROOTS: dict[str, str] = {
    "Lean": "Lean's own namespace holds the elaborator, the kernel interface and the meta monads",
    "Elab": "`Lean.Elab` is the elaborator (meta code)",
    "Meta": "`Lean.Meta` is the meta level",
    "Tactic": "tactic implementations are meta code",
    "Parser": "parsers are meta code",
    "PrettyPrinter": "the pretty printer is meta code",
    "Qq": "`Qq` quotes meta-level expressions",
    "Aesop": "Aesop's namespace holds its rule builders and meta code",
    "IO": "`IO` code has file, process and network access",
    "EIO": "`EIO` code has file, process and network access",
    "BaseIO": "`BaseIO` code has file, process and network access",
    "System": "`System` holds file and process access",
    "Mathlib.Tactic": "Mathlib's tactic implementations are meta code",
    "Mathlib.Meta": "Mathlib's meta code",
    "Batteries.Tactic": "Batteries' tactic implementations are meta code",
    "Std.Tactic": "tactic implementations are meta code",
}
META_NAMES: dict[str, str] = {
    m: f"`{m}` is one of Lean's meta monads: code in it can run while the proof is checked"
    for m in ("TacticM", "TermElabM", "MetaM", "CoreM", "CommandElabM", "MacroM", "SimpM", "ConvM", "DelabM",
              "AttrM", "ImportM", "LintM", "TacticStx", "Simproc", "DSimproc", "Macro", "Syntax", "Expr", "MVarId",
              "FVarId", "LocalContext", "MetavarContext", "Environment", "ST", "EST", "EStateM", "IO", "EIO", "BaseIO")
}
META_WORDS: dict[str, str] = {
    "tactic": "Aesop's `tactic` rule builder (and any `tactic`-typed argument) evaluates a named constant as meta code",
}


# Lean, Batteries, Aesop and Mathlib keywords that start a command. They are reserved words, so a
# proof cannot use them as names, and Lean starts a new command at each of them (also while
# recovering from a parse error). Only DECLARATIONS and the modifiers below are accepted.
COMMAND_REASONS: dict[str, str] = {
    "axiom": "`axiom` would assume whatever is to be proved",
    "opaque": "`opaque` declares a constant whose definition is never checked",
    "unsafe": "`unsafe` code is outside the kernel's checks",
    "partial": "`partial` definitions are opaque to the kernel",
    "elab": "`elab` defines new elaborators (arbitrary meta code)",
    "elab_rules": "`elab_rules` defines new elaborators (arbitrary meta code)",
    "macro": "`macro` can hide `sorry` or other banned constructs behind new syntax",
    "macro_rules": "`macro_rules` can hide `sorry` or other banned constructs behind new syntax",
    "syntax": "`syntax` declares new syntax (used to hide banned constructs)",
    "notation": "`notation` can hide `sorry` or other banned constructs behind new syntax",
    "notation3": "`notation3` can hide `sorry` or other banned constructs behind new syntax",
    "run_cmd": "`run_cmd` runs arbitrary meta code",
    "run_elab": "`run_elab` runs arbitrary meta code",
    "run_meta": "`run_meta` runs arbitrary meta code",
    "initialize": "`initialize` runs arbitrary code",
    "builtin_initialize": "`builtin_initialize` runs arbitrary code",
    "simproc": "`simproc` runs meta code inside `simp`",
    "dsimproc": "`dsimproc` runs meta code inside `simp`",
    "attribute": "`attribute` changes how existing declarations are used (and can register meta code)",
    "instance": "`instance` changes how the statement's notation is elaborated",
    "example": "`example` is not accepted: prove the theorem under its own name",
    "import": "`import` may only come first, and only the problem's header may import",
    "sudo": "`sudo set_option` sets options that could skip the kernel's checks",
}
COMMAND_REASONS.update({w: f"`{w}` declares new notation (used to hide banned constructs)" for w in ("infix", "infixl", "infixr", "prefix", "postfix")})
COMMAND_KEYWORDS = frozenset(COMMAND_REASONS) | {
    "theorem", "lemma", "def", "abbrev", "private", "protected", "noncomputable", "nonrec", "local", "scoped",
    "structure", "class", "inductive", "coinductive", "mutual", "namespace", "section", "end", "universe", "variable",
    "omit", "include", "export", "deriving", "alias", "irreducible_def", "proof_wanted", "recall", "seal", "unseal",
    "simproc_decl", "dsimproc_decl", "builtin_simproc", "builtin_dsimproc", "builtin_simproc_decl", "builtin_dsimproc_decl",
    "declare_syntax_cat", "declare_simp_like_tactic", "declare_config_elab", "declare_command_config_elab",
    "declare_aesop_rule_sets", "add_aesop_rules", "erase_aesop_rules", "register_option", "register_builtin_option",
    "register_simp_attr", "register_label_attr", "binder_predicate", "unif_hint", "grind_pattern", "assert_not_exists",
    "library_note", "add_decl_doc", "compile_inductive", "compile_def", "gen_injective_theorems", "suppress_compilation",
    "count_heartbeats", "initialize_simps_projections", "mk_iff_of_inductive_prop",
    # more Lean, Batteries and Mathlib commands: a word whose stem is one of these starts a command
    "prelude", "module", "meta", "public", "init_quot", "eoi", "builtin_initialize", "unsuppress_compilation", "whatsnew",
    "with_weak_namespace", "assert_not_imported", "extend_docs", "register_hint", "reassoc_axiom", "test_extern", "grind_propagator", "builtin_grind_propagator",
}
COMMAND_REASONS.update({
    "variable": "`variable` (and Mathlib's `variable?`) adds hypotheses to the declarations that follow, the theorem's too",
    "include": "`include` adds section variables to the declarations that follow",
    "omit": "`omit` changes which section variables the declarations that follow take",
    "count_heartbeats": "`count_heartbeats in` (and `count_heartbeats!`) lifts the heartbeat limit for what follows",
    "whatsnew": "`whatsnew in` runs meta code around the command that follows",
    "universe": "`universe` declares universe variables the theorem's statement could pick up",
    "export": "`export` changes how names in the statement resolve",
    "meta": "`meta` declarations are compiled code for the elaborator",
    "module": "module system commands are not accepted",
    "public": "module system commands are not accepted",
})
DECLARATIONS = frozenset({"theorem", "lemma", "def", "abbrev"})
MODIFIERS = frozenset({"private", "protected", "noncomputable"})
ATTRIBUTES = frozenset({"simp", "reducible", "irreducible", "inline", "noinline", "specialize", "local"})
"""Attributes a helper may carry: none of them runs code or changes what a statement means."""

_BOUNDED_OPTIONS = {  # option -> (upper bound, or None for the verifier's heartbeat limit)
    "maxHeartbeats": None,
    "synthInstance.maxHeartbeats": None,
    "maxRecDepth": MAX_REC_DEPTH,
    "synthInstance.maxSize": MAX_REC_DEPTH,
}

_OPENERS, _CLOSERS = "([{⟨⦃", ")]}⟩⦄"

_UNICODE_SPACE = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")  # Unicode category Zs, less the ASCII space
_NOT_PLAIN = re.compile(r"[^\x20-\x7e\n\t\r]")

# Characters that render as nothing or reorder text: they make what a reviewer reads differ from what Lean reads.
_INVISIBLE = {0x115F, 0x1160, 0x3164, 0xFFA0, 0x2800, 0x034F, 0x180E}


def normalize(text: str) -> str:
    """CRLF to LF, and every Unicode space (no-break, thin, ideographic...) to an ASCII space.

    Lean reads only ASCII spaces as whitespace; a pasted no-break space would be an error there,
    and is harmless to replace (inside a string literal too).
    """
    return _UNICODE_SPACE.sub(" ", text.replace("\r\n", "\n"))


# Emoji sequences: variation selectors 15/16, the zero-width joiner and the tag characters of flag
# sequences. Inert inside a string or character literal (data, never read as code); refused elsewhere.
_EMOJI_PARTS = frozenset({0x200D, 0xFE0E, 0xFE0F, *range(0xE0020, 0xE0080)})


def check_unicode(text: str, literals: list[tuple[int, int]] = ()) -> None:
    """Refuse control, format (bidi, zero-width), private-use, unassigned and invisible characters.

    `literals` are the (start, end) spans of string and character literals, where the parts of emoji
    sequences are allowed. Comments are removed before this check: they never reach Lean.
    """
    spans = sorted(literals)
    for match in _NOT_PLAIN.finditer(text):
        offset, ch = match.start(), match.group()
        cat = unicodedata.category(ch)
        code = ord(ch)
        if code in _EMOJI_PARTS and any(a < offset < b for a, b in spans):
            continue
        if cat in ("Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp") or code in _INVISIBLE or 0xFE00 <= code <= 0xFE0F or 0xE0100 <= code <= 0xE01EF:
            line = text.count("\n", 0, offset) + 1
            name = unicodedata.name(ch, "unnamed")
            raise Rejected(f"suspicious Unicode character U+{code:04X} ({name}, category {cat}) on line {line} of the proof block")


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _keyword(token: Token) -> str | None:
    """The token's text if it is a keyword-shaped word (not `«escaped»`), else None."""
    return token.text if token.kind == "word" and not token.escaped else None


def _command(token: Token) -> str | None:
    """The command keyword this word may start, judged by its stem: identifiers may end in `?` or `!`,
    and Mathlib defines commands spelled so (`variable?`, `count_heartbeats!`), so a word whose stem
    without trailing `?`/`!` is a command keyword is read as that command."""
    word = _keyword(token)
    if word is None:
        return None
    stem = word.rstrip("?!")
    return stem if stem in COMMAND_KEYWORDS else None


def _meta(token: Token) -> str | None:
    """Why this word reaches Lean's meta level (None if it does not)."""
    if token.kind != "word":
        return None
    parts = token.parts[1:] if token.parts and token.parts[0] == "_root_" else token.parts
    for n in (2, 1):
        root = ".".join(parts[:n])
        if len(parts) >= n and root in META_ROOTS:
            return META_ROOTS[root]
    for part in parts:
        if part in META_NAMES:
            return META_NAMES[part]
    if len(token.name) == 1 and token.name[0] in META_WORDS:  # `tactic`, `«tactic»`: the same name to Lean
        return META_WORDS[token.name[0]]
    return None


def _flatten(tokens: list[Token], offset: int = 0) -> list[Token]:
    """The tokens, each string that may be an interpolation `s!"..{e}.."` followed by the tokens of its
    text (at their places in the whole text): `e` is a term like any other, `by` blocks included, so
    every rule that reads the code reads it too."""
    out: list[Token] = []
    for t in tokens:
        out.append(replace(t, start=t.start + offset, end=t.end + offset) if offset else t)
        if t.kind == "string" and t.code:
            out.extend(_flatten(t.code, offset + t.start + 1))
    return out


def _last(token: Token) -> str | None:
    """The last part of the name Lean reads for this word (`«native»` and `Foo.native`: `native`), else None.
    Rules that name a word compare this, never the text as written."""
    return token.name[-1] if token.name else None


def _scan(tokens: list[Token], text: str, how: str = "") -> None:
    """Refuse `#` commands, banned names, `eval%` and native evaluation anywhere in the code (the
    text of a string that may be an interpolation included)."""
    tokens = _flatten(tokens)
    for k, t in enumerate(tokens):
        if t.kind == "symbol" or t.kind == "number" or t.kind == "char":
            continue
        where = f"{how} on line {_line(text, t.start)}" if t.kind == "hash" or t.braces or t.kind == "word" and _suspect(t) else ""
        if t.kind == "hash":
            raise Rejected(f"`{t.text}`{where}: Lean `#` commands are not accepted (`#eval!` runs code that can forge "
                           "Lean's answer; `#print` could forge the axioms report)")
        if t.kind == "string" and t.braces:
            _scan_interpolation(t, text, where)
        if t.kind != "word":
            continue
        for part in t.parts:
            if part in BANNED_NAMES:
                raise Rejected(f"banned construct `{t.text}`{where}: {BANNED_NAMES[part]}")
        nxt = tokens[k + 1] if k + 1 < len(tokens) else None
        prev = tokens[k - 1] if k else None
        # Names as Lean reads them: `«native»`, `«config»` and `_root_.native` are the field or item `native`
        # and `config` (checked in Lean 4.28: `decide +«native»` evaluates natively).
        last, alone = _last(t), t.name[0] if len(t.name) == 1 else None
        if alone == "eval" and nxt is not None and nxt.text == "%" and nxt.start == t.end:
            raise Rejected(f"banned construct `eval%`{where}: it runs arbitrary code while elaborating")
        if last == "native" and ((prev is not None and prev.text == "+") or (nxt is not None and nxt.text == ":=")):
            raise Rejected(f"banned construct `decide +native` (`{t.text}`){where}: it trusts compiled code instead of the kernel")
        if last in CONFIG_NAMES and nxt is not None and nxt.text == ":=":
            _config_term(tokens, k + 2, text)
        if last in META_FIELDS and nxt is not None and nxt.text == ":=" and prev is not None \
                and prev.text in ("(", "{", ","):
            raise Rejected(f"`{t.text} :=` on line {_line(text, t.start)}: {META_FIELDS[last]}")
        state = alone if alone in MONADIC_STATE else next((p for p in t.name if p in _STATE_PARTS), None)
        field = prev is not None and prev.text == "." and prev.end == t.start  # `xs.get`, `(f x).get`: data
        if state is not None and not (field and state not in _STATE_PARTS):
            raise Rejected(f"`{t.text}` on line {_line(text, t.start)}: {MONADIC_STATE[state]}; a proof needs none")
        if alone == "set" and not _set_tactic(tokens, k):
            raise Rejected(f"`set` on line {_line(text, t.start)} is not Mathlib's `set x := e with h` tactic: "
                           "monadic `set` changes state (in a tactic monad, the proof state itself)")
    for k, t in enumerate(tokens[:-1]):
        nxt = tokens[k + 1]
        arrow = nxt.text in ("←", "<-") or (nxt.text == "<" and k + 2 < len(tokens) and tokens[k + 2].text == "-"
                                            and tokens[k + 2].start == nxt.end)
        if t.kind == "symbol" and t.text == "(" and arrow:
            raise Rejected(f"`(←` on line {_line(text, t.start)}: a nested action runs monadic code (in a tactic monad, "
                           "on the proof state); a proof needs none")


def _set_tactic(tokens: list[Token], k: int) -> bool:
    """Mathlib's `set x := e` / `set x : T := e` (maybe `set! ...`): a name, then `:=` or `:`."""
    return (k + 2 < len(tokens) and tokens[k + 1].kind == "word" and len(tokens[k + 1].parts) == 1
            and tokens[k + 2].text in (":=", ":"))


def _config_term(tokens: list[Token], k: int, text: str) -> None:
    """A config term (at `k`, after `config :=`) must be data: `{ field := literal, ... }`, each literal a
    number, a string, a character, `true`/`false` or a leading-dot constructor (`.all`). Lean evaluates
    the term as compiled code: `.mk ...` and `⟨...⟩` set fields by position (`decide`'s native
    evaluation among them), and a name or any other term can run a helper's compiled code, with no
    heartbeat limit."""
    start = tokens[k] if k < len(tokens) else tokens[-1]
    where = f"on line {_line(text, start.start)}"
    how = ("write `(config := { field := value, ... })` with literal values, or `+flag` / `-flag`")
    if k >= len(tokens) or tokens[k].text != "{":
        shown = tokens[k].text if k < len(tokens) else ""
        kind = ("an anonymous-constructor config sets fields by position" if shown == "⟨" else
                "a positional constructor sets fields by position" if shown == "." else
                "a config term that is not a literal structure instance is evaluated as code")
        raise Rejected(f"`(config := {shown} ...)` {where}: {kind}; {how}")
    j = k + 1
    while j < len(tokens) and tokens[j].text != "}":
        field = tokens[j]
        if field.kind != "word" or len(field.parts) != 1 or j + 2 >= len(tokens) or tokens[j + 1].text != ":=":
            raise Rejected(f"`(config := {{ ... {field.text} ... }})` {where}: only `field := literal` entries "
                           f"are accepted (no `with`, no nested terms); {how}")
        if field.name[0] in META_FIELDS:
            raise Rejected(f"`{field.text} :=` {where}: {META_FIELDS[field.name[0]]}")
        j += 2
        value = tokens[j]
        if value.text == "-" and j + 1 < len(tokens) and tokens[j + 1].kind == "number":
            j += 1
        elif value.text == "." and j + 1 < len(tokens) and tokens[j + 1].kind == "word" \
                and len(tokens[j + 1].parts) == 1 and tokens[j + 1].start == value.end:
            j += 1
        elif not (value.kind in ("number", "string", "char") or (len(value.name) == 1 and value.name[0] in CONFIG_LITERALS)):
            raise Rejected(f"`{field.text} := {value.text}` in a config term {where}: the value must be a literal "
                           f"(a number, a string, true/false or `.constructor`), not a term that runs; {how}")
        j += 1
        if j < len(tokens) and tokens[j].text == ",":
            j += 1
    if j >= len(tokens):
        raise Rejected(f"unclosed config term `{{` {where}")


def _scan_meta(tokens: list[Token], text: str) -> None:
    """Refuse every word that reaches Lean's meta level (after the command checks, whose reasons are more specific)."""
    for k, t in enumerate(tokens):
        why = _meta(t)
        if why and not (k and _keyword(tokens[k - 1]) == "import"):  # a module name, checked against the header
            raise Rejected(f"`{t.text}` on line {_line(text, t.start)}: meta code is not accepted in a proof ({why})")


def _suspect(t: Token) -> bool:
    return _last(t) in ("eval", "native") or any(p in BANNED_NAMES for p in t.parts)


def _scan_interpolation(t: Token, text: str, where: str) -> None:
    """A string with `{` may be `s!"...{code}..."`, and Lean's error recovery re-reads its text as
    tokens: nothing in it may be a banned name or start a command."""
    for inner in t.code:
        bad = (
            inner.kind == "hash"
            or inner.text == "@["
            or (inner.kind == "word" and any(p in BANNED_NAMES for p in inner.parts))
            or _command(inner) is not None
            or any(p in ("set_option", "open", "eval", "native", "config") for p in inner.name)
            or _meta(inner) is not None
        )
        if bad:
            raise Rejected(f"`{inner.text}` inside a string literal with `{{`{where}: `s!\"{{...}}\"` reads it as code")


@dataclass(frozen=True)
class Submission:
    """The file sent to Lean for one completion, and what Lean's answer must echo to be believed.

    `audit_line` and `nonce_line` are the 1-based lines of the trusted `#print axioms NAME` and
    `#print "MARKER"`; `header_lines` is how many leading lines (imports and blanks) the server
    splits off, since kimina-lean-server 2.0.0 reports positions relative to the rest of the file.
    """

    name: str
    code: str
    nonce: str
    audit_line: int
    nonce_line: int
    header_lines: int
    reference: str = ""
    """The trusted header and the statement sent, proved by `sorry`: what the out-of-process re-check
    compares the theorem's type with."""
    statement_lines: tuple[int, int] = (0, 0)
    """The first and last 1-based lines of the theorem's (trusted) statement in `code`: an error there
    is the row's, not the proof's (see `judge`)."""

    @property
    def marker(self) -> str:
        return f"vrl audit {self.nonce}"


def prepare(
    completion: str,
    theorem: Theorem,
    max_heartbeats: int = DEFAULT_MAX_HEARTBEATS,
    *,
    nonce: str | None = None,
    rechecked: bool = False,
    target: str | None = None,
) -> Submission:
    """The file to send to Lean for this completion, or `Rejected` with the reason.

    The file is the trusted header, then the model's accepted commands in order (comments removed:
    exactly the text that was scanned; its `import`s and global `set_option maxHeartbeats` replaced
    by the header), with the theorem's statement replaced by the original, then the trailer.
    `rechecked`: every pass will be re-checked out of process against the trusted statement's type
    (`vrl_lean.recheck`), so an `open` in force at the theorem is accepted: the re-check refuses it
    if it changed the statement's meaning. `target`: a statement (`theorem NAME ...`) written in place
    of the original, for canaries (`vrl_lean.canary`). `nonce` is for tests only; by default every
    call draws a fresh one.
    """
    code = normalize(extract_code(completion))
    try:
        code = strip_comments(code, tokenize(code).comments)
        tokens = tokenize(code).tokens
    except LexError as exc:
        check_unicode(code)  # a stray control character explains a lexing failure better
        raise Rejected(str(exc)) from None
    check_unicode(code, [(t.start, t.end) for t in tokens if t.kind in ("string", "char")])
    _scan(tokens, code)
    normal = unicodedata.normalize("NFKC", code)
    if normal != code:
        try:
            _scan(tokenize(normal, strict=False).tokens, normal, " (written with look-alike Unicode characters)")
        except LexError:
            pass  # what Lean reads is `code`, scanned above; the normal form is a second look only
    written = Theorem(theorem.name, theorem.header, target) if target is not None else theorem
    body = _Rebuild(code, tokens, theorem, max_heartbeats, rechecked=rechecked, written=written.statement).body()
    _scan_meta(tokens, code)

    nonce = nonce or secrets.token_hex(16)
    header = theorem.trusted_header(max_heartbeats)
    head = f"{header}\n{body}\n\n"
    audit = f"#print axioms {theorem.name}\n"
    marker = f'#print "vrl audit {nonce}"\n'
    file = head + audit + marker
    lines = file.split("\n")
    header_lines = 0
    while header_lines < len(lines) and (not lines[header_lines].strip() or lines[header_lines].strip().startswith("import ")):
        header_lines += 1
    audit_line = head.count("\n") + 1
    stated = _statement_tail(written.statement, theorem.name)[0]
    reference = f"{header}\n{stated} := by\n  sorry\n"
    first = file.count("\n", 0, file.index(f"{stated} :=", len(header))) + 1
    return Submission(theorem.name, file, nonce, audit_line, audit_line + 1, header_lines, reference,
                      (first, first + stated.count("\n")))


class _Rebuild:
    """Checks the model's commands against the allow-list and rebuilds the text to send."""

    def __init__(self, code: str, tokens: list[Token], theorem: Theorem, max_heartbeats: int, *,
                 rechecked: bool = False, written: str | None = None):
        self.code, self.tokens, self.theorem, self.limit = code, tokens, theorem, max_heartbeats
        self.rechecked = rechecked
        self.written = written if written is not None else theorem.statement
        self.edits: list[tuple[int, int, str]] = []
        self.aesop = self._aesop_unsafe()

    def line(self, token: Token) -> int:
        return _line(self.code, token.start)

    def column(self, token: Token) -> int:
        return token.start - (self.code.rfind("\n", 0, token.start) + 1)

    def local_names(self, start: int, end: int) -> tuple[list[Token], list[Token]]:
        """The names that `where` clauses and `let rec` define inside the declaration `tokens[start:end]`,
        as (declared, possible). Lean 4.28: `def h := go 0 where go ...` defines the constant `h.go`, as
        `let rec go` does, and a theorem's `where` helper is a `def` too; nothing here opens them.

        `where` (`sepByIndent`): the first declaration follows it, and each other follows a `;` or starts
        a new line at exactly the first one's column (any other column is a parse error). These are
        `declared` (a word of a body written at that column is read as one too: over-counting only refuses
        more). Without a `:=` or `|` before `where`, the clause holds a structure instance's fields
        (`def c : S where x := 1`), counted as `possible`. `let rec` (not `let «rec»`): the first name
        follows `rec`, each other a `,`, which also ends many terms (`∀ x, P x`): words after a comma
        are `possible`. The naming rules read `declared`; the rules that refuse running a definition of
        the proof read both."""
        tokens, code = self.tokens, self.code
        declared: list[Token] = []
        possible: list[Token] = []
        for w in range(start, end):
            t = tokens[w]
            if _keyword(t) == "where" and w + 1 < end:
                fields = not any(u.kind == "symbol" and u.text in (":=", "|") and d == 0
                                 for u, d in zip(tokens[start:w], self._depths(start, w)))
                column = self.column(tokens[w + 1])
                found = [tokens[w + 1]]
                for j in range(w + 2, end):
                    u, before = tokens[j], tokens[j - 1]
                    if before.text == ";" or ("\n" in code[before.end:u.start] and self.column(u) == column):
                        found.append(u)
                (possible if fields else declared).extend(u for u in found if u.kind == "word")
        flat = _flatten(tokens[start:end])  # `s!"{let rec go ...; go 0}"` defines `go` too (Lean 4.28)
        for w, t in enumerate(flat):
            if _keyword(t) == "let" and w + 2 < len(flat) and _keyword(flat[w + 1]) == "rec":
                if flat[w + 2].kind == "word":
                    declared.append(flat[w + 2])
                possible.extend(flat[j] for j in range(w + 3, len(flat))
                                if flat[j].kind == "word" and flat[j - 1].text == ",")
        return declared, possible

    def aliases(self) -> set[str]:
        """The new names of `open X renaming a → b` clauses: `b` is then a second name of `X.a` (Lean 4.28:
        `open Nat renaming slow → fast in simp (maxSteps := fast 0)` runs `Nat.slow`), so every such `b`
        counts as a definition of the proof, whatever `a` is."""
        tokens, out = self.tokens, set()
        for k, t in enumerate(tokens):
            if _keyword(t) != "renaming":
                continue
            j = k + 1
            while j < len(tokens) and (tokens[j].kind == "word" and _command(tokens[j]) is None
                                       and _keyword(tokens[j]) not in ("in", "open", "set_option")
                                       or tokens[j].text in ("→", "-", ">", ",")):
                if tokens[j].kind == "word" and tokens[j - 1].text in ("→", ">"):
                    out.add(tokens[j].name[-1])
                j += 1
        return out

    def _depths(self, start: int, end: int) -> list[int]:
        """The bracket depth (relative to `start`) at each token of `tokens[start:end]`."""
        out, depth = [], 0
        for t in self.tokens[start:end]:
            if t.kind == "symbol" and t.text in _CLOSERS:
                depth = max(0, depth - 1)
            out.append(depth)
            if t.kind == "symbol" and t.text in _OPENERS:
                depth += 1
        return out

    def _aesop_unsafe(self) -> set[int]:
        """Indices of `unsafe` inside an Aesop clause `(add unsafe ...)`: a rule priority, not Lean's `unsafe`."""
        stack: list[int] = []
        found = set()
        for k, t in enumerate(self.tokens):
            if t.text in "([{⟨" and t.kind == "symbol":
                stack.append(k)
            elif t.text in ")]}⟩" and t.kind == "symbol" and stack:
                stack.pop()
            elif t.text == "unsafe" and stack and self.tokens[stack[-1]].text == "(" and _keyword(self.tokens[stack[-1] + 1]) == "add":
                nxt = self.tokens[k + 1] if k + 1 < len(self.tokens) else None
                if nxt is None or _command(nxt) is None:
                    found.add(k)
        return found

    def aesop_rules(self, defs: set[str]) -> None:
        """Aesop's `(add ... NAME)` runs NAME as a tactic when NAME has a tactic's type (its default rule
        builder), so an `add` clause may name lemmas and rule sets, never a definition of the completion
        (`defs`: the last parts of their names; a `where` helper `h.go` counts, and `h.go` names `h` too)."""
        tokens = _flatten(self.tokens)
        for k, t in enumerate(tokens[:-1]):
            if not (t.kind == "symbol" and t.text == "(" and tokens[k + 1].name == ("add",)):
                continue
            for u in self._words_until_close(tokens, k + 2):
                if any(p in defs for p in u.name):
                    raise Rejected(f"aesop rule `{u.text}` on line {self.line(u)} names a definition of this proof: "
                                   "Aesop runs a constant of tactic type as a tactic; add lemmas (theorem/lemma) only")

    @staticmethod
    def _words_until_close(tokens: list[Token], j: int) -> list[Token]:
        """The words from `j` up to the bracket that closes the one opened just before `j`."""
        depth, words = 1, []
        while j < len(tokens) and depth:
            u = tokens[j]
            if u.kind == "symbol" and u.text in "([{⟨":
                depth += 1
            elif u.kind == "symbol" and u.text in ")]}⟩":
                depth -= 1
            elif u.kind == "word":
                words.append(u)
            j += 1
        return words

    def named_items(self, defs: set[str]) -> None:
        """A `(name := value)` item after a tactic is a config field, and Lean evaluates its value as
        compiled code (`decide (kernel := slow 10)` runs `slow`, with no heartbeat limit; Lean 4.28 runs
        `simp (maxSteps := h.go 2)` for a `where` helper `h.go`). The policy cannot tell it from a named
        argument, so neither may mention a definition of the proof (`defs`, as in `aesop_rules`)."""
        if not defs:
            return
        tokens = _flatten(self.tokens)
        for k in range(len(tokens) - 2):
            if not (tokens[k].text == "(" and tokens[k + 1].kind == "word" and tokens[k + 2].text == ":="):
                continue
            for u in self._words_until_close(tokens, k + 3):
                if any(p in defs for p in u.name):
                    raise Rejected(f"`({tokens[k + 1].text} := ... {u.text} ...)` on line {self.line(u)}: a config item's "
                                   "value is evaluated as compiled code, and this one runs a definition of the proof; "
                                   "use a literal")

    def is_boundary(self, k: int) -> bool:
        t = self.tokens[k]
        if t.text == "@[" and t.kind == "symbol":
            return True
        word = _command(t)
        if word is None:
            return False
        if word == "scoped" and k and _keyword(self.tokens[k - 1]) == "open":
            return False
        return k not in self.aesop

    def commands(self) -> list[tuple[int, int]]:
        """Token ranges of the top-level commands; the first one (possibly empty) precedes any keyword."""
        tokens, out, start, k = self.tokens, [], 0, 0
        only_modifiers = False  # the current command so far is only attributes and modifiers
        while k < len(tokens):
            if self.is_boundary(k) and not only_modifiers:
                out.append((start, k))
                start = k
                only_modifiers = True
            if tokens[k].text == "@[" and tokens[k].kind == "symbol":
                k = self._attribute_end(k)
                continue
            if only_modifiers and _keyword(tokens[k]) not in MODIFIERS | {"partial", "unsafe", "nonrec"}:
                only_modifiers = False
            k += 1
        out.append((start, len(tokens)))
        return out

    def _attribute_end(self, k: int) -> int:
        """Index after the `]` closing the attribute list at `k`; every attribute must be allowed."""
        depth, j = 1, k + 1
        while j < len(self.tokens) and depth:
            t = self.tokens[j]
            if t.kind == "symbol" and t.text in "[(":
                depth += 1
            elif t.kind == "symbol" and t.text in "])":
                depth -= 1
            elif depth == 1 and t.text != "," and not (len(t.parts) == 1 and t.parts[0] in ATTRIBUTES):
                raise Rejected(f"attribute `{t.text}` on line {self.line(t)} is not accepted: only "
                               f"{', '.join(sorted(ATTRIBUTES - {'local'}))} (others can register meta code)")
            j += 1
        if depth:
            raise Rejected(f"unclosed attribute list `@[` on line {self.line(self.tokens[k])}")
        return j

    def option(self, k: int, header_level: bool) -> int:
        """Check the `set_option NAME VALUE` at `k`; return the index after it (and after `in`)."""
        tokens = self.tokens
        if k + 2 >= len(tokens) or tokens[k + 1].kind != "word":
            raise Rejected(f"incomplete `set_option` on line {self.line(tokens[k])}")
        name, value = ".".join(tokens[k + 1].parts), tokens[k + 2].text
        shown = f"`set_option {name} {value}`"
        has_in = k + 3 < len(tokens) and _keyword(tokens[k + 3]) == "in"
        if name.startswith("debug."):
            raise Rejected(f"banned option {shown} on line {self.line(tokens[k])}: debug options can skip the kernel's checks")
        if name in ("autoImplicit", "relaxedAutoImplicit"):
            if value != "false":
                raise Rejected(f"banned option {shown} on line {self.line(tokens[k])}: auto-bound names would give "
                               "the statement another meaning (the trusted header sets it to false)")
            if header_level and not has_in:  # a copy of the header's line: the trusted header sets it instead
                self.edits.append((tokens[k].start, tokens[k + 2].end, ""))
                return k + 3
        elif name.startswith("linter."):
            if value not in ("true", "false"):
                raise Rejected(f"{shown} on line {self.line(tokens[k])}: a linter option takes true or false")
        elif name in _BOUNDED_OPTIONS:
            if name == "maxHeartbeats" and header_level and not has_in:
                # A copy of the header's global limit: the trusted header sets it instead.
                self.edits.append((tokens[k].start, tokens[k + 2].end, ""))
                return k + 3
            bound = _BOUNDED_OPTIONS[name] or self.limit
            if not (tokens[k + 2].kind == "number" and value.isdigit() and 0 < int(value) <= bound):
                raise Rejected(f"{shown} on line {self.line(tokens[k])}: the value must be between 1 and {bound}")
        else:
            allowed = ", ".join([*_BOUNDED_OPTIONS, "linter.*"])
            raise Rejected(f"banned option {shown} on line {self.line(tokens[k])}: only {allowed} may be set "
                           "(other options can change what the statement means or how it is checked)")
        return k + 4 if has_in else k + 3

    def options(self, header: set[int]) -> None:
        for k, t in enumerate(self.tokens):
            if _keyword(t) == "set_option" and k not in header:
                self.option(k, header_level=False)

    def top_level(self, start: int, end: int, header: set[int]) -> None:
        """Between declarations only `open ...` and `set_option ...` (each maybe followed by `in`)."""
        tokens, k = self.tokens, start
        while k < end:
            word = _keyword(tokens[k])
            if word == "open":
                k += 1
                while k < end and _keyword(tokens[k]) not in ("in", "open", "set_option") and (
                    tokens[k].kind == "word" or tokens[k].text in "()→,-><"
                ):
                    k += 1
                k += k < end and _keyword(tokens[k]) == "in"
            elif word == "set_option":
                header.add(k)
                k = self.option(k, header_level=True)
            else:
                t = tokens[k]
                raise Rejected(f"unexpected `{t.text}` on line {self.line(t)} before the first declaration: only `import`, "
                               "`open`, `set_option` and theorem/lemma/def/abbrev declarations may appear at the top level")

    def opens_before(self, main: int) -> None:
        """An `open` in force at the theorem would change how its statement is read (scoped notation and
        instances): only namespaces the trusted header already opens may be opened there."""
        allowed = {tuple(n.split(".")) for n in _header_opens(self.theorem.header)}
        tokens = self.tokens
        for k in range(main):
            if _keyword(tokens[k]) != "open":
                continue
            j, names, naming = k + 1, [], True
            while j < main and _keyword(tokens[j]) not in ("in", "open", "set_option") and not self.is_boundary(j) and (
                tokens[j].kind == "word" or tokens[j].text in ("(", ")", "→", "-", ">", ",")
            ):
                word = tokens[j].text
                if word in ("hiding", "renaming", "("):
                    naming = False  # what follows names declarations, not namespaces
                    if word != "(":
                        # `open Nat renaming succ → x` makes `x` in the statement mean `Nat.succ`;
                        # `hiding` makes a name resolve elsewhere.
                        names.append(f"{word} ...")
                elif naming and tokens[j].kind == "word" and word != "scoped" and tokens[j].name not in allowed:
                    names.append(word)  # compared as Lean reads it: `open «Real»` opens `Real`
                j += 1
            if j < main and _keyword(tokens[j]) == "in":
                # `open X in` reaches the next command (through `set_option ... in` chains): the theorem
                # only if no other declaration starts first.
                target = next(t for t in range(j + 1, main + 1) if t == main or self.is_boundary(t))
                if target != main:
                    continue
            if names:
                raise Rejected(f"`open {' '.join(names)}` on line {self.line(tokens[k])} is in force at `theorem {self.theorem.name}`: "
                               "it could change how the original statement is read; write `open ... in` before a helper "
                               "or inside the proof instead")

    def body(self) -> str:
        """The checked text to send (without the trusted header and trailer)."""
        tokens, code, name = self.tokens, self.code, self.theorem.name
        commands = self.commands()
        header: set[int] = set()
        mains: list[tuple[int, int]] = []
        others: list[str] = []
        defs: set[str] = set()  # the last parts of the names of the proof's definitions (see `aesop_rules`)
        seen_other = False
        examples: list[Token] = []
        for start, end in commands:
            if start == end:
                continue
            first = tokens[start]
            word = _keyword(first)
            if start == 0 and not self.is_boundary(0):
                self.top_level(start, end, header)
                seen_other = True
                continue
            if word == "example":
                examples.append(first)
                continue
            if word == "import":
                module = tokens[start + 1] if start + 1 < end else None
                if module is None or f"import {module.text}" not in self.theorem.imports():
                    shown = module.text if module else ""
                    raise Rejected(f"extra `import {shown}` on line {self.line(first)}: only the problem's header may import")
                if seen_other:
                    raise Rejected(f"`import {module.text}` on line {self.line(first)} comes after other commands: imports must come first")
                self.edits.append((first.start, module.end, ""))
                self.top_level(start + 2, end, header)
                seen_other = start + 2 < end
                continue
            seen_other = True
            k, modifiers = start, []
            while k < end and (tokens[k].text == "@[" or _command(tokens[k]) is not None):
                if tokens[k].text == "@[":
                    j = self._attribute_end(k)
                    modifiers.append("@[...]")
                    k = j
                    continue
                word, stem = _keyword(tokens[k]), _command(tokens[k])
                if word in DECLARATIONS:
                    break
                if word not in MODIFIERS:
                    reason = COMMAND_REASONS.get(stem, "only theorem/lemma/def/abbrev declarations, `open` and `set_option` are accepted")
                    spelled = f" (Lean and Mathlib read `{word}` as the command `{stem}`)" if word != stem else ""
                    raise Rejected(f"`{word}` on line {self.line(tokens[k])} is not accepted{spelled}: {reason}")
                modifiers.append(word)
                k += 1
            keyword = _keyword(tokens[k]) if k < end else None
            if keyword not in DECLARATIONS or k + 1 >= end or tokens[k + 1].kind != "word":
                raise Rejected(f"a declaration on line {self.line(tokens[start])} has no theorem/lemma/def/abbrev and name")
            decl = tokens[k + 1]
            if decl.text == name and keyword in ("theorem", "lemma"):
                if modifiers:
                    raise Rejected(f"`theorem {name}` may not carry attributes or modifiers ({' '.join(modifiers)})")
                mains.append((k, end))
            elif decl.parts[-1] == name:
                raise Rejected(f"helper `{decl.text}` on line {self.line(decl)} is named like the theorem `{name}`")
            elif decl.parts[-1] in statement_names(self.theorem.statement, name):
                # `def x : ℕ := 6` (or `def Nat.x`, reached through an `open Nat`) before a statement that
                # spells `x` gives the statement another meaning, whatever namespace it is declared in.
                raise Rejected(f"helper `{decl.text}` on line {self.line(decl)} is named like `{decl.parts[-1]}` in the "
                               "statement: it could change what the statement means; rename the helper")
            else:
                others.append(f"{keyword} {decl.text}")
                if keyword in ("def", "abbrev"):
                    defs.add(decl.name[-1])
            # `where` and `let rec` helpers are definitions of the proof like any other, a theorem's too.
            declared, possible = self.local_names(k + 2, end)
            for u in declared:
                if u.name[-1] == name:
                    raise Rejected(f"`where`/`let rec` helper `{u.text}` on line {self.line(u)} is named like the theorem `{name}`")
                if u.name[-1] in statement_names(self.theorem.statement, name):
                    raise Rejected(f"`where`/`let rec` helper `{u.text}` on line {self.line(u)} is named like "
                                   f"`{u.name[-1]}` in the statement: it could change what the statement means; rename the helper")
            defs.update(u.name[-1] for u in declared + possible)
        if not mains:
            raise Rejected(_missing_declaration(code, name, others))
        defs |= self.aliases()
        self.aesop_rules(defs)
        self.named_items(defs)
        if examples:
            raise Rejected(f"`example` on line {self.line(examples[0])} is not accepted: prove `theorem {name}` and helper lemmas only")
        if len(mains) > 1:
            raise Rejected(f"`{name}` is declared {len(mains)} times; exactly one declaration is allowed")
        if tokens and _keyword(tokens[-1]) == "in":
            raise Rejected("the Lean block ends with `in`: nothing follows it")
        self.options(header)

        k, end = mains[0]
        _, rest = _statement_tail(self.theorem.statement, name)
        assign = _match_statement(code, tokens[k + 1].end, rest)
        stop = tokens[end].start if end < len(tokens) else len(code)
        if assign > stop or code[assign:stop].strip() in ("", "by"):
            raise Rejected("empty proof after `:=`")
        self.edits.append((tokens[k].start, assign, f"{_statement_tail(self.written, name)[0]} :="))
        if not self.rechecked:
            self.opens_before(k)

        out, last = [], 0
        for s, e, text in sorted(self.edits):
            out.append(code[last:s])
            out.append(text)
            last = e
        out.append(code[last:])
        return "".join(out).strip("\n").rstrip()


def _missing_declaration(code: str, name: str, others: list[str]) -> str:
    if re.search(r"(?<![\w'!?.])example(?![\w'!?])", code):
        return f"uses `example` instead of `theorem {name}`: the original theorem must be proved under its own name"
    theorems = [o for o in others if o.split()[0] in ("theorem", "lemma")]
    if theorems:
        return f"declares `{theorems[0]}` but no `theorem {name}` (renamed theorem?)"
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


def judge(result: Mapping[str, Any], submission: Submission | None) -> Verdict:
    """Turn one server result (`/api/check` or legacy `/verify` shape) for `submission` into a verdict.

    `submission=None` exists only to replay recorded runs that were made without our trailer (no
    axioms audit, no nonce); every real check passes the `Submission` that `prepare` returned.
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
    if submission is not None:
        # First: an answer that is not provably Lean's answer to this file says nothing about it.
        problem = _echo(messages, submission)
        if problem:
            return Verdict.fail(Status.CRASHED, problem, elapsed_s=elapsed)
    errors = [m for m in messages if m.get("severity") == "error"]
    defective = [m for m in errors if submission is not None and _in_statement(m, submission)]
    if defective:
        # The trusted statement does not elaborate with auto-bound names off: the row is defective, and
        # no proof of it means anything. Every attempt fails alike (no reward signal) and it is counted.
        verdict = Verdict.fail(Status.FAILED, f"defective task: its statement does not elaborate {_where(defective[0])}"
                               f" ({_first_line(defective[0])}); a name it does not bind is not auto-bound, so the "
                               "row is withheld from training", elapsed_s=elapsed)
        return verdict.model_copy(update={"metrics": {"lean/defective_statement": 1.0}})
    if errors:
        extra = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return Verdict.fail(Status.FAILED, f"Lean error {_where(errors[0])}: {_first_line(errors[0])}{extra}", elapsed_s=elapsed)
    if response.get("sorries"):
        return Verdict.fail(Status.FAILED, "the proof contains `sorry` (Lean reported sorries)", elapsed_s=elapsed)
    for m in messages:
        if "declaration uses 'sorry'" in str(m.get("data", "")):
            return Verdict.fail(Status.FAILED, f"Lean warning {_where(m)}: declaration uses 'sorry'", elapsed_s=elapsed)
    if submission is not None:
        problem = _audit(messages, submission)
        if problem:
            return Verdict.fail(Status.FAILED, problem, elapsed_s=elapsed)
    warnings = sum(m.get("severity") == "warning" for m in messages)
    audited = "axioms audited" if submission is not None else "axioms NOT audited (replay)"
    return Verdict.ok(f"Lean accepted the proof ({warnings} warnings; {audited})", elapsed_s=elapsed)


def _lines(submission: Submission, line: int) -> tuple[int, int]:
    """Where Lean reports `line` of the file: as is, or relative to the body after the import
    header, as kimina-lean-server 2.0.0 does (later versions shift positions back)."""
    return line, line - submission.header_lines


def _in_statement(message: Mapping[str, Any], submission: Submission) -> bool:
    """An unbound-name error inside the trusted statement's lines (either line convention)."""
    pos = message.get("pos")
    first, last = submission.statement_lines
    if not isinstance(pos, Mapping) or not isinstance(pos.get("line"), int) or not first:
        return False
    data = str(message.get("data", ""))
    if "unknown identifier" not in data.lower() and "autoImplicit" not in data:
        return False
    return any(first <= line <= last for line in (pos["line"], pos["line"] + submission.header_lines))


def _at(message: Mapping[str, Any], line: int) -> bool:
    pos = message.get("pos")
    return isinstance(pos, Mapping) and pos.get("line") == line and pos.get("column") == 0


def _echo(messages: list[Mapping[str, Any]], submission: Submission) -> str | None:
    """None if Lean's answer echoes this request's nonce exactly where `#print "MARKER"` prints it."""
    echoes = [m for m in messages if submission.nonce in str(m.get("data", ""))]
    if not echoes:
        return ("Lean's answer does not echo this request's nonce, so it is not Lean's answer to this file "
                "(forged from inside the attempt, or out of step with the request)")
    echo = echoes[0]
    if len(echoes) > 1 or str(echo.get("data", "")).strip() != submission.marker or echo.get("severity") != "info":
        return "the nonce appears in Lean's answer in a form Lean does not print: the answer is forged"
    if not any(_at(echo, line) for line in _lines(submission, submission.nonce_line)):
        return f"the nonce echo is {_where(echo)}, not where Lean prints line {submission.nonce_line}: the answer is forged"
    return None


def _audit(messages: list[Mapping[str, Any]], submission: Submission) -> str | None:
    """None if exactly one axioms report, at the trusted `#print axioms` line, lists only allowed axioms."""
    name = submission.name
    reports = []
    for m in messages:
        data = str(m.get("data", "")).strip()
        hit = _AXIOMS.match(data) or _NO_AXIOMS.match(data)
        if hit:
            reports.append((m, hit))
    if not reports:
        return f"no `#print axioms {name}` report in Lean's output: the axioms could not be audited"
    if len(reports) > 1:
        return f"{len(reports)} axioms reports in Lean's output (expected exactly one): the proof printed its own"
    message, report = reports[0]
    if report.group("name").strip("«»") != name:
        return f"the axioms report is for `{report.group('name')}`, not `{name}`"
    if not any(_at(message, line) for line in _lines(submission, submission.audit_line)):
        return f"the axioms report is {_where(message)}, not where Lean prints line {submission.audit_line}"
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
