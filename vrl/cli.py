"""The `vrl` command line: train, eval, verify, plugins."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from vrl.config import ConfigError, build, load_file, merge, nest, parse_override
from vrl.meta import DISTRIBUTION

console = Console(stderr=True, log_path=False)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
        force=True,
    )
    for noisy in ("httpx", "urllib3", "transformers", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    sys.exit(2)


def _options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """KEY=VALUE pairs (dotted keys allowed) merged into one nested mapping."""
    out: dict[str, Any] = {}
    for pair in pairs:
        out = merge(out, parse_override(pair))
    return out


def _resolve_config(
    config_file: Path | None, flags: dict[str, Any], overrides: tuple[str, ...], env_options: tuple[str, ...], base: dict | None = None
):
    """Layers: defaults < environment defaults < base (resumed run) < file < flags < --set overrides."""
    from vrl.plugins import registry

    file_layer = load_file(config_file) if config_file else {}
    flag_layer = nest({k: v for k, v in flags.items() if v is not None})
    set_layer = _options(overrides)
    if env_options:
        set_layer = merge(set_layer, {"env_options": _options(env_options)})
    upper = merge(merge(merge(base or {}, file_layer), flag_layer), set_layer)
    plugin = upper.get("plugin", "countdown")
    # A resumed run already carries its resolved defaults.
    env_defaults = {} if base else nest(_environment_defaults(registry(), plugin))
    return build(env_defaults, upper)


def _environment_defaults(reg, plugin: str) -> dict[str, Any]:
    """Defaults declared on the registered factory (an Environment subclass's `defaults`)."""
    factory = reg.factory("environments", plugin)
    return dict(getattr(factory, "defaults", {}) or {})


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name=DISTRIBUTION, prog_name="vrl", message="%(prog)s %(version)s (distribution %(package)s)")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """Verifier-backed reinforcement learning for language models.

    \b
    Quick start (offline, CPU, a few minutes):
      vrl train                                  # countdown, tiny model, ES
      vrl train --optimizer grpo --iterations 5
      vrl train --plugin lean --model AI-MO/Kimina-Prover-Preview-Distill-1.5B -o server=http://localhost:8000
      vrl plugins                                # what is installed
    """
    _setup_logging(verbose)


_set_help = "Override any config field, e.g. --set sampling.temperature=0.7 --set es.sigma=0.002 (repeatable)."
_opt_help = "Environment option KEY=VALUE passed to the plugin, e.g. -o server=http://localhost:8000 (repeatable)."


@main.command()
@click.option("--plugin", "-p", help="Environment to train on (see `vrl plugins`). Default: countdown.")
@click.option("--optimizer", type=click.Choice(["es", "grpo"]), help="Update rule. Default: es.")
@click.option("--model", "-m", help="Hugging Face id or local path; 'tiny' builds a small local model. Default: tiny.")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="YAML or TOML file with TrainConfig fields.")
@click.option("--iterations", "-n", type=int, help="Training iterations.")
@click.option("--name", help="Run name (directory under logging.runs_dir).")
@click.option("--resume", type=click.Path(path_type=Path), help="Continue the run in this directory.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_set_help)
@click.option("-o", "--option", "env_options", multiple=True, metavar="KEY=VALUE", help=_opt_help)
@click.option("--runtime", type=click.Choice(["local", "modal"]), help="Where generation and verification run. Default: local.")
@click.option("--detach", is_flag=True, default=None, help="With --runtime modal: run the loop itself on Modal (needs --name).")
def train(plugin, optimizer, model, config_file, iterations, name, resume, overrides, env_options, runtime, detach) -> None:
    """Train a model against a verifier.

    Writes runs/<name>/ (config, metrics.jsonl, samples.jsonl, optimizer state, summary.json).
    Ctrl-C stops cleanly; --resume continues exactly where the run stopped.
    """
    from vrl.plugins import UnknownNameError
    from vrl.rundir import RunDir
    from vrl.trainer import Trainer

    flags = {"plugin": plugin, "optimizer": optimizer, "model": model, "iterations": iterations, "logging.name": name,
             "runtime.kind": runtime, "runtime.detach": detach}
    try:
        if resume:
            run_dir = RunDir.open(resume)
            base = run_dir.config()
            fixed = {k: v for k, v in flags.items() if v is not None and k not in ("iterations",)}
            if fixed or config_file:
                _fail(f"--resume continues {resume} with its recorded config; only --iterations and --set may change")
            cfg = _resolve_config(None, flags, overrides, env_options, base=base)
        else:
            cfg = _resolve_config(config_file, flags, overrides, env_options)
            run_dir = None
        if cfg.runtime.detach:
            from vrl.runtime.modal.launch import launch_detached

            call = launch_detached(cfg)
            console.print(f"detached run {cfg.logging.name!r} started on Modal (call {call}); its run directory is "
                          f"runs/{cfg.logging.name} on the Volume {cfg.runtime.volume!r}")
            return
        trainer = Trainer(cfg, run_dir=run_dir, console=console)
    except (ConfigError, UnknownNameError, FileExistsError, FileNotFoundError, ValueError, RuntimeError) as exc:
        _fail(str(exc))
    summary = trainer.run()
    if summary["status"] == "interrupted":
        sys.exit(130)


@main.command(name="eval")
@click.option("--plugin", "-p", help="Environment (see `vrl plugins`). Default: countdown.")
@click.option("--model", "-m", help="Hugging Face id or local path; 'tiny' builds a small local model.")
@click.option("--split", default="test", show_default=True, help="Environment split to evaluate on.")
@click.option("--k", "k", type=int, default=1, show_default=True,
              help="Samples per task; reports pass@j for j = 1, 2, 4, ... (powers of two) and k.")
@click.option("--limit", type=int, default=50, show_default=True, help="Tasks to evaluate (0: all).")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="YAML or TOML file with TrainConfig fields.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_set_help)
@click.option("-o", "--option", "env_options", multiple=True, metavar="KEY=VALUE", help=_opt_help)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def eval_(plugin, model, split, k, limit, config_file, overrides, env_options, as_json) -> None:
    """Measure pass@k of a model on an environment split."""
    from vrl.evaluate import evaluate
    from vrl.plugins import UnknownNameError

    if k < 1:
        _fail("--k must be at least 1")
    try:
        cfg = _resolve_config(config_file, {"plugin": plugin, "model": model}, overrides, env_options)
        report = evaluate(cfg, split=split, k=k, limit=limit or None, console=console)
    except (ConfigError, UnknownNameError, ValueError) as exc:
        _fail(str(exc))
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


@main.command()
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
    from vrl.plugins import UnknownNameError, registry
    from vrl.verify_file import verify_lines

    try:
        options = _options(env_options)
        if server:
            options["server"] = server
        env = registry().environment(plugin, **options)
    except (UnknownNameError, ConfigError, ValueError, TypeError) as exc:
        _fail(str(exc))
    text = sys.stdin.read() if str(attempts) == "-" else _read(attempts)
    rows = asyncio.run(verify_lines(env, text.splitlines(), splits=splits or None))
    payload = "".join(json.dumps(r) + "\n" for r in rows)
    if str(out) == "-":
        click.echo(payload, nl=False)
    else:
        Path(out).write_text(payload)
    passed = sum(r["passed"] for r in rows)
    console.print(f"{passed}/{len(rows)} passed")


def _read(path: Path) -> str:
    if not path.is_file():
        _fail(f"attempts file not found: {path}")
    return path.read_text()


@main.command()
@click.option("--plugin", "-p", help="Environment whose defaults apply. Default: countdown.")
@click.option("--optimizer", type=click.Choice(["es", "grpo"]), help="Update rule.")
@click.option("--model", "-m", help="Model id or path.")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="YAML or TOML file with TrainConfig fields.")
@click.option("--iterations", "-n", type=int, help="Training iterations.")
@click.option("--name", help="Run name (directory under logging.runs_dir).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_set_help)
@click.option("-o", "--option", "env_options", multiple=True, metavar="KEY=VALUE", help=_opt_help)
@click.option("--runtime", type=click.Choice(["local", "modal"]), help="Where generation and verification run.")
@click.option("--detach", is_flag=True, default=None, help="With --runtime modal: the loop itself runs on Modal.")
@click.option("--fields", is_flag=True, help="Print the table of all fields (markdown) instead.")
def config(plugin, optimizer, model, config_file, iterations, name, overrides, env_options, runtime, detach, fields) -> None:
    """Print the resolved configuration as YAML: what `vrl train` with the same flags would use.

    Takes train's flags except --resume (a resumed run's configuration is runs/NAME/config.json).
    """
    import yaml

    from vrl.config import dump, field_table
    from vrl.plugins import UnknownNameError

    if fields:
        click.echo(field_table(), nl=False)
        return
    try:
        flags = {"plugin": plugin, "optimizer": optimizer, "model": model, "iterations": iterations, "logging.name": name,
                 "runtime.kind": runtime, "runtime.detach": detach}
        cfg = _resolve_config(config_file, flags, overrides, env_options)
    except (ConfigError, UnknownNameError) as exc:
        _fail(str(exc))
    click.echo(yaml.safe_dump(dump(cfg), sort_keys=False), nl=False)


@main.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), default=Path("report"), show_default=True,
              help="Directory for the PNG plots and report.html.")
def report(runs, out) -> None:
    """Plots and a self-contained HTML page comparing run directories.

    \b
      vrl report runs/countdown-es-* runs/countdown-grpo-* --out report/
    """
    from vrl.report import render

    try:
        page = render(list(runs), out)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    console.print(f"wrote {page} and {len(list(Path(out).glob('*.png')))} plots")


@main.group()
def modal() -> None:
    """Run on Modal: prepare the Volume once, then `vrl train --runtime modal` (docs/modal.md)."""


@modal.command()
@click.option("--model", "-m", required=True, help="Hugging Face model id to put on the Volume.")
@click.option("--revision", help="Branch, tag or commit (default: main).")
@click.option("--secret", "secrets", multiple=True, help="Modal Secret name to mount, e.g. huggingface (repeatable).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="runtime.* overrides, e.g. runtime.volume=vrl2.")
def prepare(model, revision, secrets, overrides) -> None:
    """Download base weights and tokenizer onto the Modal Volume once; workers load them from there."""
    from vrl.runtime.modal.launch import prepare as run_prepare

    try:
        cfg = _resolve_config(None, {"model": model, "runtime.kind": "modal",
                                     "runtime.secrets": list(secrets) or None}, overrides, ())
        info = run_prepare(cfg, model, revision)
    except (ConfigError, RuntimeError, ValueError) as exc:
        _fail(str(exc))
    console.print(f"{model}: {len(info['files'])} files, {info['bytes'] / 1e9:.2f} GB on Volume "
                  f"{cfg.runtime.volume!r} ({'downloaded' if info['downloaded'] else 'already there'})")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins(as_json: bool) -> None:
    """List installed plugins, their versions and what they register."""
    from vrl.plugins import registry

    reg = registry()
    infos = list(reg.plugins.values())
    if as_json:
        click.echo(json.dumps([vars(i) for i in infos], indent=2))
        return
    table = Table(title="vrl plugins")
    for col in ("plugin", "distribution", "version", "environments", "verifiers", "shapers", "status"):
        table.add_column(col, overflow="fold")  # a narrow terminal wraps names; it never cuts them
    for info in infos:
        status = f"[red]failed: {info.error}" if info.error else "[green]ok"
        table.add_row(
            info.name,
            info.distribution or "",
            info.version or "",
            "\n".join(info.registered["environments"]),
            "\n".join(info.registered["verifiers"]),
            "\n".join(info.registered["shapers"]),
            status,
        )
    Console().print(table)
    for conflict in reg.conflicts:
        console.print(f"[yellow]warning:[/] {conflict}")


if __name__ == "__main__":  # pragma: no cover
    main()
