"""Continual robust training (CRT): adversarial training of small classifiers that later adapt to new attacks.

One job per module: `classifier` (models from a config, saved as safetensors + config.json),
`attacks` (PGD under L∞/L2/L1 and a spatial-flow attack), `regularizers` (logit-distance
terms ALR and UR), `sampler` (which attack a batch trains against), `recipe` (the schema),
`data` (the .npz inputs), `trainer` (the resumable run behind `mlx finetune --recipe crt`).
"""
