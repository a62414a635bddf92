"""Every architecture name the registry lists resolves to a native model class (its module imports
and defines it), and an unknown one is refused naming the supported ones."""

from __future__ import annotations

import pytest

from llmserve.load_errors import UnsupportedArchitectureError
from llmserve.models.base import CausalLM
from llmserve.models.registry import is_supported, resolve_model_class, supported_architectures


@pytest.mark.parametrize("arch", supported_architectures())
def test_every_listed_architecture_resolves(arch: str) -> None:
    cls = resolve_model_class([arch], "ckpt")
    assert issubclass(cls, CausalLM) and is_supported([arch])


def test_unknown_architecture_is_refused_by_name() -> None:
    with pytest.raises(
        UnsupportedArchitectureError, match=r"ckpt: architecture \['NoSuchForCausalLM'\].*Phi3ForCausalLM"
    ):
        resolve_model_class(["NoSuchForCausalLM"], "ckpt")
