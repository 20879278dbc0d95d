"""Compiled kernels, one extension module per ``csrc/<name>.cpp`` (built by setup.py at install).

Import them through ``megatron_like.kernels._loader.load(name)``, which falls back cleanly when a
module was not built.
"""
