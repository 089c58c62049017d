"""Qwen3.5 / Qwen3.6 MoE (``model_type: qwen3_5_moe``): routed experts + gated shared expert.

Same layout as the dense family; experts arrive fused (``experts.gate_up_proj``,
``experts.down_proj``) or per expert, and the MTP layer's experts may use the
other form than the trunk's. ``sanitize`` accepts every combination.
"""

from .qwen3_5 import Model, ModelArgs  # noqa: F401  (the MoE blocks come from the config)
