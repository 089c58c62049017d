"""What every route needs: the engine, the tokenizer and the server's configuration."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from .engine import Engine


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Any
    model_name: str
    aliases: set
    context_length: int
    vocab_size: int
    default_max_tokens: int = 512
    sampling_defaults: Dict[str, Any] = field(default_factory=dict)
    template_args: Dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str = "qwen3"
    reasoning_field: str = "reasoning_content"
    tool_call_parser: str = "auto"
    api_key: Optional[str] = None
    model_path: str = ""
    num_mtp_layers: int = 0
    num_draft_tokens: int = 0
    adaptive: bool = True
    max_draft_tokens: int = 8
    created: int = field(default_factory=lambda: int(time.time()))
    tokenize_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mlx-mtp-tokenize"))

    @property
    def im_start_id(self) -> Optional[int]:
        tok = self.tokenizer
        try:
            i = tok.convert_tokens_to_ids("<|im_start|>")
        except Exception:
            return None
        return i if isinstance(i, int) and i != getattr(tok, "unk_token_id", None) else None
