"""Text in: read files, tokenise, pack into fixed-length sequences, split train/validation."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from mlxkit.engines.errors import InputError


@dataclass
class TokenBlocks:
    """Packed token sequences `[n, seq_len]`, split deterministically into train and validation."""

    train: torch.Tensor
    val: torch.Tensor
    description: str

    @property
    def seq_len(self) -> int:
        return int(self.train.shape[1] if self.train.numel() else self.val.shape[1])


def check_data_path(path: str | os.PathLike) -> Path:
    """Refuse a missing or unsupported --data path before any output is started (reads no text)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise InputError(f"data '{path}' does not exist")
    if path.is_file() and path.suffix not in _TEXT_SUFFIXES + (".jsonl",):
        raise InputError(f"data '{path}' has an unsupported format '{path.suffix}' (use .txt, .jsonl or a directory)")
    return path


_TEXT_SUFFIXES = (".txt", ".md", ".text", ".raw", "")
# Long documents are tokenised in pieces of at most this many characters, cut after a line end.
# The piece boundaries decide the ids at each cut, so every tokeniser of --data uses this one value.
PIECE_CHARS = 1 << 20


def read_texts(path: str | os.PathLike, text_field: str = "text") -> list[str]:
    """Documents from a .txt file, a .jsonl file (one object per line), or a directory of .txt files."""
    path = check_data_path(path)
    if path.is_dir():
        texts = [_read_utf8(f) for f in text_files(path)]
    elif path.suffix == ".jsonl":
        texts = _read_jsonl(path, text_field)
    else:
        texts = [_read_utf8(path)]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InputError(f"data '{path}' holds no text")
    return texts


def text_files(directory: Path) -> list[Path]:
    """The .txt files under a data directory, in the sorted order their documents are read."""
    files = sorted(p for p in directory.rglob("*.txt") if p.is_file())
    if not files:
        raise InputError(f"data directory '{directory}' holds no .txt files")
    return files


def not_utf8_error(path: Path, reason: str, byte: int) -> InputError:
    """The error for a data file that does not decode as UTF-8 (`byte`: offset of the first bad byte)."""
    return InputError(f"data file '{path}' is not UTF-8 text ({reason} at byte {byte})")


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8_error(path, exc.reason, exc.start) from None


def parse_jsonl_line(path: Path, number: int, line: str, text_field: str) -> dict | None:
    """The object on line `number` of a .jsonl file, or None for a blank line; it must hold `text_field`, a string."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict) or text_field not in record:
        raise InputError(f"{path}:{number}: no field '{text_field}' (choose one with --text-field)")
    if not isinstance(record[text_field], str):  # str() would train on "123" or "None"
        kind = "null" if record[text_field] is None else type(record[text_field]).__name__
        raise InputError(f"{path}:{number}: field '{text_field}' is {kind}, not a string")
    return record


def read_jsonl_records(path: Path, text_field: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a .jsonl file; each object must hold `text_field`."""
    for number, line in enumerate(_read_utf8(path).splitlines(), start=1):
        record = parse_jsonl_line(path, number, line, text_field)
        if record is not None:
            yield number, record


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    texts = [str(record[text_field]) for _, record in read_jsonl_records(path, text_field)]
    return texts


def tokenize(tokenizer, texts: list[str], max_tokens: int | None = None) -> torch.Tensor:
    """One flat id stream: documents joined by the EOS token, cut at `max_tokens`.

    Long documents are tokenised in pieces of characters, stopping as soon as enough
    tokens exist, so a 10-token run over a huge file stays cheap.
    """
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    piece_chars = PIECE_CHARS
    for doc_index, text in enumerate(texts):
        if doc_index and separator:
            ids.extend(separator)
        start = 0
        while start < len(text):
            piece = text[start:start + piece_chars]
            if start + piece_chars < len(text):  # cut at a line end so no word is split
                cut = piece.rfind("\n")
                if cut > 0:
                    piece = piece[:cut + 1]
            start += len(piece)  # the next piece starts where this one was cut: no text is skipped
            ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
            if max_tokens is not None and len(ids) >= max_tokens:
                return torch.tensor(ids[:max_tokens], dtype=torch.long)
    return torch.tensor(ids, dtype=torch.long)


def pack(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping `[n, seq_len]` blocks; the ragged tail is dropped."""
    if seq_len < 2:
        raise InputError(f"sequence length must be at least 2 (got {seq_len})")
    n = ids.numel() // seq_len
    if n == 0:
        raise InputError(f"the data has {ids.numel()} tokens, fewer than one sequence of {seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


def split(blocks: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded permutation of the blocks; the first `val_fraction` go to validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise InputError(f"validation fraction must be in [0, 1) (got {val_fraction})")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(blocks.shape[0], generator=generator)
    n_val = int(round(blocks.shape[0] * val_fraction))
    if val_fraction > 0 and n_val == 0 and blocks.shape[0] > 1:
        n_val = 1
    return blocks[order[n_val:]], blocks[order[:n_val]]


def load_blocks(path: str | os.PathLike, tokenizer, *, seq_len: int, max_tokens: int | None = None,
                val_fraction: float = 0.1, seed: int = 0, text_field: str = "text") -> TokenBlocks:
    """Read, tokenise, pack and split a user's text data."""
    ids = tokenize(tokenizer, read_texts(path, text_field), max_tokens)
    blocks = pack(ids, seq_len)
    train, val = split(blocks, val_fraction, seed)
    return TokenBlocks(train, val, f"{path} ({blocks.numel()} tokens in {blocks.shape[0]} x {seq_len})")
