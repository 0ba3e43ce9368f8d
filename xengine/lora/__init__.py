"""LoRA adapters served beside the base model: PEFT folders loaded (``adapter.py``), mapped onto the
model's projections (``targets.py``), held in device slots with an LRU over a host cache
(``slots.py``, ``manager.py``), and applied per step by adapter-grouped matmuls (``ops/lora.py``,
``graph/lora_op.py``). ``docs/lora.md`` is the guide."""
