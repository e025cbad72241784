"""Incremental text: spaces kept, multi-byte characters and stop strings never split, stream == whole text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ortpa.serve.detokenizer import TextStream


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer and decoder use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Token id == byte value: every multi-byte character spans several tokens."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab, merges=[]))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@pytest.fixture(scope="module")
def word_tokenizer(tokenizer):
    return tokenizer


def _run(tokenizer, ids, chunks, stop=()):
    stream = TextStream(tokenizer, stop)
    deltas, at = [], 0
    for size in chunks:
        deltas.append(stream.push(ids[at : at + size]))
        at += size
    deltas.append(stream.push(ids[at:]))
    deltas.append(stream.finish())
    return [d for d in deltas if d], stream


def test_word_level_keeps_the_spaces_between_tokens(word_tokenizer):
    ids = word_tokenizer.encode("hello world the paged cache").ids
    deltas, _ = _run(word_tokenizer, ids, [1] * len(ids))
    assert deltas == ["hello", " world", " the", " paged", " cache"]
    assert "".join(deltas) == word_tokenizer.decode(ids)


def test_multibyte_characters_are_never_split(byte_tokenizer):
    text = "ok 中文 é 🙂!"
    ids = list(text.encode())
    deltas, _ = _run(byte_tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "中" in deltas and "🙂" in deltas  # each whole, once its last byte arrived


def test_an_incomplete_character_at_the_end_comes_out_as_a_full_decode_does(byte_tokenizer):
    ids = [*b"a", *"中".encode()[:2]]
    deltas, _ = _run(byte_tokenizer, ids, [1, 1, 1])
    assert deltas == ["a", "\ufffd"] and "".join(deltas) == byte_tokenizer.decode(ids)


def test_stop_string_spanning_tokens_is_never_sent(word_tokenizer):
    ids = word_tokenizer.encode("hello world the paged cache").ids
    deltas, stream = _run(word_tokenizer, ids, [1] * len(ids), stop=["world the"])
    assert "".join(deltas) == "hello " and stream.stopped and stream.stop_reason == "world the"
    assert not any("world" in d for d in deltas), deltas


def test_stop_strings_wait_for_min_tokens(word_tokenizer):
    stream = TextStream(word_tokenizer, ["world"], min_tokens=3)
    ids = word_tokenizer.encode("hello world the world paged").ids
    deltas = [stream.push([t]) for t in ids] + [stream.finish()]
    assert "".join(deltas) == "hello world the " and stream.stopped  # the second "world" ends it, the first not


def test_eos_ids_are_not_decoded(word_tokenizer):
    stream = TextStream(word_tokenizer, skip_ids=[5])  # "hello" plays EOS
    assert stream.push([6, 5]) + stream.finish() == "world"


_TEXT = st.text(alphabet=st.sampled_from("ab \n中é🙂xyz"), max_size=24)


@given(text=_TEXT, cuts=st.lists(st.integers(1, 4), max_size=30), garbage=st.lists(st.integers(128, 255), max_size=3))
def test_stream_equals_the_whole_decode(byte_tokenizer, text, cuts, garbage):
    """Any text (with stray continuation bytes mixed in), pushed in any chunks: the deltas join to decode(ids)."""
    ids = list(text.encode()) + garbage + list(b"z")
    deltas, _ = _run(byte_tokenizer, ids, cuts)
    assert "".join(deltas) == byte_tokenizer.decode(ids)


@given(text=_TEXT, cuts=st.lists(st.integers(1, 4), max_size=30), stops=st.lists(_TEXT.filter(bool), max_size=3))
def test_stop_strings_cut_where_the_whole_text_first_holds_one(byte_tokenizer, text, cuts, stops):
    ids = list(text.encode())
    deltas, stream = _run(byte_tokenizer, ids, cuts, stop=stops)
    whole = byte_tokenizer.decode(ids)
    hits = [i for s in stops if (i := whole.find(s)) >= 0]
    expected = whole[: min(hits)] if hits else whole
    assert "".join(deltas) == expected and stream.stopped == bool(hits)
    sent = ""
    for d in deltas:  # no prefix of the output ever showed a stop string, even in part of a chunk
        sent += d
        assert not any(s in sent for s in stops)
