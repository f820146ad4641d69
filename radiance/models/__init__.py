"""Model architectures (Llama, Qwen2, Qwen3) and the registry that picks one from config.json."""
