"""`grpo.compile`: every decoder layer of the trained model through `torch.compile`, for training only.

A model with a small hidden size spends much of a training step in eager elementwise kernels
(RMSNorm, the rotary embedding, SiLU·mul, residual adds, casts), which inductor fuses. Each layer is
compiled on its own, as torchtitan compiles each transformer block, not the whole model: the layers
run one code object, so one compiled graph serves all of them, and what surrounds a layer stays
eager and outside the graph (FSDP2's per-layer hooks, activation checkpointing, the embedding, the
output head that `vrl.optim.logprobs` runs in chunks).

The change is made in place, by class: each layer's class becomes a subclass with the same name (so
FSDP2's `_no_split_modules` still finds the layers, and a deep copy such as FSDP2's training copy keeps
it) whose forward runs the compiled forward in training mode and the eager one in eval mode. GRPO's
forward and backward run in training mode; sampling (with its KV cache) and the no-gradient scoring of
reference and old log-probs run in eval mode, so the host's generation never goes through the compiler.

The backend is inductor unless `grpo.compile_backend` names another of torch's (`aot_eager` captures the
same graphs and runs them unfused: a problem that goes away there is inductor's).

Shapes are dynamic (`torch.compile(dynamic=True)`): batch size and sequence length are symbols from the
first compile, so micro-batches of new lengths reuse the graph. Sizes 0 and 1 are still specialised: a
micro-batch of one row, or a padding-free row (`[1, N]`), compiles once more; so does a change of
what the layer is given (an attention mask where there was none, no gradients).
"""

from __future__ import annotations

import torch
from torch import nn

# Where transformers' decoders keep their layers: Llama, Qwen2, Mistral, Gemma... (`layers`),
# GPT-2, Falcon, BLOOM (`h`), and `blocks` for others.
LAYER_LISTS = ("layers", "h", "blocks")

_CLASSES: dict[tuple[type, str], type] = {}  # (eager layer class, backend) -> its compiling subclass


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder's list of layers (`model.get_decoder().layers` and the like), or None."""
    get = getattr(model, "get_decoder", None)
    for owner in ((get(),) if callable(get) else ()) + (model,):
        for name in LAYER_LISTS:
            layers = getattr(owner, name, None)
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                return layers
    return None


def check_backend(backend: str) -> None:
    """Raise ValueError (one line) unless `backend` is one of torch.compile's backends."""
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"grpo.compile_backend={backend!r} is not a torch.compile backend: use inductor (the "
                         f"default), aot_eager or eager, or one of the {len(known)} that "
                         "torch._dynamo.list_backends(exclude_tags=()) names")


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """Make every decoder layer of `model` run compiled (by `backend`) in training mode; returns how many
    layers.

    Idempotent: a layer already compiled is left as it is. Raises ValueError (one line) when the model
    has no list of decoder layers, or when `backend` is not a torch.compile backend."""
    check_backend(backend)
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"grpo.compile=true compiles each decoder layer, but {type(model).__name__} has no list of "
                         f"them (its decoder has no {' / '.join(LAYER_LISTS)} ModuleList); set grpo.compile=false")
    for layer in layers:
        if getattr(type(layer), "_vrl_eager_class", None) is None:
            layer.__class__ = _compiling_class(type(layer), backend)
    return len(layers)


def restore_layers(model: nn.Module) -> int:
    """Undo `compile_layers` (the layers run eager again); returns how many layers were restored."""
    layers = decoder_layers(model) or []
    restored = 0
    for layer in layers:
        if type(layer) in _CLASSES.values():
            layer.__class__ = type(layer)._vrl_eager_class
            restored += 1
    return restored


def _compiling_class(base: type, backend: str) -> type:
    if (base, backend) not in _CLASSES:
        eager = base.forward
        compiled = torch.compile(eager, dynamic=True, backend=backend)

        def forward(self, *args, **kwargs):
            return (compiled if self.training else eager)(self, *args, **kwargs)

        # transformers' GradientCheckpointingLayer wraps the forward of every subclass (this one too) and
        # checkpoints in the outermost wrapper only: the checkpoint stays around the compiled call.
        _CLASSES[base, backend] = type(base.__name__, (base,), {
            "forward": forward, "__module__": base.__module__, "__qualname__": base.__qualname__,
            "__doc__": base.__doc__, "_vrl_eager_class": base,
        })
    return _CLASSES[base, backend]
