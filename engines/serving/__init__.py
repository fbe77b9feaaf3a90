"""Serving engines: what each builds, and running a child in vLLM."""
