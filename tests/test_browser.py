"""The pages in a real browser (Debian's chromium, headless) against the real server: the chat page
talks to /respond and shows the answer; /docs renders the API from local assets (no network)."""

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import pytest
from conftest import TOPICS, free_port, wait_for

from index_builder.build import build_bundle

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (CI installs it)")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--virtual-time-budget=20000", "--window-size=900,700",
]  # fmt: skip


@contextmanager
def serving(bundle: Path, log: Path) -> Iterator[str]:
    """The real server on ``bundle`` under uvicorn, its URL while the block runs."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "cli",
        "serve",
        "--bundle",
        str(bundle),
        "--port",
        str(port),
        "--threads",
        "1",
    ]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(f"http://127.0.0.1:{port}/readyz", process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    with serving(tiny_bundle, tmp_path_factory.mktemp("browser") / "server.log") as url:
        yield url


def browse(url: str, tmp_path, *what: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *what, url],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)},
    )  # fmt: skip


def test_chat_page_sends_the_message_and_shows_the_reply(server, tmp_path):
    question, answer = TOPICS["pet"]
    page = browse(
        f"{server}/chat?say={question.replace(' ', '+').replace('?', '%3F')}", tmp_path, "--dump-dom"
    )
    assert page.returncode == 0, page.stderr[-2000:]
    dom = page.stdout
    assert f'<div class="turn user">{question}</div>' in dom
    assert f'<div class="turn bot">{answer}</div>' in dom  # the toy models learned this topic
    assert "13 responses · reranker: cross" in dom  # /readyz read by the page
    shot = browse(f"{server}/chat?say=hello", tmp_path, f"--screenshot={tmp_path / 'chat.png'}")
    assert shot.returncode == 0 and (tmp_path / "chat.png").stat().st_size > 5000


def test_chat_page_answers_within_its_filter_and_says_a_bad_one(tiny_core, tmp_path):
    """A filter set on the page (here by the link's ``filter=``) goes with the message: the pet question is
    answered from the one response the filter allows, its fields shown; a filter the service refuses, or
    one that is not JSON, is said on the page."""
    answers = [a for _, a in TOPICS.values()]
    metadata = [{"intent": name} for name in TOPICS]
    bundle = tmp_path / "b"
    build_bundle(bundle, answers, bi=str(tiny_core / "bi"), onnx="none", progress=False, metadata=metadata)
    question = quote(TOPICS["pet"][0])
    with serving(bundle, tmp_path / "server.log") as url:
        shown = {}
        for where in ('{"intent": "sport"}', '{"intnet": "sport"}', "sport"):
            page = browse(f"{url}/chat?say={question}&filter={quote(where)}", tmp_path, "--dump-dom")
            assert page.returncode == 0, page.stderr[-2000:]
            shown[where] = page.stdout
    assert f'<div class="turn bot">{TOPICS["sport"][1]}</div>' in shown['{"intent": "sport"}']
    assert 'intent "sport"' in shown['{"intent": "sport"}']  # the reply's metadata, under it
    assert (
        "filter.intnet: no response in this pool has this field (fields: intent)"
        in shown['{"intnet": "sport"}']
    )
    assert "filter: not a JSON object of fields" in shown["sport"]


def test_api_docs_render_offline(server, tmp_path):
    page = browse(f"{server}/docs", tmp_path, "--dump-dom")
    assert page.returncode == 0, page.stderr[-2000:]
    assert 'class="swagger-ui' in page.stdout and "/respond" in page.stdout and "opblock" in page.stdout
