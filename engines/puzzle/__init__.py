"""Puzzle: a parent's per-layer attention and FFN variants, trained as a block library and
chosen by a mixed-integer program under a hardware target's budgets.

* `library/`: build the block library (the parent's cached activations, blockwise local
  distillation, replace-1-block scoring) and read and write it on disk.
* `search/`: price the library on a hardware profile, solve the MIP, refine its estimate in
  context, assemble the child, and the baselines it has to beat; `search/run.py` is `mlx search`.
* `recipe.py`, `search_space.py`, `subblocks.py`: what both halves share (the recipe, the
  variants each layer may take, and the stand-alone subblocks).
"""
