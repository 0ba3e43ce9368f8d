"""``xllm`` subcommands that live outside ``xservice/cli.py`` (each exposes ``register_*``)."""
