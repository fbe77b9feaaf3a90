"""`mlx export`: a child (or parent) in the formats models are served from.

`export_model(model_dir, format, out, encoding=...)` is the one entry point: `gguf` (llama.cpp,
`deci` architecture), `nemotron-nas` (NVIDIA's public HF layout) or `hf` (a self-contained HF
directory that loads with `trust_remote_code=True` where mlxkit is not installed).
"""

from mlxkit.engines.export.plan import ENCODINGS, FORMATS, ExportPlan, check_exportable, ffn_expressible, plan_export
from mlxkit.engines.export.run import describe_plan, export_model, gguf_manifest_path, run_export

__all__ = ["ENCODINGS", "FORMATS", "ExportPlan", "check_exportable", "describe_plan", "export_model", "ffn_expressible",
           "gguf_manifest_path", "plan_export", "run_export"]
