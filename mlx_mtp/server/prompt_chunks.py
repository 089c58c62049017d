"""Where a prompt chunk ends: the grid that keeps prefill independent of the budget.

Chunk ends lie on a grid of ``grid`` tokens counted from the restored prefix and from each
snapshot boundary, and a segment's last cell takes in a remainder shorter than a cell. The
trunk's state after a run of cells does not depend on how many cells each call covered
(checked bit for bit on the CPU with both BLAS settings), so a prompt alone is computed the
same whatever the budget.
"""

from __future__ import annotations

from ..models.blocks.hybrid import CHUNKED_MIN_TOKENS
from .fair_share import FairShare

# The shortest input the chunked delta rule takes, so every call but a short prompt's only
# one runs the same algorithm.
PREFILL_GRID = CHUNKED_MIN_TOKENS


class ChunkGrid:
    """Chunk ends for prompts run in calls of up to ``step_size`` tokens."""

    def __init__(self, step_size: int):
        self.step_size = step_size
        # Smaller steps than the grid: one step per call, each the same size.
        self.grid = min(PREFILL_GRID, step_size)
        self.floor = min(FairShare.FLOOR, self.grid)  # the shortest chunk but a tail

    def end(self, start: int, seg_start: int, seg_end: int, max_tokens: int,
            below_grid: bool) -> int:
        """The end of the chunk from ``start`` (about ``max_tokens``) in the segment
        ``[seg_start, seg_end]``. ``below_grid`` (streams decode): under a cell,
        ``max_tokens`` (to a boundary, taking in a remainder under the floor) run the
        recurrence in other pieces, equal up to float rounding; then back on the grid."""
        grid = self.grid
        cells = max(1, min(max_tokens, self.step_size) // grid)
        end = seg_start + ((start - seg_start) // grid + cells) * grid
        if seg_end - end < grid:
            end = seg_end
        if below_grid and max_tokens < grid:
            end = min(start + max(self.floor, max_tokens), seg_end)
            if seg_end - end < self.floor:
                end = seg_end
        return end
