"""`vrl report`: PNG plots and a self-contained HTML page comparing runs.

Reads only the run directories (metrics.jsonl, samples.jsonl, config.json, summary.json), so it
works on finished, interrupted and still-running runs alike.
"""

from __future__ import annotations

import base64
import html
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from vrl.rundir import read_jsonl  # noqa: E402

STATUSES = ("passed", "failed", "timeout", "crashed", "rejected")
STATUS_COLORS = {"passed": "#2ca02c", "failed": "#d62728", "timeout": "#ff7f0e", "crashed": "#7f7f7f", "rejected": "#9467bd"}
PHASES = (("generation_s", "generation"), ("verify_wait_s", "waiting for verifier"), ("update_s", "update"))


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.path.name} ({self.config.get('optimizer', '?')})"

    @classmethod
    def load(cls, path: str | Path) -> Run:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a vrl run directory (no config.json)")
        summary_path = path / "summary.json"
        return cls(
            path=path,
            config=json.loads((path / "config.json").read_text()),
            metrics=read_jsonl(path / "metrics.jsonl"),
            samples=read_jsonl(path / "samples.jsonl"),
            summary=json.loads(summary_path.read_text()) if summary_path.exists() else {"status": "unknown"},
        )


def _cumulative_tokens(run: Run) -> list[int]:
    total, out = 0, []
    for row in run.metrics:
        total += row["tokens"]
        out.append(total)
    return out


def plot_reward(runs: list[Run], path: Path, per_token: bool = False) -> Path:
    fig, (ax_r, ax_p) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        x = _cumulative_tokens(run) if per_token else [r["iteration"] + 1 for r in run.metrics]
        ax_r.plot(x, [r["reward_mean"] for r in run.metrics], marker="o", ms=3, label=run.label)
        ax_p.plot(x, [r["pass_rate"] for r in run.metrics], marker="o", ms=3, label=run.label)
    xlabel = "generated tokens (cumulative)" if per_token else "iteration"
    ax_r.set(title="mean reward", xlabel=xlabel, ylabel="reward")
    ax_p.set(title="pass rate", xlabel=xlabel, ylabel="fraction passed", ylim=(-0.02, 1.02))
    for ax in (ax_r, ax_p):
        ax.grid(alpha=0.3)
    ax_r.legend(fontsize=8)
    return _save(fig, path)


def plot_time(runs: list[Run], path: Path) -> Path:
    """Mean seconds per iteration by phase; verification busy time is drawn as a marker since it overlaps."""
    fig, ax = plt.subplots(figsize=(max(5, 2.2 * len(runs) + 3), 4))
    labels = [run.label for run in runs]
    bottoms = [0.0] * len(runs)
    for key, name in PHASES + (("other_s", "other (perturb, shape, log)"),):
        values = []
        for run in runs:
            rows = run.metrics or [{}]
            if key == "other_s":
                per = [r.get("loop_s", 0) - sum(r.get(k, 0) for k, _ in PHASES) for r in rows]
            else:
                per = [r.get(key, 0) for r in rows]
            values.append(max(0.0, sum(per) / len(per)))
        ax.bar(labels, values, bottom=bottoms, label=name)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    busy = [sum(r.get("verification_s", 0) for r in run.metrics) / max(1, len(run.metrics)) for run in runs]
    ax.scatter(labels, busy, color="black", marker="_", s=900, zorder=3, label="verifier busy (overlapped)")
    ax.set(title="time per iteration", ylabel="seconds")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_outcomes(runs: list[Run], path: Path) -> Path:
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6), squeeze=False)
    for ax, run in zip(axes[0], runs):
        x = [r["iteration"] + 1 for r in run.metrics]
        totals = [max(1, r["completions"]) for r in run.metrics]
        bottom = [0.0] * len(x)
        for status in STATUSES:
            frac = [r.get(f"status/{status}", 0) / t for r, t in zip(run.metrics, totals)]
            ax.bar(x, frac, bottom=bottom, color=STATUS_COLORS[status], label=status, width=0.9)
            bottom = [b + f for b, f in zip(bottom, frac)]
        ax.set(title=f"verdicts: {run.label}", xlabel="iteration", ylabel="fraction", ylim=(0, 1))
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def reasons(run: Run, top: int = 10) -> list[tuple[str, int]]:
    counts: Counter[str] = Counter()
    for row in run.metrics:
        counts.update(row.get("reasons", {}))
    return counts.most_common(top)


def best_attempts(run: Run, top: int = 5) -> list[dict[str, Any]]:
    return sorted(run.samples, key=lambda s: (-s["reward"], s["iteration"]))[:top]


def render(run_paths: list[str | Path], out: str | Path) -> Path:
    """Write reward.png, reward_per_token.png, time.png, outcomes.png and report.html into `out`."""
    runs = [Run.load(p) for p in run_paths]
    if not runs:
        raise ValueError("give at least one run directory")
    empty = [str(r.path) for r in runs if not r.metrics]
    if len(empty) == len(runs):
        raise ValueError(f"no finished iterations to report in {', '.join(empty)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    images = {
        "Reward and pass rate per iteration": plot_reward(runs, out / "reward.png"),
        "Reward and pass rate per generated token": plot_reward(runs, out / "reward_per_token.png", per_token=True),
        "Where the time goes": plot_time(runs, out / "time.png"),
        "Verifier outcomes": plot_outcomes(runs, out / "outcomes.png"),
    }
    (out / "report.html").write_text(_html(runs, images))
    return out / "report.html"


def _html(runs: list[Run], images: dict[str, Path]) -> str:
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>vrl report</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}"
        "pre{white-space:pre-wrap;max-width:600px;margin:0;font-size:12px}img{max-width:100%}",
        "</style></head><body><h1>vrl report</h1>",
        "<h2>Runs</h2><table><tr><th>run</th><th>plugin</th><th>model</th><th>optimizer</th><th>status</th>"
        "<th>iterations</th><th>reward first → last (best)</th><th>pass rate last</th><th>tokens</th><th>loop s</th></tr>",
    ]
    for run in runs:
        m = run.metrics
        reward = f"{m[0]['reward_mean']:.3f} → {m[-1]['reward_mean']:.3f} ({max(r['reward_mean'] for r in m):.3f})" if m else "–"
        parts.append(
            f"<tr><td>{e(run.path.name)}</td><td>{e(str(run.config.get('plugin')))}</td><td>{e(str(run.config.get('model')))}</td>"
            f"<td>{e(str(run.config.get('optimizer')))}</td><td>{e(str(run.summary.get('status')))}</td><td>{len(m)}</td>"
            f"<td>{reward}</td><td>{(m[-1]['pass_rate'] if m else 0):.1%}</td><td>{sum(r['tokens'] for r in m)}</td>"
            f"<td>{sum(r['loop_s'] for r in m):.1f}</td></tr>"
        )
    parts.append("</table>")
    for title, path in images.items():
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<h2>{e(title)}</h2><img alt='{e(title)}' src='data:image/png;base64,{data}'>")
    parts.append("<h2>Why attempts did not pass</h2>")
    for run in runs:
        rows = "".join(f"<tr><td>{e(reason)}</td><td>{count}</td></tr>" for reason, count in reasons(run))
        parts.append(f"<h3>{e(run.label)}</h3><table><tr><th>reason</th><th>count</th></tr>{rows}</table>")
    parts.append("<h2>Best attempts</h2>")
    for run in runs:
        parts.append(f"<h3>{e(run.label)}</h3><table><tr><th>iteration</th><th>task</th><th>reward</th><th>verdict</th><th>completion</th></tr>")
        for s in best_attempts(run):
            v = s["verdict"]
            parts.append(
                f"<tr><td>{s['iteration'] + 1}</td><td>{e(str(s['task_id']))}</td><td>{s['reward']:.3f}</td>"
                f"<td>{e(v['status'])}: {e(v['detail'])}</td><td><pre>{e(s['completion'])}</pre></td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)
