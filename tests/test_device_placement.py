"""Every tensor the Puzzle engines create lands on the device of the model or tensors they are given.

The tests run on a CPU-only torch, so the model is put on the *meta* device instead of a GPU:
meta tensors carry a device, a dtype and a shape but no data, and an operation that mixes
one with a CPU tensor (other than a 0-d scalar) raises, exactly as DEVICE does when it meets a
CPU tensor. A tensor an engine function makes without naming a device lands on the CPU
and fails the same way.

(`FakeTensorMode` with fake CUDA tensors would be closer to a GPU, but on a torch built
without CUDA every Python indexing of a fake CUDA tensor - `x[:, :-1]`, `x[..., None]`,
`x[index]` - asks for a CUDA device guard and fails with "not linked with support for cuda",
so the engines' ordinary tensor code cannot run under it.)

Each test moves a tiny CPU model to meta (its parameters and buffers replaced by meta
tensors of the same shape), feeds it meta inputs, runs the engine function and checks where
its outputs live. Meta tensors hold no values, so nothing here reads one (`.item()` is out),
and the parts of the engines that read files or values are kept apart from the tensor math
these tests run. The first test shows the harness fails on a CPU tensor, so a pass means something.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_llama
from mlxkit.engines.distill.losses import cosine_distance_sum, logit_term_sums
from mlxkit.engines.eval.metrics import kl_per_position
from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant
from mlxkit.engines.models.decilm.convert import from_parent
from mlxkit.engines.puzzle.library import activations
from mlxkit.engines.puzzle.search import assemble
from mlxkit.engines.puzzle.library.block_init import initialise, kv_head_groups, least_squares_map
from mlxkit.engines.puzzle.library.scoring import ParentTail, replaced_log_probs
from mlxkit.engines.puzzle.subblocks import parent_subblock

DEVICE = torch.device("meta")  # stands in for the GPU: not the CPU, and mixing the two raises
# A CPU tensor meeting a meta one raises RuntimeError; pulling a meta tensor onto the CPU
# (where real CUDA would copy it back silently) raises NotImplementedError.
DEVICE_ERRORS = (RuntimeError, NotImplementedError)
SEQ = 12
ATTENTION = [AttentionVariant("gqa", 2), AttentionVariant("gqa", 1), AttentionVariant("linear"),
             AttentionVariant("no_op")]
FFN = [FFNVariant("mlp", 64), FFNVariant("mlp", 24), FFNVariant("linear"), FFNVariant("no_op")]


@pytest.fixture
def on_device():
    """No gradients (nothing here trains); yields the function that moves a CPU-built module onto DEVICE."""
    with torch.no_grad():
        yield _to_device


def _to_device(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Every parameter and buffer replaced by a DEVICE tensor (floating parameters in `dtype` when given).

    Buffers keep their dtype: RoPE frequencies stay float32, as a loaded model keeps them.
    """
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                target = dtype if dtype is not None and p.is_floating_point() else p.dtype
                mod._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device=DEVICE, dtype=target),
                                                           requires_grad=False)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = torch.empty_like(b, device=DEVICE)
    return model


def _cpu_parent():
    parent = from_parent(make_tiny_llama())
    parent.config._attn_implementation = "sdpa"
    return parent


def _assert_on_device(tensors, what: str) -> None:
    for name, tensor in tensors:
        assert tensor.device == DEVICE, f"{what}: {name} is on {tensor.device}"


def _all_tensors(module: torch.nn.Module):
    return [*module.named_parameters(), *module.named_buffers()]


def _states(parent, n: int = 3):
    """Residual states at layer 0: (pos, h, mid, out), from the engine's own activation math."""
    ids = torch.randint(3, 128, (n, SEQ), device=DEVICE)
    pos = activations.position_embeddings(parent, SEQ)
    states = activations.embedded_states(parent, {"train": ids})
    tensors, nxt = activations.layer_states(parent.model.layers[0], states, pos, batch_sequences=2)
    return ids, pos, tensors["train_in"], tensors["train_mid"], nxt["train"]


def test_the_harness_catches_a_tensor_made_on_the_cpu(on_device):
    parent = on_device(_cpu_parent())
    x = torch.randn(2, SEQ, 32, device=DEVICE)
    with pytest.raises(RuntimeError, match="device"):
        x + torch.ones(32)  # a CPU tensor meeting a DEVICE one
    # RoPE made from positions and a dummy created without a device, as activations.position_embeddings
    # once did: on CUDA cos/sin follow the dummy to the CPU, and the attention that uses them fails.
    with pytest.raises(DEVICE_ERRORS):
        pos = parent.model.rotary_emb(torch.zeros(1, SEQ, 32), position_ids=torch.arange(SEQ).unsqueeze(0))
        parent.model.layers[0].attention_delta(x, pos)
    with pytest.raises(RuntimeError, match="device"):
        flat = x.reshape(-1, 32)
        gram = flat.T @ flat
        gram + torch.eye(gram.shape[0])  # an identity made without a device, as least_squares_map once did


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_caching_math_stays_on_the_model_device(on_device, dtype):
    parent = on_device(_cpu_parent(), dtype)
    assert parent.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.randint(3, 128, (5, SEQ), device=DEVICE)
    pos = activations.position_embeddings(parent, SEQ)
    _assert_on_device(zip(("cos", "sin"), pos), "position embeddings")
    assert pos[0].dtype == dtype, "cos/sin come in the compute dtype, as the full model's forward makes them"
    states = activations.embedded_states(parent, {"train": ids, "val": ids[:2]})
    for layer in parent.model.layers:
        tensors, states = activations.layer_states(layer, states, pos, batch_sequences=2)
        _assert_on_device(tensors.items(), "cached layer states")
        assert all(t.dtype == dtype for t in tensors.values())
    _assert_on_device(states.items(), "final states")


@pytest.mark.parametrize("parent_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,variant", [("attention", v) for v in ATTENTION] + [("ffn", v) for v in FFN],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_block_init_builds_every_variant_on_the_parent_device(on_device, kind, variant, parent_dtype):
    parent = on_device(_cpu_parent(), parent_dtype)
    _, pos, h, mid, out = _states(parent)
    x, y = (h, mid - h) if kind == "attention" else (mid, out - mid)
    source = parent_subblock(parent, 0, kind)
    _assert_on_device(_all_tensors(source), "parent subblock")
    for dtype in (None, torch.float32):  # the parent's dtype, and BLD's float32 master weights
        block = initialise(source, variant, parent.config, 0, x, y.float(), dtype=dtype)
        _assert_on_device(_all_tensors(block), f"initialised {kind} {variant.name}")
        assert all(p.dtype == (dtype or parent_dtype) for p in block.parameters())
        delta = block(x, pos) if kind == "attention" else block(x)
        assert delta.device == DEVICE


def test_block_init_helpers_create_on_the_input_device(on_device):
    x = torch.randn(40, 8, device=DEVICE)
    assert least_squares_map(x, torch.randn(40, 4, device=DEVICE)).device == DEVICE
    assert all(g.device == DEVICE for g in kv_head_groups(4, 2, 1, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scoring_stays_on_the_model_device(on_device, dtype):
    parent = on_device(_cpu_parent(), dtype)
    ids, pos, h, mid, out = _states(parent)
    final = out
    for layer in parent.model.layers[1:]:
        final = layer(final, pos)
    tail = ParentTail(parent, ids, final, pos)
    assert tail.parent_logp.device == DEVICE and tail.parent_logp.dtype == torch.float32
    _assert_on_device(tail.metric_tensors(tail.parent_logp).items(), "parent metrics")
    for kind, variant, x, y in (("attention", AttentionVariant("gqa", 1), h, mid - h),
                                ("ffn", FFNVariant("linear"), mid, out - mid)):
        block = initialise(parent_subblock(parent, 0, kind), variant, parent.config, 0, x, y)
        logp = replaced_log_probs(tail, block, 0, h, mid)
        assert logp.device == DEVICE and logp.dtype == torch.float32, "log-softmax is taken in float32"
        metrics = tail.metric_tensors(logp)
        _assert_on_device(metrics.items(), f"metrics of {kind} {variant.name}")
        assert all(m.dtype == torch.float32 for m in metrics.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_assembly_builds_the_child_on_the_parent_device(on_device, dtype):
    parent = on_device(_cpu_parent(), dtype)
    ids, _, h, mid, out = _states(parent)
    choices = [BlockChoice(AttentionVariant("gqa", 1), FFNVariant("mlp", 24)),
               BlockChoice(AttentionVariant("no_op"), FFNVariant("linear"))]
    blocks = {}
    for layer, choice in enumerate(choices):
        for kind, variant, x, y in (("attention", choice.attention, h, mid - h), ("ffn", choice.ffn, mid, out - mid)):
            if variant.kind != "no_op":
                block = initialise(parent_subblock(parent, layer, kind), variant, parent.config, layer, x, y,
                                   dtype=torch.float32)  # as BLD saves them: another dtype than the child's
                blocks[(layer, kind)] = block.weights()
    child = assemble.child_from_blocks(parent, choices, blocks)
    _assert_on_device(_all_tensors(child), "assembled child")
    assert all(p.dtype == dtype for p in child.parameters())
    assert child.model.rotary_emb.inv_freq.dtype == torch.float32
    logits = child(ids).logits
    assert logits.device == DEVICE


def test_losses_stay_on_the_device_and_in_float32(on_device):
    h_s = [torch.randn(2, SEQ, 32, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    h_t = [torch.randn(2, SEQ, 32, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    cosine = cosine_distance_sum(h_s, h_t)
    assert cosine.device == DEVICE and cosine.dtype == torch.float32
    head_s, head_t = on_device(torch.nn.Linear(32, 128, bias=False)), on_device(torch.nn.Linear(32, 128, bias=False))
    ids = torch.randint(0, 128, (2, SEQ), device=DEVICE)
    sums = logit_term_sums(h_s[-1].float(), h_t[-1].float(), ids, head_s, head_t, with_kl=True, with_nll=True, chunk=7)
    for name in ("kl", "nll"):
        value = getattr(sums, name)
        assert value.device == DEVICE and value.dtype == torch.float32, name
    kl = kl_per_position(torch.randn(5, 128, device=DEVICE, dtype=torch.bfloat16),
                         torch.randn(5, 128, device=DEVICE, dtype=torch.bfloat16))
    assert kl.device == DEVICE and kl.dtype == torch.float32

