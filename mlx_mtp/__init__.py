"""mlx-mtp: lossless multi-token-prediction speculative decoding on MLX."""

__version__ = "0.1.0"
