"""The engine's torch-free contract, shared with the service (the only part of ``xengine`` it imports).

``messages`` (wire structs), ``config`` (engine config dataclasses), ``text/`` (tokenizer, chat
template, incremental detokenizer, stop strings), ``cluster/`` (metadata-store key layout and the
store clients an engine registers with), ``security`` (CURVE authentication of the internal ZMQ
planes), ``paths`` (default locations), ``envs`` (every ``XLLM_*`` environment variable, read once here)
and ``models`` (make-tiny choices). Nothing here imports torch or anything else of ``xengine``.
"""
