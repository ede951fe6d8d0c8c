"""python-tests `-o turns=K`: a failing attempt's test report goes back (visible tests' calls and results;
hidden tests by index only), every turn runs in the sandbox, and the fixed code passes. The model's turns
are scripted (a random model writes no Python)."""

from __future__ import annotations

from conftest import BWRAP_PROBLEM, make_task
from vrl_python_tests.environment import PythonTestsEnvironment

from vrl.episodes import Episodes, Row, Sampled
from vrl.generate import tiny


def test_a_failing_attempt_gets_the_failing_tests_back_and_the_fix_passes():
    env = PythonTestsEnvironment(turns=3, sandbox="unsafe-local" if BWRAP_PROBLEM else "bwrap", workers=1)
    task = make_task("add", ["assert add(1, 2) == 3"], ["assert add(5, 5) == 10"])
    turns = ["```python\ndef add(a, b):\n    return a - b\n```", "```python\ndef add(a, b):\n    return a + b\n```"]
    tok = tiny.build_tokenizer()
    calls: list[int] = []

    def generate(seqs, seeds, members):
        calls.append(len(seqs[0]))
        turn = turns[len(calls) - 1]
        ids = tok(turn, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return [Sampled(ids=ids, text=turn, raw=turn, finish_reason="stop")]

    [done] = Episodes(env).run([Row(task=task, seed=0)], tok, generate)
    assert [t.passed for t in done.episode.turns if t.role == "assistant"] == [False, True]
    report = done.episode.turns[1].content
    assert report.startswith("The code failed the tests (failed):\n0/2 tests passed")
    assert "test 0 add(1, 2)" in report and "hidden test 1" in report and "10" not in report  # hidden data stays hidden
    assert done.text == turns[1] and env.multi_turn and not PythonTestsEnvironment().multi_turn
