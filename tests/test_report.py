"""vrl report renders plots and an HTML page from real (short) runs, including an interrupted one."""

import base64
import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from vrl.cli import main
from vrl.config import build
from vrl.envs.letters import LettersEnvironment
from vrl.trainer import Trainer


def short_run(tmp_path, name, stop_after=None, **overrides):
    layer = {
        "iterations": 3, "tasks_per_iteration": 4,
        "sampling": {"max_new_tokens": 8}, "es": {"population_size": 2}, "grpo": {"num_generations": 2},
        "logging": {"runs_dir": str(tmp_path), "name": name},
    }

    def stop(metrics):
        if stop_after is not None and metrics["iteration"] == stop_after:
            raise KeyboardInterrupt

    Trainer(build(layer, overrides), environment=LettersEnvironment(), on_iteration=stop).run()
    return tmp_path / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return [short_run(root, "a"), short_run(root, "b", stop_after=0, optimizer="grpo"),
            short_run(root, "c", es={"population_size": 2, "noise": "lowrank", "rank": 4})]


def test_report_files_and_content(runs, tmp_path):
    out = tmp_path / "report"
    res = CliRunner().invoke(main, ["report", *map(str, runs), "--out", str(out)])
    assert res.exit_code == 0, res.output
    for name in ("reward.png", "reward_per_token.png", "time.png", "outcomes.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    page = (out / "report.html").read_text()
    assert "a (es)" in page and "b (grpo)" in page and "c (es lowrank r=4)" in page  # three methods apart
    assert page.count("data:image/png;base64,") == 4
    for section in ("Reward and pass rate per iteration", "Reward and pass rate per generated token",
                    "Where the time goes", "Verifier outcomes", "Why attempts did not pass", "Best attempts"):
        assert f"<h2>{section}</h2>" in page
    assert "interrupted" in page and "finished" in page  # both statuses shown
    assert re.search(r"failed: N?% of characters in a-p|failed: empty completion", page)
    # the embedded images are the written files, so the page is self-contained
    first = re.search(r"base64,([A-Za-z0-9+/=]+)", page).group(1)
    assert base64.b64decode(first) == (out / "reward.png").read_bytes()


def test_report_rejects_what_is_not_a_run(tmp_path):
    res = CliRunner().invoke(main, ["report", str(tmp_path), "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "not a vrl run directory" in res.output


def test_interrupted_mid_iteration_run_is_reported_and_resumed(tmp_path):
    """Ctrl-C inside an iteration: `vrl report` reads the directory and `vrl train --resume` finishes it."""

    class StopInSecondIteration(LettersEnvironment):
        shaped = 0

        def shaper(self):
            base = super().shaper()

            def shape(task, completion, verdict):
                StopInSecondIteration.shaped += 1
                if StopInSecondIteration.shaped == 8 + 3:  # 8 results per iteration; stop in the second
                    raise KeyboardInterrupt
                return base(task, completion, verdict)

            return shape

    layer = {"iterations": 3, "tasks_per_iteration": 4, "sampling": {"max_new_tokens": 8},
             "es": {"population_size": 2}, "logging": {"runs_dir": str(tmp_path), "name": "cut"}}
    Trainer(build(layer), environment=StopInSecondIteration()).run()
    run = tmp_path / "cut"
    res = CliRunner().invoke(main, ["report", str(run), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert "interrupted" in (tmp_path / "rep" / "report.html").read_text()
    from vrl.rundir import RunDir

    resumed = Trainer(build(RunDir.open(run).config()), run_dir=RunDir.open(run), environment=LettersEnvironment())
    assert resumed.start_iteration == 1
    assert resumed.run()["status"] == "finished"
    assert [r["iteration"] for r in RunDir.open(run).metrics()] == [0, 1, 2]


@pytest.mark.slow
def test_report_of_21_runs_stays_readable_and_html_has_no_control_bytes(runs, tmp_path):
    """21 runs with long names: every image stays within a bounded size (the old layout grew with the
    number of runs: 5412 px and 11550 px wide), and control bytes in completions never reach the page."""
    import json
    import shutil

    from PIL import Image

    source = runs[0]
    many = []
    for i in range(21):
        path = tmp_path / "runs" / f"letters-es-sigma0.{i:02d}-a-long-sweep-name-20261123-160{i:02d}"
        shutil.copytree(source, path)
        many.append(path)
    hostile = "ok\x00 NUL \x1b[31m escape \x07 bell \x7f del \x85 next-line \r\n end"
    samples = [json.loads(line) for line in (many[0] / "samples.jsonl").read_text().splitlines()]
    samples[0].update(completion=hostile, reward=99.0)  # the best attempt, so the page shows it
    samples[0]["verdict"]["detail"] = "detail with \x1b[0m escape"
    (many[0] / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))

    out = tmp_path / "report"
    res = CliRunner().invoke(main, ["report", *map(str, many), "--out", str(out)])
    assert res.exit_code == 0, res.output
    for name in ("reward.png", "reward_per_token.png", "time.png", "outcomes.png"):
        width, height = Image.open(out / name).size
        assert width <= 1600 and height <= 1800, (name, width, height)
    page = (out / "report.html").read_text()
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", page)
    assert "ok␀ NUL ␛[31m escape ␇ bell ␡ del \ufffd next-line \n end" in page  # made visible, not dropped
    assert "detail with ␛[0m escape" in page


def test_labels_are_cut_in_the_middle_and_keep_their_ends():
    from vrl.report import shorten

    long = "letters-es-sigma0.05-a-long-sweep-name-20261123-160507 (es)"
    short = shorten(long, 36)
    assert len(short) == 36 and short.startswith("letters-es-sigma") and short.endswith("160507 (es)") and "…" in short
    assert shorten("short (es)", 36) == "short (es)"


def test_each_rule_labels_its_runs_from_the_recorded_config(tmp_path):
    from vrl.report import Run

    def method(config):
        return Run(path=tmp_path / "r", config=config, metrics=[], samples=[], summary={}).method

    assert method({"optimizer": "es", "es": {"noise": "lowrank", "rank": 8}}) == "es lowrank r=8"
    assert method({"optimizer": "es", "es": {"noise": "full", "rank": 8}}) == "es"
    assert method({"optimizer": "grpo", "grpo": {"use_peft": True}}) == "grpo"
    assert method({"optimizer": "random-search"}) == "random-search"  # a rule not installed here: its name


# -- the page in a real browser -------------------------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# Runs in the page after layout: per <h2> section, the first cell of each table row (the metric names), and
# every element that reaches past the window or whose content overflows its box (what scrolls sideways).
MEASURE = """<script>
const W = document.documentElement.clientWidth, out = {width: W, scroll: document.documentElement.scrollWidth,
                                                        sections: {}, overflow: []};
let section = "(top)";
for (const el of document.body.querySelectorAll("*")) {
  if (el.tagName === "H2") { section = el.textContent; out.sections[section] = []; }
  if (el.tagName === "TD" && el.cellIndex === 0 && el.closest("table").querySelector("th")) out.sections[section].push(el.textContent);
  const r = el.getBoundingClientRect();
  if (r.right > W + 1 || el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).overflowX === "visible")
    out.overflow.push(section + ": <" + el.tagName.toLowerCase() + "> " + Math.round(r.right) + "/" + el.scrollWidth);
}
const pre = document.createElement("pre"); pre.id = "measured"; pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def in_chromium(page: Path, width: int, tmp_path: Path) -> dict:
    """`page` laid out by headless Chromium in a window `width` px wide: what MEASURE found."""
    probe = page.with_name("measured.html")
    probe.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
             "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}", f"--window-size={width},900"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom.stdout, flags=re.S)
    assert found, dom.stderr[-3000:]
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs the Debian package chromium (apt-get install chromium)")
def test_the_page_in_chromium_keeps_each_kind_of_metric_under_its_heading_and_fits_1300_px(runs, tmp_path):
    """A GRPO run whose verifier logs counters and a rate, with a long run name and a completion of one long
    unbroken word: in a 1300 px window nothing reaches past the page's width, verifier counters are
    summed under their heading, and GRPO's statistics (loss, grad norm, learning rate) and the rate are
    shown under theirs (a sum of learning rates means nothing)."""
    run = tmp_path / ("letters-grpo-" + "a-very-long-sweep-name-" * 4 + "20261128")
    shutil.copytree(runs[1], run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row.update({"lean/canaries": 4.0, "lean/canary_exploits": float(i), "lean/exploit_rate": i / 4})
        assert {"grpo/loss", "grpo/grad_norm", "grpo/learning_rate"} <= set(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    samples[0].update(completion="x" * 3000, reward=99.0)  # the best attempt: shown in full
    samples[0]["task_id"] = "task-" + "0123456789" * 30
    (run / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    out = tmp_path / "report"
    res = CliRunner().invoke(main, ["report", str(run), str(runs[0]), "--out", str(out)])
    assert res.exit_code == 0, res.output

    seen = in_chromium(out / "report.html", 1300, tmp_path)
    assert seen["width"] <= 1300 and seen["overflow"] == [] and seen["scroll"] <= seen["width"], seen["overflow"]
    sections = seen["sections"]
    assert set(sections["Verifier counters"]) == {"lean/canaries", "lean/canary_exploits"}
    assert set(sections["Verifier rates"]) == {"lean/exploit_rate"}
    statistics = set(sections["Optimizer statistics"])
    assert {"grpo/loss", "grpo/grad_norm", "grpo/learning_rate"} <= statistics
    assert all(k.startswith(("grpo/", "es/", "time/")) for k in statistics), statistics


def test_per_turn_pass_rates_are_shown_as_rates_and_plotted(tmp_path):
    """A real multi-turn run (`guess`, 3 iterations): `episodes/pass_rate_turn_k` is a rate, shown as its mean over
    the run under "Verifier rates" (never summed over the iterations among the counters: 2.58 and 4.80 were shown for
    `guess` before), and the page has a pass-rate-by-turn plot with a line per turn."""
    from vrl.envs.guess import GuessEnvironment
    from vrl.report import Run, metric_kinds, turns

    layer = {"plugin": "guess", "optimizer": "grpo", "iterations": 3, "tasks_per_iteration": 4,
             "sampling": {"max_new_tokens": 2}, "grpo": {"num_generations": 4},
             "logging": {"runs_dir": str(tmp_path), "name": "guess"}}
    Trainer(build(layer, {}), environment=GuessEnvironment(turns=3)).run()
    run = Run.load(tmp_path / "guess")
    keys = [f"episodes/pass_rate_turn_{k}" for k in (1, 2, 3)]
    assert turns(run) == [1, 2, 3]
    kinds = metric_kinds(run)
    assert set(keys) <= set(kinds["rates"]) and not set(keys) & set(kinds["counters"])
    out = tmp_path / "report"
    res = CliRunner().invoke(main, ["report", str(run.path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    page = html.unescape((out / "report.html").read_text())
    rates = page[page.index("<h2>Verifier rates</h2>"):]
    rates = rates[: rates.index("<h2>", 5)]
    for key in keys:
        values = [row[key] for row in run.metrics]
        mean = float(re.search(rf"<td>{key}</td><td>([^<]+)</td>", rates).group(1))
        assert mean == pytest.approx(sum(values) / len(values), abs=1e-3) and 0 <= mean <= 1
    assert "<h2>Pass rate by turn</h2>" in page and (out / "turns.png").read_bytes()[:4] == b"\x89PNG"
