"""Token sampling for the engine: per-step metadata, logits processing and the sampler.

Kept import-free on purpose (torch is heavy): import ``xengine.sampling.sampler`` and
``xengine.sampling.metadata`` directly.
"""
