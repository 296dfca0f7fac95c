"""Running the app under uvicorn with a graceful shutdown: on SIGTERM or SIGINT readiness turns 503 at
once, uvicorn stops accepting connections and waits up to ``COREPLY_DRAIN_SECONDS`` for in-flight
requests, then the lifespan stops the engine and the process exits. With a certificate set it serves
HTTPS, the certificate read again on SIGHUP with the bundle (service/tls.py)."""

from __future__ import annotations

from types import FrameType

import uvicorn

from service.app import Guard, create_app
from service.logs import log_config
from service.settings import Settings


class DrainingServer(uvicorn.Server):
    """uvicorn's server that tells the app about the shutdown signal before it starts draining."""

    def __init__(self, config: uvicorn.Config, app: Guard) -> None:
        super().__init__(config)
        self.coreply_app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.coreply_app.begin_drain()
        super().handle_exit(sig, frame)


def serve(settings: Settings) -> None:
    app = create_app(settings)
    tls = app.state.tls  # HTTPS where a certificate is set (service/tls.py)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=log_config(),
        timeout_graceful_shutdown=settings.drain_seconds,
        ssl_context_factory=None if tls is None else lambda config, default: tls.server,
    )
    DrainingServer(config, app).run()
