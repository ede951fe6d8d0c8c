"""The detached orchestrator's body: the whole training loop inside a Modal container.

It sits above the trainer (it runs one), so nothing the trainer imports imports it. It gets the
Modal runtime by name from the registry, as the CLI does: the runtime builds the app (`app.py`),
whose orchestrator function calls this module, so importing the runtime here would close a cycle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vrl.config import migrate, train_config
from vrl.rundir import RunDir
from vrl.runtime import runtime_class
from vrl.runtime.modal.workers import RUNS_DIR
from vrl.trainer import Trainer


def orchestrate(config: dict[str, Any], root: str | os.PathLike, worker: Any, resume: bool = False,
                on_iteration: Any = None, execute: str = "modal") -> dict[str, Any]:
    """Run the whole training loop here, the run directory on the Volume (`root`).

    `worker`: the app's GPU worker; `on_iteration` commits the Volume after each iteration so metrics
    and the ES history survive a lost container; `resume=True` continues the run directory found on
    the Volume with its recorded config (only `iterations` may grow). `execute="local"` runs the
    workers' bodies in this process (tests).
    """
    run_dir = None
    if resume:
        run_dir = RunDir.open(Path(root) / RUNS_DIR / str(config["logging"]["name"]))
        config = {**migrate(run_dir.config()), "iterations": config["iterations"]}
    cfg = train_config().model_validate(config)
    cfg = cfg.model_copy(update={"logging": cfg.logging.model_copy(update={"runs_dir": Path(root) / RUNS_DIR})})
    runtime = runtime_class("modal")(cfg, app=None, worker=worker, execute=execute, volume_root=root, in_container=True)
    trainer = Trainer(cfg, run_dir=run_dir, runtime=runtime, on_iteration=on_iteration)
    summary = trainer.run()
    return json.loads(json.dumps(summary, default=str))
