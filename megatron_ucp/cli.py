"""The `megatron-ucp` command: one argparse subcommand per module, one error line on failure.

A subcommand lives in its own module, which provides `add_cli_parser(subparsers, common)` (adding a
parser built with `parents=[common]` for --quiet/--debug/--json, and `set_defaults(handler=fn)`); the
handler takes the parsed namespace and returns a JSON-safe dict, whose "message" is printed unless
--quiet (the whole dict is printed with --json). A result that is not an error but must fail the
command (checkpoints differ, a layout is incompatible) carries "exit_code" (non-zero). Register the
module in SUBCOMMAND_MODULES.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import sys
import traceback
from typing import Optional, Sequence

# Subcommand modules, in help order; each defines add_cli_parser(subparsers, common).
SUBCOMMAND_MODULES = (
    "megatron_ucp.convert.cli",  # to-universal
    "megatron_ucp.from_universal",  # from-universal
    "megatron_ucp.inspect_cmd",  # inspect
    "megatron_ucp.verify",  # verify
    "megatron_ucp.plan",  # plan
    "megatron_ucp.hf_export",  # export-hf
    "megatron_ucp.check_cmd",  # check
    "megatron_ucp.plot_cmd",  # plot-loss
)


def common_options() -> argparse.ArgumentParser:
    """Options every subcommand takes (used as an argparse parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    common.add_argument("--debug", action="store_true", help="print the full traceback on errors")
    common.add_argument("--json", action="store_true", help="print the result (or the error) as one JSON object")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-ucp", description="Universal Checkpointing for megatron-core GPT training.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    common = common_options()
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).add_cli_parser(subparsers, common)
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
    args = build_parser().parse_args(argv)
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
