"""``LLM``: offline, batched generation in the caller's thread."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from prefixserve.core import Retention
from prefixserve.engine.config import EngineConfig
from prefixserve.engine.llm_engine import PIN_WARMUP_PARAMS, PIN_WARMUP_RETENTION, LLMEngine
from prefixserve.engine.lora_registry import LoRAInfo
from prefixserve.engine.multimodal import PlacedImages, flatten_content
from prefixserve.engine.output_processor import RequestState
from prefixserve.model.text.tokenizer import Tokenizer
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]


class LLM:
    """Generates text for batches of prompts or conversations.

    ``LLM(model=None)`` loads the default model (SmolLM2-135M-Instruct). Keyword arguments are
    the fields of :class:`EngineConfig`; ``enable_prefix_caching=None`` (the default) means on.
    Each output carries ``num_cached_tokens``, the prompt tokens served from the prefix cache.
    With ``enable_lora=True`` (and ``max_loras``, ``max_lora_rank``, ``lora_modules={name:
    path}``), ``generate`` and ``chat`` take ``lora=name`` to run under a loaded adapter (or a
    list, one name or None per prompt, to mix adapters in one batch); ``load_lora`` and
    ``unload_lora`` add and remove adapters.
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
        retention: Retention | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt (text, or a list of token ids) to completion, batched, and returns
        one output per prompt in input order. ``retention`` (``prefixserve.core.Retention``)
        asks the prefix cache to keep the prompts' blocks at a priority, for a while."""
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]  # one prompt: text, or token ids
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        return self._run(batch, sampling_params, cache_salt, lora, retention)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them and
        generates the assistant's replies.

        A message's content may be a list of parts, as OpenAI's chat API has them: ``{"type":
        "text", "text": ...}``, and for a model that takes images ``{"type": "image_url",
        "image_url": {"url": "data:image/png;base64,..."}}`` or ``{"type": "image", "image":
        <a Pillow image or an image file's bytes>}`` (``engine/multimodal.py``). Raises
        ``ImageError`` for an image that cannot be decoded, ``RequestError`` for images the
        model cannot take."""
        conversations: list[Messages]
        if messages and isinstance(messages[0], dict):
            conversations = [cast(Messages, messages)]  # one conversation
        else:
            conversations = list(cast(Sequence[Messages], messages))
        prompts: list[Prompt] = []
        placed: list[PlacedImages | None] = []
        for conversation in conversations:
            ids, images = self._chat_prompt(conversation, add_generation_prompt)
            prompts.append(ids)
            placed.append(images)
        return self._run(prompts, sampling_params, cache_salt, lora, images=placed)

    def _chat_prompt(self, conversation: Messages, add_generation_prompt: bool
                     ) -> tuple[list[int], PlacedImages | None]:
        """A conversation's prompt ids (its images expanded) and placed images."""
        engine = self.engine
        messages, images = flatten_content(conversation, engine.image_token,
                                           engine.config.max_image_pixels)
        ids = cast(list[int], engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True))
        if not images:
            return ids, None
        return engine.place_images(ids, images)

    def close(self) -> None:
        """Finishes the cache tiers' writes and stops their threads (no-op without tiers)."""
        self.engine.close()

    def reset_prefix_cache(self, keep_pins: bool = False) -> bool:
        """Empties the prefix cache, also while requests run (their blocks come back uncached);
        pins are released too unless ``keep_pins``."""
        return self.engine.reset_prefix_cache(keep_pins=keep_pins)

    def pin_prefix(self, pin_id: str, prompt: Prompt, cache_salt: str | None = None) -> int:
        """Computes ``prompt`` (text or token ids) and pins its full blocks until ``unpin``;
        returns their number. Raises ``RequestError`` over the pin budget."""
        engine = self.engine
        ids = (engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt))
        engine.check_pin(ids)
        self._run([ids], PIN_WARMUP_PARAMS, cache_salt, None, PIN_WARMUP_RETENTION)
        return engine.pin_cached_prefix(pin_id, ids, cache_salt)

    def unpin(self, pin_id: str) -> bool:
        return self.engine.unpin(pin_id)

    def load_lora(self, name: str, path: str) -> LoRAInfo:
        """Loads a LoRA adapter (PEFT directory or GGUF LoRA file) to use as ``lora=name``."""
        return self.engine.add_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Unloads adapter ``name`` (its cached blocks stay until the pool reuses them)."""
        self.engine.remove_lora(name)

    def _run(self, prompts: list[Prompt],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             cache_salt: str | None, lora: str | Sequence[str | None] | None = None,
             retention: Retention | None = None,
             images: Sequence[PlacedImages | None] | None = None,
             ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} adapter names for {len(prompts)} prompts")
        engine = self.engine
        states: list[RequestState] = []
        placed = images if images is not None else [None] * len(prompts)
        try:
            for prompt, params, name, image_inputs in zip(prompts, params_list, loras, placed,
                                                          strict=True):
                request_id = engine.add_request(prompt, params, cache_salt=cache_salt, lora=name,
                                                retention=retention, images=image_inputs)
                states.append(engine.request_state(request_id))
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException:
            for state in states:
                engine.abort_request(state.request_id)
            raise
        return [state.output(delta=False) for state in states]
