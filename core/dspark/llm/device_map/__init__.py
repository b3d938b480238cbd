"""Putting an LLM on devices: the device map.

One way, whoever runs the layers: :func:`~dspark.llm.device_map.layers.map_layers` asks the placer which
layers go on which device; the torch runner moves its layers there (:mod:`.torch_layers`), or compiled
decoders hold the ranges, chained (:mod:`.chain`); a compiled decoder that holds the whole model is the map
with one stage (``DeviceMap.whole``). :mod:`.offload` runs prefill MLPs through another plugin.
"""
