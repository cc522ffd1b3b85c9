"""GPT-2 BPE: identical ids to the reference (HF tokenizers) on the whole Gutenberg corpus, and clear
errors for files that are not a GPT-2 vocabulary."""

from __future__ import annotations

import json
import lzma
import shutil

import pytest

from data_tools.tokenizer import TokenizerError, build_tokenizer, bytes_to_unicode

EDGE_CASES = [
    "Hello world",
    "",
    " ",
    "   leading and trailing   ",
    "tabs\tand\n\nnewlines\r\n  \n",
    "I'm, you're, we'll, they've, she'd, it's; DON'T 'quoted'",
    "numbers 1234567 3.14159 ６７８",
    "naïve café résumé Ünïcödé — “quotes” …",
    "中文字符和日本語のテキスト、한국어",
    "emoji 🤗🎉👨‍👩‍👧 and \u200b zero width",
    "<|endoftext|> is plain text here <|endoftext|>",
    "a" * 1000 + " " + "ab" * 300,
    "\x00\x01 control \x7f chars",
]


def test_known_ids(gpt2_tokenizer):
    assert gpt2_tokenizer.encode("Hello") == [15496]
    assert gpt2_tokenizer.encode(" world") == [995]
    assert gpt2_tokenizer.vocab_size == 50257
    assert gpt2_tokenizer.eod == 50256
    # Inside text, <|endoftext|> is ordinary text (Megatron and OpenAI's encoder do the same).
    assert 50256 not in gpt2_tokenizer.encode("<|endoftext|>")
    assert gpt2_tokenizer.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"


def test_edge_cases_match_reference(gpt2_tokenizer, hf_gpt2):
    ours = gpt2_tokenizer.encode_batch(EDGE_CASES)
    for text, ids in zip(EDGE_CASES, ours):
        assert ids == gpt2_tokenizer.encode(text)
        assert ids == hf_gpt2.encode(text).ids, text
        assert gpt2_tokenizer.decode(ids) == text


@pytest.mark.slow  # over 5 s on 2 cores: outside `scripts/check.sh --fast`
def test_whole_gutenberg_corpus_matches_reference(shared_data, gpt2_tokenizer, hf_gpt2):
    books = sorted((shared_data / "gutenberg-novels").glob("*.txt.xz"))
    assert len(books) == 21
    texts = []
    for book in books:
        with lzma.open(book, "rt", encoding="utf-8-sig") as f:  # drops the BOM, CRLF -> LF
            texts.append(f.read())
    reference = hf_gpt2.encode_batch(texts)  # HF parallelises over books
    ours = gpt2_tokenizer.encode_batch(texts)
    total = 0
    for book, text, ref, ids in zip(books, texts, reference, ours):
        assert ids == ref.ids, f"{book.name}: ids differ from the reference"
        assert gpt2_tokenizer.decode(ids) == text, book.name
        total += len(ids)
    assert total == 4_931_295


def test_hf_file_names_are_accepted(tmp_path, gpt2_files, gpt2_tokenizer):
    vocab, merges = gpt2_files
    shutil.copy(vocab, tmp_path / "vocab.json")
    shutil.copy(merges, tmp_path / "merges.txt")
    tok = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=tmp_path / "vocab.json", merge_file=tmp_path / "merges.txt"
    )
    assert tok.encode(EDGE_CASES[5]) == gpt2_tokenizer.encode(EDGE_CASES[5])


def test_byte_table_is_a_bijection():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


# --------------------------------------------------------------------------- bad files


def _gpt2_error(vocab, merges) -> str:
    with pytest.raises(TokenizerError) as info:
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    return str(info.value)


def test_vocab_that_is_not_json(tmp_path, gpt2_files):
    bad = tmp_path / "encoder.json"
    bad.write_text('{"a": 1,\n oops}\n')
    message = _gpt2_error(bad, gpt2_files[1])
    assert f"{bad}:2" in message and "invalid JSON" in message and "--vocab-file" in message


def test_vocab_that_is_not_a_str_to_int_dict(tmp_path, gpt2_files):
    bad = tmp_path / "encoder.json"
    bad.write_text("[1, 2, 3]")
    assert "expected a JSON object mapping token strings to ids, found list" in _gpt2_error(
        bad, gpt2_files[1]
    )
    bad.write_text('{"a": "1"}')
    assert "expected a non-negative integer id for every token, found 'a': '1'" in _gpt2_error(
        bad, gpt2_files[1]
    )


def test_swapped_vocab_and_merges(gpt2_files):
    vocab, merges = gpt2_files
    assert "did you swap --vocab-file and --merge-file?" in _gpt2_error(merges, vocab)


def test_merges_without_version_header(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    bad = tmp_path / "vocab.bpe"
    bad.write_text("\n".join(merges.read_text(encoding="utf-8").split("\n")[1:]), encoding="utf-8")
    message = _gpt2_error(vocab, bad)
    assert f"{bad}:1: expected a BPE merges file starting with '#version'" in message


def test_malformed_merge_line(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    lines = merges.read_text(encoding="utf-8").split("\n")
    lines[4] = "Ġ t h"  # line 5
    bad = tmp_path / "vocab.bpe"
    bad.write_text("\n".join(lines), encoding="utf-8")
    assert f"{bad}:5: expected a merge of two tokens separated by one space" in _gpt2_error(vocab, bad)


def test_ranks_inconsistent_with_merges(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    lines = merges.read_text(encoding="utf-8").split("\n")
    lines[10], lines[11] = lines[11], lines[10]  # merges 9 and 10 swapped: ids no longer follow merge order
    bad = tmp_path / "vocab.bpe"
    bad.write_text("\n".join(lines), encoding="utf-8")
    message = _gpt2_error(vocab, bad)
    assert f"{bad}:11: merge 9" in message and "should produce token id 265" in message


def test_vocab_without_eod(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    data = json.loads(vocab.read_text(encoding="utf-8"))
    del data["<|endoftext|>"]
    bad = tmp_path / "encoder.json"
    bad.write_text(json.dumps(data), encoding="utf-8")
    assert "expected an '<|endoftext|>' entry" in _gpt2_error(bad, merges)


def test_missing_flags_and_unknown_type(gpt2_files):
    with pytest.raises(TokenizerError, match="needs --vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0])
    with pytest.raises(TokenizerError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(TokenizerError, match="unknown tokenizer type 'BertWordPiece'"):
        build_tokenizer("BertWordPiece")
    with pytest.raises(TokenizerError, match="vocabulary file not found"):
        build_tokenizer("GPT2BPETokenizer", vocab_file="/nonexistent/encoder.json", merge_file=gpt2_files[1])
