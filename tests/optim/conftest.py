"""Abstract models shared by the optimizer tests (shapes only: the release costs no memory)."""

from __future__ import annotations

import pytest

from dsv41_jax import config as C
from dsv41_jax.model.transformer import abstract_model


@pytest.fixture(scope="session")
def release_model():
    return abstract_model(C.v41_flash())
