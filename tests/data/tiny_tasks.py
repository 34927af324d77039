"""Loaders for the tiny local lm-eval tasks (no downloads): one JSONL file next to this module."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

_DOCS = Path(__file__).with_name("tiny_qa.jsonl")


def load(**kwargs) -> datasets.DatasetDict:
    """`train` (few-shot examples) and `test` splits from the `split` field of each line."""
    rows = [json.loads(line) for line in _DOCS.read_text(encoding="utf-8").splitlines() if line.strip()]
    splits = {split: [r for r in rows if r["split"] == split] for split in ("train", "test")}
    return datasets.DatasetDict({split: datasets.Dataset.from_list(docs) for split, docs in splits.items()})
