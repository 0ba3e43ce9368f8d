"""Prefill-as-a-Service in the service (docs/prfaas.md): a second cluster of prefill instances in its own
registry namespace, reached over its own link; long uncached prompts prefill there and their KV crosses
the link to a local decode instance.

- ``config``: the ``cluster.prfaas`` section;
- ``link``: what the link carries (egress, backlog, the capacity it delivers when busy);
- ``router``: where each request prefills, the bandwidth-aware scheduler's loop, the metrics;
- ``serve``: the PrfaaS registry, pool and launched instances beside the local cluster's.
"""
