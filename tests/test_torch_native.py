"""MoELayer's native torch path: plain CPU tensors go to the Rust forward through torch's DLPack C
exchange table and the output is a torch tensor that owns the Rust buffer. It must give exactly
what the checked numpy path gives, decline every input it cannot read faithfully (the checked
path then answers or names the problem), and free every output it made."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import moeq_rs as mq
from moeq_rs import _core
from moeq_rs import moe as moe_module

pytestmark = pytest.mark.skipif(
    not moe_module._TORCH_TENSORS_NATIVE,
    reason="this torch publishes no DLPack C exchange table (the numpy path serves)",
)

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def layer(fixture_path: Callable[[str], Path], name: str, index: int = 0) -> mq.MoELayer:
    return mq.MoELayer.from_checkpoint(fixture_path(name), index)


def routing(t: int, moe: mq.MoELayer, ids_dtype: torch.dtype = torch.int64):  # type: ignore[no-untyped-def]
    logits = torch.randn(t, moe.num_experts)
    w, ids = torch.softmax(logits, -1).topk(moe.top_k, dim=-1)
    return logits, w / w.sum(-1, keepdim=True), ids.to(ids_dtype)


@pytest.mark.parametrize(
    "name,index",
    [("qwen3_w8a8_dynamic", 0), ("qwen3_w4a16_g128_asym", 1), ("deepseek_v3_w8a8_dynamic", 1)],
)
@pytest.mark.parametrize("dtype", FLOATS)
def test_native_path_equals_the_checked_path(
    fixture_path: Callable[[str], Path], name: str, index: int, dtype: torch.dtype
) -> None:
    moe = layer(fixture_path, name, index)
    t = 5
    x = (torch.randn(t, moe.hidden_size) * 3).to(dtype)
    logits, w, ids = routing(t, moe)
    alive = _core._cpu_torch_outputs_alive()
    fast = moe(x, logits.to(dtype))
    # The output came from the native path (it owns a Rust buffer) ...
    assert _core._cpu_torch_outputs_alive() == alive + 1
    checked = moe._forward_checked(x, logits.to(dtype))
    assert fast.dtype == checked.dtype == dtype and fast.shape == checked.shape == (t, x.shape[1])
    # ... and holds exactly what the numpy path computes.
    assert torch.equal(fast, checked)
    assert torch.isfinite(fast).all() and fast.abs().sum() > 0
    for ids_dtype in (torch.int64, torch.int32):
        del fast
        gc.collect()
        fast = moe.forward_topk(x, w.to(dtype), ids.to(ids_dtype))
        assert _core._cpu_torch_outputs_alive() == alive + 1  # native here too
        checked = moe._forward_topk_checked(x, w.to(dtype), ids.to(ids_dtype))
        assert fast.dtype == dtype and torch.equal(fast, checked)
    del fast
    gc.collect()
    assert _core._cpu_torch_outputs_alive() == alive


def test_inputs_the_native_path_declines(fixture_path: Callable[[str], Path]) -> None:
    """Each input the native path cannot read faithfully is declined (None) rather than
    misread; the layer then answers through the checked path or names the argument."""
    moe = layer(fixture_path, "qwen3_w8a16_g128")
    core, h, e = moe._core, moe.hidden_size, moe.num_experts
    x, logits = torch.randn(4, h), torch.randn(4, e)
    want = moe._forward_checked(x, logits)
    assert torch.equal(core.forward_torch(x, logits), want)

    class Sub(torch.Tensor):
        pass

    # Read by the checked path, same values.
    for other in (
        torch.nn.Parameter(x, requires_grad=False),
        x.as_subclass(Sub),
        torch._neg_view(-x),  # memory holds -x, the values are x
    ):
        assert core.forward_torch(other, logits) is None
        assert torch.equal(moe(other, logits), want)
    assert core.forward_torch(x, torch._neg_view(-logits)) is None
    assert torch.equal(moe(x, torch._neg_view(-logits)), want)
    # The flag is asked of torch itself, not of whatever the instance says.
    liar = torch._neg_view(-x)
    liar.is_neg = lambda: False  # type: ignore[method-assign]
    assert core.forward_torch(liar, logits) is None
    assert torch.equal(moe(liar, logits), want)

    # A __torch_function__ mode sees the checks (they run first) and cannot slip a resize in
    # between an argument's export and the forward.
    class Resizer(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.Tensor.is_neg and args[0] is victim_logits:
                victim_x.resize_(0)  # the native path has not read victim_x yet
            return func(*args, **(kwargs or {}))

    victim_x, victim_logits = x.clone(), logits.clone()
    with Resizer():
        got = core.forward_torch(victim_x, victim_logits)
    assert got is None and victim_x.shape == (0,), "declined: hidden_states is now 1-d"
    # Refused by the checked path, which names the argument.
    for bad_x, bad_logits, name in (
        (x.t().contiguous().t(), logits, "hidden_states"),  # column-major
        (torch.randn(8, h)[::2], logits, "hidden_states"),  # strided rows
        (x.int(), logits, "hidden_states"),
        (x.to("meta"), logits, "hidden_states"),
        (x[:, :-1].contiguous(), logits, "hidden_states"),
        (x.reshape(1, 4, h), logits, "hidden_states"),
        (x, logits[:, :-1].contiguous(), "router_logits"),
        (x, logits[:3].contiguous(), "router_logits"),
        (x.numpy(), logits, "hidden_states"),
    ):
        assert core.forward_torch(bad_x, bad_logits) is None
        with pytest.raises(mq.LayoutError, match=name):
            moe(bad_x, bad_logits)
    _, w, ids = routing(4, moe)
    want = moe._forward_topk_checked(x, w, ids)
    for neg_w, neg_ids in ((torch._neg_view(-w), ids), (w, torch._neg_view(-ids))):
        assert core.forward_topk_torch(x, neg_w, neg_ids) is None
        assert torch.equal(moe.forward_topk(x, neg_w, neg_ids), want)
    for bad_ids in (-ids - 1, ids.float(), ids[:, :1].contiguous()):
        assert core.forward_topk_torch(x, w, bad_ids) is None
        with pytest.raises(mq.LayoutError, match="topk_ids|topk_weights"):
            moe.forward_topk(x, w, bad_ids)
    with pytest.raises(mq.LayoutError, match="not an expert"):
        moe.forward_topk(x, w, torch._neg_view(-(ids + e)))
    # An id past the last expert is read, and refused by the forward itself.
    with pytest.raises(
        mq.LayoutError,
        match=rf"topk_ids\[0, 0\] = \d+ is not an expert \(the layer has {e}, ids 0 to {e - 1}\)",
    ):
        core.forward_topk_torch(x, w, ids + e)


def test_native_path_reads_views_gradients_and_empty_batches(
    fixture_path: Callable[[str], Path],
) -> None:
    moe = layer(fixture_path, "qwen3_w8a8_dynamic")
    h, e = moe.hidden_size, moe.num_experts
    big, logits_big = torch.randn(9, h), torch.randn(9, e)
    # Rows 2..6 of a larger tensor: a storage offset, still row-major.
    view, lv = big[2:7], logits_big[2:7]
    assert view.storage_offset() > 0
    assert torch.equal(moe._core.forward_torch(view, lv), moe(view.clone(), lv.clone()))
    # One row: the stride of its size-1 dimension does not matter (torch calls it contiguous).
    row = torch.randn(h, 1).t()
    assert row.stride() == (1, 1) and row.is_contiguous()
    got = moe._core.forward_torch(row, logits_big[:1])
    assert got is not None and torch.equal(got, moe._forward_checked(row, logits_big[:1]))
    # requires_grad input: the native path reads it as it is and gives a plain tensor (the
    # layer's forward then attaches the inference-only backward: test_cpu_moe.py).
    xg = big[:2].clone().requires_grad_()
    out = moe._core.forward_torch(xg, logits_big[:2])
    assert not out.requires_grad and torch.equal(out, moe(big[:2], logits_big[:2]))
    with torch.inference_mode():
        assert torch.equal(moe(big[:2], logits_big[:2]), out)
    empty = moe(torch.empty(0, h, dtype=torch.bfloat16), torch.empty(0, e))
    assert empty.shape == (0, h) and empty.dtype == torch.bfloat16


def test_native_outputs_own_their_memory(fixture_path: Callable[[str], Path]) -> None:
    moe = layer(fixture_path, "qwen3_w4a16_g128_sym")
    x, logits = torch.randn(3, moe.hidden_size), torch.randn(3, moe.num_experts)
    alive = _core._cpu_torch_outputs_alive()
    outs = [moe(x, logits) for _ in range(20)]
    assert _core._cpu_torch_outputs_alive() == alive + 20
    assert len({o.data_ptr() for o in outs}) == 20, "each call owns a fresh buffer"
    first = outs[0].clone()
    outs[1].mul_(2).add_(1)  # writable, and writing one leaves the others alone
    assert torch.equal(outs[0], first) and outs[0].is_contiguous()
    kept = outs[5]
    del outs, moe  # an output outlives its layer
    gc.collect()
    assert _core._cpu_torch_outputs_alive() == alive + 1
    assert torch.equal(kept, first)
    view = kept[1:]
    del kept
    gc.collect()
    assert _core._cpu_torch_outputs_alive() == alive + 1, "a view keeps the buffer"
    del view
    gc.collect()
    assert _core._cpu_torch_outputs_alive() == alive


def test_custom_ops_are_registered_by_importing_moeq_rs_after_torch() -> None:
    """`import torch, moeq_rs` is enough to call torch.ops.moeq.* (they were registered only
    once moeq_rs.moe was imported); `import moeq_rs` alone still does not import torch."""
    import subprocess
    import sys

    ran = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, moeq_rs, sys\n"
            "print(sorted(n for n in ('fused_moe', 'moe_forward', 'moe_forward_topk')"
            " if hasattr(torch.ops.moeq, n)))\n"
            "print('moeq_rs.moe' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert ran.stdout.split("\n")[:2] == [
        "['fused_moe', 'moe_forward', 'moe_forward_topk']",
        "True",
    ]
    alone = subprocess.run(
        [sys.executable, "-c", "import sys, moeq_rs; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert alone.stdout.strip() == "False"
    # A torch that cannot host the ops does not break `import moeq_rs` (the checkpoint API
    # needs no torch); the error comes where the layer is asked for.
    broken = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, torch, importlib.abc\n"
            "class Refuse(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'moeq_rs.moe':\n"
            "            raise ImportError('no ops on this torch')\n"
            "sys.meta_path.insert(0, Refuse())\n"
            "import moeq_rs\n"
            "print(len(moeq_rs.open('examples/tiny-moe-int4-int8').moe_layers()))\n"
            "try:\n"
            "    moeq_rs.MoELayer\n"
            "except ImportError as e:\n"
            "    print(e)",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert broken.stdout.split("\n")[:2] == ["2", "no ops on this torch"], broken


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_function_transforms_and_scripting_are_refused_by_name(
    fixture_path: Callable[[str], Path],
) -> None:
    """Forward-mode AD dropped a dual input's tangent without a word; torch.func's vmap
    failed in a numpy conversion and its grad with torch's message about the op's autograd
    function; torch.jit.script on an internal line. Each now says what is not supported, and
    plain tensors inside a dual level still run."""

    from torch.autograd import forward_ad

    moe = mq.MoELayer.from_checkpoint(fixture_path("qwen3_w8a8_dynamic"), 0)
    x = torch.randn(3, moe.hidden_size)
    logits = torch.randn(3, moe.num_experts)
    weights, ids = torch.rand(3, 2), torch.randint(0, moe.num_experts, (3, 2))
    want = moe(x, logits)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.ones_like(x))
        for call in (lambda: moe(dual, logits), lambda: moe.forward_topk(dual, weights, ids)):
            with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
                call()
        assert torch.equal(moe(x, logits), want)
    for transform, says in (
        (lambda: torch.vmap(moe)(x[None], logits[None]), "torch.func transforms"),
        (lambda: torch.func.grad(lambda a: moe(a, logits).sum())(x), "torch.func transforms"),
        # jvp is forward-mode AD on dual tensors.
        (
            lambda: torch.func.jvp(lambda a: moe(a, logits), (x,), (torch.ones_like(x),)),
            "forward-mode derivative",
        ),
    ):
        with pytest.raises(NotImplementedError, match=says):
            transform()
    with pytest.raises(NotImplementedError, match="torch.jit.script cannot compile"):
        torch.jit.script(moe)
