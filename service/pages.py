"""Pages for people: ``/docs`` (Swagger UI served from the installed package, no CDN: coreply is offline
first) and ``/chat`` (a small page to talk to the bot). Neither needs an API key; the page asks for one
when ``/respond`` does."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
SWAGGER_ASSETS = "/assets/swagger"


def install_pages(app: FastAPI) -> None:
    import swagger_ui_bundle

    app.mount(SWAGGER_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="swagger")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} API",
            swagger_js_url=f"{SWAGGER_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{SWAGGER_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{SWAGGER_ASSETS}/favicon-32x32.png",
        )

    @app.get("/chat", include_in_schema=False)
    async def chat() -> FileResponse:
        return FileResponse(STATIC / "chat.html", media_type="text/html")
