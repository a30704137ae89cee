"""The backend over time: optimizer steps that change weights in place, options, run-time dispatch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import scorch_backend as sb
from model_check import check_model, recorded_reports
from scorch_backend.custom_ops import region as R

DISPATCH_MODES = ("sparse", "auto")  # every test under the forced kernels and the default dispatch (conftest.py)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pruned_mlp(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 5))
    sb.prune(model, "magnitude", 0.9)
    return model


@pytest.mark.parametrize("options", [None, {"frozen_weights": True}])
def test_training_steps_update_weights_and_compiled_model_follows(options, scorch_dispatch):
    # frozen_weights skips only the fingerprint: optimizer steps move version counters and are always seen
    eager = pruned_mlp()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="scorch", options=options)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(compiled_model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    before = R.stats["compressions"]
    for step in range(4):
        x, y = torch.randn(16, 48, generator=g), torch.randint(0, 5, (16,), generator=g)
        for model, opt in ((eager, opt_e), (compiled, opt_c)):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()  # in place: the weights' version counters move, so the next call recompresses
        for (n, a), b in zip(eager.named_parameters(), compiled_model.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"step {step}: {n}")
    if scorch_dispatch == "sparse":  # under "auto" this small model's regions may all be left dense
        assert R.stats["compressions"] > before  # weights were compressed again after the updates
    with torch.no_grad():
        x = torch.randn(7, 48, generator=g)
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)


def test_pruning_after_compiling_is_seen():
    model = nn.Sequential(nn.Linear(40, 40))
    compiled = torch.compile(model, backend="scorch")
    x = torch.randn(3, 40)
    with torch.no_grad():
        compiled(x)
        sb.prune(model, "magnitude", 0.95)  # zeroes in place after compilation
        torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize("scorch_dispatch", ["sparse"], indirect=True)  # counts the regions the forced path makes
def test_options_fallback_eager_and_threshold(scorch_dispatch):
    model = pruned_mlp()
    check_model(model, (torch.randn(5, 48, requires_grad=True),), options={"fallback": "eager"}, train=True)
    rep = sb.explain(pruned_mlp(), torch.randn(4, 48), options={"sparse_threshold": 0.01}, repeat=1)
    assert rep.regions == [] and all("no sparse operand" in why for _, why in rep.left_dense)
    rep = sb.explain(pruned_mlp(), torch.randn(4, 48), options={"frozen_weights": True}, repeat=1)
    assert len(rep.regions) == 3


@pytest.mark.parametrize("scorch_dispatch", ["sparse"], indirect=True)  # switches to "auto" itself
def test_bag_of_words_input_is_measured_and_dense_inputs_fall_back(monkeypatch, scorch_dispatch):
    torch.manual_seed(0)
    model = nn.Linear(4000, 256)
    bow = (torch.rand(64, 4000) < 0.02).float()  # a bag of words: 2% of the vocabulary per row
    rep = sb.explain(model, bow, repeat=1)
    (r,) = rep.regions
    assert any(o["kind"] == "sparse" and "measured input" in o["attr"] for o in r.operands)
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    compiled = torch.compile(model, backend="scorch")
    with torch.no_grad():
        torch.testing.assert_close(compiled(bow), model(bow))
        dense_before = R.stats["dense_runs"]
        full = torch.randn(64, 4000)  # the same input position, now dense: measured at run time, run dense
        torch.testing.assert_close(compiled(full), model(full), rtol=1e-4, atol=1e-5)
        assert R.stats["dense_runs"] == dense_before + 1


def test_changing_batch_sizes_and_dtypes():
    model = pruned_mlp().double()
    check_model(model, (torch.randn(4, 48, dtype=torch.float64, requires_grad=True),),
                extra_inputs=[(torch.randn(n, 48, dtype=torch.float64),) for n in (1, 9, 33)])


@pytest.mark.parametrize("fused", [True, False])
def test_a_fused_optimizer_step_is_seen_on_a_masked_fine_tune(fused, scorch_dispatch):
    # torch's fused Adam writes the parameters without moving their version counter, and with the gradients
    # masked it changes only a 99%-pruned weight's nonzeros: the cache's fingerprint must hold some of them.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256))
    for lin in (model[0], model[2]):
        mask = (torch.rand_like(lin.weight) >= 0.99).float()
        with torch.no_grad():
            lin.weight.mul_(mask)  # (its zeros are -0.0 where the weight was negative)
        lin.weight.register_hook(lambda g, mask=mask: g * mask)
    opt = torch.optim.Adam(model.parameters(), 1e-2, fused=fused)
    compiled = torch.compile(model, backend="scorch")
    for _ in range(3):
        compiled(torch.randn(32, 512)).square().mean().backward()
        versions = [p._version for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        if fused:
            assert [p._version for p in model.parameters()] == versions  # (what the test is about)
        with torch.no_grad():
            x = torch.randn(16, 512)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_write_through_data_to_only_a_weights_nonzeros_is_seen():
    import json

    torch.manual_seed(1)
    w = torch.randn(1024, 1024) * (torch.rand(1024, 1024) < 0.01)  # zeros of both signs
    x = torch.randn(8, 1024)
    # y = x w^T with w a cached weight operand (as a pruned linear's region has it)
    text = json.dumps({"operands": [["bk", "dense", False, True, 0, False], ["nk", "sparse", True, True, 0, True]],
                       "out": "bn", "coef": 1.0, "frozen": False, "name": "fingerprint_test"})
    with torch.no_grad():
        torch.testing.assert_close(R.run(text, [x, w], "sparse"), x @ w.T, rtol=1e-4, atol=1e-4)
        before = R.stats["compressions"]
        w.data[w != 0] *= 2.0  # not through w's version counter, and only where it is nonzero
        torch.testing.assert_close(R.run(text, [x, w], "sparse"), x @ w.T, rtol=1e-4, atol=1e-4)
        assert R.stats["compressions"] == before + 1  # compressed again


class _CheckpointedBlocks(nn.Module):
    """Two pruned blocks under torch.utils.checkpoint (non-reentrant), with a residual around each."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            fc1, fc2 = nn.Linear(128, 512), nn.Linear(512, 128)
            with torch.no_grad():
                for lin in (fc1, fc2):
                    lin.weight.mul_(torch.rand(lin.weight.shape, generator=g) < 0.05)
            self.blocks.append(nn.Sequential(fc1, nn.ReLU(), fc2))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("train", [True, False])
def test_checkpointed_blocks_get_regions_and_train_as_eager(train):
    # Dynamo hands a checkpointed block to the backend as a graph of its own (tag_activation_checkpoint); its
    # pruned products were left dense, every gain lost (helper-42). Their regions run forward and again in the
    # backward pass's recomputation.
    torch._dynamo.reset()
    eager = _CheckpointedBlocks()
    twin = copy.deepcopy(eager)
    x = torch.randn(512, 128)  # (at 64 rows a CPU with 8x the per-call cost over dense rate leaves them dense)
    with recorded_reports() as reports, torch.set_grad_enabled(train):
        got = torch.compile(twin, backend="scorch")(x)
    with torch.set_grad_enabled(train):
        want = eager(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    names = [r.name for rep in reports for r in rep.regions]
    assert sum(n.startswith("wrap_body") for n in names) >= 4, names
    if train:
        got.square().sum().backward()
        want.square().sum().backward()
        for (name, p), q in zip(twin.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_an_embedding_gradient_through_rmsnorm_and_two_pruned_projections(scorch_dispatch):
    """A transformer's first block in small: embedding, RMSNorm, two pruned projections (q and k), trained. The
    projections' input gradients (regions) came back with the last dimension outermost; summed and passed
    through the norm's backward into embedding_dense_backward, that layout made torch 2.13's Inductor scatter
    wrong values (relative error 1.3-1.6 in the embedding's gradient), or write out of bounds (heap corruption
    at larger sizes; helper-67). Gradients now come back contiguous. Two sequence lengths."""
    V, D, O, B = 300, 128, 128, 4

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(V, D)
            self.ls = nn.ModuleList([nn.Linear(D, O, bias=False) for _ in range(2)])

        def forward(self, ids):
            x0 = self.e(ids)
            h = x0 * torch.rsqrt(x0.pow(2).mean(-1, keepdim=True) + 1e-6)
            return sum(lin(h).pow(2).sum() for lin in self.ls)

    torch.manual_seed(0)
    eager = M()
    sb.prune(eager, "magnitude", 0.9, types=(nn.Linear,))
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="scorch")
    for T in (40, 45):
        ids = torch.randint(0, V, (B, T))
        eager(ids).backward()
        compiled(ids).backward()
        torch.testing.assert_close(model.e.weight.grad, eager.e.weight.grad, rtol=1e-4, atol=1e-4)
        for a, b in zip(model.ls, eager.ls):
            torch.testing.assert_close(a.weight.grad, b.weight.grad, rtol=1e-4, atol=1e-4)
        eager.zero_grad()
        model.zero_grad()
