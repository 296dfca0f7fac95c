"""Dependencies the routes declare: the runtime state, the live engine, and the API-key check.

Each is a coroutine although nothing in it awaits: FastAPI runs a plain function dependency on its thread
pool, a hand-over there and back for a dictionary lookup (docs/performance.md §31)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request

from service.engine import Engine
from service.errors import NotReady, Unauthorized
from service.settings import Settings
from service.state import ServiceState


async def get_state(request: Request) -> ServiceState:
    return request.app.state.service


async def live_engine(request: Request) -> Engine:
    """The engine serving now; :class:`NotReady` while the bundle loads."""
    state: ServiceState = request.app.state.service
    if state.engine is None or not state.ready:
        raise NotReady("the bundle is loading")
    return state.engine


StateDep = Annotated[ServiceState, Depends(get_state)]
EngineDep = Annotated[Engine, Depends(live_engine)]


def key_check(settings: Settings, route: str) -> Callable:
    """A dependency that enforces the API keys on ``route`` unless keys are off or the route is public.
    Presented keys are matched against the live ones (``ServiceState.keys``, read again on SIGHUP). The
    key that matched is ``request.state.key`` (its scope applies to the answer) and its name goes into
    the access log; the key itself never does."""
    if not settings.keys or route in settings.public:

        async def open_route() -> None:
            return None

        return open_route

    async def check(request: Request) -> None:
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        key = request.app.state.service.keys.match(given.encode())
        if key is None:
            raise Unauthorized()
        request.state.key = key
        request.state.log["key"] = key.name

    return check
