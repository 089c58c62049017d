"""``mlx-mtp generate``: generate text from a prompt, with MTP speculative decoding."""

from __future__ import annotations

import os
import sys

from .options import (UserError, add_model_arguments, add_sampling_arguments,
                      describe_choices, drafting_from_args, load_from_args, parse_json_arg,
                      sampling_from_args)


def str_to_bool(value: str) -> bool:
    """mlx_lm.generate's reading of --verbose: anything but "false" / "f" is true."""
    return value.lower() not in ("false", "f")


def add_arguments(p):
    add_model_arguments(p)
    p.add_argument("--prompt", "-p", required=True, help="Prompt text, or '-' to read stdin")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="An image before the prompt text (repeatable; a checkpoint with a "
                        "vision tower)")
    p.add_argument("--max-tokens", "-m", type=int, default=256,
                   help="Tokens to generate at most (default: 256)")
    add_sampling_arguments(p)
    p.add_argument("--system-prompt", default=None,
                   help="System message put before the prompt (default: none)")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="Send the prompt as raw text, without the chat template")
    p.add_argument("--chat-template-args", default=None,
                   help='JSON passed to the chat template, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--prefill-step-size", type=int, default=2048,
                   help="Prompt tokens per prefill pass (default: 2048)")
    p.add_argument("--verbose", type=str_to_bool, nargs="?", const=True, default=True,
                   help="As mlx_lm.generate: True (default) frames the text and prints the "
                        "stats; False or F prints the text only")


def run(args) -> int:
    from .decode import step_costs
    from .decode.generation import format_stats, stream_generate
    from .decode.prompt import build_prompt
    from .models.io.loader import check_tokenizer_fits, generation_defaults
    from .platform import blas

    # As mlx_lm.generate: "\n" and "\t" typed on the command line are a newline and a tab.
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    if not prompt.strip():
        raise UserError("the prompt is empty; pass --prompt TEXT or pipe text with --prompt -")
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    group = _distributed_group(args)
    drafting = drafting_from_args(args, distributed=group is not None)
    k, sources = drafting.k, drafting.sources
    template_args = parse_json_arg(args.chat_template_args, "--chat-template-args")
    images = _read_images(args.image)
    sampling = sampling_from_args(args, generation_defaults(args.model))
    adaptive = drafting.adaptive
    model, tokenizer = load_from_args(args, mtp=k > 0, group=group)
    if group is not None:
        import mlx.core as mx
        from .models.distributed import shared_seed

        check_tokenizer_fits(model, tokenizer, args.model or "the demo model")
        mx.random.seed(shared_seed(group))  # unseeded sampling: the same seed on every rank
        adaptive = False  # K from per-rank timings could differ between ranks: fixed K
        if group.rank() != 0:  # rank 0 prints; the others only compute
            args.verbose, sys.stdout = False, open(os.devnull, "w")
    text = build_prompt(tokenizer, prompt, args.system_prompt, template_args,
                        args.ignore_chat_template, images=len(images))
    last = None
    # Step costs measured on this machine before (or in a short calibration now): K and
    # the draft source are right from the first steps. Not for a split model (ranks
    # would time differently).
    stored = group is None and ((adaptive and k) or sources is not None)
    policy = step_costs.policy_for(model, k, adaptive) if stored else None
    if args.verbose:
        print("==========")
    stream = stream_generate(model, tokenizer, text, max_tokens=args.max_tokens,
                             sampling=sampling, num_draft_tokens=k, adaptive=adaptive,
                             prefill_step_size=args.prefill_step_size, policy=policy,
                             draft_sources=sources, images=images)
    for r in _image_errors_as_user_errors(stream):
        print(r.text, end="", flush=True)
        last = r
    print()
    if policy is not None:
        step_costs.save(model, policy.costs)
    if args.verbose and last is not None:
        print("==========")
        print(format_stats(last))
        print(describe_choices(model))
        if sys.platform == "linux":
            print(blas.describe())
        if group is not None:
            print(f"Distributed: {model.mode} over {group.size()} ranks")
    if group is not None:
        import mlx.core as mx

        mx.synchronize()  # a step launched ahead still talks to the other ranks
    return 0


def _read_images(paths):
    """The decoded images of ``--image`` (read before the model loads: a bad file fails fast)."""
    if not paths:
        return []
    from .models.vision.images import ImageError, ImageLimits, check_count, read_image_file

    limits = ImageLimits()
    try:
        check_count(len(paths), limits)
        return [read_image_file(p, limits) for p in paths]
    except ImageError as e:
        raise UserError(f"--image: {e}") from e


def _image_errors_as_user_errors(stream):
    """A prompt the images do not fit (placeholders, a model without a tower): exit 2."""
    from .models.vision.images import ImageError

    try:
        yield from stream
    except ImageError as e:
        raise UserError(str(e)) from e


def _distributed_group(args):
    """The mx.distributed group to split the model over (None: run in one process)."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        if args.distributed:
            raise UserError("--distributed: this MLX build has no distributed backend")
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 or args.distributed else None
