"""Where generation and verification run. The trainer only sees the `Runtime` interface."""

from vrl.runtime.base import Runtime, VerificationPool

__all__ = ["Runtime", "VerificationPool", "make_runtime"]


def make_runtime(config) -> Runtime:
    if config.runtime.kind == "local":
        from vrl.runtime.local import LocalRuntime

        return LocalRuntime()
    if config.runtime.kind == "modal":
        from vrl.runtime.modal.app import build_app
        from vrl.runtime.modal.credentials import require_credentials
        from vrl.runtime.modal.runtime import ModalRuntime

        require_credentials()  # before building anything
        return ModalRuntime(config, app=build_app(config))
    raise ValueError(f"unknown runtime {config.runtime.kind!r}; choose local or modal")
