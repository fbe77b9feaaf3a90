"""Search a block library for the child that fits a budget: pricing, the MIP, refinement, assembly."""
