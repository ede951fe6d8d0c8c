"""Entry point of the vrl-python-tests plugin: registers the environment (it brings its own verifier)."""

import vrl


@vrl.hookimpl
def register_environments(register):
    from vrl_python_tests.environment import PythonTestsEnvironment

    register("python-tests", PythonTestsEnvironment)  # the class itself, so the CLI sees its defaults

