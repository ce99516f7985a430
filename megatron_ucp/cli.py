"""The `megatron-ucp` command: one argparse subcommand per module, one error line on failure.

A subcommand lives in its own module, which provides `add_cli_parser(subparsers, common)` (adding a
parser built with `parents=[common]` for --quiet/--debug/--json, and `set_defaults(handler=fn)`); the
handler takes the parsed namespace and returns a JSON-safe dict, whose "message" is printed unless
--quiet (the whole dict is printed with --json). A result that is not an error but must fail the
command (checkpoints differ, a layout is incompatible) carries "exit_code" (non-zero). Register the
module in SUBCOMMANDS with the one-line help `megatron-ucp --help` lists.

Only the module of the command being run is imported (some import torch, seconds): `megatron-ucp --help`
lists the commands from SUBCOMMANDS alone, and `megatron-ucp inspect ...` never imports the converter.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import sys
import traceback
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Subcommand:
    name: str
    module: str  # defines add_cli_parser(subparsers, common); imported only when the command runs
    help: str  # what `megatron-ucp --help` lists (the module's own parser says the same)


SUBCOMMANDS = (  # in help order
    Subcommand("to-universal", "megatron_ucp.commands.to_universal",
               "convert a Megatron-LM checkpoint into a universal checkpoint"),
    Subcommand("from-universal", "megatron_ucp.commands.from_universal",
               "write a universal checkpoint as a Megatron checkpoint at any layout"),
    Subcommand("inspect", "megatron_ucp.commands.inspect",
               "show what a checkpoint holds (format, layout, config, parameters)"),
    Subcommand("verify", "megatron_ucp.commands.verify", "compare two checkpoints of any formats and layouts"),
    Subcommand("plan", "megatron_ucp.commands.plan", "check a target layout and show what each rank would read"),
    Subcommand("export-hf", "megatron_ucp.commands.export_hf",
               "write a Hugging Face transformers model from a universal checkpoint"),
    Subcommand("import-hf", "megatron_ucp.commands.import_hf",
               "write a universal checkpoint (weights only, iteration 0) from a Hugging Face model"),
    Subcommand("check", "megatron_ucp.commands.check",
               "check every block, file and shape of a universal checkpoint (exit 1 naming what is damaged)"),
    Subcommand("plot-loss", "megatron_ucp.commands.plot", "plot loss curves of --log-jsonl files, resume point marked"),
)
SUBCOMMAND_MODULES = tuple(c.module for c in SUBCOMMANDS)


def common_options() -> argparse.ArgumentParser:
    """Options every subcommand takes (used as an argparse parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    common.add_argument("--debug", action="store_true",
                        help="print the full traceback on errors, and debug lines (e.g. classes of a newer Megatron "
                             "read as inert records)")
    common.add_argument("--json", action="store_true", help="print the result (or the error) as one JSON object")
    return common


def _command_in(argv: Sequence[str]) -> Optional[str]:
    """The subcommand named in argv: its first word that is not an option (the top-level parser has
    only -h/--help, which takes no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    """The parser of `megatron-ucp`. Only the sub-parser of the command named in `argv` is built (its module
    imported); the others are listed by name and help. argv=None builds every sub-parser."""
    parser = argparse.ArgumentParser(
        prog="megatron-ucp", description="Universal Checkpointing for megatron-core GPT training.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    common = common_options()
    chosen = None if argv is None else _command_in(argv)
    for command in SUBCOMMANDS:
        if argv is None or command.name == chosen:
            importlib.import_module(command.module).add_cli_parser(subparsers, common)
        else:
            subparsers.add_parser(command.name, help=command.help, add_help=False)
    return parser


def _one_line(error: BaseException) -> str:
    cause = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" while writing {cause.filename}" if cause.filename else ""
        return (f"no space left on the device{where}; free space or choose a destination on another disk "
                "and rerun (the partial output was removed; the input is untouched)")
    text = " ".join(str(error).split()) or type(error).__name__
    return text if not isinstance(error, KeyError) else text.strip("'\"")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point (`megatron-ucp`, `python -m megatron_ucp.cli`); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    if args.debug:  # megatron-ucp's own debug lines (e.g. classes loaded as inert records) on stderr
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("debug: %(message)s"))
        logger = logging.getLogger("megatron_ucp")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        result = args.handler(args) or {}
    except KeyboardInterrupt:
        print("error: interrupted; no output was left behind", file=sys.stderr)
        return 130
    except Exception as e:  # one clear line; the traceback only on request
        if args.debug:
            traceback.print_exc()
        message = _one_line(e)
        print(f"error: {message}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "error": message, "type": type(e).__name__}))
        return 1
    if args.json:
        print(json.dumps({"ok": True, **result}))
    elif not args.quiet and result.get("message"):
        print(result["message"])
    return int(result.get("exit_code", 0))


if __name__ == "__main__":
    sys.exit(main())
