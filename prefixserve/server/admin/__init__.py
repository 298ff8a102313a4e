"""Routes for operators, behind the admin key: LoRA adapters loaded at run time, pinned prefixes,
and the KV cache events (HTTP and ZMQ)."""
