"""What `vrl train` shows while it runs: a start banner, and a bar with i/N, elapsed time and ETA that
survive an 80-column terminal (the stats go on their own line and are cut first)."""

import io
import re
import time

from rich.console import Console

from vrl import console as show
from vrl.config import build
from vrl.envs.letters import LettersEnvironment
from vrl.trainer import Trainer

BAR_LINE = re.compile(r"training .*? (\d+)/(\d+) elapsed (\d+:\d\d:\d\d) eta (\d+:\d\d:\d\d|-:--:--)")


def test_80_columns_show_banner_bar_counts_elapsed_and_eta(tmp_path, monkeypatch):
    console = Console(width=80, record=True, file=io.StringIO(), force_terminal=True)
    layer = {"iterations": 3, "tasks_per_iteration": 4, "sampling": {"max_new_tokens": 8},
             "es": {"population_size": 2}, "logging": {"runs_dir": str(tmp_path), "name": "bar"}}
    seen: list[str] = []

    def snapshot(metrics):
        # What an 80-column terminal shows at this moment (the bar has not yet counted this iteration).
        screen = Console(width=80, record=True, file=io.StringIO())
        screen.print(progress[0].get_renderable())
        seen.append(screen.export_text().splitlines()[0])

    trainer = Trainer(build(layer), environment=LettersEnvironment(), console=console, on_iteration=snapshot)
    progress = []
    make = show.progress
    monkeypatch.setattr(show, "progress", lambda *a, **k: progress.append(make(*a, **k)) or progress[-1])
    trainer.run()
    banner = console.export_text().splitlines()[0]
    for part in (str(tmp_path / "bar"), "plugin letters", "model tiny", "optimizer es", "3 iterations"):
        assert part in banner
    shown = [BAR_LINE.search(line) for line in seen]
    assert all(shown), seen
    assert [(m.group(1), m.group(2)) for m in shown] == [("0", "3"), ("1", "3"), ("2", "3")]
    assert all("━" in line for line in seen[1:])  # the bar itself is drawn
    assert shown[0].group(4) == "-:--:--"  # nothing to estimate from yet
    assert all(m.group(4) != "-:--:--" for m in shown[1:])  # then a time
    final = Console(width=80, record=True, file=io.StringIO())
    final.print(progress[0].get_renderable())
    assert re.search(r" 3/3 elapsed \d+:\d\d:\d\d eta 0:00:00", final.export_text())


def test_long_stats_never_push_the_counts_off_a_narrow_line(tmp_path):
    for width in (60, 80, 120):
        console = Console(width=width, record=True, file=io.StringIO(), force_terminal=True)
        progress = show.progress(console, first=4)  # a resumed run: ETA from this session only
        bar = progress.add_task("training", total=20, completed=4, stats="reward 0.123 · pass 12.5% · 1234 tok/s · " * 4)
        time.sleep(0.05)
        progress.update(bar, advance=2)
        console.print(progress.get_renderable())
        first, second = console.export_text().splitlines()[:2]
        assert BAR_LINE.search(first) and " 6/20 " in first and len(first) <= width
        assert second.startswith("  reward 0.123") and second.endswith("…") and len(second) <= width
        eta = BAR_LINE.search(first).group(4)
        h, m, s = map(int, eta.split(":"))
        elapsed = progress.tasks[0].elapsed
        assert abs(h * 3600 + m * 60 + s - elapsed / 2 * 14) <= 1  # 14 iterations left at the pace of the 2 done
