"""Block drafters (DFlash, DFlash2, DSpark, EAGLE-3): see ``base.py``."""

from .base import BlockDraftModel, BlockSpec, Draw
from .dflash import DFlash

# kind name -> its BlockDraftModel class (each kind's module adds its line)
KINDS: dict = {}
KINDS["dflash"] = DFlash

__all__ = ["BlockDraftModel", "BlockSpec", "Draw", "KINDS"]
