"""What `vrl train` shows: timestamped lines, the two-line progress bar, the per-iteration line and
the closing summary table. The trainer decides what happened; this module only renders it."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

SUMMARY_KEYS = ("iterations_completed", "reward_first", "reward_last", "reward_best", "pass_rate_last",
                "tokens_total", "generation_s_total", "verification_s_total", "loop_s_total")


def log(console: Console, text: str) -> None:
    """A timestamped line: wrapped to a terminal's width, but one line in a file or pipe (logs are grepped)."""
    if console.is_terminal:
        console.log(text)
    else:
        console.print(f"[{datetime.now():%H:%M:%S}] {text}", soft_wrap=True, highlight=False)


def start(console: Console, run_dir: Path, plugin: str, model: str, optimizer: str, iterations: int) -> None:
    console.print(f"[bold]vrl train[/] run [cyan]{run_dir}[/] · plugin {plugin} · model {model} · "
                  f"optimizer {optimizer} · {iterations} iterations", soft_wrap=True)


def progress(console: Console, first: int) -> Progress:
    """Bar, i/N, elapsed and ETA on one line; the stats on a line of their own, cut to the width.
    `first` is the iteration this session starts at: the ETA counts only iterations run since."""
    return _TwoLineProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=None),  # shares what the fixed columns leave; rich drops nothing at 80 columns
        MofNCompleteColumn(),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        _EtaColumn(first),
        console=console,
        transient=False,
    )


def summary(console: Console, summary: dict[str, Any], run_dir: Path) -> None:
    table = Table(title=f"run {summary['name']} — {summary['status']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in SUMMARY_KEYS:
        if key in summary:
            value = summary[key]
            table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    for note in summary.get("notes", []):
        table.add_row("note", note)
    table.add_row("run directory", str(run_dir))
    console.print(table)


def short(m: dict[str, Any]) -> str:
    """The live stats under the bar."""
    return f"reward {m['reward_mean']:.3f} · pass {m['pass_rate']:.1%} · {m['tokens_per_s']:.0f} tok/s"


def line(m: dict[str, Any]) -> str:
    """One iteration's line in the log."""
    return (
        f"iter {m['iteration'] + 1}: reward {m['reward_mean']:.3f} (max {m['reward_max']:.3f}), "
        f"pass {m['pass_rate']:.1%}, {m['completions']} attempts, {m['tokens']} tokens, "
        f"gen {m['generation_s']:.1f}s, verify {m['verification_s']:.1f}s (waited {m['verify_wait_s']:.1f}s), "
        f"update {m['update_s']:.1f}s, loop {m['loop_s']:.1f}s"
    )


class _TwoLineProgress(Progress):
    """A progress display whose `stats` field goes on a second line, so long stats never push the bar,
    the counts or the times off a narrow terminal (rich shrinks a one-line table's columns to fit)."""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            yield Text("  " + str(task.fields.get("stats", "")), no_wrap=True, overflow="ellipsis", style="dim")


class _EtaColumn(ProgressColumn):
    """Time left, from the mean time of the iterations run in this session (not those before a resume)."""

    def __init__(self, first: int):
        super().__init__()
        self.first = first

    def render(self, task) -> Text:
        done = task.completed - self.first
        if task.finished or task.total is None:
            return Text("eta 0:00:00" if task.finished else "eta -:--:--", style="cyan")
        if done <= 0 or not task.elapsed:
            return Text("eta -:--:--", style="cyan")
        left = int(task.elapsed / done * (task.total - task.completed))
        return Text(f"eta {left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}", style="cyan")
