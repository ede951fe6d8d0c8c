"""Environment options (`-o KEY=VALUE`) are validated before anything is built; errors list what is allowed."""

from __future__ import annotations

import pytest

from vrl.environment import Environment, EnvOptions, options_model
from vrl.errors import OptionsError
from vrl.plugins import registry

DECLARED = {
    "countdown": ["size", "seed", "min_numbers", "max_numbers", "calculator", "max_turns", "chat"],
    "guess": ["size", "turns", "seed"],
    "letters": ["size", "mix"],
    "lean": ["server", "api_key", "data", "test_fraction", "timeout_s", "max_heartbeats", "repls", "recheck", "recheck_api_key",
             "recheck_sandbox", "lean_project", "lean_command", "recheck_timeout_s", "canary_rate", "turns", "feedback_chars",
             "on_exploit"],
    "python-tests": ["tasks", "format", "visible_tests", "reward", "sandbox", "workers", "test_timeout_s",
                     "attempt_timeout_s", "memory_mb", "max_processes", "python", "turns", "feedback_chars"],
}


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_every_environment_rejects_an_unknown_option_listing_the_allowed_ones(name):
    with pytest.raises(OptionsError) as err:
        registry().environment(name, no_such_option=1)
    message = str(err.value)
    assert "\n" not in message and f"environment {name!r}: unknown option 'no_such_option'" in message
    for option in DECLARED[name]:
        assert f"{option} (" in message
    assert list(registry().factory("environments", name).Options.model_fields) == DECLARED[name]


@pytest.mark.parametrize("name, options, expected", [
    ("countdown", {"size": "abc"}, "-o size='abc': Input should be a valid integer"),
    ("countdown", {"min_numbers": 5, "max_numbers": 3}, "min_numbers (5) must not exceed max_numbers (3)"),
    ("letters", {"size": 0}, "-o size=0: Input should be greater than or equal to 1 (allowed: int >= 1, default 16)"),
    ("lean", {"server": "localhost:8000"}, "must start with http:// or https://"),
    ("lean", {"server": "http://x", "recheck": "off", "test_fraction": 1.5}, "-o test_fraction=1.5: Input should be less than 1"),
    ("lean", {"server": "http://x", "recheck": "off", "repls": "many"}, "-o repls='many'"),
    ("python-tests", {"reward": "shaped"}, "Input should be 'binary' or 'partial'"),
    ("python-tests", {"sandbox": "docker"}, "Input should be 'bwrap' or 'unsafe-local'"),
])
def test_wrong_values_name_the_option_and_what_is_allowed(name, options, expected):
    with pytest.raises(OptionsError, match=None) as err:
        registry().environment(name, **options)
    assert expected in str(err.value)


def test_valid_options_reach_the_environment():
    env = registry().environment("countdown", size=7, seed=3, max_numbers=5)
    assert (env.size, env.seed, env.min_numbers, env.max_numbers) == (7, 3, 3, 5) and len(env.tasks("train")) == 7


def test_a_factory_without_an_options_model_is_checked_against_its_signature():
    """Third-party environments written before `Options` existed still get one-line errors."""

    class Old(Environment):
        name = "old"

        def __init__(self, size: int = 5, label: str = "x"):
            self.size, self.label = size, label

        def tasks(self, split="train", limit=None):
            return []

        def verifier(self):
            raise NotImplementedError

    reg = registry()
    reg._register("environments", "builtin", "old", Old)
    with pytest.raises(OptionsError, match=r"unknown option 'sise'; old accepts size \(int, default 5\), label \(str"):
        reg.environment("old", sise=1)
    with pytest.raises(OptionsError, match=r"-o size='many': Input should be a valid integer"):
        reg.environment("old", size="many")
    assert reg.environment("old", size=9).size == 9 and reg.environment("old").label == "x"

    def anything(**kwargs):  # **kwargs: the factory takes what it likes
        return Old(**kwargs)

    assert options_model(anything) is None
    assert issubclass(options_model(registry().factory("environments", "letters")), EnvOptions)
