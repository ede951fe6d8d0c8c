"""The core's own plugin: built-in environments and reward shapers, registered like any plugin's."""

from __future__ import annotations

from vrl.hookspecs import hookimpl


@hookimpl
def register_environments(register):
    from vrl.envs.countdown import CountdownEnvironment

    register("countdown", CountdownEnvironment)


@hookimpl
def register_verifiers(register):
    from vrl.envs.countdown import CountdownVerifier

    register("countdown", CountdownVerifier)


@hookimpl
def register_shapers(register):
    from vrl import reward

    register("binary", reward.Binary)
    register("partial_credit", reward.PartialCredit)
    register("length_penalty", reward.LengthPenalty)
    register("format_bonus", reward.FormatBonus)
