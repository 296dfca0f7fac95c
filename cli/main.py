"""The ``coreply`` command: ``train``, ``pretrain``, ``eval``, ``ground`` (train / eval), ``report``,
``index`` (build / add / withdraw / info / verify), ``compact``, ``serve``, ``chat``.

Heavy modules are imported inside each subcommand so ``coreply --help`` stays instant."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from cli.common import CliError, Parser
from cli.evaluate import cmd_eval, cmd_report, eval_parser, report_parser
from cli.index import cmd_compact, cmd_index, compact_parser, index_parser
from cli.serve import chat_parser, cmd_chat, cmd_serve, serve_parser
from cli.train import cmd_ground, cmd_pretrain, cmd_train, ground_parser, pretrain_parser, train_parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="coreply", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser(sub)
    pretrain_parser(sub)
    eval_parser(sub)
    ground_parser(sub)
    report_parser(sub)
    index_parser(sub)
    compact_parser(sub)
    serve_parser(sub)
    chat_parser(sub)
    return parser


COMMANDS: dict[str, Any] = {
    "train": cmd_train,
    "pretrain": cmd_pretrain,
    "eval": cmd_eval,
    "ground": cmd_ground,
    "report": cmd_report,
    "index": cmd_index,
    "compact": cmd_compact,
    "serve": cmd_serve,
    "chat": cmd_chat,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = None if argv is None else list(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(message)s"
    )  # notes from the library (capped lists...)
    from coreply.bundle import BundleError
    from coreply.checkpoint_meta import CheckpointError
    from coreply.readers import DataError

    try:
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a reader gone by now is met here, not in the flush at exit
        return code
    except BrokenPipeError:  # whoever read the output stopped (`| head`): nothing to report, and nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # left to flush at exit
        return 1
    except (CliError, DataError, CheckpointError, BundleError, ValueError, OSError) as exc:
        # OSError: a path that cannot be written (not a folder, no permission, a full disk), as the OS says
        command = " ".join(filter(None, (args.command, getattr(args, f"{args.command}_command", None))))
        print(f"coreply {command}: error: {exc}", file=sys.stderr)  # "index build", as in its flag errors
        return 2
