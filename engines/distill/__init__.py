"""Whole-model distillation: global distillation (GKD) of a Puzzle child, and plain KD."""
