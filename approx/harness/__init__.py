"""The harness: evaluation tasks and metrics, ``approx.evaluate``, fitting, fine-tuning and the command line.

It sits on top of the two lower layers, the methods (``approx.attention``, ``approx.config``,
``approx.registry``, ``approx.layer``) and the transformers glue (``approx.integration``), and nothing below
imports it (``tests/test_layout.py`` checks the direction).
"""
