"""``xllm profile engine``: measure a model's engine steps on this machine and write the device profile
an emulated instance (``--device emulated --device-profile FILE``) and the cluster simulator replay
(``xengine/tools/profile_engine.py``, run in a child process as ``profile epd`` runs its tool;
docs/emulated.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from xservice.commands.common import CliError


def register_profile_engine(tools: Any) -> None:
    e = tools.add_parser(
        "engine",
        help="measure step times here and write a device profile (for --device emulated)",
        description="Time engine steps of a model on this machine (decode batches, prefills, long "
        "contexts: the forward and logits of each step), fit the device-profile step-time model and "
        "write it as JSON, with every probe, its prediction and the error.",
    )
    e.add_argument("--model", required=True, metavar="DIR", help="model folder")
    e.add_argument("--out", metavar="FILE", help="where to write the profile (default: stdout)")
    e.add_argument("--name", help="the profile's name (default: the model folder's name)")
    e.add_argument("--num-threads", type=int, default=1, help="engine threads (default 1)")
    e.add_argument("--repeats", type=int, default=3, help="timed repeats per probe (median; default 3)")
    e.add_argument(
        "--max-tokens", type=int, default=2048, help="longest prompt / context probed (default 2048)"
    )
    e.set_defaults(run=run_profile_engine)


def run_profile_engine(args: Any) -> int:
    if not (Path(args.model) / "config.json").is_file():
        raise CliError(f"--model {args.model!r}: no config.json there; pass a model folder")
    if args.num_threads < 1 or args.repeats < 1 or args.max_tokens < 16:
        raise CliError("--num-threads and --repeats must be >= 1, --max-tokens >= 16")
    name = args.name or Path(args.model).resolve().name
    cmd = [
        sys.executable, "-m", "xengine.tools.profile_engine", "--model", args.model, "--name", name,
        "--num-threads", str(args.num_threads), "--repeats", str(args.repeats),
        "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    if args.out:
        cmd += ["--out", args.out]
    return subprocess.run(cmd, check=False).returncode  # the engine in a child: progress streams through
