"""Model files (``save_model`` / ``load_model``, netcl's ``.netcl`` format) and parameter-list checkpoints.

As in netcl, the package root re-exports only the model-file functions; the
training-state helpers are imported from :mod:`fastckpt.io.checkpoint`:

>>> from fastckpt.io import save_model, load_model                         # doctest: +SKIP
>>> from fastckpt.io.checkpoint import save_netcl_checkpoint, load_netcl_checkpoint    # doctest: +SKIP
"""

from fastckpt.io.serialization import load_model, save_model

__all__ = ["save_model", "load_model"]
