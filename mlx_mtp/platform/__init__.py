"""Platform set-up that must happen before MLX is imported (Linux CPU BLAS)."""
