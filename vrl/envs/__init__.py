"""Environments that ship with the core (registered through the same hooks as plugins, `vrl.builtin`):
`countdown` (arithmetic, the ES paper's benchmark), `letters` (a task the tiny model learns in
seconds), `guess` (a multi-turn game it learns on a CPU) and `dataset` (any dataset file or Hugging Face
id with reward functions in TRL's shape)."""

TINY_MODEL_STEPS = {
    "es.population_size": 16,
    "es.sigma": 0.2,
    "es.alpha": 1.0,
    "es.include": ["lm_head.*"],
    "grpo.num_generations": 8,
    "grpo.learning_rate": 1e-2,
    "grpo.lr_scheduler_type": "constant",
    "grpo.micro_batch_size": 32,
}
"""Update-rule settings under which the tiny random model learns the built-in toy environments (`letters`,
`guess`) in a few iterations; a pretrained model needs far smaller steps."""
