"""Rewrite assert-style tests (MBPP `assert f(x) == y`, HumanEval `check(candidate)`) into `TestCase`s.

The rewrite reads the assert with `ast` and evaluates only literals, so nothing in a dataset runs on
the host. Supported shapes, with F the entry point (or `candidate`) called on literal arguments and y
any literal (also `set(...)`, `sorted(...)`, `frozenset(...)` of one):

    assert F(...) == y        assert y == F(...)        assert F(...) is True / False / None
    assert F(...)             assert not F(...)
    assert set(F(...)) == y   assert frozenset(F(...)) == y   assert sorted(F(...)) == y   (either side)
    assert math.isclose(F(...), y[, rel_tol=..., abs_tol=...])      (either argument)
    assert abs(F(...) - y) < tol                         (also <=, and y - F(...))

The verdict is Python's own: a rewritten test passes exactly when the original assert would pass with
F returning that value (see `TestCase.check`), ill-formed tests included: `sorted(F()) == [3, 1, 2]`
never passes. Anything else raises `UnsupportedTest` naming the shape, so a loader can skip the task
loudly instead of silently checking less than the dataset meant; so does a test whose literals Python
cannot build, a tolerance Python rejects, and a `sorted` test comparing with sets, whose outcome in
Python depends on the returned set's iteration order (sets are only partially ordered).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from vrl_python_tests.checks import TestCase
from vrl_python_tests.harness import EncodeError, encode

_WRAPPERS = {"set": "set", "sorted": "sorted", "frozenset": "set"}
_CONSTRUCTORS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "sorted": sorted}


class UnsupportedTest(ValueError):
    """An assert this module cannot turn into an input/expected pair."""


def literal(node: ast.AST) -> object:
    """A literal, or set()/frozenset()/tuple()/list()/sorted() of one, or float('inf'/'nan')."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        name = node.func.id
        if name in _CONSTRUCTORS and len(node.args) <= 1:
            try:
                return _CONSTRUCTORS[name](*(literal(a) for a in node.args))
            except (TypeError, ValueError) as exc:  # set([[1]]), sorted([1, 'a']): the test itself would raise
                raise UnsupportedTest(f"{_src(node)} raises {type(exc).__name__}: {exc}") from None
        if name == "float" and len(node.args) == 1:
            arg = literal(node.args[0])
            if isinstance(arg, str) and arg.strip().lower() in ("inf", "-inf", "nan", "infinity", "-infinity"):
                return float(arg)
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise UnsupportedTest(f"not a literal: {_src(node)}") from None


def _src(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_call_to(node: ast.AST, names: Iterable[str]) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in set(names)


def _call_inputs(node: ast.Call) -> tuple[object, object]:
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        raise UnsupportedTest(f"*args/**kwargs in the call: {_src(node)}")
    args = [literal(a) for a in node.args]
    kwargs = {k.arg: literal(k.value) for k in node.keywords}
    try:
        return encode(args), encode(kwargs)
    except EncodeError as exc:
        raise UnsupportedTest(str(exc)) from None


def _unwrap(node: ast.AST, names: set[str]) -> tuple[ast.Call, str] | None:
    """F(...) -> (call, 'eq'); set(F(...)) -> (call, 'set'); sorted(F(...)) -> (call, 'sorted')."""
    if _is_call_to(node, names):
        return node, "eq"  # type: ignore[return-value]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _WRAPPERS
            and len(node.args) == 1 and not node.keywords and _is_call_to(node.args[0], names)):
        return node.args[0], _WRAPPERS[node.func.id]  # type: ignore[return-value]
    return None


def _holds_a_set(value: object) -> bool:
    if isinstance(value, (set, frozenset)):
        return True
    if isinstance(value, dict):
        return any(_holds_a_set(k) or _holds_a_set(v) for k, v in value.items())
    return isinstance(value, (list, tuple)) and any(_holds_a_set(v) for v in value)


def _tolerance(node: ast.AST, source: str) -> float:
    """A tolerance literal: a non-negative int or float that a float holds exactly, else UnsupportedTest."""
    value = literal(node)
    try:
        if isinstance(value, (int, float)) and value >= 0 and float(value) == value:  # not nan, not 2**60 + 1
            return float(value)
    except OverflowError:  # an int beyond a float's range
        pass
    raise UnsupportedTest(f"tolerance {_src(node)} is not a non-negative number a float holds: {source}")


def _case(call: ast.Call, compare: str, expected: object, source: str, hidden: bool, **extra) -> TestCase:
    args, kwargs = _call_inputs(call)
    if compare == "sorted" and isinstance(expected, list) and _holds_a_set(expected):
        raise UnsupportedTest(f"sorted() against sets depends on the returned set's iteration order: {source}")
    try:
        enc = encode(expected)
    except EncodeError as exc:
        raise UnsupportedTest(str(exc)) from None
    return TestCase(args=args, kwargs=kwargs, expected=enc, compare=compare, source=source, hidden=hidden, **extra)


def parse_assert(source: str, entry_point: str, hidden: bool = False, aliases: Iterable[str] = ("candidate",)) -> TestCase:
    """Turn one assert statement into a TestCase; raises UnsupportedTest for other shapes."""
    try:
        tree = ast.parse(source.strip())
    except SyntaxError as exc:
        raise UnsupportedTest(f"not valid Python: {exc.msg}") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise UnsupportedTest(f"not a single assert statement: {source.strip()[:80]}")
    return assert_node(tree.body[0], entry_point, source.strip(), hidden, aliases)


def assert_node(node: ast.Assert, entry_point: str, source: str, hidden: bool, aliases: Iterable[str]) -> TestCase:
    names = {entry_point, *aliases}
    test = node.test
    # assert F(...)  /  assert not F(...)
    if _is_call_to(test, names):
        return _case(test, "truthy", None, source, hidden)  # type: ignore[arg-type]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _is_call_to(test.operand, names):
        return _case(test.operand, "falsy", None, source, hidden)  # type: ignore[arg-type]
    # assert math.isclose(F(...), y, ...)
    if (isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and test.func.attr == "isclose"
            and isinstance(test.func.value, ast.Name) and test.func.value.id == "math" and len(test.args) == 2):
        sides = [test.args[0], test.args[1]]
        calls = [i for i, s in enumerate(sides) if _is_call_to(s, names)]
        if len(calls) == 1:
            tol = {k.arg: _tolerance(k.value, source) for k in test.keywords if k.arg in ("rel_tol", "abs_tol")}
            if len(tol) != len(test.keywords):
                raise UnsupportedTest(f"math.isclose with unknown keywords: {source}")
            return _case(sides[calls[0]], "isclose", literal(sides[1 - calls[0]]), source, hidden,  # type: ignore[arg-type]
                         rel_tol=tol.get("rel_tol", 1e-9), abs_tol=tol.get("abs_tol", 0.0))
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        # assert abs(F(...) - y) < tol
        if (isinstance(op, (ast.Lt, ast.LtE)) and _is_call_to(left, {"abs"}) and len(left.args) == 1  # type: ignore[attr-defined]
                and isinstance(left.args[0], ast.BinOp) and isinstance(left.args[0].op, ast.Sub)):  # type: ignore[attr-defined]
            diff = left.args[0]  # type: ignore[attr-defined]
            for call_side, value_side in ((diff.left, diff.right), (diff.right, diff.left)):
                if _is_call_to(call_side, names):  # y - F(...) is F(...) - y negated, exactly: same abs
                    compare = "abs<" if isinstance(op, ast.Lt) else "abs<="
                    return _case(call_side, compare, literal(value_side), source, hidden,  # type: ignore[arg-type]
                                 abs_tol=_tolerance(right, source))
        if isinstance(op, (ast.Eq, ast.Is)):
            for call_side, value_side in ((left, right), (right, left)):
                unwrapped = _unwrap(call_side, names)
                if unwrapped is None:
                    continue
                call, compare = unwrapped
                value_unwrapped = _unwrap(value_side, names)
                if value_unwrapped is not None:
                    raise UnsupportedTest(f"the entry point is called on both sides: {source}")
                expected = literal(value_side)
                if isinstance(op, ast.Is):
                    if not any(expected is s for s in (True, False, None)) or compare != "eq":
                        raise UnsupportedTest(f"`is` other than F(...) is True/False/None: {source}")
                    compare = "is"  # identity, as the assert means it: returning 1 is not `True`
                return _case(call, compare, expected, source, hidden)
    raise UnsupportedTest(f"unsupported assert shape: {source[:120]}")


def parse_check_function(test_source: str, entry_point: str) -> list[TestCase]:
    """HumanEval's `def check(candidate): assert ...` into TestCases (all hidden)."""
    try:
        tree = ast.parse(test_source)
    except SyntaxError as exc:
        raise UnsupportedTest(f"test code is not valid Python: {exc.msg}") from None
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        raise UnsupportedTest("no `def check(candidate)` in the test code")
    check = checks[0]
    param = check.args.args[0].arg if check.args.args else "candidate"
    cases = []
    for stmt in check.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstring or a bare string
        if isinstance(stmt, ast.Assert):
            if isinstance(stmt.test, ast.Constant) and stmt.test.value is True:
                continue  # HumanEval's `assert True, "This prints if this assert fails"`
            cases.append(assert_node(stmt, entry_point, ast.unparse(stmt), True, (param,)))
            continue
        raise UnsupportedTest(f"check() contains a {type(stmt).__name__} statement, not only asserts")
    if not cases:
        raise UnsupportedTest("check() has no asserts")
    return cases
