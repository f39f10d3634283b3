"""Explanations of the embedding layer, measured on a real checkpoint. Functions return data; the CLI renders it."""

from bertembed.explain.decompose import TextDecomposition, explain_text

__all__ = ["TextDecomposition", "explain_text"]
