"""From a corpus's documents to its files: which documents go to train and which to val, the
byte-level BPE trained on the train side, and the token files and meta.json written with it.
data/prepare.py runs these in turn (its docstring gives the decisions behind them); a change to
what they write, or how, bumps its FORMAT_VERSION.
"""

import hashlib
import itertools
import math
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from console import Droppable
from data.corpus import Corpus, PrepareError
from data.meta import EOT, EOT_ID, TOKEN_DTYPE, file_sha256
from data.store import OUTPUT_FILES, sync, write_json_atomic

if TYPE_CHECKING:
    from datasets import Dataset

BATCH_DOCUMENTS = 64  # per encode_batch call: enough for tokenizers' threads, small in memory


class Split(NamedTuple):
    """Row numbers of the train and val documents, each in input order."""

    train: list[int]
    val: list[int]
    duplicates: int  # documents whose text equals an earlier document's


def split_documents(texts: Iterable[str], val_fraction: float, seed: int) -> Split:
    """Choose each document's split from a seeded hash of its text (see data/prepare.py's
    docstring)."""
    keys = np.fromiter((_content_key(text, seed) for text in texts), dtype=np.uint64)
    if len(keys) < 2:
        raise PrepareError(
            f"need at least 2 non-empty documents to split train/val by document, got "
            f"{len(keys)}; each file is one document (with --hub, each row or text file): "
            + cut_into_files("cut one long text", "input.txt")
        )
    # Equal keys stand for equal texts: two different texts share a 64-bit key with
    # probability about n**2 / 2**65, 3e-6 for ten million documents.
    distinct = np.unique(keys)  # sorted
    if len(distinct) < 2:
        raise PrepareError(
            f"all {len(keys)} documents are identical; identical documents share a split, "
            "so train and val need at least 2 different documents"
        )
    # key / 2**64 < val_fraction, exactly: val_fraction * 2**64 only shifts the float's exponent.
    in_val = keys < np.uint64(math.ceil(val_fraction * 2**64))
    if not in_val.any():
        in_val = keys == distinct[0]
    elif in_val.all():
        in_val = keys != distinct[-1]
    train, val = np.flatnonzero(~in_val).tolist(), np.flatnonzero(in_val).tolist()
    return Split(train, val, duplicates=len(keys) - len(distinct))


def cut_into_files(what: str, file: str) -> str:
    """How to make several documents of one text: files of 1000 lines, in a folder of their own."""
    return (
        f"{what} into several first, e.g. `mkdir parts && split -l 1000 {file} parts/part_`, "
        "then --files 'parts/*'"
    )


def _content_key(text: str, seed: int) -> int:
    digest = hashlib.sha256(f"{seed}\0{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


# --- tokenizer and token files ------------------------------------------------------------


def train_tokenizer(train: "Dataset", vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # No prefix space and no normalizer, so decode(encode(s)) == s for any string.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        # All 256 bytes even if the corpus lacks some, so any later text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text_batches(train), trainer, length=len(train))
    if tokenizer.token_to_id(EOT) != EOT_ID:
        raise RuntimeError(f"{EOT} got id {tokenizer.token_to_id(EOT)}, expected {EOT_ID}")
    return tokenizer


def text_batches(documents: "Dataset") -> Iterator[list[str]]:
    for batch in documents.iter(batch_size=BATCH_DOCUMENTS):
        yield batch["text"]


def _write_tokens(tokenizer: Tokenizer, documents: "Dataset", path: Path, split: str) -> dict:
    """Encode documents into `path` as uint16, EOT after each; return the split's counts."""
    # A literal "<|endoftext|>" in the text is then ordinary text: separators are ours alone.
    # The flag is not saved in tokenizer.json.
    tokenizer.encode_special_tokens = True
    n_bytes = n_tokens = 0
    progress = tqdm(total=len(documents), desc=split, unit="doc", file=Droppable(sys.stderr))
    with path.open("wb") as out, progress as bar:
        for texts in text_batches(documents):
            encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
            ids = itertools.chain.from_iterable((*enc.ids, EOT_ID) for enc in encodings)
            array = np.fromiter(ids, dtype=TOKEN_DTYPE)
            out.write(memoryview(array))  # not tofile: its OSError on a full disk has no errno
            n_tokens += len(array)
            n_bytes += sum(len(text.encode("utf-8")) for text in texts)
            bar.update(len(texts))
    return {"documents": len(documents), "bytes": n_bytes, "tokens": n_tokens}


def write_outputs(
    out_dir: Path,
    tokenizer: Tokenizer,
    splits: dict[str, "Dataset"],
    name: str,
    corpus: Corpus,
    content_sha256: str,
    settings: dict[str, Any],
    duplicates: int,
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    temporary = {final: out_dir / f".{final}.{os.getpid()}.tmp" for final in OUTPUT_FILES}
    try:
        # Written by Python, not Tokenizer.save: its errors (a full disk) are plain Exceptions.
        temporary["tokenizer.json"].write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
        counts = {
            split: _write_tokens(tokenizer, documents, temporary[f"{split}.bin"], split)
            for split, documents in splits.items()
        }
        meta = {
            "name": name,
            "source": corpus.source,
            "vocab_size": tokenizer.get_vocab_size(),  # may be below the request on tiny corpora
            "eot_id": EOT_ID,
            "eot_token": EOT,
            "dtype": TOKEN_DTYPE,
            "content_sha256": content_sha256,
            "tokenizer_sha256": file_sha256(temporary["tokenizer.json"]),
            "splits": counts,
            "duplicate_documents": duplicates,  # copies of an earlier document's text
            "skipped": corpus.skipped,
            "replaced_invalid_utf8_bytes": corpus.replaced_bytes,
            "settings": settings,
        }
        # Old meta.json first: if we stop between the renames below, no meta.json claims a
        # mix of old and new files, and the next run rebuilds.
        for path in temporary.values():
            sync(path)
        (out_dir / "meta.json").unlink(missing_ok=True)
        for final, path in temporary.items():
            os.replace(path, out_dir / final)
        write_json_atomic(out_dir / "meta.json", meta)
    finally:
        for path in temporary.values():
            path.unlink(missing_ok=True)
    return meta
