"""vrl-python-tests: write-a-function tasks judged by tests in a sandbox."""
