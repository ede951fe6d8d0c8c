"""The hooks vrl calls. Register classes (or factories); they are only built when used.

The environment brings its own verifier and reward shaper (`ReverseEnvironment.verifier()` / `.shaper()`)."""

import vrl


@vrl.hookimpl
def register_environments(register):
    from vrl_reverse.env import ReverseEnvironment

    register("reverse", ReverseEnvironment)

