"""Tokenizer pre-flight: the inputs' vocabularies, special tokens and chat templates, compared
from their files before any tensor is read.

Merging rows of embedding matrices that index different tokens gives garbled output (mergekit's
most reported failure), so differing tokenizers are refused, in one line that says what differs,
unless the config names a tokenizer policy (`tokenizer_source` / `tokenizer`: base, union or a
tokenizer directory, under which `vocab.py` aligns the rows by token; `chat_template` for the
templates). An input without tokenizer files has nothing to compare and is left out.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mlxkit.engines.errors import InputError

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerMismatchError(InputError):
    """The inputs' tokenizers differ and the config names no tokenizer for the output."""


@dataclass(frozen=True)
class TokenizerFacts:
    spec: str
    vocab: Optional[dict[str, int]]        # token -> id, when the files list it
    vocab_digest: Optional[str]            # sentencepiece models: the file's hash stands for the vocabulary
    special: dict[str, str]
    chat_template: Optional[str]


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stored_chat_template(path: Path) -> Optional[str]:
    """The chat template a checkpoint carries: chat_template.jinja, else tokenizer_config.json's."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    cfg = _json(path / "tokenizer_config.json")
    template = cfg.get("chat_template") if isinstance(cfg, dict) else None
    return template if isinstance(template, str) else None


def _vocab(path: Path) -> Optional[dict[str, int]]:
    data = _json(path / "tokenizer.json")
    vocab: Optional[dict[str, int]] = None
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        raw = data["model"].get("vocab")
        if isinstance(raw, dict):
            vocab = {str(k): int(v) for k, v in raw.items()}
        elif isinstance(raw, list):  # Unigram: [piece, score] in id order
            vocab = {str(entry[0]): i for i, entry in enumerate(raw)}
        for added in data.get("added_tokens") or []:
            if isinstance(added, dict) and "content" in added and "id" in added:
                vocab = {**(vocab or {}), str(added["content"]): int(added["id"])}
        return vocab
    raw = _json(path / "vocab.json")
    if isinstance(raw, dict):
        vocab = {str(k): int(v) for k, v in raw.items()}
        added = _json(path / "added_tokens.json")
        if isinstance(added, dict):
            vocab.update({str(k): int(v) for k, v in added.items()})
    return vocab


def read_vocabulary(path: Path, facts: Optional[TokenizerFacts] = None) -> Optional[dict[str, int]]:
    """token -> id of the tokenizer in `path` (None when it has none): from its files, else, for a
    sentencepiece model alone, from the tokenizer transformers builds from it. `facts` saves
    reading the files again."""
    vocab = facts.vocab if facts is not None else _vocab(path)
    if vocab is not None or not (path / "tokenizer.model").is_file():
        return vocab
    from transformers import AutoTokenizer

    try:
        return dict(AutoTokenizer.from_pretrained(path).get_vocab())
    except Exception as exc:  # a tokenizer that does not load has no vocabulary to align by
        raise InputError(f"cannot read the vocabulary of '{path / 'tokenizer.model'}': "
                         f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}") from exc


def added_token_flags(path: Path) -> dict[str, dict[str, Any]]:
    """The added tokens of `path`'s tokenizer.json, content -> their flags (special, normalized, ...)."""
    data = _json(path / "tokenizer.json")
    out: dict[str, dict[str, Any]] = {}
    for added in (data.get("added_tokens") or []) if isinstance(data, dict) else []:
        if isinstance(added, dict) and isinstance(added.get("content"), str):
            out[added["content"]] = {k: v for k, v in added.items()
                                     if k in ("special", "normalized", "lstrip", "rstrip", "single_word")}
    return out


def has_tokenizer_files(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file()
                                 for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def _special(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for source in (_json(path / "tokenizer_config.json"), _json(path / "special_tokens_map.json")):
        if not isinstance(source, dict):
            continue
        for key in _SPECIAL:
            value = source.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
    return out


def tokenizer_facts(spec: str, path: Path) -> TokenizerFacts:
    vocab = _vocab(path)
    digest = None
    if vocab is None and (path / "tokenizer.model").is_file():
        digest = hashlib.sha256((path / "tokenizer.model").read_bytes()).hexdigest()
    return TokenizerFacts(spec, vocab, digest, _special(path), stored_chat_template(path))


def _examples(tokens: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(t) for t in tokens[:limit])
    return shown + (", ..." if len(tokens) > limit else "")


def _vocab_difference(a: TokenizerFacts, b: TokenizerFacts) -> Optional[str]:
    if a.vocab is not None and b.vocab is not None:
        if a.vocab == b.vocab:
            return None
        only_a = sorted((t for t in a.vocab if t not in b.vocab), key=a.vocab.__getitem__)
        only_b = sorted((t for t in b.vocab if t not in a.vocab), key=b.vocab.__getitem__)
        moved = sorted(t for t in a.vocab if t in b.vocab and a.vocab[t] != b.vocab[t])
        n = len(only_a) + len(only_b) + len(moved)
        parts = [f"{len(only)} token{'s' if len(only) != 1 else ''} only in '{f.spec}' ({_examples(only)})"
                 for only, f in ((only_b, b), (only_a, a)) if only]
        if moved:
            token = moved[0]
            parts.append(f"{len(moved)} at other ids (e.g. {token!r} is id {a.vocab[token]} in '{a.spec}' and id "
                         f"{b.vocab[token]} in '{b.spec}')")
        return (f"vocabularies differ in {n} token{'s' if n != 1 else ''} ({len(a.vocab)} in '{a.spec}', "
                f"{len(b.vocab)} in '{b.spec}'): {', '.join(parts)}")
    if a.vocab_digest is not None and b.vocab_digest is not None and a.vocab_digest != b.vocab_digest:
        return f"the sentencepiece models of '{a.spec}' and '{b.spec}' differ"
    return None


def _shown(token: Optional[str]) -> str:
    return "unset" if token is None else repr(token)


def check_tokenizers(facts: list[TokenizerFacts], *, tokenizer_policy: Optional[str],
                     chat_template: Optional[str]) -> None:
    """Raise `TokenizerMismatchError` naming the first difference, unless a policy covers it."""
    present = [f for f in facts if f.vocab is not None or f.vocab_digest is not None or f.special or f.chat_template]
    if len(present) < 2:
        return
    first = present[0]
    problems: list[str] = []
    for other in present[1:]:
        if tokenizer_policy is None:
            vocab = _vocab_difference(first, other)
            if vocab:
                problems.append(vocab)
            for key in _SPECIAL:
                a, b = first.special.get(key), other.special.get(key)
                if a != b:
                    problems.append(f"{key} is {_shown(a)} in '{first.spec}' but {_shown(b)} in '{other.spec}'")
        if chat_template is None and first.chat_template != other.chat_template:
            problems.append(f"the chat templates of '{first.spec}' and '{other.spec}' differ")
        if problems:
            break
    if problems:
        fix = "set tokenizer_source (or --tokenizer) to base, union or a tokenizer directory" \
            if tokenizer_policy is None else ""
        if any("chat templates" in p for p in problems):
            fix = " and ".join(x for x in (fix, "chat_template (auto, a name or a template)") if x)
        raise TokenizerMismatchError(f"the inputs' tokenizers differ: {'; '.join(problems)}; {fix} to choose "
                                     "what the merged model carries")
