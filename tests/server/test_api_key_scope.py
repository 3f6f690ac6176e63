"""What the API key guards: /v1/* always; /metrics with --protect-metrics; docs can be removed."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_helpers import API_KEY, RunningServer, start_server

from conveyor.config import ServerConfig


def test_default_scope_leaves_metrics_and_docs_open(keyed_server: RunningServer) -> None:
    base = keyed_server.base_url
    assert httpx.get(f"{base}/v1/models").status_code == 401
    for path in ("/health", "/metrics", "/openapi.json", "/docs"):
        assert httpx.get(f"{base}{path}", timeout=10).status_code == 200, path


def test_docs_load_swagger_ui_from_the_server_itself(keyed_server: RunningServer) -> None:
    """No CDN: a machine without internet still gets a working docs page."""
    base = keyed_server.base_url
    page = httpx.get(f"{base}/docs", timeout=10).text
    assert "cdn." not in page and "/docs/static/swagger-ui-bundle.js" in page and "/openapi.json" in page
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        response = httpx.get(f"{base}/docs/static/{asset}", timeout=10)
        assert response.status_code == 200 and len(response.content) > 10_000, asset


def test_protected_metrics_and_no_docs(tiny_checkpoint: Path) -> None:
    running = start_server(tiny_checkpoint, api_key=API_KEY, max_num_seqs=2,
                           server_options={"protect_metrics": True, "enable_docs": False})
    try:
        base, auth = running.base_url, {"Authorization": f"Bearer {API_KEY}"}
        refused = httpx.get(f"{base}/metrics", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{base}/metrics", headers=auth, timeout=10).status_code == 200
        for path in ("/openapi.json", "/docs", "/docs/static/swagger-ui.css", "/redoc"):
            assert httpx.get(f"{base}{path}", headers=auth, timeout=10).status_code == 404, path
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    finally:
        running.stop()


def test_protect_metrics_needs_a_key() -> None:
    with pytest.raises(ValueError, match="protect_metrics"):
        ServerConfig(protect_metrics=True)
