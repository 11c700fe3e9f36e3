"""The warm path's metadata guard: the C++ one and the Python fallback give the same answers."""

from __future__ import annotations

import pytest
import torch

from fp4select import tensor_guard


def _pair():
    a = torch.randint(0, 255, (13, 128), dtype=torch.uint8)
    scales = torch.zeros(128, 16, dtype=torch.float8_e4m3fn)
    return a, scales


GUARDS = {
    "native": lambda *t: tensor_guard._native_guard(t),
    "python": lambda *t: tensor_guard.python_guard(t),
}

# Each changes one property the argument checks read; the guard must refuse every one.
CHANGED = {
    "another M": lambda a, s: (a[:12], s),
    "another K": lambda a, s: (torch.zeros(13, 64, dtype=torch.uint8), s),
    "column-major a": lambda a, s: (a.t().contiguous().t(), s),
    "a as int8": lambda a, s: (a.view(torch.int8), s),
    "a on meta": lambda a, s: (a.to("meta"), s),
    "scales as uint8": lambda a, s: (a, s.view(torch.uint8)),
    "scales one tile more": lambda a, s: (a, torch.zeros(256, 16, dtype=torch.float8_e4m3fn)),
    "scales flattened": lambda a, s: (a, s.reshape(-1)),
    "scales on meta": lambda a, s: (a, s.to("meta")),
    "padded rows of a": lambda a, s: (torch.zeros(13, 256, dtype=torch.uint8)[:, :128], s),
}


def test_the_native_guard_serves_on_this_torch():
    """If this fails, a torch upgrade changed the private class: the fallback is serving."""
    assert tensor_guard.native_available(*_pair()), torch.__version__


@pytest.mark.parametrize("kind", GUARDS)
def test_new_tensors_with_the_same_metadata_pass(kind):
    check = GUARDS[kind](*_pair())
    assert check is not None
    assert check(*_pair())


@pytest.mark.parametrize("change", CHANGED)
@pytest.mark.parametrize("kind", GUARDS)
def test_a_changed_property_is_refused(kind, change):
    check = GUARDS[kind](*_pair())
    assert not check(*CHANGED[change](*_pair()))


@pytest.mark.parametrize("kind", GUARDS)
def test_an_out_tensor_is_guarded_as_well(kind):
    a, s = _pair()
    out = torch.empty(13, 256, dtype=torch.bfloat16)
    check = GUARDS[kind](a, s, out)
    assert check(a, s, torch.empty(13, 256, dtype=torch.bfloat16))
    assert not check(a, s, torch.empty(13, 256, dtype=torch.float16))
    assert not check(a, s, torch.empty(256, 13, dtype=torch.bfloat16).t())


def test_a_guard_that_fails_its_self_test_is_not_used(monkeypatch):
    """A private class whose answers differ from ours (here: accepts everything) is refused."""

    class Lenient:
        def __init__(self, *tensors, **kwargs):
            pass

        def check(self, *tensors):
            return True

    monkeypatch.setattr(tensor_guard, "_TensorGuards", Lenient)
    assert not tensor_guard.native_available(*_pair())
    check = tensor_guard.guard(*_pair())
    assert not check(*CHANGED["a as int8"](*_pair())), "the Python guard must serve instead"


def test_a_guard_with_another_signature_falls_back(monkeypatch):
    def other_signature(*tensors, dynamic_shapes=False):
        raise TypeError("unexpected keyword argument 'dynamic_dims_sizes'")

    monkeypatch.setattr(tensor_guard, "_TensorGuards", other_signature)
    check = tensor_guard.guard(*_pair())
    assert check(*_pair()) and not check(*CHANGED["column-major a"](*_pair()))
