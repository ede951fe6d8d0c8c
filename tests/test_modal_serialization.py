"""What vrl passes across a Modal call boundary survives modal's own serializer (no account needed).

vrl's real entry points run with the installed `modal` package: `launch_detached` (`orchestrate.spawn`),
`prepare` (`prepare_model.remote`) and `ModalPolicy.sample` (`sample.spawn`, ES members and GRPO shards).
What is emulated: the Modal service. The app's Function handles are hydrated by hand, with the object id
and handle metadata `app.run()` would give them, and `Function.spawn/remote` are replaced by recorders
(nothing is sent). Each recorded argument set, and each result vrl reads back, is then put through
modal 1.6.4's real `modal._serialization.serialize` and `deserialize`, as the client and the container do.
A class instance (the old `worker=app.worker()`) fails here with DeserializationError, as it did on Modal.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from vrl.config import build, dump
from vrl.policy import PerturbationSpec, Variant
from vrl.types import Completion

modal = pytest.importorskip("modal")


@pytest.fixture(autouse=True)
def modal_token(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-test")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-test")


def hydrate(handle: Any, object_id: str) -> None:
    """A Function handle as a running app leaves it: hydrated, with the server's handle metadata."""
    from modal._utils.async_utils import synchronizer
    from modal_proto import api_pb2

    impl = synchronizer._translate_in(handle)
    name = impl._function_name if getattr(impl, "_function_name", None) else object_id
    impl._hydrate(object_id, None, api_pb2.FunctionHandleMetadata(
        function_name=name, function_type=api_pb2.Function.FUNCTION_TYPE_FUNCTION))


def round_trip(value: Any) -> Any:
    from modal._serialization import deserialize, serialize

    return deserialize(serialize(value), None)


@pytest.fixture
def boundary(monkeypatch):
    """Every `.spawn` and `.remote` vrl makes, and what a worker call returns: (kind, handle id, args,
    kwargs); nothing is sent."""
    from vrl.runtime.modal import workers

    calls: list[tuple[str, str, tuple, dict]] = []

    def worker_result(args: tuple) -> dict:
        variants = args[0] if isinstance(args[0], list) else [args[0]]
        done = [Completion(task_id=f"t{i}", text="1+2", variant=v["index"], token_ids=[1, 2], logprobs=[-0.5, -0.25],
                           prompt_token_ids=[3]) for v in variants for i in range(args[1], args[2])]
        return {"completions": [workers.completion_to_wire(c) for c in done], "snapshot": None, "replayed": 0,
                "catch_up_s": 0.0}

    def spawn(self, *args, **kwargs):
        calls.append(("spawn", self.object_id, args, kwargs))
        if self.object_id != "fu-sample":
            return SimpleNamespace(object_id="fc-launched")
        out = worker_result(args)
        calls.append(("result", self.object_id, (out,), {}))
        return SimpleNamespace(object_id=f"fc-{len(calls)}", get=lambda: out, cancel=lambda: None)

    def remote(self, *args, **kwargs):
        calls.append(("remote", self.object_id, args, kwargs))
        return {"model": args[0], "path": "/vrl/hf/x", "files": ["model.safetensors"], "bytes": 1, "downloaded": True}

    monkeypatch.setattr(modal.Function, "spawn", spawn)
    monkeypatch.setattr(modal.Function, "remote", remote)
    return calls


@pytest.fixture
def app(monkeypatch):
    from vrl.runtime.modal import app as app_module

    cfg = build({"runtime": {"kind": "modal", "modal": {"volume": "vrl-ser"}}, "logging": {"name": "ser"}})
    built = app_module.build_app(cfg)
    for handle, oid in ((built.sample, "fu-sample"), (built.orchestrate, "fu-orchestrate"),
                        (built.prepare_model, "fu-prepare"), (built.stop_app, "fu-stop")):
        hydrate(handle, oid)
    running = dataclasses.replace(built, app=SimpleNamespace(run=lambda **_: contextlib.nullcontext(), app_id="ap-test"))
    monkeypatch.setattr(app_module, "build_app", lambda config: running)
    return cfg, running


def test_every_argument_and_result_vrl_passes_round_trips_through_modals_serializer(app, boundary, monkeypatch,
                                                                                    tmp_path):
    from tests.test_modal_lease import Store
    from vrl.runtime.modal import launch, lease
    from vrl.runtime.modal.runtime import ModalCaller, ModalPolicy
    from vrl.runtime.modal.volume import VolumeWeights

    cfg, built = app
    monkeypatch.setattr(launch, "read_volume_file", lambda volume, path: (_ for _ in ()).throw(FileNotFoundError(path)))
    store = Store()  # the lease Dict, here (the launch record goes there)
    real = lease.RunLease
    monkeypatch.setattr(lease, "RunLease", lambda volume, name: real(volume, name, store=store, alive=lambda call: False))
    detached = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={
        "modal": cfg.runtime.modal.model_copy(update={"detach": True})})})
    assert launch.launch_detached(detached) == "fc-launched"
    assert real("vrl-ser", "ser", store=store).launch()["app"] == "ap-test"  # the launch record
    assert launch.prepare(cfg, "Qwen/Qwen2.5-0.5B")["model"] == "Qwen/Qwen2.5-0.5B"

    # The orchestrator's own calls: ES members (the updates so far, seeds), then GRPO shards of the current weights.
    from vrl.types import Task

    store = VolumeWeights("ser", volume=None, root=tmp_path)
    policy = ModalPolicy(ModalCaller(), built.sample, cfg, store, put=lambda files: None)
    policy.perturbations(PerturbationSpec(include=(), exclude=(), sigma=0.01))
    tasks = [Task(id=f"t{i}", prompt="Use 1 and 2 to make 3.", data={"target": 3}) for i in range(3)]
    members = [Variant(index=i, samples_per_task=1, seed=100 + i, sign=1) for i in range(2)]
    assert sum(len(b) for b in policy.sample(tasks, members, seed=7)) == 6
    policy.weights = "runs/ser/weights/v1.safetensors"
    assert sum(len(b) for b in policy.sample(tasks, [Variant(index=0, samples_per_task=2)], seed=8)) == 3

    kinds = [(kind, oid) for kind, oid, _, _ in boundary]
    assert ("spawn", "fu-orchestrate") in kinds and ("remote", "fu-prepare") in kinds
    assert kinds.count(("spawn", "fu-sample")) == 2 + 1 and ("result", "fu-sample") in kinds  # 2 members, 1 shard
    for kind, oid, args, kwargs in boundary:
        back_args, back_kwargs = round_trip((args, kwargs))  # DeserializationError for a class handle
        if (kind, oid) == ("spawn", "fu-orchestrate"):  # the handles the container calls: the same Functions
            assert isinstance(back_kwargs["worker"], modal.Function)
            assert back_kwargs["worker"].object_id == "fu-sample"
            assert back_kwargs["orchestrator"].object_id == "fu-orchestrate"
            assert back_kwargs["stopper"].object_id == "fu-stop" and back_kwargs["app_id"] == "ap-test"
            assert back_args == (dump(detached), False)
        else:
            assert (back_args, back_kwargs) == (args, kwargs)


def test_a_class_instance_does_not_survive_modals_serializer():
    """The shape the detached launch used to pass (`worker=app.worker()`): 1.6.4 serializes the class
    handle without its metadata and the receiving side cannot rebuild it."""
    from modal._serialization import DeserializationError
    from modal.cls import _Cls

    cls = _Cls.__new__(_Cls)
    cls._init("Cls(GPUWorker)")
    cls._object_id, cls._is_hydrated = "cs-worker", True  # as `app.run()` leaves a class handle
    with pytest.raises(DeserializationError):
        round_trip({"worker": cls})
