"""Find the Python code in a completion: fenced blocks first, then bare code.

Models answer in many shapes: a ```python block after some prose, several blocks (an example, then
the solution), a bare function, or (HumanEval style) only the body of a function whose signature was
in the prompt. The rules, in order:

1. Fenced blocks (``` or ~~~, any info string): the last block that defines the entry point wins;
   otherwise all python-looking blocks joined (helpers and the function may be split).
2. No fence: the whole text if it parses as Python; otherwise from the first line that starts like
   code (def, class, import, from, @, or an indented line when a `prefix` is given) to the end,
   trailing prose lines dropped.
3. If the result does not define the entry point and the task has a `prefix` (the signature and
   docstring the model was asked to complete), the prefix is prepended.
"""

from __future__ import annotations

import ast
import re

_FENCE = re.compile(r"^(?P<fence>```|~~~)[ \t]*(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.DOTALL | re.MULTILINE)
_UNCLOSED = re.compile(r"^(?:```|~~~)[ \t]*(?:python3?|py)?[ \t]*\n(?P<body>.*)\Z", re.DOTALL | re.MULTILINE)
_CODE_START = re.compile(r"^(?:def |async def |class |import |from |@)", re.MULTILINE)
_PYTHON_INFO = {"", "python", "python3", "py"}


def defines(code: str, entry_point: str) -> bool:
    """Whether `code` has a top-level `def entry_point` (or an assignment to it)."""
    name = re.escape(entry_point)
    return re.search(rf"^(?:async\s+)?def\s+{name}\s*\(|^{name}\s*=", code, re.MULTILINE) is not None


def extract_code(text: str, entry_point: str, prefix: str | None = None) -> str | None:
    """The code to run for a completion, or None when there is none."""
    code = _from_fences(text, entry_point)
    if code is None:
        code = _bare(text, prefix is not None)
    if code is None or not code.strip():
        return None
    if prefix and not defines(code, entry_point):
        code = prefix.rstrip("\n") + "\n" + code if code.startswith((" ", "\t")) else prefix + "\n" + code
    return code


def _from_fences(text: str, entry_point: str) -> str | None:
    blocks = [(m.group("info").strip().lower(), m.group("body")) for m in _FENCE.finditer(text)]
    if not blocks:
        unclosed = _UNCLOSED.search(text)  # generation stopped before the closing fence
        return unclosed.group("body") if unclosed else None
    python = [body for info, body in blocks if info in _PYTHON_INFO] or [body for _, body in blocks]
    defining = [body for body in python if defines(body, entry_point)]
    if defining:
        return defining[-1]
    return "\n".join(python)


def _parses(text: str) -> bool:
    if len(text) > 200_000:
        return False
    try:
        ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def _bare(text: str, indented_ok: bool) -> str | None:
    if _CODE_START.search(text) and _parses(text):
        return text  # all of it is code, module-level statements included
    match = _CODE_START.search(text)
    if match is not None:
        lines = text[match.start():].split("\n")
    elif indented_ok and text.startswith((" ", "\t")):
        lines = text.split("\n")  # a function body completing the prompt's signature
    else:
        return None
    # Drop trailing prose: unindented lines after the code that do not look like code.
    while lines and (not lines[-1].strip() or _is_prose(lines[-1])):
        lines.pop()
    return "\n".join(lines).rstrip() + "\n"


def _is_prose(line: str) -> bool:
    """An unindented line that reads like a sentence, not a statement."""
    if line.startswith((" ", "\t", "#", ")", "]", "}")) or _CODE_START.match(line):
        return False
    return re.match(r"^[A-Za-z_][A-Za-z0-9_.]*\s*(=|\(|\[|:|\+=|-=)", line) is None and not line.rstrip().endswith(":")
