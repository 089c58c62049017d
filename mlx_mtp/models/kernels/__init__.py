"""Kernels written for the CPU backend (the chunked gated delta rule)."""
