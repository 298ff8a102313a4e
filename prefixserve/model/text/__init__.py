"""Text in and out: the tokenizers (Hugging Face tokenizers and SentencePiece from GGUF metadata),
incremental detokenizing, and chat templates."""
