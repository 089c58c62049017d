"""Command-line options shared by several verbs, defined once, and the user-error type.

Nothing here imports MLX: the CLI builds parsers before the platform is set up.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

from .decode import MAX_DRAFT_TOKENS, check_num_draft_tokens


class UserError(Exception):
    """A problem with the user's input: the CLI prints the message and exits with code 2."""


def add_model_arguments(p: argparse.ArgumentParser):
    p.add_argument("--model", default=None,
                   help="Local model directory (default: the embedded demo model)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--num-draft-tokens", "--spec-draft-n-max", type=int, default=3,
                   dest="num_draft_tokens",
                   help=f"MTP draft tokens per step, 1-{MAX_DRAFT_TOKENS} (default 3)")
    g.add_argument("--no-mtp", action="store_true", help="Plain decoding; MTP head not loaded")
    p.add_argument("--fixed-k", action="store_true",
                   help="Always draft K tokens (default: adapt K to measured acceptance/cost)")
    p.add_argument("--mtp-hidden", choices=["post_norm", "pre_norm"], default=None,
                   help="Trunk hidden state fed to the MTP head (default post_norm)")


def add_sampling_arguments(p: argparse.ArgumentParser):
    p.add_argument("--temp", type=float, default=None,
                   help="Sampling temperature, 0 = greedy (default: the model's "
                        "generation_config.json, else 0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)


def num_draft_tokens_from_args(args) -> int:
    if getattr(args, "no_mtp", False):
        return 0
    k = args.num_draft_tokens
    if k == 0 or not _in_range(k):
        raise UserError(f"--num-draft-tokens must be between 1 and {MAX_DRAFT_TOKENS} "
                        f"(got {k}); use --no-mtp for plain decoding.")
    return k


def _in_range(k) -> bool:
    try:
        check_num_draft_tokens(k)
    except ValueError:
        return False
    return True


def sampling_defaults(args, model_defaults: dict) -> dict:
    """Flags over the model's generation_config.json (keys temp, top_p, top_k, min_p)."""
    out = dict(model_defaults)
    for name in ("temp", "top_p", "top_k", "min_p"):
        v = getattr(args, name, None)
        if v is not None:
            out[name] = v
    return out


def sampling_from_args(args, model_defaults: dict):
    """SamplingParams from flags and the model's defaults; bad values are a UserError."""
    from .decode.sampling import SamplingParams

    d = sampling_defaults(args, model_defaults)
    try:
        return SamplingParams(temperature=d.get("temp", 0.0), top_p=d.get("top_p", 1.0),
                              top_k=d.get("top_k", 0), min_p=d.get("min_p", 0.0),
                              seed=getattr(args, "seed", None))
    except ValueError as e:
        raise UserError(str(e))


def parse_json_arg(value: Optional[str], flag: str) -> dict:
    if value is None:
        return {}
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise UserError(f"{flag} is not valid JSON ({e}); example: '{{\"enable_thinking\": false}}'")
    if not isinstance(out, dict):
        raise UserError(f"{flag} must be a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return out
