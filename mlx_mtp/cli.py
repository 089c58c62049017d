"""``mlx-mtp`` command line: parse, set up the platform, dispatch to the verb's module."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .options import UserError

# command -> (module with add_arguments(parser) and run(args), help)
COMMANDS = {
    "generate": ("mlx_mtp.generate", "Generate text with MTP speculative decoding"),
    "serve": ("mlx_mtp.server.main", "OpenAI-compatible server with continuous batching"),
    "bench": ("mlx_mtp.bench.main", "Benchmark MTP vs plain decoding"),
    "convert": ("mlx_mtp.convert.main",
                "Convert/quantize a Hugging Face checkpoint, keeping the MTP head"),
    "add-mtp": ("mlx_mtp.convert.add_mtp", "Graft MTP weights into an existing MLX model"),
    "train": ("mlx_mtp.train.main", "Train a model or an MTP head"),
    "draft-vocab": ("mlx_mtp.convert.draft_vocab",
                    "Rank a model's tokens by frequency in a corpus (for --draft-vocab)"),
    "inspect": ("mlx_mtp.tools.inspect_model",
                "What a checkpoint holds (family, layout, MTP head, memory), from its headers"),
    "doctor": ("mlx_mtp.tools.doctor", "This machine: MLX, BLAS, device, and what MTP gains here"),
}
MODEL_COMMANDS = ("generate", "serve", "bench", "train", "doctor")  # run models: take --blas


def fail(msg: str) -> int:
    print(f"mlx-mtp: error: {msg}", file=sys.stderr)
    return 2


def _name_the_model(message: str, args) -> str:
    """Put the model the user passed into the fix a model error suggests (the model code
    that raises does not know the path)."""
    model = getattr(args, "model", None)
    return message.replace("--model THIS", f"--model {model}") if model else message


def _shows_default(action) -> bool:
    return bool(action.option_strings) and not any(
        action.default is v for v in (None, False, True, argparse.SUPPRESS))


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every flag's help names its default (as ``(default: X)``) unless it already does."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (_shows_default(action) and "default" not in text.lower()
                and f"({action.default})" not in text):
            text += " (default: %(default)s)"
        return text


def build_parser(command=None):
    """The parser; only ``command``'s module is imported (for its arguments)."""
    from .platform import blas

    parser = argparse.ArgumentParser(
        prog="mlx-mtp", description="Lossless speculative decoding on MLX with the multi-token-"
        "prediction (MTP) heads checkpoints ship. `mlx-mtp COMMAND --help` lists a command's "
        "flags; without --model, commands use the embedded demo model.")
    parser.add_argument("--version", action="version", version=f"mlx-mtp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_,
                            formatter_class=_DefaultsFormatter)
        if name == command:
            parser.command_parser = sp  # reports the verb's own usage on bad flags
            importlib.import_module(module).add_arguments(sp)
            if name in MODEL_COMMANDS:
                blas.add_argument(sp)
            if not issubclass(sp.formatter_class, _DefaultsFormatter):  # a verb chose its own
                sp.formatter_class = type("Formatter", (_DefaultsFormatter, sp.formatter_class),
                                          {})
            for action in sp._actions:
                if action.help is None and _shows_default(action):
                    action.help = "(default: %(default)s)"
    return parser


def main(argv=None) -> int:
    from .platform import blas

    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in COMMANDS:
        return fail(f"unknown command {command!r}; choose from {', '.join(COMMANDS)}")
    parser = build_parser(command)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # exits with status 2 after the subcommand's usage
        getattr(parser, "command_parser", parser).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command in MODEL_COMMANDS:
            blas.setup(args)
        # Errors meant for users (bad input, unusable checkpoints) derive from these.
        from .decode.prompt import EmptyPromptError
        from .models.io.loader import USER_ERRORS

        try:
            return importlib.import_module(COMMANDS[args.command][0]).run(args) or 0
        except USER_ERRORS + (EmptyPromptError,) as e:
            return fail(_name_the_model(str(e), args))
    except (UserError, blas.BlasError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
