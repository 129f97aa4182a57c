"""data/loader.py's batches on a hand-written token file: windows, ranks, resuming."""

from pathlib import Path

import numpy as np
import pytest
import torch

from data.loader import TokenBatches
from data.meta import DataError

CPU = torch.device("cpu")
N, T = 50, 8  # tokens in the file, block size


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    """Token i is i, so a window's values say where it starts."""
    path = tmp_path / "train.bin"
    np.arange(N, dtype=np.uint16).tofile(path)
    return path


def test_windows_are_whole_shifted_by_one_and_cover_the_file(tokens: Path) -> None:
    batches = TokenBatches(tokens, T, batch_size=4, seed=0, device=CPU, expected_tokens=N)
    starts = set()
    for _ in range(200):
        x, y = batches.next()
        assert x.shape == y.shape == (4, T) and x.dtype == torch.int64
        assert torch.equal(y, x + 1)  # the target is the next token
        assert torch.equal(x, x[:, :1] + torch.arange(T))  # a contiguous window
        starts |= set(x[:, 0].tolist())
    # Every start from 0 to N - T - 1 (the last window's target is the file's last token).
    assert starts == set(range(N - T))


def test_ranks_together_see_what_one_process_sees(tokens: Path) -> None:
    single = TokenBatches(tokens, T, batch_size=6, seed=3, device=CPU)
    ranks = [TokenBatches(tokens, T, 3, 3, CPU, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(5):
        x, _ = single.next()
        shares = [rank.next()[0] for rank in ranks]
        assert torch.equal(torch.cat(shares), x)


def test_state_dict_resumes_the_sequence_and_restart_repeats_it(tokens: Path) -> None:
    a = TokenBatches(tokens, T, 4, seed=1, device=CPU)
    first = [a.next()[0] for _ in range(3)]
    state = a.state_dict()
    rest = [a.next()[0] for _ in range(3)]
    b = TokenBatches(tokens, T, 4, seed=99, device=CPU)  # another seed: the state decides
    b.load_state_dict(state)
    assert all(
        torch.equal(p, q) for p, q in zip(rest, [b.next()[0] for _ in range(3)], strict=True)
    )
    a.restart()
    assert all(
        torch.equal(p, q) for p, q in zip(first, [a.next()[0] for _ in range(3)], strict=True)
    )


def test_a_file_of_the_wrong_size_is_refused(tokens: Path) -> None:
    with pytest.raises(DataError, match=r"train\.bin is damaged: 100 bytes is 50 uint16 tokens, "):
        TokenBatches(tokens, T, 4, 0, CPU, expected_tokens=N + 1)
    with pytest.raises(DataError, match=r"fewer than block_size \+ 1 = 51"):
        TokenBatches(tokens, N, 1, 0, CPU)
    tokens.write_bytes(b"\0" * 99)  # half a token at the end: damaged, counted or not
    with pytest.raises(DataError, match=r"damaged: 99 bytes is 49\.5 uint16 tokens;"):
        TokenBatches(tokens, T, 4, 0, CPU)
    tokens.unlink()
    tokens.mkdir()  # a folder's size is its entries' table: not a size to read as tokens
    with pytest.raises(DataError, match=r"train\.bin is a folder, not a token file"):
        TokenBatches(tokens, T, 4, 0, CPU, expected_tokens=N)


def test_a_batch_larger_than_the_file_is_refused_where_training_draws_from_it(
    tokens: Path,
) -> None:
    """More tokens a batch than the file holds is a typo in the split training draws from;
    a small val split's windows may overlap (evaluation reads it), so that one is read."""
    with pytest.raises(DataError, match=r"more than .*train\.bin holds \(50\)"):
        TokenBatches(tokens, T, batch_size=7, seed=0, device=CPU)
    x, y = TokenBatches(tokens, T, batch_size=7, seed=0, device=CPU, whole_batches=False).next()
    assert x.shape == (7, T) and torch.equal(y, x + 1)


def test_an_id_beyond_the_tokenizer_is_an_error_naming_the_file_and_token(tokens: Path) -> None:
    """A file of the right size can still be damaged: an id the tokenizer does not have would
    fail in the embedding with an IndexError, or on a GPU with a device-side assert."""
    assert TokenBatches(tokens, T, 4, 0, CPU, vocab_size=N).next()  # ids 0..49: all fine
    damaged = np.arange(N, dtype=np.uint16)
    for bad in (60000, N):  # N: the first id the tokenizer lacks
        damaged[20] = bad
        damaged.tofile(tokens)
        batches = TokenBatches(tokens, T, batch_size=4, seed=0, device=CPU, vocab_size=N)
        with pytest.raises(DataError, match=rf"train\.bin is damaged: token 20 is id {bad}, beyo"):
            for _ in range(50):  # until a window covers token 20
                batches.next()
