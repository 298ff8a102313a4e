"""Attention over the paged KV cache: the metadata of a step (full and sliding-window layers),
prompt and shared-prefix attention, the fused decode step in C, and the batch-invariant mode."""
