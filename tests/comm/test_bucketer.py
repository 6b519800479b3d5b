"""GradientBucketer without a process group: the bucket plan, and bad input."""

import math
import warnings

import pytest
import torch
from torch import nn

from macroarch.comm import GradientBucketer, MiB, check_bucket_mb, ddp_with_buckets, plan_buckets


def _params(*numels, dtype=torch.float32):
    return [torch.zeros(n, dtype=dtype, requires_grad=True) for n in numels]


@pytest.mark.parametrize("bucket_bytes", [4, 40, 100, 4000, 1 << 20])
def test_buckets_have_exactly_the_asked_size_and_cover_every_element_once(bucket_bytes):
    params = _params(7, 30, 1, 64, 3)
    buckets, offsets, pieces = plan_buckets(params, bucket_bytes)
    capacity = bucket_bytes // 4
    total = sum(p.numel() for p in params)
    assert [b.nbytes for b in buckets[:-1]] == [capacity * 4] * (len(buckets) - 1)
    assert sum(b.numel for b in buckets) == total and len(buckets) == math.ceil(total / capacity)
    assert [b.start for b in buckets] == [i * capacity for i in range(len(buckets))]  # contiguous, in order
    assert offsets == [0, 7, 37, 38, 102]
    for p, ps in zip(params, pieces):
        assert sum(count for _, count in ps) == p.numel()
        assert [b for b, _ in ps] == sorted(b for b, _ in ps)


def test_breaks_close_buckets_at_group_starts():
    buckets, _, pieces = plan_buckets(_params(10, 10, 10), 400, breaks={1, 2})
    assert [b.numel for b in buckets] == [10, 10, 10]
    assert [ps for ps in pieces] == [[(0, 10)], [(1, 10)], [(2, 10)]]


def test_one_buffer_per_dtype_and_buckets_numbered_by_filling():
    params = _params(6) + _params(6, dtype=torch.float64) + _params(6)
    buckets, offsets, _ = plan_buckets(params, 48)  # 12 fp32 or 6 fp64 elements
    assert [(b.dtype, b.numel) for b in buckets] == [(torch.float64, 6), (torch.float32, 12)]
    assert offsets == [0, 0, 6]


def test_bucket_names_say_which_elements_of_a_split_parameter_they_hold():
    buckets, _, _ = plan_buckets(_params(10), 16, names=["w"])
    assert [b.names for b in buckets] == [("w[0:4]",), ("w[4:8]",), ("w[8:10]",)]


@pytest.mark.parametrize("bad", [0, -8, float("nan"), float("inf"), True, "8", None])
def test_bucket_mb_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="bucket_mb"):
        check_bucket_mb(bad)
    with pytest.raises(ValueError, match="bucket_mb"):
        GradientBucketer(nn.Linear(2, 2), bucket_mb=bad)


def test_a_bucket_size_that_is_not_a_multiple_of_8_mib_warns_but_is_used():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ok in (8, 16, 24.0, 64):
            assert check_bucket_mb(ok) == ok
    with pytest.warns(UserWarning, match="not a multiple of 8 MiB"):
        assert check_bucket_mb(25) == 25.0


def test_a_bucket_smaller_than_one_element_is_refused():
    with pytest.raises(ValueError, match="cannot hold one"):
        plan_buckets(_params(3), 2)


def test_without_an_initialised_process_group_the_error_says_what_to_do():
    with pytest.raises(RuntimeError, match="not initialised.*init_process_group"):
        GradientBucketer(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="not initialised"):
        ddp_with_buckets(nn.Linear(2, 2), bucket_mb=8)


@pytest.mark.parametrize("kwargs, match", [({"window_ms": -1}, "window_ms"), ({"window_ms": "200"}, "window_ms"),
                                           ({"timeout": 0}, "timeout"), ({"timeout": -3.0}, "timeout")])
def test_bad_window_and_timeout(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientBucketer(nn.Linear(2, 2), **kwargs)


def test_mib_is_binary():
    assert MiB == 2**20


def test_ddp_bucket_bytes_are_the_buckets_ddp_built():
    """One rank in this process: with a cap below every parameter, DDP (which never splits a parameter) gives each
    its own bucket, so the sizes reported are the parameters' bytes, one each (read through ``_compat``'s shim)."""
    import torch.distributed as dist

    from macroarch.comm import ddp_bucket_bytes

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8, bias=False))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # not a multiple of 8 MiB, on purpose
            ddp = ddp_with_buckets(model, bucket_mb=16 / MiB)  # 16 bytes: below every parameter
        for _ in range(2):  # DDP rebuilds its buckets at the second forward, in the order gradients came
            ddp(torch.randn(4, 16)).sum().backward()
        sizes = ddp_bucket_bytes(ddp)
        assert sorted(sizes) == sorted(p.numel() * p.element_size() for p in model.parameters())
    finally:
        dist.destroy_process_group()
