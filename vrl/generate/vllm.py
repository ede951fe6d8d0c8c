"""The `vllm` generator: fast GPU sampling with a vLLM engine, ES inside the engine, GRPO weight sync.

- Sampling: prompts are tokenised here exactly as the `hf` backend does and sent as token ids;
  `n` samples per prompt, stop strings, per-prompt seeds, token ids, and (for GRPO) the sampled
  tokens' log-probs under the temperature-scaled distribution (vLLM's `processed_logprobs`). All
  prompts go into the engine at once; completions stream out in batches as requests finish, so
  the verifier starts while the engine is still generating.
- How the weights move is the engine's mode, fixed when it starts (`Mode`), and each mode has its
  mover (`MOVERS`: the driver half) with its own worker extension (the half inside the engine):
  full-rank ES perturbs the engine's own (fused) weights in place (`vllm_inplace`), low-rank ES
  serves members from LoRA slots (`vllm_slots`), GRPO pushes a trained in-process HF copy
  (`vllm_trained`: vLLM's native weight-transfer engines, CUDA IPC or NCCL, or vrl's own loader;
  every `generator.vllm.sync_every` updates). ES noise is the `hf` backend's (same seeds, HF parameter names, values). With
  `generator.vllm.sleep` the engine frees its GPU memory between generation passes so training can use
  it (colocated mode).

vLLM is imported lazily: `pip install 'vrl-core[vllm]'`, on a machine with a CUDA GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from vrl import distributed, reaper
from vrl.config import Section
from vrl.errors import UsageError
from vrl.generate.base import Generator, cut_at_stop, tokens_covering
from vrl.generate.hf import TINY, meta_model, render_prompt
from vrl.gguf import is_gguf
from vrl.gguf import resolve as resolve_gguf
from vrl.policy import HostNeeds, PerturbationSpec, Trainable, Unsupported, Variant, WeightStream
from vrl.types import Completion, Task

# torch and the weights layer's tensor code are imported in the functions that use them: the registry
# imports this module for `VLLMGenerator.Config`, and `vrl plugins` must not load torch (issue 28).
if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class VLLMConfig(Section):
    """The `vllm` backend (`generator.backend: vllm`): a vLLM engine on a CUDA GPU (docs/vllm.md)."""

    gpu_memory_utilization: float = Field(
        0.6, gt=0.0, le=1.0,
        description="Fraction of GPU memory the engine may take (weights + KV cache); leave room for in-engine ES "
        "state (4 bytes per selected parameter) or GRPO training on the same GPU.",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + completion in tokens; None: the model's own limit."
    )
    kv_cache_memory_gb: float | None = Field(
        None, gt=0.0,
        description="KV cache of each engine in GiB, in place of the share gpu_memory_utilization leaves after a "
        "profile run. Set it when other processes start engines on the same GPU at the same time: the profile "
        "counts their allocations as this engine's (vLLM assumes no other process changes its memory meanwhile, "
        "vllm/v1/worker/gpu_worker.py) and may refuse with 'No available memory for the cache blocks'.",
    )
    enforce_eager: bool = Field(
        False, description="Skip torch.compile and CUDA graphs (starts ~3x faster, generates ~3x slower)."
    )
    max_num_seqs: int = Field(
        512, ge=1,
        description="Most sequences one engine step decodes. 512 is the largest batch vLLM captures in a CUDA "
        "graph by default; steps above it run without graphs (vLLM's own default on 80 GB GPUs is 1024: 2.5x "
        "slower for a 1920-request low-rank ES pass on one H100, docs/benchmarks.md).",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one engine shards the model over (in-engine ES needs 1)."
    )
    sleep: bool = Field(
        False,
        description="With grpo: the engine frees its GPU memory after each generation pass so training can use it "
        "(colocated mode), and wakes for the weight sync.",
    )
    sync_every: int = Field(
        1, ge=1,
        description="With grpo: push the trained weights into the engine every k updates; in between the engine "
        "samples slightly stale weights and GRPO's importance ratio uses the engine's log-probs.",
    )
    weight_transfer: Literal["auto", "ipc", "nccl", "extension", "adapter"] = Field(
        "auto",
        description="With grpo: how trained weights reach the engine. auto: vLLM's native weight-transfer engines, "
        "CUDA IPC when the engine is one worker on the trainer's GPU (ipc) and an NCCL broadcast when its workers "
        "sit on other GPUs (nccl), else vrl's own loader (extension: CUDA IPC handles into a worker extension, also "
        "across GPUs); these push a LoRA-trained model merged (W + ΔW). adapter (grpo.use_peft, one engine "
        "worker): the engine serves the LoRA adapter from a LoRA slot and only its factors travel (a faster push, "
        "slower generation through vLLM's LoRA path; docs/vllm.md).",
    )
    sampling_logprobs: bool = Field(
        True,
        description="With grpo: the engine returns each sampled token's log-prob and GRPO's importance ratio uses "
        "it (corrects for sampler/trainer numerics and stale weights). Costs about 40% of generation throughput "
        "at 1.5B (docs/benchmarks.md); false: the ratio uses the trainer's own log-probs.",
    )

    @model_validator(mode="after")
    def _check_logprobs(self) -> VLLMConfig:
        if self.sync_every > 1 and not self.sampling_logprobs:
            raise ValueError(
                "generator.vllm.sync_every > 1 samples from weights up to k-1 updates old, which only the engine's own "
                "log-probs can correct for; keep generator.vllm.sampling_logprobs=true or set generator.vllm.sync_every=1"
            )
        return self


Mode = Literal["sample", "perturb", "lowrank", "trained"]
"""How an engine's weights move, fixed when it starts: 'sample' (they do not, or only by `publish` of
ready tensors: eval, Modal's GRPO workers), 'perturb' (seeded full-rank ES in place), 'lowrank'
(low-rank ES members in LoRA slots), 'trained' (an in-process copy GRPO trains, pushed by `publish`)."""


#: Per mode, the mover that moves the engine's weights (module, class); its `extension` runs in the workers.
MOVERS: dict[str, tuple[str, str]] = {
    "sample": ("vrl.generate.vllm_trained", "PushedWeights"),
    "trained": ("vrl.generate.vllm_trained", "PushedWeights"),
    "perturb": ("vrl.generate.vllm_inplace", "InPlace"),
    "lowrank": ("vrl.generate.vllm_slots", "LoRASlots"),
}


def mover_class(mode: Mode) -> Any:
    """The `vllm_mover.Mover` subclass of an engine mode (imported on first use: it loads torch)."""
    import importlib

    module, name = MOVERS[mode]
    return getattr(importlib.import_module(module), name)


def extension_for(mode: Mode) -> str:
    """The worker extension vLLM mixes into an engine of this mode (`worker_extension_cls`): its mover's."""
    return mover_class(mode).extension


def mode_for(needs: HostNeeds | None) -> Mode:
    """The engine mode for what the update rule will ask (`Optimizer.needs`; None: sampling only)."""
    if needs is None:
        return "sample"
    if needs.moves == "trained":
        return "trained"
    return "lowrank" if needs.spec is not None and needs.spec.noise == "lowrank" else "perturb"


class BackendUnavailable(UsageError, RuntimeError):
    """The vllm backend cannot run here (no vLLM, no GPU); the message says what to do."""


def import_vllm() -> Any:
    """The vllm module, or an error that says how to get it and what it needs."""
    try:
        import vllm
    except ImportError as exc:
        raise BackendUnavailable(
            f"generator.backend=vllm needs vLLM, which cannot be imported ({exc}). Install it with "
            "`pip install 'vrl-core[vllm]'` on a machine with a CUDA GPU, or use generator.backend=hf."
        ) from exc
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable("generator.backend=vllm needs a CUDA GPU and none is visible; use generator.backend=hf")
    return vllm


def lora_settings(needs: HostNeeds | None, model: str, revision: str | None) -> dict[str, Any]:
    """The engine's LoRA settings: one slot per low-rank ES member of a call (none for other work), and
    LoRA layers on the modules ES selects alone (`lora_targets`)."""
    spec = needs.spec if needs is not None else None
    if spec is None or spec.noise != "lowrank":
        return {}
    from vrl.generate.vllm_trained import lora_rank_for

    rank = lora_rank_for(spec.rank)
    out = {"enable_lora": True, "max_loras": needs.variants, "max_cpu_loras": needs.variants, "max_lora_rank": rank,
           # A pass sends each member's requests together, so a decode step mostly holds a few members (8 of 30
           # at 64 tasks and 512 sequences): CUDA graphs per count of active adapters let the LoRA kernels
           # launch blocks for those alone, not for every slot (docs/benchmarks.md, session 23).
           "specialize_active_lora": True}
    targets = lora_targets(model, revision, spec)
    if targets is not None:
        out["lora_target_modules"] = targets
    return out


def lora_targets(model: str, revision: str | None, spec: PerturbationSpec) -> list[str] | None:
    """The module names (last dotted part, as vLLM's `lora_target_modules` takes them) of the matrices
    low-rank ES selects, or None when it selects every kind of linear layer but `lm_head`.

    vLLM puts a LoRA layer on every module it supports unless told otherwise, and each one runs its
    LoRA kernels at every step whether the members' factors there are zero or not; an es.include of
    the MLP alone would still pay for the attention's LoRA layers."""
    import torch

    from vrl.weights.lowrank import select_linear

    tree = meta_model(model, revision)
    kinds = {name.rsplit(".", 1)[-1] for name, m in tree.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head"}
    chosen = {name.removesuffix(".weight").rsplit(".", 1)[-1]
              for name, _ in select_linear(tree, spec.include, spec.exclude, report=False)}
    return None if kinds <= chosen else sorted(chosen)


ADAPTER_ELSEWHERE = ("generator.vllm.weight_transfer=adapter writes the trained module's LoRA factors from the training "
                     "process; an engine in a driver process takes whole weights by name: use "
                     "generator.vllm.weight_transfer=auto, or runtime.local.driver_processes=false")


def trained_on(config: Any) -> str:
    """The device GRPO's trained copy lives on, beside an engine (generator.device; 'auto': the current GPU)."""
    return "cuda" if config.generator.device == "auto" else config.generator.device


def engine_dtype(config: Any) -> str:
    """The engine's dtype: as the hf backend on a GPU, 'auto' means bfloat16, not the checkpoint's dtype."""
    return "bfloat16" if config.generator.dtype == "auto" else config.generator.dtype


def engine_kwargs(config: Any, model_path: str, needs: HostNeeds | None = None) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for a run's config (one place where every vllm field is read)."""
    g, v = config.generator, config.generator.vllm
    local = config.model == TINY or is_gguf(config.model)  # a folder vrl wrote: no Hub revision
    return {**lora_settings(needs, config.model, None if local else g.revision),
        "model": model_path,
        "revision": None if local else g.revision,
        "dtype": engine_dtype(config),
        "gpu_memory_utilization": v.gpu_memory_utilization,
        "max_model_len": v.max_model_len,
        **({} if v.kv_cache_memory_gb is None else {"kv_cache_memory_bytes": int(v.kv_cache_memory_gb * 2**30)}),
        "enforce_eager": v.enforce_eager,
        "max_num_seqs": v.max_num_seqs,
        "tensor_parallel_size": v.tensor_parallel_size,
        "enable_sleep_mode": v.sleep,
        "seed": config.seed,
        "worker_extension_cls": extension_for(mode_for(needs)),
        # Log-probs of the distribution tokens are drawn from (after temperature), as GRPO's ratio needs.
        "logprobs_mode": "processed_logprobs",
        # Sampling defaults are vLLM's, never the checkpoint's generation_config: every request sets them all.
        "generation_config": "vllm",
    }


def sampling_arguments(sampling: Any, n: int, seed: int | None, logprobs: bool) -> dict[str, Any]:
    """`vllm.SamplingParams`' keyword arguments for a `SamplingConfig`: every sampling setting written out
    (`generation_kwargs` on top, as TRL does), so nothing is left to vLLM's defaults or the checkpoint's
    `generation_config` (the engine is also started with generation_config='vllm', see `engine_kwargs`).
    `logprobs`: report each sampled token's log-prob (of the processed distribution, `processed_logprobs`)."""
    values = sampling.effective()
    greedy = values["temperature"] <= 0
    kwargs: dict[str, Any] = dict(
        n=n,
        temperature=0.0 if greedy else float(values["temperature"]),
        top_p=1.0 if greedy else float(values["top_p"]),
        top_k=0 if greedy else int(values["top_k"]),  # 0: off (vLLM >= 0.10)
        min_p=0.0 if greedy or values["min_p"] is None else float(values["min_p"]),
        repetition_penalty=float(values["repetition_penalty"]),
        presence_penalty=0.0,
        frequency_penalty=0.0,
        max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,
        detokenize=bool(sampling.stop),  # only stop strings need the engine's detokenizer; text is decoded here
        seed=seed,
        logprobs=0 if logprobs else None,
        flat_logprobs=True,
    )
    kwargs.update({k: v for k, v in sampling.generation_kwargs.items() if k not in sampling.PROCESSORS})
    return kwargs


def save_tiny(path: str) -> str:
    """Write the `tiny` model and tokenizer to `path` (vLLM loads models from a directory)."""
    from vrl.generate import tiny

    tiny.build_model().save_pretrained(path)
    tiny.build_tokenizer().save_pretrained(path)
    return path


def sampled_logprobs(logprobs: Any, token_ids: Sequence[int]) -> list[float]:
    """The log-prob of each sampled token from a vLLM `CompletionOutput.logprobs`."""
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: the sampled token comes first at each position
        return [float(logprobs.logprobs[i]) for i in logprobs.start_indices[: len(token_ids)]]
    return [float(step[tok].logprob) for step, tok in zip(logprobs, token_ids)]


class VLLMGenerator(Generator):
    """Sampling with a vLLM engine; ES perturbs and GRPO syncs the engine's weights in place.

    `mode` (see `Mode`) says how its weights move; the caller passes it (`from_config` derives it from
    the update rule's `needs`), and the engine refuses any other way."""

    name = "vllm"
    Config = VLLMConfig
    runs_episodes = True
    # A driver process's engine takes the trained weights its parent sends as CUDA IPC handles; its
    # transport pushes them on from there (`PushedWeights`).
    trains_elsewhere = True

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        sampling: Any,
        *,
        mode: Mode,
        model_path: str | None = None,
        revision: str | None = None,
        train_device: str = "cuda",
        dtype: str = "bfloat16",
        sampling_logprobs: bool = True,
        sync_every: int = 1,
        sleep: bool = False,
        tensor_parallel_size: int = 1,
        cleanup: str | None = None,
        device_order: list[str] | None = None,
        lora_slots: int = 0,
        weight_transfer: str = "extension",
    ):
        self.llm, self.tokenizer, self.sampling = llm, tokenizer, sampling
        self.mode = mode
        self.device_order = device_order  # the engine's GPU numbering (physical ids), when not this process's
        self.weight_transfer = weight_transfer  # how `publish` moves weights ('ipc', 'nccl': vLLM's; 'extension': vrl's)
        self.model_path, self.revision = model_path, revision
        self.train_device, self.dtype = train_device, dtype
        self.sampling_logprobs, self.logprobs = sampling_logprobs, False
        self.sync_every, self.sleep, self.tensor_parallel_size = sync_every, sleep, tensor_parallel_size
        self._cleanup = cleanup
        self._processes: set = set()  # the engine's processes, for vrl.reaper (set by from_config)
        self._asleep = False
        self.mover = mover_class(mode)(self, lora_slots) if mode == "lowrank" else mover_class(mode)(self)
        self._weights_version = 0  # salts the prefix cache: KV computed with other weights is never reused

    @staticmethod
    def check(config: Any, needs: HostNeeds | None) -> None:
        """Refuse settings that cannot work with how the update rule moves weights, before an engine starts."""
        v = config.generator.vllm
        moves = needs.moves if needs is not None else None
        problem = _perturbation_problem(v.sleep, v.tensor_parallel_size) if moves == "perturbations" else None
        if problem:
            raise ValueError(problem)

    @classmethod
    def check_fits(cls, config: Any, needs: HostNeeds | None, model: Any) -> None:
        """The engine settings suit how the weights will move, and low-rank ES selects only weights
        vLLM's LoRA layers serve: the decoder's projections, not the output layer (`vllm_slots.lora_slices`
        refuses the rest once an engine runs; an lm_head tied to the embedding is never selected)."""
        try:
            cls.check(config, needs)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        if (needs is not None and needs.moves == "trained" and config.generator.vllm.weight_transfer == "adapter"
                and config.runtime.kind == "local" and config.runtime.local.driver_processes):
            raise UsageError(ADAPTER_ELSEWHERE)
        spec = needs.spec if needs is not None else None
        if model is None or spec is None or spec.noise != "lowrank":
            return
        from vrl.errors import SelectionError
        from vrl.weights.lowrank import select_linear

        heads = [n for n, _ in select_linear(model(), spec.include, spec.exclude, report=False) if n.startswith("lm_head")]
        if heads:
            raise SelectionError(
                f"es.noise=lowrank on generator.backend=vllm cannot move {heads[0]}: vLLM serves LoRA adapters on "
                "the decoder's projections, not on the output layer; add it to es.exclude "
                "(--set 'es.exclude=[\"lm_head*\"]') or use generator.backend=hf"
            )

    @classmethod
    def from_config(cls, config: Any, needs: HostNeeds | None = None, *, gpu: str | None = None,
                    memory_fraction: float | None = None, model_path: str | None = None) -> VLLMGenerator:
        """Start an engine for the run's model.

        `gpu`: the CUDA device index the engine runs on (default: the process's first visible GPU);
        `memory_fraction`: its share of that GPU (default generator.vllm.gpu_memory_utilization), so that
        several engines can share one GPU; `model_path`: a directory already holding the model
        (a pool writes the tiny model once for all its engines).
        """
        v = config.generator.vllm
        cls.check(config, needs)
        vllm = import_vllm()
        cleanup = None
        path = model_path or config.model
        if path == TINY:
            cleanup = path = save_tiny(tempfile.mkdtemp(prefix="vrl-tiny-"))
        path = resolve_gguf(path, engine_dtype(config))  # a GGUF file: its folder, converted once (vrl/gguf.py)
        kwargs = engine_kwargs(config, path, needs)
        if memory_fraction is not None:
            kwargs["gpu_memory_utilization"] = memory_fraction
        known = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
        if "lora_target_modules" in kwargs and "lora_target_modules" not in known:
            log.warning("vLLM %s cannot restrict its LoRA layers to the modules ES selects (lora_target_modules "
                        "came in a later version): every supported module runs LoRA kernels", vllm.__version__)
            del kwargs["lora_target_modules"]
        if "kv_cache_memory_bytes" in kwargs and "kv_cache_memory_bytes" not in known:
            raise ValueError(f"generator.vllm.kv_cache_memory_gb needs vLLM's kv_cache_memory_bytes (vLLM 0.11 or "
                             f"later); this is vLLM {vllm.__version__}: leave it unset")
        if "specialize_active_lora" in kwargs and "specialize_active_lora" not in known:
            del kwargs["specialize_active_lora"]  # a speed setting of later vLLM versions; older ones run without it
        # The driver sends CUDA IPC handles and ES terms through collective_rpc, which vLLM only
        # pickles when allowed; the engine is private to this process (no server is exposed).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        # A forked engine process cannot use CUDA once this process has touched it (an HF copy, a test).
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # Where the trained copy lives: this process's generator.device, or a driver process's parent's.
        device = needs.train_device if needs is not None and needs.train_device else trained_on(config)
        adapter_rank = needs.adapter_rank if needs is not None and needs.moves == "trained" else 0
        mode = mode_for(needs)
        transfer = _weight_transfer(v.weight_transfer, mode, gpu, device, v.tensor_parallel_size, adapter_rank)
        if mode == "trained" and distributed.world_size() > 1 and expandable_segments():
            log.warning("PYTORCH_CUDA_ALLOC_CONF turns expandable_segments on: a torchrun launch with rank 0's vLLM engine "
                        "crashed with that setting at its first push (CUDA illegal memory access, 7B shape on 2 x H200) "
                        "and trained without it; unset it if the run fails so (docs/grpo.md, 'A 7B model on 2 GPUs')")
        if transfer in ("ipc", "nccl"):
            # vLLM's engine for it, loading in place: the workers register `DIRECT` when they import
            # the extension's module, before their model loads.
            from vrl.generate.vllm_trained import DIRECT

            kwargs["weight_transfer_config"] = {"backend": DIRECT[transfer]}
        elif transfer == "adapter":  # one LoRA slot, the trained policy's (its factors written at each push)
            from vrl.generate.vllm_trained import lora_rank_for

            kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=lora_rank_for(adapter_rank))
        t0 = time.perf_counter()
        # The engine's processes start here and keep the environment they see: a standalone one, even in
        # rank 0 of a torchrun launch (vrl.distributed.outside_launch says why).
        # Its processes end with this one however it ends (vrl.reaper): vLLM's own would outlive a SIGKILL or
        # an unhandled SIGTERM (torchrun ending a failed launch) and keep their GPU memory.
        with _visible_gpu(gpu) as order, distributed.outside_launch(), reaper.reaped_children() as processes:
            llm = vllm.LLM(**kwargs)
        log.info("vLLM engine ready in %.1f s%s (weights move by %s)", time.perf_counter() - t0,
                 f" on GPU {gpu}" if gpu is not None else "", transfer)
        gen = cls(llm, _load_tokenizer(path, kwargs["revision"]), config.sampling, mode=mode, model_path=path,
                  revision=kwargs["revision"], train_device=device, dtype=kwargs["dtype"],
                  sampling_logprobs=v.sampling_logprobs, sync_every=v.sync_every, sleep=v.sleep,
                  tensor_parallel_size=v.tensor_parallel_size, cleanup=cleanup, device_order=order,
                  lora_slots=kwargs.get("max_loras", 0), weight_transfer=transfer)
        gen._processes = processes
        return gen

    @classmethod
    def engines(cls, config: Any, needs: HostNeeds | None, gpus: Sequence[str | None]) -> list[VLLMGenerator]:
        """One engine per entry of `gpus` (None: GPU 0): engines on one GPU split
        generator.vllm.gpu_memory_utilization evenly, and the tiny model is written once for all."""
        cls.check(config, needs)  # before the tiny model is written for them
        placement = [gpu if gpu is not None else "0" for gpu in gpus]
        sharing = Counter(placement)
        share = config.generator.vllm.gpu_memory_utilization
        hosts: list[VLLMGenerator] = []
        cleanup = None
        try:
            path = config.model
            if path == TINY:  # written once for every engine
                cleanup = path = save_tiny(tempfile.mkdtemp(prefix="vrl-tiny-"))
            for gpu in placement:
                hosts.append(cls.from_config(config, needs, gpu=gpu, memory_fraction=share / sharing[gpu], model_path=path))
            if cleanup:  # the first engine may load a trainable copy from it later; it removes it on close
                hosts[0].adopt(cleanup)
                cleanup = None
        except BaseException:
            for host in hosts:
                host.close()
            raise
        finally:
            if cleanup:  # the engines loaded it
                shutil.rmtree(cleanup, ignore_errors=True)
        return hosts

    def counters(self) -> dict[str, float]:
        """Seconds of the engine's last weight moves, from its mover (`sync_s`: GRPO's push, `members_s`:
        writing low-rank members into LoRA slots, `update_worker_s`: an ES update inside the workers)."""
        return self.mover.counters()

    def adopt(self, directory: str) -> None:
        """Remove `directory` (a model written for this engine) when the engine closes."""
        self._cleanup = directory

    # -- how optimizers move the weights ------------------------------------------------------------
    def trainable(self) -> Trainable:
        """An HF copy of the model that GRPO trains and `publish` pushes (mode 'trained' only)."""
        if not hasattr(self.mover, "trainable"):
            raise Unsupported(f"this engine was started in mode {self.mode!r}; a trained copy needs one started with "
                              "the GRPO run's needs (mode 'trained': make_generator(config, optimizer.needs()))")
        return self.mover.trainable()

    @classmethod
    def trainable_elsewhere(cls, config: Any) -> Trainable:
        """The HF copy GRPO trains for an engine in a driver process: loaded as `trainable` loads it
        beside an engine in this process (the run's checkpoint, on generator.device, in the engine's dtype)."""
        from vrl.generate.hf import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(config.model, trained_on(config), engine_dtype(config),
                                                    config.generator.revision)
        return Trainable(model, tokenizer, config.sampling, separate=True)

    def trained_elsewhere(self) -> None:
        """The trained copy lives in the parent of this driver process: samples carry the sampler's
        log-probs (as after `trainable`), and pushes take tensors received by CUDA IPC handle."""
        self.follow_trained()
        if self.weight_transfer == "adapter":
            raise Unsupported(ADAPTER_ELSEWHERE)
        self.mover.received = True

    def follow_trained(self) -> None:
        """Another engine of the pool handed out the trained copy (in this process): this engine samples
        what `publish` pushes from it, and reports sampling log-probs as that engine does."""
        if self.mode != "trained":
            raise Unsupported(f"this engine was started in mode {self.mode!r}; a trained copy needs one started with "
                              "the GRPO run's needs (mode 'trained')")
        self.logprobs = self.sampling_logprobs

    def _perturbable(self, spec: PerturbationSpec) -> Any:
        problem = _perturbation_problem(self.sleep, self.tensor_parallel_size)
        if problem:
            raise Unsupported(problem)
        wanted: Mode = "lowrank" if spec.noise == "lowrank" else "perturb"
        if self.mode != wanted:
            raise Unsupported(f"this engine was started in mode {self.mode!r}; es.noise={spec.noise} needs one started "
                              f"with the ES run's needs (mode {wanted!r}: make_generator(config, optimizer.needs()))")
        return self.mover.perturbable(spec)

    # -- sampling ------------------------------------------------------------------------------------
    def _sampling_params(self, n: int, seed: int | None, vllm: Any) -> Any:
        return vllm.SamplingParams(**sampling_arguments(self.sampling, n, seed, self.logprobs))

    def _population(self, tasks: Sequence[Task], members: Sequence[Variant], seed: int | None
                    ) -> Iterator[list[Completion]]:
        """Every low-rank member in one generation pass, each request tagged with its member's LoRA slot."""
        if not tasks:
            return
        from vllm.lora.request import LoRARequest

        self.mover.load([(v.seed, v.sign) for v in members])
        if self._episodes is not None:  # each episode keeps its member's LoRA slot through every turn
            from vllm.lora.request import LoRARequest

            slots = [LoRARequest(f"vrl-member-{p}", p + 1, "vrl://lora-slot") for p in range(len(members))]
            yield self._episode_pass(tasks, [(v.index, v.samples_per_task, p) for p, v in enumerate(members)], seed, slots)
            return
        requests = []
        for p, v in enumerate(members):
            # Adapter p + 1 is pinned to the engine's slot for member p and never loaded from a path.
            lora = LoRARequest(f"vrl-member-{p}", p + 1, "vrl://lora-slot")
            requests += [(i, v.index, v.samples_per_task, lora) for i in range(len(tasks))]
        yield from self._run(tasks, requests, seed)

    def stream(
        self, tasks: Sequence[Task], n: int = 1, variant: int = 0, seed: int | None = None
    ) -> Iterator[list[Completion]]:
        """All prompts go to the engine at once; finished prompts are yielded `batch_size` at a time."""
        lora = self.mover.lora_request()  # the trained adapter, where the engine serves one
        if self._episodes is not None:
            if tasks:
                yield self._episode_pass(tasks, [(variant, n, -1)], seed, [], lora)
            return
        yield from self._run(tasks, [(i, variant, n, lora) for i in range(len(tasks))], seed)

    # -- episodes (vrl.episodes): turns streamed through the engine's running batch ----------------------
    def episodes(self, runner: Any) -> None:
        self._episodes = runner

    def _episode_pass(self, tasks: Sequence[Task], groups: Sequence[tuple[int, int, int]], seed: int | None,
                      slots: Sequence[Any], lora: Any = None) -> list[Completion]:
        """Every episode of `groups` (variant, samples per task, member: −1 or an index into `slots`) on `tasks`,
        all at once: each episode's turns are streamed through the engine's continuous batch (`_Turns`), a turn's
        prompt the last one's ids plus the new ones (prefix-cached), and an episode that ends is not sent again."""
        from vrl.episodes import Row

        if seed is None:
            seed = int.from_bytes(__import__("os").urandom(4), "little") >> 1
        rows = [Row(task=t, variant=variant, sample=j, seed=seed + i * n + j, member=member)
                for variant, n, member in groups for i, t in enumerate(tasks) for j in range(n)]
        self._wake()
        self.mover.before_pass()
        try:
            return self._episodes.run(rows, self.tokenizer, _Turns(self, slots, lora), self.sampling.chat_template_kwargs)
        finally:
            if self.sleep:
                self._sleep()

    def _prompts(self, tasks: Sequence[Task]) -> list[list[int]]:
        """Each task's prompt as token ids (as the hf backend encodes it), checked against max_model_len."""
        tok = self.tokenizer
        chat = self.sampling.chat_template_kwargs
        prompts = [tok(render_prompt(tok, t.prompt, chat), add_special_tokens=False)["input_ids"] for t in tasks]
        limit = getattr(getattr(self.llm, "model_config", None), "max_model_len", None)
        too_long = [(t.id, len(p)) for t, p in zip(tasks, prompts) if limit and len(p) >= limit]
        if too_long:  # vLLM would reject the whole batch with an error about one request
            task_id, length = too_long[0]
            raise ValueError(
                f"{len(too_long)} of {len(tasks)} prompts leave no room to generate within generator.vllm.max_model_len="
                f"{limit} (task {task_id!r}: {length} prompt tokens); raise generator.vllm.max_model_len (up to the "
                "model's context length) or shorten the prompts"
            )
        return prompts

    def _enqueue(self, prompts: list[list[int]], params: list[Any], loras: list[Any]) -> list[str]:
        """Add token-id prompts to the engine's running batch (each with its sampling params and LoRA request or
        None), the prefix cache salted by the weights' version; the request ids their outputs will carry."""
        salt = f"vrl-weights-{self._weights_version}"
        extra = {"lora_request": loras} if any(loras) else {}
        internal = self.llm.enqueue([{"prompt_token_ids": p, "cache_salt": salt} for p in prompts], params,
                                    use_tqdm=False, **extra)
        # enqueue returns the engine's internal ids ("<id>-<random suffix>"); outputs carry "<id>".
        return [rid.rsplit("-", 1)[0] if "-" in rid else rid for rid in internal]

    def _run(self, tasks: Sequence[Task], requests: Sequence[tuple[int, int, int, Any]], seed: int | None,
             task_of: dict[int, int] | None = None) -> Iterator[list[Completion]]:
        """Send every request (task index, variant, samples n, LoRA request or None) to the engine at once;
        yield finished completions `batch_size` prompts' worth at a time (`task_of`, if given, gets each
        completion's task index by the completion's id())."""
        import vllm

        if not tasks or not requests:
            return
        self._wake()
        self.mover.before_pass()
        prompts = self._prompts(tasks)
        # Seed of prompt i's sample j is seed + i·n + j (vLLM adds j): distinct across prompts and samples,
        # and the same for every variant (members share their random numbers).
        params = [self._sampling_params(n, None if seed is None else seed + i * n, vllm) for i, _, n, _ in requests]
        ids = self._enqueue([prompts[i] for i, *_ in requests], params, [lora for *_, lora in requests])
        position = {rid: k for k, rid in enumerate(ids)}
        engine = self.llm.llm_engine
        open_ids = set(ids)
        ready: list[Completion] = []
        per_batch = self.sampling.batch_size * max(n for _, _, n, _ in requests)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished or out.request_id not in position:
                        continue
                    open_ids.discard(out.request_id)
                    i, variant, _, _ = requests[position[out.request_id]]
                    done = [self._completion(tasks[i], prompts[i], o, variant) for o in out.outputs]
                    if task_of is not None:
                        task_of.update((id(c), i) for c in done)
                    ready += done
                    if len(ready) >= per_batch:
                        yield ready
                        ready = []
            if open_ids:
                raise RuntimeError(f"the vLLM engine went idle with {len(open_ids)} of {len(ids)} prompts unanswered")
            if ready:
                yield ready
        finally:
            if open_ids:  # the consumer stopped early: do not leave requests running in the engine
                engine.abort_request(sorted(open_ids))
        if self.sleep:
            self._sleep()

    def generate(
        self, tasks: Sequence[Task], n: int = 1, variant: int = 0, seed: int | None = None
    ) -> list[Completion]:
        """All completions for `tasks`, in task order, n per task (the engine finishes them in any order). Each
        completion is put back by its task's position, so tasks that share an id keep their own completions."""
        if self._episodes is not None:  # episodes come back in row order
            return [c for batch in self.stream(tasks, n=n, variant=variant, seed=seed) for c in batch]
        task_of: dict[int, int] = {}  # id(completion) → its task's index
        lora = self.mover.lora_request()
        out = [c for batch in self._run(tasks, [(i, variant, n, lora) for i in range(len(tasks))], seed, task_of)
               for c in batch]
        return sorted(out, key=lambda c: (task_of[id(c)], c.sample))

    def _completion(self, task: Task, prompt_ids: list[int], out: Any, variant: int) -> Completion:
        if out.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a completion of task {task.id!r} with reason {out.finish_reason!r}")
        token_ids = list(out.token_ids)
        text, stopped = cut_at_stop(self.tokenizer.decode(token_ids, skip_special_tokens=True), self.sampling.stop)
        if stopped:  # the engine's detokenizer may see the stop a few byte tokens late
            token_ids = tokens_covering(self.tokenizer, token_ids, text)
        return Completion(
            task_id=task.id,
            text=text,
            variant=variant,
            sample=out.index,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(token_ids),
            finish_reason=out.finish_reason,
            prompt_token_ids=list(prompt_ids),
            token_ids=token_ids,
            logprobs=sampled_logprobs(out.logprobs, token_ids) if self.logprobs and out.logprobs is not None else None,
        )

    # -- engine control ------------------------------------------------------------------------------
    def rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a method of the engine's worker extension (its mode's) on every worker."""
        return self.llm.collective_rpc(method, args=args)

    def weights_changed(self) -> None:
        """Cached prompt KV was computed with the old weights: later prompts carry a new cache salt, so
        prefix caching never reuses it (stale blocks are evicted as space is needed). Free, where
        `reset_prefix_cache` walks every KV block of the engine (4–7 ms per call at 1.5B)."""
        self._weights_version += 1

    def _sleep(self) -> None:
        # Level 2 drops the weights too: fine when every wake-up is followed by a full weight push (not
        # when only an adapter is pushed: the base weights must survive the sleep).
        full_push = self.mode == "trained" and self.weight_transfer != "adapter"
        level = 2 if self.sync_every == 1 and full_push else 1
        self.llm.sleep(level=level)
        self._asleep = level

    def _wake_up(self, tags: list[str] | None) -> None:
        """Give the engine its memory back; training's cached blocks are released first."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # freed activations and gradients still sit in torch's cache
        try:
            self.llm.wake_up(tags)
        except Exception as exc:
            if "out of memory" not in str(exc).lower():
                raise
            raise RuntimeError(
                "the vLLM engine could not take its GPU memory back after the training step: training keeps "
                "about 16 bytes per trained parameter (fp32 masters, their gradients, AdamW state) plus the "
                "activations of a micro-batch. Lower generator.vllm.gpu_memory_utilization, or shrink training with "
                "grpo.gradient_checkpointing=true, a smaller grpo.micro_batch_size or grpo.use_peft=true."
            ) from exc

    def _wake(self, tags: list[str] | None = None) -> None:
        if self._asleep:
            self._wake_up(tags)
            if tags is None or "kv_cache" in tags:
                self._asleep = False
            self.weights_changed()

    def decouple(self) -> None:
        """Asynchronous rollouts (`grpo.max_staleness` > 0): nothing to change in mode 'trained', whose
        trained copy is already separate from the engine's weights (`publish` pushes it); `vrl.rollouts`
        keeps a push from running while a pass samples. Other modes refuse."""
        if self.mode != "trained":
            raise Unsupported(f"this engine was started in mode {self.mode!r}; asynchronous rollouts need one started "
                              "with the GRPO run's needs (mode 'trained')")

    # -- weights pushed whole (GRPO) -----------------------------------------------------------------
    def publish(self, model: torch.nn.Module | Mapping[str, torch.Tensor] | WeightStream) -> None:
        """Push `model` (the trained copy, tensors by checkpoint name, or a `WeightStream` of them) into the
        engine (modes 'trained' and 'sample'): on the first call, then every `sync_every` calls."""
        if not hasattr(self.mover, "publish"):
            raise Unsupported(f"this engine was started in mode {self.mode!r}, whose weights move by ES; weights are "
                              "pushed whole only into engines started for GRPO or for sampling")
        self.mover.publish(model)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            core = getattr(llm.llm_engine, "engine_core", None)
            if hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
            # Those that ended are forgotten; one that outlived the shutdown stays the watchdog's to end.
            ended = {p for p in self._processes if not reaper.alive(p)}
            reaper.release(ended)
            self._processes -= ended
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self._cleanup:
            shutil.rmtree(self._cleanup, ignore_errors=True)
            self._cleanup = None


def _perturbation_problem(sleep: bool, tensor_parallel_size: int) -> str | None:
    """Why an engine with these settings cannot be perturbed in place (ES), or None."""
    if sleep:
        return ("generator.vllm.sleep frees the engine's memory for training between generation passes; it only "
                "helps optimizer=grpo (ES perturbs the engine itself). Set generator.vllm.sleep=false.")
    if tensor_parallel_size > 1:
        return ("ES perturbs the engine's weights in place, which needs the whole model in one worker: set "
                "generator.vllm.tensor_parallel_size=1 (ES runs members on separate engines, not one member on several)")
    return None


@contextlib.contextmanager
def _visible_gpu(gpu: str | None) -> Iterator[list[str] | None]:
    """Start an engine on GPU `gpu` (an index among this process's visible GPUs).

    The engine's processes, spawned inside this block, see every GPU with `gpu` first, so the engine
    runs there and can still open CUDA IPC handles of tensors on the others (GRPO's weight push;
    `vllm_trained._share` translates device ordinals). Yields the engine's order of physical ids (None: unchanged).
    """
    if gpu is None:
        yield None
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = _engine_order(gpu)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(order)
    try:
        yield order
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def expandable_segments(environ: Mapping[str, str] | None = None) -> bool:
    """Whether PyTorch's CUDA allocator is set to expandable segments by `PYTORCH_CUDA_ALLOC_CONF` or
    `PYTORCH_ALLOC_CONF` (its newer name): either of them, the option's last setting in each."""
    env = os.environ if environ is None else environ
    found = False
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        on = False
        for item in env.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                on = value.strip().lower() == "true"
        found = found or on
    return found


def _engine_order(gpu: str | None) -> list[str]:
    """The physical ids of this process's GPUs in the order an engine started on GPU `gpu` (an index among
    them; None: as they are) sees them: `gpu` first (`_visible_gpu`)."""
    from vrl.generate.vllm_trained import visible_ids

    ids = visible_ids()
    if gpu is None:
        return ids
    index = int(gpu)
    if not 0 <= index < len(ids):
        raise ValueError(f"runtime.local.gpus names GPU {gpu}, but this process sees {len(ids)} GPU(s): {ids}")
    return [ids[index]] + [i for i in ids if i != ids[index]]


def _current_gpu() -> int:
    """The GPU a bare `cuda` device means in this process: the current one (under torchrun, each rank's
    `LOCAL_RANK`, set by `distributed.start`), 0 without CUDA."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _weight_transfer(choice: str, mode: Mode, gpu: str | None, train_device: str, tensor_parallel_size: int,
                     adapter_rank: int = 0) -> str:
    """`vllm_trained.transfer_for` for an engine about to start on GPU `gpu` (an index among this
    process's GPUs; None: the first) with the trained copy on `train_device`, training a LoRA adapter
    of rank `adapter_rank` (0: none)."""
    from vrl.generate.vllm_trained import transfer_for, visible_ids

    ids = visible_ids()
    engine = _engine_order(gpu)[:tensor_parallel_size]
    train = None
    if train_device.startswith("cuda"):
        index = int(train_device.partition(":")[2] or _current_gpu())
        train = ids[index] if index < len(ids) else None
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    try:
        return transfer_for(choice, mode, engine_gpus=engine, train_gpu=train, in_process=in_process,  # type: ignore[arg-type]
                            adapter=adapter_rank, launched=distributed.world_size() > 1)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _load_tokenizer(path: str, revision: str | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, revision=revision)


class _Turns:
    """Episode turns streamed through a vLLM engine (`vrl.episodes.TurnStream`): `submit` adds requests to the
    engine's running batch, `step` runs one engine step and hands back the turns it finished. Row r samples
    with seed `seeds[r]` (vLLM's per-request generator: the same whichever requests share a step) under its
    member's LoRA slot."""

    def __init__(self, gen: VLLMGenerator, slots: Sequence[Any], lora: Any = None):
        self.gen, self.slots, self.lora = gen, slots, lora
        self.engine = gen.llm.llm_engine
        self.waiting: dict[str, tuple[int, list[int]]] = {}  # vLLM's request id → (key, the sequence it continues)

    def submit(self, keys: list[int], sequences: list[list[int]], seeds: list[int | None], members: list[int]) -> None:
        import vllm

        params = [self.gen._sampling_params(1, s, vllm) for s in seeds]
        loras = [self.slots[m] if m >= 0 else self.lora for m in members]
        for key, seq, rid in zip(keys, sequences, self.gen._enqueue(sequences, params, loras)):
            self.waiting[rid] = (key, seq)

    def busy(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[tuple[int, Any]]:
        from vrl.episodes import Sampled

        if not self.engine.has_unfinished_requests():
            raise RuntimeError(f"the vLLM engine went idle with {len(self.waiting)} turns unanswered")
        done = []
        for out in self.engine.step():
            if out.finished and out.request_id in self.waiting:
                key, seq = self.waiting.pop(out.request_id)
                c = self.gen._completion(Task(id="turn", prompt=""), seq, out.outputs[0], 0)
                done.append((key, Sampled(ids=c.token_ids, text=c.text, finish_reason=c.finish_reason, logprobs=c.logprobs,
                                          raw=self.gen.tokenizer.decode(c.token_ids, skip_special_tokens=False))))
        return done

    def abort(self) -> None:
        if self.waiting:
            self.engine.abort_request(sorted(self.waiting))
            self.waiting.clear()
