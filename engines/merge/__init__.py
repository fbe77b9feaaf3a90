"""`mlx merge`: isotropic merging (Iso-C, Iso-CTS) and the standard baselines, streamed per tensor.

Layout (mergekit's plan/executor split): `config.py` validates the recipe, `sources.py` resolves
inputs (checkpoints, hub ids, LoRA adapters), `plan.py` lists one task per tensor from headers
only, `executor.py` streams the tensors through a method from `methods/registry.py`, and
`run.py` writes the result atomically. `params.py` types each method parameter (checked with the
config, before any tensor is read), `tokenizers.py` compares the inputs' tokenizers before any
tensor is read, `vocab.py` aligns embedding and LM-head rows by token under a tokenizer policy,
`linalg.py` holds the spectral kernels, and `statistics.py` runs each input model
over calibration text for the data-aware methods (RegMean, Fisher). The config schema is mergekit's, so
`mergekit-yaml` configs run unchanged.
"""
