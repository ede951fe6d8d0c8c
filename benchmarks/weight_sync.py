"""GRPO weight sync into a vLLM engine: vLLM's native weight transfer against vrl's own loader, in one run.

    python benchmarks/weight_sync.py --out result.json                                   # colocated: extension vs ipc
    python benchmarks/weight_sync.py --out r.json --gpu 0 --train-device cuda:1 --transports extension nccl
    python benchmarks/weight_sync.py --out r.json --lora 16 --transports ipc adapter     # LoRA: merged vs adapter alone
    python benchmarks/weight_sync.py --small --out r.json                                # a 2-layer model, quick check

One engine per transport (`generator.vllm.weight_transfer`), all alive at once, each with its own
trained HF copy on `--train-device`; the pushes are interleaved (engine A, engine B, A, B, ...), each
copy changed before its push, and the reported time is the median `sync_s` (the whole `publish`:
wake-free push, IPC handles or NCCL broadcast, the workers' load, synchronised). After the last push
every engine tensor is compared with the trained copy, bit for bit (whole-weights transports).
`--lora R`: each copy trains a rank-R LoRA adapter on every linear layer of the decoder (peft, B moved
before each push); 'adapter' pushes the adapter alone, the others push W + ΔW merged. Qwen2.5-1.5B shapes, random bf16
weights (`vllm_generation.build_model`), engines eager (the load path is the same as compiled).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--path", default="/tmp/vrl-bench-model")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--repeats", type=int, default=10, help="timed pushes per transport (after one warm-up push)")
    ap.add_argument("--transports", nargs="+", default=["extension", "ipc"], choices=["extension", "ipc", "nccl", "auto", "adapter"])
    ap.add_argument("--gpu", default=None, help="the engines' GPU (an index among this process's GPUs)")
    ap.add_argument("--train-device", default="cuda", help="where the trained copies live (cuda:1: separate GPU)")
    ap.add_argument("--memory", type=float, default=0.2, help="each engine's share of its GPU")
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="train a rank-R LoRA adapter (0: every weight)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)

    import sys
    from pathlib import Path

    import torch
    import vllm

    sys.path.insert(0, str(Path(__file__).parent))
    from vllm_generation import build_model

    from vrl.config import build
    from vrl.generate.vllm import VLLMGenerator
    from vrl.policy import HostNeeds

    if not Path(args.path, "config.json").exists():
        build_model(args.path, args.small)
    res: dict = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "vllm": vllm.__version__,
                 "small": args.small, "engine_gpu": args.gpu, "train_device": args.train_device, "repeats": args.repeats,
                 "lora_rank": args.lora}
    engines: dict[str, VLLMGenerator] = {}
    models = {}
    for t in args.transports:
        cfg = build({"model": args.path, "optimizer": "grpo", "generator": {
            "backend": "vllm", "device": args.train_device,
            "vllm": {"weight_transfer": t, "enforce_eager": True, "gpu_memory_utilization": args.memory}}})
        engines[t] = VLLMGenerator.from_config(cfg, HostNeeds(moves="trained", adapter_rank=args.lora), gpu=args.gpu)
        res.setdefault("resolved", {})[t] = engines[t].weight_transfer
        models[t] = engines[t].trainable().model
        if args.lora:
            import peft

            peft.get_peft_model(models[t], peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))  # injected in place
    res["weights_gb"] = sum(p.numel() * p.element_size() for p in next(iter(models.values())).parameters()) / 1e9
    times: dict[str, list[float]] = {t: [] for t in engines}
    def move(model: torch.nn.Module, rep: int) -> None:
        """A new policy each push: one row of the embedding (or of one LoRA B) moves."""
        with torch.no_grad():
            if args.lora:
                b = next(p for n, p in model.named_parameters() if "lora_B" in n)
                b[rep % b.shape[0]].add_(0.01)
            else:
                w = model.model.embed_tokens.weight
                w[rep % w.shape[0]].add_(1.0)

    for rep in range(args.repeats + 1):
        for t, gen in engines.items():
            move(models[t], rep)
            gen.publish(models[t])
            if rep:  # the first push of each engine warms its path (NCCL joins its group there)
                times[t].append(gen.counters()["sync_s"])
    res["sync_ms_median"] = {t: 1e3 * statistics.median(v) for t, v in times.items()}
    res["sync_ms_all"] = {t: [round(1e3 * x, 2) for x in v] for t, v in times.items()}
    base = args.transports[0]
    res["ratio_vs_" + base] = {t: res["sync_ms_median"][t] / res["sync_ms_median"][base] for t in engines}
    res["tensors_differing_after_sync"] = {}
    if args.lora:
        from vrl.weights.export import weights_for_engine

        res["adapter_mb"] = sum(p.numel() * p.element_size() for n, p in next(iter(models.values())).named_parameters()
                                if "lora_" in n) / 1e6
    for t, gen in engines.items():
        if t == "adapter" or gen.weight_transfer == "adapter":
            continue  # the engine's own weights stay the base; the adapter is served beside them
        named = dict(weights_for_engine(models[t])) if args.lora else dict(models[t].named_parameters())
        engine = gen.rpc("vrl_hf_weights", {n: list(p.shape) for n, p in named.items()}, list(named))[0]
        res["tensors_differing_after_sync"][t] = [n for n, p in named.items() if not torch.equal(engine[n], p.detach().cpu())]
        res["tensors_compared"] = len(named)
    for gen in engines.values():
        gen.close()
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: res.get(k) for k in ("resolved", "sync_ms_median", "tensors_compared", "adapter_mb")}, indent=2))
    print("differing:", {t: len(v) for t, v in res["tensors_differing_after_sync"].items()})


if __name__ == "__main__":
    main()
