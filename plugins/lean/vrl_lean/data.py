"""Problems: the lean_workbook rows of kfdong/STP_Lean_SFT, or local `.lean` / JSONL statement files.

A problem is a trusted `Theorem` (name, header, statement) plus its informal text. STP rows carry
`prompt` = "Complete the following Lean 4 code:\\n\\n```lean4\\n" + header + statement (ending in
`:= by`) and `target` = a proof; the prompt alone gives the header and the statement. Conjecture rows
(tagged `<hard theorem>`, `<easy theorem>`, `<lemma>`) are not problems and are skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vrl_lean.lexer import LexError, comment_spans, strip_comments, top_level_assign
from vrl_lean.policy import Theorem

log = logging.getLogger(__name__)

STP_DATASET = "kfdong/STP_Lean_SFT"
_CONJECTURE_TAGS = ("<hard theorem>", "</hard theorem>", "<easy theorem>", "<lemma>", "<statement>")
_DECL = re.compile(r"(?<![\w'!?.])(theorem|lemma)\s+([^\s(:{\[⦃]+)")


class BadProblem(ValueError):
    """Text that does not contain a usable theorem statement."""


@dataclass(frozen=True)
class Problem:
    """A theorem to prove and the informal problem text shown beside it (may be empty)."""

    theorem: Theorem
    informal: str = ""

    @property
    def name(self) -> str:
        return self.theorem.name


def parse_lean_source(text: str, name: str | None = None) -> Problem:
    """Header, informal comment and statement from Lean source (a statement file or a proved file).

    The statement runs from `theorem NAME` to its first top-level `:=`; anything after is ignored.
    """
    text = text.replace("\r\n", "\n")
    try:
        spans = comment_spans(text)
    except LexError as exc:
        raise BadProblem(str(exc)) from None
    decls = [m for m in _DECL.finditer(text) if not any(s <= m.start() < e for s, e in spans)]
    decl = next((m for m in decls if name is None or m.group(2) == name), None)
    if decl is None:
        raise BadProblem(f"no `theorem {name or 'NAME'}` declaration found")
    head, rest = text[: decl.start()], strip_comments(text[decl.start():])
    assign = top_level_assign(rest)
    statement = (rest if assign is None else rest[:assign]).strip()
    if statement.startswith("lemma"):
        statement = "theorem" + statement[len("lemma"):]
    header_lines = [ln for ln in strip_comments(head).splitlines() if ln.strip()]
    for ln in header_lines:
        if not ln.strip().startswith(("import ", "set_option ", "open ")):
            raise BadProblem(f"unexpected line before the theorem (only import/set_option/open may come first): {ln.strip()[:80]!r}")
    informal = "\n".join(_comment_text(head[s:e]) for s, e in comment_spans(head)).strip()
    header = "\n".join(ln.strip() for ln in header_lines) + "\n"
    return Problem(Theorem(name=decl.group(2), header=header, statement=statement), informal)


def _comment_text(comment: str) -> str:
    body = comment[2:] if comment.startswith("--") else comment[2:-2]
    return body.lstrip("-!").strip()


def parse_stp_row(row: Mapping[str, Any]) -> Problem | None:
    """A problem from one STP_Lean_SFT row, or None when the row is not a lean_workbook problem."""
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or "lean_workbook" not in prompt or any(t in prompt for t in _CONJECTURE_TAGS):
        return None
    _, fence, code = prompt.partition("```lean4")
    code = (code if fence else prompt).split("```", 1)[0]
    problem = parse_lean_source(code)
    if not problem.name.startswith("lean_workbook"):
        return None
    return problem


def load_stp(split: str = "train", revision: str | None = None) -> list[Problem]:
    """The lean_workbook problems of kfdong/STP_Lean_SFT (downloads with `datasets` on first use)."""
    from vrl.errors import DatasetUnavailable
    from vrl.hub import check_dataset

    try:
        from datasets import load_dataset
    except ImportError as exc:  # pragma: no cover - datasets is a dependency
        raise RuntimeError("loading kfdong/STP_Lean_SFT needs `pip install datasets`") from exc
    instead = ", or pass local problems with -o data=PATH (a .lean file, a directory of them, or .jsonl)"
    check_dataset(STP_DATASET, revision, instead=instead)  # seconds, not a minute of retries
    try:
        rows = load_dataset(STP_DATASET, split=split, revision=revision)
    except (ConnectionError, OSError) as exc:  # the Hub went away between the check and the download
        raise DatasetUnavailable(f"cannot load {STP_DATASET}: {type(exc).__name__}: {exc}{instead}") from exc
    return problems_from_rows(rows, parse_stp_row, source=STP_DATASET)


def problems_from_rows(rows: Iterable[Mapping[str, Any]], parse, source: str) -> list[Problem]:
    """Parse rows, skip (and count) bad ones, deduplicate by theorem name keeping the first."""
    out: dict[str, Problem] = {}
    bad = 0
    for row in rows:
        try:
            problem = parse(row)
        except (BadProblem, ValueError) as exc:
            bad += 1
            if bad <= 3:
                log.warning("%s: skipped a row: %s", source, exc)
            continue
        if problem is not None and problem.name not in out:
            out[problem.name] = problem
    if bad:
        log.warning("%s: skipped %d malformed rows", source, bad)
    return list(out.values())


def parse_jsonl_row(row: Mapping[str, Any]) -> Problem | None:
    """A JSONL statement row: STP-style {"prompt"}, or {"formal_statement", "header"?, "name"?, "informal"?}."""
    if "prompt" in row and "formal_statement" not in row:
        return parse_stp_row(row) or _fail("prompt holds no lean_workbook theorem")
    statement = row.get("formal_statement", row.get("statement"))
    if not isinstance(statement, str):
        raise BadProblem('a JSONL row needs "formal_statement" (Lean text starting with `theorem NAME`) or "prompt"')
    header = row.get("header") or "import Mathlib\nimport Aesop\n\nopen BigOperators Real Nat Topology Rat\n"
    problem = parse_lean_source(f"{header}\n{statement}", name=row.get("name"))
    informal = row.get("informal") or row.get("informal_prefix") or row.get("problem") or problem.informal
    return Problem(problem.theorem, _comment_text(informal) if str(informal).startswith(("/-", "--")) else str(informal))


def _fail(msg: str) -> None:
    raise BadProblem(msg)


def load_local(path: str | Path) -> list[Problem]:
    """Problems from a `.lean` file, a directory of `.lean` files, or a `.jsonl` file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"Lean problem data not found: {path} (a .lean file, a directory of them, or .jsonl)")
    if path.is_dir():
        files = sorted(path.glob("*.lean"))
        if not files:
            raise FileNotFoundError(f"no .lean files in {path}")
        return problems_from_rows(({"file": f} for f in files), lambda r: parse_lean_source(r["file"].read_text()), str(path))
    if path.suffix == ".lean":
        return [parse_lean_source(path.read_text())]
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        return problems_from_rows(rows, parse_jsonl_row, str(path))
    raise ValueError(f"unsupported Lean problem file {path}: use .lean, a directory of .lean files, or .jsonl")


def split_problems(problems: list[Problem], test_fraction: float) -> dict[str, list[Problem]]:
    """A deterministic train/test split by a hash of the theorem name (stable as data grows)."""
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    ranked = sorted(problems, key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
    n_test = min(len(problems) - 1, max(1, round(len(problems) * test_fraction))) if test_fraction and len(problems) > 1 else 0
    test = {p.name for p in ranked[:n_test]}
    return {
        "train": [p for p in problems if p.name not in test],
        "test": [p for p in problems if p.name in test],
    }
