"""Text-level generation API: ``stream_generate`` and ``generate``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generator, Optional, Sequence, Union

import mlx.core as mx

from ..models.io.layout import check_acceptance
from .grammar import Grammar
from .policy import DraftPolicy
from .prompt import encode_prompt
from .sampling import SamplingParams
from .speculative import MTPDecoder, SpecStats
from .text_stream import TextStream


@dataclass
class GenerationResponse:
    text: str  # new text since the previous response
    token: int
    logprobs: mx.array  # (V,) target log-probabilities at this position
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: Optional[str]  # "stop" | "length" | None while running
    spec: SpecStats


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, Sequence[int]],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams = SamplingParams(),
    num_draft_tokens: int = 3,
    adaptive: bool = True,
    prefill_step_size: int = 2048,
    stop: Sequence[str] = (),
    grammar: Optional[str] = None,
    draft_sources=None,
    policy: Optional[DraftPolicy] = None,
    images: Sequence = (),
) -> Generator[GenerationResponse, None, None]:
    """Generate text, with MTP speculative decoding when ``num_draft_tokens`` > 0.

    Output is identical (greedy) or identically distributed (sampling) to plain
    decoding; ``num_draft_tokens=0`` is plain decoding. The texts joined equal
    ``tokenizer.decode`` of the generated ids (eos excluded), cut before the first of
    the ``stop`` strings. ``grammar``: an llguidance grammar the output must match
    (``grammar.json_schema_grammar(schema)`` for JSON); generation ends where it does.
    ``draft_sources``: a ``draft_source.DraftSources`` to draft from the context too (None:
    the head only).
    ``policy``: the ``DraftPolicy`` choosing K (e.g. ``step_costs.policy_for``).
    ``images``: decoded images (PIL) for the prompt's image placeholders, in order (a model
    with ``capabilities.images``); the prompt counts their tokens.
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 (got {max_tokens})")
    ids = encode_prompt(tokenizer, prompt)
    ids, prompt_images = with_images(model, ids, images)
    text = TextStream(tokenizer, stop=stop, max_tokens=max_tokens)
    state = None if grammar is None else Grammar(
        tokenizer, grammar, model.text.args.vocab_size, sorted(text.eos)).start()
    dec = _decoder(model, num_draft_tokens, draft_sources, sampling, adaptive=adaptive,
                   prefill_step_size=prefill_step_size, grammar=state, policy=policy,
                   images=prompt_images)
    mx.reset_peak_memory()

    tic = time.perf_counter()
    dec.prefill(ids)
    prompt_time = None
    while max_tokens > 0 and text.finish_reason is None:
        out = dec.step()
        # A head loaded in the wrong layout fails silently: warn once if it accepts ~nothing.
        s = dec.stats  # the head's drafts only: context drafts say nothing about it
        check_acceptance(s.head_draft_tokens, s.head_accepted_tokens, model.model_type)
        if prompt_time is None:
            prompt_time = time.perf_counter() - tic
            tic = time.perf_counter()
        yield from _responses(out, text, dec.stats, len(ids), prompt_time, tic)


def _responses(out, text: TextStream, spec: SpecStats, n_prompt: int, prompt_time: float,
               tic: float):
    """One response per token a step emitted, until the text ends."""
    for i, tok in enumerate(out.tokens):
        _, new_text = text.add([tok])
        n = text.num_tokens
        elapsed = time.perf_counter() - tic
        yield GenerationResponse(
            text=new_text, token=tok, logprobs=out.logprobs[i],
            from_draft=i < out.num_accepted, prompt_tokens=n_prompt,
            prompt_tps=n_prompt / prompt_time if prompt_time else 0.0,
            generation_tokens=n,
            # As mlx-lm: every token counts, the clock starts after the first step.
            generation_tps=n / elapsed if n > 1 and elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=text.finish_reason,
            spec=spec,
        )
        if text.finish_reason is not None:
            return


def with_images(model, ids, images: Sequence):
    """(the prompt ids with each image's placeholder expanded, the prompt's images for
    prefill); no images: (ids, None)."""
    if not images:
        return ids, None
    from ..models.vision.images import ImageError

    encoder = model.image_encoder
    if encoder is None:
        raise ImageError(f"this model ({model.model_type}) takes no images: its checkpoint "
                         "has no vision tower")
    return encoder.encode(ids, encoder.preprocess(images))


def _decoder(model, num_draft_tokens: int, draft_sources, sampling, **kwargs) -> MTPDecoder:
    """The decoder of one generation; with ``draft_sources``, its drafting chosen there."""
    k, drafter = ((num_draft_tokens, None) if draft_sources is None
                  else draft_sources.for_row(num_draft_tokens))
    return MTPDecoder(model, k, sampling, drafter=drafter, **kwargs)


def generate(model, tokenizer, prompt, **kwargs) -> str:
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))


def format_stats(r: GenerationResponse) -> str:
    """mlx-lm's familiar stats block plus one MTP line."""
    lines = [
        f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec",
        f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec",
        f"Peak memory: {r.peak_memory:.3f} GB",
    ]
    if r.spec.num_drafts:
        lines.append(r.spec.describe())
    return "\n".join(lines)
