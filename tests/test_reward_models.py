"""Models as rewards (issue 42): a sequence-classification reward model (a tiny Qwen2 classifier with random
weights, built and saved here) and an LLM judge against a real HTTP server on 127.0.0.1 that speaks the
OpenAI chat-completions shape (a stub: it scores by the response's length, since no LLM runs here). Each trains
a tiny GRPO run end to end through `vrl train`; a judge that is down stops the run under the verifier-error
rule.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from click.testing import CliRunner

from vrl.cli import main
from vrl.generate import tiny
from vrl.reward_functions import load_reward_function
from vrl.reward_models import JudgeError, LLMJudge, RewardModel, RewardModelError

SMALL = ["--set", "tasks_per_iteration=3", "--set", "grpo.num_generations=2", "--set", "sampling.max_new_tokens=5",
         "--set", "grpo.learning_rate=1e-4"]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 sequence classifier (one label) with the byte tokenizer, saved as a Hub folder would be."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    path = tmp_path_factory.mktemp("rm")
    config = Qwen2Config(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=256,
                         eos_token_id=256, bos_token_id=256)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tiny.build_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question": f"Say something about {w}."}) + "\n" for w in ("cats", "rain", "tea")))
    return str(path)


def train(tmp_path, data_file, reward: str, name: str):
    judge = ["-o", "judge_timeout_s=5"] if reward.startswith("judge:") else []  # 3 tries fit in reward_timeout_s
    return CliRunner().invoke(main, ["train", "--plugin", "dataset", "--optimizer", "grpo", "-n", "2", "--name", name,
                                     "-o", f"data={data_file}", "-o", "prompt_column=question", "-o", f"reward={reward}",
                                     "-o", "reward_timeout_s=20", *judge, "--set", f"logging.runs_dir={tmp_path}", *SMALL])


def metrics(tmp_path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_reward_model_scores_batched_and_trains_a_run(tmp_path, classifier_dir, data_file):
    """The reward is the classifier's logit on prompt + completion (right-padded batches give each row's own
    value), chat prompts go through the chat template; `-o reward=model:PATH` trains two GRPO iterations."""
    from transformers import AutoModelForSequenceClassification

    rm = load_reward_function(f"model:{classifier_dir}")
    assert isinstance(rm, RewardModel) and rm.device.type == "cpu"
    prompts, completions = ["Hi.", "A longer prompt here.", "x"], ["yes", "no, not at all", "maybe so"]
    reference = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    tok = tiny.build_tokenizer()
    with torch.no_grad():
        want = [float(reference(**tok(p + c, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
                for p, c in zip(prompts, completions)]
    assert rm(prompts, completions) == pytest.approx(want, abs=1e-5)
    rm.batch_size = 1
    assert rm(prompts, completions) == pytest.approx(want, abs=1e-5)
    chat = rm.text([{"role": "user", "content": "Hi."}], [{"role": "assistant", "content": "yes"}])
    assert "<|user|>\nHi." in chat and "<|assistant|>\nyes" in chat
    with pytest.raises(RewardModelError, match="cannot load reward model"):
        RewardModel(str(tmp_path / "missing"))

    res = train(tmp_path, data_file, f"model:{classifier_dir}", "rm")
    assert res.exit_code == 0, res.output
    rows = metrics(tmp_path, "rm")
    name = rm.__name__
    assert len(rows) == 2 and all(r[f"reward/{name}/applied"] == r["completions"] == 6 for r in rows)
    samples = [json.loads(line) for line in (tmp_path / "rm" / "samples.jsonl").read_text().splitlines()]
    for s in samples[:3]:  # each recorded reward is the classifier's score of that prompt and completion
        assert s["reward"] == pytest.approx(rm([s["prompt"]], [s["completion"]])[0], abs=1e-4)


class Judge(BaseHTTPRequestHandler):
    """POST /v1/chat/completions: the score is the response's length (capped at 10), or `reply` when set; a response
    holding `fail_on` always gets a 500; `trickle_s`: the body is sent a byte at a time, this far apart. Records the
    bodies and the Authorization headers it saw."""

    seen: list[dict] = []
    auth: list[str | None] = []
    in_flight = peak = 0
    fail_first = 0
    delay = 0.0
    fail_on: str | None = None
    reply: str | None = None
    trickle_s = 0.0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        response = re.search(r"Response:\n(.*)\Z", body["messages"][-1]["content"], re.S).group(1)
        with cls.lock:
            cls.seen.append(body)
            cls.auth.append(self.headers.get("Authorization"))
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
            fail = cls.fail_first > 0 or (cls.fail_on is not None and cls.fail_on in response)
            cls.fail_first -= 1
        time.sleep(cls.delay)
        with cls.lock:
            cls.in_flight -= 1
        if self.path != "/v1/chat/completions" or fail:
            self.send_response(503 if fail else 404)
            self.end_headers()
            return
        content = cls.reply if cls.reply is not None else f"{min(len(response), 10)}"
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        if not cls.trickle_s:
            self.wfile.write(out)
            return
        for i in range(len(out)):
            self.wfile.write(out[i : i + 1])
            self.wfile.flush()
            time.sleep(cls.trickle_s)

    def log_message(self, *args):
        pass


class _Server(ThreadingHTTPServer):
    request_queue_size = 64  # many concurrent connections (the concurrency test)
    daemon_threads = True


@pytest.fixture
def judge_url():
    Judge.seen, Judge.auth, Judge.in_flight, Judge.peak, Judge.fail_first, Judge.delay = [], [], 0, 0, 0, 0.0
    Judge.fail_on, Judge.reply, Judge.trickle_s = None, None, 0.0
    server = _Server(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_llm_judge_scores_with_a_cap_retries_and_trains_a_run(tmp_path, data_file, judge_url):
    """Scores are the reply's number / max_score; at most `concurrency` requests are in flight; a 503 is retried;
    a reply without a score is a JudgeError (never 0); `-o reward=judge:MODEL@URL` trains two GRPO iterations."""
    judge = LLMJudge("stub", judge_url, concurrency=2, backoff_s=0.01)
    Judge.delay, Judge.fail_first = 0.05, 1
    texts = ["a", "abc", "abcdefghijklmnop", "ab", "", "abcd"]
    scores = asyncio.run(judge(["p"] * 6, texts))
    assert scores == [min(len(t), 10) / 10 for t in texts]
    assert Judge.peak == 2 and len(Judge.seen) == 7  # six answers and one retried 503
    assert Judge.seen[0]["model"] == "stub" and Judge.seen[0]["temperature"] == 0.0
    with pytest.raises(JudgeError, match="not a score alone"):
        judge._parse(json.dumps({"choices": [{"message": {"content": "great!"}}]}))
    Judge.delay = 0.0
    res = train(tmp_path, data_file, f"judge:stub@{judge_url}", "judged")
    assert res.exit_code == 0, res.output
    rows = metrics(tmp_path, "judged")
    assert all(r["reward/judge/applied"] == r["completions"] for r in rows)
    assert len(Judge.seen) >= 7 + 12  # every completion of both iterations went to the judge


@pytest.mark.slow
def test_a_judge_that_is_down_stops_the_run(tmp_path, data_file, judge_url):
    """Nothing listens on the port: every completion's judge call fails after its retries, each completion is a
    verifier error (not reward 0), and the run stops before its first update with one line naming the judge."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    res = train(tmp_path, data_file, f"judge:stub@http://127.0.0.1:{port}/v1", "down")
    assert res.exit_code == 2, res.output
    error = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "reward function 'judge' raised JudgeError" in error[0], res.output
    assert "ConnectionError" in error[0]
    assert not (tmp_path / "down").exists()


# -- rewards that fail honestly (issue 56, item 8) ----------------------------------------------------------------
def _attempts(texts: list[str], per_task: int) -> list:
    """Attempts of len(texts) / per_task tasks, with token ids GRPO can train on (the text is what the judge reads)."""
    from vrl.types import Attempt, Completion, Task

    out = []
    for i, text in enumerate(texts):
        task = Task(id=f"t{i // per_task}", prompt=f"Task {i // per_task}: say something.\n")
        ids = [(7 * i + k) % 250 + 1 for k in range(4)]
        out.append(Attempt(task=task, completion=Completion(
            task_id=task.id, text=text, sample=i % per_task, prompt_token_ids=[65, 66, 67], token_ids=ids,
            completion_tokens=len(ids))))
    return out


def test_a_judge_that_fails_on_some_completions_costs_those_alone_and_grpo_leaves_them_out(judge_url):
    """The judge answers 500 to every completion holding BAD and 8 to the others. The server sees each failed
    completion's own retries and every other completion once: never the batch again. The failed ones are verifier
    errors, NaN for GRPO: its group statistics leave them out (every scored completion has 0.8, so the reward std
    is 0 and no advantage is left), and its update is zero, where reward 0 would have taught "avoid BAD"."""
    from vrl.config import SamplingConfig
    from vrl.generate.hf import HFGenerator
    from vrl.optim.grpo import GRPO, GRPOConfig, reward_table
    from vrl.reward_functions import RewardFunctions
    from vrl.types import Result
    from vrl.verifier import is_verifier_error

    Judge.fail_on, Judge.reply = "BAD", "8"
    texts = ["fine", "BAD one", "also fine", "ok", "BAD two", "BAD three", "good", "nice"]
    attempts = _attempts(texts, per_task=4)
    rewards = RewardFunctions([LLMJudge("stub", judge_url, retries=2, backoff_s=0.01)])
    verdicts = asyncio.run(rewards.verifier().verify(attempts))

    sent = [re.search(r"Response:\n(.*)\Z", b["messages"][-1]["content"], re.S).group(1) for b in Judge.seen]
    assert {t: sent.count(t) for t in texts} == {t: 3 if "BAD" in t else 1 for t in texts}
    failed = ["BAD" in t for t in texts]
    assert [is_verifier_error(v) for v in verdicts] == failed
    assert all("HTTP 503" in v.detail and judge_url in v.detail for v, f in zip(verdicts, failed) if f)
    shaper = rewards.shaper()
    results = [Result(task=a.task, completion=a.completion, verdict=v, reward=shaper(a.task, a.completion, v))
               for a, v in zip(attempts, verdicts)]
    table, _, _ = reward_table(results)
    assert [r != r for r in table] == failed and all(r == pytest.approx(0.8) for r, f in zip(table, failed) if not f)

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4)
    grpo = GRPO(GRPOConfig(num_generations=4, learning_rate=1e-2, lr_scheduler_type="constant"), seed=0,
                total_iterations=2)
    grpo.setup(HFGenerator(tiny.build_model(), tiny.build_tokenizer(), sampling))
    before = [p.detach().clone() for p in grpo.master]
    metrics = grpo.tell(results)
    assert metrics["grpo/unscorable"] == 3 and metrics["grpo/reward_std"] == 0.0
    assert metrics["grpo/advantage_abs_mean"] == 0.0 and metrics["grpo/grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, grpo.master))


def test_es_fitness_leaves_out_what_the_verifier_failed_on():
    """A member's fitness is the mean over its judged results: a verifier error (a judge that failed) is absent,
    not 0."""
    from tests.test_es import _generator
    from vrl.optim.es import ES, ESConfig
    from vrl.types import Completion, Result, Task, Verdict
    from vrl.verifier import verifier_error

    es = ES(ESConfig(population_size=4, sigma=0.01), seed=0)
    es.setup(_generator())
    task, results = Task(id="t0", prompt="p"), []
    for v in es.ask():  # member i: rewards 0.2·i and 0; member 1's second result is a verifier error
        for s, reward in enumerate([0.2 * v.index, 0.0]):
            verdict = verifier_error("judge down") if (v.index, s) == (1, 1) else Verdict.fail("failed", "", score=reward)
            results.append(Result(task=task, completion=Completion(task_id="t0", text="x", variant=v.index, sample=s),
                                  verdict=verdict, reward=reward))
    metrics = es.tell(results)
    # member 1's failed result is absent: its fitness is 0.2 alone, not (0.2 + 0) / 2
    assert metrics["es/member_reward_max"] == pytest.approx(0.3) and metrics["es/member_reward_min"] == 0.0
    assert metrics["es/member_reward_mean"] == pytest.approx((0.0 + 0.2 + 0.2 + 0.3) / 4)


@pytest.fixture(scope="module")
def bad_heads(tmp_path_factory) -> dict[str, str]:
    """Checkpoints TRL would not load as reward models: a 2-label classifier and a causal LM (no score head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    shape = dict(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, pad_token_id=256, eos_token_id=256, bos_token_id=256)
    root = tmp_path_factory.mktemp("heads")
    Qwen2ForSequenceClassification(Qwen2Config(num_labels=2, **shape)).save_pretrained(root / "two")
    Qwen2ForCausalLM(Qwen2Config(**shape)).save_pretrained(root / "lm")
    for name in ("two", "lm"):
        tiny.build_tokenizer().save_pretrained(root / name)
    return {"two": str(root / "two"), "lm": str(root / "lm")}


def test_model_reward_refuses_two_labels_and_a_missing_score_head_before_generation(tmp_path, bad_heads, data_file,
                                                                                   monkeypatch):
    """TRL loads `reward_funcs="id"` with num_labels=1: a 2-label classifier (whose first logit is one class's) and a
    checkpoint without a score head (a random head, another at every load) are refused in one line, by `vrl train`
    before anything is generated or a run directory made."""
    from vrl.generate.hf import HFGenerator

    with pytest.raises(RewardModelError, match=r"has 2 labels .*num_labels=1"):
        RewardModel(bad_heads["two"])
    with pytest.raises(RewardModelError, match=r"has no score head \(the checkpoint lacks score.weight\)"):
        RewardModel(bad_heads["lm"])

    def no_generation(*args, **kwargs):
        raise AssertionError("generated before the reward model was refused")

    monkeypatch.setattr(HFGenerator, "generate", no_generation)
    for kind, words in (("two", "has 2 labels"), ("lm", "has no score head")):
        res = train(tmp_path, data_file, f"model:{bad_heads[kind]}", kind)
        assert res.exit_code == 2, res.output
        errors = [line for line in res.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and words in errors[0], res.output
        assert not (tmp_path / kind).exists()


def test_the_judge_timeout_bounds_the_whole_request_and_names_the_judge(judge_url):
    """A server that trickles its answer a byte every 0.1 s (about 9 s in all) cannot hold a request past timeout_s:
    the completion fails within about a second, with an error naming the judge's URL."""
    Judge.trickle_s = 0.1
    judge = LLMJudge("stub", judge_url, timeout_s=1, retries=0)
    start = time.monotonic()
    [value] = asyncio.run(judge(["p"], ["a reply"]))
    assert time.monotonic() - start < 2.5
    assert isinstance(value, JudgeError) and judge_url in str(value) and "timeout_s=1" in str(value)


def test_judge_defaults_fit_reward_timeout_and_the_cli_sets_both(data_file, judge_url):
    """The judge's worst case (every try at timeout_s, and the backoffs) fits the default reward_timeout_s; a judge
    that cannot fit is refused naming both settings; -o judge_timeout_s / judge_retries / judge_concurrency reach it."""
    from vrl.envs.dataset import DatasetEnvironment
    from vrl.errors import UsageError
    from vrl.reward_functions import RewardFunctions

    env = DatasetEnvironment(data=data_file, prompt_column="question", reward=f"judge:stub@{judge_url}")
    judge = env.rewards.functions[0]
    assert judge.worst_case_s <= 0.9 * env.options.reward_timeout_s and judge.call_timeout_s == 60
    env = DatasetEnvironment(data=data_file, prompt_column="question", reward=f"judge:stub@{judge_url}",
                             judge_timeout_s="40", judge_retries="3", judge_concurrency="3", reward_timeout_s="200")
    judge = env.rewards.functions[0]
    assert (judge.timeout_s, judge.retries, judge.concurrency, judge.call_timeout_s) == (40, 3, 3, 200)
    with pytest.raises(UsageError, match=r"one completion may take 91.5 s .*reward_timeout_s=60"):
        RewardFunctions([LLMJudge("stub", judge_url, timeout_s=30)], timeout_s=60)
    with pytest.raises(UsageError, match="judge_retries set a judge: reward"):
        DatasetEnvironment(data=data_file, prompt_column="question", reward="rewards.py:f", judge_retries=1)


def test_judge_concurrency_is_as_configured(judge_url):
    """16 completions, concurrency 12, each answer 0.5 s: 12 requests are in flight at once (no thread pool caps it)."""
    Judge.delay = 0.5
    judge = LLMJudge("stub", judge_url, concurrency=12)
    assert len(asyncio.run(judge(["p"] * 16, ["abc"] * 16))) == 16
    assert Judge.peak == 12


@pytest.mark.parametrize("reply, value", [("9", 0.9), (" 7.5\n", 0.75), ("10", 1.0), ("0", 0.0),
                                          ("1. Accuracy: good. Overall 9", None), ("8/10", None), ("Score: 8", None),
                                          ("-1", None), ("11", None), ("", None), ("nine", None)])
def test_judge_replies_are_parsed_strictly(judge_url, reply, value):
    """The reply is the score alone (a number from 0 to max_score, whitespace around it): anything else is a
    failure of that completion, never a number read out of it."""
    Judge.reply = reply
    [got] = asyncio.run(LLMJudge("stub", judge_url)(["p"], ["c"]))
    if value is None:
        assert isinstance(got, JudgeError) and "not a score alone" in str(got)
    else:
        assert got == pytest.approx(value)


def test_judge_key_goes_only_to_https_or_loopback(judge_url, caplog):
    """The API key is sent to a loopback URL (the server saw it) and to https; to a plain-http remote host it is
    withheld (logged once) unless key_over_http."""
    asyncio.run(LLMJudge("stub", judge_url, api_key="sk-test")(["p"], ["c"]))
    assert Judge.auth == ["Bearer sk-test"]
    with caplog.at_level("WARNING", logger="vrl.reward_models"):
        remote = LLMJudge("stub", "http://judge.example.com/v1", api_key="sk-test")
    assert remote.key_withheld and remote._api_key is None and "not sent over plain http" in caplog.text
    assert LLMJudge("stub", "https://judge.example.com/v1", api_key="sk-test")._api_key == "sk-test"
    assert LLMJudge("stub", "http://judge.example.com/v1", api_key="sk-test", key_over_http=True)._api_key == "sk-test"
    assert LLMJudge("stub", "http://[::1]:9/v1", api_key="sk-test")._api_key == "sk-test"


def test_judge_credentials_never_show_and_a_model_name_may_hold_an_at(tmp_path, judge_url, data_file, monkeypatch):
    """A password in the judge URL: a literal one is refused (it would be recorded in config.json) without being
    shown; `${VAR}` is read from the environment, authenticates, and shows as *** in errors and reprs. The URL
    starts at the last @http(s)://, so a model name may hold '@'."""
    import base64

    host = judge_url.removeprefix("http://")
    res = CliRunner().invoke(main, ["train", "--plugin", "dataset", "--optimizer", "grpo", "-n", "1", "--name", "pw",
                                    "-o", f"data={data_file}", "-o", "prompt_column=question", "-o",
                                    f"reward=judge:stub@http://me:hunter2@{host}", "--set",
                                    f"logging.runs_dir={tmp_path}", *SMALL])
    assert res.exit_code == 2 and "hunter2" not in res.output and "${VAR}" in res.output, res.output
    assert not (tmp_path / "pw").exists()

    monkeypatch.setenv("JUDGE_PW", "hunter2")
    judge = load_reward_function("judge:org/model@v2@http://me:${JUDGE_PW}@" + host)
    assert judge.model == "org/model@v2" and "hunter2" not in repr(judge)
    assert asyncio.run(judge(["p"], ["abc"])) == [0.3]
    assert Judge.auth[-1] == "Basic " + base64.b64encode(b"me:hunter2").decode()
    Judge.fail_on = "abc"
    [error] = asyncio.run(judge(["p"], ["abc"]))
    assert isinstance(error, JudgeError) and "hunter2" not in str(error) and f"http://me:***@{host}" in str(error)


def test_a_reward_model_renders_chats_with_the_runs_chat_template_kwargs_as_trl_does(tmp_path, classifier_dir):
    """`sampling.chat_template_kwargs` reach a reward model's chats (given as an object, or as `model:PATH`), handed
    over by the preflight: the text it scores is TRL 1.16's own rendering of prompt + completion for a reward model
    (`apply_chat_template({"messages": ...}, tokenizer, **chat_template_kwargs)`), and its reward is the model's
    logit on that text."""
    from trl.data_utils import apply_chat_template

    import vrl
    from vrl.envs.dataset import DatasetEnvironment

    rm = RewardModel(classifier_dir, device="cpu")
    rm.tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}{% if enable_thinking is defined and not "
                                  "enable_thinking %} quiet{% endif %}>{{ m.content }}\n{% endfor %}")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "Say hi."}]}) + "\n")
    env = DatasetEnvironment(data=str(data), reward=[rm, f"model:{classifier_dir}"])
    config = vrl.TrainConfig(plugin="dataset", model="tiny", iterations=1, tasks_per_iteration=1,
                             sampling={"chat_template_kwargs": {"enable_thinking": False}},
                             logging={"runs_dir": str(tmp_path), "name": "rm"})
    vrl.Trainer(config, environment=env)  # its preflight hands the environment the run's settings
    assert [f.chat_template_kwargs for f in env.rewards.functions] == [{"enable_thinking": False}] * 2
    prompt, completion = [{"role": "user", "content": "Say hi."}], [{"role": "assistant", "content": "hi"}]
    trl_text = apply_chat_template({"messages": prompt + completion}, rm.tokenizer, enable_thinking=False)["text"]
    assert rm.text(prompt, completion) == trl_text == "<user quiet>Say hi.\n<assistant quiet>hi\n"
    with torch.inference_mode():
        logit = rm.model(**rm.tokenizer([trl_text], return_tensors="pt", add_special_tokens=False)).logits[0, 0]
    assert rm([prompt], [completion]) == pytest.approx([float(logit)], abs=1e-6)


def test_a_loaded_sequence_classification_model_is_a_reward_function_as_in_trl(classifier_dir, bad_heads, data_file):
    """TRL's `reward_funcs=[model]` (a loaded sequence-classification model): it scores as `model:PATH` does, its
    tokenizer loaded from the model's name, logged under the name's last part; a 2-label one is refused in one line."""
    from transformers import AutoModelForSequenceClassification

    from vrl.envs.dataset import DatasetEnvironment
    from vrl.reward_functions import RewardFunctions

    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir, num_labels=1)
    rewards = DatasetEnvironment(data=data_file, prompt_column="question", rewards=[model]).rewards
    [rm] = rewards.functions
    assert isinstance(rm, RewardModel) and rewards.names == [classifier_dir.rstrip("/").split("/")[-1]]
    prompts = ["Say hi. ", [{"role": "user", "content": "Say hi."}]]
    completions = ["hi", [{"role": "assistant", "content": "hi there"}]]
    assert rm(prompts, completions) == pytest.approx(RewardModel(classifier_dir, device="cpu")(prompts, completions),
                                                     abs=1e-6)
    two = AutoModelForSequenceClassification.from_pretrained(bad_heads["two"])
    with pytest.raises(RewardModelError, match=r"^reward model '.*two' has 2 labels, not one"):
        RewardFunctions([two])
