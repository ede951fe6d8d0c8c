"""How GRPO's trained weights reach a vLLM engine: the choice of transport (`transfer_for`), the
import of vLLM's IPC engine where ray is absent, and the trainer's side of vLLM's native weight-transfer
protocol (`NativeTransfer`).

vLLM cannot run here (no GPU): the protocol tests put stand-ins for vLLM's modules in `sys.modules`
that keep vLLM 0.26's documented rules (`start_weight_update` before `update_weights`, one
`finish_weight_update` per session; with NCCL the workers' `update_weights` and the trainer's
broadcast are one collective, so neither returns until the other side runs: a sender that waited for
`update_weights` before broadcasting would hang, which the stand-ins turn into a failure). The real
engines run in the GPU tests (tests/test_vllm_gpu.py) and benchmarks/weight_sync.py.
"""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch

from vrl.generate.vllm_trained import NativeTransfer, ipc_engine_module, transfer_for

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


@pytest.mark.parametrize(("choice", "mode", "engine", "train", "in_process", "expected"), [
    ("auto", "trained", ["0"], "0", False, "ipc"),            # colocated: one worker on the trainer's GPU
    ("auto", "trained", ["1"], "0", False, "nccl"),           # separate GPU
    ("auto", "trained", ["1", "2"], "0", False, "nccl"),      # tensor-parallel engine beside the trainer
    ("auto", "trained", ["0", "1"], "0", False, "extension"),  # TP including the trainer's GPU: no NCCL
    ("auto", "trained", ["0"], "0", True, "extension"),       # engine in this process: no IPC to itself
    ("auto", "trained", ["0"], None, False, "extension"),     # trained copy on the CPU
    ("auto", "sample", ["0"], "0", False, "extension"),       # ready tensors (Modal workers, evaluation)
    ("extension", "trained", ["0"], "0", False, "extension"),
    ("ipc", "trained", ["0"], "0", False, "ipc"),
    ("nccl", "trained", ["1"], "0", False, "nccl"),
])
def test_transfer_for_picks_the_transport_that_can_reach_the_engine(choice, mode, engine, train, in_process, expected):
    assert transfer_for(choice, mode, engine_gpus=engine, train_gpu=train, in_process=in_process) == expected


@pytest.mark.parametrize(("choice", "mode", "engine", "train", "in_process", "reason"), [
    ("ipc", "trained", ["1"], "0", False, "one worker on the trainer's GPU"),
    ("ipc", "trained", ["0", "1"], "0", False, "one worker on the trainer's GPU"),
    ("nccl", "trained", ["0"], "0", False, "GPUs other than the trainer's"),
    ("nccl", "sample", ["1"], "0", False, "only in mode 'trained'"),
    ("ipc", "trained", ["0"], "0", True, "runs in this process"),
    ("nccl", "trained", ["1"], None, False, "not on a GPU"),
])
def test_an_explicit_transport_that_cannot_work_is_refused_with_the_reason(choice, mode, engine, train, in_process, reason):
    with pytest.raises(ValueError, match=reason) as exc:
        transfer_for(choice, mode, engine_gpus=engine, train_gpu=train, in_process=in_process)
    assert "weight_transfer" in str(exc.value)


def _package(tmp_path, body: str) -> None:
    """A stand-in `vllm.distributed.weight_transfer.ipc_engine` with `body` as its source."""
    pkg = tmp_path / "vllm" / "distributed" / "weight_transfer"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "distributed", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "ipc_engine.py").write_text(body)


@pytest.fixture
def fake_vllm_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in saved:
        del sys.modules[k]
    yield tmp_path
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        del sys.modules[k]
    sys.modules.update(saved)


@pytest.mark.skipif("ray" in sys.modules or __import__("importlib").util.find_spec("ray") is not None,
                    reason="ray is installed here: the stand-in is never needed")
def test_vllms_ipc_engine_imports_without_ray_and_leaves_no_ray_behind(fake_vllm_path):
    """vLLM 0.26's ipc_engine.py imports ray at its top (only its 'ray' send mode uses it; vLLM does
    not depend on ray). The module imports; no later `import ray` sees a stand-in; a use of ray says so."""
    _package(fake_vllm_path, "import ray\n\ndef send_by_ray():\n    return ray.get([])\n\nSENDS = 'ipc'\n")
    module = ipc_engine_module()
    assert module.SENDS == "ipc"
    assert "ray" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        import ray  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match=r"ray is not installed .*ray\.get"):
        module.send_by_ray()


def test_a_different_missing_module_is_not_papered_over(fake_vllm_path):
    _package(fake_vllm_path, "import vrl_no_such_module_either\n")
    with pytest.raises(ModuleNotFoundError, match="vrl_no_such_module_either"):
        ipc_engine_module()


class _Engine:
    """A stand-in for `vllm.LLM`'s weight-transfer methods that enforces their order; `update_weights`
    of the NCCL backend is a collective: it waits for the trainer's broadcast (`broadcast`)."""

    def __init__(self):
        self.calls: list[str] = []
        self.broadcast = threading.Event()
        self.received: list[dict] = []
        self.joined = threading.Event()
        self._active = False

    def init_weight_transfer_engine(self, request):
        self.calls.append("init")
        assert self.joined.wait(5), "the trainer never joined the NCCL group"
        self.init_info = request["init_info"]

    def start_weight_update(self):
        assert not self._active, "start_weight_update while an update is active"
        self._active = True
        self.calls.append("start")

    def update_weights(self, request):
        assert self._active, "update_weights before start_weight_update"
        self.calls.append("update")
        assert self.broadcast.wait(5), "the trainer never broadcast"
        self.broadcast.clear()
        self.received.append(request["update_info"])

    def finish_weight_update(self):
        assert self._active, "finish_weight_update without start_weight_update"
        self._active = False
        self.calls.append("finish")


@pytest.fixture
def fake_nccl(monkeypatch):
    """vLLM's NCCL engine and open-port helper as stand-ins: `trainer_init` joins the engine's group,
    `trainer_send_weights` 'broadcasts' (records the tensors, releases the engine's `update_weights`)."""
    sent: list[list[tuple[str, torch.Tensor]]] = []
    engines: list[_Engine] = []

    class NCCLWeightTransferEngine:
        @staticmethod
        def trainer_init(info):
            engines[-1].joined.set()
            return ("group", info["world_size"])

        @staticmethod
        def trainer_send_weights(iterator, args):
            assert args["group"][0] == "group" and args["packed"] is True
            sent.append(list(iterator))
            engines[-1].broadcast.set()

    nccl = types.ModuleType("vllm.distributed.weight_transfer.nccl_engine")
    nccl.NCCLWeightTransferEngine = NCCLWeightTransferEngine
    net = types.ModuleType("vllm.utils.network_utils")
    net.get_open_port = lambda: 29517
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer", "vllm.utils"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, nccl.__name__, nccl)
    monkeypatch.setitem(sys.modules, net.__name__, net)
    return sent, engines


def test_nccl_transfer_joins_once_and_broadcasts_beside_the_workers_receive(fake_nccl):
    """The trainer joins the group on its first push (rank 0; the engine's workers are ranks 1..), then
    every push is start → (update_weights beside the broadcast) → finish, with each weight's name,
    dtype and shape announced to the workers in the order it is broadcast."""
    sent, engines = fake_nccl
    engine = _Engine()
    engines.append(engine)
    transfer = NativeTransfer(engine, "nccl", "cpu", workers=2)
    weights = [("a.weight", torch.ones(2, 3, dtype=torch.bfloat16)), ("b.bias", torch.zeros(4))]
    transfer.send([weights])
    transfer.send([weights])
    assert engine.calls == ["init", "start", "update", "finish", "start", "update", "finish"]
    assert engine.init_info == {"master_address": "127.0.0.1", "master_port": 29517, "world_size": 3, "rank_offset": 1}
    assert engine.received[0] == {"names": ["a.weight", "b.bias"], "dtype_names": ["bfloat16", "float32"],
                                  "shapes": [[2, 3], [4]], "packed": True}
    assert [[n for n, _ in s] for s in sent] == [["a.weight", "b.bias"]] * 2
    assert all(t is w for s in sent for (_, t), (_, w) in zip(s, weights))  # the tensors themselves: no copy


def test_a_push_in_buckets_is_one_update_session_with_one_broadcast_per_bucket(fake_nccl):
    """Weights streamed in buckets (a sharded trainer's publish) go in one session: start → per bucket,
    its names announced and its tensors broadcast → finish."""
    sent, engines = fake_nccl
    engine = _Engine()
    engines.append(engine)
    transfer = NativeTransfer(engine, "nccl", "cpu", workers=1)
    transfer.send(iter([[("a", torch.ones(2))], [("b", torch.zeros(3)), ("c", torch.ones(1))]]))
    assert engine.calls == ["init", "start", "update", "update", "finish"]
    assert [r["names"] for r in engine.received] == [["a"], ["b", "c"]]
    assert [[n for n, _ in s] for s in sent] == [["a"], ["b", "c"]]


def test_a_failed_push_still_finishes_the_update_session(fake_nccl):
    """A push that fails on the trainer's side ends the engine's update session, so that the next push
    can start one (vLLM refuses a second `start_weight_update` while one is active)."""
    sent, engines = fake_nccl
    engine = _Engine()
    engines.append(engine)
    transfer = NativeTransfer(engine, "nccl", "cpu", workers=1)
    transfer.send([[("a", torch.ones(1))]])

    def broken(iterator, args):
        engine.broadcast.set()  # the workers got something; the trainer then fails
        raise RuntimeError("NCCL error: unhandled system error")

    sys.modules["vllm.distributed.weight_transfer.nccl_engine"].NCCLWeightTransferEngine.trainer_send_weights = broken
    with pytest.raises(RuntimeError, match="NCCL error"):
        transfer.send([[("a", torch.ones(1))]])
    assert engine.calls[-1] == "finish" and not engine._active


# -- the LoRA adapter alone ('adapter') ----------------------------------------------------------------------
@pytest.mark.parametrize(("choice", "adapter", "engine", "train", "expected"), [
    ("adapter", 16, ["0"], "0", "adapter"),     # asked for: the engine serves the adapter
    ("adapter", 16, ["1"], "0", "adapter"),     # on another GPU too (the factors go as CUDA IPC handles)
    ("auto", 16, ["0"], "0", "ipc"),            # by default a LoRA run pushes W + ΔW merged (faster, measured)
    ("auto", 16, ["1"], "0", "nccl"),
    ("ipc", 16, ["0"], "0", "ipc"),
    ("extension", 16, ["0"], "0", "extension"),
])
def test_a_lora_run_pushes_its_adapter_alone_where_asked_and_merged_by_default(choice, adapter, engine, train, expected):
    assert transfer_for(choice, "trained", engine_gpus=engine, train_gpu=train, adapter=adapter) == expected


@pytest.mark.parametrize(("mode", "adapter", "reason"), [
    ("trained", 0, "use_peft is off"),
    ("trained", 1024, "above the largest rank"),
])
def test_an_adapter_transfer_without_a_servable_adapter_is_refused(mode, adapter, reason):
    with pytest.raises(ValueError, match=reason):
        transfer_for("adapter", mode, engine_gpus=["0"], train_gpu="0", adapter=adapter)
    with pytest.raises(ValueError, match="tensor-parallel"):  # the factors go whole into one worker's slot
        transfer_for("adapter", "trained", engine_gpus=["0", "1"], train_gpu="0", adapter=16)


def test_rank_0_of_a_torchrun_launch_pushes_through_vrls_loader_not_vllms_ipc(monkeypatch):
    """vLLM 0.26's IPC sender all-gathers the trainer's handles over the default process group when one
    is initialised (every rank must call it), but under torchrun only rank 0 pushes: `auto` picks vrl's
    loader there, an explicit ipc is refused with the reason; NCCL (its own group) stays available."""
    from vrl.errors import UsageError
    from vrl.generate import vllm_trained
    from vrl.generate.vllm import _weight_transfer

    assert transfer_for("auto", "trained", engine_gpus=["0"], train_gpu="0", launched=True) == "extension"
    assert transfer_for("auto", "trained", engine_gpus=["1"], train_gpu="0", launched=True) == "nccl"
    with pytest.raises(ValueError, match="torchrun launch"):
        transfer_for("ipc", "trained", engine_gpus=["0"], train_gpu="0", launched=True)
    monkeypatch.setattr(vllm_trained, "visible_ids", lambda: ["0", "1"])
    assert _weight_transfer("auto", "trained", None, "cuda", 1) == "ipc"  # one process
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets
    assert _weight_transfer("auto", "trained", None, "cuda", 1) == "extension"
    with pytest.raises(UsageError, match="torchrun launch"):
        _weight_transfer("ipc", "trained", None, "cuda", 1)


def test_a_bare_cuda_device_is_this_ranks_gpu_not_the_first(monkeypatch):
    """Under torchrun rank 1 trains on its current GPU (`LOCAL_RANK`), which the config spells `cuda`.
    With `grpo.sample_on_every_rank` its engine starts on that GPU too: the push must stay on the GPU
    (vrl's loader), not pick NCCL as if the trainer were on GPU 0. NCCL with both ends on one GPU
    failed on 2 × H200 with "NCCL error: invalid usage" (session 13)."""
    from vrl.generate import vllm, vllm_trained
    from vrl.generate.vllm import _weight_transfer

    monkeypatch.setattr(vllm_trained, "visible_ids", lambda: ["0", "1"])
    monkeypatch.setattr(vllm, "_current_gpu", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _weight_transfer("auto", "trained", "1", "cuda", 1) == "extension"
    assert _weight_transfer("auto", "trained", "0", "cuda", 1) == "nccl"  # its engine on the other GPU
    assert _weight_transfer("auto", "trained", "1", "cuda:0", 1) == "nccl"  # an explicit index is kept


def test_the_adapters_rank_reaches_the_choice_of_transport(monkeypatch):
    """An engine about to start hands the adapter's rank (not only whether there is one) to `transfer_for`:
    a rank above vLLM's largest is refused before the engine starts, with the reason."""
    from vrl.errors import UsageError
    from vrl.generate import vllm_trained
    from vrl.generate.vllm import _weight_transfer

    monkeypatch.setattr(vllm_trained, "visible_ids", lambda: ["0"])
    assert _weight_transfer("adapter", "trained", None, "cuda", 1, adapter_rank=16) == "adapter"
    with pytest.raises(UsageError, match="lora_r=1024 is above the largest rank"):
        _weight_transfer("adapter", "trained", None, "cuda", 1, adapter_rank=1024)


def _lora_model(seed: int = 0, **lora):
    peft = pytest.importorskip("peft")
    from vrl.generate import tiny

    torch.manual_seed(seed)
    base = tiny.build_model()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False, **lora)  # B ≠ 0: the adapter changes the outputs
    model = peft.get_peft_model(base, config)
    return model, base


@pytest.mark.parametrize("rslora", [False, True])
def test_the_engines_factors_are_peft_s_delta_weight(rslora):
    """`lora_factors_for_engine` gives each adapted weight (A, s·B) with s·B·A = peft's ΔW (s = α/r, or
    α/√r with rsLoRA): what a LoRA slot holding them adds to the layer's output."""
    from vrl.weights.export import lora_factors_for_engine

    model, base = _lora_model(use_rslora=rslora)
    factors = lora_factors_for_engine(base)  # the module GRPO publishes: the base with adapters inside
    layers = {n: m for n, m in base.named_modules() if hasattr(m, "lora_A") and m.lora_A}
    assert set(factors) == {f"{n}.weight" for n in layers} and len(factors) == 3 * 2  # 3 targets × 2 layers
    for name, m in layers.items():
        a, b = factors[f"{name}.weight"]
        assert a.shape == (4, m.in_features) and b.shape == (m.out_features, 4)
        torch.testing.assert_close(b @ a, m.get_delta_weight("default").float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("lora", "reason"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_an_adapter_a_served_lora_cannot_carry_is_refused(lora, reason):
    from vrl.weights.export import lora_factors_for_engine

    _, base = _lora_model(**lora)
    with pytest.raises(ValueError, match=reason):
        lora_factors_for_engine(base)


def test_no_adapter_is_a_clear_error():
    from vrl.generate import tiny
    from vrl.weights.export import lora_factors_for_engine

    with pytest.raises(ValueError, match="no LoRA adapter"):
        lora_factors_for_engine(tiny.build_model())


def test_an_adapter_slot_takes_the_factors_and_zeros_the_rest_of_its_rank():
    """`AdapterSlot.write` on stacks shaped like vLLM's (slots×1×R×in, slots×1×out×R): the slot holds
    (A, s·B), zeros beyond the adapter's rank, the other slots are untouched; a weight set that changed
    or a rank above the engine's is refused."""
    from vrl.generate.vllm_slots import AdapterSlot

    layers = {n: (torch.full((3, 1, 8, 5), 7.0), torch.full((3, 1, 6, 8), 7.0)) for n in ("q.weight", "o.weight")}
    slot = AdapterSlot(layers, 1)
    factors = {n: (torch.randn(4, 5), torch.randn(6, 4)) for n in layers}
    slot.write(factors)
    for n, (a_stack, b_stack) in layers.items():
        assert torch.equal(a_stack[1, 0, :4], factors[n][0]) and torch.equal(b_stack[1, 0, :, :4], factors[n][1])
        assert not a_stack[1, 0, 4:].any() and not b_stack[1, 0, :, 4:].any()
        assert (a_stack[[0, 2]] == 7).all() and (b_stack[[0, 2]] == 7).all()
    with pytest.raises(ValueError, match="changed since"):
        slot.write({"q.weight": factors["q.weight"]})
    with pytest.raises(ValueError, match="above the engine's max_lora_rank"):
        slot.write({n: (torch.randn(9, 5), torch.randn(6, 9)) for n in layers})


class _LoRARequest:
    """vLLM's `LoRARequest` fields that matter here."""

    def __init__(self, lora_name, lora_int_id, lora_path, load_inplace=False):
        self.lora_name, self.lora_int_id, self.lora_path, self.load_inplace = lora_name, lora_int_id, lora_path, load_inplace


class _LoRALayer:
    """A LoRA layer of a vLLM engine as its adapter manager holds it: one (A, B) stack per output slice
    (q, k, v of `qkv_proj`), `slots`×1×R×in and `slots`×1×out×R."""

    def __init__(self, slices, width, slots=2, rank=8):
        self.output_slices = tuple(slices)
        self.lora_a_stacked = tuple(torch.full((slots, 1, rank, width), 7.0) for _ in slices)
        self.lora_b_stacked = tuple(torch.full((slots, 1, out, rank), 7.0) for out in slices)


class _AdapterManager:
    """The part of vLLM's LoRA model manager that vrl uses: served modules, slots, pinned adapters."""

    def __init__(self, modules, slots=2):
        self.modules, self.lora_slots = modules, slots
        self.lora_index_to_id: list[int | None] = [None] * slots
        self.adapters: dict[int, object] = {}
        self.pinned: set[int] = set()

    def list_adapters(self):
        return dict(self.adapters)

    def create_dummy_lora(self, adapter_id, rank, embedding):
        class Zero:
            def __init__(self, i):
                self.id = i

            def clone(self, i):
                return Zero(i)

        return Zero(adapter_id)

    def add_adapter(self, adapter):
        self.adapters[adapter.id] = adapter
        self.lora_index_to_id[self.lora_index_to_id.index(None)] = adapter.id

    def pin_adapter(self, adapter_id):
        self.pinned.add(adapter_id)


def test_each_push_writes_the_adapter_into_its_slot_and_every_request_runs_with_it(monkeypatch):
    """With weight_transfer=adapter the first push pins adapter id 1 to a LoRA slot (never loaded from
    disk) and every push writes each adapted weight's (A, s·B) into the slices that serve it (q and v
    inside the fused qkv_proj); no whole-weights transfer runs; every later generation request carries
    that adapter. Here vLLM's LoRA layers are CPU stacks in a stand-in manager, and the real worker
    extension runs in process on a fused model (tests/test_vllm_layout.py's stand-ins)."""
    peft = pytest.importorskip("peft")
    from tests.test_vllm_layout import (
        HEAD_DIM,
        HEADS,
        HIDDEN,
        INTER,
        KV_HEADS,
        _EngineModel,
        _InProcessLLM,
        fuse,
        hf_model,
    )
    from vrl.config import build
    from vrl.generate import tiny
    from vrl.generate.vllm import VLLMGenerator
    from vrl.generate.vllm_trained import LoadWeightsExtension
    from vrl.types import Task

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))
    lora_module = types.ModuleType("vllm.lora.request")
    lora_module.LoRARequest = _LoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora_module)
    model = hf_model()
    engine_model = _EngineModel(fuse(model))
    qkv = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    modules = {}
    for i in range(2):
        modules[f"model.layers.{i}.self_attn.qkv_proj"] = _LoRALayer(qkv, HIDDEN)
        modules[f"model.layers.{i}.self_attn.o_proj"] = _LoRALayer([HIDDEN], HEADS * HEAD_DIM)
        modules[f"model.layers.{i}.mlp.down_proj"] = _LoRALayer([HIDDEN], INTER)
    manager = _AdapterManager(modules)
    llm = _InProcessLLM(engine_model, LoadWeightsExtension)
    llm.worker.model_runner.lora_manager = types.SimpleNamespace(_adapter_manager=manager, embedding_modules={})
    llm.enqueued = []
    llm.enqueue = lambda prompts, params, use_tqdm=False, lora_request=None: llm.enqueued.append(lora_request) or []
    gen = VLLMGenerator(llm, tiny.build_tokenizer(), build({}).sampling, mode="trained", weight_transfer="adapter")
    torch.manual_seed(1)
    peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                               init_lora_weights=False))
    tasks = [Task(id="a", prompt="x"), Task(id="b", prompt="y")]
    gen.generate(tasks)
    assert llm.enqueued == [None]  # nothing pushed yet: the engine's own weights

    def served(hf_module: str) -> torch.Tensor:
        """ΔW that the engine's slot adds for an HF module: s·B·A from the slice that serves it."""
        layer, part = {"q_proj": ("self_attn.qkv_proj", 0), "v_proj": ("self_attn.qkv_proj", 2),
                       "down_proj": ("mlp.down_proj", 0)}[hf_module.rsplit(".", 1)[1]]
        lora = modules[hf_module.rsplit(".", 2)[0] + "." + layer]
        slot = manager.lora_index_to_id.index(1)
        return lora.lora_b_stacked[part][slot, 0, :, :4] @ lora.lora_a_stacked[part][slot, 0, :4]

    for push in range(2):
        with torch.no_grad():  # a new adapter each push
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.add_(0.1 * (push + 1))
        gen.publish(model)
        for name, m in model.named_modules():
            if hasattr(m, "lora_A") and m.lora_A:
                torch.testing.assert_close(served(name), m.get_delta_weight("default"), rtol=1e-5, atol=1e-6)
    assert manager.pinned == {1} and "vrl_load_weights" not in llm.calls
    k_a = modules["model.layers.0.self_attn.qkv_proj"].lora_a_stacked[1]
    assert (k_a == 7).all()  # k_proj has no adapter: its slice is never written
    gen.generate(tasks)
    requests = llm.enqueued[-1]  # one LoRA request per prompt, the pinned adapter's
    assert len(requests) == len(tasks) and all(r is requests[0] for r in requests)
    assert requests[0].lora_int_id == 1 and requests[0].load_inplace is False
    with pytest.raises(Exception, match="not tensors"):
        gen.publish({"w": torch.ones(1)})


def test_an_adapter_on_weights_the_engines_lora_layers_do_not_serve_is_refused(monkeypatch):
    """The engine serves LoRA on some layers only: an adapter on another is refused with the reason,
    before any slot is taken."""
    peft = pytest.importorskip("peft")
    from tests.test_vllm_layout import HEAD_DIM, HEADS, HIDDEN, _EngineModel, _InProcessLLM, fuse, hf_model
    from vrl.config import build
    from vrl.generate.vllm import VLLMGenerator
    from vrl.generate.vllm_trained import LoadWeightsExtension
    from vrl.policy import Unsupported

    lora_module = types.ModuleType("vllm.lora.request")
    lora_module.LoRARequest = _LoRARequest
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora_module)
    model = hf_model()
    manager = _AdapterManager({f"model.layers.{i}.self_attn.o_proj": _LoRALayer([HIDDEN], HEADS * HEAD_DIM) for i in range(2)})
    llm = _InProcessLLM(_EngineModel(fuse(model)), LoadWeightsExtension)
    llm.worker.model_runner.lora_manager = types.SimpleNamespace(_adapter_manager=manager, embedding_modules={})
    gen = VLLMGenerator(llm, None, build({}).sampling, mode="trained", weight_transfer="adapter")
    peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"]))
    with pytest.raises(Unsupported, match="does not serve .*down_proj"):
        gen.publish(model)
    assert manager.pinned == set()


def test_the_direct_engines_skip_vllms_layerwise_reload_unless_the_model_is_quantized():
    """`direct_engine` changes only the update session's start and finish: a dense model's weights load
    in place; a quantized one still goes through the base engine's layerwise reload."""
    from vrl.generate.vllm_trained import direct_engine

    class Engine:
        calls: list[str] = []

        def __init__(self, quantization):
            self.model_config = types.SimpleNamespace(quantization=quantization)

        def start_weight_update(self):
            self.calls.append("layerwise start")

        def finish_weight_update(self):
            self.calls.append("layerwise finish")

        def receive_weights(self, info):
            self.calls.append("receive")

    Direct = direct_engine(Engine)
    assert issubclass(Direct, Engine) and Direct.__name__ == "DirectEngine"
    dense = Direct(None)
    dense.start_weight_update(), dense.receive_weights({}), dense.finish_weight_update()
    assert Engine.calls == ["receive"]
    Engine.calls.clear()
    fp8 = Direct("fp8")
    fp8.start_weight_update(), fp8.receive_weights({}), fp8.finish_weight_update()
    assert Engine.calls == ["layerwise start", "receive", "layerwise finish"]


def test_the_direct_engines_are_registered_once_under_their_names(monkeypatch):
    """Registering twice (the driver, then each worker importing the module) keeps one engine per name;
    vLLM's factory refuses a second registration, which must not escape."""
    from vrl.generate import vllm_trained

    registry: dict[str, type] = {}

    class Factory:
        @staticmethod
        def register_engine(name, cls):
            if name in registry:
                raise ValueError(f"Weight transfer engine '{name}' is already registered.")
            registry[name] = cls

    class IPC:
        pass

    class NCCL:
        pass

    modules = {"vllm.distributed.weight_transfer.factory": {"WeightTransferEngineFactory": Factory},
               "vllm.distributed.weight_transfer.nccl_engine": {"NCCLWeightTransferEngine": NCCL}}
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vllm_trained, "ipc_engine_module", lambda: types.SimpleNamespace(IPCWeightTransferEngine=IPC))
    vllm_trained.register_direct_engines()
    first = dict(registry)
    vllm_trained.register_direct_engines()
    assert registry == first and set(registry) == set(vllm_trained.DIRECT.values())
    assert issubclass(registry["vrl_ipc"], IPC) and issubclass(registry["vrl_nccl"], NCCL)


def test_low_rank_es_takes_its_slots_through_the_same_helpers():
    """`vrl_lowrank_setup` (low-rank ES) pins adapters 1..members through `pin_empty_adapters` and finds
    the stacks through `served_lora_layers`, as the served adapter does: each member gets its own slot,
    more members than slots are refused, and a weight the LoRA layers do not serve comes back as the reason."""
    from tests.test_vllm_layout import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, _EngineModel, _InProcessLLM, fuse, hf_model
    from vrl.generate.vllm_slots import LoRASlotsExtension

    model = hf_model()
    qkv = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    manager = _AdapterManager({f"model.layers.{i}.self_attn.qkv_proj": _LoRALayer(qkv, HIDDEN, slots=3) for i in range(2)},
                              slots=3)
    llm = _InProcessLLM(_EngineModel(fuse(model)), LoRASlotsExtension)
    llm.worker.model_runner.lora_manager = types.SimpleNamespace(_adapter_manager=manager, embedding_modules={})
    hf = {n: list(p.shape) for n, p in model.named_parameters()}
    q = {n: s for n, s in hf.items() if ".q_proj.weight" in n}
    with pytest.raises(ValueError, match="4 adapters but the engine has 3 LoRA slots"):
        llm.worker.vrl_lowrank_setup(q, 2, 4)
    info = llm.worker.vrl_lowrank_setup(q, 2, 3)
    assert info["matrices"] == 2 and sorted(info["slots"]) == [0, 1, 2] and manager.pinned == {1, 2, 3}
    down = {n: s for n, s in hf.items() if ".down_proj.weight" in n}
    assert "does not serve" in llm.worker.vrl_lowrank_setup(down, 2, 1)["unserved"]


@pytest.mark.parametrize("environ, on", [
    ({}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6, expandable_segments:true"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,expandable_segments:False"}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, False),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
])
def test_expandable_segments_are_read_as_pytorch_reads_its_allocator_settings(environ, on):
    """The setting the engine start warns about under torchrun (a 7B launch died with it at its first push
    on 2 x H200 and trained without it): found in either variable, the option's last setting winning."""
    from vrl.generate.vllm import expandable_segments

    assert expandable_segments(environ) is on
