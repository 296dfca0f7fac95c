"""The images, built and run for real (podman with runc): `make containers` builds them
(scripts/containers.sh) and runs this module with the image names in the environment; plain `make test`
skips it. What is and is not covered is in docker/README.md."""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import TOPICS, check_drain_under_load, free_port, make_cert, wait_for

IMAGE = os.environ.get("COREPLY_IMAGE")
GPU_IMAGE = os.environ.get("COREPLY_GPU_IMAGE")
PROMETHEUS_IMAGE = os.environ.get("PROMETHEUS_IMAGE")
pytestmark = pytest.mark.skipif(not IMAGE, reason="set by `make containers` once the images are built")
COMPOSE = Path(__file__).parent.parent / "docker" / "docker-compose.yml"


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, timeout=300)


@pytest.fixture(scope="module")
def readable_bundle(tiny_bundle, tmp_path_factory) -> Path:
    """The tiny bundle where the image's unprivileged user (uid 10001) can read it."""
    root = Path(tmp_path_factory.mktemp("shared"))
    out = root / "bundle"
    shutil.copytree(tiny_bundle, out)
    for path in (root.parent, root, out, *out.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return out


def start(
    image: str, bundle: Path, name: str, *env: str, tls: Path | None = None, verify: object = True
) -> str:
    """Run ``image`` detached, as production would (read-only root, /tmp a tmpfs); its base URL. ``tls``:
    a folder mounted at /tls, and the server's scheme HTTPS."""
    port = free_port()
    podman("rm", "-f", name, check=False)
    mounts = ["-v", f"{bundle}:/bundle:ro"] + ([] if tls is None else ["-v", f"{tls}:/tls:ro"])
    podman(
        "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", *mounts,
        "--read-only", "--tmpfs", "/tmp", "-e", "COREPLY_THREADS=1", *(f"-e{e}" for e in env), image,
    )  # fmt: skip
    base = f"{'http' if tls is None else 'https'}://127.0.0.1:{port}"
    try:
        wait_for(base + "/readyz", timeout=120, verify=verify)
    except TimeoutError:
        raise AssertionError(podman("logs", name, check=False).stderr[-3000:]) from None
    return base


def test_cpu_image_serves_scrapes_and_drains_on_sigterm(readable_bundle):
    name = "coreply-ci-cpu"
    base = start(IMAGE, readable_bundle, name, "COREPLY_DRAIN_SECONDS=15", "COREPLY_QUEUE_MAX=1000")
    try:
        answer = httpx.post(base + "/respond", json={"context": [TOPICS["pet"][0]]}).json()
        assert answer["responses"] and answer["responses"][0]["text"]
        metrics = httpx.get(base + "/metrics").text
        assert "coreply_request_duration_seconds_bucket" in metrics
        assert podman("inspect", name, "--format", "{{.Config.User}}").stdout.strip() == "10001"
        assert podman("healthcheck", "run", name, check=False).returncode == 0  # the image's own check
        body = {"context": ["hi", "how are you ?", TOPICS["sport"][0]], "n_candidates": 13, "fusion": "sum"}
        check_drain_under_load(base, body, lambda: podman("kill", "--signal", "TERM", name))
        code = int(podman("wait", name).stdout.strip())
        logs = podman("logs", name).stderr + podman("logs", name).stdout
        assert code in (0, 143), logs[-3000:]  # 143: uvicorn re-raises the SIGTERM after a clean shutdown
        assert "Application shutdown complete" in logs
    finally:
        podman("rm", "-f", name, check=False)


def test_cpu_image_serves_https_and_its_health_check_speaks_it(readable_bundle, tmp_path):
    import ssl

    cert, key = make_cert(tmp_path, "coreply")
    for path in (tmp_path, cert, key):
        path.chmod(0o755 if path.is_dir() else 0o644)  # for the image's unprivileged user
    name = "coreply-ci-tls"
    trust = ssl.create_default_context(cafile=cert)
    files = ("COREPLY_TLS_CERT_FILE=/tls/coreply.crt", "COREPLY_TLS_KEY_FILE=/tls/coreply.key")
    base = start(IMAGE, readable_bundle, name, *files, tls=tmp_path, verify=trust)
    try:
        assert httpx.post(base + "/respond", json={"context": ["hello"]}, verify=trust).status_code == 200
        assert podman("healthcheck", "run", name, check=False).returncode == 0
    finally:
        podman("rm", "-f", name, check=False)


@pytest.mark.skipif(not GPU_IMAGE, reason="GPU image not built")
def test_gpu_image_with_a_cpu_torch_installs_the_gpu_stack_and_serves(readable_bundle):
    """Everything in Dockerfile.gpu but CUDA: onnxruntime-gpu and faiss-gpu installed and importable,
    the package served (on the CPU, as there is no GPU here)."""
    probe = "import faiss, onnxruntime; print(onnxruntime.get_available_providers())"
    providers = podman("run", "--rm", "--entrypoint", "python", GPU_IMAGE, "-c", probe).stdout
    assert "CUDAExecutionProvider" in providers
    name = "coreply-ci-gpu"
    base = start(GPU_IMAGE, readable_bundle, name, "COREPLY_DEVICE=cpu")
    try:
        assert httpx.post(base + "/respond", json={"context": ["hello"]}).status_code == 200
    finally:
        podman("rm", "-f", name, check=False)


@pytest.mark.skipif(not PROMETHEUS_IMAGE, reason="no Prometheus image")
def test_compose_stack_prometheus_scrapes_coreply(readable_bundle):
    """docker/docker-compose.yml under podman-compose: coreply and a real Prometheus that scrapes it by its
    service name, loads the alert rules and stores the trace-id exemplars of request latencies (Grafana is
    not started: no image)."""
    app_port, prom_port = free_port(), free_port()
    env = {
        **os.environ,
        "COREPLY_BUNDLE_DIR": str(readable_bundle),
        "COREPLY_HOST_PORT": str(app_port),
        "PROMETHEUS_HOST_PORT": str(prom_port),
        "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", ""),
    }
    compose = ["podman-compose", "-p", "coreply-ci", "-f", str(COMPOSE)]
    up = subprocess.run([*compose, "up", "-d", "--no-build", "coreply", "prometheus"], env=env,
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        wait_for(f"http://127.0.0.1:{app_port}/readyz", timeout=120)
        wait_for(f"http://127.0.0.1:{prom_port}/-/ready", timeout=60)
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        deadline, up_value = time.monotonic() + 60, None
        while up_value != "1" and time.monotonic() < deadline:
            result = httpx.get(api + "/query", params={"query": 'up{job="coreply"}'}).json()["data"]["result"]
            up_value = result[0]["value"][1] if result else None
            time.sleep(1)
        assert up_value == "1", "Prometheus never scraped coreply"
        rules = httpx.get(api + "/rules").json()["data"]["groups"]
        assert any(rule["name"] for group in rules for rule in group["rules"]), json.dumps(rules)[:500]
        # A traced request's latency reaches Prometheus as an exemplar carrying the caller's trace id.
        trace_id, started = "4bf92f3577b34da6a3ce929d0e0e4736", time.time() - 60
        traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"
        respond = httpx.post(f"http://127.0.0.1:{app_port}/respond", json={"context": ["hello"]},
                             headers={"traceparent": traceparent})  # fmt: skip
        assert respond.status_code == 200
        query = {"query": 'coreply_request_duration_seconds_bucket{route="/respond"}', "start": started}
        deadline, traced = time.monotonic() + 60, []
        while not traced and time.monotonic() < deadline:
            time.sleep(1)
            series = httpx.get(api + "/query_exemplars", params={**query, "end": time.time()}).json()["data"]
            traced = [e for s in series for e in s["exemplars"] if e["labels"].get("trace_id") == trace_id]
        assert traced, "no exemplar with the request's trace id reached Prometheus"
    finally:
        subprocess.run([*compose, "down", "-t", "5"], env=env, capture_output=True, timeout=300)
