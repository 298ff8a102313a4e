"""Workloads of the benchmark, as token ids: sessions of turns.

A ``Session`` is what one client sends in order: a single request for the ``shared-prefix``,
``random`` and ``trace`` datasets, a whole conversation for ``multi-turn``, ``agent`` and
``multimodal`` (``multimodal.py``: chats about pictures). The prompt of a session's first turn
is that turn's tokens; the prompt of every later turn is the previous prompt, then the server's
reply to it, then the turn's tokens (``Conversation``). Sessions run concurrently; the turns of
one session never overlap.

Prompts are made of *words*: token ids that each decode to one lower-case word with a leading
space and that the tokenizer encodes back to themselves (``WordVocabulary``). Any sequence of
them survives ``encode(decode(ids)) == ids``, so a server that only takes text sees exactly the
same tokens as one that takes token ids.

Sharing is exact, by construction: groups (and conversations) differ from their first distinct
token on, so the tokens a perfect cache serves are the shared prefixes and nothing else.

A turn may send a picture (``Turn.image``) before its message text, as an ``image_url`` part of
its chat message. In the token ids the benchmark keeps of a prompt (the prompt log, the
perfect-cache estimate) the picture stands for ``IMAGE_TOKENS`` placeholder tokens
(``IMAGE_PLACEHOLDER_ID``) named by its content hash (``Conversation.mm_inputs``), as the engine
places an image's tokens; the server counts its own number of tokens per image.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from prefixserve.core.request import MultiModalInput

IMAGE_TOKENS = 196
"""Placeholder tokens a picture stands for in the benchmark's own view of a prompt (a ViT-B/16
tower at 224 x 224 pixels, as in ``benchmarks/random_model.py --vlm``)."""

IMAGE_PLACEHOLDER_ID = 0
"""The token id of those placeholders (the content hash tells pictures apart)."""

WORD_PATTERN = re.compile(r" [a-z]{2,}")
"""What a word token decodes to."""


class TextTokenizer(Protocol):
    """What the benchmark needs of a tokenizer (``prefixserve.model.text.tokenizer.Tokenizer``)."""

    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class WordVocabulary:
    """The word tokens of a tokenizer (see the module docstring), as an int64 array."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        ids = []
        for token_id in range(tokenizer.vocab_size):
            text = tokenizer.decode([token_id])
            if (WORD_PATTERN.fullmatch(text)
                    and tokenizer.encode(text, add_special_tokens=False) == [token_id]):
                ids.append(token_id)
        if len(ids) < 256:
            raise ValueError(f"the tokenizer has only {len(ids)} word tokens; the benchmark "
                             "needs at least 256 to make prompts")
        self.ids = np.array(ids, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` word tokens drawn uniformly (with replacement)."""
        return [int(i) for i in rng.choice(self.ids, n)]

    def distinct(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` different word tokens (all of them, shuffled, repeated if ``n`` is larger)."""
        if n <= len(self.ids):
            return [int(i) for i in rng.choice(self.ids, n, replace=False)]
        return [int(i) for i in rng.choice(self.ids, n)]

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


@dataclass(frozen=True)
class BenchImage:
    """A picture a turn sends: its ``data:`` URL and its content hash (the engine's, of the
    decoded pixels and size: ``prefixserve.model.vision.image``)."""

    url: str
    content_hash: str
    width: int
    height: int


@dataclass(frozen=True)
class Turn:
    """The tokens a turn adds to its session's history, and the tokens to generate. ``role``:
    who sends them on ``/v1/chat/completions`` (``user``, or ``tool``: the result of a call the
    previous reply made); ``image``: a picture sent before the message's text."""

    tokens: list[int]
    output_len: int
    role: str = "user"
    image: BenchImage | None = None


@dataclass
class Session:
    """Turns sent in order by one client. ``arrival``: seconds after the start of the run at
    which the first turn is due (None: the runner's request rate decides); ``group``: the
    shared-prefix group or conversation it belongs to."""

    turns: list[Turn]
    arrival: float | None = None
    group: int = 0
    chat: ChatSetup | None = None


@dataclass
class ChatSetup:
    """How a session looks on ``/v1/chat/completions``: a system message (``system`` tokens
    as text), a tool manifest (``tools``, function definitions), and the first user message
    (``first``: the first turn's own tokens, without the system prompt and manifest that its
    completions prompt starts with)."""

    system: list[int]
    tools: list[dict[str, Any]]
    first: list[int]


@dataclass
class Dataset:
    """A named workload and the parameters it was made with (written to the JSON).
    ``endpoint``: the endpoint the dataset must be sent to (``chat`` for pictures), None when
    ``--endpoint`` decides."""

    name: str
    sessions: list[Session]
    params: dict[str, Any] = field(default_factory=dict)
    endpoint: str | None = None

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


class Conversation:
    """The prompts of a session's turns: the first turn's tokens, then for each later turn the
    previous prompt, the reply to it and the turn's tokens. The same history is kept as text for
    servers that only take text (the reply as the server sent it). ``mm_inputs``: the pictures
    of the history so far, where their placeholder tokens are in ``ids``."""

    def __init__(self, session: Session, vocabulary: WordVocabulary) -> None:
        self.session = session
        self.vocabulary = vocabulary
        self.turn = 0
        self.ids: list[int] = []
        self.text = ""
        self.messages: list[dict[str, Any]] = []
        self.mm_inputs: list[MultiModalInput] = []
        if session.chat is not None and session.chat.system:
            self.messages.append({"role": "system",
                                  "content": vocabulary.text(session.chat.system).strip()})

    def chat_request(self) -> dict[str, Any]:
        """The chat body fields of the current turn: ``messages`` (and ``tools``)."""
        body: dict[str, Any] = {"messages": list(self.messages)}
        if self.session.chat is not None and self.session.chat.tools:
            body["tools"] = self.session.chat.tools
        return body

    def _own_tokens(self, turn: Turn) -> list[int]:
        """The tokens of the turn's message (the first turn's without the system prompt and
        manifest that ``ChatSetup`` sends apart)."""
        chat = self.session.chat
        return chat.first if chat is not None and self.turn == 0 else turn.tokens

    def _add_message(self, turn: Turn) -> None:
        chat = self.session.chat
        content: Any = self.vocabulary.text(self._own_tokens(turn)).strip()
        if turn.image is not None:
            content = [{"type": "image_url", "image_url": {"url": turn.image.url}},
                       {"type": "text", "text": content}]
        if turn.role == "tool" and self.messages and self.messages[-1]["role"] == "assistant":
            call_id = f"call_{self.turn}"
            name = chat.tools[0]["function"]["name"] if chat and chat.tools else "tool"
            self.messages[-1]["tool_calls"] = [{"id": call_id, "type": "function", "function": {
                "name": name, "arguments": "{}"}}]
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            self.messages.append({"role": "user", "content": content})

    @property
    def done(self) -> bool:
        return self.turn == len(self.session.turns)

    def next_prompt(self) -> tuple[list[int], str, int]:
        """The next turn's prompt (ids and text) and its output length; call ``add_reply``
        before asking for the turn after it."""
        turn = self.session.turns[self.turn]
        tokens = turn.tokens
        if turn.image is not None:
            cut = len(tokens) - len(self._own_tokens(turn))
            self.mm_inputs.append(MultiModalInput(len(self.ids) + cut, IMAGE_TOKENS,
                                                  turn.image.content_hash))
            tokens = tokens[:cut] + [IMAGE_PLACEHOLDER_ID] * IMAGE_TOKENS + tokens[cut:]
        self.ids = self.ids + tokens
        self.text = self.text + self.vocabulary.text(turn.tokens)
        self._add_message(turn)
        return self.ids, self.text, turn.output_len

    def add_reply(self, reply_ids: Sequence[int], reply_text: str) -> None:
        """Appends the reply to the history and moves to the next turn."""
        self.turn += 1
        if not self.done:
            self.ids = self.ids + list(reply_ids)
            self.text = self.text + reply_text
            self.messages.append({"role": "assistant", "content": reply_text})


def shared_prefix(vocabulary: WordVocabulary, *, num_groups: int, prompts_per_group: int,
                  system_prompt_len: int, question_len: int, output_len: int, shuffle: bool,
                  seed: int) -> Dataset:
    """``num_groups`` system prompts of ``system_prompt_len`` tokens, each followed by
    ``prompts_per_group`` questions of ``question_len`` tokens: one single-turn session each,
    in group order or shuffled. System prompts differ from their first token on, and so do the
    questions of a group, so two prompts share exactly their group's system prompt."""
    check_positive(num_groups=num_groups, prompts_per_group=prompts_per_group,
                   question_len=question_len, output_len=output_len)
    check_non_negative(system_prompt_len=system_prompt_len)
    rng = np.random.default_rng(seed)
    firsts = vocabulary.distinct(rng, num_groups)
    sessions = []
    for group in range(num_groups):
        system = ([firsts[group]] + vocabulary.sample(rng, system_prompt_len - 1)
                  if system_prompt_len else [])
        for first in vocabulary.distinct(rng, prompts_per_group):
            question = [first, *vocabulary.sample(rng, question_len - 1)]
            sessions.append(Session([Turn(system + question, output_len)], group=group))
    if shuffle:
        sessions = [sessions[i] for i in rng.permutation(len(sessions))]
    return Dataset("shared-prefix", sessions, {
        "num_groups": num_groups, "prompts_per_group": prompts_per_group,
        "system_prompt_len": system_prompt_len, "question_len": question_len,
        "output_len": output_len, "shuffle": shuffle, "seed": seed})


def multi_turn(vocabulary: WordVocabulary, *, num_conversations: int, num_turns: int,
               system_prompt_len: int, question_len: int, output_len: int,
               seed: int) -> Dataset:
    """``num_conversations`` conversations of ``num_turns`` user messages of ``question_len``
    tokens, answered with ``output_len`` tokens each. Every conversation starts with the same
    system prompt of ``system_prompt_len`` tokens (none when 0); their first messages differ
    from their first token on."""
    check_positive(num_conversations=num_conversations, num_turns=num_turns,
                   question_len=question_len, output_len=output_len)
    check_non_negative(system_prompt_len=system_prompt_len)
    rng = np.random.default_rng(seed)
    system = vocabulary.sample(rng, system_prompt_len)
    sessions = []
    for conversation, first in enumerate(vocabulary.distinct(rng, num_conversations)):
        turns = [Turn(system + [first] + vocabulary.sample(rng, question_len - 1), output_len)]
        turns += [Turn(vocabulary.sample(rng, question_len), output_len)
                  for _ in range(num_turns - 1)]
        sessions.append(Session(turns, group=conversation))
    return Dataset("multi-turn", sessions, {
        "num_conversations": num_conversations, "num_turns": num_turns,
        "system_prompt_len": system_prompt_len, "question_len": question_len,
        "output_len": output_len, "seed": seed})


def agent(vocabulary: WordVocabulary, *, num_sessions: int, num_turns: int, tool_tokens: int,
          system_tokens: int, num_tools: int, task_len: int, result_len: int,
          user_share: float, output_len: int, seed: int) -> Dataset:
    """Agent sessions shaped after the kv-cache-tester coding-agent traces
    (``/work/shared/traces``: per session a tool manifest of ``tool_tokens`` (median 12.7k
    there) and a system prompt of ``system_tokens`` (3.6k), then turns that are mostly tool
    results, about 1 in 6 a new user message), scaled down to fit a small model's context.

    Every session has the same system prompt and manifest (``num_tools`` functions whose
    descriptions share ``tool_tokens`` words), sent before the conversation, so they are the
    prefix every turn shares; each session's task differs from its first token on. A later
    turn is a tool result of ``result_len`` tokens (the result of a call made by the reply
    before it) or, with probability ``user_share``, a user message of ``task_len``. On
    ``/v1/completions`` a session's first prompt is system + manifest + task as tokens; on
    ``/v1/chat/completions`` they are a system message, ``tools`` and a user message."""
    check_positive(num_sessions=num_sessions, num_turns=num_turns, num_tools=num_tools,
                   task_len=task_len, result_len=result_len, output_len=output_len)
    check_non_negative(tool_tokens=tool_tokens, system_tokens=system_tokens)
    if not 0.0 <= user_share <= 1.0:
        raise ValueError(f"user-share must be in [0, 1], got {user_share}")
    rng = np.random.default_rng(seed)
    system = vocabulary.sample(rng, system_tokens)
    pieces = [vocabulary.sample(rng, max(1, tool_tokens // num_tools)) for _ in range(num_tools)]
    tools = [{"type": "function", "function": {
        "name": f"tool_{index}", "description": vocabulary.text(piece).strip(),
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}}}}}
        for index, piece in enumerate(pieces)]
    manifest = [token for piece in pieces for token in piece]
    sessions = []
    for number, first in enumerate(vocabulary.distinct(rng, num_sessions)):
        task = [first, *vocabulary.sample(rng, task_len - 1)]
        turns = [Turn(system + manifest + task, output_len)]
        for _ in range(num_turns - 1):
            if rng.random() < user_share:
                turns.append(Turn(vocabulary.sample(rng, task_len), output_len))
            else:
                turns.append(Turn(vocabulary.sample(rng, result_len), output_len, role="tool"))
        sessions.append(Session(turns, group=number, chat=ChatSetup(system, tools, task)))
    return Dataset("agent", sessions, {
        "num_sessions": num_sessions, "num_turns": num_turns, "tool_tokens": tool_tokens,
        "system_tokens": system_tokens, "num_tools": num_tools, "task_len": task_len,
        "result_len": result_len, "user_share": user_share, "output_len": output_len,
        "seed": seed})


def random_prompts(vocabulary: WordVocabulary, *, num_prompts: int, input_len: int,
                   output_len: int, seed: int) -> Dataset:
    """``num_prompts`` unrelated prompts of ``input_len`` tokens (first tokens all different
    while the vocabulary allows it): the 0%-hit case."""
    check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    rng = np.random.default_rng(seed)
    sessions = [Session([Turn([first, *vocabulary.sample(rng, input_len - 1)], output_len)],
                        group=index)
                for index, first in enumerate(vocabulary.distinct(rng, num_prompts))]
    return Dataset("random", sessions, {"num_prompts": num_prompts, "input_len": input_len,
                                        "output_len": output_len, "seed": seed})


def check_positive(**values: int) -> None:
    """A ``ValueError`` naming the first option (``num_turns`` as ``num-turns``) below 1."""
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name.replace('_', '-')} must be at least 1, got {value}")


def check_non_negative(**values: int) -> None:
    """A ``ValueError`` naming the first option below 0."""
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name.replace('_', '-')} must not be negative, got {value}")
