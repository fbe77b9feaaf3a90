"""Token shards: --data tokenised once, in one streaming pass, into memory-mapped id files.

`build_token_shards` reads the source in bounded pieces (a file's characters, a .jsonl's lines),
tokenises them in batches and appends the ids to fixed-size `.bin` shards of uint16 or uint32.
Its ids are exactly those of `text.tokenize(tokenizer, text.read_texts(path), max_tokens)`:
documents joined by the EOS token, no BOS, long documents cut into the same pieces (at a line
end, each piece starting where the last one was cut).

Layout under the caller's root, one entry per (source content, tokenizer) key:

    <key>/              a finished build: manifest.json and shard-00000.bin, shard-00001.bin, ...
    <key>.partial/      a build under way: its finished shards and progress.json
    <key>.lock          held by the one process building that key

Each shard is written through `atomic_file` and recorded in progress.json only once whole,
together with the source position after its last token, so a killed build resumes from its
last finished shard. The finished directory appears through `atomic_output_dir` only when the
build is done, so a reader never sees a torn one. A build cut at `max_tokens` is extended by a
later call that asks for more.

`TokenShards` maps the shards read-only and reads blocks of `seq_len` tokens from them, keeping
a few shards mapped at a time, so memory stays bounded by a shard whatever the corpus size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from mlxkit.engines.core.atomic import atomic_file, atomic_output_dir, atomic_write_json
from mlxkit.engines.core.manifest import content_hash
from mlxkit.engines.core.paths import cache_dir
from mlxkit.engines.data.text import (PIECE_CHARS, check_data_path, not_utf8_error, parse_jsonl_line,
                                      text_files)
from mlxkit.engines.errors import InputError

__all__ = ["DEFAULT_SHARD_TOKENS", "ShardManifest", "TokenShards", "build_token_shards", "default_shard_root",
           "repeat_factor", "repeat_message", "token_dtype", "tokenizer_identity"]

FORMAT = "mlxkit-token-shards/1"
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
# 32 Mi tokens: 64 MiB of uint16 per shard; 45B tokens make about 1,300 shards.
DEFAULT_SHARD_TOKENS = 1 << 25
# Characters handed to one batch call. The tokenizer's own working memory is a few hundred
# bytes per token, so this, not the shard size, sets the build's peak memory.
DEFAULT_BATCH_CHARS = 1 << 20
_MAPPED_SHARDS = 4


def default_shard_root() -> Path:
    """Where token shards go when the caller names no root: `$MLXKIT_CACHE/token-shards`."""
    return cache_dir() / "token-shards"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a `vocab_size` vocabulary fits (ids 0..65535), else uint32."""
    if vocab_size < 1:
        raise InputError(f"vocabulary size must be positive (got {vocab_size})")
    if vocab_size > 1 << 32:
        raise InputError(f"vocabulary size {vocab_size:,} does not fit uint32 token ids")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def tokenizer_identity(tokenizer) -> dict[str, Any]:
    """What decides the ids: a hash of the full tokenizer definition, its size and its EOS separator.

    Padding and truncation settings are left out of the hash: transformers changes them on the
    backend per call, and they do not change the ids of an unpadded, untruncated call.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        definition.pop("padding", None)
        definition.pop("truncation", None)
        kind = "tokenizer.json"
    else:  # a slow tokenizer: its vocabulary is the best available fingerprint
        definition = sorted(tokenizer.get_vocab().items())
        kind = "vocab"
    digest = hashlib.sha256(json.dumps(definition, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return {"hash": f"sha256:{digest}", "hashed": kind, "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id, "name_or_path": str(getattr(tokenizer, "name_or_path", ""))}


def repeat_factor(distinct_tokens: int, budget: int) -> float:
    """How many times training reads each distinct token: `budget / distinct_tokens` (< 1: some are unread)."""
    if distinct_tokens < 1:
        raise InputError(f"there are no training tokens to spend a budget of {budget:,} on")
    if budget < 0:
        raise InputError(f"a token budget must not be negative (got {budget:,})")
    return budget / distinct_tokens


def repeat_message(distinct_tokens: int, budget: int) -> str:
    """One line on how often the training tokens repeat over the token budget."""
    factor = repeat_factor(distinct_tokens, budget)
    if factor > 1:
        return f"the {distinct_tokens:,} training tokens repeat {factor:.1f} times over the {budget:,}-token budget"
    return (f"the {budget:,}-token budget reads {factor:.0%} of the {distinct_tokens:,} training tokens "
            "once (none repeats)")


# ----------------------------------------------------------------------------------------- schema
@dataclass(frozen=True)
class _Cursor:
    """A position in the token stream that a build can restart from without reading what precedes it.

    `doc`: the file's index (a .txt file or a directory's files) or, for .jsonl, the byte offset
    of the physical line; `line`: the .jsonl line number before that physical line, `part`: the
    line within it (str.splitlines splits at more than newlines); `kept`: documents already
    streamed (every kept document but the first is preceded by the EOS separator); `char`: the
    piece's first character in its document; `skip`: tokens of that piece, separator included,
    already written.
    """

    doc: int = 0
    line: int = 0
    part: int = 0
    kept: int = 0
    char: int = 0
    skip: int = 0

    def same_piece(self, other: _Cursor) -> bool:
        return dataclasses.replace(self, skip=0) == dataclasses.replace(other, skip=0)


@dataclass
class ShardEntry:
    """One shard file: its token count, sha256, and the stream position after its last token."""

    file: str
    tokens: int
    sha256: str
    end: _Cursor


@dataclass
class ShardManifest:
    """The manifest.json of a token-shard directory (progress.json while the build is under way)."""

    key: str
    source: dict[str, Any]
    tokenizer: dict[str, Any]
    dtype: str
    piece_chars: int
    shards: list[ShardEntry] = field(default_factory=list)
    complete: bool = False  # the whole source is in the shards, not only a max_tokens prefix

    @property
    def total_tokens(self) -> int:
        return sum(entry.tokens for entry in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "key": self.key, "source": self.source, "tokenizer": self.tokenizer,
                "dtype": self.dtype, "piece_chars": self.piece_chars, "complete": self.complete,
                "total_tokens": self.total_tokens,
                "shards": [{"file": e.file, "tokens": e.tokens, "sha256": e.sha256, "end": dataclasses.asdict(e.end)}
                           for e in self.shards]}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: Path) -> ShardManifest:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputError(f"'{where}' is not a token-shard manifest ({FORMAT})")
        try:
            shards = [ShardEntry(str(e["file"]), int(e["tokens"]), str(e["sha256"]), _Cursor(**e["end"]))
                      for e in data["shards"]]
            manifest = cls(str(data["key"]), dict(data["source"]), dict(data["tokenizer"]), str(data["dtype"]),
                           int(data["piece_chars"]), shards, bool(data["complete"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"token-shard manifest '{where}' is malformed ({exc})") from None
        if manifest.dtype not in ("uint16", "uint32"):
            raise InputError(f"token-shard manifest '{where}' names an unknown dtype '{manifest.dtype}'")
        return manifest

    @classmethod
    def read(cls, path: Path) -> ShardManifest:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"cannot read token-shard manifest '{path}' ({exc})") from None
        return cls.from_dict(data, path)


# ------------------------------------------------------------------------------------------ reader
class TokenShards:
    """The ids of a token-shard directory, memory-mapped; blocks of `seq_len` tokens as LongTensors.

    Block `i` of `seq_len` is tokens `[i * seq_len, (i + 1) * seq_len)`, so the blocks equal
    `text.pack(ids, seq_len)` (the ragged tail is dropped). `limit` keeps only the first `limit`
    tokens, as `text.tokenize`'s `max_tokens` does. A rank's view (`for_rank`) numbers only its own
    blocks and reads nothing else; only the shards it touches are mapped, a few at a time.
    """

    def __init__(self, path: str | os.PathLike, *, limit: int | None = None):
        self.path = Path(path)
        self.manifest = ShardManifest.read(self.path / MANIFEST)
        self.dtype = np.dtype(self.manifest.dtype)
        counts = [entry.tokens for entry in self.manifest.shards]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        for entry in self.manifest.shards:
            file = self.path / entry.file
            expected = entry.tokens * self.dtype.itemsize
            size = file.stat().st_size if file.is_file() else None
            if size != expected:
                raise InputError(f"token shard '{file}' holds {size} bytes, its manifest says {expected} "
                                 "(delete the directory to rebuild it)")
        total = int(self._starts[-1])
        if limit is not None and limit < 0:
            raise InputError(f"a token limit must not be negative (got {limit})")
        self._tokens = total if limit is None else min(total, limit)
        self.rank, self.world = 0, 1
        self._mapped: OrderedDict[int, np.memmap] = OrderedDict()

    def __len__(self) -> int:
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:  # data-loader workers map their own copies
        state = self.__dict__.copy()
        state["_mapped"] = OrderedDict()
        return state

    def for_rank(self, rank: int, world: int) -> TokenShards:
        """Rank `rank`'s share of `world`: its block j is global block `j * world + rank`.

        Every rank gets the same number of blocks, `num_blocks(seq_len) // world` of the whole, so
        ranks step in lockstep; the at most `world - 1` blocks left over are read by no rank.
        """
        if self.world != 1:
            raise InputError("for_rank takes the whole corpus, not a rank's share")
        if world < 1 or not 0 <= rank < world:
            raise InputError(f"rank {rank} is not in a world of {world}")
        view = TokenShards.__new__(TokenShards)
        view.__dict__.update(self.__getstate__())
        view.rank, view.world = rank, world
        return view

    def num_blocks(self, seq_len: int) -> int:
        """Whole blocks of `seq_len` tokens in this view."""
        _check_seq_len(seq_len)
        return (self._tokens // seq_len) // self.world

    def block(self, index: int, seq_len: int) -> torch.Tensor:
        """Block `index` of this view: `[seq_len]` token ids."""
        return self.blocks([index], seq_len)[0]

    def blocks(self, indices: Iterable[int] | torch.Tensor, seq_len: int) -> torch.Tensor:
        """Blocks `indices` of this view: `[len(indices), seq_len]` token ids."""
        n = self.num_blocks(seq_len)
        rows = [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
        out = np.empty((len(rows), seq_len), dtype=np.int64)
        for row, index in enumerate(rows):
            if not 0 <= index < n:
                raise IndexError(f"block {index} of {seq_len} tokens is out of range ({n} blocks)")
            start = (index * self.world + self.rank) * seq_len
            out[row] = self._read(start, start + seq_len)
        return torch.from_numpy(out)

    def span(self, start: int, stop: int) -> torch.Tensor:
        """Tokens `[start, stop)` of the whole corpus (whatever the view) as a flat LongTensor."""
        if not 0 <= start <= stop <= self._tokens:
            raise IndexError(f"tokens [{start}, {stop}) are out of range ({self._tokens} tokens)")
        return torch.from_numpy(self._read(start, stop).astype(np.int64))

    def verify(self) -> None:
        """Re-hash every shard against the manifest (reads the whole corpus once, a shard at a time)."""
        for entry in self.manifest.shards:
            if _file_sha256(self.path / entry.file) != entry.sha256:
                raise InputError(f"token shard '{self.path / entry.file}' does not match its manifest hash "
                                 "(delete the directory to rebuild it)")

    def _read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=self.dtype)
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        at = start
        while at < stop:
            first, last = int(self._starts[shard]), int(self._starts[shard + 1])
            take = min(stop, last) - at
            out[at - start: at - start + take] = self._map(shard)[at - first: at - first + take]
            at += take
            shard += 1
        return out

    def _map(self, shard: int) -> np.memmap:
        mapped = self._mapped.get(shard)
        if mapped is None:
            entry = self.manifest.shards[shard]
            mapped = np.memmap(self.path / entry.file, dtype=self.dtype, mode="r", shape=(entry.tokens,))
            self._mapped[shard] = mapped
            while len(self._mapped) > _MAPPED_SHARDS:  # unmapping lets the kernel drop the pages from RSS
                self._mapped.popitem(last=False)
        else:
            self._mapped.move_to_end(shard)
        return mapped


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 2:
        raise InputError(f"sequence length must be at least 2 (got {seq_len})")


# ------------------------------------------------------------------------------------------- build
def build_token_shards(source: str | os.PathLike, tokenizer, root: str | os.PathLike, *, text_field: str = "text",
                       max_tokens: int | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                       piece_chars: int = PIECE_CHARS, batch_chars: int = DEFAULT_BATCH_CHARS,
                       notice: Callable[[str], None] | None = None) -> TokenShards:
    """Tokenise `source` (a .txt, a .jsonl or a directory of .txt) into shards under `root`, once.

    Returns the shards of the first `max_tokens` ids (all of them when None): the ids
    `text.tokenize(tokenizer, text.read_texts(source, text_field), max_tokens)` gives. A later
    call with the same source content and tokenizer reuses them; one that asks for more tokens
    than a cut build holds extends it. Call it from one process (rank 0) and let the others open
    the returned `path` after a barrier; concurrent builders of one key wait for each other.

    `piece_chars` other than `text.PIECE_CHARS` moves the cuts inside long documents and so may
    change the ids next to a cut; `shard_tokens` and `batch_chars` change only file sizes and memory.

    A finished build is re-hashed before it is reused: one whose manifest or shards were damaged
    since is removed and tokenised again, and `notice` (when given) is told why.
    """
    path = check_data_path(source)
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"max_tokens must be at least 1 (got {max_tokens})")
    for name, value in (("shard_tokens", shard_tokens), ("piece_chars", piece_chars), ("batch_chars", batch_chars)):
        if value < 1:
            raise InputError(f"{name} must be at least 1 (got {value})")
    identity = tokenizer_identity(tokenizer)
    dtype = token_dtype(identity["vocab_size"])
    source_info = {"path": str(path.resolve()), "hash": content_hash(path, chunk=1 << 20),
                   "text_field": text_field if path.suffix == ".jsonl" and path.is_file() else None}
    key = hashlib.sha256(json.dumps({"format": FORMAT, "source": source_info["hash"],
                                     "text_field": source_info["text_field"], "tokenizer": identity["hash"],
                                     "vocab_size": identity["vocab_size"], "eos": identity["eos_token_id"],
                                     "piece_chars": piece_chars}, sort_keys=True).encode()).hexdigest()[:20]
    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    final, partial = root / key, root / f"{key}.partial"
    with _locked(root / f"{key}.lock"):
        done = _intact(final, notice)
        if done is not None and (done.complete or (max_tokens is not None and done.total_tokens >= max_tokens)):
            return TokenShards(final, limit=max_tokens)
        fresh = ShardManifest(key, source_info, identity, dtype.name, piece_chars)
        progress = _resume_point(partial, fresh, dtype)
        if done is not None and (progress is None or progress.total_tokens < done.total_tokens):
            progress = _seed_from(final, done, partial)
        if progress is None:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            progress = fresh
        progress.source = source_info  # the content is the same; the path may have moved
        _extend(progress, partial, path, tokenizer, text_field, max_tokens, shard_tokens, batch_chars, dtype)
        with atomic_output_dir(final, overwrite=True) as tmp:
            for entry in progress.shards:
                _link_or_copy(partial / entry.file, tmp / entry.file)
            atomic_write_json(tmp / MANIFEST, progress.to_dict())
        shutil.rmtree(partial, ignore_errors=True)
    return TokenShards(final, limit=max_tokens)


def _intact(final: Path, notice: Callable[[str], None] | None) -> ShardManifest | None:
    """The manifest of the finished build at `final` when it and every shard hash check; otherwise None,
    with a damaged build removed (it is derived data, made again from the source)."""
    if not final.exists():
        return None
    try:
        TokenShards(final).verify()
        return ShardManifest.read(final / MANIFEST)
    except (InputError, OSError, ValueError) as exc:
        if notice is not None:
            notice(f"the cached token shards at {final} are damaged ({str(exc).splitlines()[0][:160]}); "
                   "tokenising the data again")
        shutil.rmtree(final, ignore_errors=True)
        return None


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _resume_point(partial: Path, fresh: ShardManifest, dtype: np.dtype) -> ShardManifest | None:
    """A killed build's progress, kept up to its last whole shard; None when there is none to resume."""
    if not (partial / PROGRESS).is_file():
        return None
    try:
        progress = ShardManifest.read(partial / PROGRESS)
    except InputError:
        return None
    if progress.key != fresh.key or progress.dtype != fresh.dtype:
        return None
    whole = []
    for entry in progress.shards:
        file = partial / entry.file
        if not file.is_file() or file.stat().st_size != entry.tokens * dtype.itemsize:
            break
        whole.append(entry)
    progress.shards = whole
    return progress


def _seed_from(final: Path, done: ShardManifest, partial: Path) -> ShardManifest:
    """Start extending a build cut at max_tokens from its published shards (linked, not copied)."""
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    for entry in done.shards:
        _link_or_copy(final / entry.file, partial / entry.file)
    atomic_write_json(partial / PROGRESS, done.to_dict())
    return done


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copyfile(src, dst)


def _extend(progress: ShardManifest, partial: Path, path: Path, tokenizer, text_field: str,
            max_tokens: int | None, shard_tokens: int, batch_chars: int, dtype: np.dtype) -> None:
    """Append shards to `progress` until `max_tokens` tokens exist or the source ends."""
    total = progress.total_tokens
    if progress.complete or (max_tokens is not None and total >= max_tokens):
        return
    resume = progress.shards[-1].end if progress.shards else None
    units = _token_units(path, tokenizer, text_field, progress.piece_chars, batch_chars, resume, dtype)
    pending = next(units, None)
    while pending is not None and (max_tokens is None or total < max_tokens):
        name = f"shard-{len(progress.shards):05d}.bin"
        capacity = shard_tokens if max_tokens is None else min(shard_tokens, max_tokens - total)
        count, digest = 0, hashlib.sha256()
        with atomic_file(partial / name) as tmp, open(tmp, "wb") as out:
            while pending is not None and count < capacity:
                ids, cursor = pending
                take = min(len(ids), capacity - count)
                chunk = ids[:take].tobytes()
                out.write(chunk)
                digest.update(chunk)
                count += take
                end = dataclasses.replace(cursor, skip=cursor.skip + take)
                pending = (ids[take:], end) if take < len(ids) else next(units, None)
        total += count
        progress.shards.append(ShardEntry(name, count, f"sha256:{digest.hexdigest()}", end))
        progress.complete = pending is None
        atomic_write_json(partial / PROGRESS, progress.to_dict())
    if pending is None:
        progress.complete = True


def _token_units(path: Path, tokenizer, text_field: str, piece_chars: int, batch_chars: int,
                 resume: _Cursor | None, dtype: np.dtype) -> Iterator[tuple[np.ndarray, _Cursor]]:
    """(ids, cursor) per piece from the start or `resume` on, the EOS separator before each document but the first."""
    eos = tokenizer.eos_token_id
    pieces = _pieces(path, text_field, piece_chars, resume or _Cursor())
    first = resume is not None
    for batch in _batches(pieces, batch_chars):
        encoded = _encode_batch(tokenizer, [piece for _, piece in batch])
        for k, (cursor, _) in enumerate(batch):
            # Python ints take ~36 bytes a token: let go of each list as soon as it is an array.
            ids, encoded[k] = encoded[k], None
            separated = cursor.char == 0 and cursor.kept > 0 and eos is not None
            array = np.empty(len(ids) + separated, dtype=dtype)
            try:
                if separated:
                    array[0] = eos
                array[int(separated):] = ids
            except OverflowError:
                raise InputError(f"the tokenizer gave an id beyond its {dtype.name} vocabulary of "
                                 f"{len(tokenizer):,}") from None
            del ids
            if first:  # the build restarts inside this piece: its first `skip` tokens are written
                if not cursor.same_piece(resume):
                    raise InputError(f"'{path}' changed while it was tokenised (the restart point moved)")
                array, cursor = array[resume.skip:], resume
                first = False
            if len(array):
                yield array, cursor
        del encoded, batch


def _encode_batch(tokenizer, pieces: list[str]) -> list[list[int]]:
    """Ids of each piece without special tokens, as `tokenizer(piece, add_special_tokens=False)` gives them.

    The backend's offset-free batch call is about twice as fast; it is used only while the
    backend has no padding, truncation or special-token splitting set, the state the plain call
    resets it to.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and hasattr(backend, "encode_batch_fast") and backend.padding is None
            and backend.truncation is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))):
        return [encoding.ids for encoding in backend.encode_batch_fast(pieces, add_special_tokens=False)]
    return tokenizer(pieces, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def _batches(pieces: Iterator[tuple[_Cursor, str]], batch_chars: int) -> Iterator[list[tuple[_Cursor, str]]]:
    """Consecutive pieces, at most `batch_chars` characters a batch (a longer piece goes alone)."""
    batch: list[tuple[_Cursor, str]] = []
    chars = 0
    for item in pieces:
        if batch and chars + len(item[1]) > batch_chars:
            yield batch
            batch, chars = [], 0
        batch.append(item)
        chars += len(item[1])
    if batch:
        yield batch


# -------------------------------------------------------------------------------------- text stream
def _pieces(path: Path, text_field: str, piece_chars: int, start: _Cursor) -> Iterator[tuple[_Cursor, str]]:
    """(cursor, piece) over the documents of `path` from `start` on; whitespace-only documents are skipped."""
    if path.is_file() and path.suffix == ".jsonl":
        yield from _jsonl_pieces(path, text_field, piece_chars, start)
        return
    files = text_files(path) if path.is_dir() else [path]
    kept = start.kept
    for index in range(start.doc, len(files)):
        offset = start.char if index == start.doc else 0
        if offset == 0 and not _holds_text(files[index]):
            continue
        for char, piece in _file_pieces(files[index], offset, piece_chars):
            yield _Cursor(doc=index, kept=kept, char=char), piece
        kept += 1
    if kept == 0:
        raise InputError(f"data '{path}' holds no text")


def _jsonl_pieces(path: Path, text_field: str, piece_chars: int, start: _Cursor) -> Iterator[tuple[_Cursor, str]]:
    # Lines are split on b"\n" and then by str.splitlines, which together split where
    # `read_jsonl_records` (splitlines of the whole decoded file) does.
    kept, offset, number = start.kept, start.doc, start.line
    with open(path, "rb") as handle:
        handle.seek(offset)
        for raw in handle:
            try:
                physical = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise not_utf8_error(path, exc.reason, offset + exc.start) from None
            line_number = number
            for part, line in enumerate(physical.splitlines()):
                number += 1
                if offset == start.doc and part < start.part:
                    continue
                record = parse_jsonl_line(path, number, line, text_field)
                if record is None:
                    continue
                text = str(record[text_field])
                if not text.strip():
                    continue
                resumed = offset == start.doc and part == start.part
                here = _Cursor(doc=offset, line=line_number, part=part, kept=kept)
                for char, piece in _stream_pieces(io.StringIO(text), start.char if resumed else 0, piece_chars):
                    yield dataclasses.replace(here, char=char), piece
                kept += 1
            offset += len(raw)
    if kept == 0:
        raise InputError(f"data '{path}' holds no text")


def _holds_text(file: Path) -> bool:
    """Whether a file has a non-whitespace character (read until the first one, usually one chunk)."""
    with _utf8_errors(file), open(file, encoding="utf-8") as handle:
        while chunk := handle.read(1 << 16):
            if chunk.strip():
                return True
    return False


def _file_pieces(file: Path, offset: int, piece_chars: int) -> Iterator[tuple[int, str]]:
    # Text mode translates \r\n and \r to \n, as Path.read_text does for read_texts.
    with _utf8_errors(file), open(file, encoding="utf-8") as handle:
        yield from _stream_pieces(handle, offset, piece_chars)


def _stream_pieces(handle: io.TextIOBase, offset: int, piece_chars: int) -> Iterator[tuple[int, str]]:
    """(first character, piece) of a character stream from `offset`, cut as `text.tokenize` cuts.

    A piece is the next `piece_chars` characters; unless the text ends there, it is cut after its
    last newline (kept whole when it has none past its first character). The next piece starts
    at the cut, so the pieces concatenate to the text. A piece depends only on where it starts,
    which is what lets a build restart at a recorded offset.
    """
    remaining = offset
    while remaining:  # the skipped prefix is decoded and dropped, far cheaper than tokenising it
        skipped = len(handle.read(min(remaining, 1 << 20)))
        if not skipped:
            return
        remaining -= skipped
    buffer, char = "", offset
    while True:
        buffer += handle.read(piece_chars + 1 - len(buffer))  # one character past a piece tells if it is the last
        if len(buffer) <= piece_chars:
            if buffer:
                yield char, buffer
            return
        piece = buffer[:piece_chars]
        cut = piece.rfind("\n")
        if cut > 0:
            piece = piece[:cut + 1]
        yield char, piece
        buffer = buffer[len(piece):]
        char += len(piece)


@contextlib.contextmanager
def _utf8_errors(file: Path) -> Iterator[None]:
    """Report a decoding failure with the absolute byte offset, as `read_texts` reports it."""
    try:
        yield
    except UnicodeDecodeError:
        reason, byte = _first_bad_utf8(file)
        raise not_utf8_error(file, reason, byte) from None


def _first_bad_utf8(file: Path) -> tuple[str, int]:
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    consumed = 0
    with open(file, "rb") as handle:
        while True:
            block = handle.read(1 << 20)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                pending = len(exc.object) - len(block)  # bytes held back from the previous block
                return exc.reason, consumed - pending + exc.start
            if not block:
                return "undecodable", consumed
            consumed += len(block)


def _file_sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


class BlockView:
    """Chosen blocks of `TokenShards`, indexed like a `[n, seq_len]` tensor but read from the shards on demand."""

    def __init__(self, shards: TokenShards, seq_len: int, indices: torch.Tensor):
        self.shards, self.seq_len, self.indices = shards, seq_len, indices

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.indices.numel()), self.seq_len)

    def __len__(self) -> int:
        return int(self.indices.numel())

    def __getitem__(self, positions: Iterable[int] | torch.Tensor) -> torch.Tensor:
        return self.shards.blocks(self.indices[torch.as_tensor(positions, dtype=torch.long)], self.seq_len)


def split_blocks(shards: TokenShards, seq_len: int, held_out: int, seed: int) -> tuple[BlockView, torch.Tensor]:
    """(training blocks, held-out blocks): the seeded permutation of `text.split` over block indices.

    The held-out blocks are few and read at once; the training blocks stay in the shards.
    """
    from mlxkit.engines.data.text import split

    n = shards.num_blocks(seq_len)
    train, val = split(torch.arange(n).unsqueeze(1), held_out / n, seed) if n else (torch.zeros(0, 1),) * 2
    return BlockView(shards, seq_len, train.reshape(-1)), shards.blocks(val.reshape(-1), seq_len)
