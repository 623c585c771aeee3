"""Prompts in, padded training batches out."""
