from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

from tiny import write_tiny_model

from coreply.corpus import Pair


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-bert"))


TOPICS = {
    "food": ("what is your favorite food ?", "i love pizza and pasta"),
    "pet": ("do you have a pet ?", "yes i have a dog and a cat"),
    "sport": ("do you play a sport ?", "i play tennis and football"),
    "weather": ("how is the weather ?", "it is sunny and hot"),
    "plan": ("what is your plan for the weekend ?", "a trip to the beach"),
    "music": ("what music do you like ?", "i like music from my city"),
    "sleep": ("are you tired ?", "yes i need to sleep tonight"),
    "book": ("what book do you like ?", "i love a good book at night"),
}


@pytest.fixture(scope="session")
def toy_pairs() -> list[Pair]:
    """A small learnable corpus: each topic's question is answered by its own response."""
    pairs = []
    for round_ in range(6):
        for name, (question, answer) in TOPICS.items():
            pairs.append(Pair(("hello", f"hi how are you {round_}", question), answer, f"{name}-{round_}"))
    return pairs
