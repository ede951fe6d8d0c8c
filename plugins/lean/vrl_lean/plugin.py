"""Entry point of the vrl-lean plugin."""

import vrl


def _lean(**options):
    raise NotImplementedError("the lean environment is not implemented yet")


@vrl.hookimpl
def register_environments(register):
    register("lean", _lean)
