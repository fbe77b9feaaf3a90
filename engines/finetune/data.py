"""Fine-tuning data: packed text blocks (causal LM) or labelled texts (sequence classification).

Both objectives come out as the same `Examples`: right-padded token ids with their lengths
and, for classification, integer labels. Reading the raw files happens before any model
loads, so a missing field or an empty file is reported before any work starts; tokenising
needs the tokenizer and comes after.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mlxkit.engines.data.text import pack, read_jsonl_records, read_texts, split, tokenize
from mlxkit.engines.errors import InputError


@dataclass(frozen=True)
class LabelledTexts:
    """Texts with their labels' indices into `label_names` (sorted, so the ids are reproducible)."""

    texts: list[str]
    labels: list[int]
    label_names: list[str]


@dataclass
class Batch:
    ids: torch.Tensor                 # [b, L], right-padded
    lengths: torch.Tensor             # [b]
    labels: torch.Tensor | None       # [b] (classification) or None (causal LM)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: torch.device) -> "Batch":
        """The same batch on `device` (where the model is)."""
        return Batch(self.ids.to(device), self.lengths.to(device),
                     None if self.labels is None else self.labels.to(device))


@dataclass
class Examples:
    """Token ids [n, L] (right-padded), lengths [n], labels [n] or None."""

    ids: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def batch(self, indices: list[int]) -> Batch:
        """The examples at `indices`, cut to their longest (a causal model never sees the right padding)."""
        index = torch.tensor(indices, dtype=torch.long)
        lengths = self.lengths[index]
        width = int(lengths.max()) if len(indices) else 0
        return Batch(self.ids[index, :width], lengths, None if self.labels is None else self.labels[index])

    def to_dict(self) -> dict[str, torch.Tensor | None]:
        return {"ids": self.ids, "lengths": self.lengths, "labels": self.labels}


def read_labelled(path: str | os.PathLike, text_field: str, label_field: str) -> LabelledTexts:
    """Classification data: a .jsonl file, one object per line with a text and a label field."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"data '{path}' does not exist" if not path.exists() else
                         f"classification data '{path}' must be a .jsonl file, not a directory")
    if path.suffix != ".jsonl":
        raise InputError(f"classification data '{path}' must be a .jsonl file with '{text_field}' and "
                         f"'{label_field}' fields")
    texts, raw_labels = [], []
    for number, record in read_jsonl_records(path, text_field):
        if label_field not in record or record[label_field] is None:
            raise InputError(f"{path}:{number}: no field '{label_field}' (choose one with --set "
                             f"data.label_field=NAME)")
        label = record[label_field]
        if isinstance(label, (dict, list)):
            raise InputError(f"{path}:{number}: the label must be a string or a number (got {json.dumps(label)})")
        if not str(record[text_field]).strip():
            raise InputError(f"{path}:{number}: the '{text_field}' field is empty")
        texts.append(str(record[text_field]))
        raw_labels.append(str(label))
    if not texts:
        raise InputError(f"data '{path}' holds no examples")
    names = sorted(set(raw_labels))
    if len(names) < 2:
        raise InputError(f"data '{path}' has a single label ({names[0]!r}); classification needs at least two")
    index = {name: i for i, name in enumerate(names)}
    return LabelledTexts(texts, [index[label] for label in raw_labels], names)


def read_raw(path: str | os.PathLike, objective: str, text_field: str, label_field: str) -> list[str] | LabelledTexts:
    """The untokenised data of either objective (every format check happens here)."""
    if objective == "classification":
        return read_labelled(path, text_field, label_field)
    return read_texts(path, text_field)


def lm_examples(tokenizer, texts: list[str], *, seq_len: int, train_sequences: int, held_out: int, seed: int,
                eval_texts: list[str] | None = None) -> tuple[Examples, Examples]:
    """Packed blocks of `seq_len` tokens: training blocks and `held_out` validation blocks.

    Only as many tokens as the run can use are tokenised. Without separate evaluation text the
    held-out blocks are a seeded split of the training text; with it they are its first blocks.
    """
    if eval_texts is None:
        blocks = pack(tokenize(tokenizer, texts, (train_sequences + held_out) * seq_len), seq_len)
        if blocks.shape[0] <= held_out:
            raise InputError(f"--data gives {blocks.shape[0]} sequence(s) of {seq_len} tokens; need more than the "
                             f"{held_out} held out for validation (data.held_out_sequences)")
        train, val = split(blocks, held_out / blocks.shape[0], seed)
    else:
        train = pack(tokenize(tokenizer, texts, train_sequences * seq_len), seq_len)
        val = pack(tokenize(tokenizer, eval_texts, held_out * seq_len), seq_len)[:held_out]
    return _full_blocks(train), _full_blocks(val)


def _full_blocks(blocks: torch.Tensor) -> Examples:
    return Examples(blocks, torch.full((blocks.shape[0],), blocks.shape[1], dtype=torch.long))


def classification_examples(tokenizer, data: LabelledTexts, *, seq_len: int, held_out: int,
                            seed: int) -> tuple[Examples, Examples]:
    """Each text tokenised and cut to `seq_len` tokens; a seeded split leaves `held_out` examples for validation."""
    n = len(data.texts)
    if n <= held_out:
        raise InputError(f"--data has {n} example(s); need more than the {held_out} held out for validation "
                         "(data.held_out_sequences)")
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"][:seq_len] for text in data.texts]
    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    ids = torch.full((n, width), pad, dtype=torch.long)
    for row, tokens in enumerate(encoded):
        ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    lengths = torch.tensor([len(t) for t in encoded], dtype=torch.long)
    if int(lengths.min()) == 0:
        raise InputError(f"example {int(lengths.argmin()) + 1} of --data has no tokens")
    labels = torch.tensor(data.labels, dtype=torch.long)
    train_rows, val_rows = split(torch.arange(n)[:, None], held_out / n, seed)
    train, val = train_rows[:, 0], val_rows[:, 0]
    return (Examples(ids[train], lengths[train], labels[train]), Examples(ids[val], lengths[val], labels[val]))
