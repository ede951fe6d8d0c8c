"""Lean 4's tokeniser, closely enough that the policy sees the tokens Lean sees.

The validity policy decides on tokens, not on word regexes, so it must split text the way Lean
v4.15 does: identifiers start with a letter, `_` or a letter-like symbol, never a digit (`0sorry` is
the number `0` and then `sorry`); `«...»` escapes a name part; comments are `--` to the end of the
line and nested `/- ... -/`; string literals have escapes and `s!"{...}"` interpolations; raw
strings are `r"..."` / `r#"..."#`; `'"'` is a character literal; `#eval!` is one command token.

Lean recovers from a parse error by reading on token by token and starting a command wherever one
parses, so a difference between this tokeniser and Lean's could hide a command. Where Lean's
reading is ambiguous to us (a comment glued to an operator, a quote that may be part of an operator
token, a string whose `{` may start an interpolation) the strict tokeniser raises `LexError` and
the policy refuses the text: a refusal costs a rare legitimate proof, a mismatch could cost the
verdict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


class LexError(ValueError):
    """Text that Lean cannot tokenise, or that we cannot tokenise exactly as Lean does."""


def is_letter_like(c: str) -> bool:
    """Lean v4.15 `isLetterLike`: Greek (not λ, Π, Σ), Coptic, letter-like symbols, math alphanumerics."""
    v = ord(c)
    return (
        (0x3B1 <= v <= 0x3C9 and v != 0x3BB)
        or (0x391 <= v <= 0x3A9 and v not in (0x3A0, 0x3A3))
        or 0x3CA <= v <= 0x3FB
        or 0x1F00 <= v <= 0x1FFE
        or 0x2100 <= v <= 0x214F
        or 0x1D49C <= v <= 0x1D59F
    )


def is_subscript(c: str) -> bool:
    v = ord(c)
    return 0x2080 <= v <= 0x2089 or 0x2090 <= v <= 0x209C or 0x1D62 <= v <= 0x1D6A


def is_id_first(c: str) -> bool:
    """Lean's `isIdFirst`: ASCII letters (Lean's `isAlpha` is ASCII only), `_`, letter-like symbols."""
    return ("a" <= c <= "z") or ("A" <= c <= "Z") or c == "_" or (c > "\x7f" and is_letter_like(c))


def is_id_rest(c: str) -> bool:
    """Lean's `isIdRest`: `isIdFirst`, ASCII digits, `'`, `!`, `?`, subscripts."""
    return is_id_first(c) or ("0" <= c <= "9") or c in "'!?" or (c > "\x7f" and is_subscript(c))


_LETTER_LIKE = "\u03b1-\u03ba\u03bc-\u03c9\u0391-\u039f\u03a1\u03a2\u03a4-\u03a9\u03ca-\u03fb\u1f00-\u1ffe\u2100-\u214f\U0001d49c-\U0001d59f"
_ID_REST = re.compile(f"[A-Za-z_0-9'!?{_LETTER_LIKE}\u2080-\u2089\u2090-\u209c\u1d62-\u1d6a]*")
_SPACE = re.compile(r"[ \t\r\n]+")
_DIGITS = re.compile(r"[0-9]*")
_PLAIN = re.compile(r"[^\s\"'#@:«`/\-A-Za-z_0-9r" + _LETTER_LIKE + "]")
_OPEN, _CLOSE = "([{⟨⦃", ")]}⟩⦄"
_QUOTABLE = "\\\"'rnt"
_HEX = "0123456789abcdefABCDEF"


@dataclass
class Token:
    """One token. `kind`: word (identifier or keyword), number, string, char, hash (`#eval!`), symbol.

    A word's `parts` are its dot-separated name parts with `«»` removed; `escaped` says some part
    was written in `«»` (then it is an identifier, never a keyword). A string's `braces` says its
    text contains `{` (it may be an interpolation).
    """

    kind: str
    text: str
    start: int
    end: int
    parts: tuple[str, ...] = ()
    escaped: bool = False
    braces: bool = False
    code: list[Token] = field(default_factory=list)

    @property
    def name(self) -> tuple[str, ...]:
        """The name Lean reads: a word's parts with `«»` removed and a leading `_root_` dropped, so that
        `«native»`, `_root_.native` and `native` compare equal (() for any other token)."""
        if self.kind != "word":
            return ()
        return self.parts[1:] if len(self.parts) > 1 and self.parts[0] == "_root_" else self.parts


@dataclass
class Lexed:
    tokens: list[Token]
    comments: list[tuple[int, int]]


def tokenize(text: str, strict: bool = True) -> Lexed:
    """Tokens and comment spans of `text`. `strict=False` never raises (for trusted problem files)."""
    return _Lexer(text, strict).run()


class _Lexer:
    def __init__(self, text: str, strict: bool):
        self.s, self.n, self.strict = text, len(text), strict
        self.tokens: list[Token] = []
        self.comments: list[tuple[int, int]] = []

    def fail(self, at: int, why: str) -> None:
        if self.strict:
            line = self.s.count("\n", 0, at) + 1
            raise LexError(f"{why} (line {line})")

    def glued_to_operator(self, i: int) -> bool:
        """True when the previous token is an operator symbol that ends exactly at `i`."""
        if not self.tokens or self.tokens[-1].end != i:
            return False
        last = self.tokens[-1]
        return last.kind == "symbol" and last.text not in _OPEN + _CLOSE + ",;"

    def run(self) -> Lexed:
        s, n = self.s, self.n
        i = 0
        space, plain = _SPACE.match, _PLAIN.match
        while i < n:
            c = s[i]
            if c in " \t\r\n":
                i = space(s, i).end()
            elif plain(s, i):  # an operator or bracket character that starts nothing else
                self.tokens.append(Token("symbol", c, i, i + 1))
                i += 1
            elif (c == "-" and s.startswith("--", i)) or (c == "/" and s.startswith("/-", i)):
                if self.glued_to_operator(i):
                    # Lean reads the longest operator token first (`<-` in `<--`, `//` in `//-`):
                    # whether this starts a comment depends on Lean's token table.
                    self.fail(i, f"`{s[i:i + 2]}` is glued to the operator `{self.tokens[-1].text}`: "
                                 "put a space before the comment")
                i = self.comment(i)
            elif c == '"':
                i = self.string(i)
            elif c == "r" and self.raw_start(i):
                i = self.raw_string(i)
            elif "0" <= c <= "9":
                i = self.number(i)
            elif c == "'":
                i = self.quote(i)
            elif c == "«" or is_id_first(c):
                i = self.word(i)
            elif c == "#" and i + 1 < n and (is_id_first(s[i + 1]) or s[i + 1] == "«"):
                j = _ID_REST.match(s, i + 1).end()
                self.tokens.append(Token("hash", s[i:j], i, j))
                i = j
            elif s.startswith(":=", i) or s.startswith("@[", i):
                self.tokens.append(Token("symbol", s[i:i + 2], i, i + 2))
                i += 2
            else:
                self.tokens.append(Token("symbol", c, i, i + 1))
                i += 1
        return Lexed(self.tokens, self.comments)

    def comment(self, i: int) -> int:
        s, n = self.s, self.n
        if s.startswith("--", i):
            end = s.find("\n", i)
            end = n if end < 0 else end
            self.comments.append((i, end))
            return end
        start, depth, i = i, 1, i + 2
        while depth:
            close = s.find("-/", i)
            if close < 0:
                depth = -1
                break
            nested = s.find("/-", i, close)
            if nested < 0:
                depth, i = depth - 1, close + 2
            else:
                depth, i = depth + 1, nested + 2
        if depth:
            line = s.count("\n", 0, start) + 1
            raise LexError(f"unterminated block comment `/-` starting on line {line}")
        self.comments.append((start, i))
        return i

    def escape(self, i: int) -> int:
        """Index after the escape sequence whose backslash is at `i`; invalid ones fail like Lean's."""
        s = self.s
        c = s[i + 1] if i + 1 < self.n else ""
        if c and c in _QUOTABLE:
            return i + 2
        if c == "x" and all(ch in _HEX for ch in s[i + 2 : i + 4]) and len(s[i + 2 : i + 4]) == 2:
            return i + 4
        if c == "u" and all(ch in _HEX for ch in s[i + 2 : i + 6]) and len(s[i + 2 : i + 6]) == 4:
            return i + 6
        # Anything else, string gaps (backslash-newline) included, is refused: where Lean v4.15 would
        # stop with an error inside the literal, its recovery would read the rest of it as code.
        self.fail(i, f"invalid escape sequence `\\{c}` (Lean rejects it)")
        return i + 2

    def string(self, i: int) -> int:
        s, n = self.s, self.n
        start, j, braces = i, i + 1, False
        while j < n:
            if s[j] == "\\":
                j = self.escape(j)
            elif s[j] == '"':
                break
            else:
                braces = braces or s[j] == "{"
                j += 1
        else:
            raise LexError(f"unterminated string literal starting on line {s.count(chr(10), 0, start) + 1}")
        end = j + 1
        token = Token("string", s[start:end], start, end, braces=braces)
        if braces:
            # `s!"..{e}.."` (and `m!`, `f!`, `throwError`...) read `{e}` as code. Whether this string is
            # one depends on the syntax around it, so both readings must end in the same place.
            other = self.interpolated_end(start)
            if other != end:
                self.fail(start, "a string literal with `{` reads differently as plain text and as an "
                                 "interpolation `s!\"...{...}\"`: Lean's reading cannot be told apart")
            token.code = tokenize(s[start + 1 : end - 1], strict=False).tokens
        self.tokens.append(token)
        return end

    def interpolated_end(self, i: int) -> int:
        """End of the literal at `i` read as an interpolated string, or -1 if that reading fails."""
        s, n = self.s, self.n
        j = i + 1
        while j < n:
            c = s[j]
            if c == "\\":
                j += 2
            elif c == '"':
                return j + 1
            elif c == "{":
                depth, j = 1, j + 1
                while j < n and depth:
                    if s[j] in "([{":
                        depth += 1
                    elif s[j] in ")]}":
                        depth -= 1
                    elif s[j] == '"':
                        return -1  # a string inside an interpolation: too close to call
                    j += 1
                if depth:
                    return -1
            else:
                j += 1
        return -1

    def raw_start(self, i: int) -> bool:
        j = i + 1
        while j < self.n and self.s[j] == "#":
            j += 1
        return j < self.n and self.s[j] == '"'

    def raw_string(self, i: int) -> int:
        s = self.s
        j = i + 1
        while s[j] == "#":
            j += 1
        closing = '"' + "#" * (j - i - 1)
        end = s.find(closing, j + 1)
        if end < 0:
            raise LexError(f"unterminated raw string literal starting on line {s.count(chr(10), 0, i) + 1}")
        end += len(closing)
        self.tokens.append(Token("string", s[i:end], i, end))
        return end

    def number(self, i: int) -> int:
        s, n = self.s, self.n
        j = i + 1
        if s[i] == "0" and j < n and s[j] in "xXbBoO":
            digits = {"x": _HEX, "b": "01", "o": "01234567"}[s[j].lower()]
            k = j + 1
            while k < n and s[k] in digits:
                k += 1
            if k == j + 1:
                self.fail(i, f"`{s[i:j + 1]}` without digits (Lean rejects it)")
            j = k
        else:
            j = _DIGITS.match(s, j).end()
            # As Lean's decimal reader: `2.` and `2e` belong to the number even without digits after.
            if j < n and s[j] == ".":
                j = _DIGITS.match(s, j + 1).end()
            if j < n and s[j] in "eE":
                j += 1
                if j < n and s[j] in "+-":
                    j += 1
                j = _DIGITS.match(s, j).end()
        self.tokens.append(Token("number", s[i:j], i, j))
        return j

    def quote(self, i: int) -> int:
        """A `'` at a token start: a character literal, or part of an operator (`∑'`, `⁻¹'`)."""
        s, n = self.s, self.n
        nxt = s[i + 1] if i + 1 < n else ""
        if nxt == "'" or nxt == "":
            self.tokens.append(Token("symbol", "'", i, i + 1))
            return i + 1
        if self.glued_to_operator(i):
            # `⁻¹'` is one Mathlib token but `+'a'` is `+` and a character: unknowable without
            # Lean's token table. Only a quote, backslash or quote-mark after it could hide text.
            if nxt in "\"\\'":
                self.fail(i, f"`'` glued to the operator `{self.tokens[-1].text}` followed by `{nxt}`: "
                             "put a space between them")
            self.tokens.append(Token("symbol", "'", i, i + 1))
            return i + 1
        j = self.escape(i + 1) if nxt == "\\" else i + 2
        if j < n and s[j] == "'":
            self.tokens.append(Token("char", s[i : j + 1], i, j + 1))
            return j + 1
        self.fail(i, "missing end of character literal (Lean rejects it)")
        self.tokens.append(Token("symbol", "'", i, i + 1))
        return i + 1

    def word(self, i: int) -> int:
        s, n = self.s, self.n
        parts: list[str] = []
        escaped = False
        j = i
        while True:
            if s[j] == "«":
                end = s.find("»", j + 1)
                if end < 0:
                    raise LexError(f"unterminated `«` identifier on line {s.count(chr(10), 0, j) + 1}")
                parts.append(s[j + 1 : end])
                escaped, j = True, end + 1
            else:
                k = _ID_REST.match(s, j + 1).end()
                parts.append(s[j:k])
                j = k
            if j + 1 < n and s[j] == "." and (s[j + 1] == "«" or is_id_first(s[j + 1])):
                j += 1
                continue
            break
        self.tokens.append(Token("word", s[i:j], i, j, parts=tuple(parts), escaped=escaped))
        return j


def comment_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every comment: `--` to end of line, and nested `/- ... -/` blocks."""
    return tokenize(text, strict=False).comments


def strip_comments(text: str, spans: list[tuple[int, int]] | None = None) -> str:
    """The text with every comment removed; a block comment leaves one space so tokens stay apart."""
    out, last = [], 0
    for start, end in comment_spans(text) if spans is None else spans:
        out.append(text[last:start])
        if text.startswith("/-", start):
            out.append(" ")
        last = end
    out.append(text[last:])
    return "".join(out)


def comments(text: str) -> list[str]:
    """The comments' texts, in order (used to recover a problem's informal statement)."""
    return [text[s:e] for s, e in comment_spans(text)]


def top_level_assign(text: str, start: int = 0) -> int | None:
    """Index of the first `:=` at bracket depth 0 from `start` (comments already stripped)."""
    depth = 0
    for token in tokenize(text[start:], strict=False).tokens:
        if token.kind != "symbol":
            continue
        if token.text in _OPEN:
            depth += 1
        elif token.text in _CLOSE:
            depth = max(0, depth - 1)
        elif depth == 0 and token.text == ":=":
            return start + token.start
    return None


IDENT_CHAR = r"[\w'!?₀-₉ₐ-ₜᵢ-ᵪⱼ]"
"""Characters that continue a Lean identifier (approximately), for matching trusted statements."""


def declaration_re(name: str) -> re.Pattern[str]:
    """`theorem NAME` or `lemma NAME` as a whole identifier (used on trusted statements only)."""
    return re.compile(rf"(?<![\w.'])(theorem|lemma)\s+{re.escape(name)}(?!{IDENT_CHAR}|\.)")
