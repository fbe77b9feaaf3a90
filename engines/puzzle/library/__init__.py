"""Build a Puzzle block library and keep it on disk: activations, BLD, scoring, the schema."""
