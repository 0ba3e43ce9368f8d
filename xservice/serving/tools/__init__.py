"""Tool calling: parsers of calls in model output (one per model family), the constraint that makes
forced calls valid, and the per-request plan that ties tools, ``tool_choice`` and the template together."""
