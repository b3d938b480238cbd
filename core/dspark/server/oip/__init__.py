"""The Open Inference Protocol server (KServe v2 / Triton, REST and gRPC): ``dspark serve MODEL.onnx``.

Modules, one concern each: ``config`` (the YAML), ``model`` (a served Session and its checks),
``batcher`` (Triton's dynamic batching), ``service`` (what both protocols share), ``rest`` and
``rest_codec`` (REST routes and bodies, binary tensor data), ``grpc_service`` (GRPCInferenceService),
``datatypes`` (tensor encodings), ``stats`` and ``metrics`` (statistics, Prometheus), ``errors``,
``launch`` (startup and the drain). See docs/serving-models.md.
"""
