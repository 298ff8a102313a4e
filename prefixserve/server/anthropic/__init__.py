"""Anthropic's Messages API: messages, count_tokens, tools and explicit caching with
cache_control, rendered into the same engine calls as the OpenAI API."""
