"""Turn a text corpus into the token files train.py reads.

    python data/prepare.py --name NAME
        (--stdlib | --files PATH_OR_GLOB ... | --hub DATASET [--hub-config C] [--split S]
         [--text-column COL])
        [--vocab-size N] [--val-fraction F] [--max-bytes N]
        [--encoding-errors {strict,replace}] [--seed N] [--out-root DIR]

writes <out-root>/NAME/ (out-root defaults to ./data, where train.py's data.root looks):

    train.bin, val.bin  flat raw np.uint16 token ids; every document is followed by <|endoftext|>
    tokenizer.json      byte-level BPE (`tokenizers`) trained on the train split only
    meta.json           what was prepared, from what, and how big; written last

The same thing from Python: `prepare("NAME", files=["corpus/*.txt"]) -> Path`.
`datasets` is imported only inside functions of data/corpus.py (the one module that uses it),
so importing `prepare`/`PrepareError` from here stays cheap.

Decisions, so that a reader need not reverse-engineer them:

* Split by document, never by token, and by content: a document goes to val iff the first 8
  bytes of sha256(f"{seed}\\0{text}") (the text as tokenized), read as a fraction of 2**64,
  are below val_fraction. So identical documents always share a split (val loss is never
  measured on a copy of a training document), and adding, removing or capping documents
  never moves the others; val gets about val_fraction of the distinct texts, not exactly.
  If no document falls in val, the identical documents with the smallest hash go there; if
  all do, those with the largest go to train. Both splits keep input order, and at least two
  different documents are required. meta.json's duplicate_documents counts the documents
  whose text equals an earlier one's (web corpora have many).
* `<|endoftext|>` is the only special token and always has id 0 (EOT_ID): the BPE trainer
  places special tokens before the 256 byte tokens. A literal "<|endoftext|>" inside a
  document is encoded as ordinary text, so the separator only ever comes from us.
* `--stdlib` is every `.py` file under sysconfig's "stdlib" path, sorted by relative path,
  except those below a site-packages/dist-packages (not the stdlib), test/tests (large,
  repetitive fixtures) or idlelib (a GUI app) folder, and the charmap codec tables
  (encodings/cp437.py, koi8_r.py, ...: each a 256-entry decoding_table, near-copies of one
  another, which would put most of a val table's lines in train). Empty files (bare
  __init__.py) and non-UTF-8 files are skipped too; meta.json counts all three, since the
  corpus is fixed and the user cannot fix it. That leaves about 10 MB / 600 files for CPython
  3.11, which prepare in ~6 s on 2 cores, so there is no cap by default.
* `--files`: each file is one document, read once however many patterns match it (said, as
  `--files a.txt a.txt` is one document). An empty file is an error (a glob that picked one
  up is more likely a mistake than intent), and so is non-UTF-8 input, naming the file and
  byte offset;
  `--encoding-errors replace` instead decodes with Python's "replace" handler, which puts
  one U+FFFD for each invalid sequence (one or more bytes), and meta.json counts the
  undecodable bytes. Hub documents that are empty or None are skipped and counted.
* `--hub` on plain-text files (a local folder of .txt, or a Hub repo of them) takes each
  file whole as one document, as --files does; `datasets`' text builder would make each line
  a row, dropping the newlines and splitting a file's lines between train and val. An empty
  file there is skipped and counted, as an empty Hub row is (--files calls it an error).
  `datasets` picks a local folder's files itself (the most common format; where names say a
  split, train_*, test_*, a split's files only; no linked folder): the files it does not
  read for --split are said and listed in meta.json's skipped.unread_files, each with why.
* `--max-bytes N` keeps the longest prefix of whole documents, in input order, that fits in
  N bytes (raw file bytes for --files/--stdlib, UTF-8 bytes for --hub). meta.json's
  skipped.over_max_bytes counts the inputs left unread from the first that did not fit on,
  whatever they hold (an empty one among them is not counted as empty too).
* meta.json bytes are the UTF-8 bytes of the documents as tokenized. Files are read as
  text with universal newlines, so "\\r\\n" and a lone "\\r" both become one "\\n"; a
  compressed file is its own bytes (not unpacked: those are what was checked and hashed).
  Tokens include one <|endoftext|> per document, bytes include nothing for it.
* Reuse: content_sha256 covers the settings (with the output format and `tokenizers`
  versions) and the inputs (--files/--stdlib: relative names and raw bytes; --hub: the text of
  every kept document; a local folder's path is not a setting, so one moved or typed otherwise
  is the same corpus). If meta.json has the same hash and the files it describes are
  whole, nothing is redone. --hub has to load the dataset to hash it; a Hub dataset's
  download is cached in <out-root>/NAME/.hf_cache, a local folder's Arrow copy is temporary
  (in <out-root>/.prepare-*, or the system's temporary folder where the out-root is read-only,
  so a corpus there is still reused). Local files are read twice, to check and hash them, then to
  tokenize them (through an Arrow copy in a temporary <out-root>/.prepare-* folder, not /tmp:
  it is as big as the corpus); a file that changed in between is an error.
* Writing: new files go to temporary names first; the old meta.json is removed before they
  are moved into place and the new one is written last, so an interrupted run never leaves a
  meta.json that describes files it did not finish. Bad input fails before anything is written,
  except --hub's download cache (a wrong --text-column, say, is found after the download,
  which the retry then reuses). A folder with no corpus's meta.json that holds anything but a
  prepare's files and the --files inputs (another tool's train.bin and val.bin; a project's
  own folder) is refused, not written into. One prepare at a time per out-root: a second one
  waits (a lock on the folder; where the filesystem has no locks, none).
"""

import argparse
import collections
import contextlib
import itertools
import os
import shlex
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

if __package__ in (None, ""):  # run as `python data/prepare.py`: make `data.` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from console import StdoutClosed, cli_path, dropping, say, stdout_closed
from data.corpus import (
    Corpus,
    PrepareError,
    files_corpus,
    hub_corpus,
    load_text_files,
    match_files,
    stdlib_corpus,
)
from data.meta import CORPUS_NAME, CORPUS_NAME_RULE, MAX_VOCAB_SIZE, MIN_VOCAB_SIZE
from data.store import (
    OUTPUT_FILES,
    ScratchFolder,
    cannot_write,
    check_out_dir,
    check_writable,
    content_hash,
    is_complete,
    one_at_a_time,
    record_source,
    remove_stale_scratch,
    remove_stale_temporaries,
    say_what_is_replaced,
)
from data.tokens import (
    cut_into_files,
    split_documents,
    text_batches,
    train_tokenizer,
    write_outputs,
)

DEFAULT_VOCAB_SIZE = 2048
DEFAULT_VAL_FRACTION = 0.1
DEFAULT_OUT_ROOT = Path("data")  # relative to the working directory, as data.root is
# Bump when the files written, or how they are derived, change, so old data is rebuilt.
FORMAT_VERSION = 2  # 2: train/val chosen by content hash, meta.json duplicate_documents
HF_CACHE_DIR = ".hf_cache"
LOCAL_HUB = "(a local folder)"  # meta.json settings.hub for one; no Hub name has a space
_stdout_status: int | None = None  # stdout's exit status once a line could not be written


def prepare(
    name: str,
    *,
    stdlib: bool = False,
    files: Sequence[str] | None = None,
    hub: str | None = None,
    hub_config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    out_root: Path | str | None = None,
    max_bytes: int | None = None,
    encoding_errors: str = "strict",
    seed: int = 0,
) -> Path:
    """Prepare one corpus (exactly one of stdlib/files/hub) and return its output folder."""
    if hub is not None:
        hub = os.path.expanduser(hub)  # --hub=~/texts: no shell expands a ~ after '='
    kind = _check_arguments(name, stdlib, files, hub, hub_config, split, text_column)
    _check_settings(vocab_size, val_fraction, max_bytes, encoding_errors, seed, kind)
    out_dir = Path(out_root if out_root is not None else DEFAULT_OUT_ROOT) / name
    inputs = match_files(files) if kind == "files" and files else []
    if len(set(inputs)) == 1 and inputs[0].stat().st_size > 0:  # said before any work
        one = shlex.quote(os.path.relpath(inputs[0]))
        raise PrepareError(
            f"--files matched one file, {one}, and each file is one document: a train/val "
            f"split needs two or more. {cut_into_files('Cut it', one)}"
        )
    # --files may sit in the corpus's folder, as nanoGPT keeps its input.txt
    check_out_dir(out_dir, inputs)
    _say_repeated(inputs)
    settings: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "tokenizers_version": tokenizers.__version__,
        "kind": kind,
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "seed": seed,
        "max_bytes": max_bytes,
    }
    # A local --hub folder's Arrow copy, made to hash it, is removed at the end (cleanup)
    with contextlib.ExitStack() as cleanup:
        # Only settings that can change the output, so unrelated ones never force a rebuild.
        if kind == "stdlib":
            corpus = stdlib_corpus(max_bytes)
        elif kind == "files":
            settings["encoding_errors"] = encoding_errors
            corpus = files_corpus(files or [], encoding_errors, max_bytes)
        else:
            assert hub is not None
            # A local folder is known by its documents, which the digest covers, not by its
            # path: typed otherwise (./d, d/) or moved, it is the same corpus, reused
            where = LOCAL_HUB if Path(hub).exists() else hub
            settings |= {"hub": where, "hub_config": hub_config, "split": split}
            settings["text_column"] = text_column
            hub_cache = Path(cleanup.enter_context(_hub_cache(hub, out_dir)))
            corpus = hub_corpus(hub, hub_config, split, text_column, max_bytes, hub_cache)
            _say_unread(hub, split, corpus.skipped.get("unread_files", []))
        content_sha256 = content_hash(settings, corpus.digest)
        # The out-root, then the reuse check and the writing: one prepare at a time in it.
        try:  # failing as check_out_dir cannot foresee (root ignores permissions; /proc)
            out_dir.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise cannot_write(out_dir, e, "give another --out-root") from None
        with one_at_a_time(out_dir.parent):
            remove_stale_scratch(out_dir.parent)
            # A killed prepare's files (each as big as a split), whether this one reuses or not
            remove_stale_temporaries(out_dir, (*OUTPUT_FILES, "meta.json"))
            if is_complete(out_dir, content_sha256):
                _say(f"reusing {out_dir}: inputs and settings unchanged ({content_sha256[:12]})")
                record_source(out_dir, corpus.source, corpus.skipped)
                return out_dir
            if out_dir.exists():  # not reused: it will be written, before the tokenizer is trained
                check_writable(out_dir, out_dir)
            meta = _build(out_dir, name, corpus, settings, content_sha256)
        counts = meta["splits"]
        short = meta["vocab_size"] < vocab_size  # a small corpus: no pair left to merge
        _say(
            f"prepared {out_dir}: vocab {meta['vocab_size']}"
            + (f" (of {vocab_size} asked: the corpus had no more pairs to merge)" if short else "")
            + ", "
            f"train {counts['train']['documents']} docs / {counts['train']['tokens']} tokens, "
            f"val {counts['val']['documents']} docs / {counts['val']['tokens']} tokens"
        )
        return out_dir


def _say_repeated(matches: list[Path]) -> None:
    """A file that --files matches twice (named twice, or by two globs) is one document, read
    once: said, as `--files a.txt a.txt` would otherwise read as two documents and count one."""
    repeated = [path for path, n in collections.Counter(matches).items() if n > 1]
    if repeated:
        names = ", ".join(os.path.relpath(path) for path in repeated[:3])
        _say(
            f"note: --files matched {len(repeated)} file{'s' * (len(repeated) > 1)} more than "
            f"once ({names}{', ...' if len(repeated) > 3 else ''}); each file is read once, as "
            "one document"
        )


def _say_unread(hub: str, split: str, unread: list[str]) -> None:
    """A local --hub folder's files that `datasets` does not read for the split: said, never
    dropped unseen (meta.json's skipped.unread_files lists them)."""
    if unread:
        names = ", ".join(unread[:3]) + (", ..." if len(unread) > 3 else "")
        _say(
            f"note: --hub {hub!r}: `datasets` does not read {len(unread)} of its files for "
            f"split {split!r}: {names}; it reads one format per folder, and where file names "
            "say a split (train_*, test_*, validation_*), a split's files only; --files reads "
            "files as they are named"
        )


def _say(text: str) -> None:
    """A line of progress on stdout. One that cannot be written (`| head` took its line and
    went, a full disk) does not stop the corpus: it is dropped, and so are the lines after it
    (stdout goes to /dev/null), and main ends with stdout's status."""
    global _stdout_status
    try:
        say(text)
    except StdoutClosed as e:
        _stdout_status = 2  # where even stderr (the same full disk, or gone) cannot say why
        with contextlib.suppress(OSError):
            _stdout_status = stdout_closed(e)


def _build(
    out_dir: Path, name: str, corpus: Corpus, settings: dict[str, Any], content_sha256: str
) -> dict[str, Any]:
    """Split the documents, train the tokenizer on the train side, and write the corpus
    folder (meta.json last); its meta.json. Called holding the out-root's lock."""
    vocab_size = settings["vocab_size"]
    meta_before = _meta_bytes(out_dir)
    # Arrow files for local corpora are only needed while tokenizing. They are as big as the
    # corpus, so they go by the output (not to /tmp, which may be a small tmpfs).
    try:
        scratch = ScratchFolder(out_dir.parent)
    except OSError as e:
        raise cannot_write(out_dir.parent, e, "nothing was changed") from None
    with scratch as cache_dir:
        documents = corpus.documents
        if documents is None:
            try:
                documents = load_text_files(corpus, Path(cache_dir))
            except OSError as e:  # a full disk
                raise cannot_write(Path(cache_dir), e, "nothing was changed") from None
        texts = itertools.chain.from_iterable(text_batches(documents))
        assignment = split_documents(texts, settings["val_fraction"], settings["seed"])
        # Once the documents are known to make a corpus, not before an error about them.
        say_what_is_replaced(out_dir, settings, corpus.digest)
        splits = {
            "train": documents.select(assignment.train),
            "val": documents.select(assignment.val),
        }
        _say(f"training a {vocab_size}-token byte-level BPE on {len(assignment.train)} documents")
        tokenizer = train_tokenizer(splits["train"], vocab_size)
        if tokenizer.get_vocab_size() < vocab_size:
            _say(
                f"note: the tokenizer has {tokenizer.get_vocab_size()} tokens, fewer than "
                f"--vocab-size {vocab_size}: the training documents allow no more merges"
            )
        try:
            return write_outputs(
                out_dir,
                tokenizer,
                splits,
                name,
                corpus,
                content_sha256,
                settings,
                assignment.duplicates,
            )
        except OSError as e:  # a full disk, a folder made read-only meanwhile
            raise cannot_write(out_dir, e, _what_is_left(out_dir, meta_before)) from None


def _meta_bytes(out_dir: Path) -> bytes | None:
    with contextlib.suppress(OSError):
        return (out_dir / "meta.json").read_bytes()
    return None


def _what_is_left(out_dir: Path, meta_before: bytes | None) -> str:
    """After a prepare that stopped part-way, given the meta.json there when it began: meta.json
    is removed just before the renames and the new one written last, so the same one there now
    is the old corpus's, whose files are untouched, and another is the new corpus's, whole."""
    now = _meta_bytes(out_dir)
    if now is None:
        return "no meta.json describes unfinished files, so the next run redoes them"
    if now == meta_before:
        return "the corpus there before is as it was"
    return "the new corpus was written whole (its meta.json is there)"


def _hub_cache(hub: str, out_dir: Path) -> contextlib.AbstractContextManager[str]:
    """Where `datasets` caches what --hub loads. A Hub dataset: <out_dir>/.hf_cache, kept, so a
    rerun (or a retry after a wrong --text-column) downloads nothing. A local folder: a
    temporary folder by the out-root (its Arrow copy is as big as the corpus, and a kept one
    would be stale after each edit of the folder), or in the system's temporary folder where
    the out-root cannot be written, so a corpus there can still be reused."""
    if not Path(hub).exists():
        return contextlib.nullcontext(str(out_dir / HF_CACHE_DIR))
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        return ScratchFolder(out_dir.parent)
    except OSError:
        return tempfile.TemporaryDirectory(prefix="prepare-hub-")


# --- checking arguments -------------------------------------------------------------------


def _check_arguments(
    name: str,
    stdlib: bool,
    files: Sequence[str] | None,
    hub: str | None,
    hub_config: str | None,
    split: str,
    text_column: str,
) -> str:
    """Validate the name and source; return the source kind."""
    if isinstance(files, str):  # a string is a sequence too: of one-character "paths"
        raise PrepareError(f"files={files!r}: give a list of paths or globs, e.g. [{files!r}]")
    if not CORPUS_NAME.fullmatch(name):
        raise PrepareError(f"--name {name!r} must be {CORPUS_NAME_RULE}")
    given = [
        kind
        for kind, on in [("stdlib", stdlib), ("files", files is not None), ("hub", hub is not None)]
        if on
    ]
    if len(given) != 1:
        raise PrepareError(f"give exactly one source of --stdlib, --files, --hub; got {given}")
    if files is not None and not files:
        raise PrepareError("--files needs at least one path or glob")
    if files is not None and "" in files:
        raise PrepareError("--files '': an empty path; give a file, or a glob like 'docs/*.txt'")
    if hub is not None and not hub.strip():
        raise PrepareError(f"--hub {hub!r}: empty; give a Hub dataset's name or a local folder")
    hub_only = {"--hub-config": hub_config is not None, "--split": split != "train"}
    hub_only["--text-column"] = text_column != "text"
    misused = [flag for flag, on in hub_only.items() if on]
    if misused and given != ["hub"]:
        verb = "applies" if len(misused) == 1 else "apply"
        raise PrepareError(f"{', '.join(misused)} only {verb} to --hub")
    return given[0]


def _check_settings(
    vocab_size: int,
    val_fraction: float,
    max_bytes: int | None,
    encoding_errors: str,
    seed: int,
    kind: str,
) -> None:
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise PrepareError(
            f"--vocab-size {vocab_size} must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}]: "
            "256 byte tokens plus <|endoftext|>, and ids stored as uint16"
        )
    if not 0.0 < val_fraction < 1.0:  # also rejects NaN
        raise PrepareError(f"--val-fraction {val_fraction} must be strictly between 0 and 1")
    if max_bytes is not None and max_bytes <= 0:
        raise PrepareError(f"--max-bytes {max_bytes} must be positive")
    if encoding_errors not in ("strict", "replace"):
        raise PrepareError(f"--encoding-errors {encoding_errors!r} must be 'strict' or 'replace'")
    if encoding_errors != "strict" and kind != "files":
        raise PrepareError("--encoding-errors only applies to --files")
    if seed < 0:
        raise PrepareError(f"--seed {seed} must be non-negative")


# --- command line -------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="data/prepare.py",
        allow_abbrev=False,
        description="Corpus -> byte-level BPE -> uint16 token files in <out-root>/NAME/ "
        "(train.bin, val.bin, tokenizer.json, meta.json). How documents are split and chosen: "
        "the docstring of data/prepare.py.",
    )
    parser.add_argument("--name", required=True, help="output folder name under --out-root")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--stdlib", action="store_true", help="this Python's stdlib .py files")
    source.add_argument("--files", nargs="+", metavar="PATH_OR_GLOB", help="one document per file")
    source.add_argument(
        "--hub",
        metavar="DATASET",
        help="a Hub dataset name, or a local folder of data files or one save_to_disk wrote",
    )
    parser.add_argument("--hub-config", help="--hub: dataset configuration name")
    parser.add_argument("--split", default="train", help="--hub: split to load (default train)")
    parser.add_argument("--text-column", default="text", help="--hub: column with the documents")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help=f"BPE vocabulary, <|endoftext|> and the 256 bytes included (default "
        f"{DEFAULT_VOCAB_SIZE}; the run's model.vocab_size must be at least this)",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help=f"about this share of the distinct documents goes to val (default "
        f"{DEFAULT_VAL_FRACTION})",
    )
    parser.add_argument("--max-bytes", type=int, help="keep a prefix of whole documents this big")
    parser.add_argument(
        "--encoding-errors",
        choices=["strict", "replace"],
        default="strict",
        help="--files: fail on non-UTF-8 input, or replace each invalid sequence with U+FFFD",
    )
    parser.add_argument("--seed", type=int, default=0, help="for the train/val document split")
    parser.add_argument(
        "--out-root",
        type=cli_path,
        help=f"default ./{DEFAULT_OUT_ROOT} (the same as data.root)",
    )
    return parser.parse_args(argv)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, a job scheduler), raised as Ctrl-C is: the scratch folder and the
    temporary files are removed on the way out, as they are after Ctrl-C."""


def _terminate(signum: int, frame: object) -> None:
    # Raised once Python runs again: the tokenizer's merges, in Rust, finish first. A second
    # SIGTERM stops at once (what it leaves, the next prepare removes).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> int:
    global _stdout_status
    _stdout_status = None
    args = _parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()  # signals go there
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    out_dir = Path(args.out_root or DEFAULT_OUT_ROOT) / args.name
    meta_before = _meta_bytes(out_dir)
    # A stderr gone (`2>&1 | head`) or full costs its lines (a note, "waiting for another
    # prepare"), not the corpus; stdout's lines decide the status (_say).
    with dropping("stderr"):
        try:
            prepare(
                args.name,
                stdlib=args.stdlib,
                files=args.files,
                hub=args.hub,
                hub_config=args.hub_config,
                split=args.split,
                text_column=args.text_column,
                vocab_size=args.vocab_size,
                val_fraction=args.val_fraction,
                out_root=args.out_root,
                max_bytes=args.max_bytes,
                encoding_errors=args.encoding_errors,
                seed=args.seed,
            )
        except PrepareError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as e:
            # Outputs go to temporary names first and meta.json comes last (see the docstring).
            how = "stopped by SIGTERM" if isinstance(e, _Terminated) else "interrupted"
            print(f"{how}; {_what_is_left(out_dir, meta_before)}", file=sys.stderr)
            return 128 + (signal.SIGTERM if isinstance(e, _Terminated) else signal.SIGINT)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    return _stdout_status or 0  # the corpus is whole; its lines were not all shown


if __name__ == "__main__":
    sys.exit(main())
