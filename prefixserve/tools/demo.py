"""A demo of the prefix cache at work on the default model.

Four chat requests share a long system prompt and differ in their question. They run one after
the other, so each later one finds the system prompt's blocks in the cache: the table shows, per
request, the prompt tokens served from the cache and the time to first token.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

SYSTEM_PROMPT = (
    "You are the help desk of the city library. The library opens Monday to Friday from nine "
    "to eight and on Saturdays from ten to four; it is closed on Sundays and public holidays. "
    "Members may borrow up to twelve books for three weeks and renew them twice online, by "
    "phone or at the desk, unless another member has reserved them. Late returns cost twenty "
    "cents per book per day, capped at five euros per book. Membership is free for residents; "
    "visitors pay ten euros a year. The reading room on the second floor is silent; group "
    "study rooms on the third floor can be booked for two hours at a time. Printing costs ten "
    "cents a page in black and white and fifty cents in colour. Answer in one or two sentences."
)

QUESTIONS = [
    "How many books can I borrow?",
    "Is the library open on Sunday?",
    "What does colour printing cost?",
    "Can I book a room for my study group?",
]


def run_demo(model: str | None = None, max_tokens: int = 48) -> None:
    """Runs the four requests and prints what the cache saved on each."""
    from prefixserve import LLM, SamplingParams

    console = Console()
    console.print("Loading the model...")
    llm = LLM(model)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    table = Table(title=f"Prefix cache at work (block size {llm.engine.block_size})")
    for column in ("question", "prompt tokens", "from cache", "TTFT s", "answer"):
        table.add_column(column, overflow="fold")
    total = cached = 0
    for question in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": question}]
        out = llm.chat(messages, params)[0]
        prompt_len = len(out.prompt_token_ids)
        total += prompt_len
        cached += out.num_cached_tokens
        table.add_row(question, str(prompt_len), str(out.num_cached_tokens),
                      f"{out.metrics.ttft:.2f}", out.outputs[0].text.strip())
    console.print(table)
    console.print(f"Prompt tokens served from the cache: {cached} of {total} "
                  f"({cached / total:.0%}); only the rest went through the model.")
