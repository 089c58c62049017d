"""Blocks the families share: the Qwen hybrid, the attention-trunk MTP block, per-depth chains, sliding windows, DSA rows."""
