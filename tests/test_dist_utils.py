import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch.multiprocessing import ProcessRaisedException


def _sum_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _rank_one_fails(rank, world_size):
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def _rank_one_hangs(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return rank


def test_run_ranks_all_reduce():
    assert run_ranks(_sum_rank, 2) == [1.0, 1.0]


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(ProcessRaisedException, match=r"(?s)Process 1 .*_rank_one_fails.*rank one says no"):
        run_ranks(_rank_one_fails, 2)


def test_a_hanging_rank_is_killed_after_the_wall_limit():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="_rank_one_hangs on 2 ranks did not finish in 20 s"):
        run_ranks(_rank_one_hangs, 2, wall_s=20)
    assert time.monotonic() - started < 60
