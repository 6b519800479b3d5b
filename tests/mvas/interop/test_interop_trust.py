"""What a crafted checkpoint can do: our own formats (the packed safetensors file, ``torch.load(weights_only=True)``
of state dicts and of the DCP optimizer extras) refuse it and run no code; a DCP checkpoint's ``.metadata`` is
unpickled by torch and does run code, as ``macroarch.mvas.interop.dcp``'s docstring says (trusted sources only)."""

import io
import json
import pickle

import pytest
import safetensors
import torch
from torch import nn

from macroarch.mvas import apply, load_packed, plan_from_rules, save_packed
from macroarch.mvas.interop import dcp as mvas_dcp


class Payload:
    """Unpickled, it creates ``marker``: the proof that loading ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _model(managed=True):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    if managed:
        apply(net, plan_from_rules(net, [("*.weight", "fp8")], block_size=16, min_numel=0))
    return net


def _header(path):
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def _with_header(path, header, data):
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("craft", ["dtype name", "not json", "offsets", "checksums"])
def test_a_crafted_packed_file_is_refused_and_runs_nothing(tmp_path, craft):
    marker = tmp_path / "marker"
    path = tmp_path / "mvas_model.safetensors"
    save_packed(_model(), path)
    header, data = _header(path)
    if craft == "dtype name":  # a loader that evaluated or looked up this string would run it
        code = f"__import__('os').system('touch {marker}')"
        header["__metadata__"]["mvas_compute_dtypes"] = json.dumps({"0.weight": code})
    elif craft == "not json":
        header["__metadata__"]["mvas_compute_dtypes"] = f"exec(open('{marker}', 'w'))"
    elif craft == "offsets":
        key = next(k for k in header if k != "__metadata__")
        header[key]["data_offsets"] = [0, len(data) * 4]
    else:
        header["__metadata__"]["mvas_checksums"] = pickle.dumps(Payload(marker)).hex()
    _with_header(path, header, data)
    dense = _model(managed=False)
    before = [p.detach().clone() for p in dense.parameters()]
    with pytest.raises(Exception) as info:  # noqa: B017 (which error depends on the craft; any Exception will do)
        load_packed(dense, path)
    assert isinstance(info.value, ValueError | safetensors.SafetensorError), repr(info.value)
    assert not marker.exists()
    assert all(type(p) is nn.Parameter and torch.equal(p, b) for p, b in zip(dense.parameters(), before, strict=True))


def test_a_crafted_state_dict_is_refused_by_torch_load_weights_only(tmp_path):
    marker = tmp_path / "marker"
    buffer = io.BytesIO()
    torch.save({"0.weight": Payload(marker)}, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(buffer, weights_only=True)
    assert not marker.exists()


def test_dcp_metadata_is_unpickled_by_torch_so_it_must_be_trusted(tmp_path):
    model = _model()
    mvas_dcp.save(tmp_path / "ckpt", model)
    marker = tmp_path / "marker"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(pickle.UnpicklingError):  # our own reader of such a file (weights_only) refuses it
        torch.load(tmp_path / "ckpt" / ".metadata", weights_only=True)
    assert not marker.exists()
    with pytest.raises(AttributeError, match="state_dict_metadata"):  # the unpickled object is no Metadata ...
        mvas_dcp.load(tmp_path / "ckpt", _model())
    assert marker.exists()  # torch's DCP reader ran the crafted pickle: the docstring's warning is needed
    assert all("from a trusted source" in " ".join(doc.split()) for doc in (mvas_dcp.__doc__, mvas_dcp.load.__doc__))
