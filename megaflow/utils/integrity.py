"""Checkpoints that can be trusted: a manifest of checksums, and pickles read without running code.

**Manifest.** :func:`write_manifest` records every file under a directory with its size
and sha256 in ``MANIFEST.json``; it is written last, just before the ``COMPLETE``
marker. :func:`verify_manifest` recomputes them and refuses a missing, extra, resized or
changed file by name. A subdirectory that carries its own manifest (a model checkpoint
inside a trainer checkpoint) is *sealed*: the outer manifest records only the inner
``MANIFEST.json`` and ``COMPLETE`` (so a changed inner manifest is caught) and the
verification descends into it, so no file is hashed twice::

    {"format": "megaflow-manifest", "version": 1, "algorithm": "sha256",
     "files": {"trainer_state.json": {"size": 812, "sha256": "9f0c..."}, ...},
     "sealed": ["actor/model"]}

The manifest protects against damage (a flipped byte, a truncated or missing shard), not
against a checkpoint crafted by someone else, who can rewrite the manifest too.

**No code from files.** Pickles cannot be avoided entirely: torch's distributed
checkpoint stores its index (``.metadata``) as a plain pickle and megatron-core keeps
non-tensor state (``common.pt``, byte items) as ``torch.save`` pickles. Before anything
else reads them, :func:`check_dcp_pickles` reads every one of them with a restricted
unpickler (:class:`RestrictedUnpickler` for the index, ``torch.load(weights_only=True)``
for the rest) that builds only an allow-listed set of plain data classes and refuses any
other global (``os.system``, ``builtins.eval``, any ``__reduce__`` payload) without
calling it. A file that passes can then be loaded by the libraries' own readers: they can
only rebuild the same allow-listed objects.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST_FILE = "MANIFEST.json"
MANIFEST_FORMAT = "megaflow-manifest"
MANIFEST_VERSION = 1
#: Files never listed in a manifest: the manifest itself and the completeness marker
#: (written after it).
_UNLISTED = {MANIFEST_FILE, "COMPLETE"}
_CHUNK = 1 << 20


class IntegrityError(ValueError):
    """A checkpoint file is missing, changed, unlisted or holds a refused pickle (named)."""


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file.

    Raises:
        IntegrityError: unreadable or not JSON (the file and the parser's message).
    """
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise IntegrityError(f"{path} is not readable JSON: {err}") from None


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_sealed(directory: Path) -> bool:
    return (directory / MANIFEST_FILE).is_file() and (directory / "COMPLETE").is_file()


def _walk(root: Path) -> tuple[list[str], list[str]]:
    """(files to list, sealed subdirectories), as sorted POSIX paths relative to ``root``."""
    files: list[str] = []
    sealed: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = here.relative_to(root)
        if here != root and _is_sealed(here):
            sealed.append(rel_dir.as_posix())
            files.extend((rel_dir / name).as_posix() for name in sorted(_UNLISTED))
            dirnames[:] = []
            continue
        dirnames.sort()
        for name in sorted(filenames):
            if here == root and name in _UNLISTED:
                continue
            files.append((rel_dir / name).as_posix())
    return sorted(files), sorted(sealed)


def write_manifest(root: str | os.PathLike) -> dict[str, Any]:
    """Write ``root/MANIFEST.json`` listing every file under ``root`` (size, sha256).

    Call it when every other file is in place, before writing ``COMPLETE``. Sealed
    subdirectories (with their own manifest and ``COMPLETE``) are referenced, not rehashed.

    Returns:
        The manifest written.
    """
    root = Path(root)
    files, sealed = _walk(root)
    entries = {}
    for rel in files:
        path = root / rel
        entries[rel] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "algorithm": "sha256",
                "files": entries, "sealed": sealed}
    tmp = root / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST_FILE)
    return manifest


def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    """Parse ``root/MANIFEST.json``.

    Raises:
        IntegrityError: no manifest (a checkpoint from before manifests, or not finished),
            or one that is not a megaflow manifest.
    """
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        raise IntegrityError(f"{root} has no {MANIFEST_FILE}: the checkpoint is incomplete or was written "
                             "by a megaflow without checksums; it cannot be verified")
    manifest = read_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT \
            or manifest.get("version") != MANIFEST_VERSION or not isinstance(manifest.get("files"), dict):
        raise IntegrityError(f"{path} is not a {MANIFEST_FORMAT} version {MANIFEST_VERSION} manifest")
    return manifest


def confined_path(root: str | os.PathLike, relative: Any, entry: str) -> Path:
    """``root / relative`` for a path read from a checkpoint's own metadata (a manifest entry,
    a distributed checkpoint's ``.metadata``), refused unless it resolves inside ``root``
    (symbolic links followed): a crafted entry must not make a load read another file.

    Args:
        entry: what to name in the error (the metadata file and the item).

    Raises:
        IntegrityError: ``relative`` is not a relative path string, or leads outside ``root``.
    """
    root = Path(root)
    if not isinstance(relative, (str, os.PathLike)) or not str(relative) or Path(relative).is_absolute():
        raise IntegrityError(f"{entry}: path {relative!r} is not a relative path inside {root}; refused")
    path = root / relative
    base = root.resolve()
    if not path.resolve().is_relative_to(base):
        raise IntegrityError(f"{entry}: path {str(relative)!r} leads outside the checkpoint directory {root}; "
                             "refused")
    return path


def verify_manifest(root: str | os.PathLike, *, checksums: bool = True) -> int:
    """Check every file under ``root`` against its manifest, sealed subdirectories included.

    Args:
        checksums: recompute sha256 (False: only presence and sizes, a cheap check).

    Returns:
        The number of files checked.

    Raises:
        IntegrityError: naming the first file that is missing, not listed, of another
            size or with another checksum, or a missing/malformed manifest.
    """
    root = Path(root)
    manifest = read_manifest(root)
    listed: dict[str, dict] = manifest["files"]
    for rel in [*listed, *manifest.get("sealed", [])]:
        confined_path(root, rel, f"{root / MANIFEST_FILE} (entry {rel!r})")
    files, sealed = _walk(root)
    missing = sorted(set(listed) - set(files))
    if missing:
        raise IntegrityError(f"checkpoint file {root / missing[0]} is missing (listed in {root / MANIFEST_FILE})")
    extra = sorted(set(files) - set(listed))
    if extra:
        raise IntegrityError(f"checkpoint file {root / extra[0]} is not listed in {root / MANIFEST_FILE} "
                             "(added after the checkpoint was written)")
    if sorted(manifest.get("sealed", [])) != sealed:
        raise IntegrityError(f"{root}: the sealed subdirectories {sealed} differ from the manifest's "
                             f"{sorted(manifest.get('sealed', []))}")
    for rel in files:
        path, want = root / rel, listed[rel]
        size = path.stat().st_size
        if size != want.get("size"):
            raise IntegrityError(f"checkpoint file {path} has {size} bytes, the manifest says {want.get('size')}")
        if checksums and file_sha256(path) != want.get("sha256"):
            raise IntegrityError(f"checkpoint file {path} is corrupt: its sha256 differs from {root / MANIFEST_FILE}")
    return len(files) + sum(verify_manifest(root / sub, checksums=checksums) for sub in sealed)


# ---------------------------------------------------------------------- pickles
#: (module, name) pairs the distributed-checkpoint index may reference: torch's metadata
#: dataclasses and the plain values inside them. Anything else is refused.
_DCP_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.planner", n) for n in ("SavePlan", "WriteItem", "TensorWriteData",
                                                         "WriteItemType")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("torch", "Size"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
}


def _torch_constant(module: str, name: str) -> Any:
    """``torch.float32``, ``torch.strided``, ``torch.contiguous_format``: pickled by name."""
    import torch

    if module != "torch":
        return None
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


class RestrictedUnpickler(pickle.Unpickler):
    """A pickle reader that resolves only allow-listed globals (see :data:`_DCP_METADATA_CLASSES`).

    Raises:
        IntegrityError: from :meth:`load`, on the first global outside the allow-list; the
            global is never imported or called.
    """

    def __init__(self, file: Any, *, source: str, allowed: Iterable[tuple[str, str]] = _DCP_METADATA_CLASSES):
        super().__init__(file)
        self._source, self._allowed = source, set(allowed)

    def find_class(self, module: str, name: str) -> Any:
        constant = _torch_constant(module, name)
        if constant is not None:
            return constant
        if (module, name) in self._allowed:
            return super().find_class(module, name)
        raise IntegrityError(f"{self._source} holds a pickle that references {module}.{name}, which megaflow "
                             "refuses to load (a checkpoint must not carry code; only plain metadata and "
                             "tensors are allowed)")

    def persistent_load(self, pid: Any) -> Any:
        raise IntegrityError(f"{self._source} holds a pickle with persistent ids, which megaflow refuses to load")


def read_dcp_metadata(dcp_dir: str | os.PathLike) -> Any:
    """Read a torch distributed checkpoint's ``.metadata`` index without executing code.

    Returns:
        The ``torch.distributed.checkpoint.metadata.Metadata`` object.

    Raises:
        IntegrityError: no ``.metadata``, a truncated or malformed one, or one referencing
            anything but metadata classes.
    """
    path = Path(dcp_dir) / ".metadata"
    if not path.is_file():
        raise IntegrityError(f"{dcp_dir} has no .metadata (not a distributed checkpoint, or not finished)")
    with open(path, "rb") as f:
        try:
            return RestrictedUnpickler(f, source=str(path)).load()
        except IntegrityError:
            raise
        except Exception as err:  # noqa: BLE001 - any malformed pickle is a broken index
            raise IntegrityError(f"{path} is not a readable distributed-checkpoint index: "
                                 f"{type(err).__name__}: {err}") from None


def _register_megatron_safe_globals() -> bool:
    """Import megatron-core, which registers its allow-list with torch; False when absent."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its TE/Apex fallback notices, shown by the workers anyway
            import megatron.core  # noqa: F401
    except ImportError:  # pragma: no cover - megatron-core is a core dependency
        return False
    return True


def _weights_only_load(data: Any, source: str) -> Any:
    """``torch.load(weights_only=True)``; a refused global is retried once with megatron-core's
    allow-list registered (its ``common.pt`` may hold its config dataclasses)."""
    import torch

    for attempt in (0, 1):
        if isinstance(data, io.BytesIO):
            data.seek(0)
        try:
            return torch.load(data, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            if attempt == 0 and _register_megatron_safe_globals():
                continue
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise IntegrityError(f"{source} holds a pickle that megaflow refuses to load (only tensors and "
                                 f"plain data are allowed): {first}") from None
        except Exception as err:  # noqa: BLE001 - a damaged file
            raise IntegrityError(f"{source} cannot be read as a torch file: {type(err).__name__}: {err}") from None
    raise AssertionError("unreachable")


def load_tensors(path: str | os.PathLike) -> Any:
    """``torch.load(path, weights_only=True)`` with errors that name the file.

    Raises:
        IntegrityError: the file holds anything but tensors and plain data, or is damaged.
    """
    return _weights_only_load(str(path), str(path))


def check_dcp_pickles(dcp_dir: str | os.PathLike) -> Any:
    """Read every pickle of a megatron-core / torch distributed checkpoint safely (see module doc).

    Checks the ``.metadata`` index (restricted unpickler), that every file it refers to lies
    inside ``dcp_dir`` (:func:`confined_path`), each byte item it lists (the
    byte range of its file, with ``torch.load(weights_only=True)``) and every ``*.pt``
    file (``common.pt`` and sharded objects).

    Returns:
        The index (``Metadata``).

    Raises:
        IntegrityError: naming the file (and item) with a refused or unreadable pickle.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    dcp_dir = Path(dcp_dir)
    metadata = read_dcp_metadata(dcp_dir)
    storage = metadata.storage_data or {}
    paths = {index: confined_path(dcp_dir, getattr(info, "relative_path", None),
                                  f"{dcp_dir / '.metadata'} (item {getattr(index, 'fqn', index)!r})")
             for index, info in storage.items()}
    for index, info in storage.items():
        item = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(item, BytesStorageMetadata):
            continue
        path = paths[index]
        source = f"{path} (item {index.fqn!r})"
        if getattr(info, "transform_descriptors", None):
            raise IntegrityError(f"{source} is stored with transforms {info.transform_descriptors}, which "
                                 "megaflow does not read")
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise IntegrityError(f"{source} is truncated: the index needs {info.length} bytes at offset "
                                 f"{info.offset}")
        _weights_only_load(io.BytesIO(data), source)
    for path in sorted(dcp_dir.rglob("*.pt")):
        _weights_only_load(str(path), str(path))
    return metadata


__all__ = ["MANIFEST_FILE", "IntegrityError", "read_json", "file_sha256", "write_manifest", "read_manifest",
           "verify_manifest", "confined_path", "RestrictedUnpickler", "read_dcp_metadata", "check_dcp_pickles",
           "load_tensors"]
