"""Test cases as data, and the host-side comparison of an attempt's returned value with the expected one.

A `TestCase` holds encoded inputs and an encoded expected value (see `harness.encode`). Only the
inputs ever enter the sandbox; the comparison runs here, on values decoded into plain built-in types,
so no object the attempt built (an `__eq__` that always says yes) can take part in it.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vrl_python_tests.harness import check_hashes, decode, encode

Compare = Literal["eq", "is", "set", "sorted", "isclose", "truthy", "falsy"]


class TestCase(BaseModel):
    """One call of the entry point and what it must return."""

    model_config = ConfigDict(frozen=True)
    __test__ = False  # not a pytest class

    args: Any = Field(description="Encoded list of positional arguments (harness.encode of a list).")
    kwargs: Any = Field(default_factory=lambda: encode({}), description="Encoded dict of keyword arguments.")
    expected: Any = Field(None, description="Encoded expected value (ignored for truthy/falsy).")
    compare: Compare = Field("eq", description="How the returned value is compared with `expected`; 'is' (identity, "
                             "for True/False/None only, as `assert f(x) is True` judges) refuses 1 for True.")
    rel_tol: float = Field(1e-9, ge=0, description="Relative tolerance for compare='isclose'.")
    abs_tol: float = Field(0.0, ge=0, description="Absolute tolerance for compare='isclose'.")
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
        expected = decode(self.expected)
        if self.compare == "truthy":
            return (bool(got), "" if got else f"returned {_short(got)}, expected a true value")
        if self.compare == "falsy":
            return (not got, "" if not got else f"returned {_short(got)}, expected a false value")
        if self.compare == "is":
            ok = got is expected  # decoded True/False/None are the singletons; 1 is not True
            return ok, "" if ok else f"returned {_short(got)}, expected {expected!r} (an identity check)"
        if self.compare == "set":
            check_hashes(got)  # the attempt's list becomes a set here: no forged hash collisions
            ok = set(got) == set(expected)
        elif self.compare == "sorted":
            ok = sorted(got) == sorted(expected)
        elif self.compare == "isclose":
            ok = close(got, expected, self.rel_tol, self.abs_tol)
        else:
            ok = equal(got, expected)
        return ok, "" if ok else f"returned {_short(got)}, expected {_short(expected)}"


_SINGLETONS = (True, False, None)


def equal(got: Any, expected: Any) -> bool:
    """Python's == on trusted built-in values, as `assert f(x) == y` would judge them."""
    return bool(got == expected)


def close(got: Any, expected: Any, rel_tol: float, abs_tol: float) -> bool:
    """Element-wise math.isclose over numbers nested in lists, tuples and dict values."""
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return False
        if got == expected:  # exact, also for ints beyond a float's range
            return True
        try:
            return math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol)
        except OverflowError:  # an int above 1e308 against a float: not close to anything finite
            return False
    if isinstance(expected, (list, tuple)):
        return (type(got) is type(expected) and len(got) == len(expected)
                and all(close(g, e, rel_tol, abs_tol) for g, e in zip(got, expected)))
    if isinstance(expected, dict):
        return (type(got) is dict and got.keys() == expected.keys()
                and all(close(got[k], expected[k], rel_tol, abs_tol) for k in expected))
    return equal(got, expected)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
