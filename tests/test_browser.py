"""The pages in a real browser (Debian's chromium, headless) against the real server: the chat page
talks to /respond and shows the answer; /docs renders the API from local assets (no network)."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import TOPICS, free_port, wait_for

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (CI installs it)")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--virtual-time-budget=20000", "--window-size=900,700",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("browser") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "cli",
        "serve",
        "--bundle",
        str(tiny_bundle),
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


def test_api_docs_render_offline(server, tmp_path):
    page = browse(f"{server}/docs", tmp_path, "--dump-dom")
    assert page.returncode == 0, page.stderr[-2000:]
    assert 'class="swagger-ui' in page.stdout and "/respond" in page.stdout and "opblock" in page.stdout
