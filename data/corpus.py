"""Choosing the documents of a corpus: this Python's stdlib, local files, or a `datasets` dataset.

Each reader checks its input, applies --max-bytes, hashes the content it keeps and returns a
`Corpus`; prepare.py then splits, tokenizes and writes it (through tokens.py). `datasets` is
imported only inside the functions that load through it. The rules (what is skipped, what is an
error) are listed in prepare.py's docstring.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import platform
import re
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset

STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
)
# What every charmap codec table in encodings/ defines (cp437.py, koi8_r.py, ...: made by
# gencodec.py or its kin, or edited from one another): a 256-entry table, data more than code.
CHARMAP_TABLE_MARK = b"\ndecoding_table = ("
_ESCAPED_BYTE_RE = re.compile("[\udc80-\udcff]")  # how surrogateescape spells one bad byte


class PrepareError(ValueError):
    """Bad input or settings; the message names the file, flag or field at fault."""


@dataclass
class Corpus:
    """The documents chosen for preparation, known before any tokenizing."""

    source: dict[str, Any]  # meta.json "source"
    digest: str  # sha256 over the input content
    skipped: dict[str, int | list[str]] = field(default_factory=dict)
    replaced_bytes: int = 0  # undecodable bytes turned into U+FFFD (--encoding-errors replace)
    paths: list[Path] = field(default_factory=list)  # local files, loaded later
    names: list[str] = field(default_factory=list)  # their names in the digest
    documents: Dataset | None = None  # hub rows, already loaded; column "text"


# --- the readers ---------------------------------------------------------------


def _stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's .py files, sorted by relative path (see module docstring)."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    paths = [
        path
        for path in root.rglob("*.py")
        if not STDLIB_EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1])
    ]
    return root, sorted(paths, key=lambda path: path.relative_to(root).as_posix())


def _charmap_table(path: Path, root: Path) -> bool:
    return (
        path.relative_to(root).parts[0] == "encodings" and CHARMAP_TABLE_MARK in path.read_bytes()
    )


def stdlib_corpus(max_bytes: int | None) -> Corpus:
    root, paths = _stdlib_files()
    # ~70 near-copies of one another: split apart, they would put most of each val table's
    # lines in train.
    tables = {path for path in paths if _charmap_table(path, root)}
    paths = [path for path in paths if path not in tables]
    corpus = _read_local(paths, root, skip_bad=True, replace_bad=False, max_bytes=max_bytes)
    corpus.skipped["charmap_codec_tables"] = len(tables)
    corpus.source = {
        "kind": "stdlib",
        "python": platform.python_version(),
        "root": str(root),
        "excluded_dirs": sorted(STDLIB_EXCLUDED_DIRS),
        **corpus.source,
    }
    return corpus


def expand_files(patterns: Sequence[str]) -> list[Path]:
    """Paths and globs -> existing files, in argument order, each glob sorted, no repeats."""
    return list(dict.fromkeys(match_files(patterns)))


def match_files(patterns: Sequence[str]) -> list[Path]:
    """Each pattern's files, resolved, in argument order: a file two patterns match is there
    twice (expand_files keeps the first)."""
    found: list[Path] = []
    for pattern in map(os.path.expanduser, patterns):  # --files=~/t/*.txt: no shell expanded it
        # An existing file is taken literally even if its name holds glob characters.
        if not Path(pattern).is_file() and any(char in pattern for char in "*?["):
            matches = sorted(
                Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()
            )
            if not matches:
                raise PrepareError(f"glob {pattern!r} matched no files")
        else:
            path = Path(pattern)
            if path.is_dir():
                raise PrepareError(
                    f"{pattern!r} is a directory; pass a glob like '{pattern}/*.txt'"
                )
            if path.exists() and not path.is_file():  # a device, a pipe: no corpus to hash
                raise PrepareError(f"{pattern!r} is not a regular file")
            if not path.is_file():
                raise PrepareError(f"file {pattern!r} does not exist")
            matches = [path]
        found.extend(match.resolve() for match in matches)
    return found


def files_corpus(patterns: Sequence[str], encoding_errors: str, max_bytes: int | None) -> Corpus:
    paths = expand_files(patterns)
    # Names are hashed relative to the common folder of the files --max-bytes keeps, so that
    # files it leaves out (added or dropped) cannot change them
    root = Path(os.path.commonpath([path.parent for path in _within_budget(paths, max_bytes)]))
    replace = encoding_errors == "replace"
    corpus = _read_local(paths, root, skip_bad=False, replace_bad=replace, max_bytes=max_bytes)
    corpus.source = {
        "kind": "files",
        # Absolute, so a rebuild runs from anywhere
        "patterns": [os.path.abspath(os.path.expanduser(p)) for p in patterns],
        "root": str(root),
        **corpus.source,
    }
    return corpus


def _within_budget(paths: list[Path], max_bytes: int | None) -> list[Path]:
    """The files that fit --max-bytes by their sizes on disk (the first always: _read_local
    says when it does not fit)."""
    if max_bytes is None:
        return paths
    total = 0
    for count, path in enumerate(paths):
        try:
            total += path.stat().st_size
        except OSError:  # _read_local names the file and the error
            continue
        if count and total > max_bytes:
            return paths[:count]
    return paths


def _read_local(
    paths: list[Path], root: Path, *, skip_bad: bool, replace_bad: bool, max_bytes: int | None
) -> Corpus:
    """Read, check and hash files; keep those that are used (see module docstring)."""
    kept: list[Path] = []
    names: list[str] = []
    content = hashlib.sha256()
    skipped: dict[str, Any] = {"empty_documents": 0, "non_utf8_files": [], "over_max_bytes": 0}
    total = replaced = 0
    for index, path in enumerate(paths):
        try:
            raw = path.read_bytes()
        except OSError as error:
            raise PrepareError(f"cannot read {path}: {error.strerror}") from error
        if not raw:
            if not skip_bad:
                empty = sum(p.stat().st_size == 0 for p in paths)
                others = f" (and {empty - 1} more of the {len(paths)} matched)" if empty > 1 else ""
                raise PrepareError(
                    f"{path} is empty{others}; every input file must hold a document: give "
                    "patterns that leave out empty files (a package's bare __init__.py, say)"
                )
            skipped["empty_documents"] += 1
            continue
        bad = _invalid_utf8(raw)
        if bad is not None and skip_bad:  # skipped: takes none of the --max-bytes budget
            skipped["non_utf8_files"].append(path.relative_to(root).as_posix())
            continue
        if not _fits(max_bytes, total, len(raw), first=not kept, what=str(path)):
            skipped["over_max_bytes"] = len(paths) - index
            break
        if not path.is_relative_to(root):  # it grew or shrank since its size was read
            raise PrepareError(f"{path} changed while it was read; run again")
        name = path.relative_to(root).as_posix()
        if bad is not None:  # a file the budget left out is neither an error nor counted
            offset, count = bad
            if not replace_bad:
                raise PrepareError(
                    f"{path} is not UTF-8 (first bad byte at offset {offset}); "
                    "fix the file or pass --encoding-errors replace"
                )
            replaced += count
        total += len(raw)
        kept.append(path)
        names.append(name)
        _hash_file(content, name, raw)
    if not kept:
        raise PrepareError(f"no usable documents under {root}: skipped {skipped}")
    file_list = "\n".join(names)
    return Corpus(
        source={"files": len(kept), "file_list_sha256": sha256_text(file_list)},
        digest=content.hexdigest(),
        skipped=skipped,
        replaced_bytes=replaced,
        paths=kept,
        names=names,
    )


def _hash_file(content: Any, name: str, raw: bytes) -> None:
    # Length-prefixed so that moving bytes between files changes the hash.
    content.update(f"{name}\0{len(raw)}\0".encode())
    content.update(raw)


def _fits(max_bytes: int | None, total: int, size: int, first: bool, what: str) -> bool:
    """Whether a document of `size` bytes fits the --max-bytes budget after `total` bytes.

    The first document must fit: a budget that admits nothing is an error, not an empty corpus.
    """
    if max_bytes is None or total + size <= max_bytes:
        return True
    if first:
        raise PrepareError(
            f"--max-bytes {max_bytes} is smaller than the first document, {what} ({size} bytes)"
        )
    return False


def _invalid_utf8(raw: bytes) -> tuple[int, int] | None:
    """(offset of the first undecodable byte, how many there are), or None for valid UTF-8."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        escaped = raw.decode("utf-8", errors="surrogateescape")
        return error.start, len(_ESCAPED_BYTE_RE.findall(escaped))
    return None


def hub_corpus(
    dataset: str,
    config: str | None,
    split: str,
    text_column: str,
    max_bytes: int | None,
    cache_dir: Path,
) -> Corpus:
    rows, unread = _load_hub(dataset, config, split, text_column, cache_dir)
    keep: list[int] = []
    content = hashlib.sha256()
    skipped = {"empty_documents": 0, "over_max_bytes": 0}
    total = 0
    for index, text in enumerate(_iter_texts(rows, text_column)):
        if not text:
            skipped["empty_documents"] += 1
            continue
        raw = text.encode("utf-8")
        if not _fits(max_bytes, total, len(raw), first=not keep, what=f"row {index}"):
            skipped["over_max_bytes"] = len(rows) - index
            break
        total += len(raw)
        keep.append(index)
        content.update(f"{len(raw)}\0".encode())
        content.update(raw)
    if not keep:
        raise PrepareError(
            f"--hub {dataset!r} split {split!r} has no non-empty documents "
            f"in --text-column {text_column!r}"
        )
    documents = rows.select(keep)
    if text_column != "text":
        documents = documents.rename_column(text_column, "text")
    where = os.path.abspath(dataset) if Path(dataset).exists() else dataset  # a local folder
    source = {"kind": "hub", "dataset": where, "config": config, "split": split}
    source |= {"text_column": text_column, "rows": len(rows)}
    if unread:
        skipped["unread_files"] = unread
    return Corpus(source=source, digest=content.hexdigest(), skipped=skipped, documents=documents)


def _iter_texts(rows: Dataset, column: str) -> Iterator[str | None]:
    for batch in rows.iter(batch_size=1024):
        yield from batch[column]


# --- loading through `datasets` -----------------------------------------------------------


def _import_datasets() -> Any:
    """Import `datasets` quietly: no telemetry, progress bars, 'Generating split' logs, or the
    Hub client's 'Repo card metadata block was not found' for a folder's plain README.md."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # a dependency of datasets
    return datasets


def load_text_files(corpus: Corpus, cache_dir: Path) -> Dataset:
    """One row per file of a local corpus, column "text": the file's bytes decoded as open()
    reads text (universal newlines), streamed to an Arrow file in cache_dir. Not the `text`
    builder: it decompresses what looks compressed (.gz, .zip, or by content), so the
    documents would not be the bytes that were checked and hashed.

    Each file is read once more here; a file that changed since it was checked and hashed
    is an error (the digest would not describe the tokens). An OSError writing the Arrow
    file (a full disk) is raised as itself."""
    datasets = _import_datasets()
    content = hashlib.sha256()

    def rows() -> Iterator[dict[str, str]]:
        for path, name in zip(corpus.paths, corpus.names, strict=True):
            try:
                raw = path.read_bytes()
            except OSError as error:  # not one writing the copy
                raise PrepareError(f"cannot read {path}: {error.strerror}") from error
            _hash_file(content, name, raw)
            # "replace" changes nothing in a file checked as UTF-8, and a file that is no
            # longer UTF-8 has changed, which the digest below finds.
            text = raw.decode("utf-8", errors="replace")
            yield {"text": text.replace("\r\n", "\n").replace("\r", "\n")}

    features = datasets.Features({"text": datasets.Value("string")})
    try:
        # One file in memory at a time (by default `datasets` holds 1000 before writing them).
        documents = datasets.Dataset.from_generator(
            rows,
            features=features,
            cache_dir=str(cache_dir),
            writer_batch_size=1,
            fingerprint=corpus.digest,  # not a hash of `rows` (a closure over a hash object)
        )
    except datasets.exceptions.DatasetGenerationError as error:  # wraps what rows() raised
        if isinstance(error.__cause__, (PrepareError, OSError)):
            raise error.__cause__ from None
        raise
    if content.hexdigest() != corpus.digest:
        raise PrepareError(
            f"input files under {corpus.source['root']} changed while they were prepared; run again"
        )
    return documents


def _load_hub(
    dataset: str, config: str | None, split: str, text_column: str, cache_dir: Path
) -> tuple[Dataset, list[str]]:
    """The split's rows, only the text column, and a local folder's files that `datasets`
    does not read for it (see _unread_files)."""
    _check_local(dataset)
    datasets = _import_datasets()
    unread: list[str] = []
    try:
        if _saved_to_disk(Path(dataset)):  # load_dataset refuses these and names load_from_disk
            if config is not None:
                raise ValueError("a folder save_to_disk wrote has no configurations (--hub-config)")
            rows = _split_of(datasets.load_from_disk(dataset), split)
        else:
            rows, data_files = _load_dataset(datasets, dataset, config, split, str(cache_dir))
            unread = _unread_files(Path(dataset), data_files, split)
    except PrepareError:
        raise
    # The Hub client, fsspec and the builders raise many types; to the user all of them mean
    # "could not load", and the chained cause keeps the detail.
    except Exception as error:
        raise PrepareError(f"--hub {dataset!r}: cannot load split {split!r}: {error}") from error
    if text_column not in rows.column_names:
        raise PrepareError(
            f"--text-column {text_column!r} is not a column of {dataset!r}; "
            f"columns: {rows.column_names}"
        )
    feature = rows.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise PrepareError(
            f"--text-column {text_column!r} of {dataset!r} holds {feature}, not strings"
        )
    return rows.select_columns([text_column]), unread


def _unread_files(folder: Path, data_files: Any, split: str) -> list[str]:
    """The files of a local folder that `datasets` does not read for `split`, by relative
    name, each with why: it reads one format per folder (the most common one), and where any
    file's name says a split (train_*, test*, valid*, ...), a split's files only. The dataset
    card (README.md) and what `datasets` skips itself (names starting with . or __) are not
    counted. A linked folder is named once: neither `datasets` nor rglob goes into one."""
    if not folder.is_dir():
        return []  # a Hub dataset
    in_split = {
        Path(name).resolve(): str(named)
        for named, names in (data_files or {}).items()
        for name in names
    }
    unread = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        skipped = any(part.startswith((".", "__")) for part in relative.parts)
        card = len(relative.parts) == 1 and relative.name.lower() == "readme.md"
        if skipped or card:
            continue
        if path.is_symlink() and path.is_dir():
            unread.append(f"{relative.as_posix()}/ (a linked folder)")
            continue
        if not path.is_file():
            continue
        named = in_split.get(path.resolve())
        if named is None:
            unread.append(f"{relative.as_posix()} (in no split)")
        elif named != split:
            unread.append(f"{relative.as_posix()} (split {named})")
    return unread


def _check_local(dataset: str) -> None:
    """A file, or a local folder that is not there, is an error here, before `datasets`
    takes it for a Hub name (and retries the network for half a minute)."""
    path = Path(dataset).expanduser()
    if path.is_file():
        raise PrepareError(
            f"--hub {dataset!r} is a file; --hub takes a folder of data files, one "
            "save_to_disk wrote, or a Hub dataset name (text files: --files)"
        )
    if path.exists():
        return
    # A Hub name is NAME or OWNER/NAME: more parts, or a leading /, . or ~, make a path, and
    # OWNER/NAME whose OWNER is a folder here is most likely a mistyped one.
    if dataset.startswith(("/", ".", "~")) or dataset.count("/") > 1:
        raise PrepareError(f"--hub {dataset!r}: no such folder")
    if path.parent != Path(".") and path.parent.is_dir():
        raise PrepareError(
            f"--hub {dataset!r}: no such folder in {path.parent}/ (for a Hub dataset of "
            "that name, run from another folder)"
        )


def _load_dataset(
    datasets: Any, dataset: str, config: str | None, split: str, cache_dir: str
) -> tuple[Dataset, Any]:
    """`load_dataset`, except that plain-text files are one document per file, as --files
    reads them. `datasets`' text builder defaults to one row per line, which would drop the
    newlines and split a file between train and val line by line. Also returns the data
    files of every split, as the builder chose them."""
    builder = datasets.load_dataset_builder(dataset, config, cache_dir=cache_dir)
    if builder.name != "text":
        builder.download_and_prepare()
        return builder.as_dataset(split=split), builder.config.data_files
    builder = datasets.load_dataset_builder(
        dataset, config, cache_dir=cache_dir, sample_by="document"
    )
    try:
        builder.download_and_prepare()
    except Exception as error:
        _name_the_non_utf8_file(error, dataset, builder.config.data_files)
        raise
    return builder.as_dataset(split=split), builder.config.data_files


def _name_the_non_utf8_file(error: BaseException, dataset: str, data_files: Any) -> None:
    """Raise a PrepareError naming the local text file (and byte) that stopped the text
    builder, as --files would, if `error` came from one that is not UTF-8."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, UnicodeDecodeError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return
    for path in (Path(name) for files in (data_files or {}).values() for name in files):
        bad = _invalid_utf8(path.read_bytes()) if path.is_file() else None
        if bad is not None:
            raise PrepareError(
                f"{path} is not UTF-8 (first bad byte at offset {bad[0]}); fix the file, or "
                f"prepare the folder with --files '{dataset}/**/*.txt' --encoding-errors replace"
            ) from error
    raise PrepareError(f"a text file of the dataset is not UTF-8: {cause}") from error


def _saved_to_disk(path: Path) -> bool:
    """A folder `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` wrote."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _split_of(saved: Any, split: str) -> Dataset:
    """The split of a saved DatasetDict; a saved Dataset is one split already, taken whole
    (under the default split name, so that no other split is read as this one)."""
    if not hasattr(saved, "keys"):
        if split != "train":
            raise ValueError("the folder holds one Dataset, not splits: leave --split out")
        return saved
    if split not in saved:
        raise ValueError(f"the saved DatasetDict has splits {list(saved)}, not {split!r}")
    return saved[split]


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
