"""A decode step's host work does not grow with the rows of a batch (issue 48): no Python loop over rows, no value
read per row. Counted as PyTorch operator calls (reads to the host included: `aten.item`) in the decode steps of
every method, at 2 and at 16 rows. The rows are one prompt repeated, so that every row takes the same path (the
dynamic schedule's rows then agree); one row alone skips a few batch offsets, hence 2, not 1."""

import collections

import pytest
import torch
from conftest import random_prompt, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import refreshkv


class OperatorCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def decode_calls(model, monkeypatch, method: str, rows: int) -> collections.Counter:
    """Operator calls of the decode steps (every forward after the prefill) of 12 new tokens."""
    counter, forward, forwards = OperatorCalls(), model.forward, []

    def counted(*args, **kwargs):
        forwards.append(1)
        if len(forwards) == 1:  # the prefill
            return forward(*args, **kwargs)
        with counter:
            return forward(*args, **kwargs)

    params = {"budget": 40} if "budget" in refreshkv.METHODS[method].parameters() else {}
    if method in ("refreshkv", "recycled"):
        params["stride" if method == "recycled" else "qc_stride"] = 4  # full steps or query checks in 12 steps
    if method == "quest":
        params["dense_layers"] = 0  # its selection in the one layer of the model (every layer dense is refused)
    ids = random_prompt(64).expand(rows, -1)
    with monkeypatch.context() as patch:
        patch.setattr(model, "forward", counted)
        refreshkv.generate(model, ids, method=method, max_new_tokens=12, eos_token_id=[], **params)
    return counter.calls


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only waits
    yield tiny_model("llama", layers=1)
    torch.set_num_threads(threads)


CASES = [(name, "C") for name in sorted(refreshkv.METHODS)] + [
    (name, "PyTorch")
    for name in ("refreshkv", "recycled", "oracle")  # their selection also without the C
]


@pytest.mark.parametrize("method, selection", CASES)
def test_a_decode_step_calls_as_many_operators_for_16_rows_as_for_2(method, selection, model, monkeypatch):
    if selection == "PyTorch":
        monkeypatch.setenv("REFRESHKV_NATIVE", "0")
    two = decode_calls(model, monkeypatch, method, 2)
    sixteen = decode_calls(model, monkeypatch, method, 16)
    grown = {name: (two[name], sixteen[name]) for name in two.keys() | sixteen.keys() if two[name] != sixteen[name]}
    assert not grown, grown
