"""vrl-lean: Lean 4 theorem proving with kimina-lean-server as the verifier."""

from vrl_lean.policy import ALLOWED_AXIOMS, Rejected, Submission, Theorem, judge, prepare
from vrl_lean.server import KIMINA, ServerSpec

__all__ = ["ALLOWED_AXIOMS", "KIMINA", "Rejected", "ServerSpec", "Submission", "Theorem", "judge", "prepare"]
