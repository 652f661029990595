import time
from pathlib import Path

import dist_utils
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


def _rank_one_hangs(rank, world_size, folder):
    if rank == 1:
        Path(folder, "hanging").touch()  # in fn, not still starting, when the limit strikes
        time.sleep(600)
    return rank


def test_run_ranks_all_reduce():
    assert run_ranks(_sum_rank, 2) == [1.0, 1.0]


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(ProcessRaisedException, match=r"(?s)Process 1 .*_rank_one_fails.*rank one says no"):
        run_ranks(_rank_one_fails, 2)


def test_a_hanging_rank_is_killed_after_the_wall_limit(tmp_path):
    """3 s: a 2-rank launch reaches fn in under 1 s on a loaded 2-core machine (a failing rank's
    test takes 0.8 s), and the marker shows rank 1 was hanging in fn when it was killed."""
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="_rank_one_hangs on 2 ranks did not finish in 3 s"):
        run_ranks(_rank_one_hangs, 2, str(tmp_path), wall_s=3)
    assert 3 <= time.monotonic() - started < 43
    assert (tmp_path / "hanging").exists()


def test_what_libraries_set_on_themselves_keeps_ranks_on_the_forkserver(monkeypatch):
    """Lightning and scikit-learn (on import) and torch.compile (on first use) set variables
    torch reads at import in their own process; start_method() must not read them as the
    caller's change (a test worker that used them would spawn every later rank: 10-50 s a launch
    instead of 0.5 s)."""
    import lightning_fabric  # noqa: F401  (sets PYTORCH_NVML_BASED_CUDA_CHECK=1)
    pytest.importorskip("sklearn")  # the data extra; sets KMP_DUPLICATE_LIB_OK, KMP_INIT_AT_FORK
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()  # what torch.compile's first use calls: sets TORCHINDUCTOR_CACHE_DIR
    remembered = dist_utils._read_at_import(dist_utils._session_env)
    assert dist_utils._read_at_import() == remembered
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the control: a caller's own choice is seen
    assert dist_utils._read_at_import() != remembered
