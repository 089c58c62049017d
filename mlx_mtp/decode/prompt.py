"""From the user's text to prompt token ids: the chat template (or not), then the tokenizer."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union


# The chat-template variables every prompt starts from, in `generate` and `serve` alike.
# Thinking is off unless asked for (--chat-template-args '{"enable_thinking": true}', or a
# request's chat_template_kwargs): mlx-lm's tokenizer wrapper would otherwise switch it on
# for any vocabulary that has <think>, whatever the template's own default.
DEFAULT_TEMPLATE_ARGS = {"enable_thinking": False}


def chat_template_args(*layers: Optional[dict]) -> dict:
    """The template variables: the defaults, then each layer over the previous one
    (the command's ``--chat-template-args``, then a request's ``chat_template_kwargs``)."""
    out = dict(DEFAULT_TEMPLATE_ARGS)
    for layer in layers:
        out.update(layer or {})
    return out


def build_prompt(tokenizer, text: str, system: Optional[str] = None,
                 template_args: Optional[dict] = None, ignore_template: bool = False,
                 images: int = 0) -> str:
    """The text to tokenize: ``text`` as one user turn in the chat template, or raw.
    ``images``: that many images lead the turn (the template writes their placeholders;
    raw text must hold them itself)."""
    if ignore_template or not getattr(tokenizer, "chat_template", None):
        return text
    content = ([{"type": "image"}] * images + [{"type": "text", "text": text}]
               if images else text)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **chat_template_args(template_args))


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


