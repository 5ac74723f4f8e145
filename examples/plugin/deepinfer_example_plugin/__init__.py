"""An example DeepInfer backend plugin: see plugin.py (discovery) and accelerator.py (the work)."""
