"""Structured outputs: the request fields that name a constraint, their limits, and compiling
constraints in worker processes for the ranks to load."""
