"""Disaggregation, engine side: PD's prompt-KV transfer and EPD's image-embedding transfer
(``docs/cluster.md``, ``docs/multimodal.md``)."""
