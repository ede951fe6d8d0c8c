"""The `vrl` command line: train, eval, export, verify, config, report, plugins, modal.

The commands are registered like a plugin's (`vrl.builtin`'s `register_commands` adds `COMMANDS`),
so plugins add theirs the same way; the group collects them the first time it is asked for one.

Errors: a problem the user can fix (a `UsageError`, or a bad value found while checking the input)
prints one line, `error: what is wrong; how to fix it`, and exits with 2; anything else is
unexpected and exits with 1 (`vrl -v ...` shows its traceback). Ctrl-C exits with 130.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from vrl.errors import RunDirError, UsageError
from vrl.meta import DISTRIBUTION

console = Console(stderr=True, log_path=False)


class _LogHandler(RichHandler):
    """Rich's log lines on a terminal; in a file or pipe, one unwrapped line per record (`warning: ...`),
    as `error: ...` lines are: a log is grepped, not read at 80 columns."""

    def emit(self, record: logging.LogRecord) -> None:
        if self.console.is_terminal:
            return super().emit(record)
        try:
            text = self.format(record)
            stamp = self.formatter.formatTime(record, "%H:%M:%S") if self.formatter else ""
            self.console.print(f"[{stamp}] {record.levelname.lower()}: {text}", soft_wrap=True, highlight=False,
                               markup=False)
        except Exception:
            self.handleError(record)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[_LogHandler(console=console, show_path=False)],
        force=True,
    )
    for noisy in ("httpx", "urllib3", "transformers", "datasets", "filelock", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # huggingface_hub gives its logger a handler of its own and lets records propagate too, so each
    # of its warnings (a retry, say) printed twice; ours is the one handler.
    import huggingface_hub.utils.logging  # noqa: F401  (adds that handler on import: add it now, then drop it)

    hub = logging.getLogger("huggingface_hub")
    for handler in list(hub.handlers):
        if type(handler) is logging.StreamHandler:
            hub.removeHandler(handler)


def _fail(message: str, code: int = 2) -> None:
    """Print `error: ...` on one line (however the message was wrapped) and exit."""
    line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    console.print(f"[bold red]error:[/] {escape(line)}", soft_wrap=True, highlight=False)
    sys.exit(code)


@contextlib.contextmanager
def _checking_input() -> Iterator[None]:
    """While the input is checked (before any work), a failure is the user's to fix: a UsageError.

    Plugins and optional packages report setup problems as ValueError, LookupError, file errors or
    RuntimeError (a sink whose package is missing, say); a bug there still shows its traceback with -v.
    """
    try:
        yield
    except (UsageError, NotImplementedError, RecursionError):
        raise
    except (ValueError, LookupError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
            PermissionError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc


class _Main(click.Group):
    """The command group: turns errors into one line and an exit status (see the module docstring).

    Its commands come from the plugins' `register_commands` hooks (vrl's own from `vrl.builtin`),
    collected the first time the group is asked for its commands.
    """

    _collected = False

    @property
    def commands(self) -> dict[str, click.Command]:
        if not self._collected:
            self._collected = True  # before the hooks run: they add commands through this property
            from vrl.plugins import registry

            registry().add_commands(self)
        return self._commands

    @commands.setter
    def commands(self, value: dict[str, click.Command]) -> None:
        self._commands = value

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except UsageError as exc:
            if ctx.params.get("verbose"):
                console.print_exception()
            _fail(str(exc))
        except Exception as exc:
            if ctx.params.get("verbose"):
                console.print_exception()
                _fail(f"{type(exc).__name__}: {exc}", 1)
            _fail(f"{type(exc).__name__}: {exc} (unexpected; `vrl -v ...` shows the traceback)", 1)


def _options(pairs: tuple[str, ...], repeatable: bool = False) -> dict[str, Any]:
    """KEY=VALUE pairs (dotted keys allowed) merged into one nested mapping. With `repeatable` (an
    environment's -o options), a key given more than once collects its values into one list
    (`-o reward=a:f -o reward=b:g` → reward=[a:f, b:g]); otherwise the last one wins, as for --set."""
    from vrl.config import merge, parse_override  # here, not at the top: `vrl --help` needs none of it

    if repeatable:
        keys = [pair.partition("=")[0].strip() for pair in pairs]
        repeated = {k for k in keys if keys.count(k) > 1}
        collected: dict[str, list[Any]] = {}
        for key, pair in zip(keys, pairs):
            if key in repeated:
                value = next(iter(_leaves(parse_override(pair))))
                collected.setdefault(key, []).extend(value if isinstance(value, list) else [value])
        pairs = tuple(p for k, p in zip(keys, pairs) if k not in repeated)
        out = _options(pairs)
        for key, values in collected.items():
            node = out
            *parents, last = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = values
        return out
    out: dict[str, Any] = {}
    for pair in pairs:
        out = merge(out, parse_override(pair))
    return out


def _leaves(tree: Any) -> Any:
    """The values at the leaves of a nested mapping (one override has one)."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    else:
        yield tree


def _resolve_config(
    config_file: Path | None, flags: dict[str, Any], overrides: tuple[str, ...], env_options: tuple[str, ...], base: dict | None = None
):
    """`vrl.resolve_config` (the library's resolution too): defaults < environment defaults < base (resumed
    run) < file < flags < --set overrides (with -o options as `env_options`).

    A resumed run's recorded config (`base`) may use keys that have moved since (`vrl.config.MOVED`):
    it is migrated; the user's own layers must use the new keys (the error names them).
    """
    from vrl.config import merge, resolve_config  # here, not at the top: see `_options`

    set_layer = _options(overrides)
    if env_options:
        set_layer = merge(set_layer, {"env_options": _options(env_options, repeatable=True)})
    return resolve_config({k: v for k, v in flags.items() if v is not None}, file=config_file, overrides=set_layer, base=base)


def _environment_defaults(reg, plugin: str) -> dict[str, Any]:
    """Defaults declared on the registered factory (an Environment subclass's `defaults`), dotted keys."""
    factory = reg.factory("environments", plugin)
    return dict(getattr(factory, "defaults", {}) or {})


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name=DISTRIBUTION, prog_name="vrl", message="%(prog)s %(version)s (distribution %(package)s)")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """Verifier-backed reinforcement learning for language models.

    \b
    Quick start (offline, CPU, a few minutes):
      vrl train --plugin letters                 # the tiny model learns to write a-p, in seconds
      vrl train                                  # countdown, tiny model, ES
      vrl train --optimizer grpo --iterations 5
      vrl train --plugin lean --model AI-MO/Kimina-Prover-Preview-Distill-1.5B -o server=http://localhost:8000 -o recheck=http://localhost:8001
      vrl plugins                                # what is installed
    """
    _setup_logging(verbose)


_set_help = "Override any config field, e.g. --set sampling.temperature=0.7 --set es.sigma=0.002 (repeatable)."
_opt_help = "Environment option KEY=VALUE passed to the plugin, e.g. -o server=http://localhost:8000 (repeatable)."


def _run_options(command: Any) -> Any:
    """The options `vrl train` and `vrl config` share (one definition, so their help never drifts)."""
    options = [
        click.option("--plugin", "-p", help="Environment to train on (see `vrl plugins`). Default: countdown."),
        click.option("--optimizer", help="Update rule: es, grpo, or one a plugin registers (see `vrl plugins`). Default: es."),
        click.option("--model", "-m", help="Hugging Face id or local path; 'tiny' builds a small local model. Default: tiny."),
        click.option("--config", "config_file", type=click.Path(path_type=Path), help="YAML or TOML file with TrainConfig fields."),
        click.option("--iterations", "-n", type=int, help="Training iterations."),
        click.option("--name", help="Run name (directory under logging.runs_dir)."),
        click.option("--seed", type=int, help="Seeds task order, sampling and the optimizer (the `seed` field). Default: 0."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_set_help),
        click.option("-o", "--option", "env_options", multiple=True, metavar="KEY=VALUE", help=_opt_help),
        click.option("--runtime", help="Where generation and verification run: local, modal, or one a plugin registers. "
                     "Default: local."),
        click.option("--detach", is_flag=True, default=None,
                     help="With --runtime modal: run the loop itself on Modal (runtime.modal.detach; needs --name)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


_FLAG_OF = {"plugin": "--plugin", "optimizer": "--optimizer", "model": "--model", "iterations": "--iterations",
            "logging.name": "--name", "seed": "--seed", "runtime.kind": "--runtime", "runtime.modal.detach": "--detach"}


def _run_flags(plugin, optimizer, model, iterations, name, runtime, detach, seed=None) -> dict[str, Any]:
    """The shared flags as dotted config keys (None: not given)."""
    return {"plugin": plugin, "optimizer": optimizer, "model": model, "iterations": iterations, "logging.name": name,
            "seed": seed, "runtime.kind": runtime, "runtime.modal.detach": detach}


@click.command()
@_run_options
@click.option("--resume", type=click.Path(path_type=Path), help="Continue the run in this directory.")
def train(plugin, optimizer, model, config_file, iterations, name, seed, overrides, env_options, runtime, detach, resume) -> None:
    """Train a model against a verifier.

    Writes runs/<name>/ (config, metrics.jsonl, samples.jsonl, optimizer state, summary.json).
    Ctrl-C stops cleanly; --resume continues exactly where the run stopped.
    """
    from vrl.rundir import RunDir
    from vrl.runtime import make_runtime
    from vrl.trainer import Trainer

    flags = _run_flags(plugin, optimizer, model, iterations, name, runtime, detach, seed)
    run_dir = None
    try:
        with _checking_input():
            if resume:
                run_dir = RunDir.open(resume)
                run_dir.acquire()  # a live writer is refused before anything else happens
                fixed = [k for k, v in flags.items() if v is not None and k != "iterations"]
                if fixed or config_file:
                    given = ", ".join([_FLAG_OF[k] for k in fixed] + (["--config"] if config_file else []))
                    raise UsageError(f"--resume continues {resume} with its recorded config, so {given} cannot be "
                                     "given; only --iterations, --set and -o may change")
                cfg = _resolve_config(None, flags, overrides, env_options, base=run_dir.config())
                _check_resume_iterations(run_dir, cfg.iterations, iterations)
            else:
                cfg = _resolve_config(config_file, flags, overrides, env_options)
            if cfg.runtime.modal.detach:
                from vrl.runtime.modal.launch import launch_detached

                call = launch_detached(cfg)
                console.print(f"detached run {cfg.logging.name!r} started on Modal (call {call}); its run directory is "
                              f"runs/{cfg.logging.name} on the Volume {cfg.runtime.modal.volume!r}")
                return
            trainer = Trainer(cfg, run_dir=run_dir, console=console, runtime=make_runtime(cfg))
    except BaseException:
        if run_dir is not None:
            run_dir.release()
        raise
    try:
        summary = trainer.run()
    except UsageError as exc:  # e.g. the verifier went down: say what was kept
        raise UsageError(f"{exc}{_kept(trainer.run_dir)}") from exc
    if summary["status"] == "interrupted":
        sys.exit(130)


def _check_resume_iterations(run_dir, total: int, asked: int | None) -> None:
    """A resume must have iterations left: say how to extend a finished run instead of showing an empty bar."""
    done = run_dir.completed_iterations()
    if done < total:
        return
    if asked is None:
        raise RunDirError(f"run {run_dir.path} is finished ({done} of {total} iterations); extend it with "
                          f"`vrl train --resume {run_dir.path} --iterations N` with N > {done}")
    raise RunDirError(f"run {run_dir.path} has already finished {done} iterations, so --iterations {asked} adds none; "
                      f"pass --iterations N with N > {done}")


def _kept(run_dir) -> str:
    """What a failed run left: finished iterations (and how to continue), or nothing at all; nothing to say
    on a rank > 0 of a torchrun launch (`run_dir` None: rank 0 owns the run and says it)."""
    if run_dir is None:
        return ""
    if not (run_dir.path / "config.json").exists():
        return f" (nothing was kept: {run_dir.path} was removed)"
    done = run_dir.completed_iterations()
    return f" ({done} finished iterations are kept in {run_dir.path}; continue with `vrl train --resume {run_dir.path}`)"


@click.command(name="eval")
@click.option("--plugin", "-p", help="Environment (see `vrl plugins`). Default: countdown, or the run's with a run directory.")
@click.option("--model", "-m", help="Hugging Face id, local path, a run directory (its trained model), or 'tiny'.")
@click.option("--split", default="test", show_default=True, help="Environment split to evaluate on.")
@click.option("--k", "k", type=int, default=1, show_default=True,
              help="Samples per task; reports pass@j for j = 1, 2, 4, ... (powers of two) and k.")
@click.option("--limit", type=int, default=50, show_default=True, help="Tasks to evaluate (0: all).")
@click.option("--seed", type=int, help="Seeds sampling (the `seed` field). Default: 0.")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="YAML or TOML file with TrainConfig fields.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_set_help)
@click.option("-o", "--option", "env_options", multiple=True, metavar="KEY=VALUE", help=_opt_help)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def eval_(plugin, model, split, k, limit, seed, config_file, overrides, env_options, as_json) -> None:
    """Measure pass@k of a model on an environment split.

    --model may name a run directory: its trained model is exported to a temporary folder first
    (as `vrl export` does) and the run's plugin is the default.
    """
    import tempfile

    from vrl.evaluate import evaluate
    from vrl.export import export_run, is_run_dir
    from vrl.plugins import registry

    if k < 1:
        raise UsageError("--k must be at least 1")
    with tempfile.TemporaryDirectory(prefix="vrl-eval-") as tmp:
        shown = model
        with _checking_input():
            if model and is_run_dir(model):
                plugin = plugin or json.loads((Path(model) / "config.json").read_text())["plugin"]
                info = export_run(model, Path(tmp) / "model")
                console.print(f"evaluating {model} (iteration {info['iteration']}, {info['optimizer']})")
                model = info["out"]
            cfg = _resolve_config(config_file, {"plugin": plugin, "model": model, "seed": seed}, overrides, env_options)
            env = registry().environment(cfg.plugin, **cfg.env_options)
        # evaluate checks the split, the model and the verifier before it generates anything
        report = evaluate(cfg, split=split, k=k, limit=limit or None, console=console, environment=env)
        cfg.model = shown or cfg.model
    if as_json:
        click.echo(json.dumps(report))
        return
    table = Table(title=f"{cfg.plugin} / {split} / {cfg.model}: {report['tasks']} tasks × {k} samples")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report["pass_at"].items():
        table.add_row(f"pass@{key}", f"{value:.3f}")
    for status, count in report["statuses"].items():
        table.add_row(f"verdicts {status}", str(count))
    Console().print(table)


@click.command()
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="New (or empty) directory for the model.")
@click.option("--device", default="auto", show_default=True, help="Where to rebuild the weights: auto (a GPU if any), cpu, cuda.")
def export(run, out, device) -> None:
    """Write a run's trained model as a Hugging Face model folder (weights, config, tokenizer).

    \b
      vrl export runs/countdown-es-20250101-120000 --out models/countdown-es
      vrl eval --model models/countdown-es          # or AutoModelForCausalLM.from_pretrained(...)

    ES replays the run's history onto its base model; GRPO takes its newest checkpoint, with a LoRA
    adapter merged into the base weights. See docs/cli.md.
    """
    from vrl.export import export_run

    with _checking_input():  # not a run, no finished iteration, --out taken: the user's to fix
        info = export_run(run, out, device=device)
    console.print(f"wrote {info['out']}: {info['optimizer']} after iteration {info['iteration']} of {run} "
                  f"(base {info['base_model']}{', LoRA merged' if info.get('lora') else ''})")


@click.command()
@click.argument("attempts", type=click.Path(path_type=Path, allow_dash=True))
@click.option("--plugin", "-p", default="countdown", show_default=True, help="Environment whose verifier judges.")
@click.option("--split", "splits", multiple=True, help="Splits searched for task ids (default: all).")
@click.option("--out", type=click.Path(path_type=Path, allow_dash=True), default="-", help="Where verdicts go (default stdout).")
@click.option("-o", "--option", "env_options", multiple=True, metavar="KEY=VALUE", help=_opt_help)
@click.option("--server", help="Verifier server URL; shorthand for -o server=URL (e.g. a kimina-lean-server).")
def verify(attempts, plugin, splits, out, env_options, server) -> None:
    """Score ready-made attempts without a model.

    ATTEMPTS is JSONL (or - for stdin); each line names a task and carries a completion:

    \b
      {"task_id": "train-3", "completion": "<answer>(1 + 2) * 3</answer>"}
      {"task": {"numbers": [3, 5, 7], "target": 22}, "completion": "<answer>3 * 5 + 7</answer>"}

    One verdict per line comes out, in input order. A malformed line gets a `rejected` verdict that
    names the problem; it never stops the others. See docs/cli.md for the format.
    """
    from vrl.plugins import registry
    from vrl.rundir import write_text
    from vrl.verifier import ensure_ready
    from vrl.verify_file import verify_lines

    # Every check before the first verdict: a bad --out found afterwards would lose them all.
    with _checking_input():
        options = _options(env_options, repeatable=True)
        if server:
            options["server"] = server
        env = registry().environment(plugin, **options)
        if str(out) != "-":
            _check_writable(Path(out))
        if str(attempts) != "-" and not attempts.is_file():
            raise UsageError(f"attempts file not found: {attempts}")
        ensure_ready(env.verifier())
    text = sys.stdin.read() if str(attempts) == "-" else attempts.read_text()
    rows = asyncio.run(verify_lines(env, text.splitlines(), splits=splits or None))
    payload = "".join(json.dumps(r) + "\n" for r in rows)
    if str(out) == "-":
        click.echo(payload, nl=False)
    else:
        write_text(Path(out), payload)
    passed = sum(r["passed"] for r in rows)
    others = Counter(r["status"] for r in rows if not r["passed"])
    detail = f" ({', '.join(f'{n} {status}' for status, n in others.most_common())})" if others else ""
    console.print(f"{passed}/{len(rows)} passed{detail}")


def _check_writable(out: Path) -> None:
    """`--out FILE` can be written: its folder exists and is writable, and it is not a directory."""
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file path such as {out / 'verdicts.jsonl'}")
    if not parent.is_dir():
        raise UsageError(f"--out {out}: the directory {parent} does not exist; create it first or choose another path")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise UsageError(f"--out {out} is not writable; choose another path")


@click.command()
@_run_options
@click.option("--fields", is_flag=True, help="Print every field, grouped by section (markdown), instead.")
def config(plugin, optimizer, model, config_file, iterations, name, seed, overrides, env_options, runtime, detach, fields) -> None:
    """Print the resolved configuration as YAML: what `vrl train` with the same flags would use.

    Takes train's flags except --resume (a resumed run's configuration is runs/NAME/config.json).
    """
    import yaml

    from vrl.config import dump, field_table

    if fields:
        click.echo(field_table(), nl=False)
        return
    with _checking_input():
        flags = _run_flags(plugin, optimizer, model, iterations, name, runtime, detach, seed)
        cfg = _resolve_config(config_file, flags, overrides, env_options)
    click.echo(yaml.safe_dump(dump(cfg), sort_keys=False), nl=False)


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), default=Path("report"), show_default=True,
              help="Directory for the PNG plots and report.html.")
def report(runs, out) -> None:
    """Plots and a self-contained HTML page comparing run directories.

    \b
      vrl report runs/countdown-es-* runs/countdown-grpo-* --out report/
    """
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory (it gets report.html and the plots)")
    from vrl.report import render

    with _checking_input():
        page = render(list(runs), out)
    console.print(f"wrote {page} and {len(list(Path(out).glob('*.png')))} plots")


@click.group()
def modal() -> None:
    """Run on Modal: prepare the Volume once, then `vrl train --runtime modal` (docs/modal.md)."""


@modal.command()
@click.option("--model", "-m", required=True,
              help="Hugging Face model id, a GGUF file or a local model folder to put on the Volume.")
@click.option("--revision", help="Branch, tag or commit (default: main).")
@click.option("--secret", "secrets", multiple=True, help="Modal Secret name to mount, e.g. huggingface (repeatable).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="runtime.modal.* overrides, e.g. runtime.modal.volume=vrl2.")
@click.option("--quiet", "-q", is_flag=True, help="Hide Modal's image build and container output.")
def prepare(model, revision, secrets, overrides, quiet) -> None:
    """Put base weights and tokenizer on the Modal Volume once (a Hub id is downloaded there; a GGUF file or a
    model folder is uploaded from here); workers load them from there."""
    from vrl.runtime.modal.launch import prepare as run_prepare

    with _checking_input():
        cfg = _resolve_config(None, {"model": model, "runtime.kind": "modal", "runtime.modal.output": not quiet,
                                     "runtime.modal.secrets": list(secrets) or None}, overrides, ())
    with _checking_input():  # Modal's own refusals (no token, no such model) are the user's to fix
        info = run_prepare(cfg, model, revision)
    console.print(f"{model}: {len(info['files'])} files, {info['bytes'] / 1e9:.2f} GB on Volume "
                  f"{cfg.runtime.modal.volume!r} ({_prepared(info)})")


def _prepared(info: dict) -> str:
    if not info["downloaded"]:
        return "already there"
    return "uploaded" if info.get("uploaded") else "downloaded"


@modal.command(name="resume")
@click.argument("name")
@click.option("--iterations", "-n", type=int, help="Train up to this many iterations (default: the recorded number).")
@click.option("--volume", default="vrl", show_default=True, help="The Modal Volume the run lives on.")
@click.option("--quiet", "-q", is_flag=True, help="Hide Modal's image build and container output.")
def modal_resume(name, iterations, volume, quiet) -> None:
    """Continue a detached run on Modal from its run directory on the Volume (runs/NAME)."""
    from vrl.runtime.modal.launch import resume_detached

    with _checking_input():  # no account, no such run: the user's to fix
        call, cfg = resume_detached(name, volume=volume, iterations=iterations, output=not quiet)
    console.print(f"detached run {name!r} resumed on Modal up to iteration {cfg.iterations} (call {call}); "
                  f"its run directory is runs/{name} on the Volume {volume!r}")


@modal.command(name="status")
@click.argument("name")
@click.option("--volume", default="vrl", show_default=True, help="The Modal Volume the run lives on.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a line.")
def modal_status(name, volume, as_json) -> None:
    """Where a detached run stands: the call that owns it, iterations finished, its last metrics."""
    from vrl.runtime.modal.launch import format_metrics, run_status

    with _checking_input():
        info = run_status(name, volume)
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    owner = f"running (call {info['call']})" if info["running"] else f"not running ({info['status'] or 'never started'})"
    last = f"; last {format_metrics(info['last'])}" if info["last"] else ""
    console.print(f"{name}: {owner}, {info['iterations_completed']}/{info['iterations']} iterations{last}")
    if info["error"]:
        console.print(f"error: {escape(info['error'])}")


@modal.command(name="logs")
@click.argument("name")
@click.option("--volume", default="vrl", show_default=True, help="The Modal Volume the run lives on.")
def modal_logs(name, volume) -> None:
    """The iterations a detached run finished (as committed to the Volume), and how it ended."""
    from vrl.runtime.modal.launch import run_logs

    with _checking_input():
        lines = run_logs(name, volume)
    for line in lines:
        click.echo(line)


@modal.command(name="stop")
@click.argument("name")
@click.option("--volume", default="vrl", show_default=True, help="The Modal Volume the run lives on.")
def modal_stop(name, volume) -> None:
    """Stop a detached run (finished iterations stay on the Volume; `vrl modal resume NAME` continues it)."""
    from vrl.runtime.modal.launch import stop_run

    with _checking_input():
        call = stop_run(name, volume)
    console.print(f"stopped {name!r} (call {call}); continue it with `vrl modal resume {name}`" if call
                  else f"{name!r} is not running; nothing to stop")


@modal.command(name="doctor")
@click.option("--plugin", "-p", help="The plugin whose verifier sandbox to start (default: the run's, countdown).")
@click.option("--model", "-m", help="The model a run would use (its name goes into the probe's config).")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="YAML or TOML file with TrainConfig fields.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Overrides, e.g. runtime.modal.gpu=A100-80GB (check the settings the run will use).")
@click.option("--quiet", "-q", is_flag=True, help="Hide Modal's image build and container output.")
def modal_doctor(plugin, model, config_file, overrides, quiet) -> None:
    """Check a Modal account before a long run, for cents: images, GPU, Volume, handles, a verifier sandbox."""
    from vrl.runtime.modal.doctor import run as run_doctor

    with _checking_input():
        cfg = _resolve_config(config_file, {"plugin": plugin, "model": model, "runtime.kind": "modal",
                                            "runtime.modal.output": not quiet}, overrides, ())
    with _checking_input():
        checks = run_doctor(cfg, say=lambda line: console.print(escape(line), soft_wrap=True, highlight=False))
    failed = [c for c in checks if not c.ok]
    total = sum(c.cents for c in checks)
    console.print(f"{len(checks) - len(failed)}/{len(checks)} checks passed in {sum(c.seconds for c in checks):.0f} s, "
                  f"{total:.1f} ¢ at list prices")
    if failed:
        sys.exit(1)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins(as_json: bool) -> None:
    """List installed plugins, their versions and what they register.

    `VRL_PLUGINS=a,b` loads only those plugins (`VRL_PLUGINS=` none: the built-ins alone).
    """
    from vrl.plugins import KINDS, registry

    reg = registry().collect_all()
    infos = list(reg.plugins.values())
    if as_json:
        click.echo(json.dumps([vars(i) for i in infos], indent=2))
        return
    table = Table(title="vrl plugins")
    for col in ("plugin", "distribution", "version", "registers", "status"):
        table.add_column(col, overflow="fold")  # a narrow terminal wraps names; it never cuts them
    labels = {**KINDS, "commands": "command"}
    for info in infos:
        status = f"[red]failed: {escape(info.error)}" if info.error else "[green]ok"
        registers = "\n".join(f"{labels[kind]}: {', '.join(names)}" for kind, names in info.registered.items() if names)
        table.add_row(info.name, info.distribution or "", info.version or "", registers, status)
    Console().print(table)
    for conflict in reg.conflicts:
        console.print(f"[yellow]warning:[/] {escape(conflict)}")


#: The built-in commands, added to the group by `vrl.builtin`'s `register_commands` (as a plugin adds its own).
COMMANDS = (train, eval_, export, verify, config, report, modal, plugins)


if __name__ == "__main__":  # pragma: no cover
    # `python -m vrl.cli`: run the group of the importable module, the one `vrl.builtin` adds COMMANDS to.
    from vrl.cli import main as _main

    _main()
