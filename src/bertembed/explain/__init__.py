"""Explanations of the embedding layer, measured on a real checkpoint: functions return data, the CLI renders it.
Nothing here imports torch or matplotlib at import time (the fine-tune and the figures import them when they run)."""

from bertembed.explain.decompose import TextDecomposition, explain_text
from bertembed.explain.drift import DriftReport, drift
from bertembed.explain.finetune import FinetuneReport, finetune_demo
from bertembed.explain.onehot import OneHotReport, analyze_onehot
from bertembed.explain.positions import PositionReport, analyze_positions
from bertembed.explain.projector import WordMap, word_map
from bertembed.explain.segments import SegmentReport, analyze_segments
from bertembed.explain.tokens import TokenReport, analyze_tokens

__all__ = ["DriftReport", "FinetuneReport", "OneHotReport", "PositionReport", "SegmentReport", "TextDecomposition",
           "TokenReport", "WordMap", "analyze_onehot", "analyze_positions", "analyze_segments", "analyze_tokens",
           "drift", "explain_text", "finetune_demo", "word_map"]
