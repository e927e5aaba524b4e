"""Incremental detokenization against Hugging Face's full decode of the same ids: token by token with the
bundled model's tokenizer and two tokenizers built here (byte-level BPE; SentencePiece-style with byte
fallback and a leading-space strip), and through the engine (sampled outputs full of byte tokens, stop
strings that straddle token boundaries)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchbridge.serve import LLM, SamplingParams, default_model_dir
from torchbridge.serve.tokenizer import Tokenizer

TEXTS = [
    "def main() -> int:\n    return 0\n",
    "héllo wörld, ça va? naïve café",
    "日本語のテキストと中文",
    "emoji 🙂👍🏽 and 🇯🇵 flags",
    "mixed: Ünïcödé → ∑ x² ≤ ∞ … «quoted»",
    "  leading spaces and\ttabs\n\nnew lines  ",
]


def build_sentencepiece_style(out_dir: Path) -> None:
    """A Llama-2-style tokenizer: '▁' for spaces, byte fallback for characters outside the vocabulary,
    and a decoder that strips the leading space of the text (so windows need their context)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = RustTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  initial_alphabet=["▁"])
    tok.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog café " * 20], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            clean_up_tokenization_spaces=False).save_pretrained(out_dir)


@pytest.fixture(scope="module")
def tokenizers(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    sp = tmp_path_factory.mktemp("sp-tokenizer")
    build_sentencepiece_style(sp)
    return {"bundled": Tokenizer(default_model_dir()), "byte-bpe": Tokenizer(tokenizer_dir),
            "sentencepiece": Tokenizer(sp)}


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> tuple[list[str], str]:
    """Feed ids one at a time (after an optional prompt that is not output); the deltas and the final text."""
    prompt = prompt or []
    all_ids = list(prompt)
    detok = tok.detokenizer(len(prompt))
    deltas = []
    for t in ids:
        all_ids.append(t)
        deltas.append(detok.step(all_ids, len(all_ids)))
        assert detok.text == "".join(deltas)
    deltas.append(detok.finish(all_ids, len(all_ids)))
    return deltas, detok.text


@pytest.mark.parametrize("name", ["bundled", "byte-bpe", "sentencepiece"])
def test_token_by_token_equals_full_decode(tokenizers: dict[str, Tokenizer], name: str) -> None:
    tok = tokenizers[name]
    withheld = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        deltas, got = stream(tok, ids, prompt=tok.encode("a prompt", add_special_tokens=False))
        assert got == tok.hf.decode(ids, skip_special_tokens=True), (name, text)
        # No partial character ever went out: every delta but the last is clean text.
        assert all("\ufffd" not in d for d in deltas[:-1]) or "\ufffd" in got
        withheld += sum(1 for d in deltas[:-1] if d == "")
    # The texts do split characters across tokens here (else the test would not exercise withholding).
    assert withheld > 0, name


@pytest.mark.parametrize("name", ["bundled", "byte-bpe", "sentencepiece"])
def test_random_ids_with_invalid_bytes_and_special_tokens(tokenizers: dict[str, Tokenizer], name: str) -> None:
    """Arbitrary id sequences (broken UTF-8, special tokens in the middle): the final text is the full
    decode, U+FFFD included, and the text only ever grows by appending."""
    tok = tokenizers[name]
    vocab = len(tok.hf)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        ids = torch.randint(0, vocab, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        _, got = stream(tok, ids)
        assert got == tok.hf.decode(ids, skip_special_tokens=True), (name, ids)


def test_full_decode_fallback_for_tokenizers_that_clean_up_spaces(tokenizer_dir: Path, tmp_path: Path) -> None:
    """A tokenizer whose Hugging Face decode may post-process the whole text (clean_up_tokenization_spaces)
    is decoded whole, not in windows, and still equals Hugging Face's decode."""
    import json
    import shutil

    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["clean_up_tokenization_spaces"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(tmp_path)
    assert tok.hf.clean_up_tokenization_spaces and not tok._windowed
    for text in ["Hello world . How are you ? I am fine , thank you .", *TEXTS]:
        ids = tok.encode(text, add_special_tokens=False)
        deltas, got = stream(tok, ids)
        assert got == tok.hf.decode(ids, skip_special_tokens=True)


def run_streaming(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[str, list[int], str, object]:
    """One request through engine.step(): (concatenated stream deltas, token ids, final text, finish)."""
    eng = llm.engine
    eng.add_request("r", prompt, params)
    deltas, final = [], None
    while eng.has_unfinished():
        for u in eng.step():
            deltas.append(u.new_text)
            if u.finished:
                final = u
    assert final is not None
    return "".join(deltas), final.seq.output_ids, final.seq.text, (final.finish_reason, final.stop_reason)


@pytest.fixture(scope="module")
def sampled_llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), block_size=4, num_blocks=256, max_model_len=128)


def test_engine_text_equals_full_decode_of_sampled_outputs(sampled_llm: LLM) -> None:
    """A random-weight model sampling at temperature 1.5 emits byte tokens freely (broken and split
    multi-byte characters): streamed and final text equal Hugging Face's decode of the output ids."""
    tok = sampled_llm.tokenizer
    non_ascii = 0
    for seed in range(6):
        params = SamplingParams(temperature=1.5, seed=seed, max_tokens=48, ignore_eos=True)
        streamed, ids, text, _ = run_streaming(sampled_llm, [5, 6, 7, 8], params)
        assert text == tok.hf.decode(ids, skip_special_tokens=True)
        assert streamed == text
        non_ascii += any(ord(c) > 127 for c in text)
    assert non_ascii > 0


def test_stop_strings_straddling_tokens(sampled_llm: LLM) -> None:
    """Stop strings that begin inside one token's text and end inside a later one's cut the text at the
    string, also when the string holds a multi-byte character split across byte tokens."""
    tok = sampled_llm.tokenizer
    checked = multibyte = 0
    for seed in range(8):
        base = SamplingParams(temperature=1.5, seed=seed, max_tokens=48, ignore_eos=True)
        _, ids, full, _ = run_streaming(sampled_llm, [9, 10, 11], base)
        # Character offset where each token's text ends (prefix decodes; only clean boundaries).
        ends = []
        for i in range(1, len(ids) + 1):
            t = tok.hf.decode(ids[:i], skip_special_tokens=True)
            if not t.endswith("\ufffd") and full.startswith(t) and (not ends or len(t) > ends[-1]):
                ends.append(len(t))
        for a, b in zip(ends, ends[2:], strict=False):
            # From the middle of one token's text to the middle of the token after the next.
            start, stop_end = a - 1, b - 1
            if start < 1 or stop_end - start < 2:
                continue
            stop = full[start:stop_end]
            if "\ufffd" in stop:
                continue
            p = SamplingParams(temperature=1.5, seed=seed, max_tokens=48, ignore_eos=True, stop=[stop])
            streamed, _, text, finish = run_streaming(sampled_llm, [9, 10, 11], p)
            assert text == full[: full.index(stop)] and streamed == text, (seed, stop)
            assert finish == ("stop", stop)
            checked += 1
            multibyte += any(len(c.encode()) > 1 for c in stop)
            break
    assert checked >= 4 and multibyte >= 1, (checked, multibyte)
