"""A second corpus to measure the built-in models on: chitchat is the one every choice was made on.

Writes the English conversations of ChatterBot's corpus (the PyPI package ``chatterbot-corpus``, BSD-3;
``pip install chatterbot-corpus==1.3.3``, not a dependency of coreply) as a team would bring its own data:
``pairs.jsonl`` (every turn after a conversation's first is a reply, its context the turns before it; each
distinct (context, reply) once: the package repeats its tech-support lines about a hundred times each) and
``replies.jsonl`` (the pool: every distinct reply, as chitchat's pool is every response of its pairs).
docs/results.md §67 builds bundles over it with no pairs and measures them with ``bench/as_served.py
--pairs``.

    python bench/other_corpus.py --out /tmp/chatterbot
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml


def conversations(folder: Path) -> tuple[dict[str, list[str]], list[str]]:
    """``topic:n`` -> the turns of each conversation in the ``*.yml`` files of ``folder``, in file order,
    and the ``topic:n`` of entries that are not lists of turns, left out (1.3.3's trivia.yml has one, a
    question and its answer in one string); a one-line exit naming a file that is not such YAML."""
    out, skipped = {}, []
    for path in sorted(folder.glob("*.yml")):
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise SystemExit(f"--corpus: {path} is not UTF-8 YAML ({type(exc).__name__})") from None
        dialogues = (data.get("conversations") or []) if isinstance(data, dict) else None
        if not isinstance(dialogues, list):
            raise SystemExit(f"--corpus: {path}: give 'conversations' as a list of lists of turns")
        for n, turns in enumerate(dialogues):
            if isinstance(turns, list):
                out[f"{path.stem}:{n}"] = [text for text in (str(t).strip() for t in turns) if text]
            else:
                skipped.append(f"{path.stem}:{n}")
    return out, skipped


def pairs_and_replies(dialogues: dict[str, list[str]]) -> tuple[list[dict], list[str]]:
    """Each distinct (context, reply) of ``dialogues`` once, as coreply's pairs records, and the distinct
    replies in order of first appearance."""
    pairs, seen, replies = [], set(), {}
    for conversation, turns in dialogues.items():
        for i in range(1, len(turns)):
            key = (tuple(turns[:i]), turns[i])
            if key not in seen:
                seen.add(key)
                pairs.append({"context": turns[:i], "response": turns[i], "conversation_id": conversation})
                replies.setdefault(turns[i], None)
    return pairs, list(replies)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder to write pairs.jsonl and replies.jsonl to")
    p.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="a folder of its .yml files (default: the installed package's)",
    )
    args = p.parse_args()
    folder = args.corpus
    if folder is None:
        try:
            import chatterbot_corpus
        except ImportError:
            raise SystemExit(
                "--corpus: not given and chatterbot-corpus is not installed (pip install it)"
            ) from None
        folder = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    if not sorted(folder.glob("*.yml")):
        raise SystemExit(f"--corpus: {folder} holds no .yml files")
    dialogues, skipped = conversations(folder)
    if skipped:
        print(f"note: {len(skipped)} entries are not lists of turns, left out: {', '.join(skipped)}")
    pairs, replies = pairs_and_replies(dialogues)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "pairs.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs)
    with open(args.out / "replies.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in replies)
    print(f"{args.out}: {len(pairs)} pairs, {len(replies)} replies")


if __name__ == "__main__":
    main()
