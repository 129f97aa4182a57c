"""The data tests' shared parts: tiny corpora of a few documents, written into tmp_path, and
helpers to read back what data/prepare.py made of them."""

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from data.meta import EOT_ID

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 400  # small: fast to train, still room to merge every test word
META_KEYS = {"name", "source", "vocab_size", "eot_id", "content_sha256", "tokenizer_sha256"}
# Each document repeats its own word, so a merged token for the word shows which split trained on it.
WORDS = ["quokka", "zephyr", "bramble", "fjord", "walrus", "cobalt"]


def document(word: str) -> str:
    return f"The {word} sat.\n" + f"{word} " * 40 + "\nCafé ☕ ünïcode, tabs\tand 'quotes'.\n"


def write_corpus(folder: Path, documents: dict[str, str | bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in documents.items():
        data = content if isinstance(content, bytes) else content.encode("utf-8")
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus", {f"{word}.txt": document(word) for word in WORDS})


def contents_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


class Prepared(NamedTuple):
    files: list[str]  # the globs it was prepared from
    out: Path
    before: dict[str, bytes]  # its files, by name


@pytest.fixture
def prepared(corpus: Path, tmp_path: Path) -> Prepared:
    """A corpus prepared in tmp_path/tiny, for tests of what a later prepare does to it."""
    # Imported here, as Tokenizer below: both import tokenizers, which this module, a plugin of
    # every test file's, must not need (gpu_check.sh's machine may lack it).
    from data.prepare import prepare

    files = [str(corpus / "*.txt")]
    out = prepare("tiny", files=files, vocab_size=VOCAB, out_root=tmp_path)
    return Prepared(files, out, contents_of(out))


def decode_split(out_dir: Path, split: str) -> list[str]:
    """The split's documents, read back the way train.py reads tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    ids = np.memmap(out_dir / f"{split}.bin", dtype=np.uint16, mode="r")
    assert ids[-1] == EOT_ID, "every document, the last included, ends with EOT"
    ends = np.flatnonzero(ids == EOT_ID)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


def read_meta(out_dir: Path) -> dict:
    return json.loads((out_dir / "meta.json").read_text())


def mtimes(out_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(out_dir.iterdir()) if p.is_file()}
