"""GRPO (not implemented yet; see the GRPO issue)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from vrl.optim.base import Optimizer


class GRPOConfig(BaseModel):
    """Group Relative Policy Optimization settings."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_generations: int = Field(8, ge=2, description="Samples per task (the group size G).")


class GRPO(Optimizer):
    name = "grpo"

    def __init__(self, config: GRPOConfig, seed: int = 0):
        raise NotImplementedError("the grpo optimizer is not implemented yet; use --optimizer es")
