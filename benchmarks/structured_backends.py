"""Structured-output backends on this CPU: xgrammar vs llguidance; prints one JSON document.

For each vocabulary (the tiny and small test tokenizers, and a 151,646-entry byte-level BPE the size
of Qwen's, trained here on local Python sources and cached) and each backend:

- ``setup_ms``: building the backend's tokenizer view (once per engine; imports excluded);
- ``compile_ms``: per grammar, cold (no cache), up to and including the first token mask: what a
  request waits before its first constrained step;
- ``fill_us``: per decode step, filling the token bitmask of B sequences (B = 1, 8, 32), each walking
  a valid output token by token (mean over the walk; the fastest of ``--fill-reps`` walks), one thread;
- ``apply_us``: turning B bitmasks into -inf logits: xgrammar's CPU kernel vs this project's
  ``xengine.structured.bitmask.apply_bitmask`` (backend-neutral).

xgrammar is a benchmark-only peer (``pip install -e ".[bench]"``); without it its entries say
``{"skipped": ...}`` and only llguidance is measured.

    PYTHONPATH=. .venv/bin/python -m benchmarks.structured_backends --num-threads 1 [--vocabs tiny small qwen151k]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoint import cache_root, generated_checkpoint
from benchmarks.smoke import add_smoke_flag, parse_args

QWEN_VOCAB = 151_646
_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
_ORDER = {
    "type": "object",
    "$defs": {
        "item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "qty": {"type": "integer"},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        }
    },
    "properties": {
        "id": {"type": "integer"},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "note", "paid"],
    "additionalProperties": False,
}
_WIDE = {
    "type": "object",
    "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(40)},
    "required": [f"field_{i}" for i in range(40)],
    "additionalProperties": False,
}
_WIDE_INSTANCE = {f"field_{i}": ["text", 7, True][i % 3] for i in range(40)}
_EBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= num | "(" expr ")"\nnum ::= [0-9]+\n'
# name -> (kind, source, a valid output to walk)
CASES: dict[str, tuple[str, str, str]] = {
    "json_person": ("json", json.dumps(_PERSON), '{"name":"Alice Smith","age":42,"role":"user","tags":["a","bc"]}'),
    "json_order": (
        "json",
        json.dumps(_ORDER),
        '{"id":1234,"items":[{"sku":"ABC-1234","qty":2},{"sku":"XYZ-0001","qty":10}],"note":null,"paid":true}',
    ),
    "json_wide40": ("json", json.dumps(_WIDE), json.dumps(_WIDE_INSTANCE, separators=(",", ":"))),
    "json_object": ("json_object", "", '{"a":[1,2,{"b":"c"}],"d":"hello world"}'),
    "regex_date": ("regex", r"\d{4}-\d{2}-\d{2}", "2024-05-17"),
    "choice": ("choice", json.dumps(["positive", "negative", "neutral"]), "negative"),
    "ebnf_arith": ("grammar", _EBNF, "12+(3-45)+6"),
}  # fmt: skip


def _qwen_size_tokenizer() -> Path:
    """A byte-level BPE with Qwen2's vocabulary size, trained once on local text and cached."""
    target = cache_root() / "bpe-151k" / "tokenizer.json"
    if target.is_file():
        return target
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from xengine.tools.bpe import SPECIAL_TOKENS
    from xengine.tools.corpus import iter_corpus

    def docs():
        yield from iter_corpus(20_000_000, 0)
        for p in sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py")):
            try:
                yield p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue

    print("training a 151,646-entry BPE (once, about a minute)", file=sys.stderr)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=QWEN_VOCAB,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs(), trainer=trainer)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(target)
    return target


def tokenizer_path(name: str) -> Path:
    if name == "qwen151k":
        return _qwen_size_tokenizer()
    return generated_checkpoint("qwen3", name) / "tokenizer.json"


class _Xgrammar:
    name = "xgrammar"
    modules = ("xgrammar", "transformers")  # imported before setup is timed

    def __init__(self, tok_file: Path, vocab_size: int, eos: list[int]) -> None:
        import xgrammar as xgr
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tok_file)))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, source: str) -> Any:
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(source, any_whitespace=False, separators=(",", ":"))
        if kind == "json_object":
            # strict_mode would allow only {}; without it 0.2.8's any-JSON rules ignore ``separators``
            # (always ", "), so compact output needs any_whitespace
            return c.compile_json_schema('{"type": "object"}', any_whitespace=True, strict_mode=False)
        if kind == "regex":
            return c.compile_regex(source)
        if kind == "choice":
            alts = " | ".join(json.dumps(s) for s in json.loads(source))
            return c.compile_grammar(f"root ::= {alts}")
        return c.compile_grammar(source)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)


class _Llguidance:
    name = "llguidance"
    modules = ("llguidance", "llguidance.torch")

    def __init__(self, tok_file: Path, vocab_size: int, eos: list[int]) -> None:
        import llguidance as llg
        import llguidance.torch as llg_torch

        self.llg, self.llg_torch = llg, llg_torch
        self.tok = llg.LLTokenizer(tok_file.read_text(), n_vocab=vocab_size, eos_token=eos)

    def compile(self, kind: str, source: str) -> Any:
        m = self.llg.LLMatcher
        opts = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        if kind == "json":
            return self._template(m.grammar_from_json_schema(source, defaults=opts))
        if kind == "json_object":
            return self._template(m.grammar_from_json_schema('{"type": "object"}', defaults=opts))
        if kind == "regex":
            return self._template(m.grammar_from_regex(source))
        if kind == "choice":
            return self._template(
                m.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in json.loads(source)))
            )
        return self._template(self.llg.grammar_from("grammar", source))

    def _template(self, grammar: str) -> Any:
        """The compiled form: a matcher never advanced, which every sequence's matcher is a copy of
        (the engine's way: copies share the lexer's cache; separate matchers would each rebuild it)."""
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for row, m in enumerate(matchers):
            self.llg_torch.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def _compile_ms(backend: Any, kind: str, source: str, vocab_size: int, reps: int) -> float:
    from xengine.structured.bitmask import allocate_bitmask

    times = []
    for _ in range(reps):
        bitmask = allocate_bitmask(1, vocab_size)
        t0 = time.perf_counter()
        backend.fill([backend.matcher(backend.compile(kind, source))], bitmask)
        times.append(_ms(t0))
    return round(statistics.median(times), 3)


def _fill_us(backend: Any, compiled: Any, tokens: list[int], batch: int, vocab_size: int, reps: int) -> float:
    """Mean time of one step's bitmask fill for ``batch`` matchers walking ``tokens``; the fastest of
    ``reps`` walks (fresh matchers each), which is the least disturbed by other load on the machine."""
    from xengine.structured.bitmask import allocate_bitmask

    means = []
    for _ in range(reps):
        matchers = [backend.matcher(compiled) for _ in range(batch)]
        bitmask = allocate_bitmask(batch, vocab_size)
        total = 0.0
        for token in tokens:
            t0 = time.perf_counter()
            backend.fill(matchers, bitmask)
            total += time.perf_counter() - t0
            for m in matchers:
                if not backend.accept(m, token):
                    raise ValueError(f"{backend.name} rejected token {token} of the walked output")
        means.append(total / len(tokens))
    return round(min(means) * 1e6, 1)


def _apply_us(vocab_size: int, batch: int) -> dict[str, float]:
    import numpy as np

    from xengine.structured.bitmask import allocate_bitmask, apply_bitmask

    rng = np.random.default_rng(0)
    bitmask = allocate_bitmask(batch, vocab_size)
    bitmask.copy_(torch.from_numpy(rng.integers(-(2**31), 2**31 - 1, bitmask.shape, dtype=np.int32)))
    logits = torch.randn(batch, vocab_size)
    rows = list(range(batch))
    out: dict[str, float] = {}
    fns = {"xllm_lut": lambda x: apply_bitmask(x, bitmask, rows)}
    try:
        import xgrammar as xgr

        fns["xgrammar_cpu"] = lambda x: xgr.apply_token_bitmask_inplace(x, bitmask)
    except ImportError:
        pass
    for name, fn in fns.items():
        times = []
        for _ in range(20):
            x = logits.clone()
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(times) * 1e6, 1)
    return out


def _run_backend(cls: Any, tok_file: Path, vocab_size: int, eos: list[int], args: argparse.Namespace) -> dict:
    try:
        for module in cls.modules:
            importlib.import_module(module)
        t0 = time.perf_counter()
        backend = cls(tok_file, vocab_size, eos)
    except ImportError as e:
        return {
            "skipped": f"{cls.name} is not installed ({e}); install the bench extra: pip install -e '.[bench]'"
        }
    report: dict[str, Any] = {"setup_ms": _ms(t0), "compile_ms": {}, "fill_us": {}}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    for name, (kind, source, instance) in CASES.items():
        report["compile_ms"][name] = _compile_ms(backend, kind, source, vocab_size, args.compile_reps)
        tokens = tok.encode(instance, add_special_tokens=False).ids
        compiled = backend.compile(kind, source)
        report["fill_us"][name] = {
            f"B={b}": _fill_us(backend, compiled, tokens, b, vocab_size, args.fill_reps)
            for b in args.batch_sizes
        }
    return report


SMOKE = dict(vocabs=["tiny"], batch_sizes=[1], compile_reps=1, fill_reps=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", nargs="+", default=["tiny", "small", "qwen151k"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--compile-reps", type=int, default=3)
    p.add_argument("--fill-reps", type=int, default=3, help="walks per fill measurement (the fastest counts)")
    p.add_argument(
        "--num-threads", type=int, default=1, help="torch threads (both backends fill masks on one)"
    )
    add_smoke_flag(p)
    args = parse_args(p, argv, SMOKE)
    torch.set_num_threads(args.num_threads)
    report: dict[str, Any] = {"num_threads": args.num_threads, "vocabs": {}}
    for vocab in args.vocabs:
        from tokenizers import Tokenizer

        tok_file = tokenizer_path(vocab)
        tok = Tokenizer.from_file(str(tok_file))
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
        entry: dict[str, Any] = {"vocab_size": vocab_size}
        for cls in (_Xgrammar, _Llguidance):
            print(f"{vocab}: {cls.name}", file=sys.stderr)
            entry[cls.name] = _run_backend(cls, tok_file, vocab_size, eos, args)
        entry["apply_us"] = {f"B={b}": _apply_us(vocab_size, b) for b in args.batch_sizes}
        report["vocabs"][vocab] = entry
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
