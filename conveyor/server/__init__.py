"""The OpenAI-compatible HTTP server: schemas, app factory, Prometheus metrics and `run_server`."""
