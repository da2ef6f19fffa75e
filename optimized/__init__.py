"""twinshard.optimized: the overlapped, multi-stream implementation (not yet written)."""
