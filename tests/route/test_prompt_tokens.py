from __future__ import annotations

from torchbridge.route.index import block_hashes
from torchbridge.route.prompt_tokens import ChunkTokenizer, make_tokenizer, request_tokens


def test_chunk_tokenizer_values() -> None:
    tok = ChunkTokenizer(4)
    assert tok.encode_prompt("abcdefghij") == [0x64636261, 0x68676665, 0x6A69]  # little-endian byte chunks
    assert tok.encode_prompt("") == []
    assert ChunkTokenizer(2).encode_prompt("é!") == [0xA9C3, 0x21]  # UTF-8 bytes, not characters


def test_chat_growth_keeps_block_prefix() -> None:
    tok = make_tokenizer(None)
    turn1 = [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "first question " * 10}]
    turn2 = [*turn1, {"role": "assistant", "content": "answer " * 20}, {"role": "user", "content": "more"}]
    h1 = block_hashes(request_tokens(tok, {"messages": turn1}), 16)
    h2 = block_hashes(request_tokens(tok, {"messages": turn2}), 16)
    assert len(h1) >= 5 and h2[:len(h1)] == h1


def test_request_tokens_forms() -> None:
    tok = make_tokenizer(None)
    assert request_tokens(tok, {"prompt": [5, 6, 7]}) == [5, 6, 7]  # token-id prompts pass through
    assert request_tokens(tok, {"prompt": ["ab", "cd"]}) == tok.encode_prompt("abcd")
    assert request_tokens(tok, {}) == []
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert request_tokens(tok, {"messages": parts})  # content-part lists are accepted
