"""Turn a parent of a supported family into the heterogeneous class, and describe children of it."""

from __future__ import annotations

import contextlib
from typing import Container, Iterator, Sequence

import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.models import families
from mlxkit.engines.models.attention import prefer_sdpa
from mlxkit.engines.models.decilm.blocks import BlockChoice, ParentShape
from mlxkit.engines.models.decilm.configuration_mlx_decilm import MlxDeciLMConfig
from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM

# Which parents convert, and how their checkpoints map onto the child, is the family layer's
# (engines/models/families); this module builds the child from what a family says.
SUPPORTED_PARENTS = families.supported_model_types()
_CARRIED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                   "tie_word_embeddings", "rope_parameters", "attention_bias", "mlp_bias", "bos_token_id",
                   "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
                   # family fields a config of the family (or a child of one) spells as the child does
                   "qk_norm", "norm_weight_offset", "embedding_multiplier", "sandwich_norms",
                   "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")


def check_parent(config) -> None:
    """Refuse a parent whose family, or a feature of whose config, the child cannot reproduce (InputError)."""
    families.check_parent(config)


def child_config(parent_config, choices: Sequence[BlockChoice] | None = None) -> MlxDeciLMConfig:
    """The heterogeneous config of a child of `parent_config` (the parent itself when `choices` is None)."""
    family = families.check_parent(parent_config)
    fields = {k: getattr(parent_config, k) for k in _CARRIED_FIELDS if hasattr(parent_config, k)}
    if parent_config.model_type == "mlx_decilm":
        fields["num_key_value_heads"] = parent_config.parent_num_key_value_heads
        fields["intermediate_size"] = parent_config.parent_intermediate_size
    fields.update(family.fields_for(parent_config))
    fields["sliding_window"] = families.sliding_window(parent_config)
    fields["windowed_layers"] = families.windowed_layers(parent_config)
    fields["head_dim"] = getattr(parent_config, "head_dim", None) or \
        parent_config.hidden_size // parent_config.num_attention_heads
    shape = ParentShape.from_config(parent_config)
    if choices is not None:
        if len(choices) != shape.num_layers:
            raise InputError(f"{len(choices)} block choices for a parent of {shape.num_layers} layers")
        for choice in choices:
            choice.attention.validate(shape)
            choice.ffn.validate(shape)
        fields["block_configs"] = [c.to_block_config(shape) for c in choices]
    fields["parent_num_key_value_heads"] = shape.num_key_value_heads
    fields["parent_intermediate_size"] = shape.intermediate_size
    return MlxDeciLMConfig(**fields)


def from_parent(parent_model) -> MlxDeciLMForCausalLM:
    """The parent as an `MlxDeciLMForCausalLM` with every layer at the parent's shape (same weights).

    Tensors are shared with the parent, fused ones as row views; a tensor the family's checkpoints
    lack is zeros. The parent model itself is left as it was.
    """
    config = child_config(parent_model.config)
    config._attn_implementation = getattr(parent_model.config, "_attn_implementation", None) or \
        prefer_sdpa(config)._attn_implementation
    with torch.device("meta"):
        model = MlxDeciLMForCausalLM(config)
    stored = parent_model.state_dict()
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    sources = families.parent_sources(parent_model.config, shapes, stored)
    weight = next(parent_model.parameters())
    missing = sorted({s.name for s in sources.values() if s.name is not None and s.name not in stored})
    used = {s.name for s in sources.values()}
    unexpected = [k for k in stored if k not in used and "rotary_emb" not in k
                  and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise InputError(f"parent weights do not match the {families.family_of(parent_model.config).name} layout: "
                         f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    state = {}
    for name, source in sources.items():
        if source.name is None:
            state[name] = torch.zeros(shapes[name], dtype=weight.dtype, device=weight.device)
        else:
            tensor = stored[source.name]
            state[name] = tensor if source.rows is None else tensor[source.rows[0]:source.rows[1]]
        if tuple(state[name].shape) != shapes[name]:
            raise InputError(f"parent tensor for '{name}' has shape {tuple(state[name].shape)}; the converted "
                             f"parent needs {shapes[name]}")
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(weight.dtype)
    # The RoPE buffers were on meta. They are computed on the CPU and kept in float32 whatever
    # the weights' dtype, as transformers keeps them: bfloat16 frequencies would turn the
    # angles of late positions into noise.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(weight.device)
    return model.eval()


def parent_skeleton(parent_config) -> MlxDeciLMForCausalLM:
    """The parent of `parent_config` as an `MlxDeciLMForCausalLM` on the meta device: no weights, but
    real RoPE buffers (computed on the CPU in float32, as `from_parent` makes them).

    Parameters do not require gradients: a parent is only ever run.
    """
    config = child_config(parent_config)
    config._attn_implementation = getattr(parent_config, "_attn_implementation", None) or \
        prefer_sdpa(config)._attn_implementation
    with torch.device("meta"):
        model = MlxDeciLMForCausalLM(config)
    model.requires_grad_(False)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()


def parent_file_name(name: str, parent_config, stored: Container[str]) -> str | None:
    """The name, in the parent's own checkpoint (whose tensor names are `stored`), of the converted
    parent's tensor `name`; None for a tensor `from_parent` fills with zeros.

    The family layout and the converted class share their names; a tied head is the embedding; a
    tensor the family's checkpoints may lack (Qwen2's o_proj bias) is held as zeros. A tensor that
    a family stores fused with others has no name of its own: `parent_sources` gives its rows.
    """
    family = families.family_of(parent_config)
    if name == "lm_head.weight" and parent_config.tie_word_embeddings:
        return "model.embed_tokens.weight"
    if name.startswith(families.LAYER_PREFIX):
        rest = name[len(families.LAYER_PREFIX):].split(".", 1)[1]
        part = family.fused_part(rest)
        if part is not None:
            raise InputError(f"'{name}' is stored in rows of '{part[0].stored}' by {family.name} parents; "
                             "read it through parent_sources")
        if rest in family.renamed:
            return name[: -len(rest)] + family.renamed[rest]
        if rest in family.absent_as_zeros and name not in stored:
            return None
    return name


def parent_sources(parent_config, model: MlxDeciLMForCausalLM, stored: Container[str]) -> dict[str, families.Source]:
    """For each tensor of the converted parent `model` (real or on meta), where the parent's checkpoint
    (whose tensor names are `stored`) holds it: a whole tensor, a row range of a fused one, or nothing."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return families.parent_sources(parent_config, shapes, stored)


class StreamedParent:
    """A parent whose decoder layers stay in its safetensors files until they are held.

    `model` is the converted parent (`from_parent`'s class and names) with its embedding, final
    norm, head and RoPE buffers resident on `device` in `dtype`, and every decoder layer on the
    meta device. `hold(i)` reads layer i one tensor at a time (`LazyTensorLoader`), cast to
    `dtype` as `from_pretrained(dtype=...)` casts, and gives it back to the meta device when the
    last holder exits. Every tensor read is checked for NaN and infinity, the check
    `check_finite_weights` makes of a resident parent.
    """

    streamed = True

    def __init__(self, model: MlxDeciLMForCausalLM, loader, sources: dict[str, families.Source], *,
                 dtype: torch.dtype, device: torch.device, spec: str) -> None:
        self.model, self.loader, self.sources = model, loader, sources
        self.dtype, self.device, self.spec = dtype, device, spec
        self._holders: dict[int, int] = {}

    @classmethod
    def open(cls, directory, parent_config, *, dtype: torch.dtype, device: torch.device | str,
             spec: str) -> "StreamedParent | None":
        """The parent stored at `directory`, or None when its files do not hold exactly the tensors
        (names and shapes) the converted class expects, in which case only a full load can read it."""
        from mlxkit.engines.io.lazy_loader import LazyTensorLoader

        check_parent(parent_config)
        model = parent_skeleton(parent_config)
        loader = LazyTensorLoader.from_path(directory)
        sources = parent_sources(parent_config, model, loader.index)
        if not _stored_as_described(sources, model, loader):
            loader.close()
            return None
        device = torch.device(device)
        parent = cls(model, loader, sources, dtype=dtype, device=device, spec=spec)
        model.model.rotary_emb.to(device)
        tied = model.config.tie_word_embeddings
        names = [name for name in sources if not name.startswith("model.layers.")
                 and not (tied and name == "lm_head.weight")]  # a tied head is the embedding, read once
        model.load_state_dict(parent._read(names), strict=False, assign=True)
        if tied:
            model.tie_weights()
        return parent

    @property
    def config(self):
        return self.model.config

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The converted parent's tensors `names`, from the files, in the compute dtype on the device.

        A fused stored tensor is read once for all the names it holds, which are row views of it.
        """
        from mlxkit.engines.errors import NonFiniteError

        stored: dict[str, torch.Tensor] = {}
        out = {}
        for name in names:
            source = self.sources[name]
            if source.name is None:
                out[name] = torch.zeros(self.model.get_parameter(name).shape, dtype=self.dtype, device=self.device)
                continue
            if source.name not in stored:
                tensor = self.loader.get_tensor(source.name)
                if tensor.is_floating_point():
                    tensor = tensor.to(self.dtype)
                    if not torch.isfinite(tensor).all():
                        raise NonFiniteError(f"model '{self.spec}' has NaN or infinite values in '{source.name}'")
                stored[source.name] = tensor.to(self.device)
            tensor = stored[source.name]
            out[name] = tensor if source.rows is None else tensor[source.rows[0]:source.rows[1]]
        return out

    def sampled_values(self, name: str, stride: int, count: int) -> torch.Tensor:
        """`tensor.reshape(-1)[::stride][:count]` of the converted parent's tensor `name`, in float32 on the
        CPU, read element by element (the values `model_fingerprint` samples, without reading the tensor)."""
        source = self.sources[name]
        shape = self.model.get_parameter(name).shape
        indices = range(0, shape.numel(), stride)[:count]
        if source.name is None:
            return torch.zeros(len(indices), dtype=torch.float32)
        # Rows of a fused tensor are contiguous in it: the part's elements start at its first row's.
        offset = source.rows[0] * (shape.numel() // shape[0]) if source.rows is not None else 0
        values = self.loader.get_elements(source.name, [offset + i for i in indices])
        return values.to(self.dtype).to(torch.float32)

    def layer_names(self, index: int) -> list[str]:
        prefix = f"model.layers.{index}."
        return [name for name in self.sources if name.startswith(prefix)]

    @contextlib.contextmanager
    def hold(self, index: int) -> Iterator[torch.nn.Module]:
        """Decoder layer `index`, read from the files for as long as someone holds it."""
        layer = self.model.model.layers[index]
        if not self._holders.get(index):
            prefix = f"model.layers.{index}."
            tensors = self._read(self.layer_names(index))
            layer.load_state_dict({name[len(prefix):]: tensor for name, tensor in tensors.items()},
                                  strict=True, assign=True)
        self._holders[index] = self._holders.get(index, 0) + 1
        try:
            yield layer
        finally:
            self._holders[index] -= 1
            if not self._holders[index]:
                layer.to(device="meta")

    def held(self) -> list[int]:
        """The layers resident now."""
        return sorted(i for i, n in self._holders.items() if n)

    def close(self) -> None:
        self.loader.close()


def _stored_as_described(sources: dict[str, families.Source], model: MlxDeciLMForCausalLM, loader) -> bool:
    """Whether the files hold every source with the shape the converted class needs (a fused tensor: all
    its rows, each part's width)."""
    state = model.state_dict()
    rows: dict[str, int] = {}
    for name, source in sources.items():
        if source.name is None:
            continue
        if source.name not in loader.index:
            return False
        stored, needed = loader.info(source.name).shape, tuple(state[name].shape)
        if source.rows is None and stored != needed:
            return False
        if source.rows is not None:
            if tuple(stored[1:]) != needed[1:]:
                return False
            rows[source.name] = max(rows.get(source.name, 0), source.rows[1])
    return all(loader.info(name).shape[0] == count for name, count in rows.items())


class ResidentParent:
    """A parent held whole in memory, behind `StreamedParent`'s interface (`hold` costs nothing)."""

    streamed = False

    def __init__(self, model: MlxDeciLMForCausalLM) -> None:
        self.model = model

    @property
    def config(self):
        return self.model.config

    @contextlib.contextmanager
    def hold(self, index: int) -> Iterator[torch.nn.Module]:
        yield self.model.model.layers[index]

    def held(self) -> list[int]:
        return list(range(len(self.model.model.layers)))

    def close(self) -> None:
        pass
