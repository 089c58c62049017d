"""The lookup proposer (drafters/lookup.py) against a brute-force search."""

import numpy as np
import pytest

from mlx_mtp.drafters.lookup import LookupIndex, LookupSettings


def brute_force(tokens, s: LookupSettings):
    """Longest tail n-gram (min_match..max_match) seen before; most recent occurrence."""
    last = len(tokens) - 1
    for n in range(s.max_match, s.min_match - 1, -1):
        if n > len(tokens):
            continue
        tail = tokens[-n:]
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tail:
                return n, tokens[end + 1 : end + 1 + s.max_draft]
    return 0, []


@pytest.mark.parametrize("vocab,settings", [
    (3, LookupSettings(min_match=1, max_match=4, max_draft=5)),
    (4, LookupSettings()),
    (8, LookupSettings(min_match=2, max_match=3, max_draft=32)),
])
def test_index_matches_brute_force_at_every_length(vocab, settings):
    rng = np.random.default_rng(vocab)
    for trial in range(4):
        tokens = rng.integers(0, vocab, 300).tolist()
        if trial % 2:  # copy-rich: repeat spans of itself
            tokens = tokens[:60] + tokens[10:70] + tokens[5:40] + tokens[:100]
        index = LookupIndex(settings)
        index.sync(tokens[:7])  # prefill in chunks, then token by token
        index.sync(tokens[:20])
        for i in range(20, len(tokens) + 1):
            if i > 20:
                index.extend([tokens[i - 1]])
            n, want = brute_force(tokens[:i], settings)
            assert index.match()[0] == n
            assert index.propose() == want


def test_proposal_ends_where_the_context_ends_and_respects_max_draft():
    index = LookupIndex(LookupSettings(min_match=2, max_match=4, max_draft=6))
    index.extend([1, 2, 3, 4, 5, 1, 2])
    assert index.propose() == [3, 4, 5, 1, 2]
    assert index.propose(2) == [3, 4]
    index.extend([9])
    assert index.propose() == []
    assert index.match() == (0, None)


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="max_draft"):
        LookupSettings(max_draft=33)
    with pytest.raises(ValueError, match="min_match"):
        LookupSettings(min_match=5, max_match=4)
