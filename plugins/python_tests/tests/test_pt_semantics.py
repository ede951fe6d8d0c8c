"""The host's verdict on a rewritten assert is exactly Python's verdict on the original assert.

Each row is (assert as written, value the function returns). What Python says is computed here by
running the assert itself with `f` returning that value; what the plugin says comes from the path the
verifier takes: `parse_assert`, the TestCase stored in a task and read back, the value encoded, sent
as JSON and decoded, then `TestCase.check`. The two must agree on every row, ill-formed tests included
(`sorted(f()) == [3, 1, 2]` can never pass in Python, so it must never pass here).
"""

from __future__ import annotations

import json
import math
import pickle

import pytest
from conftest import make_task
from vrl_python_tests.asserts import UnsupportedTest, parse_assert
from vrl_python_tests.checks import TestCase
from vrl_python_tests.harness import encode, parse_int

NAN = float("nan")
INF = float("inf")

ROWS: list[tuple[str, object]] = [
    # F(...) == y, either side
    ("assert f() == [1, 2]", [1, 2]),
    ("assert f() == [1, 2]", (1, 2)),
    ("assert f() == (1, 2)", [1, 2]),
    ("assert [1, 2] == f()", [1, 2]),
    ("assert f() == 1", True),
    ("assert f() == 1", 1.0),
    ("assert f() == True", 1),
    ("assert f() == 1.0", 1),
    ("assert f() == {1: 'a'}", {True: "a"}),
    ("assert f() == {1, 2}", frozenset({1, 2})),
    ("assert f() == frozenset({1, 2})", {1, 2}),
    ("assert f() == float('nan')", NAN),
    ("assert f() == float('inf')", INF),
    ("assert f() == -0.0", 0.0),
    ("assert f() == 'a'", b"a"),
    ("assert f() == 1j", 1j),
    ("assert f() == None", None),
    ("assert f() == None", 0),
    ("assert f() == []", ()),
    # F(...) is True / False / None
    ("assert f() is True", True),
    ("assert f() is True", 1),
    ("assert f() is None", None),
    ("assert f() is False", 0),
    ("assert f() is False", False),
    ("assert None is f()", None),
    # F(...) / not F(...)
    ("assert f()", [0]),
    ("assert f()", 0),
    ("assert f()", NAN),
    ("assert f()", ""),
    ("assert not f()", ""),
    ("assert not f()", [None]),
    ("assert not f()", 0.0),
    ("assert not f()", {}),
    ("assert not f()", 0j),
    # sorted(F(...)) == y, either side, y sorted or not
    ("assert sorted(f()) == [3, 1, 2]", [1, 2, 3]),
    ("assert sorted(f()) == [3, 1, 2]", [3, 1, 2]),
    ("assert sorted(f()) == [1, 2, 3]", [3, 1, 2]),
    ("assert sorted(f()) == (1, 2, 3)", [3, 2, 1]),
    ("assert sorted(f()) == {1, 2, 3}", {1, 2, 3}),
    ("assert sorted(f()) == sorted([3, 1, 2])", {2, 3, 1}),
    ("assert sorted([3, 1, 2]) == sorted(f())", (3, 1, 2)),
    ("assert [1, 2, 3] == sorted(f())", [2, 1, 3]),
    ("assert [3, 2, 1] == sorted(f())", [2, 1, 3]),
    ("assert sorted(f()) == [1, 1, 2]", [1, 2]),
    ("assert sorted(f()) == [1, 1, 2]", [1, 2, 1]),
    ("assert sorted(f()) == ['a', 'b']", "ba"),
    ("assert sorted(f()) == [1, 2]", {2: "x", 1: "y"}),
    ("assert sorted(f()) == [1, 2]", [2, 1.0]),
    ("assert sorted(f()) == [True, 2]", [2, 1]),
    ("assert sorted(f()) == [1, 'a']", [1, "a"]),
    ("assert sorted(f()) == [(1, 2), (1, 3)]", [(1, 3), (1, 2)]),
    ("assert sorted(f()) == [[1, 2], (1, 3)]", [(1, 3), (1, 2)]),
    ("assert sorted(f()) == []", 5),
    ("assert sorted(f()) == []", []),
    ("assert sorted(f()) == [None]", [None]),
    ("assert sorted(f()) == [1.0, 2.0]", [2.0, NAN]),
    ("assert frozenset(f()) == [1]", [1]),
    # set(F(...)) == y, frozenset(F(...)) == y, either side
    ("assert set(f()) == set([1, 2])", [2, 1, 1]),
    ("assert set(f()) == [1, 2]", [1, 2]),
    ("assert set(f()) == (1, 2)", (1, 2)),
    ("assert set(f()) == {1, 2}", [2, 1]),
    ("assert set(f()) == {1, 2}", [2, 1, 3]),
    ("assert set(f()) == frozenset({1, 2})", [1, 2]),
    ("assert frozenset(f()) == {1, 2}", (1, 2)),
    ("assert frozenset(f()) == frozenset([1, 2])", {2: None, 1: None}),
    ("assert set(f()) == {'a', 'b'}", "abba"),
    ("assert set(f()) == 'ab'", "ab"),
    ("assert set(f()) == {}", []),
    ("assert set(f()) == set()", []),
    ("assert set(f()) == {1, 2}", {1: 0, 2: 0}),
    ("assert set(f()) == {1}", [[1]]),
    ("assert set(f()) == {1}", [1] * 100),
    ("assert set(f()) == {'a'}", "a" * 100),
    ("assert set(f()) == {0}", [0, 0.0, False, -0.0] * 20),
    ("assert set(f()) == {1, 2}", [NAN, 1, 2]),
    ("assert {1, 2} == set(f())", [1, 2.0]),
    ("assert set([1, 2]) == set(f())", [True, 2]),
    ("assert set(f()) == {(1, 2)}", [[1, 2]]),
    ("assert set(f()) == {(1, 2)}", [(1, 2), (1, 2)]),
    # math.isclose(F(...), y, ...)
    ("assert math.isclose(f(), 1.0)", 1.0 + 1e-10),
    ("assert math.isclose(f(), 1.0)", 1.0 + 1e-8),
    ("assert math.isclose(f(), 1.0)", True),
    ("assert math.isclose(f(), True)", 1.0000000001),
    ("assert math.isclose(f(), 1)", 1),
    ("assert math.isclose(f(), [1.0])", [1.0]),
    ("assert math.isclose(f(), (1.0, 2.0), abs_tol=0.1)", (1.05, 2.0)),
    ("assert math.isclose(f(), 1.0)", [1.0]),
    ("assert math.isclose(f(), 'a')", "a"),
    ("assert math.isclose(f(), 1.0)", 1 + 0j),
    ("assert math.isclose(f(), {'a': 1.0})", {"a": 1.0}),
    ("assert math.isclose(f(), float('inf'))", INF),
    ("assert math.isclose(f(), float('nan'))", NAN),
    (f"assert math.isclose(f(), {10 ** 400})", 10 ** 400),
    ("assert math.isclose(f(), 2.5)", 10 ** 400),
    ("assert math.isclose(f(), 2, rel_tol=0.5)", 3),
    ("assert math.isclose(f(), 2, rel_tol=0.2)", 3),
    ("assert math.isclose(f(), 2, abs_tol=1)", 3),
    ("assert math.isclose(2.5, f())", 2.5),
    ("assert math.isclose(f(), 0.0, abs_tol=1e-9)", 1e-10),
    # abs(F(...) - y) < tol, <= tol, either order inside
    ("assert abs(f() - 1.0) < 0.5", 1.5),
    ("assert abs(f() - 1.0) <= 0.5", 1.5),
    ("assert abs(f() - 1.0) < 0.5", 1.25),
    ("assert abs(f() - 1.0) <= 0.5", 1.75),
    ("assert abs(f() - float('inf')) < 1", INF),
    ("assert abs(f() - float('inf')) <= 1", INF),
    ("assert abs(f() - 1.0) < 1e-9", True),
    ("assert abs(f() - 1) < 1", 1.5),
    ("assert abs(f() - 1) < 1", 2),
    ("assert abs(f() - 1) <= 1", 2),
    ("assert abs(f() - [1.0]) < 1", [1.0]),
    ("assert abs(f() - 1.0) < 1", [1.0]),
    ("assert abs(1.0 - f()) < 0.1", 1.05),
    ("assert abs(2 - f()) < 0.1", 1.05),
    ("assert abs(f() - 1) < 1", 1 + 0.5j),
    ("assert abs(f() - 1) < 1", 1 + 1j),
    ("assert abs(f() - {1}) < 1", {1}),
    ("assert abs(f() - 0.3) < 1e-6", 0.1 + 0.2),
    ("assert abs(f() - 1.0) < 1", NAN),
    ("assert abs(f() - 1.0) < 1", "1.0"),
    ("assert abs(f() - 1.0) < 0", 1.0),
    ("assert abs(f() - 1.0) <= 0", 1.0),
]


def python_says(source: str, value: object) -> bool:
    """Run the assert itself, `f` returning `value`: does it pass?"""
    try:
        exec(compile(source, "<assert>", "exec"), {"f": lambda: value, "math": math})  # noqa: S102 - our own table
    except Exception:  # noqa: BLE001 - AssertionError, or the TypeError/OverflowError the assert raises
        return False
    return True


def stored(source: str) -> TestCase:
    """The TestCase as the verifier reads it: parsed, stored in a task as JSON, validated back."""
    test = parse_assert(source, "f")
    return TestCase.model_validate(json.loads(json.dumps(test.model_dump(mode="json"))))


def plugin_says(source: str, value: object) -> bool:
    """The verifier's verdict: the value crosses the channel as JSON and the host compares."""
    wire = json.loads(json.dumps(encode(value), allow_nan=False), parse_int=parse_int)
    return stored(source).check(wire)[0]


@pytest.mark.parametrize("source, value", ROWS, ids=[f"{s} <- {v!r}"[:90] for s, v in ROWS])
def test_verdict_is_pythons_verdict(source, value):
    assert plugin_says(source, value) == python_says(source, value)


def test_the_reported_case():
    assert not python_says("assert sorted(s()) == [3, 1, 2]".replace("s()", "f()"), [1, 2, 3])
    assert not plugin_says("assert sorted(s()) == [3, 1, 2]".replace("s()", "f()"), [1, 2, 3])
    assert plugin_says("assert sorted(f()) == sorted([3, 1, 2])", [2, 3, 1])


@pytest.mark.parametrize("source", [
    # sorted() of sets orders them by inclusion only: the result depends on the returned set's
    # iteration order, which the channel does not carry (and which varies with string hashing).
    "assert sorted(f()) == [frozenset({1}), frozenset({2})]",
    "assert sorted(f()) == sorted([(1, frozenset({2})), (1, frozenset({3}))])",
    # tolerances Python itself rejects or that no value can meet
    "assert math.isclose(f(), 1.0, rel_tol='0.1')",
    "assert math.isclose(f(), 1.0, abs_tol=-1)",
    "assert math.isclose(f(), 1.0, rel_tol=float('nan'))",
    "assert abs(f() - 1.0) < '0.1'",
    "assert abs(f() - 1.0) < -1",
    f"assert abs(f() - 1.0) < {2 ** 60 + 1}",
    # literals Python cannot build: every candidate would fail by an exception in the test itself
    "assert set(f()) == set([[1]])",
    "assert sorted(f()) == sorted([1, 'a'])",
    "assert f() == tuple(5)",
])
def test_shapes_with_no_exact_verdict_are_refused(source):
    with pytest.raises(UnsupportedTest):
        parse_assert(source, "f")


def test_infinite_tolerance_survives_storage():
    for source, value in [("assert abs(f() - 1.0) < float('inf')", 1e300),
                          ("assert abs(f() - float('inf')) < float('inf')", INF),
                          ("assert math.isclose(f(), 1.0, abs_tol=float('inf'))", -5.0)]:
        assert plugin_says(source, value) == python_says(source, value), source


# -- end to end: the same table through bubblewrap, the fork server and the result channel ----------

def test_the_verifier_agrees_with_python(judge):
    disagree = []
    for i, (source, value) in enumerate(ROWS):
        task = make_task("f", [source], task_id=f"row-{i}")
        code = f"import pickle\n\ndef f():\n    return pickle.loads({pickle.dumps(value)!r})\n"
        report = judge(code, task)
        if report.verdict.passed != python_says(source, value):
            disagree.append(f"{source} <- {value!r}: {report.verdict.detail}")
    assert not disagree, "\n".join(disagree)


# -- stdlib values that compare as plain data: the answer Python's assert accepts is accepted ------

STDLIB = """
import collections, enum, typing
Point = collections.namedtuple("Point", "x y")
class Pair(typing.NamedTuple):
    a: int
    b: int
class Color(enum.IntEnum):
    RED = 1
    BLUE = 2
class Perm(enum.IntFlag):
    R = 4
    W = 2
"""

# (what f returns, the assert): every row runs through bubblewrap, the fork server and the host.
STDLIB_ROWS = [
    ("collections.Counter('abca')", "assert f() == {'a': 2, 'b': 1, 'c': 1}"),
    ("collections.Counter('abca')", "assert f() == {'a': 2, 'b': 1}"),
    ("collections.Counter({'a': 1, 'b': 0})", "assert f() == {'a': 1}"),  # a zero count is a key of the dict
    ("collections.OrderedDict([(2, 'b'), (1, 'a')])", "assert f() == {1: 'a', 2: 'b'}"),
    ("collections.defaultdict(list, {1: [collections.Counter('x')]})", "assert f() == {1: [{'x': 1}]}"),
    ("collections.defaultdict(int)", "assert f() == {}"),
    ("collections.defaultdict(int)", "assert not f()"),
    ("Point(1, 2)", "assert f() == (1, 2)"),
    ("Point(1, 2)", "assert f() == [1, 2]"),  # a tuple is not a list, in Python as here
    ("[Pair(3, 4), Point(1, 2)]", "assert sorted(f()) == [(1, 2), (3, 4)]"),
    ("Color.BLUE", "assert f() == 2"),
    ("Color.BLUE", "assert f() == 2.0"),
    ("Color.RED", "assert f() is True"),  # an identity check stays one
    ("{Color.RED: 'r'}", "assert f() == {1: 'r'}"),
    ("Perm.R | Perm.W", "assert f() == 6"),
    ("Perm(0)", "assert not f()"),
    ("Perm.R", "assert abs(f() - 4) < 1"),
    ("collections.Counter('ab')", "assert set(f()) == {'a', 'b'}"),
]


def stdlib_python_says(value: str, source: str) -> bool:
    namespace: dict = {"math": math}
    exec(compile(STDLIB + f"def f():\n    return {value}\n", "<row>", "exec"), namespace)  # noqa: S102 - our table
    return python_says(source, namespace["f"]())


def test_stdlib_values_are_judged_as_python_judges_them(judge):
    got = {}
    for i, (value, source) in enumerate(STDLIB_ROWS):
        task = make_task("f", [source], task_id=f"stdlib-{i}")
        report = judge(STDLIB + f"def f():\n    return {value}\n", task)
        got[(value, source)] = report.verdict.passed
        assert report.verdict.passed == stdlib_python_says(value, source), (value, source, report.verdict.detail)
    # Both verdicts occur, so a verifier that passes or refuses everything fails above.
    assert set(got.values()) == {True, False}


@pytest.mark.parametrize("code", [
    "class D(dict):\n    def __eq__(self, other):\n        return True\ndef f():\n    return D()\n",
    "import collections\nclass C(collections.Counter):\n    pass\ndef f():\n    return C()\n",
    "import collections\nP = collections.namedtuple('P', 'x')\nclass Q(P):\n    def __eq__(self, other):\n"
    "        return True\ndef f():\n    return Q(0)\n",
    "import collections\nP = collections.namedtuple('P', 'x')\nP.__eq__ = lambda self, other: True\n"
    "def f():\n    return P(0)\n",
    "import enum\nclass E(enum.IntEnum):\n    A = 0\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = int.__hash__\ndef f():\n    return E.A\n",
    "class I(int):\n    pass\ndef f():\n    return I(5)\n",
], ids=["dict-subclass", "counter-subclass", "namedtuple-subclass", "patched-namedtuple", "enum-eq", "int-subclass"])
def test_user_subclasses_stay_refused(judge, code):
    """Each would pass `f() == {'a': 1}`-style asserts in Python through its own `__eq__`; here it is refused."""
    task = make_task("f", ["assert f() == {'a': 1}"])
    report = judge(code, task)
    assert not report.verdict.passed
    assert "cannot return" in report.verdict.detail, report.verdict.detail


def test_a_150_deep_list_passes_exactly_when_pythons_assert_passes(judge):
    nested = "[" * 150 + "1" + "]" * 150
    task = make_task("f", [f"assert f() == {nested}"])
    for returned in (nested, "[" * 150 + "2" + "]" * 150, "[" * 149 + "1" + "]" * 149):
        code = f"def f():\n    return {returned}\n"
        expected = python_says(f"assert f() == {nested}", eval(returned))  # noqa: S307 - our own literal
        assert judge(code, task).verdict.passed is expected, returned[:5]
    assert judge(f"def f():\n    return {nested}\n", task).verdict.passed  # the right answer is one of them
    # Past the documented bound (harness.MAX_DEPTH = 300) a value fails with the reason.
    deep = "def f():\n    x = 1\n    for _ in range(400):\n        x = [x]\n    return x\n"
    report = judge(deep, make_task("f", ["assert f() == 1"]))
    assert not report.verdict.passed and "nested deeper than 300" in report.verdict.detail, report.verdict.detail
