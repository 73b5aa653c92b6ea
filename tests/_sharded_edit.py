"""Editing a sharded checkpoint's metadata the way a tool that rewrites it consistently would: ``reseal`` records the
edited files' sizes and hashes in the manifest and the manifest's own checksum, so that what the loaders' cross-checks
catch is tested apart from what the hashes catch."""

from __future__ import annotations

import json
from pathlib import Path

import blake3

from fastckpt.sharded.format import DESCRIPTION_FILE, INDEX_FILE, MANIFEST_FILE, TENSORKEY_FILE, dumps, seal

METADATA = (INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE)


def reseal(directory, manifest: dict | None = None) -> None:
    """Record every metadata file's size and BLAKE3 in the manifest (``manifest``, or the one on disk when it is a
    JSON object) and, for a version-3 manifest, its checksum; write it."""
    d = Path(directory)
    if manifest is None:
        manifest = json.loads((d / MANIFEST_FILE).read_bytes())
    if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict):
        for name in METADATA:
            if (d / name).exists() and isinstance(manifest["files"].get(name), dict):
                data = (d / name).read_bytes()
                manifest["files"][name] = {**manifest["files"][name], "size": len(data),
                                           "blake3": blake3.blake3(data).hexdigest()}
    if isinstance(manifest, dict) and "checksum" in manifest:
        manifest = seal(manifest)
    (d / MANIFEST_FILE).write_bytes(dumps(manifest))
