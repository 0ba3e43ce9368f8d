"""Build a C source of this project into a shared library with the machine's C compiler, once.

The library lands in ``<cache dir>/build/`` (``$XLLM_CACHE_DIR`` or ``~/.cache/xllm``) under a name
keyed by the source, the flags and the machine, so an edited source or another CPU builds anew and
an unchanged one is reused. Concurrent builders are safe: each compiles to a temporary file and
renames it into place atomically.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from xengine.api.envs import cache_dir


def default_cache_dir() -> Path:
    """``$XLLM_CACHE_DIR`` or ``~/.cache/xllm`` (the same default as ``xengine.api.paths``)."""
    return cache_dir()


def c_compiler(purpose: str) -> str:
    """``$CC``, ``cc``, ``gcc`` or ``clang``, whichever is found first; ``purpose`` goes in the error."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise RuntimeError(
        f"no C compiler (cc, gcc or clang) to build {purpose}: install gcc (ci/setup.sh does) or set CC"
    )


def build_shared_library(
    source: Path,
    flags: Sequence[str],
    purpose: str,
    cache_dir: Path | None = None,
    libs: Sequence[str] = (),
    depends: Sequence[Path] = (),
) -> Path:
    """The shared library of ``source`` compiled with ``flags`` (and linked with ``libs``);
    ``depends``: files it includes (part of the key, so editing one rebuilds)."""
    text = source.read_bytes()
    key_parts = [text, " ".join(flags).encode(), " ".join(libs).encode(), platform.machine().encode()]
    key_parts += [p.read_bytes() for p in depends]
    key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
    out_dir = (cache_dir or default_cache_dir()) / "build"
    lib = out_dir / f"{source.stem}-{key}.so"
    if lib.is_file():
        return lib
    cc = c_compiler(purpose)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cc, "-shared", "-fPIC", *flags, "-o", tmp, str(source), *libs]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building {purpose} failed ({' '.join(cmd)}):\n{res.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)  # atomic: a concurrent builder's identical file is simply replaced
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib
