"""A trained model's weights as another copy takes them: under the checkpoint's names (an engine, a
Volume file) or as a Hugging Face folder (`vrl export`).

Loading a model by name is the hf backend's (`vrl.generate.hf.load_model_and_tokenizer`, which also
builds the local `tiny` model); `vrl.export` passes that loader to an optimizer's `export`, which
rebuilds the trained weights (ES: replayed onto a `vrl.weights` view) and writes them with `save_model`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ModelLoader = Callable[[str, str, str | None], tuple[Any, Any]]
"""`load(name, dtype, revision) -> (model, tokenizer)`: a base model in this process, on the export's device."""


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


def save_lora_adapter(model: torch.nn.Module, folder: str) -> dict[str, Any]:
    """Write the LoRA adapter peft injected into `model` to `folder` in peft's own format
    (`adapter_config.json`, `adapter_model.safetensors` with `base_model.model.<module>.lora_A/B.weight`),
    replacing what is there; returns the config. What a vLLM engine loads as a LoRA adapter.

    One active adapter, the same rank and α on every layer, no DoRA, no extra trained modules
    (`modules_to_save`): what `grpo.use_peft` trains. Anything else is refused (push the merged
    weights instead: generator.vllm.weight_transfer=ipc, nccl or extension).
    """
    import json
    import os

    from safetensors.torch import save_file

    layers = {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "lora_B") and m.lora_A}
    if not layers:
        raise ValueError("the model has no LoRA adapter to save (grpo.use_peft is off?)")
    if any("modules_to_save" in n for n, _ in model.named_modules()):
        raise ValueError("the adapter trains whole modules too (modules_to_save), which a served adapter cannot carry")
    tensors: dict[str, torch.Tensor] = {}
    shape: set[tuple[int, float, bool]] = set()
    for name, m in layers.items():
        active = [a for a in m.active_adapters if a in m.lora_A]
        if len(active) != 1:
            raise ValueError(f"{name} has {len(active)} active LoRA adapters; a served adapter is one")
        a = active[0]
        if getattr(m, "use_dora", {}).get(a, False):
            raise ValueError(f"{name} uses DoRA, which a served LoRA adapter cannot carry")
        shape.add((m.r[a], float(m.lora_alpha[a]), bool(getattr(m, "use_rslora", {}).get(a, False))))
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = m.lora_A[a].weight.detach().contiguous()
        tensors[f"{prefix}.lora_B.weight"] = m.lora_B[a].weight.detach().contiguous()
    if len(shape) != 1:
        raise ValueError(f"the adapter's layers differ in rank or alpha ({sorted(shape)}); a served adapter has one of each")
    (r, alpha, rslora), = shape
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "use_rslora": rslora,
              "use_dora": False, "bias": "none", "modules_to_save": None, "lora_dropout": 0.0,
              "target_modules": sorted({n.rsplit(".", 1)[-1] for n in layers})}
    os.makedirs(folder, exist_ok=True)
    # Each file is replaced whole (written beside it, then renamed): a reader never sees half of one.
    weights, cfg = os.path.join(folder, "adapter_model.safetensors"), os.path.join(folder, "adapter_config.json")
    save_file({k: v.cpu() for k, v in tensors.items()}, weights + ".tmp")
    os.replace(weights + ".tmp", weights)
    with open(cfg + ".tmp", "w") as f:
        json.dump(config, f)
    os.replace(cfg + ".tmp", cfg)
    return config


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
