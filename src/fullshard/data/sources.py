"""Where training records come from: local files, a directory of them, a saved dataset or a cached
Hub dataset, all read through `datasets` into memory-mapped Arrow tables.

Reading is done by `datasets` (fast, Arrow-backed); when it fails, the failing file is read again
here, slowly, only to say which file and line is at fault, since "JSON parse error in row 1" of a
directory of files helps nobody.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..log import log_rank0

BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
METADATA_MAX_BYTES = 1 << 20  # a .json object smaller than this without the data fields is metadata


@dataclass(frozen=True)
class Source:
    """The records named by `data.path`: local files grouped by reader, a saved dataset or a Hub name."""

    path: str
    kind: str  # "files", "saved", "hub" or "builtin"
    groups: tuple = ()  # ((builder, (file, ...)), ...) for kind "files"
    split: str = "train"

    @property
    def files(self) -> list[Path]:
        return [f for _, files in self.groups for f in files]

    def stamp(self, exact: bool = True) -> list:
        """What identifies the data on disk without reading it: paths, sizes and (`exact`) modification
        times; without them, names and sizes only, which survive copying the files elsewhere."""
        if self.kind in ("files", "saved"):
            files = self.files if self.kind == "files" else sorted(p for p in Path(self.path).rglob("*") if p.is_file())
            if not exact:
                return [(f.name, f.stat().st_size) for f in files]
            return [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        return [self.path, self.split]


def _is_metadata(file: Path, fields: tuple[str, ...]) -> bool:
    """A small .json holding one object without any data field (meta.json, config.json) is not data."""
    if file.suffix != ".json" or file.stat().st_size > METADATA_MAX_BYTES:
        return False
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return False  # a JSON Lines file named .json, or a broken file: the reader will say which
    return isinstance(value, dict) and not any(f in value for f in fields)


def resolve_source(path: str | None, fields: tuple[str, ...], split: str = "train") -> Source:
    """The source behind `data.path`; `fields` are the record fields the format reads."""
    if not path:
        return Source("<built-in corpus>", "builtin")
    root = Path(path).expanduser()
    if not root.exists():
        return Source(path, "hub", split=split)
    if root.is_dir() and any((root / m).exists() for m in SAVED_MARKERS):
        return Source(str(root), "saved", split=split)
    candidates = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")) if root.is_dir() \
        else [root]
    groups: list[tuple[str, list[Path]]] = []  # runs of files read alike, in file-name order
    skipped = []
    for file in candidates:
        builder = BUILDERS.get(file.suffix.lower(), "text" if not root.is_dir() else None)
        if builder is None or (root.is_dir() and _is_metadata(file, fields)):
            skipped.append(file.name)
        elif groups and groups[-1][0] == builder:
            groups[-1][1].append(file)
        else:
            groups.append((builder, [file]))
    if skipped:
        log_rank0(f"data.path={path!r}: not data, skipped: {', '.join(skipped[:8])}"
                  + (f" and {len(skipped) - 8} more" if len(skipped) > 8 else ""), once=True)
    if not groups:
        raise ConfigError(f"data.path={path!r} holds no data files ({', '.join(sorted(BUILDERS))})")
    return Source(str(root), "files", tuple((b, tuple(f)) for b, f in groups), split)


def locate(source: Source, row: int) -> str:
    """Name record `row` of the source (0-based, in reading order) by file and line where it can."""
    return locate_row(source.files, row) if source.kind == "files" else f"row {row + 1} of {source.path}"


# ---------------------------------------------------------------------------------------------- reading


def _builder_kwargs(builder: str) -> dict:
    return {"sample_by": "document", "encoding": "utf-8"} if builder == "text" else {}


def load_records(source: Source, cache_dir: Path, layouts: tuple[tuple[str, ...], ...], streaming: bool = False,
                 optional: tuple[str, ...] = ()):
    """The source as one `datasets.Dataset` (or `IterableDataset` when streaming) holding only the
    columns of the `layouts` (alternative column sets, e.g. messages or prompt+response; each record
    has one) that it has, and those of `optional` it has (`optional="*"`: every other column too). A
    text file's one column is named after the first layout's first field."""
    import datasets

    datasets.disable_progress_bars()
    if source.kind == "builtin":
        from .builtin import builtin_corpus

        parts = [(datasets.Dataset.from_dict({layouts[0][0]: builtin_corpus()}), "the built-in corpus", ())]
    elif source.kind == "saved":
        parts = [(_load_saved(source, streaming), f"the saved dataset {source.path!r}", ())]
    elif source.kind == "hub":
        parts = [(_load_hub(source, streaming), f"the Hub dataset {source.path!r}", ())]
    else:
        parts = [(_load_files(builder, files, cache_dir, layouts, streaming), None, files)
                 for builder, files in source.groups]
    selected = [_select_layout(part, where, files, layouts, optional) for part, where, files in parts]
    return selected[0] if len(selected) == 1 else datasets.concatenate_datasets(selected)


def _load_saved(source: Source, streaming: bool):
    import datasets

    loaded = datasets.load_from_disk(source.path)
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise ConfigError(f"the saved dataset {source.path!r} has no split {source.split!r} "
                              f"(splits: {', '.join(loaded)}); set data.split")
        loaded = loaded[source.split]
    return loaded.to_iterable_dataset() if streaming else loaded


def _load_hub(source: Source, streaming: bool):
    import datasets

    try:
        return datasets.load_dataset(source.path, split=source.split, streaming=streaming)
    except Exception as err:  # noqa: BLE001 - any failure means the same thing to the user
        raise ConfigError(f"data.path={source.path!r} is no local file or directory, and reading it as a Hub "
                          f"dataset (split {source.split!r}, offline: from the local cache) failed: "
                          f"{type(err).__name__}: {err}") from None


@contextlib.contextmanager
def quiet_datasets():
    """`datasets` logs a reader's failure itself ("Failed to load JSON ..."); ours names the file
    and line instead, so its messages below critical are silenced while it reads."""
    from datasets.utils import logging as ds_logging

    level = ds_logging.get_verbosity()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)


def _load_files(builder: str, files: tuple[Path, ...], cache_dir: Path, layouts, streaming: bool):
    import datasets

    try:
        with quiet_datasets():
            part = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                         cache_dir=str(cache_dir / "raw"), streaming=streaming,
                                         **_builder_kwargs(builder))
            if streaming and part.column_names is None:
                next(iter(part), None)  # the first records are read now, so a file broken from its start fails here
    except Exception as err:  # noqa: BLE001 - located below, file by file
        raise locate_read_error(builder, files, err, layouts) from None
    if builder == "text" and layouts[0][0] != "text":
        part = part.rename_column("text", layouts[0][0])
    return part


def _select_layout(part, where: str | None, files: tuple[Path, ...], layouts, optional: tuple[str, ...] = ()):
    """Keep the columns of every layout the part has (a chat file may hold `messages` records and
    prompt/response ones) and the optional ones it has; a record with none of its layouts' fields
    names the file and line."""
    columns = list(part.column_names or next(iter(part), {}))  # a stream may know its fields only when read
    present = [lay for lay in layouts if all(c in columns for c in lay)]
    if not present:
        place = where or locate_row(files, 0)
        wanted = " or ".join("+".join(repr(c) for c in lay) for lay in layouts)
        raise ConfigError(f"{place} has no field {wanted} (fields: {', '.join(columns)}; set data.text_field "
                          "or data.format)")
    kept = list(dict.fromkeys(c for lay in present for c in lay))
    others = [c for c in columns if c not in kept] if optional == "*" else optional
    part = part.select_columns([*kept, *(c for c in others if c in columns and c not in kept)])
    if not hasattr(part, "__len__"):
        return part  # streaming: a record missing a field is named when it is read
    if len(part) == 0:
        raise ConfigError(f"{where or ', '.join(str(f) for f in files)} holds no records")
    row = _first_without(part, present)
    if row is not None:
        place = locate_row(files, row) if files else f"row {row + 1} of {where}"
        if len(present) == 1:
            record = part[row]
            missing = next(c for c in present[0] if record[c] is None)
            raise ConfigError(f"{place} has no field {missing!r}")
        raise ConfigError(f"{place} has no field {' or '.join('+'.join(repr(c) for c in lay) for lay in present)}")
    return part


# ---------------------------------------------------------------------------------------------- errors


def _first_without(part, layouts) -> int | None:
    """The first row whose fields of every one of `layouts` are not all set, if any."""
    import functools

    import pyarrow.compute as pc

    table = part.data
    complete = [functools.reduce(pc.and_, [pc.is_valid(table.column(c)) for c in lay]) for lay in layouts]
    missing = pc.invert(functools.reduce(pc.or_, complete))
    return int(pc.index(missing, True).as_py()) if pc.any(missing).as_py() else None


def locate_read_error(builder: str, files, err: Exception, layouts=()) -> ConfigError:
    """The first file (and line) that cannot be read, found by reading file by file: not UTF-8,
    not JSON, or (files whose records differ) a record without the fields read."""
    problem = _first_problem(builder, files, layouts)
    if problem:
        return ConfigError(problem)
    cause = err.__cause__ or err
    return ConfigError(f"cannot read {', '.join(str(f) for f in files)} as {builder}: {type(cause).__name__}: {cause}")


def source_read_error(source: Source, err: Exception, layouts=()) -> ConfigError:
    """`locate_read_error` for a whole source (a stream failing mid-way, in any of its files)."""
    for builder, files in source.groups:
        problem = _first_problem(builder, files, layouts)
        if problem:
            return ConfigError(problem)
    return ConfigError(f"cannot read {source.path}: {type(err).__name__}: {err}")


def _first_problem(builder: str, files, layouts) -> str | None:
    for file in files:
        if file.stat().st_size == 0:
            return f"{file} holds no records (empty file)"
        problem = _text_problem(file) if builder in ("text", "json") else None
        if problem is None and builder == "json":
            problem = _json_problem(file, layouts)
        if problem:
            return problem
    return None


def _text_problem(file: Path) -> str | None:
    data = file.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        return (f"{file}:{line} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                f"convert the file, e.g. `iconv -f latin1 -t utf-8`")
    return None


def _record_problem(record, place: str, layouts) -> str | None:
    if not isinstance(record, dict):
        return f"{place} is not a JSON object"
    if layouts and not any(all(f in record for f in lay) for lay in layouts):
        wanted = " or ".join("+".join(repr(f) for f in lay) for lay in layouts)
        return f"{place} has no field {wanted} (fields: {', '.join(record)})"
    return None


def _json_problem(file: Path, layouts=()) -> str | None:
    text = file.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            return f"{file}:{err.lineno} is not valid JSON ({err.msg})"
        problems = (_record_problem(r, f"{file} row {i + 1}", layouts) for i, r in enumerate(records))
        return next((p for p in problems if p), None)
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            return f"{file}:{line_no} is not valid JSON ({err.msg})"
        problem = _record_problem(record, f"{file}:{line_no}", layouts)
        if problem:
            return problem
    return None


def _record_lines(file: Path) -> list[str] | None:
    """Where each record of a file starts ("file:line" or "file row k"), for naming a bad record."""
    if file.suffix.lower() in (".jsonl", ".json"):
        with open(file, encoding="utf-8", errors="replace") as handle:
            head = handle.read(4096).lstrip()
        if head.startswith("["):
            count = len(json.loads(file.read_text(encoding="utf-8")))
            return [f"{file} row {i + 1}" for i in range(count)]
        with open(file, encoding="utf-8", errors="replace") as handle:
            return [f"{file}:{n}" for n, line in enumerate(handle, 1) if line.strip()]
    if file.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return [f"{file} row {i + 1}" for i in range(pq.ParquetFile(file).metadata.num_rows)]
    if file.suffix.lower() == ".arrow":
        return None
    return [str(file)]


def locate_row(files, row: int) -> str:
    """Name record `row` (0-based, in reading order) of `files` by file and line."""
    for file in files:
        places = _record_lines(file)
        if places is None:
            return f"row {row + 1} of {file}"
        if row < len(places):
            return places[row]
        row -= len(places)
    return f"row {row + 1} of {', '.join(str(f) for f in files)}"
