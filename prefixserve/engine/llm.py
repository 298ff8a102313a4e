"""``LLM``: offline, batched generation in the caller's thread."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from prefixserve.engine.config import EngineConfig
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.engine.output_processor import RequestState
from prefixserve.model.tokenizer import Tokenizer
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]


class LLM:
    """Generates text for batches of prompts or conversations.

    ``LLM(model=None)`` loads the default model (SmolLM2-135M-Instruct). Keyword arguments are
    the fields of :class:`EngineConfig`; ``enable_prefix_caching=None`` (the default) means on.
    Each output carries ``num_cached_tokens``, the prompt tokens served from the prefix cache.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt (text, or a list of token ids) to completion, batched, and returns
        one output per prompt in input order."""
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]  # one prompt: text, or token ids
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        return self._run(batch, sampling_params, cache_salt)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them and
        generates the assistant's replies."""
        conversations: list[Messages]
        if messages and isinstance(messages[0], dict):
            conversations = [cast(Messages, messages)]  # one conversation
        else:
            conversations = list(cast(Sequence[Messages], messages))
        tokenizer = self.engine.tokenizer
        prompts: list[Prompt] = [
            cast(list[int], tokenizer.apply_chat_template(
                list(c), add_generation_prompt=add_generation_prompt, tokenize=True))
            for c in conversations
        ]
        return self._run(prompts, sampling_params, cache_salt)

    def close(self) -> None:
        """Finishes the cache tiers' writes and stops their threads (no-op without tiers)."""
        self.engine.close()

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, also while requests run (their blocks come back uncached)."""
        return self.engine.reset_prefix_cache()

    def _run(self, prompts: list[Prompt],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             cache_salt: str | None) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        states: list[RequestState] = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                request_id = engine.add_request(prompt, params, cache_salt=cache_salt)
                states.append(engine.request_state(request_id))
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException:
            for state in states:
                engine.abort_request(state.request_id)
            raise
        return [state.output(delta=False) for state in states]
