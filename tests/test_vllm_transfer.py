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
    transfer.send(weights)
    transfer.send(weights)
    assert engine.calls == ["init", "start", "update", "finish", "start", "update", "finish"]
    assert engine.init_info == {"master_address": "127.0.0.1", "master_port": 29517, "world_size": 3, "rank_offset": 1}
    assert engine.received[0] == {"names": ["a.weight", "b.bias"], "dtype_names": ["bfloat16", "float32"],
                                  "shapes": [[2, 3], [4]], "packed": True}
    assert [[n for n, _ in s] for s in sent] == [["a.weight", "b.bias"]] * 2
    assert all(t is w for s in sent for (_, t), (_, w) in zip(s, weights))  # the tensors themselves: no copy


def test_a_failed_push_still_finishes_the_update_session(fake_nccl):
    """A push that fails on the trainer's side ends the engine's update session, so that the next push
    can start one (vLLM refuses a second `start_weight_update` while one is active)."""
    sent, engines = fake_nccl
    engine = _Engine()
    engines.append(engine)
    transfer = NativeTransfer(engine, "nccl", "cpu", workers=1)
    transfer.send([("a", torch.ones(1))])

    def broken(iterator, args):
        engine.broadcast.set()  # the workers got something; the trainer then fails
        raise RuntimeError("NCCL error: unhandled system error")

    sys.modules["vllm.distributed.weight_transfer.nccl_engine"].NCCLWeightTransferEngine.trainer_send_weights = broken
    with pytest.raises(RuntimeError, match="NCCL error"):
        transfer.send([("a", torch.ones(1))])
    assert engine.calls[-1] == "finish" and not engine._active


# -- the LoRA adapter alone ('adapter') ----------------------------------------------------------------------
@pytest.mark.parametrize(("choice", "adapter", "engine", "train", "expected"), [
    ("adapter", 16, ["0"], "0", "adapter"),     # asked for: the engine serves the adapter
    ("adapter", 16, ["1", "2"], "0", "adapter"),  # on any GPUs, in any numbers (the adapter travels by file)
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


def _lora_model(seed: int = 0, **lora):
    peft = pytest.importorskip("peft")
    from vrl.generate import tiny

    torch.manual_seed(seed)
    base = tiny.build_model()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False, **lora)  # B ≠ 0: the adapter changes the outputs
    model = peft.get_peft_model(base, config)
    return model, base


def test_the_saved_adapter_is_the_trained_one_as_peft_loads_it(tmp_path):
    """`save_lora_adapter` writes the adapter GRPO trained (read from the injected layers) in peft's
    format: peft loads it onto a fresh base and gets the trained model's outputs exactly."""
    peft = pytest.importorskip("peft")
    from vrl.generate import tiny
    from vrl.weights.export import save_lora_adapter

    model, base = _lora_model()
    config = save_lora_adapter(base, str(tmp_path))  # the module GRPO publishes: the base with adapters inside
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    torch.manual_seed(0)
    fresh = tiny.build_model()
    loaded = peft.PeftModel.from_pretrained(fresh, str(tmp_path))
    ids = torch.randint(0, 200, (2, 12))
    model.eval(), loaded.eval()
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids).logits
        assert torch.equal(got, want)
        with model.disable_adapter():
            assert not torch.allclose(model(ids).logits, want)  # the adapter matters in this check
    # A second push replaces the files whole.
    with torch.no_grad():
        next(p for n, p in base.named_parameters() if "lora_B" in n).add_(1.0)
    save_lora_adapter(base, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.parametrize(("lora", "reason"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_an_adapter_a_served_lora_cannot_carry_is_refused(tmp_path, lora, reason):
    from vrl.weights.export import save_lora_adapter

    _, base = _lora_model(**lora)
    with pytest.raises(ValueError, match=reason):
        save_lora_adapter(base, str(tmp_path))


def test_no_adapter_to_save_is_a_clear_error(tmp_path):
    from vrl.generate import tiny
    from vrl.weights.export import save_lora_adapter

    with pytest.raises(ValueError, match="no LoRA adapter"):
        save_lora_adapter(tiny.build_model(), str(tmp_path))


class _LoRARequest:
    """vLLM's `LoRARequest` fields that matter here."""

    def __init__(self, lora_name, lora_int_id, lora_path, load_inplace=False):
        self.lora_name, self.lora_int_id, self.lora_path, self.load_inplace = lora_name, lora_int_id, lora_path, load_inplace


def test_each_push_reloads_the_adapter_in_place_and_every_request_runs_with_it(monkeypatch):
    """With weight_transfer=adapter a push writes the adapter and reloads it in place under one id
    (`add_lora(load_inplace=True)`), no whole-weights RPC runs, and every later generation request
    carries that adapter (without reloading it again); before the first push the requests run on the
    engine's own weights. The adapter's directory goes when the engine closes."""
    from pathlib import Path

    from vrl.generate import tiny
    from vrl.generate.vllm import VLLMGenerator

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))
    lora_module = types.ModuleType("vllm.lora.request")
    lora_module.LoRARequest = _LoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora_module)
    _, base = _lora_model()

    class LLM:
        def __init__(self):
            self.added, self.enqueued, self.rpcs = [], [], []
            self.llm_engine = types.SimpleNamespace(add_lora=self._add, has_unfinished_requests=lambda: False)
            self.model_config = types.SimpleNamespace(max_model_len=64)

        def _add(self, request):
            files = sorted(p.name for p in Path(request.lora_path).iterdir())
            self.added.append((request.lora_int_id, request.load_inplace, files))
            return True

        def enqueue(self, prompts, params, use_tqdm=False, lora_request=None):
            self.enqueued.append(lora_request)
            return []

        def collective_rpc(self, method, args=()):
            self.rpcs.append(method)
            return [None]

    llm = LLM()
    from vrl.config import build

    gen = VLLMGenerator(llm, tiny.build_tokenizer(), build({}).sampling, mode="trained", weight_transfer="adapter")
    from vrl.types import Task

    tasks = [Task(id="a", prompt="x"), Task(id="b", prompt="y")]
    gen.generate(tasks)
    assert llm.enqueued == [None]  # nothing pushed yet: the engine's own weights (B = 0 at the start of training)
    gen.publish(base)
    gen.publish(base)
    assert llm.added == [(1, True, ["adapter_config.json", "adapter_model.safetensors"])] * 2
    assert llm.rpcs == []  # no whole-weights transfer
    assert {"sync_s", "adapter_write_s", "adapter_load_s"} <= set(gen.counters())
    gen.generate(tasks)
    requests = llm.enqueued[-1]  # one LoRA request per prompt
    assert len(requests) == len(tasks) and all(r is requests[0] for r in requests)
    assert requests[0].lora_int_id == 1 and requests[0].load_inplace is False
    directory = requests[0].lora_path
    with pytest.raises(Exception, match="not tensors"):
        gen.publish({"w": torch.ones(1)})
    gen.close()
    assert not Path(directory).exists()


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
