"""``python -m xservice`` is the ``xllm`` command."""

from xservice.cli import main

raise SystemExit(main())
