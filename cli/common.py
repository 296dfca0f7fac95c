"""What every ``coreply`` subcommand shares: the one-line error, the parser that refuses in one line,
argparse types that check a value before the slow work, and the data and model flags."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from coreply.artifacts import check_out_file
from coreply.config import BUILTIN, BUILTIN_WEIGHTS, ModelConfig
from coreply.restatement import check_quantile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Adds an option's default to its help, except where that would say nothing (``None``, an off
    flag) or what the help already says in words ("(default: the whole pool)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        said = action.help or ""
        if action.default is None or action.default is False or "(default: " in said:
            return said
        return super()._get_help_string(action) or said


DEFAULTS_SHOWN = {"formatter_class": _DefaultsShown}


class Parser(argparse.ArgumentParser):
    """Refuses a bad command line in one line naming the flag, like every other CLI error, instead of
    argparse's usage block (40 lines for ``train``) above it; subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """As argparse's, but a flag the command does not know is refused by that command's parser, so the
        message points at its ``--help`` rather than the top one's."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            parser: argparse.ArgumentParser = self
            while subs := [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]:
                parser = subs[0].choices[getattr(parsed, subs[0].dest)]
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed


def checkpoint(kind: str):
    """An argparse type: a checkpoint directory as given, or ``builtin``: the default bundle's trained model
    of this kind, shipped with the package (where it is installed is nothing a user should need to know)."""

    def parse(text: str) -> str:
        return str(BUILTIN_WEIGHTS[kind]) if text == BUILTIN else text

    parse.__name__ = "checkpoint"
    return parse


def add_checkpoint_args(p: argparse.ArgumentParser, bi_default: str | None, cross_none: str) -> None:
    """``--bi`` and ``--cross``: trained checkpoints, or ``builtin``; ``cross_none`` says what no
    ``--cross`` means to this command."""
    p.add_argument(
        "--bi",
        type=checkpoint("bi"),
        default=bi_default,
        help="bi-encoder checkpoint dir, 'builtin' (the default bundle's) or 'zero-shot'"
        + (f" (default: {bi_default})" if bi_default else ""),
    )
    p.add_argument(
        "--cross",
        type=checkpoint("cross"),
        default=None,
        help=f"cross-encoder checkpoint dir or 'builtin' (the default bundle's); none: {cross_none}",
    )


def at_least(low: int):
    """An argparse type: an int >= ``low`` (argparse names the flag in its one-line error)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def result_name(out: str) -> str:
    """A result's default name: its ``--out`` file's name without ``.json`` or ``.json.gz``."""
    return Path(Path(out).name.removesuffix(".gz")).stem


def out_file(text: str) -> str:
    """An argparse type: a file to write whose folder exists, checked before the slow work, not after."""
    try:
        check_out_file(Path(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def out_dir(text: str) -> str:
    """An argparse type: a folder to write, which may exist but not as a file, and whose nearest existing
    parent can take it; checked before the slow work, not after."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; name a folder")
    made = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())  # where mkdir starts
    if not made.is_dir() or not os.access(made, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text} cannot be made: {made} is not a folder you can write to")
    return text


def run_dir(text: str) -> str:
    """An argparse type: a training run's directory (:func:`out_dir`), but not a bundle or a checkpoint
    (the run's files and checkpoints written into one would break its seal)."""
    from coreply.bundle import MANIFEST
    from coreply.checkpoint_meta import META

    path = Path(out_dir(text))
    for name, kind in ((MANIFEST, "bundle"), (META, "checkpoint")):
        if (path / name).is_file():
            raise argparse.ArgumentTypeError(f"{text} is a {kind} ({name}); name a folder for the run")
    return text


def base_model(text: str) -> str:
    """An argparse type: 'default', or a local Hugging Face model folder (checked before the slow work)."""
    if text != "default" and not (Path(text) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a local Hugging Face model folder (no config.json)")
    return text


def service_url(text: str) -> str:
    """An argparse type: a service's http(s) address (``coreply chat --url``)."""
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) address, e.g. http://127.0.0.1:8000")
    return text


def filter_json(text: str) -> dict:
    """An argparse type: a metadata filter as a JSON object (``coreply chat --filter``); its fields and
    values are checked against the pool where it is used."""
    try:
        where = json.loads(text)
    except json.JSONDecodeError:
        where = None
    if not isinstance(where, dict) or not where:
        raise argparse.ArgumentTypeError(
            f'{text!r} is not a JSON object of fields, e.g. \'{{"intent": "refund"}}\''
        )
    return where


def guard_quantile(text: str) -> float | None:
    """An argparse type: 'off', or the restatement guard's quantile in [0.5, 1)."""
    if text == "off":
        return None
    try:
        return check_quantile(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'off' or in [0.5, 1), got {text}") from None


def in_unit_interval(text: str, words: dict[str, Any], wanted: str) -> Any:
    """An argparse type's body: one of ``words`` (text -> value), or a number in [0, 1); else the
    one-line error ``must be <wanted>, got <text>``."""
    if text in words:
        return words[text]
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
    return value


def gate_fidelity(text: str) -> float | None:
    """An argparse type: 'off', or the share of calibration answers the rerank gate (or reach) may change,
    in [0, 1)."""
    return in_unit_interval(text, {"off": None}, "'off' or a share in [0, 1)")


def lexical_weight(text: str) -> float | str | None:
    """An argparse type: 'off', 'auto', or the lexical stage's z-score weight of the dense score in [0, 1)."""
    return in_unit_interval(text, {"off": None, "auto": "auto"}, "'auto', 'off' or a weight in [0, 1)")


def load_data(spec: str, max_turns: int) -> dict[str, list]:
    """``chitchat`` -> the built-in splits; a file -> {'train': pairs} (see coreply.readers)."""
    from coreply.corpus import load_chitchat
    from coreply.readers import read_pairs

    if spec == "chitchat":
        return load_chitchat(max_turns=max_turns)
    return {"train": read_pairs(spec)}


def read_prior_pairs(flag: str | None, builtin_train: list | None) -> list:
    """--prior-pairs: a pairs file, 'none', or (not given) the built-in train split where one applies."""
    from coreply.readers import read_pairs

    if flag not in (None, "none"):
        return read_pairs(flag)
    return builtin_train if builtin_train is not None and flag is None else []


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--base-model",
        type=base_model,
        default="default",
        help="'default' (all-MiniLM-L6-v2 from PyPI) or a local HF dir",
    )
    g.add_argument("--pooling", choices=["cls", "mean"], default="mean", help="how token vectors become one")
    g.add_argument(
        "--projection-dim",
        type=at_least(1),
        default=None,
        help="linear projection after pooling (bi-encoder)",
    )
    g.add_argument("--share-towers", action="store_true", help="one encoder for context and response")
    g.add_argument("--normalize", action="store_true", help="L2-normalise embeddings (cosine scores)")
    g.add_argument(
        "--score-scale", type=float, default=ModelConfig.score_scale, help="bi-encoder scores = scale * dot"
    )
    g.add_argument(
        "--max-context-tokens",
        type=at_least(4),
        default=ModelConfig.max_context_tokens,
        help="context tokens kept (the latest)",
    )
    g.add_argument(
        "--max-response-tokens",
        type=at_least(3),
        default=ModelConfig.max_response_tokens,
        help="response tokens kept",
    )
    g.add_argument("--max-turns", type=at_least(1), default=ModelConfig.max_turns, help="context turns kept")
    g.add_argument("--dropout", type=float, default=ModelConfig.dropout, help="dropout while training")
    g.add_argument(
        "--num-layers",
        type=at_least(1),
        default=None,
        help="keep the base model's first k layers (default: all)",
    )
    g.add_argument(
        "--cross-head",
        choices=["mlp", "match"],
        default=ModelConfig.cross_head,
        help="the reranker's score: 'mlp', a new head on the pooled pair; 'match', a learnt scale times the "
        "cosine of the context's and the response's mean token vectors (ranks from step 0)",
    )
    g.add_argument(
        "--poly-codes",
        type=at_least(0),
        default=0,
        metavar="M",
        help="train the retriever as a Poly-encoder with M learnt context codes (its poly stage then "
        "reranks from cached response vectors); 0: a plain bi-encoder",
    )


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        base_model=args.base_model,
        pooling=args.pooling,
        projection_dim=args.projection_dim,
        share_towers=args.share_towers,
        normalize=args.normalize,
        score_scale=args.score_scale,
        max_context_tokens=args.max_context_tokens,
        max_response_tokens=args.max_response_tokens,
        max_turns=args.max_turns,
        dropout=args.dropout,
        num_layers=args.num_layers,
        poly_codes=args.poly_codes,
        cross_head=args.cross_head,
    )


def not_an_input(out: str, **inputs: str | list[str] | None) -> None:
    """Refuse an ``--out`` that names one of the command's own input files (``inputs``: flag -> path(s)),
    which writing the result would destroy."""
    for flag, paths in inputs.items():
        for path in [paths] if isinstance(paths, str) else paths or []:
            if Path(path).exists() and Path(path).resolve() == Path(out).resolve():
                name = "an input" if flag == "inputs" else "--" + flag.replace("_", "-")
                raise CliError(
                    f"--out {out} is the file {name} reads; writing the result there would destroy it"
                )


def knowledge_file(path: str) -> list[str]:
    """One knowledge sentence per non-blank line of a UTF-8 text file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise CliError(f"--knowledge {path}: not UTF-8 text; save it as UTF-8") from None
    except OSError as exc:
        raise CliError(f"--knowledge {path}: cannot read it ({exc.strerror})") from None
    sentences = [line.strip() for line in lines if line.strip()]
    if not sentences:
        raise CliError(f"--knowledge {path}: no sentences (one per line expected)")
    return sentences
