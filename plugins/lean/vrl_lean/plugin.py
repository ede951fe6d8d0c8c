"""Entry point of the vrl-lean plugin: registers the `lean` environment (it brings its own verifier)."""

from __future__ import annotations

import vrl


@vrl.hookimpl
def register_environments(register):
    from vrl_lean.environment import LeanEnvironment

    # The class itself is the factory, so `vrl train` can read LeanEnvironment.defaults.
    register("lean", LeanEnvironment)

