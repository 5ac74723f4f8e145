"""The reference backend: every backend op in plain torch on the CPU."""
