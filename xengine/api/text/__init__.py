"""Torch-free text layer shared by the offline API and the service: tokenizer, detokenizer, stop strings."""
