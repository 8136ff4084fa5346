"""Incremental detokenizer on the real default tokenizer: UTF-8 hold-back, stop strings, cost."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferline.worker.engine.detokenizer import IncrementalDetokenizer, StopChecker

MULTIBYTE_TEXT = "héllo 😀🎉👍🏽 世界你好 日本語 한국어 ∑≠ naïve café — “quotes” 🇫🇷 \n\t ok."


@functools.lru_cache(maxsize=1)
def load_tokenizer():
    from transformers import AutoTokenizer

    from inferline.config.settings import bundled_model_path

    path = bundled_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def reference(tokenizer, token_ids, stop, skip_special_tokens=True):
    """decode(all) cut before the first stop string to complete (longest if several end there)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    stop = [s for s in stop if s]
    for end in range(1, len(text) + 1):
        matches = [s for s in stop if text[:end].endswith(s)]
        if matches:
            return text[: end - max(map(len, matches))], True
    return text, False


def stream(tokenizer, token_ids, stop=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(
        tokenizer, [1, 2, 3], stop=stop, skip_special_tokens=skip_special_tokens
    )
    deltas, stopped = [], False
    for token_id in token_ids:
        delta, stopped = detok.add(token_id)
        deltas.append(delta)
        if stopped:
            break
    flushed = detok.flush()
    assert detok.text == "".join(deltas) + flushed
    return deltas, flushed, detok.stopped  # flush may complete a stop string ending in U+FFFD


def interesting_ids():
    tok = load_tokenizer()
    ids = set(tok.encode(MULTIBYTE_TEXT))
    ids |= {t for ch in MULTIBYTE_TEXT for t in tok.encode(ch)}
    ids |= set(range(17))  # the special tokens
    return sorted(ids)


token_id_lists = st.lists(
    st.one_of(st.sampled_from(interesting_ids()), st.integers(0, len(load_tokenizer()) - 1)),
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_ids=token_id_lists, data=st.data())
def test_deltas_concatenate_to_the_decoded_text_cut_at_the_stop(token_ids, data):
    tokenizer = load_tokenizer()
    full = tokenizer.decode(token_ids, skip_special_tokens=True)
    substrings = st.builds(
        lambda i, n: full[i : i + n], st.integers(0, max(0, len(full) - 1)), st.integers(1, 6)
    )
    stop = data.draw(st.lists(st.one_of(substrings, st.text(max_size=3)), max_size=3))
    deltas, flushed, stopped = stream(tokenizer, token_ids, stop)
    want, want_stopped = reference(tokenizer, token_ids, stop)
    assert "".join(deltas) + flushed == want
    assert stopped == want_stopped
    for delta in deltas:  # no delta ends in the middle of a character
        assert not delta.endswith("\ufffd") or "\ufffd" in full


def test_text_of_real_multibyte_tokens_never_breaks_a_character(tokenizer):
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the case is really exercised
    deltas, flushed, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + flushed == MULTIBYTE_TEXT
    assert flushed == ""


def test_unfinished_character_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("a😀")
    for cut in range(1, len(ids)):
        deltas, flushed, _ = stream(tokenizer, ids[:cut])
        assert "".join(deltas) + flushed == tokenizer.decode(ids[:cut])


def test_stop_string_spanning_tokens_is_never_emitted(tokenizer):
    ids = tokenizer.encode("The answer is 42.\nObservation: done")
    deltas, flushed, stopped = stream(tokenizer, ids, stop=["Observation:"])
    assert stopped and flushed == ""
    assert "".join(deltas) == "The answer is 42.\n"
    assert all("Obs" not in d for d in deltas)


def test_possible_stop_prefix_is_held_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["<END>"])
    emitted = [detok.add(t)[0] for t in tokenizer.encode("a <EN")]
    assert "".join(emitted) == "a "  # "<EN" could still become "<END>"
    emitted = [detok.add(t)[0] for t in tokenizer.encode("D? no, <ENDING")]
    assert "".join(emitted) == "<END? no, <ENDING" and not detok.stopped
    assert detok.flush() == "" and detok.text == "a <END? no, <ENDING"


def test_flush_releases_a_held_stop_prefix(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["###"])
    text = "".join(detok.add(t)[0] for t in tokenizer.encode("x ##"))
    assert text == "x " and detok.flush() == "##" and detok.text == "x ##"


def test_after_stop_nothing_more_is_emitted(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["b"])
    for token_id in tokenizer.encode("abc"):
        detok.add(token_id)
    assert detok.stopped and detok.text == "a"
    assert detok.add(tokenizer.encode("zzz")[0]) == ("", True)
    assert detok.flush() == "" and detok.text == "a"


def test_special_tokens_kept_when_asked(tokenizer):
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id]
    deltas, flushed, _ = stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(deltas) + flushed == tokenizer.decode(ids, skip_special_tokens=False)
    deltas, flushed, _ = stream(tokenizer, ids)
    assert "".join(deltas) + flushed == "hi"


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner):
        self.inner = inner
        self.decoded_lengths: list[int] = []

    def decode(self, token_ids, **kwargs):
        self.decoded_lengths.append(len(token_ids))
        return self.inner.decode(token_ids, **kwargs)


def test_each_token_decodes_a_short_window(tokenizer):
    ids = tokenizer.encode((MULTIBYTE_TEXT + " Some plain English words follow. ") * 40)
    counting = CountingTokenizer(tokenizer)
    deltas, flushed, _ = stream(counting, ids)
    assert "".join(deltas) + flushed == tokenizer.decode(ids)
    assert len(counting.decoded_lengths) <= len(ids) + 1  # one decode per token, one in flush
    assert max(counting.decoded_lengths) <= 8  # the window, not the whole output (~1000 tokens)


@pytest.mark.parametrize(
    ("stop", "chunks", "emitted", "stopped"),
    [
        (["ab"], ["xa", "b", "c"], "x", True),
        (["abcd", "bc"], ["ab", "cd"], "a", True),  # "bc" completes first
        (["bc", "abc"], ["abc"], "", True),  # same end: the longer match wins
        (["ab"], ["xa", "c"], "xac", False),
        ([""], ["abc"], "abc", False),
    ],
)
def test_stop_checker(stop, chunks, emitted, stopped):
    checker = StopChecker(stop)
    text = "".join(checker.feed(c) for c in chunks) + checker.flush()
    assert (text, checker.stopped) == (emitted, stopped)
