"""Environments that ship with the core (registered through the same hooks as plugins, `vrl.builtin`):
`countdown` (arithmetic, the ES paper's benchmark), `letters` (a task the tiny model learns in
seconds) and `dataset` (any dataset file or Hugging Face id with reward functions in TRL's shape)."""
