"""From the user's text to prompt token ids: the chat template (or not), then the tokenizer."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union


def build_prompt(tokenizer, text: str, system: Optional[str] = None,
                 template_args: Optional[dict] = None, ignore_template: bool = False) -> str:
    """The text to tokenize: ``text`` as one user turn in the chat template, or raw."""
    if ignore_template or not getattr(tokenizer, "chat_template", None):
        return text
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **(template_args or {}))


class EmptyPromptError(ValueError):
    """Nothing to generate from (CLI: exit 2; server: 400)."""


def encode_prompt(tokenizer, prompt: Union[str, Sequence[int]]) -> List[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise EmptyPromptError("The prompt is empty.")
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    else:
        ids = list(prompt)
    if not ids:
        raise EmptyPromptError("The prompt is empty after tokenization (the tokenizer "
                               "produced no tokens for it).")
    return ids


