"""The Modal runtime: the same loop on many GPUs (docs/modal.md).

`ModalRuntime` plugs into the trainer; `build_app` declares the Modal app (per-role images, the GPU
worker, `prepare_model`, the detached orchestrator); `SandboxPool` keeps warm verifier sandboxes.
Importing this package does not import `modal`; building the app does.
"""

from vrl.runtime.modal.runtime import ModalPolicy, ModalRuntime
from vrl.runtime.modal.sandbox import ProcessSandbox, SandboxHandle, SandboxPool, SandboxSpec

__all__ = ["ModalPolicy", "ModalRuntime", "ProcessSandbox", "SandboxHandle", "SandboxPool", "SandboxSpec"]
