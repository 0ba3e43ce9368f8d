"""Speculative decoding: proposers draft tokens, the target verifies them in its own step.

``config``: ``SpeculativeConfig`` (``xengine/api/config.py``); ``proposer.py``: the proposer interface
and its factory; ``ngram.py``: prompt lookup; ``drafting.py``: which sequences draft this step and how
many tokens; ``verify.py``: greedy agreement and rejection sampling over the target's distributions;
``stats.py``: proposed / accepted counters. ``docs/speculative_decoding.md`` tells the whole story.
"""
