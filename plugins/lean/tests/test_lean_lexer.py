"""The tokeniser splits text as Lean v4.15 does (Lean is not installed here: the expected splits
follow Lean's `Parser/Basic.lean` rules: `isIdFirst`, `numberFn`, `charLitFnAux`, `strLitFnAux`)."""

from __future__ import annotations

import pytest
from vrl_lean.lexer import LexError, tokenize


def kinds(text: str) -> list[tuple[str, str]]:
    return [(t.kind, t.text) for t in tokenize(text).tokens]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("0sorry", [("number", "0"), ("word", "sorry")]),  # identifiers never start with a digit
        ("1set_option", [("number", "1"), ("word", "set_option")]),
        ("2e5x 2.y", [("number", "2e5"), ("word", "x"), ("number", "2."), ("word", "y")]),
        ("h' h₁ x!", [("word", "h'"), ("word", "h₁"), ("word", "x!")]),
        ("#eval! 1", [("hash", "#eval!"), ("number", "1")]),
        ("_root_.sorryAx a.«b c».d", [("word", "_root_.sorryAx"), ("word", "a.«b c».d")]),
        ("'\"' -- c \"\nx", [("char", "'\"'"), ("word", "x")]),
        ("'\\'' '\\x41'", [("char", "'\\''"), ("char", "'\\x41'")]),
        ('"a \\" sorry" b', [("string", '"a \\" sorry"'), ("word", "b")]),
        ('r"\\" sorry', [("string", 'r"\\"'), ("word", "sorry")]),  # raw strings have no escapes
        ('r#"a"b"# c', [("string", 'r#"a"b"#'), ("word", "c")]),
        ("/- a /- b -/ sorry -/ x", [("word", "x")]),  # nested block comments
        ("f ⁻¹' s", [("word", "f"), ("symbol", "⁻"), ("symbol", "¹"), ("symbol", "'"), ("word", "s")]),
        ("a := @[simp]", [("word", "a"), ("symbol", ":="), ("symbol", "@["), ("word", "simp"), ("symbol", "]")]),
    ],
)
def test_tokens_as_lean_splits_them(text, expected):
    assert kinds(text) == expected


@pytest.mark.parametrize(
    "text,reason",
    [
        ("x <-- y", "glued"),
        ("x +'\"' y", "glued"),
        ('"\\q"', "invalid escape"),
        ('"a\\\n b"', "invalid escape"),  # string gaps: refused rather than guessed
        ("'ab'", "missing end of character literal"),
        ('"abc', "unterminated string"),
        ("/- /- -/", "unterminated block comment"),
        ("«abc", "unterminated `«`"),
        ("0x", "without digits"),
        ('s!"{"}"', "cannot be told apart"),
    ],
)
def test_text_lean_would_read_differently_is_refused(text, reason):
    with pytest.raises(LexError, match=reason):
        tokenize(text)


@pytest.mark.parametrize(
    "text,name",
    [
        ("native", ("native",)),
        ("«native»", ("native",)),  # Lean 4.28: `decide +«native»` is `decide +native`
        ("_root_.native", ("native",)),
        ("«config».«mk»", ("config", "mk")),
        ("a.«b c».d", ("a", "b c", "d")),
        ("_root_", ("_root_",)),
        ("\"native\"", ()),
    ],
)
def test_a_word_carries_the_name_lean_reads(text, name):
    (token,) = tokenize(text).tokens
    assert token.name == name
