"""The weights layer: what optimizers and the hosts that hold the weights share.

Optimizers (`vrl.optim`) say what changes; hosts (`vrl.generate`, the runtimes) apply it; neither
imports the other's package, both import this one, and this one imports neither.

- `noise`: ES noise, a pure function of (member seed, parameter name, element index), the same bits
  on every device; the full-rank reference kernels.
- `flat`: `FlatParams`, the flat view (an fp32 master θ of the selected parameters, written into
  the weights wherever they live); `flat_triton`: its fused GPU kernels.
- `factors`, `exact`, `lowrank_kernels`, `lowrank`: low-rank ES (EGGROLL): a member's factor noise,
  the bounds that keep its arithmetic exact, the update kernels (reference, float64 batched) and
  `LowRankParams`, the low-rank view; `lowrank_triton`: its GPU kernels.
- `update`: the typed update messages (`FullRankUpdate`, `LowRankUpdate`) and their wire form.
- `export`: a trained model's weights under checkpoint names, and as a Hugging Face folder.

Submodules are imported where used (`import vrl.weights` loads no torch).
"""
