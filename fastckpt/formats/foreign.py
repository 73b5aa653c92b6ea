"""Other tools' checkpoint files, told apart by their first bytes, and the way from each to safetensors.

fastckpt never unpickles (a pickle runs code when loaded), so a torch
``torch.save`` file (``.pt``, ``.pth``, ``pytorch_model.bin``: a ZIP holding
``<archive>/data.pkl``, or a bare pickle from before torch 1.6), a torch
distributed checkpoint (DCP: a directory of ``.distcp`` files and a
``.metadata`` pickle) and a Keras file (a ``.keras`` ZIP of
``metadata.json``, ``config.json`` and ``model.weights.h5``; a
``.weights.h5`` HDF5 file) are refused with what the file is and the commands
that turn it into a safetensors file, instead of the NPZ or ZIP parser's
complaint about members that are not ``.npy``.

>>> foreign_file_error("m.pt", b"\\x80\\x02\\x8a\\x0al\\xfc\\x9cF\\xf9 j").args[0][:62]
'm.pt: this is a torch pickle (torch.save, pytorch_model.bin): '
>>> foreign_file_error("w.npz", b"PK\\x03\\x04" + bytes(22) + b"\\x05\\x00\\x00\\x00" + b"w.npy") is None
True
"""

from __future__ import annotations

import os

from fastckpt.errors import FormatError

__all__ = ["foreign_file_error", "foreign_directory_error", "SNIFF_BYTES"]

SNIFF_BYTES = 30 + 1024  # a ZIP local header and its member name: enough to name every kind below

_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_KERAS_MEMBERS = (b"metadata.json", b"config.json", b"model.weights.h5", b"model.weights.npz", b"assets/")
_TORCH_MEMBER_ENDS = (b"/data.pkl", b"/.format_version", b"/byteorder", b"/version")


def _torch_pickle(path: str) -> str:
    source = "model.pt" if path.startswith("<") else path  # bytes in memory ("<bytes>"): written to a file first
    return (f"{path}: this is a torch pickle (torch.save, pytorch_model.bin): fastckpt never unpickles (loading a "
            "pickle can run any code). To get to safetensors, where you trust the file: python -c \"import torch; "
            "from safetensors.torch import save_file; "
            f"save_file(torch.load({source!r}, weights_only=True), 'model.safetensors')\" (for a training checkpoint, "
            "save its state_dict entry; shared tensors need .clone() first), then open model.safetensors")


def _dcp(path: str) -> str:
    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    return (f"{path}: this is a torch distributed checkpoint (DCP: .distcp files and a .metadata pickle): fastckpt "
            "never unpickles (loading a pickle can run any code). To get to safetensors, where you trust the files: "
            "python -c \"from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            f"dcp_to_torch_save({directory!r}, 'model.pt')\", then turn model.pt into model.safetensors with "
            "torch.load(..., weights_only=True) and safetensors.torch.save_file")


def _keras(path: str, what: str) -> str:
    return (f"{path}: this is a Keras file ({what}), which fastckpt does not read. To get to safetensors: load it "
            "in Keras (keras.saving.load_model, or model.load_weights for .weights.h5), then "
            "python -c \"from safetensors.numpy import save_file; import numpy as np; "
            "save_file({w.path: np.asarray(w) for w in model.weights}, 'model.safetensors')\"")


def foreign_file_error(path, head: bytes) -> FormatError | None:
    """The error for a file of another tool (``head``: its first :data:`SNIFF_BYTES` bytes, or fewer), else None.

    >>> foreign_file_error("x.weights.h5", b"\\x89HDF\\r\\n\\x1a\\n" + bytes(8)).args[0][:45]
    'x.weights.h5: this is a Keras file (HDF5 weig'
    """
    path = os.fspath(path)
    if os.path.basename(path).endswith(".distcp"):
        return FormatError(_dcp(path))
    if head.startswith(_HDF5_MAGIC):
        return FormatError(_keras(path, "HDF5 weights, .weights.h5 / .h5"))
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:  # a pickle's PROTO opcode
        return FormatError(_torch_pickle(path))
    if head.startswith(b"PK\x03\x04") and len(head) >= 30:
        member = head[30:30 + int.from_bytes(head[26:28], "little")]
        if member.endswith(_TORCH_MEMBER_ENDS):
            return FormatError(_torch_pickle(path))
        if member in _KERAS_MEMBERS or member.startswith(b"assets/"):
            return FormatError(_keras(path, "a .keras archive"))
    return None


def foreign_directory_error(path, names) -> FormatError | None:
    """The error for a directory of another tool (``names``: its entries), else None.

    >>> foreign_directory_error("ckpt", [".metadata", "__0_0.distcp"]).args[0][:60]
    'ckpt: this is a torch distributed checkpoint (DCP: .distcp f'
    """
    names = set(names)
    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        return FormatError(_dcp(os.fspath(path)))
    return None
