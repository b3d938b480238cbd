"""Serving on a Ray cluster with Ray Serve: one OpenAI ingress in front of N engine replicas.

Ray is imported only here and only when a cluster is asked for (``dspark serve
--replicas N`` or a ``cluster`` config section); the single-process server
never loads it (the ``cluster`` config section is
:class:`dspark.server.config.ClusterSection`). The pieces:

* :mod:`.routing` -- the routing decision (least outstanding tokens, prefix
  affinity), pure and testable without Ray.
* :mod:`.router` -- that decision behind Ray Serve's request-router extension point.
* :mod:`.replica` -- the engine replica deployment (one ``AsyncLLMEngine`` each).
* :mod:`.frontend` -- the ingress's stand-in for the engine: validation locally,
  generation streamed from a replica.
* :mod:`.ingress` -- the ingress deployment: the single-process server's FastAPI app.
* :mod:`.registry` -- replicas' metrics endpoints and engine state, for scraping and /health.
* :mod:`.deploy` -- building the Serve application from a config and running it.
* :mod:`.nodes` -- every node's devices and plugins (``dspark devices --cluster``).
"""
