"""Online/offline co-location, engine side: online arrivals stop offline prefill steps between
layers, and a stopped step carries on later from where it stopped (``docs/colocation.md``)."""
