"""Prompts the engine tests share: one system prompt before several questions, so that the
requests share a cached prefix of whole blocks."""

from __future__ import annotations

from prefixserve import LLM

SYSTEM = ("You are a careful assistant for a small bakery. Answer questions about opening hours, "
          "bread, cakes and prices politely and briefly. The bakery opens at seven and closes at "
          "six, except on Sundays when it closes at noon. ")
QUESTIONS = ["What time do you open?", "Do you sell rye bread?", "Is there a cake for ten?",
             "Are you open on Sunday afternoon?"]


def prompts(llm: LLM) -> list[list[int]]:
    """The system prompt followed by each question, as token ids of ``llm``'s tokenizer."""
    tok = llm.get_tokenizer()
    return [tok.encode(SYSTEM + q) for q in QUESTIONS]
