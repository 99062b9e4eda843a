"""Tier 1, the `overlap` package without ranks: what ``import overlap`` sets up (Triton's interpreter where
no GPU exists) and its ops called with no process group."""

from __future__ import annotations

import pytest
import torch

import overlap


def test_ops_need_an_initialized_group():
    a = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        overlap.all_gather_matmul(a, torch.randn(3, 2))


def test_triton_runs_interpreted_where_no_gpu():
    import os

    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
