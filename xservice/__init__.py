"""xllm service layer: HTTP API, engine client, cluster. Torch-free."""
