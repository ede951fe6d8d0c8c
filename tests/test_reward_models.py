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
    return CliRunner().invoke(main, ["train", "--plugin", "dataset", "--optimizer", "grpo", "-n", "2", "--name", name,
                                     "-o", f"data={data_file}", "-o", "prompt_column=question", "-o", f"reward={reward}",
                                     "-o", "reward_timeout_s=20", "--set", f"logging.runs_dir={tmp_path}", *SMALL])


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
    """POST /v1/chat/completions: the score is the response's length (capped at 10); records what it saw."""

    seen: list[dict] = []
    in_flight = peak = 0
    fail_first = 0
    delay = 0.0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.seen.append(body)
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
            fail = cls.fail_first > 0
            cls.fail_first -= 1
        time.sleep(cls.delay)
        with cls.lock:
            cls.in_flight -= 1
        if self.path != "/v1/chat/completions" or fail:
            self.send_response(503 if fail else 404)
            self.end_headers()
            return
        response = re.search(r"Response:\n(.*)\Z", body["messages"][-1]["content"], re.S).group(1)
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": f"{min(len(response), 10)}"}}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(out.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_url():
    Judge.seen, Judge.in_flight, Judge.peak, Judge.fail_first, Judge.delay = [], 0, 0, 0, 0.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
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
    with pytest.raises(JudgeError, match="no score"):
        judge._parse(type("R", (), {"json": lambda self: {"choices": [{"message": {"content": "great!"}}]},
                                    "text": ""})())
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
