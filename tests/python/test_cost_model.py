"""The run-time choice between sparse kernels and dense ATen code."""

import torch

import scorch_backend as sb
from conftest import random_dense
from scorch_backend import cost_model


def test_crossover_comes_from_the_calibration_file():
    import json

    data = json.loads(cost_model._CALIBRATION.read_text())
    assert 0 < data["dense_crossover_density"] <= 1
    assert cost_model.crossover_density() == data["dense_crossover_density"]


def test_decisions(monkeypatch, capsys):
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    monkeypatch.setenv("SCORCH_DENSE_CROSSOVER", "0.3")
    assert cost_model.choose_dense([0.6], 10**6)[0]          # a 60%-dense "sparse" operand runs dense
    assert not cost_model.choose_dense([0.01], 10**6)[0]
    assert cost_model.choose_dense([0.01], 100)[0]           # tiny: dense
    assert not cost_model.choose_dense([0.5, 0.1], 10**6)[0]  # SpGEMM-like: densities multiply
    # The dense path gives the same results, including a sparse result in the plan's format, and gradients.
    monkeypatch.setenv("SCORCH_DEBUG", "1")
    A = random_dense((60, 50), 0.6, dtype=torch.float64, seed=1)
    S = sb.sparse(A, "csr")
    v = S.stored_values.detach().clone().requires_grad_()
    D = torch.randn(50, 30, dtype=torch.float64, requires_grad=True)
    out = sb.einsum("ij,jk->ik", S.with_values(v), D)
    assert "dense ATen" in capsys.readouterr().err
    torch.testing.assert_close(out, A @ D)
    out.sum().backward()
    torch.testing.assert_close(S.with_values(v.grad).to_dense(), (torch.ones(60, 30, dtype=torch.float64) @ D.t()) * (A != 0))
    C = sb.einsum("ij,ij->ij", S, S)
    assert isinstance(C, sb.SparseTensor) and str(C.format) == "csr"
    torch.testing.assert_close(C.to_dense(), A * A)
    sparse = sb.sparse(random_dense((300, 300), 0.01, dtype=torch.float64, seed=2), "csr")
    sb.einsum("ij,jk->ik", sparse, torch.randn(300, 8, dtype=torch.float64))
    assert "sparse kernel" in capsys.readouterr().err
