"""Bundled examples: models and datasets that every machine has, no download.

Takes nothing; gives the models the bundled specs name (``gpt.CharGPT``, a byte-level GPT with
tied embeddings; ``cnn.SkipCNN``, a CNN with a long skip connection) and real or synthetic data
(``data.python_source_text``: the Python standard library's sources; ``data.python_source_lm``:
the same as transformers-style dict batches; ``data.synthetic_images``).
"""
