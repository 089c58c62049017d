"""Block drafters (DFlash, DFlash2, DSpark, EAGLE-3): see ``base.py``."""

from .base import BlockDraftModel, BlockSpec, Draw
from .dflash import DFlash
from .dflash2 import DFlash2DraftModel
from .dspark import DSparkDraftModel
from .eagle3 import Eagle3DraftModel

# kind name -> its BlockDraftModel class (each kind's module adds its line)
KINDS: dict = {}
KINDS["dflash"] = DFlash
KINDS["dflash2"] = DFlash2DraftModel
KINDS["dspark"] = DSparkDraftModel
KINDS["eagle3"] = Eagle3DraftModel

__all__ = ["BlockDraftModel", "BlockSpec", "Draw", "KINDS"]
