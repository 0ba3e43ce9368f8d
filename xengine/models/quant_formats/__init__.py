"""Readers and writers of quantized checkpoint formats: one module per method (``compressed``,
``gptq``, ``awq``), each with ``parse`` (config -> ``checkpoint.CheckpointQuantization``), ``convert``
(checkpoint tensors -> the canonical form of ``canonical.py``), ``pack_layer`` and ``write_config``
(the other way, for ``xllm model quantize``); ``packing`` (values in int32 words), ``layers``
(gathering a layer's tensors from the stream), ``rounding`` (the on-the-fly rounding, for the writer)."""
