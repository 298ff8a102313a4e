"""The decoder architectures: their configs (from GGUF metadata or an HF config.json), the
Llama-family and Gemma 3 models, their building blocks, and LoRA adapters in their projections."""
