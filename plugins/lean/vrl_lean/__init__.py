"""vrl-lean: Lean 4 theorem proving with kimina-lean-server as the verifier."""
