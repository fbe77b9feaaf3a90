"""The child architecture's source, made self-contained for an exported directory (`trust_remote_code`).

The configuration and modeling files of `mlx_decilm` (and the block vocabulary they read
`block_configs` with) are copied from this installation into the output, their mlxkit
imports rewritten to relative ones, so `AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)` works where mlxkit is not installed. The copy is the code that ran
here, not a second implementation that could drift.
"""

from __future__ import annotations

import re
from pathlib import Path

from mlxkit.engines.errors import BackendError

_DECILM_PACKAGE = "mlxkit.engines.models.decilm"
_SOURCE_FILES = ("blocks.py", "configuration_mlx_decilm.py", "modeling_mlx_decilm.py")
# mlxkit.engines.errors has no imports of its own, so it travels as one more file.
_ERRORS_FILE = "errors_mlx_decilm.py"
_REWRITES = (
    (re.compile(r"\bfrom mlxkit\.engines\.models\.decilm\.(\w+) import\b"), r"from .\1 import"),
    (re.compile(r"\bfrom mlxkit\.engines\.errors import\b"), f"from .{_ERRORS_FILE[:-3]} import"),
)
_MLXKIT_IMPORT = re.compile(r"^\s*(?:from\s+mlxkit\b|import\s+mlxkit\b)", re.MULTILINE)

MLX_AUTO_MAP = {"AutoConfig": "configuration_mlx_decilm.MlxDeciLMConfig",
                "AutoModelForCausalLM": "modeling_mlx_decilm.MlxDeciLMForCausalLM"}
NAS_AUTO_MAP = {"AutoConfig": "configuration_decilm.DeciLMConfig",
                "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM"}

_NAS_CONFIGURATION = '''"""Nemotron-NAS config (`model_type="nemotron-nas"`), on the mlx_decilm child config beside it.

Public DeciLM `block_configs` carry `n_heads_in_group` and `ffn_mult`; the base class turns
them into exact KV-head counts and widths (DeciLM's rule: ceil_256(int(2*ffn_mult*hidden/3))).
Serving engines (vLLM, SGLang, TensorRT-LLM) read each entry as an object
(`config.block_configs[i].attention.no_op`, `.ffn.ffn_mult`), as NVIDIA's own configuration
classes provide; the model code beside this file reads them as mappings. `BlockFields` is
both, and being a dict it serialises to the public JSON unchanged.
Written by mlxkit's `mlx export --format nemotron-nas`.
"""

from .configuration_mlx_decilm import MlxDeciLMConfig


class BlockFields(dict):
    """A mapping whose keys are also attributes; a missing key is an AttributeError, so `hasattr` works."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _as_fields(block):
    return BlockFields({key: BlockFields(value) if isinstance(value, dict) else value
                        for key, value in dict(block).items()})


class DeciLMConfig(MlxDeciLMConfig):
    model_type = "nemotron-nas"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.block_configs = [_as_fields(block) for block in self.block_configs]
        self.architectures = ["DeciLMForCausalLM"]
'''

_NAS_MODELING = '''"""Nemotron-NAS model class for this directory: the mlx_decilm child model under the public names.

Tensor names are the public DeciLM ones (self_attn.{q,k,v,o}_proj, self_attn.linear_attn,
mlp.{gate,up,down}_proj, mlp.linear_mlp). Written by mlxkit's `mlx export --format nemotron-nas`.
"""

from .configuration_decilm import DeciLMConfig
from .modeling_mlx_decilm import MlxDeciLMForCausalLM


class DeciLMForCausalLM(MlxDeciLMForCausalLM):
    config_class = DeciLMConfig
'''


def _source_dir() -> Path:
    import importlib

    return Path(importlib.import_module(f"{_DECILM_PACKAGE}.modeling_mlx_decilm").__file__).parent


def _self_contained(name: str, text: str) -> str:
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    if _MLXKIT_IMPORT.search(text):
        # A new mlxkit import in the architecture files must be made portable here, not shipped broken.
        line = _MLXKIT_IMPORT.search(text).group(0).strip()  # type: ignore[union-attr]
        raise BackendError(f"{name} imports from mlxkit ({line!r}) in a way export cannot make self-contained")
    return text


def remote_code_files(flavour: str) -> tuple[dict[str, str], dict[str, str]]:
    """The files to write (name -> text) and the config's `auto_map`, for "mlx_decilm" or "nemotron-nas"."""
    import mlxkit.engines.errors as errors_module

    source = _source_dir()
    files = {name: _self_contained(name, (source / name).read_text()) for name in _SOURCE_FILES}
    files[_ERRORS_FILE] = _self_contained(_ERRORS_FILE, Path(errors_module.__file__).read_text())
    if flavour == "mlx_decilm":
        return files, dict(MLX_AUTO_MAP)
    files["configuration_decilm.py"] = _NAS_CONFIGURATION
    files["modeling_decilm.py"] = _NAS_MODELING
    return files, dict(NAS_AUTO_MAP)
