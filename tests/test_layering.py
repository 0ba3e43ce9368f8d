"""The import rules of ``docs/architecture.md`` ("who may import whom"), checked on the source.

Every import counts, wherever it stands (module level, inside a function, under ``TYPE_CHECKING``):
a reader follows all of them. Rules between packages:
- ``xservice`` imports nothing of ``xengine`` but ``xengine.api`` (the torch-free contract);
- ``xengine.api`` imports nothing else of ``xengine``, and nothing of ``memory``, ``graph``, ``ops``;
- nothing under ``xengine``, ``memory``, ``graph`` or ``ops`` imports ``xservice``;
- ``memory`` and ``graph`` import only ``ops`` (and themselves; ``memory`` also the wire block hash
  of the contract, ``xengine.api.block_hash``); ``ops`` imports no other package;
- the exception: ``ops`` and ``memory`` may read the ``XLLM_*`` environment variables through
  ``xengine.api.envs`` (their one definition); like ``block_hash`` it is a leaf that imports nothing of
  the project (``LEAVES``), so the exception cannot pull the engine or the service in;
and inside them (``FOLDER_RULES``): models are math only, policies are pure, the step loops and the
process sit above what they drive, op backends see only the shared op types. No import cycle
between files, package ``__init__`` files included: each file sits above what it imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("xservice", "xengine", "memory", "graph", "ops")
# leaf modules of the contract the lower packages may import: they import nothing of the project
ENVS = "xengine.api.envs"
LEAVES = ("xengine.api.block_hash", ENVS)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            out[_module_name(path)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` refers to (a module, or the package holding an attribute)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_pkg else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            if src in LEAVES:
                bad.append(f"{src} -> {dst}: a leaf of the contract imports nothing of the project")
            if _in(src, "xservice") and _in(dst, "xengine") and not _in(dst, "xengine.api"):
                bad.append(f"{src} -> {dst}: the service may import only xengine.api")
            if _in(src, "xengine.api") and (
                (_in(dst, "xengine") and not _in(dst, "xengine.api"))
                or any(_in(dst, p) for p in ("memory", "graph", "ops"))
            ):
                bad.append(f"{src} -> {dst}: xengine.api is the torch-free contract")
            if not _in(src, "xservice") and _in(dst, "xservice"):
                bad.append(f"{src} -> {dst}: a lower layer imports the service")
            for pkg in ("memory", "graph"):
                allowed = (pkg, "ops") + (("xengine.api.block_hash", ENVS) if pkg == "memory" else ())
                if _in(src, pkg) and not any(_in(dst, p) for p in allowed):
                    bad.append(f"{src} -> {dst}: {pkg} may import only ops")
            if _in(src, "ops") and not _in(dst, "ops") and dst != ENVS:
                bad.append(f"{src} -> {dst}: ops imports no other package")
            bad += [
                f"{src} -> {dst}: {why}" for srcs, dsts, why in FOLDER_RULES if _matches(src, dst, srcs, dsts)
            ]
    return sorted(bad)


# (importers, what they must not import, why); a module matches a name when it is it or lies under it.
# A "!" name exempts itself from the importers (a folder importing itself is always fine).
_ENGINE_PARTS = ("colocation", "step", "runner", "scheduler", "process", "disagg", "engine", "llm")
FOLDER_RULES: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = (
    (
        ("xengine.models", "xengine.layers"),
        ("graph.interrupt", *(f"xengine.{p}" for p in _ENGINE_PARTS)),
        "models and layers are math only",
    ),
    (
        ("xengine", "graph", "memory", "ops", "!xengine.process"),
        ("xengine.process",),
        "only the engine process modules import each other",
    ),
    (
        ("xengine", "!xengine.engine", "!xengine.step"),
        ("xengine.step",),
        "only the Engine drives the step loops",
    ),
    (
        ("xengine.step",),
        ("xengine.process", "xengine.engine", "xengine.llm"),
        "a step loop sits below the Engine",
    ),
    (
        ("xengine.colocation",),
        ("xengine.step", "xengine.process", "xengine.disagg", "xengine.engine", "xengine.runner"),
        "co-location is driven by the step loops, not the other way",
    ),
    (
        ("xengine.runner",),
        ("xengine.step", "xengine.engine", "xengine.process", "xengine.disagg"),
        "the runner runs a plan; it does not drive steps",
    ),
    (
        ("xengine.disagg",),
        ("xengine.step", "xengine.engine", "xengine.process", "xengine.runner", "xengine.scheduler"),
        "transfers move KV and embeddings only",
    ),
    (("xservice.policies",), ("xservice", "!xservice.policies"), "policies are pure: no service I/O"),
    (
        ("xservice.engine",),
        ("xservice", "!xservice.engine", "!xservice.policies"),
        "the engine seam sits below HTTP, serving and the cluster",
    ),
    (
        ("xservice.serving", "xservice.routes", "xservice.batch", "xservice.rec", "xservice.protocol"),
        ("xservice.cluster",),
        "serving code talks to an EngineBackend, never to the cluster",
    ),
    (
        (
            "ops.torch_ref",
            "ops.cpu_kernels",
            "ops.triton_kernels",
            "ops.onednn",
            "ops.cuda_kernels",
            "ops.npu_kernels",
        ),
        (
            "ops.registry",
            "ops.attention",
            "ops.moe",
            "ops.norm",
            "ops.rope",
            "ops.activation",
            "ops.kv_store",
        ),
        "op backends never call the facades they implement",
    ),
)


def _matches(src: str, dst: str, srcs: tuple[str, ...], dsts: tuple[str, ...]) -> bool:
    def hit(module: str, names: tuple[str, ...]) -> bool:
        plain = [n for n in names if not n.startswith("!")]
        exempt = [n[1:] for n in names if n.startswith("!")]
        return any(_in(module, n) for n in plain) and not any(_in(module, n) for n in exempt)

    return hit(src, srcs) and hit(dst, dsts)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), every edge counted: a
    package ``__init__`` importing its submodules is part of the graph too (excluding those edges
    once hid a circle through ``ops/__init__`` and the MoE backend)."""
    edges = graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_layers_import_only_what_they_may() -> None:
    assert _violations(_graph()) == []


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_checker_sees_a_violation_and_a_cycle() -> None:
    graph = {"xservice.a": {"xengine.engine"}, "xengine.x": {"xengine.y"}, "xengine.y": {"xengine.x"}}
    assert _violations(graph) == ["xservice.a -> xengine.engine: the service may import only xengine.api"]
    assert _cycles(graph) == [["xengine.x", "xengine.y"]]


def test_checker_sees_a_crossing_inside_a_package() -> None:
    graph = {
        "xengine.models.decoder": {"xengine.colocation.interrupter"},
        "xservice.policies.routing": {"xservice.cluster.pool"},
        "xservice.serving.chat": {"xservice.cluster.pool", "xservice.engine.protocol"},
        "xengine.step.normal": {"xengine.step.result", "xengine.runner.model_runner"},
        "xservice.policies.epd.assign": {"xservice.policies.epd.costs"},
    }
    assert _violations(graph) == [
        "xengine.models.decoder -> xengine.colocation.interrupter: models and layers are math only",
        "xservice.policies.routing -> xservice.cluster.pool: policies are pure: no service I/O",
        "xservice.serving.chat -> xservice.cluster.pool: serving code talks to an EngineBackend, never to "
        "the cluster",
    ]
