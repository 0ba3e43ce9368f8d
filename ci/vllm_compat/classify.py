"""One category per vLLM OpenAI-server test, with its reason; the rules are data (``RULES``).

Categories:

- ``passed``
- ``model-specific``: asserts on a particular model's text, tokens, vocabulary, template or accuracy
  (the stand-in serves a tiny random checkpoint under every model name), or needs a model family's
  own format (gpt-oss Harmony).
- ``vllm-internal``: tests vLLM's Python classes (mocked engines, parsers, renderers), not the
  HTTP server; never run against xllm.
- ``xllm-missing: <feature>``: needs a feature xllm does not have.
- ``xllm-differs: <what>``: a deliberate difference (xllm's field rule, OpenAI's usage shape).
- ``xllm-bug: <what>``: xllm answers wrongly where it should not.
- ``harness: <what>``: this harness cannot run the test (hardware, packages, vLLM's own skips).
- ``unclassified``: a failure no rule explains (a rule is missing: read the message).

Order of decision: passed; not run because it starts no server → vllm-internal; the first rule in
``RULES`` whose patterns all match; the stand-in's own "xllm-missing: ..." refusal (a server flag
whose feature is the module's subject); for a failure in a module whose server was started without a
feature flag (``SOFT_FEATURE_FLAGS`` in ``stand_in/utils.py``), that feature; else unclassified.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

PREFIX = "tests/entrypoints/openai/"


@dataclass(frozen=True)
class Rule:
    """Matches a non-passing test when every non-empty pattern is found (``re.search``) in: the module
    path (relative to tests/entrypoints/openai/), the test name (after "::"), the failure message."""

    category: str
    reason: str
    module: str = ""
    test: str = ""
    message: str = ""

    def match(self, module: str, test: str, message: str) -> str | None:
        """The category (``{0}``.. filled from the message pattern's groups) if the rule matches."""
        found = [
            re.search(pattern, text, re.S) if pattern else True
            for pattern, text in ((self.module, module), (self.test, test), (self.message, message))
        ]
        if not all(found):
            return None
        groups = found[2].groups() if self.message else ()
        return self.category.format(*groups)


ANSWER = "asserts a real model's answer; the tiny random checkpoint answers with random text"
RULES: tuple[Rule, ...] = (
    # --- harness ------------------------------------------------------------------------------------
    Rule(
        "harness: GPU hardware",
        "skipped by the test: needs FP8 / several GPUs",
        message=r"needs FP8|several GPUs",
    ),
    Rule(
        "harness: skipped by vLLM",
        "vLLM skips it itself (flaky or unavailable in its CI, or a parametrization it does not run)",
        message=r"^Skipped: (?!needs)",
    ),
    Rule(
        "harness: local checkpoint",
        "asserts /v1/models' 'root' is the hub id; the stand-in serves a local folder (vLLM reports its --model "
        "value as root too)",
        module=r"models/test_models\.py",
        message=r"model-qwen3-tiny",
    ),
    # --- model-specific -----------------------------------------------------------------------------
    Rule(
        "model-specific",
        "gpt-oss only: the Harmony response format (the gpt_oss package, gpt-oss weights)",
        module=r"responses/test_harmony\.py|responses/test_parsable_context\.py|responses/test_mcp_tools\.py",
    ),
    Rule(
        "model-specific",
        "gpt-oss only: Harmony chat format",
        module=r"test_serving_chat\.py",
        test=r"GPTOSS|gpt_oss",
    ),
    Rule(
        "model-specific",
        "GSM8K accuracy of a real model through lm-eval",
        module=r"correctness/test_lmeval\.py",
    ),
    Rule(
        "xllm-missing: prompt embeddings as input",
        "the module's subject: its server needs --enable-prompt-embeds, which the tree under test lacks",
        module=r"completion/test_completion_with_prompt_embeds\.py",
        message=r"xllm-missing|--enable-prompt-embeds|prompt_embeds: not supported",
    ),
    Rule(
        "xllm-missing: prompt embeddings in chat messages",
        "vLLM 0.33's chat content parts of type 'prompt_embeds' (xllm takes prompt_embeds on /v1/completions)",
        module=r"chat_completion/test_chat_completion_with_prompt_embeds\.py",
    ),
    Rule("model-specific", ANSWER, module=r"responses/test_basic\.py", message=r"assert '\d+' in "),
    Rule(
        "model-specific",
        ANSWER + " (the extracted event name)",
        module=r"responses/test_structured_output\.py",
        message=r"== 'science fair'",
    ),
    Rule("model-specific", ANSWER + " ('2')", test=r"test_complex_message_content", message=r"== '2'"),
    Rule(
        "model-specific",
        ANSWER + ' ({"result": 2})',
        test=r"test_response_format_json_(object|schema)",
        message=r"^AssertionError: [{\[]",
    ),
    Rule(
        "model-specific",
        "a real model ends its (constrained) JSON within max_tokens; the random one spends them on the whitespace "
        "or long strings the grammar allows and is cut mid-value",
        message=r"JSONDecodeError: Unterminated",
    ),
    Rule(
        "model-specific",
        "asks a real model to change its answer when told it disagrees (a second structured choice / JSON "
        "differing from the first); the random model repeats itself",
        module=r"chat_completion/test_chat\.py",
        test=r"test_structured_outputs_(choice|json)_chat$",
        message=r"assert '.*' != '.*'",
    ),
    Rule(
        "model-specific",
        "expects a real model to use all of max_tokens ('length'); the random model emitted its EOS first",
        module=r"chat_completion/test_chat\.py",
        test=r"test_single_chat_session",
        message=r"'stop' == 'length'",
    ),
    Rule(
        "model-specific",
        "expects the model to stop (EOS) before max_tokens; a random model rarely emits EOS",
        message=r"'length' == 'stop'|<\|im_end\|>'",
    ),
    Rule(
        "model-specific",
        "expects the model to call the tool ('<tool_call>' output)",
        test=r"test_chat_completion_with_tool_use",
        message=r"startswith",
    ),
    Rule(
        "model-specific",
        "asks for the logprob of token id 5000; the tiny checkpoint's vocabulary is smaller (a 400 naming "
        "'logprob_token_ids', as vLLM answers an out-of-vocabulary id)",
        test=r"logprob_token_ids",
        message=r"logprob_token_ids'?: each id must be in \[0, \d+\)",
    ),
    Rule(
        "model-specific",
        "assumes prompt token 3 is the model's top-1 (then 1 entry, else 2: the actual token is added)",
        test=r"test_more_than_one_prompt_logprobs_chat",
        message=r"assert 2 == 1",
    ),
    Rule(
        "model-specific",
        "counts prompt tokens with Qwen3's tokenizer (5); the tiny checkpoint's tokenizer splits it into 6",
        test=r"test_single_completion",
        message=r"assert 6 == 5",
    ),
    Rule(
        "model-specific",
        "passes 'enable_thinking' to Qwen3's chat template; the tiny checkpoint's template has no such "
        "variable (xllm refuses template variables a template does not use)",
        message=r"does not use the variable 'enable_thinking'",
    ),
    # --- vLLM's own wording ---------------------------------------------------------------------------
    Rule(
        "vllm-internal",
        "asserts the wording of vLLM's pydantic errors ('greater_than_equal'); xllm answers 400 naming 'seed'",
        test=r"test_long_seed",
        message=r"greater_than_equal",
    ),
    Rule(
        "xllm-missing: prompt embeddings as input",
        "sends 'prompt_embeds' (refused by xllm with a 400 naming it)",
        message=r"prompt_embeds: not supported",
    ),
    Rule(
        "vllm-internal",
        "asserts vLLM's wording ('not compatible') of a 400 xllm answers too: 'prompt_logprobs': true is refused "
        "first by xllm's strict field rule (a boolean is not an integer)",
        module=r"completion/test_completion_with_prompt_embeds\.py",
        test=r"test_prompt_logprobs_raises_error",
        message=r"Regex pattern did not match",
    ),
    Rule(
        "vllm-internal",
        "asserts vLLM's error text for an empty prompt; xllm answers a 400 with its own text",
        test=r"test_empty_prompt",
        message=r"Regex pattern did not match",
    ),
    # --- xllm-differs: deliberate differences ---------------------------------------------------------
    Rule(
        "xllm-differs: unknown fields are refused",
        "vLLM ignores unknown message fields; xllm's field rule refuses them with a 400 naming the field",
        test=r"test_extra_fields_allowed",
    ),
    Rule(
        "xllm-differs: usage.prompt_tokens_details always present",
        "compares usage to an object without prompt_tokens_details (vLLM adds it only with "
        "--enable-prompt-tokens-details); xllm always reports it, as OpenAI does",
        message=r"CompletionUsa.*_details=None",
    ),
    # --- xllm-missing: routes and features ------------------------------------------------------------
    Rule(
        "xllm-missing: /v1/chat/completions/batch",
        "the route is 404",
        module=r"test_batched_chat",
        message=r"404",
    ),
    Rule("xllm-missing: /invocations", "the route is 404", test=r"test_invocations", message=r"404"),
    Rule("xllm-missing: /v1/decisions", "vLLM's decisions API", module=r"decisions/"),
    Rule(
        "xllm-missing: LoRA adapters",
        "asks for a LoRA adapter by a name the server does not serve (an older tree without LoRA, or an "
        "adapter resolver plugin xllm lacks: the name is a 404)",
        message=r"does not exist; this server serves",
    ),
    Rule(
        "xllm-missing: tensorizer",
        "vLLM's tensorizer weight format",
        module=r"test_tensorizer_entrypoint\.py",
    ),
    Rule(
        "xllm-missing: kv_transfer_params",
        "vLLM's disaggregated-prefill hand-off field",
        message=r"kv_transfer_params",
    ),
    Rule(
        "xllm-missing: per-request metrics",
        "vLLM's 'metrics' response field (--enable-per-request-metrics)",
        test=r"per_request_metrics",
    ),
    Rule(
        "xllm-missing: reasoning parsers",
        "reasoning content / include_reasoning / reasoning controls",
        message=r"include_reasoning|reasoning: not supported|Expected reasoning|input item type 'reasoning'",
    ),
    Rule(
        "xllm-missing: reasoning parsers",
        "the function_call is there (checked by hand); the test then asserts a 'reasoning' output item",
        module=r"responses/test_function_call\.py",
        test=r"test_function_tool_use",
        message=r"assert None is not None",
    ),
    Rule(
        "xllm-missing: stored responses",
        "store / background / previous_response_id on /v1/responses (xllm's responses are stateless)",
        message=r"not stored by this server|does not store responses",
    ),
    Rule(
        "xllm-missing: logprobs on /v1/responses", "'include' (logprobs)", message=r"include: not supported"
    ),
    Rule(
        "xllm-missing: structural tags",
        "'strict' function tools with tool_choice 'auto' need a structural-tag constraint",
        message=r"structural tag",
    ),
    Rule(
        "xllm-missing: namespace tools",
        "'namespace' tools on /v1/responses",
        message=r"tool type 'namespace'",
    ),
    Rule(
        "xllm-missing: logprobs over the whole vocabulary",
        "top_logprobs / prompt_logprobs = -1 (vLLM with --max-logprobs = vocabulary size)",
        message=r"got -1",
    ),
    Rule(
        "xllm-missing: --return-tokens-as-token-ids (server default)",
        "the server-wide default for return_tokens_as_token_ids",
        module=r"test_return_tokens_as_ids\.py",
        test=r"\[True\]",
    ),
    Rule(
        "xllm-missing: --enable-force-include-usage",
        "usage on every response",
        module=r"test_enable_force_include_usage",
    ),
    Rule(
        "xllm-missing: --root-path",
        "serving under a path prefix",
        module=r"test_root_path\.py",
        message=r"404",
    ),
    Rule("xllm-missing: custom message roles", "vLLM accepts any role name", test=r"test_custom_role"),
    # before the field rule (the "before" tree): fields and response fields that did not exist yet
    Rule(
        "xllm-missing: vLLM response fields",
        "prompt_logprobs / prompt_token_ids / token_ids in responses",
        message=r"has no attribute '(prompt_logprobs|prompt_token_ids|token_ids)'|'prompt_token_ids' in",
    ),
    Rule("xllm-missing: /v1/responses", "the route is 404", module=r"responses/", message=r"404 - Not Found"),
    Rule(
        "xllm-missing: structured outputs (ignored)",
        "the constraint was not applied (a tree without structured outputs ignored the field; in a tree that "
        "has them this would be a bug)",
        module=r"test_chat\.py",
        test=r"test_structured_outputs|test_response_format",
        message=r"JSONDecodeError: (Expecting value|Extra data)|fullmatch|in \['Python'",
    ),
    Rule(
        "xllm-missing: echo (continue_final_message)",
        "the continued message is not echoed",
        module=r"test_chat_echo\.py",
        test=r"test_case0",
        message=r"saying in|^AssertionError: assert \('",
    ),
    Rule(
        "xllm-missing: named tool_choice",
        "a named function tool_choice answered with text",
        module=r"test_completion_with_function_calling\.py",
        message=r"assert not ",
    ),
    Rule(
        "xllm-missing: request field 'return_tokens_as_token_ids' (ignored)",
        "tokens came back as text",
        module=r"test_return_tokens_as_ids\.py",
        test=r"\[False\]",
        message=r"invalid literal for int",
    ),
    Rule(
        "xllm-missing: echo with logprobs",
        "'echo' together with 'logprobs'",
        message=r"'echo' together with 'logprobs'",
    ),
    Rule(
        "xllm-missing: usage in streams",
        "stream_options.include_usage / continuous usage",
        message=r"'NoneType' object has no attribute 'prompt_tokens'",
    ),
    Rule(
        "xllm-missing: usage in streams",
        "stream_options.include_usage / continuous usage",
        test=r"test_completion_stream_options",
        message=r"assert None is not None",
    ),
    Rule(
        "xllm-missing: structured outputs (ignored)",
        "invalid grammars/schemas/regexes were accepted: structured outputs were ignored",
        test=r"test_invalid_(grammar|json_schema|regex)",
        message=r"DID NOT RAISE",
    ),
    Rule(
        "xllm-missing: logit_bias",
        "invalid logit_bias accepted: the field was ignored",
        module=r"logit_bias",
        message=r"DID NOT RAISE",
    ),
    Rule(
        "xllm-missing: request field '{0}'",
        "xllm refuses this request field (unknown to it)",
        message=r"([\w.]+): Unrecognized request argument",
    ),
    Rule("xllm-bug: invalid request accepted", "vLLM answers 400; xllm served it", message=r"DID NOT RAISE"),
)


def classify(nodeid: str, entry: dict[str, Any], soft: dict[str, dict[str, str]]) -> tuple[str, str]:
    """(category, reason) of one test."""
    outcome = entry.get("outcome")
    if outcome == "passed":
        return "passed", ""
    if outcome == "not-run" and entry.get("kind") == "vllm-internal":
        return "vllm-internal", "starts no server: tests vLLM's own Python classes"
    if outcome == "not-run":
        return "harness: not run", "deselected (-k), or the run stopped before this test"
    module_path, _, test = nodeid.partition("::")
    module = module_path.removeprefix(PREFIX)
    message = entry.get("message") or ""
    for rule in RULES:
        category = rule.match(module, test, message)
        if category:
            return category, rule.reason
    features = re.findall(r"(?:xllm-missing: |; )(.+?) \(vLLM server flag", message)
    if features:
        return f"xllm-missing: {'; '.join(features)}", "its server needs a feature xllm lacks (not started)"
    features = sorted(set(soft.get(module_path, {}).values()))
    if outcome in ("failed", "error") and features:
        return (
            f"xllm-missing: {'; '.join(features)}",
            "fails in a module whose server needs this feature (its flag was dropped); no other rule applies",
        )
    return "unclassified", "no rule explains this failure: read the message"


def classify_all(raw: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    soft = raw.get("__module_features__", {}).get("modules", {})
    rows = []
    for nodeid, entry in sorted(raw.items()):
        if nodeid.startswith("__"):
            continue
        category, reason = classify(nodeid, entry, soft)
        rows.append({"test": nodeid, "category": category, "reason": reason, **entry})
    return rows


def top_category(category: str) -> str:
    return category.split(":")[0]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts per category (and per detailed category) and per raw pytest outcome."""
    server = [r for r in rows if r.get("kind") != "vllm-internal"]  # the tests that start a server
    return {
        "total": len(rows),
        "server_tests": len(server),
        "passed": sum(r["category"] == "passed" for r in rows),
        "categories": dict(Counter(top_category(r["category"]) for r in rows).most_common()),
        "detailed": dict(Counter(r["category"] for r in rows).most_common()),
        "outcomes": dict(Counter(r.get("outcome") for r in rows).most_common()),
    }


def render_markdown(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The report: counts, then every non-passing server test (grouped by category) with its reason."""
    lines = [
        f"# vLLM {summary.get('vllm')} OpenAI-server tests against xllm ({summary.get('label')})",
        "",
        f"xllm tree: `{summary.get('repo')}` at `{summary.get('commit')}`; wall time {summary.get('wall_s')} s.",
        "",
        f"{summary['passed']} passed of {summary['server_tests']} tests that start a server "
        f"({summary['total']} collected).",
        "",
        "| category | tests |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in summary["detailed"].items()]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["category"] not in ("passed", "vllm-internal"):
            groups.setdefault(r["category"], []).append(r)
    for category in sorted(groups):
        lines += ["", f"## {category} ({len(groups[category])})", ""]
        for r in groups[category]:
            first = (r.get("message") or "").replace("`", "'").strip().splitlines()
            detail = f" — `{first[0][:160]}`" if first else ""
            lines.append(f"- `{r['test'].removeprefix(PREFIX)}` ({r.get('outcome')}): {r['reason']}{detail}")
    return "\n".join(lines) + "\n"


def render_grouped(rows: list[dict[str, Any]]) -> str:
    """Every non-passing server test, grouped by category and reason, tests listed per module (for
    benchmarks/results/ (the vLLM-compat run log))."""
    groups: dict[tuple[str, str], dict[str, list[str]]] = {}
    for r in rows:
        if r["category"] in ("passed", "vllm-internal"):
            continue
        module, _, test = r["test"].removeprefix(PREFIX).partition("::")
        groups.setdefault((r["category"], r["reason"]), {}).setdefault(module, []).append(
            test or "(collection)"
        )
    lines: list[str] = []
    for (category, reason), modules in sorted(groups.items()):
        count = sum(len(tests) for tests in modules.values())
        lines.append(f"- **{category}** ({count}): {reason}.")
        for module, tests in sorted(modules.items()):
            names = Counter(t.split("[")[0] for t in tests)  # parametrizations counted, not listed
            listed = ", ".join(f"`{n}`" + (f" ×{k}" if k > 1 else "") for n, k in names.items())
            lines.append(f"  - `{module}`: {listed}")
    return "\n".join(lines) + "\n"
