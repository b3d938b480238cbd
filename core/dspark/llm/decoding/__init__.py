"""The engine on plugins' compiled decoders: step batches, specs, target choice, and the runner
that drives the chosen target with failover to the next (plugin API 1.6, docs/decoders.md)."""
