"""`mlx eval`: load models and data, evaluate, return a plain result dict."""

from __future__ import annotations

import os

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.data.text import pack, read_texts, tokenize
from mlxkit.engines.errors import InputError
from mlxkit.engines.eval.language_model import evaluate
from mlxkit.engines.models.loading import load_model
from mlxkit.engines.training.device import Placement, dtype_name

DEFAULT_SEQ_LEN = 512


def _check_max_tokens(max_tokens: int, seq_len: int) -> None:
    if max_tokens < seq_len:
        raise InputError(f"--max-tokens ({max_tokens}) must be at least --seq-len ({seq_len})")


def run_eval(model: str, *, data: str | os.PathLike | None, reference: str | None = None, max_tokens: int = 8192,
             seq_len: int | None = None, text_field: str = "text", seed: int = 0, allow_pickle: bool = False,
             device: str = "auto", dtype: str = "auto", reporter: Reporter | None = None) -> dict:
    """Perplexity of `model` on `data` (or, without data, on text sampled from the reference or the model).

    With a reference, also KL(reference || model), top-1 agreement and the reference's own perplexity.
    Both models are held on `device` in the compute `dtype` (see `engines/training/device.py`); the
    log-probabilities behind every metric are computed in float32. `seq_len` defaults to 512, or the
    model's positions when it has fewer; a `seq_len` the model cannot hold is refused, as in
    finetune and calibrate, instead of evaluating positions it was never trained on.
    """
    import torch

    reporter = reporter or Reporter()
    placement = Placement.resolve(device, dtype)  # a bad or missing device fails before anything loads
    if seq_len is not None:
        from mlxkit.engines.models.loading import load_config

        positions = getattr(load_config(model), "max_position_embeddings", None)
        if isinstance(positions, int) and seq_len > positions:
            raise InputError(f"--seq-len {seq_len} exceeds the {positions} positions of '{model}' "
                             "(max_position_embeddings)")
        _check_max_tokens(max_tokens, seq_len)
    texts = read_texts(data, text_field) if data is not None else None  # fail on bad data before loading
    # Without data the text is sampled on the CPU from the float32 weights, so it is the same text
    # (and the same cache entry) whatever --device and --dtype are; the models are placed afterwards.
    sampling = texts is None
    load_dtype = torch.float32 if sampling else placement.dtype
    load_device = None if sampling else placement.device
    loaded = load_model(model, dtype=load_dtype, device=load_device, allow_pickle=allow_pickle, reporter=reporter)
    ref = load_model(reference, dtype=load_dtype, device=load_device, allow_pickle=allow_pickle,
                     with_tokenizer=False, reporter=reporter) if reference else None
    if seq_len is None:
        positions = getattr(loaded.model.config, "max_position_embeddings", None)
        seq_len = min(DEFAULT_SEQ_LEN, positions) if isinstance(positions, int) and positions > 1 else DEFAULT_SEQ_LEN
        _check_max_tokens(max_tokens, seq_len)
    if ref is not None and ref.model.config.vocab_size != loaded.model.config.vocab_size:
        raise InputError(f"'{model}' and reference '{reference}' have different vocabularies "
                         f"({loaded.model.config.vocab_size} vs {ref.model.config.vocab_size})")
    if texts is not None:
        ids = tokenize(loaded.tokenizer, texts, max_tokens)
        blocks = pack(ids, seq_len)
        description = str(data)
    else:
        from mlxkit.engines.data.sampled import sample_tokens

        sampler = ref.model if ref is not None else loaded.model
        blocks = sample_tokens(sampler, loaded.tokenizer, n_sequences=max(1, max_tokens // seq_len), seq_len=seq_len,
                               seed=seed, reporter=reporter)
        description = "text sampled from " + ("the reference" if ref is not None else "the model itself")
        loaded.model.to(device=placement.device, dtype=placement.dtype)
        if ref is not None:
            ref.model.to(device=placement.device, dtype=placement.dtype)
    result = evaluate(loaded.model, blocks, reference=ref.model if ref else None, reporter=reporter).to_dict()
    if ref is not None:
        result["reference_perplexity"] = evaluate(ref.model, blocks).perplexity
    result.update(model=model, reference=reference, data=description, device=str(placement.device),
                  dtype=dtype_name(placement.dtype))
    return result
