"""Tables (docs/tasks.md): a parquet or CSV file read by pyarrow, a JSON / Arrow file, a
``save_to_disk`` folder or a hub dataset from the local cache read through Hugging Face ``datasets``;
each as one Arrow table for :func:`graft_rl.data.table.from_arrow` (no Python object per row).

``hf:ORG/NAME[:CONFIG][:SPLIT]`` reads a hub dataset; when the hub cannot be reached (no network, or
``HF_DATASETS_OFFLINE=1``) it comes from the local Hugging Face cache, and when it is not there either
the error says so in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

from graft_rl.data.problem import DatasetError

__all__ = ["TABLE_SUFFIXES", "read_hub", "read_table", "is_table", "read_jsonl_table"]

#: file suffixes read as tables (JSONL has its own reader, which names the line at fault)
TABLE_SUFFIXES = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".arrow": "arrow"}


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DatasetError("this dataset is read through Hugging Face datasets: pip install datasets") from None
    datasets.disable_progress_bars()
    return datasets


def _arrow(ds):
    """A ``datasets.Dataset`` as one Arrow table (its rows in order; no Python object per row)."""
    return ds.with_format("arrow")[:]


def _split(ds, split: str | None, name: str):
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


def read_table(path: Path, split: str | None = None):
    """A local table as Arrow: a parquet or CSV file (pyarrow), a JSON / Arrow file or a
    ``save_to_disk`` folder (``datasets``)."""
    if not path.exists():
        raise DatasetError(f"{path}: dataset file not found")
    try:
        if path.suffix == ".parquet" and path.is_file():
            import pyarrow.parquet as pq

            return pq.read_table(path)
        if path.suffix == ".csv" and path.is_file():
            return _read_csv(path)
        datasets = _datasets()
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(TABLE_SUFFIXES[path.suffix], data_files=str(path), split="train")
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(f"{path}: cannot read it ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    return _arrow(_split(ds, split, str(path)))


def _read_csv(path: Path):
    """A CSV file by pyarrow, with the values ``datasets`` (pandas) gave: an empty cell is null, and a
    column of dates or times stays text (pyarrow would parse it)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    opts = pacsv.ConvertOptions(strings_can_be_null=True)
    table = pacsv.read_csv(path, convert_options=opts)
    dated = [f.name for f in table.schema if pa.types.is_temporal(f.type)]
    if dated:
        opts = pacsv.ConvertOptions(strings_can_be_null=True, column_types={n: pa.string() for n in dated})
        table = pacsv.read_csv(path, convert_options=opts)
    return table


def _plain_json_type(t) -> bool:
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _plain_json_type(t.value_type)
    if pa.types.is_struct(t):
        return all(_plain_json_type(t.field(i).type) for i in range(t.num_fields))
    return pa.types.is_string(t) or pa.types.is_int64(t) or pa.types.is_boolean(t) or pa.types.is_float64(t)


def _complete(arr) -> bool:
    """No null at any depth, and no whole number among floats (JSON's ``1`` read as ``1.0``): the
    values are the ones ``json.loads`` gives, row by row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if arr.null_count:
        return False
    t = arr.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _complete(arr.flatten())
    if pa.types.is_struct(t):
        return all(_complete(arr.field(i)) for i in range(t.num_fields))
    if pa.types.is_float64(t):
        return not pc.any(pc.equal(arr, pc.floor(arr))).as_py()
    return True


def read_jsonl_table(path: Path):
    """A JSONL file as Arrow through pyarrow's reader (fast) when that gives exactly the values the
    line reader would: every row has every key (no nulls at any depth), no dates parsed, no whole
    number turned into a float. Else None: the line reader reads it (and names a bad line)."""
    if path.suffix != ".jsonl":
        return None
    try:
        import pyarrow.json as pajson

        table = pajson.read_json(path)
    except Exception:  # noqa: BLE001 (ArrowInvalid and friends: the line reader says what is wrong)
        return None
    for col, field in zip(table.columns, table.schema, strict=True):
        if not _plain_json_type(field.type) or not _complete(col.combine_chunks()):
            return None
    return table


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


def read_hub(spec: str):
    """``hf:ORG/NAME[:CONFIG][:SPLIT]``: from the hub, or from the local cache when it cannot be reached
    (``HF_HUB_OFFLINE=1`` goes to the cache at once)."""
    parts = spec.removeprefix("hf:").split(":")
    if not parts[0] or len(parts) > 3:
        raise DatasetError(f"{spec}: expected hf:ORG/NAME[:CONFIG][:SPLIT]")
    repo, config, split = parts[0], (parts[1] or None) if len(parts) > 1 else None, parts[2] if len(parts) > 2 else None
    datasets = _datasets()
    error: Exception | None = None
    if not _offline():
        try:
            return _arrow(_split(datasets.load_dataset(repo, config, split=split), split, spec))
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
    return _arrow(_split(ds, split, spec))


def _not_cached(spec: str, exc: Exception | None):
    why = "HF_HUB_OFFLINE is set" if exc is None else f"the hub cannot be reached: {type(exc).__name__}"
    return DatasetError(
        f"{spec}: not in the local Hugging Face cache ({os.environ.get('HF_HOME', '~/.cache/huggingface')}) and {why}; "
        "download it once where there is network (huggingface-cli download --repo-type dataset ORG/NAME) or give a local file"
    )
