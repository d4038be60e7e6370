"""Loader for the lm-eval tasks in this folder (no downloads, no network).

lm-eval passes a task's `dataset_kwargs` to `custom_dataset` as keyword arguments, but does not
resolve a relative `data_files` path against the YAML's folder (HF `datasets` would resolve it
against the current directory). This loader resolves it against this folder, then loads the
jsonl with HF datasets' packaged `json` builder, which works with HF_DATASETS_OFFLINE=1."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_json(data_files: dict[str, str], **_metadata):
    import datasets

    files = {split: str((HERE / f).resolve()) for split, f in data_files.items()}
    return datasets.load_dataset("json", data_files=files)
