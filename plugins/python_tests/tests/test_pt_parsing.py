"""Assert rewriting, typed encoding and comparison, and code extraction: host-side, no sandbox."""

from __future__ import annotations

import math

import pytest
from vrl_python_tests.asserts import UnsupportedTest, parse_assert, parse_check_function
from vrl_python_tests.checks import TestCase
from vrl_python_tests.extract import extract_code
from vrl_python_tests.harness import EncodeError, decode, encode

# -- typed encoding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [
    None, True, 0, -7, 2**100, 1.5, float("inf"), "", "é", b"\x00\xff", 1 + 2j, [], (), [1, (2, 3)], {1, 2},
    frozenset({"a"}), {"a": [1]}, {(1, 2): {3}}, [[[]]],
])
def test_encode_decode_round_trip_keeps_types(value):
    back = decode(encode(value))
    assert back == value and type(back) is type(value)


def test_nan_round_trips_as_nan():
    assert math.isnan(decode(encode(float("nan"))))


def test_tuple_and_list_stay_distinct():
    assert decode(encode((1, 2))) != decode(encode([1, 2]))


@pytest.mark.parametrize("value", [object(), type("I", (int,), {})(3), type("S", (str,), {})("x"), range(3),
                                   [1, object()], {"k": type("L", (list,), {})()}])
def test_encode_refuses_everything_but_exact_builtins(value):
    with pytest.raises(EncodeError):
        encode(value)


def test_encode_caps_size():
    with pytest.raises(EncodeError):
        encode([0] * 300_000)


@pytest.mark.parametrize("data", [{"list": 1}, {"a": 1, "b": 2}, {"float": "1.0"}, {"thing": []}, {"dict": [[1]]}])
def test_decode_rejects_what_encode_cannot_produce(data):
    with pytest.raises(ValueError):
        decode(data)


# -- comparison -------------------------------------------------------------------------------------

def case(expected, compare="eq", **kw) -> TestCase:
    return TestCase(args=encode([]), expected=encode(expected), compare=compare, **kw)


def test_eq_follows_assert_semantics():
    assert case(3).check(encode(3))[0]
    assert case(3.0).check(encode(3))[0]  # assert f() == 3.0 passes for 3 too
    ok, why = case([1, 2]).check(encode((1, 2)))
    assert not ok and "expected [1, 2]" in why
    assert not case("a").check(encode("b"))[0]


def test_set_sorted_isclose_abs_truthy_falsy():
    assert case({3, 1, 2}, "set").check(encode([1, 2, 3, 3]))[0]  # set(x) == y
    assert not case([1, 2, 3], "set").check(encode([1, 2, 3]))[0]  # a set is never equal to a list
    assert not case({1, 2}, "set").check(encode([1]))[0]
    assert case([1, 2], "sorted").check(encode([2, 1]))[0]  # sorted(x) == y
    assert not case([2, 1], "sorted").check(encode([1, 2]))[0]  # y is not sorted for the test
    assert not case([1, 1, 2], "sorted").check(encode([1, 2]))[0]
    assert case(1.0, "isclose", rel_tol=1e-3).check(encode(1.0005))[0]
    assert not case(1.0, "isclose", rel_tol=1e-6).check(encode(1.01))[0]
    assert not case([1.0, 2.0], "isclose", abs_tol=0.1).check(encode([1.05, 1.95]))[0]  # math.isclose: numbers only
    assert not case(1.0, "isclose").check(encode("1.0"))[0]
    assert case(1.0, "abs<", abs_tol=0.5).check(encode(1.25))[0]
    assert not case(1.0, "abs<", abs_tol=0.5).check(encode(1.5))[0]
    assert case(1.0, "abs<=", abs_tol=0.5).check(encode(1.5))[0]
    assert case(None, "truthy").check(encode([0]))[0]
    assert not case(None, "truthy").check(encode(0))[0]
    assert case(None, "falsy").check(encode(""))[0]


def test_unreadable_or_incomparable_values_fail_without_raising():
    assert not case([1], "set").check(encode([[1]]))[0]  # unhashable
    assert not case(1).check({"bogus": 1})[0]


# -- assert rewriting -------------------------------------------------------------------------------

def test_plain_equality_both_ways():
    t = parse_assert('assert f(1, "a", k=[2]) == (3, 4)', "f")
    assert decode(t.args) == [1, "a"] and decode(t.kwargs) == {"k": [2]}
    assert decode(t.expected) == (3, 4) and t.compare == "eq"
    t = parse_assert("assert {1: 2} == f()", "f")
    assert decode(t.expected) == {1: 2}


@pytest.mark.parametrize("source, compare, expected", [
    ("assert f(1)", "truthy", None),
    ("assert not f(1)", "falsy", None),
    ("assert f(1) is None", "is", None),
    ("assert f(1) is True", "is", True),
    ("assert set(f(1)) == set([3, 2])", "set", {2, 3}),
    ("assert sorted(f(1)) == [1, 2]", "sorted", [1, 2]),
    ("assert f(-1) == float('inf')", "eq", math.inf),
    ("assert candidate(1) == 2", "eq", 2),
])
def test_supported_shapes(source, compare, expected):
    t = parse_assert(source, "f")
    assert t.compare == compare and decode(t.expected) == expected and t.source == source


def test_tolerance_shapes():
    t = parse_assert("assert math.isclose(f(2), 0.5, rel_tol=0.001)", "f")
    assert (t.compare, t.rel_tol, t.abs_tol, decode(t.expected)) == ("isclose", 0.001, 0.0, 0.5)
    t = parse_assert("assert abs(f(2) - 0.5) < 1e-6", "f")
    assert (t.compare, t.abs_tol, decode(t.expected)) == ("abs<", 1e-6, 0.5)
    t = parse_assert("assert abs(0.5 - f(2)) <= 1", "f")
    assert (t.compare, t.abs_tol, decode(t.expected)) == ("abs<=", 1.0, 0.5)


@pytest.mark.parametrize("source", [
    "assert f(x) == 1",  # a name, not a literal
    "assert f(1) == g(2)",
    "assert f(1) > 3",
    "assert len(f(1)) == 3",
    "assert f(1)[0] == 3",
    "assert f(1) == f(2)",
    "assert f(*[1]) == 1",
    "assert f(__import__('os').system('id')) == 0",
    "x = 1",
    "assert f(1 == 2",
    "assert f(1) is 3",
])
def test_unsupported_shapes_are_refused_not_weakened(source):
    with pytest.raises(UnsupportedTest):
        parse_assert(source, "f")


def test_check_function_of_humaneval():
    src = '''
METADATA = {"author": "x"}

def check(candidate):
    """Docstring."""
    assert candidate(2, 3) == 5
    assert abs(candidate(0.1, 0.2) - 0.3) < 1e-6
    assert True, "This prints if this assert fails"
'''
    cases = parse_check_function(src, "add")
    assert [c.compare for c in cases] == ["eq", "abs<"] and all(c.hidden for c in cases)
    with pytest.raises(UnsupportedTest, match="For"):
        parse_check_function("def check(candidate):\n    for i in range(3):\n        assert candidate(i) == i\n", "f")
    with pytest.raises(UnsupportedTest, match="no `def check"):
        parse_check_function("assert f(1) == 1", "f")


# -- code extraction --------------------------------------------------------------------------------

SOLUTION = "def add(a, b):\n    return a + b\n"


@pytest.mark.parametrize("text", [
    f"```python\n{SOLUTION}```",
    f"Here you go:\n\n```python\n{SOLUTION}```\nThis adds numbers.",
    f"```py\n{SOLUTION}```",
    f"```\n{SOLUTION}```",
    f"Example:\n```python\nprint(add(1, 2))\n```\nSolution:\n```python\n{SOLUTION}```\n",
    f"```python\n{SOLUTION}",  # generation stopped before the closing fence
    SOLUTION,
    f"Sure! Here is the function.\n{SOLUTION}\nHope this helps.",
])
def test_extraction_finds_the_function(text):
    code = extract_code(text, "add")
    assert code is not None and "def add(a, b):\n    return a + b" in code
    assert "Hope this" not in code and "Here you go" not in code


def test_extraction_joins_helper_blocks_and_keeps_module_code():
    text = "```python\nimport math\n```\n```python\nK = 2\n```"
    assert extract_code(text, "add") == "import math\n\nK = 2\n"
    assert extract_code("X = 1\ndef add(a, b):\n    return a + X\n", "add").startswith("X = 1")


def test_extraction_completes_a_prompt_prefix():
    prefix = 'def add(a, b):\n    """Add."""\n'
    code = extract_code("    return a + b\n", "add", prefix=prefix)
    assert code == prefix + "    return a + b\n"
    assert extract_code(SOLUTION, "add", prefix=prefix) == SOLUTION  # a full definition needs no prefix


@pytest.mark.parametrize("text", ["", "I don't know.", "The answer is 42."])
def test_no_code_is_none(text):
    assert extract_code(text, "add") is None
