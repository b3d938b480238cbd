"""The server's HTTP API by concern: shared state, error bodies, generation plumbing, the /v1 generation routes.

:mod:`dspark.server.app` composes them into the FastAPI app.
"""
