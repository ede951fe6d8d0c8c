"""Entry point of the vrl-python-tests plugin."""

import vrl


def _python_tests(**options):
    raise NotImplementedError("the python-tests environment is not implemented yet")


@vrl.hookimpl
def register_environments(register):
    register("python-tests", _python_tests)
