"""The `hf` generator: batched sampling with transformers on CPU or GPU.

Prompts are left-padded so a batch decodes together with the KV cache; `n` samples per prompt come
from `num_return_sequences`. Token ids are kept on each completion so training sees exactly what
was sampled.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import Field

from vrl.config import Section
from vrl.errors import DeviceUnavailable
from vrl.generate.base import Generator, cut_at_stop, shard_seed, tokens_covering
from vrl.policy import HostNeeds, PerturbationSpec, Trainable, Variant
from vrl.types import Completion, Prompt, Task

# torch and the weights layer are imported in the functions that use them: the registry imports this
# module for `HFGenerator.Config`, and `vrl plugins` must not load torch (issue 28).
if TYPE_CHECKING:
    import torch

TINY = "tiny"
_GLOBAL_RNG = threading.Lock()


def resolve_device(device: str, setting: str = "generator.device") -> torch.device:
    """The torch device for a config value ('auto', 'cpu', 'cuda', 'cuda:1'); `DeviceUnavailable` (one
    line naming `setting` and the fix) for a GPU this machine does not have."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise DeviceUnavailable(f"{setting}={device!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(f"{setting}={device!r} but no CUDA GPU is available; use 'cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceUnavailable(f"{setting}={device!r} but this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                                f"numbered from 0; use one of them or 'auto'")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_model_and_tokenizer(name: str, device: str = "auto", dtype: str = "auto", revision: str | None = None):
    """Load a causal LM and its tokenizer ('tiny' builds one locally), ready for left-padded batches."""
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if name == TINY:
        from vrl.generate import tiny

        model, tokenizer = tiny.build_model(), tiny.build_tokenizer()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from vrl.gguf import is_gguf, resolve

        if is_gguf(name):  # a GGUF file: its Hugging Face folder, converted once in this dtype (vrl/gguf.py)
            name, revision = resolve(name, str(torch_dtype).removeprefix("torch.")), None
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
            model = AutoModelForCausalLM.from_pretrained(name, revision=revision, dtype=torch_dtype)
        except OSError as exc:
            raise RuntimeError(
                f"cannot load model {name!r}: {exc}\n"
                "Give a Hugging Face model id (with network access or a warm cache) or a local directory, "
                "or use --model tiny to build a small local model."
            ) from exc
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(device=dev, dtype=torch_dtype).eval()
    return model, tokenizer


def meta_model(name: str, revision: str | None = None) -> torch.nn.Module:
    """The model's module tree without its weights (on the meta device): parameter names and shapes,
    no memory; `tiny` is built as it is (a few thousand parameters)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == TINY:
        from vrl.generate import tiny

        return tiny.build_model()
    from vrl.gguf import is_gguf, resolve_any

    if is_gguf(name):  # a GGUF file: the config of its converted folder (any dtype's)
        name, revision = resolve_any(name), None
    cfg = AutoConfig.from_pretrained(name, revision=revision)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def render_prompt(tokenizer: Any, prompt: Prompt, chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """Text for the model: chat messages go through the tokenizer's chat template, with `chat_template_kwargs`
    (`sampling.chat_template_kwargs`); the episodes' first prompt renders the same way (`vrl.episodes.render`)."""
    from vrl.episodes import render

    return render(tokenizer, prompt, None, chat_template_kwargs)


def cpu_threads(threads: int | None, model: str, device: torch.device) -> int | None:
    """Torch intra-op threads for a run: the configured number, else 1 for the tiny model on CPU.

    The tiny model's matrices are too small to gain from a thread pool, and when other processes keep
    the cores busy, torch's default of one thread per core waits on descheduled threads at every op
    (an iteration of `letters` went from about 3 s to 16-30 s on 2 busy cores). None: leave torch alone.
    """
    if threads is not None:
        return threads
    if model == TINY and device.type == "cpu":
        return 1
    return None


def generation_arguments(sampling: Any, tokenizer: Any, *, sample: bool) -> dict[str, Any]:
    """`model.generate`'s keyword arguments for a `SamplingConfig`: one complete `GenerationConfig`.

    The one place every hf sampling path (and a multi-turn one) builds them. Every setting of
    `sampling` is written out, `generation_kwargs` on top (as TRL does), and `generate` must run
    under `own_generation_config`, so nothing comes from the checkpoint's `generation_config`
    (Qwen2.5-Instruct ships repetition_penalty 1.05 and top_k 20). `sample=False`: greedy decoding,
    which with `_RowSampler` as a logits processor samples (the row sampler applies the temperature
    and the truncations itself; the repetition penalty stays transformers' processor, which runs
    before it, skipping the prompts' left padding).
    """
    from transformers import GenerationConfig

    values = sampling.effective()
    fields: dict[str, Any] = dict(
        max_new_tokens=sampling.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        repetition_penalty=float(values["repetition_penalty"]),
        do_sample=sample,
        # Greedy: no warpers run, so their settings stay unset (transformers warns of set ones).
        temperature=float(values["temperature"]) if sample else None,
        top_p=float(values["top_p"]) if sample else None,
        top_k=int(values["top_k"]) if sample else None,
        min_p=values["min_p"] if sample else None,
    )
    fields.update({k: v for k, v in sampling.generation_kwargs.items() if k not in sampling.PROCESSORS})
    kwargs: dict[str, Any] = {"generation_config": GenerationConfig(**fields)}
    if sampling.stop:
        kwargs.update(stop_strings=list(sampling.stop), tokenizer=tokenizer)
    return kwargs


@contextlib.contextmanager
def own_generation_config(model: Any) -> Iterator[None]:
    """Inside the block the model's own `generation_config` is a blank one (its special token ids kept).

    transformers fills every setting a passed `GenerationConfig` leaves unset (None) from
    `model.generation_config`, so a checkpoint's sampling defaults (min_p, typical_p, suppressed
    tokens, ...) would otherwise reach the sampler; the model's config is put back after, so a saved
    checkpoint keeps it.
    """
    from transformers import GenerationConfig

    own = model.generation_config
    model.generation_config = GenerationConfig(**{k: getattr(own, k, None) for k in (
        "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")})
    try:
        yield
    finally:
        model.generation_config = own


class HFConfig(Section):
    """The `hf` backend (`generator.backend: hf`): transformers' `generate`, on CPU or GPU."""

    turn_cache: bool = Field(
        True,
        description="Episodes keep each turn's KV cache for the next turn (the next `generate` computes only the "
        "tokens after what its episode's row already holds: the environment's reply and what follows). Off: every "
        "turn recomputes the whole sequence (the same tokens, up to floating-point effects). Not used with a "
        "repetition penalty (sampling.repetition_penalty != 1), which would see the cache's masked positions.",
    )

    threads: int | None = Field(
        None, ge=1,
        description="torch's intra-op CPU threads, set process-wide when the model loads. None: 1 for the "
        "tiny model on CPU (its matrices gain nothing from more, and one thread per core is many times slower "
        "when other processes keep the cores busy; docs/config.md); other models keep torch's default (one per "
        "core), as does GPU generation.",
    )


def _load(config: Any, device: str) -> tuple[Any, Any]:
    """The run's model and tokenizer on `device`, with the run's CPU threads (set process-wide: GRPO's
    training step on CPU runs with the same pool)."""
    g = config.generator
    threads = cpu_threads(g.hf.threads, config.model, resolve_device(device))
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return load_model_and_tokenizer(config.model, device, g.dtype, g.revision)


class HFGenerator(Generator):
    """Sampling with `model.generate`. The model is the one optimizers train or perturb, in place."""

    name = "hf"
    Config = HFConfig
    runs_episodes = True
    trains_elsewhere = True  # `publish` copies any weights in by name

    def __init__(self, model: Any, tokenizer: Any, sampling: Any):
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.train_device: Any = None  # where `decouple`'s training copy goes (None: the sampler's device)
        self._decoupled, self._train_model = False, None
        self.turn_cache = True  # episodes keep their KV cache across turns (`generator.hf.turn_cache`)
        self._weights_version = 0  # bumped by `publish`: a turn cache made before then is dropped

    @classmethod
    def from_config(cls, config: Any, needs: HostNeeds | None = None, *, gpu: str | None = None) -> HFGenerator:
        """The run's model on GPU `gpu` (default generator.device); `needs` asks nothing of this backend."""
        g = config.generator
        device = f"cuda:{gpu}" if gpu is not None else None
        model, tokenizer = _load(config, device or g.device)
        gen = cls(model, tokenizer, config.sampling)
        gen.train_device = resolve_device(g.device)
        gen.turn_cache = g.hf.turn_cache
        return gen

    @classmethod
    def trainable_elsewhere(cls, config: Any) -> Trainable:
        """The run's model on generator.device, loaded as `from_config` loads the engine's."""
        model, tokenizer = _load(config, config.generator.device)
        return Trainable(model, tokenizer, config.sampling, separate=True)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- how optimizers move the weights ------------------------------------------------------------
    def _perturbable(self, spec: PerturbationSpec) -> Any:
        from vrl.weights.lowrank import perturbable

        return perturbable(self.model, spec)  # FlatParams, or LowRankParams (its `layers` serve `_population`)

    def trainable(self) -> Trainable:
        if not self._decoupled:
            return Trainable(self.model, self.tokenizer, self.sampling)
        if self._train_model is None:  # made once, on generator.device: with runtime.local.gpus elsewhere, side by side
            import copy

            self._train_model = copy.deepcopy(self.model).to(self.train_device or self.device)
        return Trainable(self._train_model, self.tokenizer, self.sampling, separate=True)

    def decouple(self) -> None:
        """Asynchronous rollouts: `trainable()` becomes a copy of the model (made on first call, on
        `generator.device`), `self.model` changes only by `publish`, and sampling reports each token's
        log-prob under the distribution it was drawn from (`_RowSampler(record=True)`)."""
        if self._train_model is not None:
            raise RuntimeError("decouple() must come before trainable()")
        self._decoupled = True

    def publish(self, model: Any) -> None:
        """Sampling reads `self.model`; weights trained elsewhere (another host's model, tensors by
        checkpoint name, LoRA merged, or a `WeightStream` of them) are copied in."""
        if model is self.model:
            return
        import torch

        from vrl.weights.export import published_buckets

        own = dict(self.model.named_parameters())
        self._weights_version += 1
        with torch.no_grad():
            for bucket in published_buckets(model):  # checkpoint names, LoRA merged
                unknown = sorted({name for name, _ in bucket} - set(own))
                if unknown:
                    raise ValueError(f"published weights do not match the model: unknown {unknown[:3]}")
                for name, t in bucket:
                    own[name].copy_(t)

    def _population(self, tasks: Sequence[Task], members: Sequence[Variant], seed: int | None
                    ) -> Iterator[list[Completion]]:
        """All low-rank members in one `model.generate` per prompt batch (`hf_population.population`)."""
        if seed is None:  # still one seed for the whole call, so members share their random numbers
            import torch

            seed = int(torch.randint(0, 2**31 - 1, ()).item())
        size = self.sampling.batch_size
        for start in range(0, len(tasks), size):
            if self._episodes is not None:
                yield self._episode_population(tasks[start : start + size], start, members, seed)
            else:
                yield self._generate_population(tasks[start : start + size], start, members, seed)

    def stream(
        self, tasks: Sequence[Task], n: int = 1, variant: int = 0, seed: int | None = None
    ) -> Iterator[list[Completion]]:
        size = self.sampling.batch_size
        for start in range(0, len(tasks), size):
            if self._episodes is not None:
                yield self._episode_batch(tasks[start : start + size], n, variant, shard_seed(seed, start, n))
            else:
                yield self._generate_batch(tasks[start : start + size], n, variant, shard_seed(seed, start, n))

    # -- episodes (vrl.episodes): one turn of every live episode per `model.generate` --------------------
    def episodes(self, runner: Any) -> None:
        self._episodes = runner

    def _episode_batch(self, tasks: Sequence[Task], n: int, variant: int, seed: int | None) -> list[Completion]:
        """Episodes of `tasks`, n per task; row (i, j) starts from seed + i·n + j (`_RowSampler`), as
        `_generate_recorded` seeds a single turn."""
        from vrl.episodes import Row

        seed = _fresh_seed() if seed is None else seed
        rows = [Row(task=t, variant=variant, sample=j, seed=seed + i * n + j) for i, t in enumerate(tasks) for j in range(n)]
        cache = self._turn_cache()
        return self._episodes.run(rows, self.tokenizer, lambda ids, seeds, rm: self._continue(ids, seeds, rm, cache=cache),
                                  self.sampling.chat_template_kwargs)

    def _episode_population(self, tasks: Sequence[Task], start: int, members: Sequence[Variant], seed: int
                            ) -> list[Completion]:
        """Episodes of every low-rank member at once: each row keeps its member (its LoRA slot) through every
        turn, whichever rows share a turn's `model.generate`."""
        from vrl.episodes import Row

        rows = [Row(task=t, variant=v.index, sample=j, seed=seed + (start + i) * v.samples_per_task + j, member=p)
                for p, v in enumerate(members) for i, t in enumerate(tasks) for j in range(v.samples_per_task)]
        signs = [(v.seed, v.sign) for v in members]
        cache = self._turn_cache()
        return self._episodes.run(rows, self.tokenizer,
                                  lambda ids, seeds, rm: self._continue(ids, seeds, rm, signs, cache=cache),
                                  self.sampling.chat_template_kwargs)

    def _turn_cache(self) -> _TurnCache | None:
        """A KV cache for one batch of episodes (`generator.hf.turn_cache`). None with a repetition penalty:
        transformers' penalty reads every id of the row, and the cached rows' masked positions hold pad ids where
        a fresh pass has none, so the penalty (of the pad token, often EOS) would differ."""
        if not self.turn_cache or self.sampling.effective()["repetition_penalty"] != 1.0:
            return None
        return _TurnCache()

    def _continue(self, sequences: list[list[int]], seeds: list[int | None], row_member: list[int],
                  members: list[tuple[int, int]] | None = None, cache: _TurnCache | None = None) -> list[Any]:
        """One model turn for each token-id sequence (left-padded into one batch), row r drawn from its own
        generator seeded `seeds[r]`, so a row samples the same whichever rows share the call; with `members`
        (low-rank ES), row r runs member `row_member[r]`. With `cache` (one episode batch's `_TurnCache`), each row
        starts from the KV cache of the earlier turn its sequence continues and only its new tokens are computed.
        Returns `vrl.episodes.Sampled` per row."""
        import contextlib

        import torch

        from vrl.episodes import Sampled

        pad = self.tokenizer.pad_token_id
        if cache is not None and cache.version != self._weights_version:
            cache.reset()
        plan = cache.plan(sequences, row_member, pad) if cache is not None else None
        if plan is not None:
            rows_ids, rows_mask = plan
        else:
            width = max(len(x) for x in sequences)
            rows_ids = [[pad] * (width - len(x)) + x for x in sequences]
            rows_mask = [[0] * (width - len(x)) + [1] * len(x) for x in sequences]
        width = len(rows_ids[0])
        input_ids = torch.tensor(rows_ids, device=self.device)
        attention = torch.tensor(rows_mask, device=self.device)
        kwargs, sampler = self._row_sampled([_fresh_seed() if s is None else s for s in seeds], self._decoupled)
        if cache is not None:
            from transformers import DynamicCache

            if plan is None:
                cache.kv = DynamicCache(config=self.model.config)
            kwargs["cache"] = cache.kv
        with torch.inference_mode():
            if members:
                from vrl.generate.hf_population import population

                rows = population(self._params.layers, members, self._spec.sigma, self._spec.rank, row_member)
            else:
                rows = contextlib.nullcontext()
            with rows, own_generation_config(self.model):
                out = self.model.generate(input_ids=input_ids, attention_mask=attention, **kwargs)
            logps = sampler.sampled_logprobs(out).float().cpu() if sampler is not None and sampler.record else None
        sampled = []
        for r in range(len(sequences)):
            ids, text, finish = self._trim(out[r, width:].tolist())
            raw = self.tokenizer.decode(ids, skip_special_tokens=False)
            sampled.append(Sampled(ids=ids, text=text, raw=raw, finish_reason=finish,
                                   logprobs=logps[r, : len(ids)].tolist() if logps is not None else None))
        if cache is not None:
            cache.keep(sequences, rows_mask, [s.ids for s in sampled], row_member, self._weights_version)
        return sampled

    def _row_sampled(self, seeds: Sequence[int], record: bool = False) -> tuple[dict[str, Any], _RowSampler | None]:
        """`generate`'s arguments with row r drawn from its own generator seeded `seeds[r]` (`_RowSampler`:
        greedy over its Gumbel-perturbed scores, recording each drawn token's log-prob with `record`), and
        that sampler; at temperature 0, plain greedy decoding and no sampler."""
        kwargs = generation_arguments(self.sampling, self.tokenizer, sample=False)
        values = self.sampling.effective()
        if values["temperature"] <= 0:
            return kwargs, None
        from transformers import LogitsProcessorList

        sampler = _RowSampler(seeds, values, self.device, record=record)
        kwargs["logits_processor"] = LogitsProcessorList([sampler])
        return kwargs, sampler

    def _encode(self, tasks: Sequence[Task]) -> Any:
        texts = [render_prompt(self.tokenizer, t.prompt, self.sampling.chat_template_kwargs) for t in tasks]
        return self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)

    def _generate_population(self, tasks: Sequence[Task], start: int, members: Sequence[Variant], seed: int
                             ) -> list[Completion]:
        """Every member on `tasks` (positions start, start+1, ... of the call) in one `model.generate`.

        Rows are member-major (member, task, sample). Row (v, i, j) samples with its own generator
        seeded `seed + (start + i)·n_v + j` (`_RowSampler`), so what a row draws does not depend on
        which other rows share the batch: a pool of engines, each batching its share of the
        members, samples what one engine does (up to floating-point effects of the batch shape on
        the logits). Members share the per-(task, sample) random numbers, as full-rank members do.
        """
        import torch

        with torch.inference_mode():
            from vrl.generate.hf_population import population

            enc = self._encode(tasks)
            rows, row_member, row_seeds, meta = [], [], [], []
            for p, v in enumerate(members):
                for i in range(len(tasks)):
                    for j in range(v.samples_per_task):
                        rows.append(i)
                        row_member.append(p)
                        row_seeds.append(seed + (start + i) * v.samples_per_task + j)
                        meta.append((v.index, i, j))
            index = torch.tensor(rows, device=self.device)
            batch = {k: t.index_select(0, index) for k, t in enc.items()}
            kwargs, _ = self._row_sampled(row_seeds)
            members_st = [(v.seed, v.sign) for v in members]
            with population(self._params.layers, members_st, self._spec.sigma, self._spec.rank, row_member), \
                    own_generation_config(self.model):
                out = self.model.generate(**batch, **kwargs)
            return self._completions(tasks, enc, out, meta)

    def _generate_batch(self, tasks: Sequence[Task], n: int, variant: int, seed: int | None) -> list[Completion]:
        import torch

        sample = self.sampling.effective()["temperature"] > 0
        if self._decoupled and sample:
            return self._generate_recorded(tasks, n, variant, seed)
        with torch.inference_mode():
            enc = self._encode(tasks)
            # n rows per prompt (rather than num_return_sequences, which greedy decoding refuses).
            rows = {k: v.repeat_interleave(n, dim=0) for k, v in enc.items()}
            kwargs = generation_arguments(self.sampling, self.tokenizer, sample=sample)
            # transformers samples from torch's global RNG: hf engines of one process (a pool) take turns.
            with _GLOBAL_RNG, torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                    own_generation_config(self.model):
                if seed is not None:
                    torch.manual_seed(seed)
                out = self.model.generate(**rows, **kwargs)
            return self._completions(tasks, enc, out, [(variant, *divmod(row, n)) for row in range(out.shape[0])])

    def _generate_recorded(self, tasks: Sequence[Task], n: int, variant: int, seed: int | None) -> list[Completion]:
        """As `_generate_batch`, each row drawn by `_RowSampler` from its own generator (seed + row: no
        global RNG, which the training thread reseeds), with each sampled token's log-prob kept.

        The log-probs are vLLM's `processed_logprobs`: log-softmax of the logits after the repetition
        penalty, divided by the temperature and cut by top-k, top-p and min-p (renormalised over what is
        left), the distribution the token was drawn from; without truncations that is what GRPO's
        `completion_logprobs` computes.
        """
        import torch

        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, ()).item())
        with torch.inference_mode():
            enc = self._encode(tasks)
            rows = {k: v.repeat_interleave(n, dim=0) for k, v in enc.items()}
            count = rows["input_ids"].shape[0]
            kwargs, sampler = self._row_sampled([seed + r for r in range(count)], record=True)
            with own_generation_config(self.model):
                out = self.model.generate(**rows, **kwargs)
            logps = sampler.sampled_logprobs(out).float().cpu()
            completions = self._completions(tasks, enc, out, [(variant, *divmod(row, n)) for row in range(count)])
        for row, c in enumerate(completions):
            c.logprobs = logps[row, : len(c.token_ids)].tolist()
        return completions

    def _completions(self, tasks: Sequence[Task], enc: Any, out: torch.Tensor, rows: Sequence[tuple[int, int, int]]
                     ) -> list[Completion]:
        """One completion per output row; `rows[r]` is (variant, task index, sample) of row r."""
        prompt_len = enc["input_ids"].shape[1]
        completions = []
        for row, (variant, i, j) in enumerate(rows):
            prompt_ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
            completions.append(self._completion(tasks[i], prompt_ids, out[row, prompt_len:].tolist(), variant, j))
        return completions

    def _trim(self, new_ids: list[int]) -> tuple[list[int], str, str]:
        """A row's sampled ids cut after EOS or the first stop string, their text, and the finish reason."""
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        finish = "length"
        while new_ids and pad != eos and new_ids[-1] == pad:  # padding after a stop string
            new_ids.pop()
        if eos in new_ids:
            new_ids = new_ids[: new_ids.index(eos) + 1]
            finish = "stop"
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        text, stopped = cut_at_stop(text, self.sampling.stop)
        if stopped:  # keep only the tokens up to the stop string: GRPO trains on these ids
            new_ids, finish = tokens_covering(self.tokenizer, new_ids, text), "stop"
        return new_ids, text, finish

    def _completion(self, task: Task, prompt_ids: list[int], new_ids: list[int], variant: int, sample: int) -> Completion:
        new_ids, text, finish = self._trim(new_ids)
        return Completion(
            task_id=task.id,
            text=text,
            variant=variant,
            sample=sample,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(new_ids),
            finish_reason=finish,
            prompt_token_ids=prompt_ids,
            token_ids=new_ids,
        )


class _TurnCache:
    """The KV cache of one batch of episodes across its turns (`generator.hf.turn_cache`).

    After a turn, cache row j holds the keys and values of the positions `generate` saw: its left padding, its
    sequence, then the sampled tokens (past a row's end, the tokens sampled while the others went on: junk).
    `mask[j]` marks the positions that hold its sequence and its kept tokens (`valid[j]`, in order). The next
    turn's sequence r picks the row of its member holding the longest prefix of it and becomes: that row's
    positions, masked to the prefix (the rest, as padding, masked out and written as pad ids), then the
    sequence's remaining tokens, left-padded to a common width. `generate` computes only those; the position of
    each token is its count of unmasked positions before it, as when the cached ones were computed, so every
    cached key and value is what a fresh pass would compute (up to floating-point effects of the batch shape).
    A sequence no row holds a prefix of (an episode joining a later turn is still found: rows persist until the
    batch ends), or weights published since (`HFGenerator.publish`), make the turn recompute everything."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.kv: Any = None
        self.mask: list[list[int]] = []
        self.valid: list[list[int]] = []
        self.member: list[int] = []
        self.version = -1
        self.reused = 0  # tokens not computed again, over the batch's turns (measured by tests and benchmarks)

    def plan(self, sequences: list[list[int]], members: list[int], pad: int
             ) -> tuple[list[list[int]], list[list[int]]] | None:
        """The next turn's input ids and attention mask over the cache's positions and then the new tokens, with
        the cache's rows selected to match; None (and no cache) when some sequence continues no cached row."""
        if self.kv is None or not self.valid:
            self.reset()
            return None
        picks, lengths = [], []
        for seq, member in zip(sequences, members):
            best, length = -1, 0
            for j, valid in enumerate(self.valid):
                if self.member[j] != member:
                    continue
                n = _common_prefix(valid, seq)
                if n > length:
                    best, length = j, n
            if best < 0:
                self.reset()
                return None
            picks.append(best)
            lengths.append(min(length, len(seq) - 1))  # at least one new token for `generate` to compute
        tail = max(len(seq) - n for seq, n in zip(sequences, lengths))
        rows_ids, rows_mask = [], []
        for seq, j, n in zip(sequences, picks, lengths):
            ids, mask, used = [], [], 0
            for flag in self.mask[j]:
                keep = flag and used < n
                ids.append(seq[used] if keep else pad)
                mask.append(1 if keep else 0)
                used += bool(flag)
            rest = seq[n:]
            rows_ids.append(ids + [pad] * (tail - len(rest)) + rest)
            rows_mask.append(mask + [0] * (tail - len(rest)) + [1] * len(rest))
            self.reused += n
        import torch

        index = torch.tensor(picks, device=self.kv.layers[0].keys.device) if self.kv.layers else None
        for layer in self.kv.layers:
            layer.batch_select_indices(index)
        return rows_ids, rows_mask

    def keep(self, sequences: list[list[int]], rows_mask: list[list[int]], kept: list[list[int]], members: list[int],
             version: int) -> None:
        """Record what each row's cache holds after the turn: its sequence, then the kept tokens the cache has."""
        sampled = self.kv.get_seq_length() - len(rows_mask[0])  # the last sampled token was never fed back
        self.mask, self.valid = [], []
        for seq, mask, ids in zip(sequences, rows_mask, kept):
            k = max(0, min(len(ids), sampled))
            self.mask.append(mask + [1] * k + [0] * (sampled - k))
            self.valid.append(seq + ids[:k])
        self.member, self.version = list(members), version


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _fresh_seed() -> int:
    """A seed drawn from torch's global RNG, for a call that was given none."""
    import torch

    return int(torch.randint(0, 2**31 - 1, ()).item())


class _RowSampler:
    """Samples each batch row from its own seeded generator (Gumbel-max), for greedy `generate`.

    Scores (after transformers' repetition penalty, when one is set) are divided by the temperature
    and cut by top-k, top-p and min-p, in that order, as transformers' warpers do (each keeping at
    least one token); adding independent Gumbel noise and taking the argmax then draws from softmax
    of what is left. Each row's noise comes from a `torch.Generator` seeded with the row's seed and
    advanced once per step, so a row's draws do not depend on the rest of the batch.
    """

    def __init__(self, seeds: Sequence[int], values: Mapping[str, Any], device: torch.device, record: bool = False):
        import torch

        self.temperature, self.top_p = float(values["temperature"]), float(values["top_p"])
        self.top_k, self.min_p = int(values["top_k"]), values["min_p"]
        self.device = device
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        # record: the log-softmax of each step's processed scores, to read the sampled token's log-prob
        # at the next step (or in `sampled_logprobs`) once `generate` has appended it.
        self.record, self._last, self._taken = record, None, []

    def sampled_logprobs(self, sequences: torch.Tensor) -> torch.Tensor:
        """[rows, steps]: each sampled token's log-prob under the distribution it was drawn from (after
        `generate` returned `sequences`; rows that finished early have pad tokens, and junk, at the end)."""
        import torch

        taken = [*self._taken, self._last.gather(1, sequences[:, -1:]).squeeze(1)] if self._last is not None else []
        return torch.stack(taken, 1) if taken else torch.zeros(sequences.shape[0], 0)

    def processed(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores of the distribution a row draws from: temperature, then top-k, top-p, min-p (-inf: cut)."""
        import torch

        scores = scores.to(torch.float64) / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = scores.sort(dim=-1)
            cut = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - self.top_p
            cut[..., -1] = False
            scores = scores.masked_fill(cut.scatter(1, order, cut), float("-inf"))
        if self.min_p:
            probs = scores.softmax(dim=-1)
            cut = probs < self.min_p * probs.max(dim=-1, keepdim=True).values
            scores = scores.masked_fill(cut, float("-inf"))
        return scores

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        scores = self.processed(scores)
        if self.record:
            if self._last is not None:  # input_ids ends with the token drawn from the last step's scores
                self._taken.append(self._last.gather(1, input_ids[:, -1:]).squeeze(1))
            self._last = scores.log_softmax(dim=-1)
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, device=self.device, dtype=torch.float64)
                         for g in self.generators])
        gumbel = -torch.log(-torch.log(u.clamp(min=1e-300)))
        return scores + gumbel
