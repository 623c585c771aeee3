"""Chat templates shipped with the package (the shared Qwen2.5 tokenizer has none)."""
