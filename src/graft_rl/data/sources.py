"""Tables read through Hugging Face ``datasets`` (docs/tasks.md): a hub dataset from the local cache,
a parquet / CSV / JSON file, or a ``save_to_disk`` folder, as plain rows for
:func:`graft_rl.data.problems_from_rows`.

``hf:ORG/NAME[:CONFIG][:SPLIT]`` reads a hub dataset; when the hub cannot be reached (no network, or
``HF_DATASETS_OFFLINE=1``) it comes from the local Hugging Face cache, and when it is not there either
the error says so in one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["TABLE_SUFFIXES", "read_hub", "read_table", "is_table"]

#: file suffixes read through ``datasets`` (JSONL has its own reader, which names the line at fault)
TABLE_SUFFIXES = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".arrow": "arrow"}


def _datasets():
    from graft_rl.data import DatasetError

    try:
        import datasets
    except ImportError:
        raise DatasetError("this dataset is read through Hugging Face datasets: pip install datasets") from None
    datasets.disable_progress_bars()
    return datasets


def _plain(value):
    """A cell as a JSON value (the verifier workers receive rows as JSON): numbers, text, lists, dicts."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return json.loads(json.dumps(value, default=str))


def _rows(table) -> list[dict]:
    return [{k: _plain(v) for k, v in row.items()} for row in table]


def _split(ds, split: str | None, name: str):
    from graft_rl.data import DatasetError

    if hasattr(ds, "keys"):  # a DatasetDict
        splits = list(ds.keys())
        if split is None:
            if len(splits) != 1 and "train" not in splits:
                raise DatasetError(f"{name}: has splits {', '.join(splits)}; name one ({name}:SPLIT)")
            split = "train" if "train" in splits else splits[0]
        if split not in splits:
            raise DatasetError(f"{name}: no split {split!r}; it has {', '.join(splits)}")
        return ds[split]
    return ds


def is_table(path: Path) -> bool:
    """A file ``datasets`` reads, or a ``save_to_disk`` folder."""
    return path.suffix in TABLE_SUFFIXES or (
        path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json", "state.json"))
    )


def read_table(path: Path, split: str | None = None) -> list[dict]:
    """A local table's rows: a parquet / CSV / JSON / Arrow file, or a ``save_to_disk`` folder."""
    from graft_rl.data import DatasetError

    datasets = _datasets()
    if not path.exists():
        raise DatasetError(f"{path}: dataset file not found")
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(TABLE_SUFFIXES[path.suffix], data_files=str(path), split="train")
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(f"{path}: cannot read it ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    return _rows(_split(ds, split, str(path)))


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _cached_snapshot(repo: str) -> str | None:
    """The folder of the dataset repo's files in the local Hugging Face hub cache, if it is there."""
    try:
        from huggingface_hub import snapshot_download

        cache = os.environ.get("HF_HUB_CACHE") or (
            os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None
        )  # read now: huggingface_hub reads its environment once, at import
        return snapshot_download(repo, repo_type="dataset", local_files_only=True, cache_dir=cache)
    except Exception:
        return None


def read_hub(spec: str) -> list[dict]:
    """``hf:ORG/NAME[:CONFIG][:SPLIT]``: from the hub, or from the local cache when it cannot be reached
    (``HF_HUB_OFFLINE=1`` goes to the cache at once)."""
    from graft_rl.data import DatasetError

    parts = spec.removeprefix("hf:").split(":")
    if not parts[0] or len(parts) > 3:
        raise DatasetError(f"{spec}: expected hf:ORG/NAME[:CONFIG][:SPLIT]")
    repo, config, split = parts[0], (parts[1] or None) if len(parts) > 1 else None, parts[2] if len(parts) > 2 else None
    datasets = _datasets()
    error: Exception | None = None
    if not _offline():
        try:
            return _rows(_split(datasets.load_dataset(repo, config, split=split), split, spec))
        except DatasetError:
            raise
        except ValueError as exc:  # an unknown config or split: the hub answered
            if "split" in str(exc).lower() or "config" in str(exc).lower():
                raise DatasetError(f"{spec}: {str(exc).splitlines()[0][:240]}") from None
            error = exc
        except Exception as exc:
            error = exc
    local = _cached_snapshot(repo)
    if local is None:
        raise _not_cached(spec, error)
    try:
        ds = datasets.load_dataset(local, config, split=split)
    except Exception as exc:
        raise DatasetError(
            f"{spec}: the cached copy in {local} does not load ({type(exc).__name__}: {str(exc)[:160]})"
        ) from None
    return _rows(_split(ds, split, spec))


def _not_cached(spec: str, exc: Exception | None):
    from graft_rl.data import DatasetError

    why = "HF_HUB_OFFLINE is set" if exc is None else f"the hub cannot be reached: {type(exc).__name__}"
    return DatasetError(
        f"{spec}: not in the local Hugging Face cache ({os.environ.get('HF_HOME', '~/.cache/huggingface')}) and {why}; "
        "download it once where there is network (huggingface-cli download --repo-type dataset ORG/NAME) or give a local file"
    )
