"""The OpenAI-compatible HTTP server: ``dspark serve`` (see docs/server.md)."""
