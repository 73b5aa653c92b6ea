"""TensorFlow's quantized dtypes are kept (or refused, never changed); opaque entries are skipped, never fatal."""

from __future__ import annotations

from pathlib import Path

import crc32c
import numpy as np
import pytest

import fastckpt
from fastckpt._native.tftable import mask_crc
from fastckpt.cli import main
from fastckpt.errors import DestinationError
from fastckpt.formats.convert import QUANTIZED_KEY, convert
from fastckpt.formats.tf.dtypes import QUANTIZED
from fastckpt.formats.tf.proto import BundleHeader, encode_entry, encode_header
from fastckpt.formats.tf.table import TableBuilder
from fastckpt.tf import CheckpointReader, describe, write_checkpoint

# name -> (DataType enum, TensorFlow's numpy form)
QTYPES = {"qint8": (11, [("qint8", "i1")]), "quint8": (12, [("quint8", "u1")]), "qint32": (13, [("qint32", "<i4")]),
          "qint16": (15, [("qint16", "<i2")]), "quint16": (16, [("quint16", "<u2")])}


def _quantized_values():
    return {name: np.arange(-3, 3).astype(np.dtype(form)[0]).view(np.dtype(form)).reshape(2, 3)
            for name, (_, form) in QTYPES.items()}


def _crc(data: bytes) -> int:
    return mask_crc(crc32c.crc32c(data))


def test_tensorflow_numpy_forms():
    assert {name: dt for name, dt in QUANTIZED.items()} == {n: np.dtype(f) for n, (_, f) in QTYPES.items()}


def test_quantized_round_trip_tensorflow_to_tensorflow_exactly(tmp_path, capsys):
    values = _quantized_values()
    write_checkpoint(tmp_path / "q", values)
    convert(tmp_path / "q", tmp_path / "copy", to="tf")
    for prefix in ("q", "copy"):
        with CheckpointReader(tmp_path / prefix) as r:
            for name, (enum, form) in QTYPES.items():
                assert r.info(name).tf_dtype == enum, (prefix, name)
                assert r.info(name).tf_dtype_name == name
                assert r[name].dtype == np.dtype(form)
                assert r[name].tobytes() == values[name].tobytes()
    assert {t["name"]: t["dtype"] for t in describe(tmp_path / "copy")["tensors"]} == {n: n for n in QTYPES}
    assert main(["inspect", str(tmp_path / "copy")]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows == {n: n for n in QTYPES}


def test_quantized_dtypes_are_never_written_as_plain_ints(tmp_path):
    write_checkpoint(tmp_path / "p", {"i8": np.arange(3, dtype=np.int8)})
    with CheckpointReader(tmp_path / "p") as r:
        assert r.info("i8").tf_dtype == 6 and r["i8"].dtype == np.int8


def test_quantized_into_safetensors_is_refused_without_the_opt_in(tmp_path):
    write_checkpoint(tmp_path / "q", _quantized_values())
    with pytest.raises(DestinationError, match=r"5 tensor\(s\) of TensorFlow quantized types cannot be stored in "
                                               r"safetensors without losing the type: 'qint16' \(qint16\), "
                                               r".*quantized_as_ints=True"):
        convert(tmp_path / "q", tmp_path / "q.safetensors")
    assert not (tmp_path / "q.safetensors").exists()
    assert convert(tmp_path / "q", tmp_path / "s.safetensors", skip_unsupported=True)["skipped"] == sorted(QTYPES)


def test_quantized_as_ints_records_the_types_and_tensorflow_gets_them_back(tmp_path, capsys):
    values = _quantized_values()
    write_checkpoint(tmp_path / "q", values)
    assert main(["convert", str(tmp_path / "q"), str(tmp_path / "q.safetensors"), "--quantized-as-ints"]) == 0
    assert "qint8: qint8 (stored as integers, type in the metadata)" in capsys.readouterr().err
    with fastckpt.open(tmp_path / "q.safetensors") as f:
        assert f.metadata == {QUANTIZED_KEY: '{"qint16": "qint16", "qint32": "qint32", "qint8": "qint8", '
                                             '"quint16": "quint16", "quint8": "quint8"}'}
        for name, (_, form) in QTYPES.items():
            assert f.host(name).dtype == np.dtype(form)[0]  # the plain integers
            assert f.host(name).tobytes() == values[name].tobytes()
    summary = convert(tmp_path / "q.safetensors", tmp_path / "back", to="tf")
    assert summary["quantized"] == {n: n for n in QTYPES} and summary["dropped"] == []
    with CheckpointReader(tmp_path / "back") as r:
        for name, (enum, form) in QTYPES.items():
            assert r.info(name).tf_dtype == enum
            assert r[name].dtype == np.dtype(form) and r[name].tobytes() == values[name].tobytes()
    # NPZ keeps TensorFlow's numpy form as it is
    convert(tmp_path / "q.safetensors", tmp_path / "q.npz")
    with fastckpt.open(tmp_path / "q.npz") as f:
        assert {n: f.host(n).dtype for n in f} == {n: np.dtype(form) for n, (_, form) in QTYPES.items()}
    convert(tmp_path / "q", tmp_path / "direct.npz")
    assert main(["inspect", str(tmp_path / "direct.npz")]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows == {n: n for n in QTYPES}
    with fastckpt.open(tmp_path / "direct.npz") as f, np.load(tmp_path / "direct.npz") as z:
        for name in QTYPES:
            assert f.host(name).dtype == z[name].dtype == values[name].dtype
            assert f.host(name).tobytes() == z[name].tobytes() == values[name].tobytes()


def test_a_recorded_type_that_disagrees_with_the_stored_ints_is_refused(tmp_path):
    fastckpt.save_safetensors(tmp_path / "bad.safetensors", {"q": np.zeros(2, np.int16)},
                              metadata={QUANTIZED_KEY: '{"q": "qint8"}'})
    with pytest.raises(fastckpt.errors.FormatError, match="'q' is recorded as qint8 .* stored as int16, not int8"):
        convert(tmp_path / "bad.safetensors", tmp_path / "bad", to="tf")


def _bundle_with_opaque(prefix: str, enum: int) -> None:
    """A checkpoint as TensorFlow writes one holding a tf.data iterator: a DT_VARIANT entry beside tensors."""
    w = np.arange(4, dtype="<f4").tobytes()
    opaque = b"\x0a\x05dummy serialized iterator state"
    data = w + opaque
    entries = {
        b"iterator/.ATTRIBUTES/ITERATOR_STATE": encode_entry(enum, (1,), offset=len(w), size=len(opaque),
                                                              crc32c=_crc(opaque)),
        b"w": encode_entry(1, (4,), size=len(w), crc32c=_crc(w)),
    }
    Path(prefix + ".data-00000-of-00001").write_bytes(data)
    with open(prefix + ".index", "wb") as f:
        builder = TableBuilder(f)
        builder.add(b"", encode_header(BundleHeader()))
        for key in sorted(entries):
            builder.add(key, entries[key])
        builder.finish()


@pytest.mark.parametrize("enum,kind", [(21, "variant"), (20, "resource")])
def test_an_opaque_entry_is_skipped_and_the_rest_opens(tmp_path, capsys, enum, kind):
    prefix = str(tmp_path / "ckpt-1")
    _bundle_with_opaque(prefix, enum)
    with CheckpointReader(prefix) as r:
        assert list(r) == ["w"] and r["w"].tolist() == [0, 1, 2, 3]
        assert list(r.skipped) == ["iterator/.ATTRIBUTES/ITERATOR_STATE"]
        assert r.skipped["iterator/.ATTRIBUTES/ITERATOR_STATE"].startswith(f"{kind}: ")
    with fastckpt.open(prefix) as f:
        assert list(f.keys()) == ["w"]
    assert describe(prefix)["skipped"] == {"iterator/.ATTRIBUTES/ITERATOR_STATE": r.skipped[
        "iterator/.ATTRIBUTES/ITERATOR_STATE"]}
    summary = convert(prefix, tmp_path / "w.safetensors")
    assert summary["tensors"] == 1 and summary["skipped"] == ["iterator/.ATTRIBUTES/ITERATOR_STATE"]
    assert main(["inspect", str(tmp_path / "ckpt-1")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("tensorflow, 1 tensor")
    assert out[1].startswith(f"skipped iterator/.ATTRIBUTES/ITERATOR_STATE: {kind}: ")
    assert main(["convert", prefix, str(tmp_path / "w2.npz")]) == 0
    assert f"skipped iterator/.ATTRIBUTES/ITERATOR_STATE: {kind}: " in capsys.readouterr().err


def test_the_old_proto_import_path_still_names_the_object_graph_types(tmp_path):
    from fastckpt.tf import proto

    write_checkpoint(tmp_path / "g", {"model/w/.ATTRIBUTES/VARIABLE_VALUE": np.ones(2, np.float32)},
                     object_graph=True)
    with CheckpointReader(tmp_path / "g") as r:
        assert isinstance(r.object_graph(), proto.ObjectGraph)
    assert proto.GraphNode is fastckpt.formats.tf.proto.GraphNode


def test_the_safetensors_writer_names_a_quantized_type(tmp_path):
    q = np.zeros(2, np.int8).view([("qint8", "i1")])
    with pytest.raises(TypeError, match=r"tensor 'q': dtype \[\('qint8', 'i1'\)\] has no safetensors equivalent "
                                        r"\(TensorFlow's qint8, which safetensors has not: "
                                        r"store a.view\(a.dtype\[0\]\)"):
        fastckpt.save_safetensors(tmp_path / "q.safetensors", {"q": q})
    assert not (tmp_path / "q.safetensors").exists()
    assert q.view(q.dtype[0]).dtype == np.int8  # the way out the message names works
