"""What the engine calls for structured outputs: compile on arrival, hold the request until its
grammar is ready, hand it to the scheduler then (or fail it naming the field).

A compile error is the client's mistake (an invalid schema, regex or grammar) and becomes
``ValueError("invalid value for 'structured_outputs': ...")``: a 400 naming the field at the service
(which renames it to the field the client used). Cache hits and already-compiled grammars skip the
wait, so the request is scheduled in the step it arrives.
"""

from __future__ import annotations

from pathlib import Path

from xengine.api.config import StructuredOutputsConfig
from xengine.api.grammar import grammar_spec
from xengine.api.grammar_sandbox import GrammarSandbox, SandboxLimits
from xengine.request import Request
from xengine.structured.backend import BaseGrammarBackend
from xengine.structured.cache import CompiledGrammarCache
from xengine.structured.compiler import GrammarCompiler
from xengine.structured.factory import create_backend
from xengine.structured.matcher import for_request
from xengine.structured.waiting import GrammarReady, GrammarWaitQueue

DEFAULT_BACKEND = "llguidance"
IDLE_WAIT_S = 0.01  # the engine has nothing but compiles to wait for: block this long per step


def compile_error_message(error: BaseException) -> str:
    if isinstance(error, ValueError):
        return f"invalid value for 'structured_outputs': {error}"
    return f"structured outputs failed: {type(error).__name__}: {error}"


class StructuredOutputs:
    def __init__(self, compiler: GrammarCompiler, closed_objects: bool = True) -> None:
        self.compiler = compiler
        self.waiting = GrammarWaitQueue()
        self.closed_objects = closed_objects  # structured_outputs.disable_additional_properties

    @classmethod
    def for_model(
        cls,
        model_dir: str,
        vocab_size: int,
        eos_token_ids: list[int],
        config: StructuredOutputsConfig | None = None,
    ) -> StructuredOutputs:
        """Grammars over the tokenizer of the model folder ``model_dir`` (its ``tokenizer.json``), each
        compiled in a sandbox first and refused past ``config``'s limits."""
        config = config or StructuredOutputsConfig()
        tokenizer_file = Path(model_dir) / "tokenizer.json"

        def factory() -> BaseGrammarBackend:
            if not tokenizer_file.is_file():
                raise RuntimeError(f"structured outputs need the model's tokenizer.json ({tokenizer_file})")
            return create_backend(DEFAULT_BACKEND, tokenizer_file, vocab_size, eos_token_ids)

        limits = SandboxLimits(config.compile_timeout_s, config.sandbox_memory_mib << 20)
        sandbox = GrammarSandbox(limits, tokenizer_file, vocab_size, eos_token_ids)
        cache = CompiledGrammarCache(max_bytes=int(config.cache_mib * 2**20))
        compiler = GrammarCompiler(factory, cache, sandbox, int(config.max_compiled_mib * 2**20))
        return cls(compiler, config.disable_additional_properties)

    def admit(self, request: Request, catalog: object = None) -> bool:
        """True when ``request`` (constrained) can be scheduled now (its grammar attached); False when it
        waits for its compile. Raises ``ValueError`` naming the field when its compile already failed."""
        so = request.params.structured_outputs
        assert so is not None
        resume = so.resume_token_ids or []
        if resume and request.prompt_token_ids[len(request.prompt_token_ids) - len(resume) :] != resume:
            raise ValueError(
                "invalid value for 'structured_outputs': 'resume_token_ids' must be the end of the prompt"
            )
        if so.disable_additional_properties is None and (so.json is not None or so.json_object):
            so.disable_additional_properties = self.closed_objects
        future = self.compiler.submit(grammar_spec(so))
        if not future.done():
            self.waiting.add(request, catalog, future)
            return False
        error = future.exception()
        if error is not None:
            raise ValueError(compile_error_message(error))
        request.grammar = for_request(future.result(), resume)
        return True

    def take_ready(self, idle: bool) -> list[GrammarReady]:
        """Requests whose compile finished; ``idle``: nothing else to run, so block briefly for one."""
        if idle:
            self.waiting.wait(IDLE_WAIT_S)
        return self.waiting.take_done()

    def close(self) -> None:
        self.compiler.close()
