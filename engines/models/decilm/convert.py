"""Turn a Llama-family parent into the heterogeneous class, and describe children of it."""

from __future__ import annotations

import contextlib
from typing import Container, Iterator, Sequence

import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.models.decilm.blocks import BlockChoice, ParentShape
from mlxkit.engines.models.decilm.configuration_mlx_decilm import MlxDeciLMConfig
from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM

# Llama-shaped families: pre-norm, RoPE, SwiGLU, separate q/k/v/o projections (Qwen3 adds per-head q/k norms).
SUPPORTED_PARENTS = {"llama", "mistral", "qwen2", "qwen3", "mlx_decilm"}
_CARRIED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                   "tie_word_embeddings", "rope_parameters", "attention_bias", "mlp_bias", "bos_token_id",
                   "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "qk_norm")


def check_parent(config) -> None:
    if config.model_type not in SUPPORTED_PARENTS:
        raise InputError(f"Puzzle needs a Llama-family parent ({', '.join(sorted(SUPPORTED_PARENTS))}); "
                         f"got model_type '{config.model_type}'")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
        raise InputError("parents with sliding-window attention are not supported yet")


def child_config(parent_config, choices: Sequence[BlockChoice] | None = None) -> MlxDeciLMConfig:
    """The heterogeneous config of a child of `parent_config` (the parent itself when `choices` is None)."""
    check_parent(parent_config)
    if parent_config.model_type == "mlx_decilm":
        fields = {k: getattr(parent_config, k) for k in _CARRIED_FIELDS if hasattr(parent_config, k)}
        fields["num_key_value_heads"] = parent_config.parent_num_key_value_heads
        fields["intermediate_size"] = parent_config.parent_intermediate_size
    else:
        fields = {k: getattr(parent_config, k) for k in _CARRIED_FIELDS if hasattr(parent_config, k)}
    if parent_config.model_type == "qwen2":
        # Qwen2 has q/k/v biases but no o bias; our GQA block uses one flag for all four.
        fields["attention_bias"] = True
    if parent_config.model_type == "qwen3":
        fields["qk_norm"] = True
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
    """The parent as an `MlxDeciLMForCausalLM` with every layer at the parent's shape (same weights)."""
    config = child_config(parent_model.config)
    if parent_model.config.model_type == "qwen2":
        _add_zero_o_proj_bias(parent_model)
    config._attn_implementation = getattr(parent_model.config, "_attn_implementation", None) or "sdpa"
    with torch.device("meta"):
        model = MlxDeciLMForCausalLM(config)
    state = parent_model.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if missing or unexpected:
        raise InputError(f"parent weights do not match the Llama layout: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    weight = next(parent_model.parameters())
    model = model.to(weight.dtype)
    # The RoPE buffers were on meta. They are computed on the CPU and kept in float32 whatever
    # the weights' dtype, as transformers keeps them: bfloat16 frequencies would turn the
    # angles of late positions into noise.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(weight.device)
    return model.eval()


def _add_zero_o_proj_bias(parent_model) -> None:
    for layer in parent_model.model.layers:
        o_proj = layer.self_attn.o_proj
        if o_proj.bias is None:
            o_proj.bias = torch.nn.Parameter(torch.zeros(o_proj.out_features, dtype=o_proj.weight.dtype,
                                                         device=o_proj.weight.device))


def parent_skeleton(parent_config) -> MlxDeciLMForCausalLM:
    """The parent of `parent_config` as an `MlxDeciLMForCausalLM` on the meta device: no weights, but
    real RoPE buffers (computed on the CPU in float32, as `from_parent` makes them).

    Parameters do not require gradients: a parent is only ever run.
    """
    config = child_config(parent_config)
    config._attn_implementation = getattr(parent_config, "_attn_implementation", None) or "sdpa"
    with torch.device("meta"):
        model = MlxDeciLMForCausalLM(config)
    model.requires_grad_(False)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()


def parent_file_name(name: str, parent_config, stored: Container[str]) -> str | None:
    """The name, in the parent's own checkpoint (whose tensor names are `stored`), of the converted
    parent's tensor `name`; None for a tensor `from_parent` fills with zeros.

    The Llama-family layout and the converted class share their names; a tied head is the
    embedding; Qwen2 checkpoints have no o_proj bias, which the converted class holds as zeros.
    """
    if name == "lm_head.weight" and parent_config.tie_word_embeddings:
        return "model.embed_tokens.weight"
    if name not in stored and parent_config.model_type == "qwen2" and name.endswith(".self_attn.o_proj.bias"):
        return None
    return name


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

    def __init__(self, model: MlxDeciLMForCausalLM, loader, files: dict[str, str | None], *, dtype: torch.dtype,
                 device: torch.device, spec: str) -> None:
        self.model, self.loader, self.files = model, loader, files
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
        files: dict[str, str | None] = {}
        for name, tensor in model.state_dict().items():
            files[name] = parent_file_name(name, parent_config, loader.index)
            if files[name] is not None and (files[name] not in loader.index
                                            or loader.info(files[name]).shape != tuple(tensor.shape)):
                loader.close()
                return None
        device = torch.device(device)
        parent = cls(model, loader, files, dtype=dtype, device=device, spec=spec)
        model.model.rotary_emb.to(device)
        tied = model.config.tie_word_embeddings
        names = [name for name in files if not name.startswith("model.layers.")
                 and not (tied and name == "lm_head.weight")]  # a tied head is the embedding, read once
        model.load_state_dict({name: parent._read(name) for name in names}, strict=False, assign=True)
        if tied:
            model.tie_weights()
        return parent

    @property
    def config(self):
        return self.model.config

    def _read(self, name: str) -> torch.Tensor:
        """The converted parent's tensor `name`, from the files, in the compute dtype on the device."""
        from mlxkit.engines.errors import NonFiniteError

        file_name = self.files[name]
        if file_name is None:
            shape = self.model.get_parameter(name).shape
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        tensor = self.loader.get_tensor(file_name)
        if tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
            if not torch.isfinite(tensor).all():
                raise NonFiniteError(f"model '{self.spec}' has NaN or infinite values in '{file_name}'")
        return tensor.to(self.device)

    def sampled_values(self, name: str, stride: int, count: int) -> torch.Tensor:
        """`tensor.reshape(-1)[::stride][:count]` of the converted parent's tensor `name`, in float32 on the
        CPU, read element by element (the values `model_fingerprint` samples, without reading the tensor)."""
        file_name = self.files[name]
        indices = range(0, self.model.get_parameter(name).numel(), stride)[:count]
        if file_name is None:
            return torch.zeros(len(indices), dtype=torch.float32)
        values = self.loader.get_elements(file_name, indices)
        return values.to(self.dtype).to(torch.float32)

    def layer_names(self, index: int) -> list[str]:
        prefix = f"model.layers.{index}."
        return [name for name in self.files if name.startswith(prefix)]

    @contextlib.contextmanager
    def hold(self, index: int) -> Iterator[torch.nn.Module]:
        """Decoder layer `index`, read from the files for as long as someone holds it."""
        layer = self.model.model.layers[index]
        if not self._holders.get(index):
            prefix = f"model.layers.{index}."
            layer.load_state_dict({name[len(prefix):]: self._read(name) for name in self.layer_names(index)},
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
