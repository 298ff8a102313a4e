"""OpenAI's API: completions, chat completions, responses, tools and structured outputs,
logprobs, tokenize, and the vLLM extensions (retention, cache salts)."""
