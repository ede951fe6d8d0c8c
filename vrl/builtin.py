"""The core's own plugin: built-in environments and reward shapers, registered like any plugin's."""

from __future__ import annotations

from vrl.hookspecs import hookimpl


@hookimpl
def register_environments(register):
    from vrl.envs.countdown import CountdownEnvironment
    from vrl.envs.letters import LettersEnvironment

    register("countdown", CountdownEnvironment)
    register("letters", LettersEnvironment)


@hookimpl
def register_verifiers(register):
    from vrl.envs.countdown import CountdownVerifier
    from vrl.envs.letters import LettersVerifier

    register("countdown", CountdownVerifier)
    register("letters", LettersVerifier)


@hookimpl
def register_shapers(register):
    from vrl import reward

    register("binary", reward.Binary)
    register("partial_credit", reward.PartialCredit)
    register("length_penalty", reward.LengthPenalty)
    register("format_bonus", reward.FormatBonus)
