"""The engine's step loops: schedule -> execute -> update, one step at a time (``normal.py``) or the
next step scheduled while the model runs the current one (``overlap.py``, async scheduling), with
the fault isolation and between-step housekeeping both share (``docs/engine_performance.md``)."""
