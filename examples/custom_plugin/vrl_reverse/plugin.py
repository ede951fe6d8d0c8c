"""The hooks vrl calls. Register classes (or factories); they are only built when used."""

import vrl


@vrl.hookimpl
def register_environments(register):
    from vrl_reverse.env import ReverseEnvironment

    register("reverse", ReverseEnvironment)


@vrl.hookimpl
def register_verifiers(register):
    from vrl_reverse.env import ReverseVerifier

    register("reverse", ReverseVerifier)
