"""Task sources: the bundled tasks, MBPP and HumanEval in their public formats, and plain vrl JSONL.

Every source becomes `vrl.Task`s whose `data` holds the entry point and the tests as `TestCase`s
(inputs and expected values, never code to run on the host). Rows that cannot be converted are
skipped with a warning that names them and says why; a source that yields no task is an error.

Formats (one JSON object per row):

* ``vrl`` (the bundled file): ``id``, ``text``, ``entry_point``, ``tests`` (asserts shown in the
  prompt), ``hidden_tests`` (asserts not shown), optional ``split`` (default ``train``),
  ``solution``. A test may also be a `TestCase` object instead of an assert string.
* ``mbpp``: ``task_id``, ``text`` (or ``prompt``), ``code``, ``test_list``, ``test_setup_code``,
  ``challenge_test_list``. The first ``visible_tests`` asserts are shown; the rest are hidden. The
  split follows the MBPP paper's id ranges: 1-10 prompt, 11-510 test, 511-600 validation, 601-974 train.
* ``humaneval``: ``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``. The
  prompt's signature and docstring are what the model completes; every `check` assert is hidden;
  the split is ``test``.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from vrl.types import Task
from vrl_python_tests.asserts import UnsupportedTest, parse_assert, parse_check_function
from vrl_python_tests.checks import TestCase
from vrl_python_tests.harness import decode

log = logging.getLogger(__name__)

Format = Literal["auto", "vrl", "mbpp", "humaneval"]
FORMATS = ("auto", "vrl", "mbpp", "humaneval")
ANSWER_INSTRUCTION = "Answer with the complete function in a ```python code block."


class DatasetError(ValueError):
    """A task source that cannot be read or yields no usable task."""


def bundled_path() -> Path:
    """The JSONL file of the tasks shipped with the plugin."""
    return Path(str(importlib.resources.files("vrl_python_tests") / "data" / "tasks.jsonl"))


def read_rows(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """Rows of a .jsonl, .json (a list) or .parquet file, each with a location for messages."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"task file not found: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        return [(f"{path} row {i + 1}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list):
            raise DatasetError(f"{path} must hold a JSON list of task objects")
        return [(f"{path} item {i + 1}", row) for i, row in enumerate(data)]
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            log.warning("skipping %s: not JSON (%s)", where, exc.msg)
            continue
        if not isinstance(row, dict):
            log.warning("skipping %s: a row must be a JSON object", where)
            continue
        rows.append((where, row))
    return rows


def detect_format(row: dict[str, Any]) -> str:
    """Guess a row's format from its keys."""
    if "test_list" in row:
        return "mbpp"
    if "canonical_solution" in row or ("test" in row and "entry_point" in row and "prompt" in row):
        return "humaneval"
    if "entry_point" in row and "tests" in row:
        return "vrl"
    raise DatasetError(f"unknown task format (keys: {', '.join(sorted(row))}); expected vrl, mbpp or humaneval keys")


def to_tasks(rows: Iterable[tuple[str, dict[str, Any]]], fmt: str = "auto", visible_tests: int = 1) -> list[Task]:
    """Convert rows to tasks, skipping (with a warning) those that cannot be converted."""
    if fmt not in FORMATS:
        raise DatasetError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if visible_tests < 0:
        raise DatasetError(f"visible_tests must be >= 0, got {visible_tests}")
    tasks: list[Task] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for where, row in rows:
        try:
            kind = detect_format(row) if fmt == "auto" else fmt
            task = {"vrl": from_vrl, "mbpp": from_mbpp, "humaneval": from_humaneval}[kind](row, visible_tests)
        except (DatasetError, UnsupportedTest, KeyError, TypeError, ValueError) as exc:
            reason = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            skipped.append(f"{where}: {reason}")
            continue
        if task.id in seen:
            skipped.append(f"{where}: duplicate task id {task.id!r}")
            continue
        seen.add(task.id)
        tasks.append(task)
    if skipped:
        log.warning("skipped %d task(s) that could not be converted, e.g. %s", len(skipped), "; ".join(skipped[:3]))
    if not tasks:
        detail = f" ({skipped[0]})" if skipped else ""
        raise DatasetError(f"no usable task in the source{detail}")
    return tasks


def _tests(items: Iterable[Any], entry_point: str, hidden: bool) -> list[TestCase]:
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(parse_assert(item, entry_point, hidden=hidden))
        elif isinstance(item, dict):
            out.append(TestCase.model_validate({**item, "hidden": hidden}))
        else:
            raise DatasetError(f"a test must be an assert string or a TestCase object, got {type(item).__name__}")
    return out


def make_prompt(text: str, entry_point: str, shown: list[TestCase]) -> str:
    """The prompt for MBPP-style tasks: the description, the visible tests, the answer format."""
    lines = [text.strip(), "", f"The function must be named `{entry_point}`."]
    if shown:
        lines += ["It should pass tests like these:", "```python"]
        lines += [t.source or f"assert {t.call_text(entry_point)} == {decode(t.expected)!r}" for t in shown]
        lines += ["```"]
    lines += [ANSWER_INSTRUCTION]
    return "\n".join(lines)


def _task(task_id: str, prompt: str, entry_point: str, tests: list[TestCase], split: str, source: str,
          solution: str | None = None, prefix: str | None = None) -> Task:
    if not tests:
        raise DatasetError("a task needs at least one test")
    if not entry_point.isidentifier():
        raise DatasetError(f"entry_point {entry_point!r} is not a Python identifier")
    data: dict[str, Any] = {
        "entry_point": entry_point,
        # Python mode: the encoded values are JSON data already, and pydantic's JSON mode stops at 255
        # levels of nesting (an expected list 128 deep), below harness.MAX_DEPTH.
        "tests": [t.model_dump(mode="python") for t in tests],
        "split": split,
        "source": source,
    }
    if solution is not None:
        data["solution"] = solution
    if prefix is not None:
        data["prefix"] = prefix
    return Task(id=task_id, prompt=prompt, data=data)


def from_vrl(row: dict[str, Any], visible_tests: int = 1) -> Task:
    """A row of the vrl format (see the module docstring)."""
    del visible_tests  # the row says which tests are visible
    entry = str(row["entry_point"])
    shown = _tests(row["tests"], entry, hidden=False)
    hidden = _tests(row.get("hidden_tests", []), entry, hidden=True)
    prompt = row.get("prompt") or make_prompt(str(row.get("text", "")), entry, shown)
    return _task(str(row["id"]), prompt, entry, shown + hidden, str(row.get("split", "train")), "vrl",
                 row.get("solution"))


def mbpp_split(task_id: int) -> str:
    """The MBPP paper's split of task ids."""
    if task_id <= 10:
        return "prompt"
    if task_id <= 510:
        return "test"
    if task_id <= 600:
        return "validation"
    return "train"


def from_mbpp(row: dict[str, Any], visible_tests: int = 1) -> Task:
    """A row of MBPP (full or sanitized)."""
    if (row.get("test_setup_code") or "").strip():
        raise UnsupportedTest("test_setup_code is not supported (the tests would run code on the host)")
    asserts = list(row["test_list"]) + list(row.get("challenge_test_list") or [])
    if not asserts:
        raise DatasetError("no tests")
    entry = _called_name(asserts[0])
    cases = [parse_assert(a, entry, hidden=i >= visible_tests) for i, a in enumerate(asserts)]
    text = row.get("text") or row.get("prompt")
    if not text:
        raise KeyError("text")
    task_id = int(row["task_id"])
    prompt = make_prompt(str(text), entry, [c for c in cases if not c.hidden])
    return _task(f"mbpp-{task_id}", prompt, entry, cases, mbpp_split(task_id), "mbpp", row.get("code"))


def _called_name(assert_source: str) -> str:
    """The name of the first function called in an assert (MBPP rows do not name their entry point)."""
    import ast

    try:
        tree = ast.parse(assert_source.strip())
    except SyntaxError as exc:
        raise UnsupportedTest(f"not valid Python: {exc.msg}") from None
    builtin = {"set", "sorted", "abs", "frozenset", "list", "tuple", "float", "isclose", "round"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in builtin:
            return node.func.id
    raise UnsupportedTest(f"no function call in {assert_source[:80]}")


def from_humaneval(row: dict[str, Any], visible_tests: int = 1) -> Task:
    """A row of HumanEval: complete the function whose signature and docstring are in `prompt`."""
    del visible_tests  # HumanEval shows its examples inside the docstring
    entry = str(row["entry_point"])
    cases = parse_check_function(str(row["test"]), entry)
    prefix = str(row["prompt"])
    prompt = ("Complete the following Python function.\n\n```python\n" + prefix.rstrip() + "\n```\n"
              + ANSWER_INSTRUCTION)
    solution = prefix + row["canonical_solution"] if row.get("canonical_solution") else None
    return _task(str(row["task_id"]), prompt, entry, cases, "test", "humaneval", solution, prefix=prefix)


def load_source(source: str, fmt: str = "auto", visible_tests: int = 1) -> list[Task]:
    """Tasks from 'bundled', a file path, or 'hf:<dataset>[:<config>]' (needs internet and `datasets`)."""
    if source == "bundled":
        return to_tasks(read_rows(bundled_path()), "vrl")
    if source.startswith("hf:"):
        return to_tasks(hub_rows(source[3:]), fmt, visible_tests)
    return to_tasks(read_rows(source), fmt, visible_tests)


def hub_rows(name: str) -> list[tuple[str, dict[str, Any]]]:
    """Every split of a Hugging Face dataset, e.g. 'mbpp', 'mbpp:sanitized', 'openai_humaneval'."""
    try:
        import datasets
    except ImportError:
        raise DatasetError("tasks=hf:... needs the `datasets` package: pip install datasets") from None
    path, _, config = name.partition(":")
    try:
        loaded = datasets.load_dataset(path, config or None)
    except Exception as exc:  # noqa: BLE001 - offline, unknown name, gated: all worth the same advice
        raise DatasetError(f"could not load {path!r} from the Hugging Face Hub ({exc}); "
                           "download it as JSONL or parquet and pass tasks=/path/to/file instead") from None
    return [(f"hf:{name}/{split} row {i + 1}", dict(row)) for split, rows in loaded.items() for i, row in enumerate(rows)]
