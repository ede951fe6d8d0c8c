"""`vrl report`: PNG plots and a self-contained HTML page comparing runs.

Reads only the run directories (metrics.jsonl, samples.jsonl, config.json, summary.json), so it
works on finished, interrupted and still-running runs alike.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from vrl.optim import optimizer_class  # noqa: E402
from vrl.rundir import read_jsonl  # noqa: E402

STATUSES = ("passed", "failed", "timeout", "crashed", "rejected")
STATUS_COLORS = {"passed": "#2ca02c", "failed": "#d62728", "timeout": "#ff7f0e", "crashed": "#7f7f7f", "rejected": "#9467bd"}
PHASES = (("generation_s", "generation"), ("verify_wait_s", "waiting for verifier"), ("update_s", "update"))
# Figures stay within these sizes (inches at DPI) however many runs are compared: labels are cut to
# LABEL_CHARS and the panels and bars shrink instead of the image growing.
DPI = 110
MAX_WIDTH_IN, MAX_HEIGHT_IN = 14.0, 16.0
LABEL_CHARS = 36
PANEL_COLUMNS = 4


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.path.name} ({self.method})"

    @property
    def method(self) -> str:
        """The update rule as it labels its own runs (`Optimizer.label` of the recorded section: low-rank
        ES adds its rank), so runs of different methods stay apart in a comparison."""
        name = self.config.get("optimizer", "?")
        try:
            rule = optimizer_class(name)
        except (LookupError, ValueError, ImportError):  # a rule not installed here: its name is all we know
            return name
        return rule.label(self.config.get(name) or {})

    @property
    def short_label(self) -> str:
        """The label cut in the middle to LABEL_CHARS: run names often differ only in their endings."""
        return shorten(self.label)

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


def shorten(text: str, limit: int = LABEL_CHARS) -> str:
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head):]


def _styles(n: int) -> list[dict[str, Any]]:
    """A distinct colour and line style per run: 10 colours × 4 line styles before anything repeats."""
    colors = plt.get_cmap("tab10").colors
    dashes = ("-", "--", ":", "-.")
    return [{"color": colors[i % 10], "linestyle": dashes[(i // 10) % 4]} for i in range(n)]


def plot_reward(runs: list[Run], path: Path, per_token: bool = False) -> Path:
    """Reward and pass rate curves; the legend goes below the axes, in columns, so it covers no curve."""
    legend_cols = max(1, min(3, math.ceil(len(runs) / 8)))
    legend_rows = math.ceil(len(runs) / legend_cols)
    fig, (ax_r, ax_p) = plt.subplots(
        1, 2, figsize=(11, min(MAX_HEIGHT_IN, 4 + 0.22 * legend_rows)), layout="constrained"
    )
    for run, style in zip(runs, _styles(len(runs))):
        # Iterations are counted from 1 here, as on the console (metrics.jsonl's `iteration` is 0-based).
        x = _cumulative_tokens(run) if per_token else [r["iteration"] + 1 for r in run.metrics]
        ax_r.plot(x, [r["reward_mean"] for r in run.metrics], marker="o", ms=3, label=run.short_label, **style)
        ax_p.plot(x, [r["pass_rate"] for r in run.metrics], marker="o", ms=3, **style)
    xlabel = "generated tokens (cumulative)" if per_token else "iteration (first = 1)"
    ax_r.set(title="mean reward", xlabel=xlabel, ylabel="reward")
    ax_p.set(title="pass rate", xlabel=xlabel, ylabel="fraction passed", ylim=(-0.02, 1.02))
    for ax in (ax_r, ax_p):
        ax.grid(alpha=0.3)
        if not per_token:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(loc="outside lower center", ncols=legend_cols, fontsize=8, frameon=False)
    return _save(fig, path)


def plot_time(runs: list[Run], path: Path) -> Path:
    """Mean seconds per iteration by phase, one horizontal bar per run (names stay readable however many);
    verification busy time is drawn as a marker since it overlaps the rest."""
    height = min(MAX_HEIGHT_IN, 1.6 + 0.32 * len(runs))
    fig, ax = plt.subplots(figsize=(11, height), layout="constrained")
    y = list(range(len(runs)))
    lefts = [0.0] * len(runs)
    for key, name in PHASES + (("other_s", "other (perturb, shape, log)"),):
        values = []
        for run in runs:
            rows = run.metrics or [{}]
            if key == "other_s":
                per = [r.get("loop_s", 0) - sum(r.get(k, 0) for k, _ in PHASES) for r in rows]
            else:
                per = [r.get(key, 0) for r in rows]
            values.append(max(0.0, sum(per) / len(per)))
        ax.barh(y, values, left=lefts, label=name, height=0.7)
        lefts = [b + v for b, v in zip(lefts, values)]
    busy = [sum(r.get("verification_s", 0) for r in run.metrics) / max(1, len(run.metrics)) for run in runs]
    ax.scatter(busy, y, color="black", marker="|", s=200, zorder=3, label="verifier busy (overlapped)")
    ax.set_yticks(y, [run.short_label for run in runs], fontsize=8 if len(runs) <= 24 else 6)
    ax.invert_yaxis()  # first run on top, as in the table of runs
    ax.set(title="time per iteration", xlabel="seconds (mean per iteration)")
    ax.grid(alpha=0.3, axis="x")
    fig.legend(loc="outside lower center", ncols=5, fontsize=8, frameon=False)
    return _save(fig, path)


def plot_outcomes(runs: list[Run], path: Path) -> Path:
    """Small multiples: one panel of verdict fractions per run, PANEL_COLUMNS to a row, one shared legend."""
    cols = min(PANEL_COLUMNS, len(runs))
    rows = math.ceil(len(runs) / cols)
    width = min(MAX_WIDTH_IN, max(6.0, 3.4 * cols))  # one run: wide enough for the legend
    height = min(MAX_HEIGHT_IN, 0.6 + 2.6 * rows)
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False, sharey=True, layout="constrained")
    flat = [ax for row in axes for ax in row]
    for ax, run in zip(flat, runs):
        x = [r["iteration"] + 1 for r in run.metrics]
        totals = [max(1, r["completions"]) for r in run.metrics]
        bottom = [0.0] * len(x)
        for status in STATUSES:
            frac = [r.get(f"status/{status}", 0) / t for r, t in zip(run.metrics, totals)]
            ax.bar(x, frac, bottom=bottom, color=STATUS_COLORS[status], label=status, width=0.9)
            bottom = [b + f for b, f in zip(bottom, frac)]
        ax.set_title(run.short_label, fontsize=8)
        ax.set(ylim=(0, 1))
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _label_grid(axes, flat, len(runs), "fraction")
    handles = [plt.Rectangle((0, 0), 1, 1, color=STATUS_COLORS[s]) for s in STATUSES]
    fig.legend(handles, STATUSES, loc="outside lower center", ncols=len(STATUSES), fontsize=8, frameon=False)
    fig.suptitle("verdicts per iteration", fontsize=10)
    return _save(fig, path)


def reward_functions(run: Run) -> list[str]:
    """The reward functions a run logged one by one (`reward/<name>/mean`, the dataset environment's)."""
    return sorted({k[len("reward/"):-len("/mean")] for m in run.metrics for k in m
                   if k.startswith("reward/") and k.endswith("/mean")})


def plot_reward_functions(runs: list[Run], path: Path) -> Path:
    """One panel per reward function: its mean over the completions it applied to, a line per run."""
    names = sorted({n for run in runs for n in reward_functions(run)})
    cols = min(PANEL_COLUMNS, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(min(MAX_WIDTH_IN, max(6.0, 3.6 * cols)), min(MAX_HEIGHT_IN, 1.0 + 2.8 * rows)),
                             squeeze=False, layout="constrained")
    flat = [ax for row in axes for ax in row]
    for ax, name in zip(flat, names):
        for run, style in zip(runs, _styles(len(runs))):
            points = [(r["iteration"] + 1, r[f"reward/{name}/mean"]) for r in run.metrics if f"reward/{name}/mean" in r]
            if points:
                ax.plot(*zip(*points), marker="o", ms=3, label=run.short_label, **style)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in flat[len(names):]:
        ax.set_visible(False)
    legend = {label: handle for ax in flat for handle, label in zip(*ax.get_legend_handles_labels())}
    handles, labels = list(legend.values()), list(legend)
    fig.legend(handles, labels, loc="outside lower center", ncols=min(3, max(1, len(labels))), fontsize=8, frameon=False)
    fig.suptitle("mean reward per function (over the completions it applied to)", fontsize=10)
    return _save(fig, path)


INFORMATIVE = (("filter/informative_frac", "groups with a non-constant outcome (grpo.filter_groups)"),
               ("es/informative_task_frac", "tasks whose members' rewards differ (es)"))


def informative(run: Run) -> bool:
    """Whether a run logged the share of its groups or tasks that carry signal (issue 58)."""
    return any(key in row for row in run.metrics for key, _ in INFORMATIVE)


def plot_informative(runs: list[Run], path: Path) -> Path:
    """The informative fraction per iteration, a line per run: the share of generated GRPO groups whose raw
    outcome differs (dynamic sampling), or of ES tasks whose members' rewards differ."""
    fig, ax = plt.subplots(figsize=(11, 4), layout="constrained")
    for run, style in zip(runs, _styles(len(runs))):
        for key, _ in INFORMATIVE:
            points = [(r["iteration"] + 1, r[key]) for r in run.metrics if key in r]
            if points:
                ax.plot(*zip(*points), marker="o", ms=3, label=run.short_label, **style)
    ax.set(title="informative fraction: " + "; ".join(what for _, what in INFORMATIVE), xlabel="iteration (first = 1)",
           ylabel="fraction", ylim=(-0.02, 1.02))
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    return _save(fig, path)


_TURN = re.compile(r"^episodes/pass_rate_turn_(\d+)$")


def turns(run: Run) -> list[int]:
    """The turns k a run logged `episodes/pass_rate_turn_k` for (multi-turn episodes), in order."""
    return sorted({int(m.group(1)) for row in run.metrics for k in row if (m := _TURN.match(k))})


def plot_turns(runs: list[Run], path: Path) -> Path:
    """Pass rate by turn: one panel per run with episodes, a line per turn k (the share of its episodes the
    environment passed at or before turn k), over the iterations."""
    shown = [run for run in runs if turns(run)]
    cols = min(PANEL_COLUMNS, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(min(MAX_WIDTH_IN, max(6.0, 3.6 * cols)), min(MAX_HEIGHT_IN, 1.2 + 2.8 * rows)),
                             squeeze=False, sharey=True, layout="constrained")
    flat = [ax for row in axes for ax in row]
    colors = plt.get_cmap("viridis")
    for ax, run in zip(flat, shown):
        ks = turns(run)
        for k in ks:
            key = f"episodes/pass_rate_turn_{k}"
            points = [(r["iteration"] + 1, r[key]) for r in run.metrics if key in r]
            ax.plot(*zip(*points), marker="o", ms=3, color=colors(k / (max(ks) + 1)), label=f"by turn {k}")
        ax.set_title(run.short_label, fontsize=8)
        ax.set(ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7, frameon=False)
    _label_grid(axes, flat, len(shown), "share of episodes passed")
    fig.suptitle("pass rate by turn (passed at or before turn k)", fontsize=10)
    return _save(fig, path)


def _label_grid(axes, flat, used: int, ylabel: str) -> None:
    """A grid of per-run panels: the unused ones hidden, iterations along the bottom row, `ylabel` on the left."""
    for ax in flat[used:]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("iteration (first = 1)", fontsize=8)
    for row in axes:
        row[0].set_ylabel(ylabel, fontsize=8)


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
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
    """Write reward.png, reward_per_token.png, time.png, outcomes.png and report.html into `out` (and
    reward_functions.png, informative.png and turns.png for runs that log what they plot)."""
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
    if any(reward_functions(run) for run in runs):
        images["Reward per function"] = plot_reward_functions(runs, out / "reward_functions.png")
    if any(informative(run) for run in runs):
        images["Informative fraction"] = plot_informative(runs, out / "informative.png")
    if any(turns(run) for run in runs):
        images["Pass rate by turn"] = plot_turns(runs, out / "turns.png")
    (out / "report.html").write_text(_html(runs, images))
    return out / "report.html"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Text with control bytes made visible: C0 as Unicode control pictures (␀, ␛, ...), DEL as ␡, C1 as �.

    Completions are model output; a stray escape or NUL would otherwise reach the page (browsers show
    some as nothing, some as boxes, and a NUL can end the text early in other tools). Tab and newline stay.
    """
    text = text.replace("\r\n", "\n")

    def visible(m: re.Match[str]) -> str:
        c = ord(m.group())
        return chr(0x2400 + c) if c < 0x20 else "\u2421" if c == 0x7F else "\ufffd"

    return _CONTROL.sub(visible, text)


# A verifier's derived metrics (`Environment.iteration_metrics`: lean/exploit_rate, lean/recheck_s_mean) are
# named for what they are; its per-attempt counters (`Verdict.metrics`, summed per iteration) are plain counts.
_RATE = re.compile(r"(_rate|_ratio|_fraction|_mean|_std|_min|_max|/mean|/std|/min|/max|_rate_turn_\d+)$")


def metric_kinds(run: Run) -> dict[str, list[str]]:
    """A run's named metrics (`a/b`), by how they add up over its iterations:

    - `counters`: the verifiers' counts (`Verdict.metrics` summed per iteration): summed over the run;
    - `rates`: the verifiers' rates and means (`Environment.iteration_metrics` derives them; the name
      ends in `_rate`, `_ratio`, `_fraction`, `_mean`, `_std`, `/mean`, ..., or `_rate_turn_k` as episodes'
      `episodes/pass_rate_turn_k`): a sum means nothing;
    - `statistics`: the update rule's own (`<optimizer>/...`: loss, grad_norm, learning_rate) and the
      loop's timings (`time/...`): a sum means nothing either.

    Status counts and reward functions have sections of their own."""
    rule = f"{run.config.get('optimizer', '?')}/"
    keys = sorted({k for m in run.metrics for k in m if "/" in k and not k.startswith(("status/", "reward/"))})
    kinds: dict[str, list[str]] = {"counters": [], "rates": [], "statistics": []}
    for k in keys:
        kind = "statistics" if k.startswith((rule, "time/")) else "rates" if _RATE.search(k) else "counters"
        kinds[kind].append(k)
    return kinds


def _values(run: Run, key: str) -> list[float]:
    return [float(m[key]) for m in run.metrics if isinstance(m.get(key), (int, float))]


def _metric_sections(runs: list[Run], e: Any) -> list[str]:
    """Verifier counters (summed over the run, and the last iteration's), verifier rates and the update
    rule's statistics (the mean over the run's iterations, and the last value), each under its own
    heading; and the integrity alarms a run stopped on."""
    sections = (("counters", "Verifier counters", "sum over the run", lambda v: sum(v)),
                ("rates", "Verifier rates", "mean over the run", lambda v: sum(v) / len(v)),
                ("statistics", "Optimizer statistics", "mean over the run", lambda v: sum(v) / len(v)))
    kinds = {id(run): metric_kinds(run) for run in runs}
    parts: list[str] = []
    for kind, title, total, fold in sections:
        body = []
        for run in runs:
            rows = "".join(f"<tr><td>{e(k)}</td><td>{fold(v):.4g}</td><td>{v[-1]:.4g}</td></tr>"
                           for k in kinds[id(run)][kind] if (v := _values(run, k)))
            if rows:
                body.append(f"<h3>{e(run.label)}</h3><table class='{kind}'><tr><th>metric</th><th>{total}</th>"
                            f"<th>last iteration</th></tr>{rows}</table>")
        if body:
            parts += [f"<h2>{title}</h2>", *body]
    for run in runs:
        alarms = run.path / "alarms.jsonl"
        if alarms.exists():
            lines = [json.loads(x) for x in alarms.read_text().splitlines() if x.strip()]
            first = e(lines[0]["alarm"]) if lines else ""
            parts.append(f"<h2>Integrity alarms</h2><h3>{e(run.label)}</h3>"
                         f"<p><b>{len(lines)} integrity alarm(s)</b> (alarms.jsonl); the first: {first}</p>")
    return parts


def _reward_function_table(runs: list[Run], e: Any) -> list[str]:
    """Each reward function's mean, first and last iteration, per run (TRL's `rewards/<name>/mean`)."""
    rows = []
    for run in runs:
        for name in reward_functions(run):
            means = [m[f"reward/{name}/mean"] for m in run.metrics if f"reward/{name}/mean" in m]
            applied = sum(float(m.get(f"reward/{name}/applied", 0)) for m in run.metrics)
            rows.append(f"<tr><td>{e(run.path.name)}</td><td>{e(name)}</td><td>{means[0]:.4g} → {means[-1]:.4g}</td>"
                        f"<td>{max(means):.4g}</td><td>{applied:.0f}</td></tr>")
    if not rows:
        return []
    return ["<h2>Reward functions</h2><table><tr><th>run</th><th>function</th><th>mean first → last</th><th>best</th>"
            "<th>completions scored</th></tr>", *rows, "</table>"]


def _html(runs: list[Run], images: dict[str, Path]) -> str:
    def e(text: str) -> str:
        return html.escape(printable(text))

    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>vrl report</title><style>",
        # Nothing scrolls sideways at any width down to a laptop's: long unbroken words (a run name, a
        # completion with no spaces) break anywhere, tables and images shrink to the page.
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;overflow-wrap:anywhere}"
        "table{border-collapse:collapse;margin:1em 0;max-width:100%}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top;overflow-wrap:anywhere}"
        "pre{white-space:pre-wrap;overflow-wrap:anywhere;max-width:600px;margin:0;font-size:12px}img{max-width:100%}",
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
    parts.extend(_reward_function_table(runs, e))
    parts.extend(_metric_sections(runs, e))
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
