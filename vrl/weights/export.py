"""A trained model's weights as another copy takes them: under the checkpoint's names (an engine, a
Volume file) or as a Hugging Face folder (`vrl export`).

Loading a model by name is the hf backend's (`vrl.generate.hf.load_model_and_tokenizer`, which also
builds the local `tiny` model); `vrl.export` passes that loader to an optimizer's `export`, which
rebuilds the trained weights (ES: replayed onto a `vrl.weights` view) and writes them with `save_model`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from vrl.policy import WeightStream

ModelLoader = Callable[[str, str, str | None], tuple[Any, Any]]
"""`load(name, dtype, revision) -> (model, tokenizer)`: a base model in this process, on the export's device."""


def release_shared() -> None:
    """Free what the receiver has let go of among the CUDA tensors this process shared by IPC handle (torch
    keeps a freed block that was shared in limbo until `ipc_collect`, or until an allocation runs short):
    called between the buckets of a push, so a streamed push holds about one bucket rather than all."""
    if torch.cuda.is_initialized():  # (nothing was shared by CUDA IPC handle otherwise)
        torch.cuda.ipc_collect()


def published_buckets(model: Any) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """What `PolicyHost.publish` was given, as buckets of (checkpoint name, tensor): a `WeightStream` as
    it comes, tensors by name as one bucket, a module's weights (`weights_for_engine`) as one."""
    if isinstance(model, WeightStream):
        return model
    if isinstance(model, Mapping):
        return [list(model.items())]
    return [weights_for_engine(model)]


def weights_for_engine(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's weights under the checkpoint's (HF) names, as the engine loads them.

    LoRA (peft injects `base_layer` + `lora_A/B` into the model): each adapted layer is sent as one
    merged weight W + ΔW computed out of place (peft's own `get_delta_weight`), so the engine serves
    the adapted policy while the trainable base stays untouched (merging in place and unmerging
    again would not give back W's bits in bf16). Without adapters the parameters go as they are.
    """
    lora = {
        name: m for name, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "get_delta_weight")
    }
    if not lora:
        return [(n, p.detach()) for n, p in model.named_parameters()]
    out: list[tuple[str, torch.Tensor]] = []
    with torch.no_grad():
        for name, m in lora.items():
            base = m.base_layer
            weight = base.weight.detach()
            if not (m.merged or m.disable_adapters):  # merged: W already holds ΔW
                for adapter in m.active_adapters:
                    if adapter in m.lora_A:
                        # As peft's merge: the sum in fp32 (adapters are often fp32), rounded once.
                        weight = (weight.float() + m.get_delta_weight(adapter).float()).to(weight.dtype)
            out.append((f"{name}.weight", weight))
            if getattr(base, "bias", None) is not None:
                out.append((f"{name}.bias", base.bias.detach()))
        inside = tuple(f"{name}." for name in lora)
        for n, p in model.named_parameters():
            if n.startswith(inside):
                continue
            if "modules_to_save" in n or "original_module" in n:
                raise ValueError(f"cannot sync peft modules_to_save ({n}) into the engine; adapt those layers with LoRA")
            out.append((n, p.detach()))
    return out


def lora_factors_for_engine(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The LoRA adapter peft injected into `model` as an engine's LoRA slots hold it: per adapted weight
    (its HF name, `<module>.weight`), (A, s·B) with peft's scale s (α/r, α/√r with rsLoRA) folded into B
    in fp32, as vLLM folds it when it loads an adapter; the layer then adds x·Aᵀ·(s·B)ᵀ = s·B·A·x,
    peft's ΔW·x.

    One active adapter, the same rank and α on every layer, no DoRA, no extra trained modules
    (`modules_to_save`): what `grpo.use_peft` trains and what a served LoRA adapter carries. Anything
    else is refused (push the merged weights instead: generator.vllm.weight_transfer=ipc, nccl or extension).
    """
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "lora_B") and m.lora_A}
    if not layers:
        raise ValueError("the model has no LoRA adapter (grpo.use_peft is off?)")
    if any("modules_to_save" in n for n, _ in model.named_modules()):
        raise ValueError("the adapter trains whole modules too (modules_to_save), which a served adapter cannot carry")
    out, shapes = {}, set()
    for name, m in layers.items():
        active = [a for a in m.active_adapters if a in m.lora_A]
        if len(active) != 1:
            raise ValueError(f"{name} has {len(active)} active LoRA adapters; a served adapter is one")
        a = active[0]
        if getattr(m, "use_dora", {}).get(a, False):
            raise ValueError(f"{name} uses DoRA, which a served LoRA adapter cannot carry")
        shapes.add((int(m.r[a]), float(m.lora_alpha[a]), bool(getattr(m, "use_rslora", {}).get(a, False))))
        out[f"{name}.weight"] = (m.lora_A[a].weight.detach(), m.lora_B[a].weight.detach().float() * m.scaling[a])
    if len(shapes) != 1:
        raise ValueError("the adapter's layers differ in rank or alpha; a served adapter has one of each")
    return out


def save_model(model: torch.nn.Module, tokenizer, folder) -> None:
    """Write `model` and `tokenizer` as a standard Hugging Face folder (what `vrl export` produces)."""
    from transformers.utils import logging as hf_logging

    # ES moved the weights into flat shared buffers; safetensors needs each tensor to own its storage.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no per-shard bar on the console
    try:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
