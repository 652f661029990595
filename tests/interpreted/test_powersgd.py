"""PowerSGD kernels under the interpreter against the torch path, to fp32 summation-order
tolerance: P, Q and the residual of a step (with error feedback fused in), and the batched
Gram-Schmidt of ragged P matrices in one launch."""
import itertools

import pytest
import torch
import triton
from hypothesis import assume, example, given, settings, strategies as st
from kernel_utils import backend, gradient, residual_like

import gradcomp
from gradcomp.kernels import declared, powersgd as kernels
from gradcomp.kernels.traffic import count_bytes
from gradcomp.methods.powersgd import (orthonormalize_, orthonormalize_columns_,
                                       orthonormalize_runs_, project_, transpose_project_,
                                       unit_columns_, update_residual_)

TOL = 2e-5  # relative to the largest entry: sums of up to ~1e5 fp32 products in another order


def assert_close(actual, expected, scale=None):
    scale = expected.abs().max().item() if scale is None else scale
    assert (actual - expected).abs().max().item() <= TOL * max(scale, 1e-30), \
        f"max diff {(actual - expected).abs().max().item()} vs scale {scale}"


@settings(max_examples=4, deadline=None)
@given(n=st.integers(8, 300), m=st.one_of(st.integers(40, 700), st.just(9000)),
       rank=st.sampled_from([1, 2, 3, 4, 8, 16]), seed=st.integers(0, 2**16), feedback=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_step_matches_torch(n, m, rank, seed, feedback, dtype):
    method = gradcomp.get_method("powersgd", rank=rank, seed=seed)
    assume(method.low_rank((n, m)) is not None)  # else the uncompressed fallback: tested apart
    x = gradient(n * m, seed, dtype).view(n, m)
    residual = residual_like(n * m, seed) if feedback else None
    expected_residual = residual.clone() if feedback else None
    with backend("torch"):
        expected = method.compress(x, expected_residual, {})
    with backend("triton"):
        got = method.compress(x, residual, {})
    p, q = got.parts["p"], got.parts["q"]
    assert_close(p, expected.parts["p"], scale=1.0)
    assert_close(q, expected.parts["q"])
    if feedback:
        corrected = x.float().reshape(-1) + residual_like(n * m, seed)
        assert_close(residual, expected_residual, scale=corrected.abs().max().item())


def test_wide_matrix_splits_columns_across_programs():
    """A short, wide matrix is cut into column splits whose partial P meet in fp32 atomics."""
    n, m = 16, 40_000
    x, q0 = gradient(n * m, 1).view(n, m), torch.randn(m, 4)
    assert declared.matmul_splits(n, m, kernels.MATMUL_CPU_CONFIG.kwargs["BLOCK_N"]) > 1
    assert_close(kernels.ef_matmul(x, None, q0), x @ q0)


@settings(max_examples=6, deadline=None)
@example(k=1, n=3000, m=40, rank=4, seed=1, dtype=torch.float32)  # tall: rows split, atomics meet
@given(k=st.sampled_from([1, 3]), n=st.integers(1, 700), m=st.integers(1, 300),
       rank=st.sampled_from([1, 3, 4, 16]), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_transpose_matmul_matches_torch(k, n, m, rank, seed, dtype):
    """Q = M^T P for k matrices strided in a bucket (any gradient dtype), its row splits summed in
    fp32 atomics into a Q the launcher zero-fills."""
    x = bucket_batch(k, n, m, 5, seed, dtype)
    p = gradient(k * n * rank, seed + 1).view(k, n, rank)
    q = torch.full((k, m, rank), float("nan"))
    kernels.transpose_matmul(x, p, out=q)
    assert_close(q, torch.bmm(x.float().transpose(1, 2), p))
    if k == 1:
        assert_close(kernels.transpose_matmul(x[0], p[0]), x[0].float().T @ p[0])


def test_tall_matrix_splits_rows_across_programs():
    """A tall, narrow M: Q = M^T P in row splits that meet in fp32 atomics."""
    n, m = 12_000, 16
    assert declared.matmul_splits(m, n, kernels.MATMUL_CPU_CONFIG.kwargs["BLOCK_M"]) > 1
    x, p = gradient(n * m, 6).view(n, m), gradient(n * 4, 7).view(n, 4)
    assert_close(kernels.transpose_matmul(x, p), x.T @ p)


def part(t: torch.Tensor, offset: int, k: int, *shape: int) -> torch.Tensor:
    """k matrices of ``shape`` back to back in the flat t from ``offset``."""
    return t[offset:offset + k * shape[0] * shape[1]].view(k, *shape)


@settings(max_examples=2, deadline=None)
@example(seed=1, feedback=True, dtype=torch.bfloat16, rank=16)
@example(seed=2, feedback=False, dtype=torch.float32, rank=4)  # M read from the bucket; decode only
@given(seed=st.integers(0, 2**16), feedback=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), rank=st.sampled_from([1, 4, 16]))
def test_runs_of_a_bucket_match_torch_run_by_run(seed, feedback, dtype, rank):
    """Runs of three shapes in one bucket (gaps between matrices, rank clipped per shape as the
    hook's plan does), one launch per pass: P = (x + r) Q, Q = M^T P, then the decode into the
    bucket and the residual M - P Q^T in one pass; equal to the torch path run by run, and the
    bucket's gaps untouched."""
    layout = [(2, 30, 300), (1, 300, 20), (3, 9, 41)]  # (k, n, m)
    runs, at_x, at_m, at_p, at_q = [], 7, 0, 0, 0
    for k, n, m in layout:
        r = min(rank, n, m)
        runs.append(kernels.Run(k, n, m, r, at_x, n * m + 5, at_m, at_p, at_q))
        at_x, at_m, at_p, at_q = at_x + k * (n * m + 5), at_m + k * n * m, at_p + k * n * r, at_q + k * m * r
    bucket = gradient(at_x + 3, seed, dtype)
    q = gradient(at_q, seed + 1)
    residual = residual_like(at_m, seed) if feedback else None
    expected = []
    for run in runs:  # the torch path, batch by batch
        x = bucket.as_strided((run.k, run.n, run.m), (run.x_stride, run.m, 1), run.x_offset)
        res = None if residual is None else part(residual.clone(), run.res_offset, run.k, run.n, run.m)
        p = torch.empty(run.k, run.n, run.rank)
        with backend("torch"):
            mats = project_(x, res, part(q, run.q_offset, run.k, run.m, run.rank), p)
            q_new = transpose_project_(mats, p, torch.empty(run.k, run.m, run.rank))
            decoded = torch.bmm(p, q_new.transpose(1, 2))
            if res is not None:
                update_residual_(mats, p, q_new)
        expected.append((p, q_new, decoded.to(dtype), mats))  # decoded as the bucket holds it
    p, q_new, out = torch.full((at_p,), float("nan")), torch.full((at_q,), float("nan")), bucket.clone()
    with count_bytes() as traffic:
        kernels.ef_matmul_runs(bucket, residual, q, p, runs)
        kernels.transpose_matmul_runs(bucket, residual, p, q_new, runs)
        kernels.residual_update_runs(out, residual, p, q_new, runs)
    assert [name for name, _ in traffic.launches] == [
        "ef_matmul_kernel", "transpose_matmul_kernel", "residual_update_kernel"]
    untouched = torch.ones(len(out), dtype=torch.bool)
    for run, (p_ref, q_ref, decoded, m_ref) in zip(runs, expected):
        assert_close(part(p, run.p_offset, run.k, run.n, run.rank), p_ref)
        assert_close(part(q_new, run.q_offset, run.k, run.m, run.rank), q_ref)
        got = out.as_strided((run.k, run.n, run.m), (run.x_stride, run.m, 1), run.x_offset).float()
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 0.0  # fp32 sums that differ may round apart
        error = (got - decoded.float()).abs() - ulp * decoded.float().abs()
        assert error.max().item() <= TOL * decoded.float().abs().max().item()
        for b in range(run.k):
            untouched[run.x_offset + b * run.x_stride:run.x_offset + b * run.x_stride + run.n * run.m] = False
        if feedback:
            assert_close(part(residual, run.res_offset, run.k, run.n, run.m), m_ref,
                         scale=m_ref.abs().max().item() + decoded.float().abs().max().item())
    assert torch.equal(out[untouched], bucket[untouched])


def test_bad_runs_are_named():
    x, q, p = torch.zeros(100), torch.zeros(40), torch.zeros(40)
    with pytest.raises(ValueError, match="at least one run"):
        kernels.ef_matmul_runs(x, None, q, p, ())
    with pytest.raises(ValueError, match=r"runs\[0\] must be a Run"):
        kernels.ef_matmul_runs(x, None, q, p, [(1, 10, 10)])
    with pytest.raises(ValueError, match=r"runs\[1\] reaches element 120 of x, which has 100"):
        kernels.ef_matmul_runs(x, None, q, p, [kernels.Run(1, 2, 10, 2), kernels.Run(1, 10, 10, 1, 20)])
    with pytest.raises(ValueError, match=r"runs\[0\]: x_stride 5 is below n \* m = 20"):
        kernels.transpose_matmul_runs(x, None, p, q, [kernels.Run(2, 2, 10, 1, 0, 5)])
    with pytest.raises(ValueError, match="ranks 1..16"):
        kernels.residual_update_runs(x, None, p, q, [kernels.Run(1, 2, 10, 17)])
    with pytest.raises(ValueError, match="needs out, residual or both"):
        kernels.residual_update_runs(None, None, p, q, [kernels.Run(1, 2, 10, 1)])
    with pytest.raises(ValueError, match="x must be 1-D"):
        kernels.ef_matmul_runs(x.view(10, 10), None, q, p, [kernels.Run(1, 2, 10, 1)])


def test_non_finite_gradient_never_enters_the_residual():
    x = gradient(64 * 500, 2).view(64, 500)
    x[3, 7] = float("nan")
    residual = residual_like(64 * 500, 2)
    with backend("triton"):
        p = gradcomp.get_method("powersgd").compress(x, residual).parts["p"]
    assert torch.isfinite(residual).all() and not torch.isfinite(p).all()


@settings(max_examples=6, deadline=None)
@given(shapes=st.lists(st.integers(1, 1000).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, min(n, 8)))),
                       min_size=1, max_size=5),
       epsilon=st.sampled_from([0.0, 1e-8]), seed=st.integers(0, 2**16))
def test_batched_gram_schmidt_matches_per_matrix_reference(shapes, epsilon, seed):
    """n x r matrices with r <= n, as PowerSGD's plan makes P (r = min(rank, n, m)): past n
    columns, what is left of a column is rounding noise, which epsilon 0 scales to unit length
    differently in every summation order."""
    gen = torch.Generator().manual_seed(seed)
    matrices = [torch.randn(n, r, generator=gen) for n, r in shapes]
    matrices[0].zero_()  # an all-zero gradient must stay zero (no 0/0)
    flat = torch.cat([t.reshape(-1) for t in matrices])
    kernels.orthonormalize_batched_(flat, shapes, epsilon)
    offset = 0
    for t, (n, r) in zip(matrices, shapes):
        got = flat[offset:offset + n * r].view(n, r)
        assert_close(got, orthonormalize_(t.clone(), epsilon), scale=1.0)
        offset += n * r


def test_ranks_beyond_the_kernels_run_on_torch():
    x = gradient(200 * 300, 3).view(200, 300)
    method = gradcomp.get_method("powersgd", rank=kernels.MAX_RANK + 1)
    with backend("triton"):
        payload = method.compress(x)
    assert payload.parts["p"].shape == (200, kernels.MAX_RANK + 1)
    with pytest.raises(ValueError, match="ranks"):
        kernels.ef_matmul(x, None, torch.zeros(300, kernels.MAX_RANK + 1))


def bucket_batch(k, n, m, gap, seed, dtype):
    """k gradients [n, m] evenly spaced in a bucket (``gap`` elements between them), as the
    hook's strided [k, n, m] view of it."""
    stride = n * m + gap
    bucket = gradient(k * stride, seed, dtype)
    return bucket.as_strided((k, n, m), (stride, m, 1))


@settings(max_examples=1, deadline=None)  # the examples: every k, gap, dtype and feedback
@example(k=5, n=70, m=1100, rank=16, gap=5, seed=1, feedback=True, dtype=torch.bfloat16)
@example(k=2, n=33, m=1100, rank=8, gap=0, seed=2, feedback=False, dtype=torch.float32)
@example(k=5, n=9, m=300, rank=1, gap=5, seed=3, feedback=True, dtype=torch.float32)
@example(k=2, n=150, m=77, rank=2, gap=5, seed=4, feedback=True, dtype=torch.bfloat16)
@example(k=1, n=64, m=1100, rank=4, gap=0, seed=5, feedback=True, dtype=torch.float32)
@given(k=st.sampled_from([1, 2, 5]), n=st.integers(1, 150), m=st.one_of(st.integers(8, 400), st.just(1100)),
       rank=st.sampled_from([1, 2, 3, 4, 8, 16]), gap=st.sampled_from([0, 5]),
       seed=st.integers(0, 2**16), feedback=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_batched_power_step_matches_torch(k, n, m, rank, gap, seed, feedback, dtype):
    """A power step as the hook runs it, one launch per batch of k matrices (strided in a
    bucket): P = (x + r) Q, the residual becoming M, Q = M^T P and M - P Q^T for the
    orthonormalized P, against the torch path of the same batched functions."""
    rank = min(rank, n, m)  # as PowerSGD.low_rank
    x = bucket_batch(k, n, m, gap, seed, dtype)
    q = unit_columns_(gradient(k * m * rank, seed + 1).view(k, m, rank))
    residual = residual_like(k * n * m, seed).view(k, n, m) if feedback else None
    results = {}
    for name in ("torch", "triton"):
        r = residual.clone() if feedback else None
        p = torch.full((k, n, rank), float("nan"))  # the kernels must zero-fill it themselves
        with backend(name):
            mats = project_(x, r, q, p)
            projected = p.clone()
            orthonormalize_columns_(p)
            q_new = transpose_project_(mats, p, torch.full((k, m, rank), float("nan")))
            if feedback:
                update_residual_(mats, p, q_new)
        results[name] = (projected, mats, q_new)
    (p_ref, m_ref, q_ref), (p_got, m_got, q_got) = results["torch"], results["triton"]
    assert_close(p_got, p_ref)
    assert_close(q_got, q_ref)
    corrected = x.float() + (residual if feedback else 0)
    if feedback:  # M - P Q^T, P Q^T to the tolerance of the P it was made of
        assert_close(m_got, m_ref, scale=corrected.abs().max().item())
    else:
        assert torch.equal(m_got, corrected)


@pytest.mark.parametrize("feedback", [True, False])
def test_launches_per_power_step_do_not_grow_with_the_batch(feedback):
    """A power step over k same-shape matrices launches the same kernels and torch operators
    for k = 1 and k = 5, and each kernel moves k times its declared bytes per matrix."""
    n, m, rank = 40, 1100, 4
    steps = {}
    for k in (1, 5):
        x = bucket_batch(k, n, m, 3, k, torch.float32)
        residual = residual_like(k * n * m, k).view(k, n, m) if feedback else None
        q = unit_columns_(gradient(k * m * rank, 9).view(k, m, rank))
        p = torch.empty(k, n, rank)
        with backend("triton"), count_bytes() as traffic:
            mats = project_(x, residual, q, p)
            orthonormalize_columns_(p)  # (the hook's orthonormalize_runs_: one launch per bucket)
            q_new = transpose_project_(mats, p, torch.empty(k, m, rank))
            if feedback:
                update_residual_(mats, p, q_new)
        steps[k] = traffic
        config = kernels.MATMUL_CPU_CONFIG.kwargs
        bn, bm = config["BLOCK_N"], config["BLOCK_M"]
        launched = dict(traffic.launches)
        assert launched["ef_matmul_kernel"] == k * declared.ef_matmul_bytes(
            n, m, rank, 4, feedback, bn, declared.matmul_splits(n, m, bn))
        assert launched["orthonormalize_kernel"] == declared.orthonormalize_bytes([(n, rank)] * k)
        assert launched["transpose_matmul_kernel"] == k * declared.transpose_matmul_bytes(
            n, m, rank, 4, bm, declared.matmul_splits(m, n, bm))
        if feedback:
            assert launched["residual_update_kernel"] == k * declared.residual_update_bytes(
                n, m, rank, bn, bm)
    assert declared.matmul_splits(n, m, kernels.MATMUL_CPU_CONFIG.kwargs["BLOCK_N"]) > 1  # atomics too
    names = {k: [name for name, _ in t.launches] for k, t in steps.items()}
    ops = {k: [name for name, _ in t.torch_ops] for k, t in steps.items()}
    assert names[1] == names[5] and ops[1] == ops[5] == ["zero_", "zero_"]  # P and Q zero-filled once
    assert names[5] == (["ef_matmul_kernel", "orthonormalize_kernel", "transpose_matmul_kernel"]
                        + ["residual_update_kernel"] * feedback)


@pytest.mark.parametrize("rank", [1, 3, 8, 16])
def test_splits_give_a_gpu_enough_programs(rank):
    """A 4096 x 4096 matrix: 64 row blocks x 8 splits (~4 programs per SM of an H100), each
    split >= MIN_SPLIT_COLUMNS wide; splits beyond the first add at most rank / 64 bytes per
    element of atomics."""
    bn = kernels.MATMUL_CONFIGS[0].kwargs["BLOCK_N"]
    for n, m in ((4096, 4096), (64, 1 << 20), (1 << 20, 64), (16, 40_000), (300, 700)):
        splits = declared.matmul_splits(n, m, bn)
        assert 1 <= splits <= declared.TARGET_PROGRAMS
        assert splits == 1 or m // splits >= declared.MIN_SPLIT_COLUMNS
        assert triton.cdiv(n, bn) * splits >= declared.TARGET_PROGRAMS or splits == max(1, m // declared.MIN_SPLIT_COLUMNS)
        extra_atomics = 8 * n * rank * (splits - 1)  # beyond the one add of an unsplit matrix
        assert extra_atomics <= n * m * rank / 64
    assert declared.matmul_splits(4096, 4096, bn) == 8  # 64 x 8 = 512 programs (was 64 x 1)


def test_bad_batches_are_named():
    x, q = torch.zeros(2, 8, 40), torch.zeros(2, 40, 4)
    with pytest.raises(ValueError, match="x must be contiguous"):
        kernels.ef_matmul(x.transpose(1, 2), None, q)
    with pytest.raises(ValueError, match=r"q must be a \[k, n, m\] batch .* \[2, 40, \*\]"):
        kernels.ef_matmul(x, None, torch.zeros(3, 40, 4))
    with pytest.raises(ValueError, match="residual must be"):
        kernels.ef_matmul(x, torch.zeros(2, 8, 41), q)
    with pytest.raises(ValueError, match="out must be"):
        kernels.ef_matmul(x, None, q, out=torch.zeros(2, 8, 3))
    with pytest.raises(ValueError, match="ranks 1..16"):
        kernels.ef_matmul(x, None, torch.zeros(2, 40, 17))
    with pytest.raises(ValueError, match="p must be"):
        kernels.residual_update(x, torch.zeros(2, 9, 4), q)
    with pytest.raises(ValueError, match=r"p must be a \[k, n, m\] batch .* \[2, 8, \*\]"):
        kernels.transpose_matmul(x, torch.zeros(2, 9, 4))
    with pytest.raises(ValueError, match="out must be"):
        kernels.transpose_matmul(x, torch.zeros(2, 8, 4), out=torch.zeros(2, 40, 3))
    with pytest.raises(ValueError, match="matrix must be contiguous"):
        kernels.residual_update(x[:, :, :20], torch.zeros(2, 8, 4), q[:, :20])


def test_a_buckets_runs_are_orthonormalized_in_one_launch(monkeypatch):
    """The hook's P parts (runs of k matrices [n, r] back to back, ragged) in one kernel launch,
    as the torch path's QR per run; the offset tables are made (copied to the device) once per
    cache."""
    runs = [(3, 50, 4), (1, 200, 4), (2, 7, 3), (1, 16, 16)]
    total = sum(k * n * r for k, n, r in runs)
    expected = gradient(total, 5)
    with backend("torch"):
        orthonormalize_runs_(expected, runs)
    made = []
    original = kernels.orthonormalize_tables
    monkeypatch.setattr(kernels, "orthonormalize_tables",
                        lambda shapes, device: made.append(shapes) or original(shapes, device))
    cache, got = {}, []
    for _ in range(2):
        flat = gradient(total, 5)
        with backend("triton"), count_bytes() as traffic:
            orthonormalize_runs_(flat, runs, cache=cache)
        assert [name for name, _ in traffic.launches] == ["orthonormalize_kernel"]
        assert_close(flat, expected, scale=1.0)
        got.append(flat)
    assert made == [[(50, 4)] * 3 + [(200, 4)] + [(7, 3)] * 2 + [(16, 16)]]
    assert list(cache) == [flat.device] and torch.equal(got[0], got[1])


def _hook_steps(rank, world):
    """Per backend: the averaged gradients of 3 PowerSGD hook steps of an MLP with four
    same-shape weights in one bucket (one run of 4, plus the output layer), and the kernel
    launches and bucket calls on the kernels."""
    import os

    from ddp_models import make_ddp
    from kernel_utils import counted_launches

    from gradcomp.hooks import register
    os.environ["GRADCOMP_CPU_COMPILE"] = "0"
    out = {}
    for name in ("torch", "triton"):
        os.environ["GRADCOMP_BACKEND"] = name
        torch.manual_seed(0)
        layers = [torch.nn.Linear(24, 24) for _ in range(4)] + [torch.nn.Linear(24, 10)]
        ddp = make_ddp(torch.nn.Sequential(*layers), bucket_cap_mb=25)
        state = register(ddp, "powersgd", matrix_rank=2)
        grads = []
        with counted_launches() as launches:
            for step in range(3):
                ddp.zero_grad(set_to_none=True)
                x = torch.randn(8, 24, generator=torch.Generator().manual_seed(100 * step + rank))
                ddp(x).square().mean().backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in ddp.parameters()]))
        out[name] = (torch.stack(grads), dict(launches), state.stats()["buckets"])
    return out


def test_hook_launches_each_pass_once_per_bucket():
    """powersgd_hook on the kernels gives the torch backend's gradients (to the kernels'
    tolerance), with one launch of each pass per bucket for its matrices of two shapes (the four
    hidden weights and the output layer)."""
    from dist_utils import run_ranks
    results = run_ranks(_hook_steps, 2, timeout_s=300)
    (reference, _, calls), (got, launches, triton_calls) = results[0]["torch"], results[0]["triton"]
    assert calls == triton_calls >= 3
    assert torch.equal(got, results[1]["triton"][0])  # the replicas agree
    assert_close(got, reference)
    assert launches == {"ef_matmul_kernel": calls, "orthonormalize_kernel": calls,
                        "transpose_matmul_kernel": calls, "residual_update_kernel": calls}


def _launches_per_bucket(rank, world):
    """Kernel launches and torch operators of one warm powersgd_hook call on a bucket of 3 and on
    one of 7 matrices of the same 3 shapes (the 7 in 4 runs: not all evenly spaced)."""
    import os

    from ddp_models import FakeBucket

    from gradcomp.hooks import PowerSGDState, powersgd_hook
    os.environ["GRADCOMP_CPU_COMPILE"], os.environ["GRADCOMP_BACKEND"] = "0", "triton"

    class MatrixBucket(FakeBucket):
        def __init__(self, shapes, seed):
            super().__init__(gradient(sum(a * b for a, b in shapes), seed))
            starts = [0, *itertools.accumulate(a * b for a, b in shapes)]
            self._params = [self._buffer[s:s + a * b].view(a, b) for s, (a, b) in zip(starts, shapes)]

        def gradients(self):
            return self._params

    a, b, c = (16, 40), (24, 24), (40, 16)
    out = {}
    for shapes in ([a, b, c], [a, b, a, c, b, a, c]):
        bucket, state = MatrixBucket(shapes, len(shapes)), PowerSGDState(matrix_rank=2)
        powersgd_hook(state, bucket).wait()  # the bucket's plan, tables and warm Q
        with count_bytes() as traffic:
            powersgd_hook(state, bucket).wait()
        out[len(shapes)] = ([name for name, _ in traffic.launches], [name for name, _ in traffic.torch_ops],
                            len(state._plan(bucket).chunks))
    return out


def test_launches_per_bucket_do_not_grow_with_matrices_or_shapes():
    """The hook on the kernels launches the same kernels and torch operators for 3 matrices of 3
    shapes and for 7 of those shapes in 4 runs: one launch of each pass per bucket."""
    from dist_utils import run_ranks
    (three, seven), = [(r[3], r[7]) for r in run_ranks(_launches_per_bucket, 1, timeout_s=120)]
    assert three[2] == 3 and seven[2] == 4  # runs of evenly spaced same-shape matrices
    assert three[:2] == seven[:2]
    assert three[0] == ["ef_matmul_kernel", "orthonormalize_kernel", "transpose_matmul_kernel",
                        "residual_update_kernel"]


def test_p_zeroed_by_the_caller_is_not_filled_again():
    """The hook zero-fills all of a bucket's P parts at once; project_ then adds into them."""
    k, n, m, rank = 2, 30, 600, 3
    x, q = bucket_batch(k, n, m, 0, 3, torch.float32), gradient(k * m * rank, 4).view(k, m, rank)
    p = torch.zeros(k, n, rank)
    with backend("triton"), count_bytes() as traffic:
        project_(x, None, q, p, p_zeroed=True)
    assert traffic.torch_ops == [] and [name for name, _ in traffic.launches] == ["ef_matmul_kernel"]
    assert_close(p, torch.bmm(x, q))
