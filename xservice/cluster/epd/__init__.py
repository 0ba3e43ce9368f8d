"""EPD disaggregation on the cluster side: images encoded on one instance, prompts prefilled on
another, decoded on a third (``docs/multimodal.md``).

- ``dispatcher.py``: ``EPDDispatcher``, PD dispatching with the encode stage in front;
- ``image_index.py``: the global index of which instance caches which image's embeddings;
- ``serve.py``: EPD's part of ``xllm serve``'s cluster mode;
- ``auto.py``, ``profiler.py``, ``workload.py``: ``epd.strategy: auto`` (profile the model at
  start-up, choose the strategy, roles and budgets) and ``xllm profile epd``.

The pure policies they apply are in ``xservice/policies/epd/``.
"""
