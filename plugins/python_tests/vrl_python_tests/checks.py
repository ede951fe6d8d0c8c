"""Test cases as data, and the host-side comparison of an attempt's returned value with the expected one.

A `TestCase` holds encoded inputs and an encoded expected value (see `harness.encode`). Only the
inputs ever enter the sandbox; the comparison runs here, on values decoded into plain built-in types,
so no object the attempt built (an `__eq__` that always says yes) can take part in it. Each compare
mode is the expression of the assert it stands for, evaluated by Python on those values (see
`TestCase._compare`), so the verdict is the original assert's, never looser or stricter.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vrl_python_tests.harness import MAX_SAME_HASH, DecodeError, decode, encode

Compare = Literal["eq", "is", "set", "sorted", "isclose", "abs<", "abs<=", "truthy", "falsy"]


class TestCase(BaseModel):
    """One call of the entry point and what it must return."""

    model_config = ConfigDict(frozen=True)
    __test__ = False  # not a pytest class

    args: Any = Field(description="Encoded list of positional arguments (harness.encode of a list).")
    kwargs: Any = Field(default_factory=lambda: encode({}), description="Encoded dict of keyword arguments.")
    expected: Any = Field(None, description="Encoded expected value (ignored for truthy/falsy).")
    compare: Compare = Field("eq", description="The assert the test stands for, with x the returned value and y "
                             "`expected`: eq `x == y`, is `x is y` (y True/False/None), set `set(x) == y`, sorted "
                             "`sorted(x) == y`, isclose `math.isclose(x, y, rel_tol=, abs_tol=)`, abs< "
                             "`abs(x - y) < abs_tol`, abs<= `abs(x - y) <= abs_tol`, truthy `x`, falsy `not x`.")
    rel_tol: float = Field(1e-9, ge=0, description="rel_tol of compare='isclose'.")
    abs_tol: float = Field(0.0, ge=0, description="abs_tol of compare='isclose'; the bound of 'abs<' and 'abs<='.")
    hidden: bool = Field(False, description="Hidden tests are not shown in the prompt and their values not in details.")
    source: str = Field("", description="The test as written (e.g. the original assert), for details.")

    @field_validator("args", "kwargs", "expected")
    @classmethod
    def _decodable(cls, v: Any) -> Any:
        decode(v)  # raises ValueError with the offending part
        return v

    @model_validator(mode="after")
    def _identity_needs_a_singleton(self) -> TestCase:
        if self.compare == "is" and not any(decode(self.expected) is s for s in _SINGLETONS):
            raise ValueError("compare='is' needs expected True, False or None (an identity check)")
        return self

    def inputs(self) -> dict[str, Any]:
        """What the sandbox receives: the encoded inputs and nothing else."""
        return {"args": self.args, "kwargs": self.kwargs}

    def call_text(self, entry_point: str) -> str:
        """The call as Python source, e.g. `add(1, 2)`."""
        parts = [repr(a) for a in decode(self.args)] + [f"{k}={v!r}" for k, v in decode(self.kwargs).items()]
        return f"{entry_point}({', '.join(parts)})"

    def check(self, encoded_value: Any) -> tuple[bool, str]:
        """Compare an encoded returned value with the expectation; returns (passed, why not).

        Never raises: whatever goes wrong with the attempt's value (too large or deep to decode, an
        OverflowError while comparing) fails this test with the reason and touches no other attempt.
        """
        try:
            got = decode(encoded_value)
        except Exception as exc:  # noqa: BLE001 - any failure is this attempt's, never the batch's
            return False, f"unreadable return value ({type(exc).__name__}: {exc})"
        try:
            return self._compare(got)
        except Exception as exc:  # noqa: BLE001 - e.g. set() of a list of lists, OverflowError in isclose
            return False, f"returned {_short(got)}, not comparable ({type(exc).__name__}: {str(exc)[:100]})"

    def _compare(self, got: Any) -> tuple[bool, str]:
        """Python's own verdict on the assert this test stands for, the entry point having returned `got`.

        The rule: evaluate the assert's expression (see `compare`) on the decoded values exactly as Python
        does, with nothing normalised on either side: `sorted(x) == [3, 1, 2]` is never true, a list is
        not a tuple, `1 == 1.0 == True`, nan equals nothing, `math.isclose` takes numbers only and
        `abs(x - y) < tol` is strict. Whatever the expression raises (unhashable elements, a list minus a
        float, an int too large for a float) fails the test, as it fails the assert. Both sides of `==`,
        `math.isclose` and `abs(x - y)` are symmetric for built-in values, so the side F(...) stood on
        does not matter.
        """
        y = decode(self.expected)
        mode = self.compare
        if mode == "truthy":
            ok = bool(got)
        elif mode == "falsy":
            ok = not got
        elif mode == "is":
            ok = got is y  # decoded True/False/None are the singletons; 1 is not True
        elif mode == "set":
            ok = python_set(got) == y
        elif mode == "sorted":
            ok = sorted(got) == y
        elif mode == "isclose":
            ok = math.isclose(got, y, rel_tol=self.rel_tol, abs_tol=self.abs_tol)
        elif mode == "abs<":
            ok = abs(got - y) < self.abs_tol
        elif mode == "abs<=":
            ok = abs(got - y) <= self.abs_tol
        else:
            ok = got == y
        ok = bool(ok)
        wanted = _WANTED[mode].format(y=_short(y), rel_tol=self.rel_tol, abs_tol=self.abs_tol)
        return ok, "" if ok else f"returned {_short(got)}, expected {wanted}"


_SINGLETONS = (True, False, None)
_WANTED = {
    "eq": "{y}", "is": "{y} (an identity check)", "truthy": "a true value", "falsy": "a false value",
    "set": "set(value) == {y}", "sorted": "sorted(value) == {y}",
    "isclose": "math.isclose(value, {y}, rel_tol={rel_tol}, abs_tol={abs_tol})",
    "abs<": "abs(value - {y}) < {abs_tol}", "abs<=": "abs(value - {y}) <= {abs_tol}",
}


def python_set(values: Any) -> set:
    """`set(values)`, refusing (DecodeError) more than MAX_SAME_HASH *distinct* elements with one hash.

    Forged hash collisions make building a set quadratic; repeated equal elements cost nothing and
    count once, as they do in `set()` (a string of 100 'a's is a set of one). Unhashable elements raise
    TypeError, as `set()` does.
    """
    result: set = set()
    per_hash: dict[int, int] = {}
    for item in values:
        if item in result:  # at most MAX_SAME_HASH comparisons: the bound below holds for `result`
            continue
        h = hash(item)
        per_hash[h] = per_hash.get(h, 0) + 1
        if per_hash[h] > MAX_SAME_HASH:
            raise DecodeError(f"more than {MAX_SAME_HASH} elements of a set share one hash value")
        result.add(item)
    return result


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
