"""The process inside a verifier sandbox: the plugin's verifier behind a JSON-lines protocol.

    python -m vrl.runtime.modal.verify_server --plugin NAME [-o KEY=VALUE ...] [--wait-url URL]

stdin carries one request per line, stdout one response per line (same `id`):

    {"id": 1, "op": "ping"}                      -> {"id": 1, "ok": true}
    {"id": 2, "op": "verify", "attempts": [...]} -> {"id": 2, "verdicts": [...]}
    (a blank line)                               -> nothing: the pool's keep-alive while a request runs
                                                    (stdin writes keep a Modal sandbox from its idle timeout)

Anything a plugin prints goes to stderr: file descriptor 1 is taken for the protocol at start-up.
With `--wait-url`, pings are answered only once that URL is healthy (a sidecar server such as
kimina-lean-server is up: alive, which is not ready). The first ping then runs the verifier's own
`check_ready()` (a plugin's self-check, e.g. that bubblewrap can make its sandbox here): its message, or
the error that kept the verifier from being built, is the ping's answer, so the pool and `vrl modal
doctor` name the real cause instead of a failed warm-up. With `--warmup` (a JSON list of attempts), the
first ping is answered only once the plugin's own verifier has judged every one of them as passed: a
Lean server has then imported Mathlib and checked a proof, so the pool's start timeout covers the
warm-up and the first batch does not pay it inside the verifier's timeout. `--warmup-option KEY=VALUE`
judges the warm-up with those verifier options on top of `-o` (a long per-proof timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import urllib.request

log = logging.getLogger("vrl.verify_server")


def _wait_healthy(url: str, timeout_s: float) -> str | None:
    """Poll `url` until it answers 200; None when healthy, else the reason."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return None
                last = f"HTTP {resp.status}"
        except OSError as exc:
            last = str(exc)
        time.sleep(1.0)
    return f"{url} not healthy after {timeout_s:g} s ({last})"


async def _warm_up(verifier, attempts: list[dict], timeout_s: float) -> str | None:
    """Judge the warm-up attempts; None when every one passed, else why the sandbox is not ready."""
    from vrl.types import Attempt
    from vrl.verifier import verify_safely

    t0 = time.monotonic()
    verdicts = await verify_safely(verifier, [Attempt.model_validate(a) for a in attempts], timeout_s)
    failed = [v for v in verdicts if not v.passed]
    if failed:
        return f"the warm-up attempt did not pass ({failed[0].status.value}: {failed[0].detail[:300]})"
    log.info("warm-up: %d attempt(s) passed in %.1f s", len(verdicts), time.monotonic() - t0)
    return None


async def _ready(plugin: str, verifier) -> str | None:
    """The verifier's `check_ready()`; None when it is ready, else its message."""
    try:
        await verifier.check_ready()
    except Exception as exc:  # noqa: BLE001 - reported on ping: the pool and `vrl modal doctor` show it
        return f"the {plugin!r} verifier is not ready: {exc}"
    return None


def _options(items: list[str]) -> dict:
    """`KEY=VALUE` items (`-o`, `--warmup-option`) as one options dict, later items winning."""
    from vrl.config import parse_override

    options: dict = {}
    for item in items:
        options.update(parse_override(item))
    return options


async def _warm_up_with(plugin: str, options: dict, warmup_options: dict, verifier, attempts: list[dict],
                        timeout_s: float) -> str | None:
    """The warm-up, judged by the run's verifier, or, with warm-up options, by a verifier of its own built
    with them on top of the run's options (and closed after: what it warmed, such as a Lean server's REPLs,
    stays with the server)."""
    if not warmup_options:
        return await _warm_up(verifier, attempts, timeout_s)
    from vrl.plugins import registry

    try:
        warm = registry().environment(plugin, **{**options, **warmup_options}).verifier()
    except Exception as exc:  # noqa: BLE001 - the sandbox is then not ready, with the reason
        return f"cannot build the warm-up verifier: {type(exc).__name__}: {exc}"
    try:
        return await _warm_up(warm, attempts, timeout_s)
    finally:
        await warm.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plugin", required=True)
    parser.add_argument("-o", "--option", action="append", default=[])
    parser.add_argument("--wait-url")
    parser.add_argument("--wait-timeout", type=float, default=600.0)
    parser.add_argument("--batch-timeout", type=float, default=None)
    parser.add_argument("--warmup", default=None, help="JSON list of attempts that must pass before the first ping")
    parser.add_argument("--warmup-option", action="append", default=[],
                        help="KEY=VALUE: a verifier option for the warm-up only (e.g. a long per-attempt timeout)")
    args = parser.parse_args(argv)

    # Keep fd 1 for the protocol; everything else written to stdout lands on stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="verify_server: %(message)s")

    from vrl.plugins import registry
    from vrl.types import Attempt
    from vrl.verifier import verify_safely

    started = time.monotonic()

    options, warmup_options = _options(args.option), _options(args.warmup_option)
    loop = asyncio.new_event_loop()
    try:
        verifier = registry().environment(args.plugin, **options).verifier()
        error = None
    except Exception as exc:  # noqa: BLE001 - reported on ping, so the pool shows the reason instead of a dead pipe
        verifier, error = None, f"cannot build the {args.plugin!r} verifier: {type(exc).__name__}: {exc}"
    waited = False

    def reply(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")

    for line in sys.stdin:
        if not line.strip():  # a keep-alive
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError as exc:
            reply({"id": None, "error": f"bad request line: {exc}"})
            continue
        rid, op = req.get("id"), req.get("op")
        if op == "ping":
            if not waited and args.wait_url and error is None:
                error = _wait_healthy(args.wait_url, args.wait_timeout)
            if not waited and error is None:  # the plugin's own self-check names the cause (a sandbox it cannot make)
                error = loop.run_until_complete(_ready(args.plugin, verifier))
            if not waited and args.warmup and error is None:
                left = max(1.0, args.wait_timeout - (time.monotonic() - started))
                error = loop.run_until_complete(
                    _warm_up_with(args.plugin, options, warmup_options, verifier, json.loads(args.warmup), left))
            waited = True
            reply({"id": rid, "ok": error is None, **({"error": error} if error else {})})
        elif op == "verify":
            if verifier is None:
                reply({"id": rid, "error": error})
                continue
            attempts = [Attempt.model_validate(a) for a in req.get("attempts", [])]
            verdicts = loop.run_until_complete(verify_safely(verifier, attempts, args.batch_timeout))
            reply({"id": rid, "verdicts": [v.model_dump(mode="json") for v in verdicts]})
        else:
            reply({"id": rid, "error": f"unknown op {op!r}; expected ping or verify"})
    if verifier is not None:
        loop.run_until_complete(verifier.aclose())
    return 0


if __name__ == "__main__":
    sys.exit(main())
