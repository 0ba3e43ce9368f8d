"""Speculative decoding: proposers draft tokens, the target verifies them in its own step.

The setting is ``SpeculativeConfig`` (``xengine/api/speculative_config.py``). ``drafting.py``: the
proposer interface, which sequences draft this step and how many tokens; ``ngram.py``: prompt lookup;
``draft_model.py``: a small model drafting greedily; ``verify.py``: greedy agreement and rejection
sampling over the target's distributions; ``stats.py``: proposed / accepted counters. The scheduler's
part is ``xengine/scheduler/speculative.py``. ``docs/speculative_decoding.md`` tells the whole story.
"""
