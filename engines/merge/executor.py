"""Execute a merge plan tensor by tensor.

For each task: read the base tensor and each input's tensor (or LoRA factors), combine them on
the compute device, and hand the result on. At any time memory holds the T input tensors, the
base, the result and the method's workspace for one tensor name: (T + 2) × the largest tensor
plus workspace, never a whole model. Data-aware methods also get each input's calibration
statistics for that tensor (a Gram matrix or Fisher values), read the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch

from mlxkit.engines.core.finite import all_finite
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import NonFiniteError
from mlxkit.engines.io.tensor_writer import TensorWriter
from mlxkit.engines.merge.methods.base import MergeMethod, TensorJob
from mlxkit.engines.merge.plan import MergePlan, TensorTask
from mlxkit.engines.merge.sources import MergeInput

if TYPE_CHECKING:
    from mlxkit.engines.merge.statistics import ModelStatistics


class NonFiniteTensorError(NonFiniteError):
    """A merged tensor holds NaN or infinity. It is refused, never written: a checkpoint with one
    non-finite weight produces NaN logits for every token."""



def combine(plan: MergePlan, method: MergeMethod, inputs: list[MergeInput], base: Optional[MergeInput],
            device: torch.device, reporter: Reporter, statistics: Optional[Sequence["ModelStatistics"]] = None
            ) -> Iterator[tuple[TensorTask, Optional[torch.Tensor], torch.Tensor]]:
    """Yield (task, base tensor in float32 or None, result). The result is the combined delta M
    for task-vector methods, the merged weight otherwise, and the stored tensor for copies.
    `statistics` (data-aware methods), one per input, give each job its tensor's statistics."""
    for task in reporter.track(plan.tasks, f"merging ({plan.method})"):
        sources = task.sources or [(i, task.name) for i in range(len(inputs))]
        base_name = task.base_name or (task.name if base is not None else None)
        if task.action == "copy":
            # non-float buffers come from the base (LoRA inputs have none), else the first source
            stored = base.loader.get_tensor(base_name) if base is not None and base_name else \
                inputs[sources[0][0]].loader.get_tensor(sources[0][1])
            yield task, None, stored
            continue
        if task.vocab_rows is not None and plan.vocab is not None:
            # rows re-indexed by token (vocab.py): every input's rows then index the output's tokens
            base_t, tensors = plan.vocab.read(sources, base_name, inputs, base)
            if method.uses_deltas:
                tensors = [t.sub_(base_t) for t in tensors]
        else:
            base_t = base.loader.get_tensor(base_name).float() if base is not None and base_name else None
            if method.uses_deltas:
                tensors = [inputs[i].delta(name, base_t) for i, name in sources]
            else:
                tensors = [inputs[i].weight(name, base_t) for i, name in sources]
        tensors = [t.to(device) for t in tensors]
        job = TensorJob(task.name, task.matrix, dict(task.params), [dict(p) for p in task.model_params], task.seed,
                        base=base_t.to(device) if base_t is not None else None,
                        # statistics index an input's stored rows, not the re-indexed ones: left out there
                        statistics=None if task.vocab_rows is not None else _statistics_of(statistics, sources,
                                                                                            device))
        result = method.merge(tensors, job).to("cpu", torch.float32)
        if not all_finite(result):
            raise _non_finite(task.name, method, [inputs[i] for i, _ in sources], tensors, base, base_t)
        del tensors
        yield task, base_t, result


def _statistics_of(statistics: Optional[Sequence["ModelStatistics"]], sources: list[tuple[int, str]],
                   device: torch.device) -> Optional[list[torch.Tensor]]:
    """Each source's statistics for its tensor, on `device`; None unless every source has some."""
    if statistics is None:
        return None
    found = [statistics[i].get(name) for i, name in sources]
    if any(value is None for value in found):
        return None
    return [value.to(device) for value in found]


def _non_finite(name: str, method: MergeMethod, inputs: list[MergeInput], tensors: list[torch.Tensor],
                base: Optional[MergeInput], base_t: Optional[torch.Tensor]) -> NonFiniteTensorError:
    """Name the culprit of a non-finite result; only runs on failure, so the inputs are checked for free."""
    if base is not None and base_t is not None and not all_finite(base_t):
        return NonFiniteTensorError(f"the base model '{base.spec}' has NaN or infinite values in '{name}'")
    for inp, tensor in zip(inputs, tensors):
        if not all_finite(tensor):
            return NonFiniteTensorError(f"model '{inp.spec}' has NaN or infinite values in '{name}'")
    return NonFiniteTensorError(f"merging '{name}' with {method.name} produced NaN or infinite values "
                                "from finite inputs")


def apply_alpha(task: TensorTask, base_t: Optional[torch.Tensor], result: torch.Tensor, alpha: float,
                uses_deltas: bool) -> torch.Tensor:
    """θ_base + α·M (task-vector methods) or the merged weight, in the task's output dtype.

    Raises `NonFiniteTensorError` when that overflows: α·M past float32's range, or a value past
    the range of a narrow output dtype (float16 stops at 65504).
    """
    if task.action == "copy":
        return result
    scale = alpha * float(task.params.get("lambda", 1.0))
    merged = base_t + scale * result if (uses_deltas and base_t is not None) else result
    merged = merged.to(getattr(torch, task.out_dtype))
    if not all_finite(merged):
        raise NonFiniteTensorError(f"'{task.name}' overflows to infinity in {task.out_dtype} at alpha {alpha:g}; "
                                   "use a smaller alpha or a wider output dtype (--save-dtype float32)")
    return merged


def write_merged(plan: MergePlan, method: MergeMethod, inputs: list[MergeInput], base: Optional[MergeInput],
                 writer: TensorWriter, alpha: float, device: torch.device, reporter: Reporter,
                 statistics: Optional[Sequence["ModelStatistics"]] = None) -> None:
    for task, base_t, result in combine(plan, method, inputs, base, device, reporter, statistics):
        writer.save(task.name, apply_alpha(task, base_t, result, alpha, plan.uses_deltas))
