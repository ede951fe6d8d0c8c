"""Just enough of Lean 4's lexer to find comments, strings and top-level `:=` reliably.

The validity policy scans and sends the comment-free text this module produces, so whatever it gets
wrong can only cause a false rejection or a compile error, never hide code from the scan.
"""

from __future__ import annotations

import re


class LexError(ValueError):
    """Text that Lean itself would refuse to lex (an unterminated comment)."""


def comment_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every comment: `--` to end of line, and nested `/- ... -/` blocks."""
    spans: list[tuple[int, int]] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            i = _skip_string(text, i)
        elif text.startswith("--", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            spans.append((i, end))
            i = end
        elif text.startswith("/-", i):
            start, depth, i = i, 1, i + 2
            while i < n and depth:
                if text.startswith("/-", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("-/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            if depth:
                line = text.count("\n", 0, start) + 1
                raise LexError(f"unterminated block comment `/-` starting on line {line}")
            spans.append((start, i))
        else:
            i += 1
    return spans


def _skip_string(text: str, i: int) -> int:
    """Index just past the string literal opening at `i` (or the end of text if it never closes)."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return len(text)


def strip_comments(text: str) -> str:
    """The text with every comment removed; a block comment leaves one space so tokens stay apart."""
    out, last = [], 0
    for start, end in comment_spans(text):
        out.append(text[last:start])
        if text.startswith("/-", start):
            out.append(" ")
        last = end
    out.append(text[last:])
    return "".join(out)


def comments(text: str) -> list[str]:
    """The comments' texts, in order (used to recover a problem's informal statement)."""
    return [text[s:e] for s, e in comment_spans(text)]


_OPEN, _CLOSE = "([{⟨⦃", ")]}⟩⦄"


def top_level_assign(text: str, start: int = 0) -> int | None:
    """Index of the first `:=` at bracket depth 0 from `start` (comments already stripped)."""
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch == '"':
            i = _skip_string(text, i)
            continue
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(0, depth - 1)
        elif depth == 0 and text.startswith(":=", i):
            return i
        i += 1
    return None


IDENT_CHAR = r"[\w'!?₀-₉ₐ-ₜᵢ-ᵪⱼ]"
"""Characters that continue a Lean identifier (approximately: letters, digits, _, ', !, ?, subscripts)."""


def declaration_re(name: str) -> re.Pattern[str]:
    """`theorem NAME` or `lemma NAME` as a whole identifier."""
    return re.compile(rf"(?<![\w.'])(theorem|lemma)\s+{re.escape(name)}(?!{IDENT_CHAR}|\.)")
