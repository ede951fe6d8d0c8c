"""The built-in `dataset` environment: any dataset, reward functions in TRL's shape, both update rules.

Real parts throughout: the tiny local model, the local runtime, real files (JSONL, JSON, CSV,
Parquet) and the real `datasets` package on a local directory. The Hugging Face Hub is not
reachable here: the Hub path is tested offline (an id that cannot load) and with `datasets`
absent (hidden from the import system).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vrl.cli import main
from vrl.envs.dataset import DatasetEnvironment, MalformedDataset
from vrl.errors import DatasetUnavailable, OptionsError, UnknownSplitError, UsageError
from vrl.reward_functions import RewardFunctionError, RewardFunctions, load_reward_function
from vrl.types import Attempt, Completion, Status
from vrl.verifier import is_verifier_error

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "dataset_env"
PROBLEMS = FIXTURES / "problems.jsonl"
REWARDS = FIXTURES / "rewards.py"
SMALL = ["--set", "tasks_per_iteration=6", "--set", "es.population_size=2", "--set", "grpo.num_generations=2",
         "--set", "sampling.max_new_tokens=6"]


def spec(name: str) -> str:
    return f"{REWARDS}:{name}"


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def attempts(env: DatasetEnvironment, texts: list[str]) -> list[Attempt]:
    return [Attempt(task=t, completion=Completion(task_id=t.id, text=x)) for t, x in zip(env.tasks(), texts)]


def judge(env: DatasetEnvironment, texts: list[str]):
    return asyncio.run(env.verifier().verify(attempts(env, texts)))


def env_of(*rewards: str, **options) -> DatasetEnvironment:
    return DatasetEnvironment(data=str(PROBLEMS), prompt_column="question", reward=[spec(r) for r in rewards], **options)


# -- training through the CLI ------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["es", "grpo"])
def test_vrl_train_on_a_jsonl_with_two_weighted_reward_functions(tmp_path, optimizer):
    """`vrl train --plugin dataset` on custom column names with a sync and an async reward and weights:
    every logged reward is the weighted sum of the two functions' values, the per-function means are in
    metrics.jsonl, and `vrl report` shows them."""
    res = cli("train", "--plugin", "dataset", "--optimizer", optimizer, "-n", "2", "--name", "run",
              "-o", f"data={PROBLEMS}", "-o", "prompt_column=question",
              "-o", f"reward=[{spec('share_wanted')}, {spec('short')}]", "-o", "reward_weights=[1.0, 0.5]",
              "--set", f"logging.runs_dir={tmp_path}", *SMALL)
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for r in rows:
        assert r["reward/share_wanted/applied"] == r["completions"]  # applies to every row
        assert r["reward/short/applied"] <= r["completions"]  # None on the `digits` row
        assert 0.0 <= r["reward/share_wanted/mean"] <= 1.0 and "reward/short/std" in r
        assert r["status/crashed"] == 0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples
    for s in samples:
        values = s["verdict"]["metrics"]
        assert s["reward"] == pytest.approx(values["reward/share_wanted"] + 0.5 * values.get("reward/short", 0.0))
        digits = s["prompt"] == "Write digits."
        assert ("reward/short" in values) is not digits
    from vrl.report import render  # here, not at the top: it imports matplotlib, which collection need not pay

    html = render([run], tmp_path / "report").read_text()
    assert "<h2>Reward functions</h2>" in html and "share_wanted" in html and "short" in html
    assert (tmp_path / "report" / "reward_functions.png").stat().st_size > 0


@pytest.mark.parametrize("optimizer", ["es", "grpo"])
def test_a_reward_that_raises_on_everything_stops_the_run(tmp_path, optimizer):
    res = cli("train", "--plugin", "dataset", "--optimizer", optimizer, "-n", "2", "--name", "broken",
              "-o", f"data={PROBLEMS}", "-o", "prompt_column=question", "-o", f"reward={spec('always_raises')}",
              "--set", f"logging.runs_dir={tmp_path}", *SMALL)
    assert res.exit_code == 2, res.output
    error = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1
    assert "reward function 'always_raises' raised ZeroDivisionError: reward bug" in error[0]
    assert "rewards.py:" in error[0]  # the line that raised
    assert not (tmp_path / "broken").exists()  # nothing finished, nothing kept


def test_a_reward_that_raises_on_one_row_costs_that_row_only(tmp_path):
    """The whole-batch call raises because of the `digits` row; each completion is then judged alone,
    so only the digits completions crash and the run finishes."""
    res = cli("train", "--plugin", "dataset", "-n", "2", "--name", "one-bad", "-o", f"data={PROBLEMS}",
              "-o", "prompt_column=question", "-o", f"reward={spec('raises_on_digits')},{spec('short')}",
              "--set", f"logging.runs_dir={tmp_path}", *SMALL)
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "one-bad" / "metrics.jsonl").read_text().splitlines()]
    # 6 tasks per iteration = every row once, the digits row among them, sampled by 2 ES members (+ none else)
    assert [r["status/crashed"] for r in rows] == [r["completions"] // 6 for r in rows]
    assert all(r["reward/raises_on_digits/applied"] == r["completions"] - r["status/crashed"] for r in rows)


def test_one_bad_row_is_a_failed_verdict_for_that_attempt_only():
    env = env_of("raises_on_digits", "short")
    verdicts = judge(env, ["abc"] * 6)
    digits = [i for i, t in enumerate(env.tasks()) if t.data["topic"] == "digits"]
    assert digits == [3]
    assert is_verifier_error(verdicts[3]) and "reward function 'raises_on_digits' raised KeyError" in verdicts[3].detail
    assert all(v.status is Status.PASSED for i, v in enumerate(verdicts) if i != 3), verdicts
    assert env.shaper()(env.tasks()[3], Completion(task_id="x", text="abc"), verdicts[3]) == 0.0


def test_a_hanging_reward_times_out_that_attempt_only():
    env = env_of("hangs_on_digits", reward_timeout_s=0.5)
    verdicts = judge(env, ["abc"] * 6)
    assert is_verifier_error(verdicts[3]) and "'hangs_on_digits' did not return within 0.5 s" in verdicts[3].detail
    assert [v.metrics.get("reward/hangs_on_digits") for i, v in enumerate(verdicts) if i != 3] == [0.5] * 5


def test_a_hanging_async_reward_is_cancelled_and_async_rewards_share_one_loop():
    """Async functions run on one event loop, as in TRL (a client bound to a loop keeps working across
    calls); a call that overruns is cancelled there and the loop serves the next ones."""
    loops = []

    async def which_loop(completions, **kwargs):
        loops.append(asyncio.get_running_loop())
        return [1.0] * len(completions)

    env = DatasetEnvironment(data=str(PROBLEMS), prompt_column="question", reward_timeout_s=0.5,
                             rewards=[spec("hangs_async_on_digits"), which_loop])
    verdicts = judge(env, ["abc"] * 6)
    assert is_verifier_error(verdicts[3]) and "'hangs_async_on_digits' did not return within 0.5 s" in verdicts[3].detail
    assert [v.metrics.get("reward/hangs_async_on_digits") for v in verdicts] == [0.25] * 3 + [None] + [0.25] * 2
    judge(env, ["abc"] * 2)
    assert len(loops) == 2 and loops[0] is loops[1] and loops[0].is_running()


def test_malformed_answers_of_a_reward_function_are_verdicts():
    def wrong_length(completions, **kwargs):
        return [1.0]

    def a_string_for_abc(completions, **kwargs):
        return ["yes" if c == "abc" else 0.25 for c in completions]

    env = DatasetEnvironment(data=str(PROBLEMS), prompt_column="question", rewards=[wrong_length])
    assert all(v.status is Status.PASSED for v in judge(env, ["x"] * 1))  # one attempt: one value is right
    verdicts = judge(env, ["x"] * 3)  # the batch's answer is short; alone, each call answers right
    assert all(v.status is Status.PASSED for v in verdicts)
    env = DatasetEnvironment(data=str(PROBLEMS), prompt_column="question", rewards=[a_string_for_abc])
    verdicts = judge(env, ["abc", "zz", "zz"])
    assert is_verifier_error(verdicts[0]) and "returned 'yes', not a number" in verdicts[0].detail
    assert [v.metrics["reward/a_string_for_abc"] for v in verdicts[1:]] == [0.25, 0.25]


@pytest.mark.parametrize("spelling", ["comma", "repeated"])
def test_vrl_verify_judges_attempts_at_dataset_rows(spelling):
    """Two reward functions, given comma-separated or as a repeated -o reward= (each occurrence kept)."""
    lines = json.dumps({"task_id": "train-1", "completion": "abc"}) + "\n" + \
        json.dumps({"task_id": "train-1", "completion": "abcdefghijkl"}) + "\n"
    rewards = (["-o", f"reward={spec('share_wanted')},{spec('short')}"] if spelling == "comma" else
               ["-o", f"reward={spec('share_wanted')}", "-o", f"reward={spec('short')}"])
    res = CliRunner().invoke(main, ["verify", "--plugin", "dataset", "-o", f"data={PROBLEMS}", "-o", "prompt_column=question",
                                    *rewards, "-"], input=lines)
    assert res.exit_code == 0, res.output
    first, second = [json.loads(line) for line in res.stdout.splitlines()]
    assert (first["status"], first["metrics"]["reward/short"]) == ("passed", 1.0)
    assert (second["status"], second["metrics"]["reward/share_wanted"], second["metrics"]["reward/short"]) == ("failed", 0.25, 0.0)


# -- reward semantics --------------------------------------------------------------------------------


def test_weighted_sum_leaves_out_none_and_logs_each_function_as_trl_does():
    env = env_of("share_wanted", "short", reward_weights=[2.0, 0.5], pass_threshold=2.5)
    texts = ["abcxx", "zzzzzzzzzzzz", "efgh", "12", "ab", "ae"]
    verdicts = judge(env, texts)
    shaper = env.shaper()
    rewards = [shaper(a.task, a.completion, v) for a, v in zip(attempts(env, texts), verdicts)]
    assert rewards == pytest.approx([2 * 0.6 + 0.5, 0.0, 2.5, 2.0, 2.5, 2.5])  # row 3 (digits): `short` is None
    assert [v.passed for v in verdicts] == [False, False, True, False, True, True]  # pass_threshold 2.5
    assert verdicts[0].score == 1.0 and verdicts[1].score == 0.0  # the sum, clamped to [0, 1]
    sums: dict[str, float] = {}
    for v in verdicts:
        for k, x in v.metrics.items():
            sums[k] = sums.get(k, 0.0) + x
    logged = env.iteration_metrics(sums)
    shares = [0.6, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert logged["reward/share_wanted/mean"] == pytest.approx(sum(shares) / 6)
    assert logged["reward/share_wanted/std"] == pytest.approx(
        (sum(s * s for s in shares) / 6 - (sum(shares) / 6) ** 2) ** 0.5)
    assert logged["reward/short/mean"] == pytest.approx(4 / 5) and logged["reward/short/applied"] == 5
    assert not [k for k in logged if k.startswith("reward/") and k.count("/") == 1]  # raw sums are not logged


def test_a_completion_no_function_applies_to_is_rejected_and_unscorable():
    def only_letters(completions, topic, **kwargs):
        return [None if t == "digits" else 1.0 for t in topic]

    env = DatasetEnvironment(data=str(PROBLEMS), prompt_column="question", rewards=[only_letters])
    verdicts = judge(env, ["x"] * 6)
    assert verdicts[3].status is Status.REJECTED and "no reward function applies" in verdicts[3].detail
    assert env.shaper()(env.tasks()[3], Completion(task_id="x", text="x"), verdicts[3]) == 0.0
    # Each verdict keeps every function's (value, weight): GRPO reads the unscorable ones from it (TRL's NaN).
    assert verdicts[3].rewards == [(None, 1.0)] and verdicts[0].rewards == [(1.0, 1.0)]
    assert env.iteration_metrics({})["reward/only_letters/applied"] == 0.0
    assert "reward/only_letters/mean" not in env.iteration_metrics({})


def test_functions_get_trl_arguments_chat_completions_and_only_what_they_name():
    seen = {}

    def named_only(prompts, completions, wanted):
        seen["named"] = (prompts, completions, wanted)
        return [0.0] * len(completions)

    async def everything(**kwargs):
        seen["all"] = kwargs
        return [0.0] * len(kwargs["completions"])

    env = DatasetEnvironment(data=str(PROBLEMS), prompt_column="question", rewards=[named_only, everything])
    tasks = env.tasks()[1:3]  # a text prompt, then a chat prompt
    batch = [Attempt(task=t, completion=Completion(task_id=t.id, text="ab", token_ids=[97, 98])) for t in tasks]
    asyncio.run(env.verifier().verify(batch))
    prompts, completions, wanted = seen["named"]
    assert prompts == ["Write the letters a, b and c.", [{"role": "user", "content": "Write letters from e to h."}]]
    assert completions == ["ab", [{"role": "assistant", "content": "ab"}]]  # TRL's conversational format
    assert wanted == ["abc", "efgh"]
    assert sorted(seen["all"]) == ["completion_ids", "completions", "log_extra", "log_metric", "prompts",
                                   "raw_completions", "topic", "trainer_state", "wanted"]  # TRL's, and the raw text
    assert seen["all"]["completion_ids"] == [[97, 98], [97, 98]]


def test_reward_names_and_specs():
    def acc(completions, **kwargs):
        return [1.0] * len(completions)

    class Judge:
        def __call__(self, completions, **kwargs):
            return [1.0] * len(completions)

    rewards = RewardFunctions([acc, functools.partial(acc), Judge(), spec("short")], weights=[1, 1, 1, 1])
    assert rewards.names == ["acc", "acc_2", "Judge", "short"]
    assert load_reward_function("json:dumps") is json.dumps
    with pytest.raises(RewardFunctionError, match="must look like module:function"):
        load_reward_function("no_colon")
    with pytest.raises(RewardFunctionError, match="no module named 'no_such_module_xyz'"):
        load_reward_function("no_such_module_xyz:f")
    with pytest.raises(RewardFunctionError, match="has no attribute 'nope'"):
        load_reward_function(spec("nope"))
    with pytest.raises(RewardFunctionError, match="reward file not found"):
        load_reward_function("missing/rewards.py:f")
    with pytest.raises(RewardFunctionError, match="2 reward weights for 1 reward functions"):
        RewardFunctions([acc], weights=[1, 2])


def test_a_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_for_vrl_test.py").write_text("def ones(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    assert load_reward_function("my_rewards_for_vrl_test:ones")(["a"]) == [1.0]


def test_a_function_that_names_a_missing_column_is_refused_before_generation(tmp_path):
    env = env_of("needs_missing_column")
    with pytest.raises(RewardFunctionError, match=r"'needs_missing_column' needs 'solution', which .*problems.jsonl "
                       r"does not have \(its columns: topic, wanted\)"):
        env.tasks()
    res = cli("train", "--plugin", "dataset", "-o", f"data={PROBLEMS}", "-o", "prompt_column=question",
              "-o", f"reward={spec('needs_missing_column')}", "--set", f"logging.runs_dir={tmp_path}")
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "needs 'solution'" in res.output
    assert list(tmp_path.iterdir()) == []


def test_modal_sandboxes_are_refused_with_the_setting_to_use():
    """A plain verifier sandbox has neither the data file nor the reward module: say what to set instead."""
    with pytest.raises(UsageError, match=r"--set runtime.modal.verify_in=local"):
        env_of("short").modal_sandbox()


def test_options_are_checked():
    with pytest.raises(OptionsError, match="unknown option 'rewrd'"):
        DatasetEnvironment(data=str(PROBLEMS), rewrd="x:y")
    with pytest.raises(OptionsError, match=r"^environment 'dataset': give a reward function \(-o reward=module:function\) "
                       "or an environment_factory whose class has get_reward$"):
        DatasetEnvironment(data=str(PROBLEMS))
    with pytest.raises(OptionsError, match=r"reward \(list\[str or function\], default \[\]\)"):
        DatasetEnvironment(data=str(PROBLEMS), reward="json:dumps", nope=1)


# -- data --------------------------------------------------------------------------------------------

ROWS = [{"q": "one", "answer": "1"}, {"q": "two", "answer": "2"}]


def _write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        path.write_text("q,answer\n" + "".join(f"{r['q']},{r['answer']}\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_every_file_format_gives_the_same_tasks(tmp_path, suffix):
    path = _write(tmp_path / f"data{suffix}", ROWS)
    env = DatasetEnvironment(data=str(path), prompt_column="q", rewards=[lambda completions, **kw: [0.0]])
    tasks = env.tasks()
    assert [(t.id, t.prompt, t.data) for t in tasks] == [("train-0", "one", {"answer": "1"}), ("train-1", "two", {"answer": "2"})]
    assert env.tasks(limit=1) == tasks[:1]


def test_system_prompt_ids_and_chat_prompts(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"id": "a", "q": "one"}, {"id": "b", "q": [{"role": "user", "content": "two"}]}])
    env = DatasetEnvironment(data=str(path), prompt_column="q", id_column="id", system_prompt="Be brief.",
                             rewards=[lambda completions, **kw: [0.0]])
    a, b = env.tasks()
    assert (a.id, b.id) == ("a", "b")
    assert a.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one"}]
    assert b.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "two"}]


def test_the_chat_template_renders_message_prompts():
    from vrl.generate.hf import render_prompt
    from vrl.generate.tiny import build_tokenizer

    tok = build_tokenizer()
    prompt = env_of("short").tasks()[2].prompt
    text = render_prompt(tok, prompt)
    assert text == tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert "Write letters from e to h." in text and text != prompt[0]["content"]


@pytest.mark.parametrize(("content", "where", "what"), [
    ('{"q": "ok"}\n{"q": "fine"}\n{"q": "x",\n', ":3:", "not JSON"),
    ('{"q": "ok"}\n[1, 2]\n', ":2:", "a row must be an object"),
    ('{"q": "ok"}\n{"question": "no q"}\n', ":2:", "no column 'q' (its columns: question); name the prompt column"),
    ('{"q": "ok"}\n{"q": "  "}\n', ":2:", "the prompt column 'q' is empty"),
    ('{"q": [{"role": "user"}]}\n', ":1:", "message 1 of 'q' must be an object with string 'role' and 'content'"),
    ('{"q": 3}\n', ":1:", "must hold text or a non-empty list of chat messages"),
    ('{"q": "a", "completions": 1}\n', ":1:", "column 'completions' has the name of a reward function argument"),
])
def test_a_malformed_row_is_one_line_naming_it(tmp_path, content, where, what):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    env = DatasetEnvironment(data=str(path), prompt_column="q", rewards=[lambda completions, **kw: [0.0]])
    with pytest.raises(MalformedDataset) as info:
        env.tasks()
    assert f"{path}{where}" in str(info.value) and what in str(info.value)
    runs = tmp_path / "runs"
    res = cli("train", "--plugin", "dataset", "-o", f"data={path}", "-o", "prompt_column=q",
              "-o", f"reward={spec('short')}", "--set", f"logging.runs_dir={runs}")
    assert res.exit_code == 2 and res.output.startswith("error: ") and res.output.count("\n") == 1, res.output
    assert not runs.exists() or list(runs.iterdir()) == []  # loses nothing: no run directory


def test_repeated_ids_and_csv_rows_of_the_wrong_width(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"id": "a", "q": "x"}, {"id": "a", "q": "y"}])
    with pytest.raises(MalformedDataset, match=r"d.jsonl:2: task id 'a' repeats .*d.jsonl:1"):
        DatasetEnvironment(data=str(path), prompt_column="q", id_column="id", rewards=[len]).tasks()
    path = tmp_path / "d.csv"
    path.write_text("q,answer\none,1\ntwo,2,extra\n")
    with pytest.raises(MalformedDataset, match=r"d.csv:3: 2 columns in the header"):
        DatasetEnvironment(data=str(path), prompt_column="q", rewards=[len]).tasks()


def test_splits_of_a_local_file_and_of_a_dataset_directory(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")  # not the user's cache
    path = _write(tmp_path / "d.jsonl", ROWS)
    env = DatasetEnvironment(data=str(path), prompt_column="q", rewards=[len])
    assert env.splits == ("train",)
    with pytest.raises(UnknownSplitError, match=r"is one split, 'train'.*vrl eval --split train"):
        env.tasks("test")
    with pytest.raises(UnknownSplitError, match=r"is one split, 'train'; there is no split 'dev' \(-o split=train\)"):
        DatasetEnvironment(data=str(path), prompt_column="q", split="dev", rewards=[len]).tasks()
    # A directory goes through `datasets` (as a Hub id does), with its own splits.
    folder = tmp_path / "ds"
    folder.mkdir()
    _write(folder / "train.jsonl", ROWS)
    _write(folder / "test.jsonl", ROWS[:1])
    env = DatasetEnvironment(data=str(folder), prompt_column="q", rewards=[len])
    assert [t.prompt for t in env.tasks("train")] == ["one", "two"]
    assert [t.prompt for t in env.tasks("test")] == ["one"]
    env = DatasetEnvironment(data=str(folder), prompt_column="q", split="validation", rewards=[len])
    with pytest.raises(UnknownSplitError, match=r"has no split 'validation'; its splits: (train, test|test, train)"):
        env.tasks()


def test_a_missing_file_and_an_unloadable_hub_id(tmp_path, monkeypatch):
    with pytest.raises(DatasetUnavailable, match="dataset file not found"):
        DatasetEnvironment(data=str(tmp_path / "nope.jsonl"), rewards=[len]).tasks()
    import datasets
    import huggingface_hub

    # Offline, as this machine is (the Hub is unreachable): fail at once instead of after retries.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetUnavailable, match=r"could not load dataset 'no-such-owner/no-such-set' from the Hugging "
                       r"Face Hub .*check the id"):
        DatasetEnvironment(data="no-such-owner/no-such-set", rewards=[len]).tasks()


def test_a_hub_id_without_the_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(DatasetUnavailable, match=r"needs the `datasets` package: pip install datasets"):
        DatasetEnvironment(data="owner/name", rewards=[len]).tasks()


# -- docs --------------------------------------------------------------------------------------------


def test_docs_dataset_python_example_runs(tmp_path, monkeypatch, capsys):
    text = (ROOT / "docs" / "dataset.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "docs/dataset.md", "exec"), {"__name__": "__docs__"})
    status, reward = capsys.readouterr().out.split()[-2:]
    assert status == "finished" and 0.0 <= float(reward) <= 1.5
    rows = [json.loads(line) for run in (tmp_path / "runs").iterdir() for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("reward/right_length/mean" in r and "reward/no_digits/mean" in r for r in rows)


def test_docs_dataset_cli_example_parses(tmp_path, monkeypatch):
    """The page's command, run on files made to its names (accuracy and brevity), resolves and trains."""
    text = (ROOT / "docs" / "dataset.md").read_text()
    command = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[0].replace("\\\n", " ").split()
    assert command[:2] == ["vrl", "train"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "problems.jsonl").write_text(json.dumps({"question": "2 + 2?", "answer": "4"}) + "\n")
    (tmp_path / "rewards.py").write_text(
        "def accuracy(completions, answer, **kw):\n    return [float(a in c) for c, a in zip(completions, answer)]\n"
        "def brevity(completions, **kw):\n    return [1.0 / (1 + len(c)) for c in completions]\n")
    res = cli(*command[1:], "-n", "1", "--set", f"logging.runs_dir={tmp_path / 'runs'}", *SMALL)
    assert res.exit_code == 0, res.output
    (run,) = (tmp_path / "runs").iterdir()
    config = json.loads((run / "config.json").read_text())
    assert config["env_options"]["reward_weights"] == [1.0, 0.2]
    assert {"reward/accuracy/applied", "reward/brevity/applied"} <= set(json.loads((run / "metrics.jsonl").read_text()))


# -- TRL's reward-function contract with environments (issue 56) ----------------------------------------------------
TRL_ENV = '''
class Tally:
    """A TRL environment class: reset with the row, a tool, state the reward functions read."""

    def reset(self, **row):
        self.target, self.total = int(row["target"]), 0
        return f" Reach {self.target}."

    def add(self, n: int) -> str:
        """Add to the total.

        Args:
            n: The number.
        """
        self.total += n
        return str(self.total)


SEEN = []


def reward_func(environments, trainer_state, log_extra, log_metric, **kwargs):
    """As TRL's docs write one: score the state each completion's own instance ended in."""
    SEEN.append((list(environments), trainer_state.global_step, trainer_state.max_steps, list(kwargs["target"])))
    log_extra("target_seen", [e.target for e in environments])
    log_metric("tally/targets", sum(e.target for e in environments) / len(environments))
    return [float(e.total == e.target) for e in environments]
'''


def test_reward_functions_get_environments_trainer_state_log_extra_and_log_metric(tmp_path) -> None:
    """From Python and from the CLI under GRPO: a reward function written for TRL 1.16 (environments, one
    instance per completion in order; trainer_state; log_extra; log_metric) runs unchanged."""
    import vrl

    module = tmp_path / "tally_env.py"
    module.write_text(TRL_ENV)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Count to {t}."}], "target": t}) + "\n"
                            for t in (1, 2, 3)))
    tally = load_reward_function(f"{module}:reward_func")
    seen = tally.__globals__["SEEN"]  # the module the loader made of the file
    env = DatasetEnvironment(data=str(data), environment_factory=f"{module}:Tally", reward=[tally])
    config = vrl.TrainConfig(plugin="dataset", model="tiny", optimizer="grpo", iterations=2, tasks_per_iteration=3,
                             sampling={"max_new_tokens": 4}, grpo={"num_generations": 2},
                             logging={"runs_dir": str(tmp_path), "name": "py", "samples_per_iteration": 6})
    assert vrl.Trainer(config, environment=env).run()["status"] == "finished"
    assert [(step, steps) for _, step, steps, _ in seen] == [(0, 2), (1, 2)]  # TRL's global_step, max_steps
    for instances, _, _, targets in seen:
        assert len({id(e) for e in instances}) == len(instances) == 6  # one instance per completion
        assert [e.target for e in instances] == targets  # in order: each reset with its own row
    rows = [json.loads(line) for line in (tmp_path / "py" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["tally/targets"] == 2.0 and rows[0]["reward/reward_func/applied"] == 6  # log_metric's mean
    sample = json.loads((tmp_path / "py" / "samples.jsonl").read_text().splitlines()[0])
    assert "target_seen: " in sample["verdict"]["detail"]  # log_extra's column, per completion

    seen.clear()
    res = cli("train", "--plugin", "dataset", "--model", "tiny", "--optimizer", "grpo", "-n", "1", "--name", "cli",
              "-o", f"data={data}", "-o", f"environment_factory={module}:Tally", "-o", f"reward={module}:reward_func",
              "--set", "tasks_per_iteration=3", "--set", "grpo.num_generations=2", "--set", "sampling.max_new_tokens=4",
              "--set", f"logging.runs_dir={tmp_path}")
    assert res.exit_code == 0, res.output
    [row] = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert row["tally/targets"] == 2.0 and row["episodes/count"] == 6

    # `environments` needs an environment class: refused before anything is generated, in one line.
    with pytest.raises(RewardFunctionError, match="^reward function 'reward_func' needs 'environments'.*environment_factory"):
        DatasetEnvironment(data=str(data), reward=[tally], tool=[f"{FIXTURES.parent}/tools/counter_env.py:double"]).tasks()


def test_episode_options_by_trls_names_and_vrls(tmp_path) -> None:
    """max_tool_calling_iterations (TRL) is max_turns - 1; max_completion_length (TRL) is max_episode_tokens (vrl);
    step_timeout_s and tool_feedback reach each episode."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "Count.", "target": 1}) + "\n")
    double = f"{FIXTURES.parent}/tools/counter_env.py:double"
    base = {"data": str(data), "reward": [lambda completions, **kw: [0.0] * len(completions)], "tool": [double]}
    env = DatasetEnvironment(**base, max_tool_calling_iterations=2, max_episode_tokens=50, step_timeout_s=5,
                             tool_feedback="detailed")
    episode = env.interaction(env.tasks()[0])
    assert (episode.max_turns, episode.max_tokens, episode.step_timeout_s, episode.feedback) == (3, 50, 5.0, "detailed")
    episode = DatasetEnvironment(**base, max_completion_length=7).interaction(env.tasks()[0])
    assert (episode.max_turns, episode.max_tokens, episode.step_timeout_s, episode.feedback) == (4, 7, 60.0, "trl")
    with pytest.raises(OptionsError, match="^environment 'dataset': give max_turns or max_tool_calling_iterations"):
        DatasetEnvironment(**base, max_turns=3, max_tool_calling_iterations=2)


# -- environment-owned rows, several environments, a pool of instances (issue 56, item 4) -------------------------
OWNED_ENV = '''
INITS = []
RESETS = []


class Reach:
    """TRL's lead shape: the rows carry no prompt; reset() gives it. An expensive __init__ counts its calls."""

    def __init__(self):
        INITS.append(id(self))
        self.total = self.target = 0

    def reset(self, **row):
        RESETS.append(dict(row))
        self.total, self.target = 0, row["target"]
        return f"Reach {row['target']} with add."

    def add(self, n: int) -> str:
        """Add to the total.

        Args:
            n: The number.
        """
        self.total += n
        return str(self.total)

    def get_reward(self) -> float:
        return 1.0 if self.total == self.target else 0.0


class Shrink:
    """A second environment: its own tool, no get_reward."""

    def reset(self, **row):
        RESETS.append(dict(row))
        self.target = row["target"]

    def halve(self, n: int) -> int:
        """Halve a number.

        Args:
            n: The number.
        """
        return n // 2


class NoReset:
    def add(self, n: int) -> str:
        """Add.

        Args:
            n: The number.
        """
        return str(n)


SEEN = []


def own_target(environments, target, **kwargs):
    """Each completion's instance was reset with its own row (never a later episode's)."""
    routed = kwargs.get("environment") or [None] * len(target)
    SEEN.append([(type(e).__name__, e.target, t, r) for e, t, r in zip(environments, target, routed)])
    return [1.0 if e.target == t else 0.0 for e, t in zip(environments, target)]
'''


def _owned(tmp_path):
    module = tmp_path / "owned_env.py"
    module.write_text(OWNED_ENV)
    return module, load_reward_function(f"{module}:own_target").__globals__


def test_a_class_without_reset_is_refused_at_construction_naming_reset(tmp_path) -> None:
    """As TRL checks at construction: an environment class without reset is refused in one line naming reset (from
    Python, in a dict, and from the CLI before a run directory is made)."""
    module, _ = _owned(tmp_path)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "Go.", "target": 1}) + "\n")
    with pytest.raises(OptionsError, match=r"environment_factory NoReset has no reset method.*reset\(\*\*row\)"):
        DatasetEnvironment(data=str(data), environment_factory=f"{module}:NoReset", reward=[f"{module}:own_target"])
    with pytest.raises(OptionsError, match=r"environment_factory\.b NoReset has no reset method"):
        DatasetEnvironment(data=str(data), environment_factory={"a": f"{module}:Reach", "b": f"{module}:NoReset"})
    res = cli("train", "--plugin", "dataset", "-n", "1", "--name", "nr", "-o", f"data={data}",
              "-o", f"environment_factory={module}:NoReset", "-o", f"reward={module}:own_target",
              "--set", f"logging.runs_dir={tmp_path}", *SMALL)
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1 and "has no reset method" in errors[0], res.output
    assert not (tmp_path / "nr").exists()


def test_rows_without_a_prompt_get_it_from_reset_and_instances_come_from_a_pool(tmp_path) -> None:
    """TRL's lead example: rows without a prompt column; reset(**row) (the row without a prompt, as TRL passes it)
    supplies the prompt, appended to TRL's placeholder (one empty user message). Instances are pooled: over 3
    iterations of 4 episodes, __init__ runs for fewer instances than episodes while every episode resets its
    instance, and each reward function call reads the instance of its own episode."""
    import vrl

    module, ns = _owned(tmp_path)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"target": t}) + "\n" for t in (3, 5)))
    env = DatasetEnvironment(data=str(data), environment_factory=f"{module}:Reach", reward=[f"{module}:own_target"])
    task = env.tasks()[0]
    assert task.prompt == [{"role": "user", "content": ""}] and task.data == {"target": 3}
    interaction = env.interaction(task)
    assert interaction.prompt(task) == [{"role": "user", "content": "Reach 3 with add."}]
    assert ns["RESETS"][-1] == {"target": 3}  # no prompt key: the row as it is
    with pytest.raises(MalformedDataset, match="no column 'prompt'"):
        DatasetEnvironment(data=str(data), reward=[f"{module}:own_target"]).tasks()  # no environment: still an error

    ns["INITS"].clear(), ns["RESETS"].clear(), ns["SEEN"].clear()
    env = DatasetEnvironment(data=str(data), environment_factory=f"{module}:Reach", reward=[f"{module}:own_target"])
    config = vrl.TrainConfig(plugin="dataset", model="tiny", optimizer="es", iterations=3, tasks_per_iteration=2,
                             sampling={"max_new_tokens": 4}, es={"population_size": 2},
                             logging={"runs_dir": str(tmp_path), "name": "owned"})
    assert vrl.Trainer(config, environment=env).run()["status"] == "finished"
    assert len(ns["RESETS"]) == 12 and len(ns["INITS"]) <= 8  # 4 episodes an iteration: never one __init__ each
    assert all(t == own for batch in ns["SEEN"] for _, t, own, _ in batch)


def test_a_dict_environment_factory_routes_rows_by_their_environment_column(tmp_path) -> None:
    """TRL's dict environment_factory: each row's `environment` column picks its class; a row is offered the
    standalone tools and its own environment's methods only; reset gets the row without `environment`; the class
    that owns a reward scores its own rows (None for the others'); a row naming no known environment is refused
    before anything runs; from the CLI as -o environment_factory.NAME=module:Class; trains under GRPO."""
    module, ns = _owned(tmp_path)
    data = tmp_path / "rows.jsonl"
    rows = [{"environment": "reach", "target": 2}, {"environment": "shrink", "target": 8},
            {"prompt": [{"role": "user", "content": "Shrink 6."}], "environment": "shrink", "target": 6}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    factories = {"reach": f"{module}:Reach", "shrink": f"{module}:Shrink"}
    env = DatasetEnvironment(data=str(data), environment_factory=factories, reward=[f"{module}:own_target"],
                             tool=[f"{FIXTURES.parent}/tools/counter_env.py:double"])
    tasks = env.tasks()
    offered = [[t["function"]["name"] for t in env.interaction(task).tools] for task in tasks]
    assert offered == [["double", "add"], ["double", "halve"], ["double", "halve"]]
    ns["RESETS"].clear()
    prompts = [env.interaction(task).prompt(task) for task in tasks]
    assert ns["RESETS"] == [{"target": 2}, {"target": 8},
                            {"prompt": [{"role": "user", "content": "Shrink 6."}], "target": 6}]
    assert prompts[0] == [{"role": "user", "content": "Reach 2 with add."}] and prompts[2] == rows[2]["prompt"]
    assert env.rewards.names == ["own_target", "Reach"]
    reach = env.rewards.functions[1]
    assert reach(environment_rewards=[1.0, 0.5, 0.0], environment=["reach", "shrink", "shrink"]) == [1.0, None, None]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"environment": "nope", "target": 1}) + "\n")
    with pytest.raises(MalformedDataset, match=r"bad.jsonl:1: the 'environment' column must name one of .*reach, shrink"):
        DatasetEnvironment(data=str(bad), environment_factory=factories, reward=[f"{module}:own_target"]).tasks()

    ns["SEEN"].clear()
    res = cli("train", "--plugin", "dataset", "--optimizer", "grpo", "-n", "1", "--name", "routed",
              "-o", f"data={data}", "-o", f"environment_factory.reach={module}:Reach",
              "-o", f"environment_factory.shrink={module}:Shrink", "-o", f"reward={module}:own_target",
              "--set", "tasks_per_iteration=3", "--set", "grpo.num_generations=2", "--set", "sampling.max_new_tokens=4",
              "--set", f"logging.runs_dir={tmp_path}")
    assert res.exit_code == 0, res.output
    [batch] = ns["SEEN"]
    assert sorted(name for name, _, _, _ in batch) == ["Reach", "Reach", "Shrink", "Shrink", "Shrink", "Shrink"]
    assert all(t == own and name.lower() == routed for name, t, own, routed in batch)
    [row] = [json.loads(line) for line in (tmp_path / "routed" / "metrics.jsonl").read_text().splitlines()]
    assert row["reward/Reach/applied"] == 2  # get_reward scores the Reach rows only


INCREMENT_ENV = '''
import random

RESETS = []


class IncrementEnv:
    """TRL's lead example, as its docs write it: no dataset; reset() self-samples the task and returns the prompt."""

    def reset(self, **kwargs) -> str | None:
        RESETS.append(kwargs)
        self.counter = 0
        self.target = random.randint(1, 6)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


SEEN = []


def prompt_reward(prompts, environments, **kwargs):
    SEEN.append([(p, e.target) for p, e in zip(prompts, environments)])
    return [0.0 for _ in prompts]
'''


def test_training_without_data_the_environment_owns_it_and_rewards_get_the_prompts_reset_gave(tmp_path) -> None:
    """TRL's lead environment example, with no dataset at all: placeholder rows (TRL's one empty user message, which
    reset(**row) receives as `prompt`, as TRL's placeholder dataset passes it), each episode's reset() giving its
    prompt; reward functions get `prompts` as TRL 1.16 builds them, reset's text appended to the last message (also
    kept in the sample's episode). From Python under GRPO, and from the CLI with get_reward as the only reward.
    Without data and without one environment class, the options are refused in one line."""
    import vrl

    module = tmp_path / "increment_env.py"
    module.write_text(INCREMENT_ENV)
    ns = load_reward_function(f"{module}:prompt_reward").__globals__
    env = DatasetEnvironment(environment_factory=f"{module}:IncrementEnv", reward=[f"{module}:prompt_reward"])
    tasks = env.tasks()
    assert len(tasks) == 1024 and env.splits == ("train",) and len(env.tasks(limit=3)) == 3
    assert (tasks[5].id, tasks[5].prompt, tasks[5].data) == ("train-5", [{"role": "user", "content": ""}], {})
    with pytest.raises(UnknownSplitError, match="no data .* is one split, 'train'"):
        env.tasks("test")
    config = vrl.TrainConfig(plugin="dataset", model="tiny", optimizer="grpo", iterations=2, tasks_per_iteration=2,
                             sampling={"max_new_tokens": 4}, grpo={"num_generations": 2},
                             logging={"runs_dir": str(tmp_path), "name": "py"})
    assert vrl.Trainer(config, environment=env).run()["status"] == "finished"
    assert ns["RESETS"] and all(r == {"prompt": [{"role": "user", "content": ""}]} for r in ns["RESETS"])
    assert [len(batch) for batch in ns["SEEN"]] == [4, 4]
    for batch in ns["SEEN"]:  # TRL: prompt[:-1] + [{**prompt[-1], "content": content + observation}]
        assert all(p == [{"role": "user", "content": f"Increment the counter by {t}."}] for p, t in batch), batch
    sample = json.loads((tmp_path / "py" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["episode"]["prompt"][0]["content"].startswith("Increment the counter by ")
    assert sample["prompt"] == sample["episode"]["prompt"]  # the sample shows the prompt the model saw

    res = cli("train", "--plugin", "dataset", "--optimizer", "grpo", "-n", "1", "--name", "cli",
              "-o", f"environment_factory={module}:IncrementEnv", "--set", "tasks_per_iteration=2",
              "--set", "grpo.num_generations=2", "--set", "sampling.max_new_tokens=4", "--set", f"logging.runs_dir={tmp_path}")
    assert res.exit_code == 0, res.output
    [row] = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert row["reward/IncrementEnv/applied"] == 4 and row["episodes/count"] == 4

    with pytest.raises(OptionsError, match=r"^environment 'dataset': no data; give -o data=FILE .*one environment_factory"):
        DatasetEnvironment(reward=[f"{module}:prompt_reward"])
    with pytest.raises(OptionsError, match="a dict environment_factory needs data whose 'environment' column"):
        DatasetEnvironment(environment_factory={"a": f"{module}:IncrementEnv"})
    with pytest.raises(RewardFunctionError, match="needs 'target', which training without data does not have"):
        DatasetEnvironment(environment_factory=f"{module}:IncrementEnv",
                           reward=[lambda completions, target: [0.0] * len(completions)]).tasks()


def test_tools_a_chat_template_cannot_show_are_refused_at_preflight_before_the_model_loads(tmp_path, monkeypatch):
    """A text prompt with tools on a tokenizer whose chat template ignores tools (the npm Llama 3.1 one) is refused
    by the preflight, from Python and from the CLI, in the one line the first episode would raise (naming the tools
    and the fix), before any weights load and before a run directory is made; no environment class's reset runs."""
    import vrl
    from tests.test_tools import _tokenizer
    from vrl.episodes import ToolsNotRendered

    llama31 = _tokenizer("llama3_1").name_or_path
    module, ns = _owned(tmp_path)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "Reach 3.", "target": 3}) + "\n")

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights loaded before the preflight refused the tools")

    monkeypatch.setattr("vrl.generate.hf.load_model_and_tokenizer", no_weights)
    monkeypatch.setattr("vrl.generate.hf.meta_model", no_weights)
    env = DatasetEnvironment(data=str(data), environment_factory=f"{module}:Reach", reward=[f"{module}:own_target"])
    ns["RESETS"].clear()
    config = vrl.TrainConfig(plugin="dataset", model=llama31, iterations=1, tasks_per_iteration=1,
                             logging={"runs_dir": str(tmp_path), "name": "py"})
    with pytest.raises(ToolsNotRendered, match=r"^the episode offers tools \(add\) but the model's chat template does "
                       r"not render tools .*use a model whose template renders tools .* or give no tools$"):
        vrl.Trainer(config, environment=env)
    assert not (tmp_path / "py").exists() and ns["RESETS"] == []
    res = cli("train", "--plugin", "dataset", "--model", llama31, "-n", "1", "--name", "cli", "-o", f"data={data}",
              "-o", f"tool={FIXTURES.parent}/tools/counter_env.py:double", "-o", f"reward={REWARDS}:always_raises",
              "--set", f"logging.runs_dir={tmp_path}")
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1 and "offers tools (double)" in errors[0], res.output
    assert not (tmp_path / "cli").exists()
