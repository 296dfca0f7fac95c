from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

from tiny import write_tiny_model

from coreply.artifacts import Sealing, hash_tree, write_json_atomic
from coreply.config import ModelConfig
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


POOL_EXTRA = ["hello", "ok then", "see you later", "that is funny", "what do you mean ?"]


def train_toy(out: Path, model: ModelConfig, pairs: list[Pair], **overrides) -> dict:
    """Train on the toy task (CORE unless ``overrides`` say otherwise) into ``out``; the summary."""
    from training.config import TrainConfig
    from training.trainer import Trainer

    settings = dict(mode="core", num_negatives=3, batch_size=8, max_steps=60, eval_every=30, valid_size=16)
    settings |= dict(valid_candidates=4, lr=3e-3, device="cpu", log_every=30) | overrides
    config = TrainConfig(output_dir=str(out), model=model, **settings)
    return Trainer(config, pairs, pairs[:16], sorted({p.response for p in pairs})).fit()


@pytest.fixture(scope="session")
def tiny_core(tmp_path_factory, tiny_model_dir, toy_pairs) -> Path:
    """A tiny bi- and cross-encoder trained together (CORE) on the toy task: ``run/bi``, ``run/cross``."""
    out = tmp_path_factory.mktemp("tiny-core") / "run"
    train_toy(out, ModelConfig(base_model=str(tiny_model_dir), dropout=0.0), toy_pairs)
    return out


def reseal(root: Path, sealing: Sealing, edit: Callable[[dict], None] = lambda meta: None) -> str:
    """Change a sealed artifact's JSON in place with ``edit`` and record its files and version anew (in
    the format ``edit`` leaves), as a tool that knows the format would: what is left to catch is what
    the hashes cannot see. Returns the version."""
    path = root / sealing.meta_name
    meta = json.loads(path.read_text())
    edit(meta)
    meta["files"] = hash_tree(root, sealing.meta_name)
    meta[sealing.version] = sealing.version_of(meta, meta["files"])
    write_json_atomic(path, meta)
    return meta[sealing.version]


def toy_pool() -> list[str]:
    return [answer for _, answer in TOPICS.values()] + POOL_EXTRA


def best_within(vectors: np.ndarray, queries: np.ndarray, k: int, allow: np.ndarray) -> np.ndarray:
    """Each query's best k allowed ids [Q, k] by brute force (vectors [N, D], queries [Q, D], allow [Q, N]
    bool), -1 past its last allowed row."""
    scores = np.where(allow, queries @ vectors.T, -np.inf)  # [Q, N]
    best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.where(np.take_along_axis(scores, best, 1) > -np.inf, best, -1)


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_core, toy_pairs) -> Path:
    """A bundle of the tiny CORE models over the toy pool (int8 ONNX, exact search)."""
    from index_builder.build import build_bundle

    out = tmp_path_factory.mktemp("bundles") / "tiny"
    build_bundle(
        out,
        toy_pool(),
        bi=str(tiny_core / "bi"),
        cross=str(tiny_core / "cross"),
        queries=[p.context for p in toy_pairs[:8]],
        calibration=toy_pairs[:16],
        progress=False,
    )
    return out


RESTATED = "what is your favorite food ? !"
"""A pool entry that restates a toy question (not an exact echo: the restatement guard's job)."""


def tiny_models_over(tmp_path_factory, tiny_core, name: str, pool: list[str], **options) -> Path:
    """A bundle of the tiny CORE models over ``pool``, built with ``options`` (PyTorch only)."""
    from index_builder.build import build_bundle

    out = tmp_path_factory.mktemp("bundles") / name
    models = {"bi": str(tiny_core / "bi"), "cross": str(tiny_core / "cross")}
    build_bundle(out, pool, **models, onnx="none", progress=False, **options)
    return out


@pytest.fixture(scope="session")
def guarded_bundle(tmp_path_factory, tiny_core, toy_pairs) -> Path:
    """The tiny CORE models over the toy pool and :data:`RESTATED`, with the restatement guard calibrated
    on the toy pairs (PyTorch only)."""
    pool = [*toy_pool(), RESTATED]
    return tiny_models_over(
        tmp_path_factory, tiny_core, "guarded", pool, guard_pairs=toy_pairs, guard_quantile=0.99
    )


VARIANTS = ["I LOVE PIZZA AND PASTA!!", "i loove pizza and pasta", "Hello!", "helloooo ."]
"""Spelling variants of two toy pool answers ("i love pizza and pasta", "hello")."""

SAYS_NOTHING = ["...", "? !"]
"""Replies that say nothing (:func:`coreply.text.says_nothing`)."""


@pytest.fixture(scope="session")
def variants_bundle(tmp_path_factory, tiny_core) -> Path:
    """The tiny CORE models over the toy pool, :data:`VARIANTS` and :data:`SAYS_NOTHING` (PyTorch only)."""
    pool = [*toy_pool(), *VARIANTS, *SAYS_NOTHING]
    return tiny_models_over(tmp_path_factory, tiny_core, "variants", pool)


LEXICAL_WEIGHT = 0.4


@pytest.fixture(scope="session")
def lexical_bundle(tmp_path_factory, tiny_core) -> Path:
    """The tiny CORE models over the toy pool with a lexical stage at :data:`LEXICAL_WEIGHT` over 8
    candidates (PyTorch only)."""
    options = {"lexical_weight": LEXICAL_WEIGHT, "lexical_depth": 8}
    return tiny_models_over(tmp_path_factory, tiny_core, "lexical", toy_pool(), **options)


# ---------------------------------------------------------------------------- real servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_cert(folder: Path, name: str, days: int = 2) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 whose subject is ``name``, valid for ``days``, and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    request = [
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        str(days),
        "-subj",
        f"/CN={name}",
    ]
    subprocess.run(
        [*request, "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


def wait_for(
    url: str, process: subprocess.Popen | None = None, timeout: float = 120, verify: object = True
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def check_drain_under_load(base: str, body: dict, terminate: Callable[[], None], requests: int = 64) -> None:
    """``requests`` concurrent POST /respond; ``terminate()`` (a SIGTERM) once the first is answered. Every
    request is then either answered 200 or refused before admission, and some 200s finished after the
    signal (they really were in flight)."""
    outcomes: list[tuple[str, float]] = []

    async def one(client: httpx.AsyncClient) -> None:
        try:
            r = await client.post(base + "/respond", json=body)
            outcomes.append(("ok" if r.status_code == 200 else f"http {r.status_code}", time.monotonic()))
        except httpx.ConnectError:
            outcomes.append(("refused", time.monotonic()))
        except httpx.HTTPError as exc:
            outcomes.append((f"failed after admission: {exc!r}", time.monotonic()))

    async def load_then_terminate() -> float:
        limits = httpx.Limits(max_connections=requests, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            tasks = [asyncio.create_task(one(client)) for _ in range(requests)]
            while not outcomes:  # requests are flowing; most are still queued
                await asyncio.sleep(0.005)
            terminate()
            sent = time.monotonic()
            await asyncio.gather(*tasks)
        return sent

    sent = asyncio.run(load_then_terminate())
    kinds = [kind for kind, _ in outcomes]
    assert set(kinds) <= {"ok", "refused"}, [k for k in kinds if k not in ("ok", "refused")]
    assert sum(1 for kind, at in outcomes if kind == "ok" and at > sent) > 0


class Gate:
    """Wraps an engine factory: once ``close()``d, context encoding blocks until ``opened.set()`` (10 s at
    most); ``entered`` is set when a batch reaches it."""

    def __init__(self) -> None:
        self.opened, self.entered = threading.Event(), threading.Event()
        self.opened.set()

    def factory(self, settings, metrics):
        from service.engine import load_engine

        engine = load_engine(settings, metrics)
        encode = engine.backend.encode_contexts

        def gated(contexts):
            self.entered.set()
            self.opened.wait(10)
            return encode(contexts)

        engine.backend.encode_contexts = gated
        return engine

    def close(self) -> None:
        self.entered.clear()
        self.opened.clear()
