"""Checkpoint input: loading, HF <-> MLX layout, config and file checks, split drafters, hub ids."""
