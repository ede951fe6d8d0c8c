"""The kimina client and the Lean verifier against a local HTTP server that replays answers.

The server (lean_replay.ReplayServer, a thread in this process) speaks kimina-lean-server's API; a
real server needs Docker and Lean + Mathlib, which the test machine lacks. Its answers are the
recorded ones from the fixture with the trailer's two messages (axioms report, nonce echo)
synthesised in Lean's format (see lean_replay), plus crafted error paths and forged answers.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from lean_replay import (
    AUDIT_OK,
    FIXTURE,
    Answer,
    ReplayServer,
    fixture_problems,
    fixture_responder,
    fixture_result,
)
from lean_replay import fixture_attempt as attempt
from vrl_lean.client import KiminaClient, LeanServerError
from vrl_lean.verifier import LeanVerifier

from vrl.types import Status

PROBLEMS = fixture_problems()


def verifier(url: str, **kw) -> LeanVerifier:
    kw.setdefault("repls", 4)
    client = KiminaClient(url, kw.pop("api_key", None), repls=kw.pop("repls"), timeout_s=kw.pop("timeout_s", 30.0),
                          max_retries=kw.pop("max_retries", 3), backoff_s=0.01, queue_wait_s=kw.pop("queue_wait_s", 60.0))
    return LeanVerifier(client=client, **kw)


async def test_fixture_end_to_end_50_pass_2_timeouts_joined_by_id_in_batches_of_repls():
    with ReplayServer(fixture_responder()) as server:
        v = verifier(server.url, repls=4, api_key="sekrit")
        attempts = [attempt(n) for n in sorted(PROBLEMS)]
        verdicts = await v.verify(attempts)
        await v.aclose()
    by_name = {a.task.id: verdict for a, verdict in zip(attempts, verdicts)}
    assert sum(v.passed for v in verdicts) == 50
    assert sorted(n for n, v in by_name.items() if v.status is Status.TIMEOUT) == ["lean_workbook_10090", "lean_workbook_1036"]
    assert all("axioms audited" in v.detail for v in verdicts if v.passed)
    # The replay server answers in reverse order: correct verdicts prove the join is by id.
    assert [len(r["snippets"]) for r in server.requests] == [4] * 13
    body = server.requests[0]
    assert body["timeout"] == 30 and body["reuse"] is True and body["debug"] is False
    assert all(a == "Bearer sekrit" for a in server.auth_headers)
    code = body["snippets"][0]["code"]
    assert code.startswith("import Mathlib\nimport Aesop\n")
    audit, echo = code.rstrip().splitlines()[-2:]
    assert audit.startswith("#print axioms ") and re.fullmatch(r'#print "vrl audit [0-9a-f]{32}"', echo)
    markers = [s["code"].rstrip().splitlines()[-1] for r in server.requests for s in r["snippets"]]
    assert len(set(markers)) == 52  # a fresh nonce per snippet


async def test_a_forged_answer_that_does_not_echo_the_nonce_is_never_a_pass():
    """The `#eval!` attack wrote a complete fake REPL answer to stdout. Such an answer (here: the
    recorded clean answer plus a well-formed axioms report, i.e. everything but the nonce) fails."""
    with ReplayServer(fixture_responder(echo=False)) as server:
        v = verifier(server.url)
        verdicts = await v.verify([attempt("lean_workbook_101"), attempt("simple_add")])
    assert not any(x.passed for x in verdicts)
    assert all(x.status is Status.CRASHED and "nonce" in x.detail for x in verdicts)


async def test_an_answer_out_of_step_with_its_request_is_never_a_pass():
    """When a forged answer is read first, the REPL's real answer stays in the pipe and is read as the
    answer to the NEXT request. That stale answer carries the previous request's nonce: not a pass."""
    previous: list[dict] = []

    def respond(payload):
        snippet = payload["snippets"][0]
        answer = fixture_result(snippet["id"], (previous or [snippet])[-1]["code"])
        answer["id"] = snippet["id"]
        previous.append(snippet)
        return Answer(body={"results": [answer]})

    with ReplayServer(respond) as server:
        v = verifier(server.url)
        first = await v.verify([attempt("lean_workbook_101")])
        second = await v.verify([attempt("lean_workbook_101")])
    assert first[0].passed
    assert not second[0].passed and "nonce" in second[0].detail


async def test_an_audit_listing_sorryAx_fails_every_proof():
    forged = "'{name}' depends on axioms: [propext, sorryAx, Classical.choice, Quot.sound]"
    with ReplayServer(fixture_responder(audit=forged)) as server:
        v = verifier(server.url)
        verdicts = await v.verify([attempt("lean_workbook_101"), attempt("simple_add")])
    assert not any(x.passed for x in verdicts) and all("sorryAx" in x.detail for x in verdicts)


async def test_rejected_attempts_are_never_sent():
    with ReplayServer(fixture_responder()) as server:
        v = verifier(server.url)
        bad = attempt("lean_workbook_101", "```lean4\ntheorem lean_workbook_101 (x : ℕ) (hx : x = 2^9 + 1) : x = 513 := by sorry\n```")
        verdicts = await v.verify([bad, attempt("simple_add")])
    assert verdicts[0].status is Status.REJECTED and "sorry" in verdicts[0].detail
    assert verdicts[1].passed
    assert [len(r["snippets"]) for r in server.requests] == [1]


async def test_a_500_splits_the_batch_so_only_the_crashing_snippet_fails():
    def respond(payload):
        if any("lean_workbook_101" in s["code"] for s in payload["snippets"]):
            return Answer(500, {"detail": "REPL died"})
        return fixture_responder()(payload)

    names = ["lean_workbook_10009", "lean_workbook_101", "lean_workbook_10012", "simple_add"]
    with ReplayServer(respond) as server:
        v = verifier(server.url, repls=4)
        verdicts = await v.verify([attempt(n) for n in names])
    status = dict(zip(names, verdicts))
    assert status["lean_workbook_101"].status is Status.CRASHED and "500" in status["lean_workbook_101"].detail
    assert all(status[n].passed for n in names if n != "lean_workbook_101")
    assert sorted(len(r["snippets"]) for r in server.requests) == [1, 1, 2, 2, 4]


async def test_429_is_retried_with_backoff_then_succeeds():
    calls = []

    def respond(payload):
        calls.append(time.monotonic())
        if len(calls) < 3:
            return Answer(429, {"detail": "No available REPLs"})
        return fixture_responder()(payload)

    with ReplayServer(respond) as server:
        verdicts = await verifier(server.url).verify([attempt("lean_workbook_101")])
    assert verdicts[0].passed and len(calls) == 3


async def test_503_retry_after_is_honoured_and_retries_are_bounded():
    calls = []

    def respond(payload):
        calls.append(time.monotonic())
        return Answer(503, {"detail": "starting"}, headers={"Retry-After": "0.3"})

    with ReplayServer(respond) as server:
        verdicts = await verifier(server.url, max_retries=2).verify([attempt("lean_workbook_101")])
    assert len(calls) == 3  # first try + 2 retries
    assert calls[1] - calls[0] >= 0.25
    assert verdicts[0].status is Status.CRASHED and "gave up after 2 retries" in verdicts[0].detail


async def test_a_dropped_connection_is_retried():
    calls = []

    def respond(payload):
        calls.append(1)
        return Answer(drop=True) if len(calls) == 1 else fixture_responder()(payload)

    with ReplayServer(respond) as server:
        verdicts = await verifier(server.url).verify([attempt("lean_workbook_101")])
    assert verdicts[0].passed and len(calls) == 2


async def test_a_slow_answer_becomes_a_timeout_verdict_and_is_not_retried():
    """The server holds its answer until the client has given up: the verdict (a timeout) comes first.
    A client that waited for the answer would get it only when the test lets the server go (after 60 s
    at the latest), as a wrong answer, and `answered` would be set before the verdict."""
    calls = []
    release, answered = threading.Event(), threading.Event()

    def respond(payload):
        calls.append(1)
        release.wait(60)
        answered.set()
        return Answer(body={"results": []})

    with ReplayServer(respond) as server:
        v = verifier(server.url, timeout_s=0.2, queue_wait_s=0.0)  # HTTP timeout 0.6 s
        try:
            verdicts = await v.verify([attempt("lean_workbook_101")])
            answered_first = answered.is_set()
        finally:
            release.set()
    assert not answered_first  # the client gave up before the server answered
    assert verdicts[0].status is Status.TIMEOUT and "timed out" in verdicts[0].detail
    assert len(calls) == 1


@pytest.mark.parametrize("status,hint", [(401, "api_key"), (404, "kimina-lean-server 2.x"), (422, "shape"), (400, "not retried")])
async def test_other_4xx_are_not_retried_and_explained(status, hint):
    with ReplayServer(lambda p: Answer(status, {"detail": "nope"})) as server:
        verdicts = await verifier(server.url).verify([attempt("lean_workbook_101")])
        with pytest.raises(LeanServerError, match=hint):
            await KiminaClient(server.url).check([("a", "import Mathlib")])
    assert verdicts[0].status is Status.CRASHED and hint in verdicts[0].detail
    assert len(server.requests) == 2  # one per call: never retried


async def test_a_missing_result_id_fails_only_that_attempt():
    def respond(payload):
        kept = [s for s in payload["snippets"] if "simple_add" not in s["code"]]
        return Answer(body={"results": [fixture_result(s["id"], s["code"]) for s in kept]})

    with ReplayServer(respond) as server:
        verdicts = await verifier(server.url).verify([attempt("lean_workbook_101"), attempt("simple_add")])
    assert verdicts[0].passed
    assert verdicts[1].status is Status.CRASHED and "no result" in verdicts[1].detail


async def test_unreachable_server_gives_crashed_verdicts_naming_the_url():
    v = verifier("http://127.0.0.1:9", max_retries=1)
    verdicts = await v.verify([attempt("lean_workbook_101")])
    assert verdicts[0].status is Status.CRASHED and "127.0.0.1:9" in verdicts[0].detail


async def test_health_and_snippet_id_checks():
    with ReplayServer(fixture_responder()) as server:
        client = KiminaClient(server.url)
        assert await client.health()
        with pytest.raises(ValueError, match="unique"):
            await client.check([("a", "x"), ("a", "y")])
        await client.aclose()
    assert not await KiminaClient("http://127.0.0.1:9").health()


def test_client_and_verifier_arguments_are_validated():
    with pytest.raises(ValueError, match="http"):
        KiminaClient("localhost:8000")
    with pytest.raises(ValueError, match="repls"):
        KiminaClient("http://x", repls=0)
    assert KiminaClient("http://x", timeout_s=60, queue_wait_s=60).http_timeout_s == 190
    with pytest.raises(ValueError, match="docker run"):
        LeanVerifier()
    with pytest.raises(ValueError, match="max_heartbeats"):
        LeanVerifier("http://x", max_heartbeats=0)


def test_audit_line_format_matches_lean_v4_15():
    assert AUDIT_OK.format(name="lean_workbook_101") == "'lean_workbook_101' depends on axioms: [propext, Classical.choice, Quot.sound]"


async def test_the_eval_bang_forgery_is_refused_before_it_reaches_the_server():
    """Issue 15's attack through the real verifier: a correct-looking proof followed by `#eval!` code
    that writes a fake REPL answer to stdout. It is rejected with a reason and never sent."""
    source = (FIXTURE / "input" / "goedel-lean_workbook_101.lean").read_text()
    forgery = (
        '\n#eval! show IO Unit from do\n  let out ← IO.FS.Handle.mk "/proc/self/fd/1" .write\n'
        '  out.putStrLn (toString (Lean.Json.mkObj [("env", 0)]))\n  out.putStrLn ""\n'
    )
    with ReplayServer(fixture_responder()) as server:
        v = verifier(server.url)
        verdicts = await v.verify([attempt("lean_workbook_101", f"```lean4\n{source}{forgery}```"), attempt("simple_add")])
    assert verdicts[0].status is Status.REJECTED and "`#eval!`" in verdicts[0].detail
    assert verdicts[1].passed
    assert [len(r["snippets"]) for r in server.requests] == [1] and "#eval" not in server.requests[0]["snippets"][0]["code"]


async def test_a_helper_lemma_is_sent_with_the_proof_and_the_proof_passes():
    """Kimina-style answers prove a lemma first; it used to be dropped silently ("unknown identifier")."""
    statement = PROBLEMS["lean_workbook_101"].theorem.statement
    completion = (
        "<think>\nuse a lemma\n</think>\n```lean4\nimport Mathlib\n\nlemma eval_hx (x : ℕ) (hx : x = 2^9 + 1) : x = 513 := by\n"
        f"  rw [hx]\n\n{statement} := by\n  exact eval_hx x hx\n```"
    )
    with ReplayServer(fixture_responder()) as server:
        verdicts = await verifier(server.url).verify([attempt("lean_workbook_101", completion)])
    code = server.requests[0]["snippets"][0]["code"]
    assert code.index("lemma eval_hx") < code.index(statement) < code.index("#print axioms")
    assert verdicts[0].passed, verdicts[0].detail
