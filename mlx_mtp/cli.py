"""``mlx-mtp`` command line: generate | serve | bench | convert | add-mtp | train."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from . import __version__, fast_blas

# command -> (module, function adding its arguments, function running it)
COMMANDS = {
    "generate": ("mlx_mtp.cli", "add_generate_arguments", "run_generate",
                 "Generate text with MTP speculative decoding"),
    "serve": ("mlx_mtp.server.app", "add_arguments", "run",
              "OpenAI-compatible server with continuous batching"),
    "bench": ("mlx_mtp.bench", "add_arguments", "run", "Benchmark MTP vs plain decoding"),
    "convert": ("mlx_mtp.convert", "add_convert_arguments", "run_convert",
                "Convert/quantize a Hugging Face checkpoint, keeping the MTP head"),
    "add-mtp": ("mlx_mtp.convert", "add_add_mtp_arguments", "run_add_mtp",
                "Graft MTP weights into an existing MLX model"),
    "train": ("mlx_mtp.train", "add_arguments", "run", "Train a model or an MTP head"),
}
# Commands that run a model on MLX, and so take --blas (see fast_blas.py).
BLAS_COMMANDS = ("generate", "serve", "bench", "train")


class UserError(Exception):
    """A problem with the user's input: message printed, exit code 2."""


def fail(msg: str) -> int:
    print(f"mlx-mtp: error: {msg}", file=sys.stderr)
    return 2


def add_model_arguments(p: argparse.ArgumentParser):
    p.add_argument("--model", default=None,
                   help="Local model directory (default: the embedded demo model)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--num-draft-tokens", "--spec-draft-n-max", type=int, default=3,
                   dest="num_draft_tokens", help="MTP draft tokens per step, 1-8 (default 3)")
    g.add_argument("--no-mtp", action="store_true", help="Plain decoding; MTP head not loaded")
    p.add_argument("--fixed-k", action="store_true",
                   help="Always draft K tokens (default: adapt K to measured acceptance/cost)")
    p.add_argument("--mtp-hidden", choices=["post_norm", "pre_norm"], default=None,
                   help="Trunk hidden state fed to the MTP head (default post_norm)")


def add_sampling_arguments(p: argparse.ArgumentParser, defaults_from_model=True):
    p.add_argument("--temp", type=float, default=None, help="Sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)


def sampling_from_args(args, model_defaults: dict):
    from .sampling import SamplingParams

    def pick(name, default):
        v = getattr(args, name)
        return v if v is not None else model_defaults.get(name, default)

    return SamplingParams(
        temperature=pick("temp", 0.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
        min_p=pick("min_p", 0.0), seed=args.seed,
    )


def num_draft_tokens_from_args(args) -> int:
    from .speculative import MAX_DRAFT_TOKENS

    if getattr(args, "no_mtp", False):
        return 0
    k = args.num_draft_tokens
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise UserError(
            f"--num-draft-tokens must be between 1 and {MAX_DRAFT_TOKENS} (got {k}); "
            "use --no-mtp for plain decoding."
        )
    return k


def parse_json_arg(value, flag):
    if value is None:
        return {}
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise UserError(f"{flag} is not valid JSON ({e}); example: '{{\"enable_thinking\": false}}'")
    if not isinstance(out, dict):
        raise UserError(f"{flag} must be a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return out


# --- generate ---------------------------------------------------------------
def add_generate_arguments(p: argparse.ArgumentParser):
    add_model_arguments(p)
    p.add_argument("--prompt", "-p", required=True, help="Prompt text, or '-' to read stdin")
    p.add_argument("--max-tokens", "-m", type=int, default=256)
    add_sampling_arguments(p)
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="Send the prompt as raw text, without the chat template")
    p.add_argument("--chat-template-args", default=None,
                   help='JSON passed to the chat template, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)


def build_prompt(tokenizer, text: str, system: str = None, template_args: dict = None,
                 ignore_template: bool = False):
    if ignore_template or not getattr(tokenizer, "chat_template", None):
        return text
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **(template_args or {}))


def run_generate(args) -> int:
    from .generate import format_stats, stream_generate
    from .loader import generation_defaults, load

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise UserError("the prompt is empty; pass --prompt TEXT or pipe text with --prompt -")
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    k = num_draft_tokens_from_args(args)
    template_args = parse_json_arg(args.chat_template_args, "--chat-template-args")
    try:
        sampling = sampling_from_args(args, generation_defaults(args.model))
    except ValueError as e:
        raise UserError(str(e))
    model, tokenizer = load(args.model, mtp=k > 0, mtp_hidden=args.mtp_hidden)
    text = build_prompt(tokenizer, prompt, args.system_prompt, template_args,
                        args.ignore_chat_template)
    last = None
    if args.verbose:
        print("==========")
    for r in stream_generate(model, tokenizer, text, max_tokens=args.max_tokens,
                             sampling=sampling, num_draft_tokens=k, adaptive=not args.fixed_k,
                             prefill_step_size=args.prefill_step_size):
        print(r.text, end="", flush=True)
        last = r
    print()
    if args.verbose and last is not None:
        print("==========")
        print(format_stats(last))
        if sys.platform == "linux":
            print(fast_blas.describe())
    return 0


# --- dispatch -------------------------------------------------------------------
def build_parser(command: str = None):
    parser = argparse.ArgumentParser(prog="mlx-mtp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mlx-mtp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod, add_fn, _, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if name == command:  # import only the module that runs
            getattr(importlib.import_module(mod), add_fn)(sp)
            if name in BLAS_COMMANDS:
                sp.add_argument(
                    "--blas", choices=fast_blas.MODES, default=fast_blas.default_mode(),
                    help="CPU matmul library on Linux: auto = numpy's OpenBLAS through a small "
                         "compiled shim when possible, else MLX's reference BLAS; openblas = "
                         "fail if that is impossible (default: $MLX_MTP_BLAS or auto)")
    return parser


def setup_blas(args, argv):
    """Move this process onto OpenBLAS if wanted (re-executes it), verify, and report it.

    Only when main() is the process's entry point: re-executing replaces the whole process,
    which must not happen to a caller of main(argv) (tests, python -m mlx_mtp.train).
    """
    if getattr(args, "server", None):  # bench --server: a client, it runs no model
        return
    fast_blas.maybe_reexec(args.blas, argv)
    fast_blas.check(args.blas, argv)
    if args.command == "serve":  # app.run's basicConfig is then a no-op: keep its format
        logging.basicConfig(level=args.log_level,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        fast_blas.log.info(fast_blas.describe())
    elif args.command != "generate" and not getattr(args, "quiet", False):
        print(fast_blas.describe(), file=sys.stderr)  # generate prints it with its stats


def main(argv=None) -> int:
    entry_point = argv is None
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in COMMANDS:
        return fail(f"unknown command {command!r}; choose from {', '.join(COMMANDS)}")
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    mod, _, run_fn, _ = COMMANDS[args.command]
    from .loader import ModelLoadError
    from .models import UnsupportedModelError
    from .models.hybrid import MissingMTPWeightsError

    try:
        if entry_point and args.command in BLAS_COMMANDS:
            setup_blas(args, argv)
        return getattr(importlib.import_module(mod), run_fn)(args) or 0
    except (UserError, ModelLoadError, UnsupportedModelError, MissingMTPWeightsError,
            fast_blas.BlasError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Run the imported module's main so exception classes are the ones commands raise.
    from mlx_mtp.cli import main as _main

    sys.exit(_main())
