"""The benchmark's agent dataset and its chat conversations, without a server: every session
starts with the same system prompt and manifest, later turns are tool results or user
messages, and the chat messages pair each tool result with a call of the reply before it."""

from __future__ import annotations

import pytest

from prefixserve.model.text.tokenizer import load_tokenizer
from prefixserve.tools.bench.datasets import Conversation, WordVocabulary, agent


@pytest.fixture(scope="module")
def vocabulary() -> WordVocabulary:
    return WordVocabulary(load_tokenizer(None))


def test_agent_sessions_share_system_and_manifest(vocabulary: WordVocabulary) -> None:
    dataset = agent(vocabulary, num_sessions=5, num_turns=6, tool_tokens=80, system_tokens=20,
                    num_tools=4, task_len=10, result_len=12, user_share=0.2, output_len=8,
                    seed=3)
    firsts = [s.turns[0].tokens for s in dataset.sessions]
    shared = 20 + 80
    assert all(f[:shared] == firsts[0][:shared] for f in firsts)
    assert len({f[shared] for f in firsts}) == 5  # tasks differ from their first token on
    roles = [t.role for s in dataset.sessions for t in s.turns[1:]]
    assert set(roles) == {"tool", "user"} and roles.count("tool") > roles.count("user")
    chat = dataset.sessions[0].chat
    assert chat is not None and len(chat.tools) == 4 and chat.first == firsts[0][shared:]


def test_chat_messages_answer_each_tool_result_with_a_call(vocabulary: WordVocabulary) -> None:
    dataset = agent(vocabulary, num_sessions=1, num_turns=5, tool_tokens=40, system_tokens=8,
                    num_tools=2, task_len=6, result_len=6, user_share=0.0, output_len=4, seed=1)
    conversation = Conversation(dataset.sessions[0], vocabulary)
    while not conversation.done:
        conversation.next_prompt()
        body = conversation.chat_request()
        conversation.add_reply([], "ok")
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 4
    for call, result in zip(messages[2::2], messages[3::2], strict=True):
        assert call["tool_calls"][0]["id"] == result["tool_call_id"]
    assert body["tools"] == dataset.sessions[0].chat.tools
