"""`RXF_PDL` (rxf/core/runner/pdl.py): unset or empty means on where the GPU has it, `0` off, anything
else a clear error naming the variable. On the CPU only the parsing can run: `0` and a bad value are decided
before the device is asked for its compute capability."""

from __future__ import annotations

import pytest
import torch

from rxf.core.runner import pdl


@pytest.fixture
def fresh_setting(monkeypatch: pytest.MonkeyPatch):
    pdl._supported.cache_clear()
    yield monkeypatch
    pdl._supported.cache_clear()


def test_zero_turns_it_off_without_asking_the_device(fresh_setting: pytest.MonkeyPatch) -> None:
    fresh_setting.setenv(pdl.ENV, "0")
    assert pdl._supported(0) is False


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1"])
def test_other_values_are_refused(fresh_setting: pytest.MonkeyPatch, value: str) -> None:
    fresh_setting.setenv(pdl.ENV, value)
    with pytest.raises(ValueError, match=pdl.ENV):
        pdl._supported(0)


@pytest.mark.parametrize("value", [None, "", "1"], ids=["unset", "empty", "1"])
@pytest.mark.parametrize("major", [8, 9, 10])
def test_on_by_default_from_compute_capability_9(fresh_setting: pytest.MonkeyPatch, value: str | None,
                                                 major: int) -> None:
    """The device's answer stands in for a GPU's (`torch.cuda.get_device_capability`, patched)."""
    if value is None:
        fresh_setting.delenv(pdl.ENV, raising=False)
    else:
        fresh_setting.setenv(pdl.ENV, value)
    fresh_setting.setattr(torch.cuda, "get_device_capability", lambda index: (major, 0))
    assert pdl._supported(0) is (major >= 9)
    assert not pdl.use_pdl(torch.zeros(1)), "CPU tensors never launch with it"
