"""twinshard.conformance: cases, oracles and the parity report (not yet written)."""
