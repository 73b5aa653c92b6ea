"""The storage floor: the only code that opens, maps, renames, fsyncs, pins and guards checkpoint files.

Every multi-file format (TensorFlow prefixes, Hugging Face sharded directories, fastckpt's sharded and RecIS
layouts, training checkpoints and the manager's record) is a layout over this floor: its marker, the names it
publishes, its name rule, how it writes and how it opens. The floor keeps one mechanism per concern:

- ``commit``: staging, fsync and the one atomic step that makes a save visible (no-replace by default);
- ``remote``: the same for object storage (uploads, conditional on ``s3://``; a prefix's manifest last);
- ``snapshot``: one pinned commit for every reader of several files, with a bounded descriptor cache;
- ``names``: the one rule for tensor, table, slot and step names;
- ``manifest``: bounded JSON reading and schema checks.

It sits between the native core (``_native``: mappings and the fault guard) and the formats, and imports
nothing above it.

>>> from fastckpt.store.snapshot import Snapshot
>>> from fastckpt.store.manifest import parse_json
>>> parse_json(b'{"format_version": 3}', "manifest.json")["format_version"]
3
"""
