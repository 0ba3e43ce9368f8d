"""The grammar sandbox's child process: validates (and, given a tokenizer, compiles) one spec at a time.

Run as ``python -m xengine.api.grammar_worker [--tokenizer FILE --num-ids N --eos 1,2]
--memory-bytes M --stack-bytes S --parent-pid P``. It caps its own address space at its size after start-up plus
``M`` and runs every job on a thread with an ``S``-byte stack, so a spec that recurses too deeply,
allocates without bound or crashes the native library takes down only this process; the parent
(``grammar_sandbox``) sees it die or time out and refuses the spec. Torch-free, so it starts fast.

Protocol: one JSON object per line each way. After start-up it prints ``{"ready": true}``; then for
each ``{"kind", "source", "whitespace"}`` it prints ``{"ok": true, "compiled_bytes": n}`` (the bytes
the compiled grammar holds after its first token mask; 0 without a tokenizer) or
``{"ok": false, "error": "why"}``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import sys
import threading
from functools import partial
from typing import Any

from xengine.api.grammar import (
    GrammarSpec,
    check_llguidance_grammar,
    llguidance_grammar,
    make_lltokenizer,
    short_error,
)
from xengine.api.grammar_bounds import check_bounds
from xengine.api.lifetime import die_with_parent


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    die_with_parent(args.parent_pid)  # a job outliving its caller would only burn a core
    tokenizer = None
    if args.tokenizer:
        eos = [int(t) for t in args.eos.split(",") if t]
        tokenizer = make_lltokenizer(args.tokenizer, args.num_ids, eos)
    _cap_memory(args.memory_bytes)
    threading.stack_size(args.stack_bytes)
    _reply({"ready": True})
    for line in sys.stdin:
        _reply(_on_thread(partial(run_job, json.loads(line), tokenizer)))
    return 0


def run_job(job: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Validate the spec of ``job``; with ``tokenizer``, also compile it and measure what it holds."""
    spec = GrammarSpec(job["kind"], job["source"], job.get("whitespace"))
    try:
        check_bounds(spec)
        grammar = llguidance_grammar(spec)
        check_llguidance_grammar(grammar, tokenizer)
        compiled_bytes = _compiled_bytes(grammar, tokenizer) if tokenizer is not None else 0
    except MemoryError:
        return {"ok": False, "error": "compiling it needs more memory than a grammar may use"}
    except (ValueError, RecursionError) as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True, "compiled_bytes": compiled_bytes}


def _compiled_bytes(grammar: str, tokenizer: Any) -> int:
    """Heap bytes a compiled matcher holds once its first mask is computed (where llguidance builds
    most of its lexer state), as the engine's compiled-grammar cache would hold it."""
    import llguidance as llg

    before = _heap_bytes()
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise ValueError(short_error(matcher.get_error()))
    held = _heap_bytes() - before
    del matcher
    return max(0, held)


def _heap_bytes() -> int:
    """Bytes in use on the C heap (glibc ``mallinfo2``; else the resident set size)."""
    try:
        info = _mallinfo2()
        return info.uordblks + info.hblkhd
    except (OSError, AttributeError):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())
    ]


def _mallinfo2() -> _MallInfo2:
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2()


def _cap_memory(extra_bytes: int) -> None:
    """Address space capped at what is mapped now plus ``extra_bytes``."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _on_thread(fn: Any) -> dict[str, Any]:
    """``fn()`` on a new thread (its stack is the sandbox's small one), its result returned here."""
    result: dict[str, Any] = {"ok": False, "error": "the grammar compiler failed"}

    def target() -> None:
        nonlocal result
        result = fn()

    thread = threading.Thread(target=target, name="grammar-job")
    thread.start()
    thread.join()
    return result


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m xengine.api.grammar_worker")
    p.add_argument("--tokenizer", default="", help="tokenizer.json to compile against (default: none)")
    p.add_argument("--num-ids", type=int, default=0, help="token ids a mask covers")
    p.add_argument("--eos", default="", help="comma-separated eos token ids")
    p.add_argument("--memory-bytes", type=int, required=True, help="address space allowed past start-up")
    p.add_argument("--stack-bytes", type=int, required=True, help="stack of the thread running a job")
    p.add_argument("--parent-pid", type=int, required=True, help="the caller's pid (we die with it)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
