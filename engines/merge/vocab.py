"""Embedding and LM-head rows aligned by token string, for inputs whose tokenizers differ.

A tokenizer policy (`tokenizer_source` / `tokenizer.source` in a config, `--tokenizer` on the
command line) first fixes the output's vocabulary, from tokenizer files only:

* `base`: the base model's (with no base, the first model's);
* `union`: the base's (or first model's) tokens at their own ids, then every other input's extra
  tokens, input by input, each input's in id order;
* a directory (one of the inputs, or any tokenizer directory): that tokenizer's.

Every tensor matching the embedding pattern (`embed_tokens`, `lm_head` when it is not tied, ...)
is then re-indexed as the executor reads it, one tensor name at a time: row j of each input's
aligned tensor is that input's own row for the token with output id j. An input that lacks the
token (or lists it past its embedding rows) takes instead, in this order:

1. the row of the only model (base included) that has the token: a token one model brought keeps
   exactly that model's row under any normalised weighted mean, and a task vector of zero;
2. the base's row (its task vector is then zero);
3. its own mean row, the mean of the rows its own tokens index.

The run says how many rows each input took from where (a notice, and `tokenizer` in the
manifest's results).

Padding, as mergekit handles it: stored rows that no token indexes (a vocabulary padded to a
multiple of 64, say) are never read, since nothing trained them; the output has one row per
output id, rounded up to `tokenizer.pad_to_multiple_of` when given, and config.json's
`vocab_size` says so. Output rows that no token indexes take each input's mean row (mergekit's
fill: a mean row perturbs the output distribution least). When every input's vocabulary already
is the output's and the row counts agree, nothing is re-indexed and the tensors, padding rows
included, merge as stored, exactly as without a policy.

An input without tokenizer files is taken to share the reference's vocabulary (the base's, else
the first model's; mergekit's assumption), and says so. Re-indexing one tensor holds every
input's stored and aligned copies of it: 2·(T + 1) tensors of that name, still never a model.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.sources import MergeInput
from mlxkit.engines.merge.tokenizers import TokenizerFacts, added_token_flags, read_vocabulary

BASE = -1  # the base model's key among the participants; the inputs are keyed by their index

# Where a row an input lacks came from, as the summary and the notices name it.
ONLY_HOLDER, BASE_ROW, MEAN_ROW = "only_holder", "base", "mean"


@dataclass(frozen=True)
class RowSources:
    """How one participant's aligned tensor is made from stored rows."""

    copies: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]  # (participant, output rows, its stored rows)
    mean_rows: torch.Tensor      # output rows that take this participant's mean row
    token_rows: torch.Tensor     # the stored rows its own tokens index: what its mean row averages
    missing: dict[str, int]      # tokens it lacks, by where their row came from
    past_rows: int = 0           # tokens its tokenizer lists beyond its embedding rows (counted as missing)


@dataclass(frozen=True)
class NewToken:
    """A union token the reference's tokenizer lacks, with the flags its source tokenizer gives it."""

    content: str
    id: int
    flags: dict


@dataclass
class VocabAlignment:
    """The output vocabulary and, per participant, where each aligned row comes from."""

    policy: str
    tokens: int                        # ids the output vocabulary spans
    rows: int                          # rows of every re-indexed tensor
    sources: dict[int, RowSources]     # BASE or an input's index
    labels: dict[int, str]             # the same keys: the participant's spec
    padding: int = 0                   # output rows no token indexes
    new_tokens: list[NewToken] = field(default_factory=list)
    assumed: dict[str, str] = field(default_factory=dict)  # spec without tokenizer files -> spec whose vocab it takes

    def summary(self) -> dict:
        """What the manifest records: the vocabulary, and which rows each input did not have."""
        missing = {}
        for p, rs in self.sources.items():
            if sum(rs.missing.values()):
                missing[self.labels[p]] = {kind: rs.missing.get(kind, 0) for kind in (ONLY_HOLDER, BASE_ROW, MEAN_ROW)}
                if rs.past_rows:
                    missing[self.labels[p]]["past_embedding_rows"] = rs.past_rows
        return {"policy": self.policy, "tokens": self.tokens, "rows": self.rows, "padding_rows": self.padding,
                "added_tokens": [t.content for t in self.new_tokens], "missing_rows": missing,
                "assumed_vocabulary": dict(self.assumed)}

    def notices(self) -> list[str]:
        added = f", {len(self.new_tokens)} of them added to the reference's tokenizer" if self.new_tokens else ""
        lines = [f"tokenizer {self.policy}: {self.tokens} token ids{added}; embedding and LM-head rows are "
                 f"re-indexed by token to {self.rows} rows"]
        for spec, source in self.assumed.items():
            lines.append(f"'{spec}' has no tokenizer files: its rows are taken to follow the vocabulary of '{source}'")
        for p, rs in self.sources.items():
            total = sum(rs.missing.values())
            if not total:
                continue
            past = f" ({rs.past_rows} listed past its embedding rows)" if rs.past_rows else ""
            lines.append(f"'{self.labels[p]}' lacks {total} of the output's tokens{past}: "
                         f"{rs.missing.get(ONLY_HOLDER, 0)} take the row of the only model that has them, "
                         f"{rs.missing.get(BASE_ROW, 0)} the base's row, {rs.missing.get(MEAN_ROW, 0)} its mean row")
        if self.padding:
            lines.append(f"{self.padding} padding rows (no token) take each model's mean row")
        return lines

    def aligned(self, participant: int, stored: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """`participant`'s tensor re-indexed to the output vocabulary; `stored(p)` gives p's stored tensor (float32)."""
        rs = self.sources[participant]
        own = stored(participant)
        out = own.new_empty((self.rows, *own.shape[1:]))
        for other, out_rows, stored_rows in rs.copies:
            out[out_rows] = stored(other)[stored_rows]
        if rs.mean_rows.numel():
            out[rs.mean_rows] = own[rs.token_rows].mean(0)
        return out

    def read(self, sources: list[tuple[int, str]], base_name: Optional[str], inputs: list[MergeInput],
             base: Optional[MergeInput]) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
        """The base's and each source's weight for one re-indexed tensor name, aligned, in float32.

        Reads each participant's stored tensor once, the donors of rows included.
        """
        names = dict(sources)
        stored: dict[int, torch.Tensor] = {}

        def read_stored(p: int) -> torch.Tensor:
            if p not in stored:
                if p == BASE:
                    assert base is not None and base_name is not None
                    stored[p] = base.loader.get_tensor(base_name).float()
                else:
                    inp, name = inputs[p], names.get(p, sources[0][1])
                    if inp.kind == "lora" and name in inp.replaced:
                        stored[p] = inp.loader.get_tensor(inp.replaced[name]).float()
                    else:  # a LoRA adapter's embedding is the base's rows plus its delta
                        stored[p] = inp.weight(name, read_stored(BASE) if inp.kind == "lora" else None)
            return stored[p]

        base_t = self.aligned(BASE, read_stored) if base is not None and base_name is not None else None
        weights = [self.aligned(i, read_stored) for i, _ in sources]
        return base_t, weights

    def write_tokenizer(self, out: Path, reference: Path) -> None:
        """Give the tokenizer files copied to `out` (the reference's) the union's new tokens.

        They go in as added tokens at their union ids rather than into the model's vocabulary:
        an added token is matched before the model runs, so it works the same for BPE, WordPiece,
        Unigram and WordLevel, needs no merges (a BPE vocabulary entry that no merge produces is
        never emitted), and leaves the segmentation of text without it unchanged. Tokens that were
        added tokens in their source keep its flags (special, normalized, ...); a plain vocabulary
        entry of another tokenizer goes in under its stored spelling, not special and not
        normalised. The result is checked by loading it back with `AutoTokenizer`.
        """
        if not self.new_tokens:
            return
        path = out / "tokenizer.json"
        if path.is_file():
            data = json.loads(path.read_text())
        else:  # a slow tokenizer only (sentencepiece, vocab.json + merges): its fast conversion
            from transformers import AutoTokenizer

            data = json.loads(AutoTokenizer.from_pretrained(reference).backend_tokenizer.to_str())
        data.setdefault("added_tokens", [])
        for token in self.new_tokens:
            data["added_tokens"].append({"id": token.id, "content": token.content, "single_word": False,
                                         "lstrip": False, "rstrip": False, "normalized": False, "special": False,
                                         **token.flags})
        path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n")
        config_path = out / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else None
        if isinstance(config, dict) and isinstance(config.get("added_tokens_decoder"), dict):
            # transformers 4 rebuilds the added tokens from this table too, so it must list the new ones
            for token in self.new_tokens:
                config["added_tokens_decoder"][str(token.id)] = {
                    "content": token.content, "single_word": False, "lstrip": False, "rstrip": False,
                    "normalized": False, "special": False, **token.flags}
            config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
        _check_written_tokenizer(out, self.new_tokens)


def _check_written_tokenizer(out: Path, new_tokens: list[NewToken]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    for token in new_tokens:
        got = tokenizer.convert_tokens_to_ids(token.content)
        if got != token.id:
            raise InputError(f"the union tokenizer written to '{out}' gives {token.content!r} id {got}, not the id "
                             f"{token.id} its embedding row was written at; use tokenizer_source: base instead")


def tokenizer_source_dir(policy: Optional[str], inputs: list[MergeInput], base: Optional[MergeInput]) -> Path:
    """The directory whose tokenizer files the output carries: the reference's (base, else the
    first model) for no policy, `base` and `union`, else the named input's or the named directory."""
    from mlxkit.engines.merge.config import input_key

    reference = base or inputs[0]
    if policy in (None, "base", "union"):
        return Path(reference.path)
    for inp in [*([base] if base else []), *inputs]:
        if input_key(inp.spec) == input_key(policy):
            return Path(inp.path)
    return Path(policy).expanduser()


def align_vocabularies(policy: Optional[str], pad_to_multiple_of: Optional[int], inputs: list[MergeInput],
                       base: Optional[MergeInput], facts: list[TokenizerFacts], embedding_pattern: str,
                       reporter: Reporter) -> Optional[VocabAlignment]:
    """Where every aligned embedding row comes from, or None when nothing needs re-indexing.

    Reads tokenizer files and tensor headers only. `facts` are the participants' (the base first
    when there is one, then the inputs), as the pre-flight read them.
    """
    if policy is None:
        return None
    embed_re = re.compile(embedding_pattern)
    parts = [*([(BASE, base)] if base is not None else []), *enumerate(inputs)]
    labels = {p: inp.spec for p, inp in parts}
    vocabs = {p: read_vocabulary(Path(inp.path), fact) for (p, inp), fact in zip(parts, facts)}
    reference = parts[0][0]
    known = [p for p, _ in parts if vocabs[p] is not None]
    if not known:
        return None  # no tokenizer to align by: the rows are merged as stored, as without a policy
    fallback = reference if vocabs[reference] is not None else known[0]
    assumed = {labels[p]: labels[fallback] for p, _ in parts if vocabs[p] is None}
    vocabs = {p: vocabs[p] if vocabs[p] is not None else vocabs[fallback] for p in vocabs}
    reference_rows = _embedding_rows(parts[0][1], embed_re, None)
    if reference_rows is None:
        return None  # no embedding tensor to re-index
    rows = {p: _embedding_rows(inp, embed_re, reference_rows) for p, inp in parts}

    new_tokens: list[NewToken] = []
    if policy == "base":
        out_vocab = dict(vocabs[reference])
    elif policy == "union":
        out_vocab, new_tokens = _union(parts, vocabs, rows, reference)
        if new_tokens and labels[reference] in assumed:
            raise InputError(f"tokenizer union: '{labels[reference]}' has no tokenizer files for the union's "
                             f"{len(new_tokens)} new tokens to extend")
    else:
        directory = tokenizer_source_dir(policy, inputs, base)
        named = [p for p, inp in parts if Path(inp.path) == directory]
        out_vocab = vocabs[named[0]] if named else read_vocabulary(directory)
        if out_vocab is None:
            raise InputError(f"tokenizer source '{policy}' lists no vocabulary mlx merge can read "
                             "(tokenizer.json, vocab.json or a sentencepiece model)")
    if not out_vocab:
        raise InputError(f"tokenizer {policy}: the output vocabulary is empty")
    span = max(out_vocab.values()) + 1
    out_rows = span if not pad_to_multiple_of else -(-span // pad_to_multiple_of) * pad_to_multiple_of
    unchanged = all(vocabs[p] == out_vocab for p in vocabs) and len(set(rows.values())) == 1
    if unchanged and (pad_to_multiple_of is None or out_rows == reference_rows):
        for spec, source in assumed.items():
            reporter.notice(f"'{spec}' has no tokenizer files: its rows are taken to follow the vocabulary of "
                            f"'{source}'")
        return None

    sources = _row_sources(parts, vocabs, rows, out_vocab, out_rows)
    alignment = VocabAlignment(policy=policy, tokens=span, rows=out_rows, sources=sources, labels=labels,
                               padding=out_rows - len(set(out_vocab.values())), new_tokens=new_tokens,
                               assumed=assumed)
    for line in alignment.notices():
        reporter.notice(line)
    return alignment


def _embedding_rows(inp: MergeInput, embed_re: re.Pattern, fallback: Optional[int]) -> Optional[int]:
    """The rows of an input's token embeddings (the fewest, when its embedding and LM head differ);
    `fallback` for a LoRA adapter that does not replace them (it keeps the base's)."""
    if inp.kind == "lora":
        shapes = [inp.tensors[key].shape for target, key in inp.replaced.items() if embed_re.search(target)]
    else:
        shapes = [info.shape for name, info in inp.tensors.items() if embed_re.search(name) and info.shape]
    return min(shape[0] for shape in shapes) if shapes else fallback


def _union(parts: list[tuple[int, MergeInput]], vocabs: dict[int, dict[str, int]], rows: dict[int, int],
           reference: int) -> tuple[dict[str, int], list[NewToken]]:
    out_vocab = dict(vocabs[reference])
    next_id = max(out_vocab.values(), default=-1) + 1
    new_tokens: list[NewToken] = []
    for p, inp in parts:
        if p == reference:
            continue
        flags = added_token_flags(Path(inp.path))
        for token, token_id in sorted(vocabs[p].items(), key=lambda item: item[1]):
            # a token listed past the input's embedding rows has no trained row anywhere (mergekit skips it too)
            if token in out_vocab or token_id >= rows[p]:
                continue
            out_vocab[token] = next_id
            new_tokens.append(NewToken(token, next_id, flags.get(token, {})))
            next_id += 1
    return out_vocab, new_tokens


def _row_sources(parts: list[tuple[int, MergeInput]], vocabs: dict[int, dict[str, int]], rows: dict[int, int],
                 out_vocab: dict[str, int], out_rows: int) -> dict[int, RowSources]:
    keys = [p for p, _ in parts]
    copies: dict[int, dict[int, tuple[list[int], list[int]]]] = {p: {} for p in keys}
    means: dict[int, list[int]] = {p: [] for p in keys}
    missing: dict[int, Counter] = {p: Counter() for p in keys}
    past = Counter(p for p in keys for token_id in vocabs[p].values() if token_id >= rows[p])

    def take(p: int, source: int, out_id: int, stored_id: int) -> None:
        out_ids, stored_ids = copies[p].setdefault(source, ([], []))
        out_ids.append(out_id)
        stored_ids.append(stored_id)

    for token, out_id in out_vocab.items():
        held = {p: vocabs[p].get(token) for p in keys}
        held = {p: i for p, i in held.items() if i is not None and i < rows[p]}
        for p in keys:
            if p in held:
                take(p, p, out_id, held[p])
            elif len(held) == 1:
                (source, stored_id), = held.items()
                take(p, source, out_id, stored_id)
                missing[p][BASE_ROW if source == BASE else ONLY_HOLDER] += 1
            elif BASE in held:
                take(p, BASE, out_id, held[BASE])
                missing[p][BASE_ROW] += 1
            else:
                means[p].append(out_id)
                missing[p][MEAN_ROW] += 1
    padding = sorted(set(range(out_rows)) - set(out_vocab.values()))
    as_index = lambda ids: torch.tensor(ids, dtype=torch.long)  # noqa: E731
    result = {}
    for p in keys:
        # an input none of whose tokens has a row (all listed past its rows) averages every row it has
        own_rows = sorted({i for i in vocabs[p].values() if i < rows[p]}) or list(range(rows[p]))
        result[p] = RowSources(
            copies=tuple((source, as_index(out_ids), as_index(stored_ids))
                         for source, (out_ids, stored_ids) in copies[p].items()),
            mean_rows=as_index(means[p] + padding), token_rows=as_index(own_rows),
            missing=dict(missing[p]), past_rows=past[p])
    return result
