"""One rank of a GRPO step under FSDP2 with `grpo.compile` (tests/test_grpo_compile.py; not a test module).

Runs tests/grpo_fsdp_worker.py's step (same arguments), then each rank writes how many graphs dynamo
compiled to OUT.rankN.json: the proof that the sharded copy's layers ran compiled.

    torchrun --standalone --nproc-per-node 2 tests/grpo_compile_worker.py OUT RUN_DIR '{"compile": true, ...}'
"""

from __future__ import annotations

import json
import os
import sys

from torch._dynamo.utils import counters

from tests.grpo_fsdp_worker import main

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    with open(f"{sys.argv[1]}.rank{os.environ['RANK']}.json", "w") as f:
        json.dump({"graphs": counters["stats"]["unique_graphs"]}, f)
