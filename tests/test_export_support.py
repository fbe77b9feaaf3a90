"""Helpers shared by the export tests (no tests here): tiny children with every block kind, a BPE tokenizer.

`make_child_dir` saves a random heterogeneous child (the `mlx_decilm` class) the way
`mlx search` does, with a byte-level BPE tokenizer that has real merges (llama.cpp refuses a
BPE vocabulary without them). RoPE theta is 100000 (SmolLM2's), not the default 10000, so an
exporter that misses `rope_parameters` gets wrong logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from conftest import make_tiny_llama

if TYPE_CHECKING:
    import numpy as np

ROPE_THETA = 100000.0
TINY = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256, rope_theta=ROPE_THETA)
TEXT = "the quick brown fox jumps over the lazy dog; then the other fox sat there with them. " * 2

# One layer of each kind llama.cpp's deci graph treats differently (see engines/export/gguf_export.py).
MIXED = ("no_op+ffn128",   # attention-free layer 0: becomes zero linear attention in GGUF
         "kv1+no_op",      # attention without FFN: zero FFN in GGUF
         "linear+ffn256",  # linear attention
         "no_op+no_op",    # empty layer: skipped
         "kv2+ffn64",      # the parent's attention, narrow FFN
         "kv1+no_op")      # last layer without FFN


def choices(names: Sequence[str]):
    from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant

    out = []
    for name in names:
        att, ffn = name.split("+")
        out.append(BlockChoice(AttentionVariant.parse(att), FFNVariant.parse(ffn)))
    return out


def make_bpe_tokenizer():
    """Byte-level BPE over printable ASCII plus a few merges; specials <unk>, <s>, </s> (ids 0-2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ"]  # byte-level stand-ins for space, \n
    merges = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("Ġ", "f"), ("o", "x"), ("Ġf", "ox")]
    merged = ["".join(m) for m in merges]
    vocab = {tok: i for i, tok in enumerate(specials + alphabet + merged)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def make_child(names: Sequence[str] = MIXED, seed: int = 0, **overrides):
    """A random child of a tiny Llama with the blocks `names` (e.g. "kv1+ffn128"), weights wide enough to matter."""
    from mlxkit.engines.models.decilm.convert import child_config
    from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM

    fields = {**TINY, "num_hidden_layers": len(names), **overrides}
    parent = make_tiny_llama(seed, **fields)
    config = child_config(parent.config, choices(names))
    config._attn_implementation = "eager"
    torch.manual_seed(seed + 1)
    child = MlxDeciLMForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in child.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.15)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)  # not all ones: a norm exported in the wrong place shows
            else:
                param.normal_(0.0, 0.05)
    return child


def save_dir(model, out: Path) -> Path:
    model.save_pretrained(out)
    make_bpe_tokenizer().save_pretrained(out)
    return out


def make_child_dir(out: Path, names: Sequence[str] = MIXED, seed: int = 0, **overrides) -> Path:
    return save_dir(make_child(names, seed, **overrides), out)


def make_parent_dir(out: Path, seed: int = 0, **overrides) -> Path:
    return save_dir(make_tiny_llama(seed, **{**TINY, **overrides}), out)


def make_qwen2_parent_dir(out: Path, seed: int = 0) -> Path:
    """A tiny Qwen2 parent: q/k/v biases and no o bias, RoPE theta 30000."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = {k: v for k, v in TINY.items() if k != "rope_theta"}
    torch.manual_seed(seed)
    config = Qwen2Config(**{**fields, "num_hidden_layers": 2}, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 30000.0})
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.15)
    return save_dir(model, out)


def token_ids(length: int = 48) -> list[int]:
    ids = make_bpe_tokenizer()(TEXT)["input_ids"]
    assert len(ids) >= length
    return [1] + ids[: length - 1]


@torch.no_grad()
def torch_logits(directory: Path, ids: Sequence[int]) -> torch.Tensor:
    """[T, V] float32 logits of the saved model (mlxkit's own class), eager attention."""
    import mlxkit  # noqa: F401  # registers mlx_decilm with the Auto classes
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    return model(torch.tensor([list(ids)])).logits[0].float()


def agreement(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, max |Δlogit| / max |reference logit|) over all positions."""
    top1 = (reference.argmax(-1) == other.argmax(-1)).float().mean().item()
    rel = ((reference - other).abs().max() / reference.abs().max()).item()
    return top1, rel


def deci_reference_logits(path: Path, ids: Sequence[int]) -> "np.ndarray":
    """Logits of a GGUF as llama.cpp's deci graph (src/models/deci.cpp) computes them, in numpy float64.

    A reading of that graph for tests on machines without llama-cpp-python; the `llamacpp`
    tests run llama.cpp itself. It keeps the graph's quirks: a layer with 0 heads passes its
    input on, a layer with heads and 0 KV heads is `attn_output @ norm(x)`, and a layer whose
    FFN length is 0 `continue`s before its attention output is added to the residual.
    """
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    weights = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
        [int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    heads, kv_heads, ffn = (field(f"deci.{k}") for k in ("attention.head_count", "attention.head_count_kv",
                                                          "feed_forward_length"))
    eps, base = field("deci.attention.layer_norm_rms_epsilon"), field("deci.rope.freq_base")
    hd = field("deci.attention.key_length")

    def linear(x, name):  # optional biases, as the loader takes them
        y = x @ weights[name + ".weight"].T
        return y + weights[name + ".bias"] if name + ".bias" in weights else y

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x):  # [T, H, hd], GGML "normal" mode: adjacent pairs
        t = np.arange(x.shape[0])[:, None]
        theta = t * base ** (-np.arange(0, hd, 2) / hd)[None, :]
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        return out

    x = weights["token_embd.weight"][list(ids)]
    n = x.shape[0]
    for il in range(field("deci.block_count")):
        b = f"blk.{il}."
        inp = x
        cur = x if heads[il] == 0 else norm(x, weights[b + "attn_norm.weight"])
        if heads[il] > 0 and kv_heads[il] == 0:
            cur = cur @ weights[b + "attn_output.weight"].T
        elif heads[il] > 0:
            q = rope(linear(cur, b + "attn_q").reshape(n, heads[il], hd))
            k = rope(linear(cur, b + "attn_k").reshape(n, kv_heads[il], hd))
            v = linear(cur, b + "attn_v").reshape(n, kv_heads[il], hd)
            group = heads[il] // kv_heads[il]
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
            scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            cur = linear(np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1), b + "attn_output")
        if ffn[il] == 0:
            continue
        ffn_inp = cur + inp if heads[il] > 0 else cur
        y = norm(ffn_inp, weights[b + "ffn_norm.weight"])
        gate, up = linear(y, b + "ffn_gate"), linear(y, b + "ffn_up")
        x = linear(gate / (1 + np.exp(-gate)) * up, b + "ffn_down") + ffn_inp
    x = norm(x, weights["output_norm.weight"])
    return x @ weights.get("output.weight", weights["token_embd.weight"]).T


# Run in a fresh interpreter where mlxkit cannot be imported: no site processing (so the editable
# install's path hook never loads), site-packages added by hand, and an import blocker on top.
_NO_MLXKIT = '''
import sys
sys.path.append({site!r})
class _NoMlxkit:
    def find_spec(self, name, path=None, target=None):
        if name == "mlxkit" or name.startswith("mlxkit."):
            raise ImportError("mlxkit is not installed here")
        return None
sys.meta_path.insert(0, _NoMlxkit())
try:
    import mlxkit
except ImportError:
    pass
else:
    raise SystemExit("mlxkit is importable")
import json, numpy, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({directory!r}, trust_remote_code=True, dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(torch.tensor([{ids!r}])).logits[0].float().numpy()
numpy.save({out!r}, logits)
print(json.dumps({{"class": type(model).__name__, "module": type(model).__module__,
                  "mlxkit_loaded": any(m == "mlxkit" or m.startswith("mlxkit.") for m in sys.modules)}}))
'''


def logits_without_mlxkit(directory: Path, ids: Sequence[int], work: Path) -> tuple["np.ndarray", dict]:
    import json
    import os
    import subprocess
    import sys
    import sysconfig

    import numpy as np

    out = work / "remote_logits.npy"
    script = _NO_MLXKIT.format(site=sysconfig.get_paths()["purelib"], directory=str(directory), ids=list(ids),
                               out=str(out))
    env = {**os.environ, "HF_MODULES_CACHE": str(work / "hf_modules"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run([sys.executable, "-I", "-S", "-c", script], cwd=work, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(out), json.loads(result.stdout.strip().splitlines()[-1])


def make_sentencepiece_style_tokenizer():
    """A Llama-2 style BPE (byte fallback, ▁ for spaces): the kind llama.cpp's converter reads for
    DeciLM checkpoints whose vocabulary is not Llama 3's. Returns (tokenizer, vocabulary size)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [".", ";", ","]
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("o", "x"), ("▁", "f"), ("▁f", "ox")]
    vocab_list = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + letters + \
        ["".join(m) for m in merges]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return fast, len(vocab_list)


def llama_cpp_logits(path: Path, ids: Sequence[int], *, all_positions: bool = True,
                     f32_cache: bool = True) -> "np.ndarray":
    """llama.cpp's logits for `ids` ([T, V], or [V] for the last position only), 1 thread, on the CPU.

    With `all_positions=False` llama.cpp is asked for the last position only, so the graph's
    selection of output rows (done inside the last layer) is exercised. The KV cache is F32
    unless `f32_cache=False` (llama.cpp's default is F16, which on a model with large
    activations costs more agreement than the export itself).
    """
    import numpy as np
    import llama_cpp

    cache_type = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if f32_cache else {}
    llm = llama_cpp.Llama(str(path), n_ctx=max(64, len(ids) + 8), n_threads=1, n_batch=512,
                          logits_all=all_positions, verbose=False, **cache_type)
    try:
        llm.eval(list(ids))
        if all_positions:
            return np.array(llm.scores[: len(ids)], dtype=np.float64)
        row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).astype(np.float64)
    finally:
        llm.close()


def export_literal_and_faithful(tmp_path: Path) -> Path:
    """A child with an attention + no-op-FFN layer, exported twice: `literal.gguf` with FFN length 0
    (what the deci graph drops the attention of) and `faithful.gguf` as `mlx export` writes it."""
    import dataclasses

    from mlxkit.engines.export import export_model, plan_export, run_export

    child = make_child_dir(tmp_path / "child", names=("kv2+ffn256", "kv1+no_op", "kv2+ffn256"))
    plan = plan_export(str(child), "gguf", tmp_path / "literal.gguf")
    literal = tuple(dataclasses.replace(g, n_ff=0, ffn="none") if g.ffn == "zero" else g for g in plan.gguf_layers)
    run_export(dataclasses.replace(plan, gguf_layers=literal))
    export_model(child, "gguf", tmp_path / "faithful.gguf")
    return child
