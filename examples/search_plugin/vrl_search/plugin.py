"""The hooks vrl calls: one update rule and one generator backend, registered by name.

Classes are imported inside the hooks, so `vrl plugins` and `vrl --help` stay fast.
"""

import vrl


@vrl.hookimpl
def register_optimizers(register):
    from vrl_search.random_search import RandomSearch

    register("random_search", RandomSearch)  # --optimizer random_search; settings: random_search.*


@vrl.hookimpl
def register_generators(register):
    from vrl_search.canned import CannedGenerator

    register("canned", CannedGenerator)  # --set generator.backend=canned; settings: generator.canned.*
