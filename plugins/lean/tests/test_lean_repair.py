"""Lean proof repair (`-o turns=K`) on the recorded kimina fixtures: each turn's proof goes through the
whole verifier (the policy first: a banned construct never reaches Lean), a failed proof's Lean error
(position, message, the failing line of the checked file) goes back, and the repaired proof passes.

The server is `lean_replay.py` (recorded kimina-lean-server answers); an answer for a proof that
contains the tactic `nlinarith_typo` is SYNTHESISED here as Lean v4.15 reports an unknown tactic, at the
line of the checked file where it stands (kimina's numbering: after the split-off import lines). The
model's turns are scripted (the tiny random model never writes a proof).
"""

from __future__ import annotations

import json

from click.testing import CliRunner
from lean_replay import FIXTURE, Answer, ReplayServer, fixture_responder
from vrl_lean.environment import LeanEnvironment

from vrl.cli import main
from vrl.episodes import Episodes, Row, Sampled
from vrl.generate import tiny

TYPO = "nlinarith_typo"


def responder(seen: list[str]):
    recorded = fixture_responder()

    def respond(payload):
        seen.extend(s["code"] for s in payload["snippets"])
        answer = recorded(payload)
        for result in answer.body["results"]:
            code = next(s["code"] for s in payload["snippets"] if s["id"] == result["id"])
            if TYPO in code:
                rest = code.splitlines()
                skipped = next(i for i, line in enumerate(rest) if line.strip() and not line.startswith("import"))
                line = next(i for i, text in enumerate(rest) if TYPO in text) - skipped + 1
                result["response"]["messages"].insert(0, {"severity": "error", "pos": {"line": line, "column": 2},
                                                          "endPos": {"line": line, "column": 16},
                                                          "data": "unknown tactic"})
        return Answer(body=answer.body)

    return respond


def proof(name: str) -> str:
    return next(p for p in sorted((FIXTURE / "input").glob("*.lean")) if f"theorem {name} " in p.read_text()).read_text()


def test_a_failed_proof_gets_its_lean_error_and_failing_line_back_and_the_repair_passes():
    seen: list[str] = []
    with ReplayServer(responder(seen)) as server:
        env = LeanEnvironment(server=server.url, recheck="off", canary_rate=0.0, data=str(FIXTURE / "input"), turns=3)
        tasks = env.tasks("train")[:2]
        good = [proof(t.id) for t in tasks]
        broken = good[0].replace("  nlinarith [", f"  {TYPO} [", 1)
        assert broken != good[0]
        script = {tasks[0].id: [f"```lean4\n{broken}\n```", f"```lean4\n{good[0]}\n```"],
                  tasks[1].id: ["```lean4\n#eval 1\n```", f"```lean4\n{good[1]}\n```"]}
        tok = tiny.build_tokenizer()

        def generate(seqs, seeds, members):
            out = []
            for seq in seqs:
                text = tok.decode(seq)
                task = next(t for t in tasks if t.data["statement"][:60] in text)
                turn = script[task.id][text.count("<|assistant|>") - 1]
                ids = tok(turn, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                out.append(Sampled(ids=ids, text=turn, raw=turn, finish_reason="stop"))
            return out

        first, second = Episodes(env).run([Row(task=t, seed=0) for t in tasks], tok, generate)
    assert [t.passed for t in first.episode.turns if t.role == "assistant"] == [False, True]
    feedback = first.episode.turns[1].content
    assert feedback.startswith("Lean rejected the proof (failed): Lean error at line ") and "unknown tactic" in feedback
    failing = feedback.split("The failing line:\n", 1)[1].splitlines()[0]
    assert TYPO in failing and failing.strip().startswith(TYPO)  # the very line of the model's proof
    assert first.text.startswith("```lean4") and first.episode.metrics["turns"] == 2
    # The policy judged the second task's first turn: `#eval` refused before Lean saw it.
    assert [t.passed for t in second.episode.turns if t.role == "assistant"] == [False, True]
    assert "rejected" in second.episode.turns[1].content and "#eval" not in "".join(seen)
    assert sum(TYPO in code for code in seen) == 1 and len(seen) == 3  # every other turn reached Lean once


def test_vrl_train_with_turns_runs_episodes_on_the_fixtures(tmp_path):
    """`vrl train --plugin lean -o turns=3` with the tiny model: its turns never hold a proof, so each episode
    takes all three turns, every one judged (and refused) by the policy, and the run finishes."""
    with ReplayServer(fixture_responder()) as server:
        res = CliRunner().invoke(main, ["train", "--plugin", "lean", "--model", "tiny", "-n", "1", "--name", "repair",
                                        "-o", f"server={server.url}", "-o", "recheck=off", "-o", "turns=3",
                                        "-o", f"data={FIXTURE / 'input'}", "--set", "tasks_per_iteration=2",
                                        "--set", "es.population_size=2", "--set", "sampling.max_new_tokens=8",
                                        "--set", f"logging.runs_dir={tmp_path}"])
    assert res.exit_code == 0, res.output
    [row] = [json.loads(line) for line in (tmp_path / "repair" / "metrics.jsonl").read_text().splitlines()]
    assert row["episodes/count"] == 4 and row["episodes/turns_mean"] == 3 and row["episodes/pass_rate_turn_3"] == 0
    sample = json.loads((tmp_path / "repair" / "samples.jsonl").read_text().splitlines()[0])
    assert [t["role"] for t in sample["episode"]["turns"]] == ["assistant", "user"] * 2 + ["assistant"]
    assert sample["episode"]["turns"][1]["content"].startswith("Lean rejected the proof (rejected)")
