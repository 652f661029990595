"""Replaying a checkpoint's bucket layout on the first step of a resumed run, so that it is
bit-identical to an uninterrupted one (see :func:`replay_saved_layout`), and the duck-typed
bucket that replay (and the per-parameter call form) hands to a hook.
"""
from __future__ import annotations

import torch

from ..comm import _forward


def replay_saved_layout(state, bucket, hook):
    """Make a resumed run bit-identical to an uninterrupted one (``state``: a HookState).

    DDP's first step in a new process uses its initial bucket layout and only then rebuilds
    the buckets in gradient order, so compressing that step bucket by bucket would differ
    from the uninterrupted run. On the first step after ``load_state_dict`` whose first
    bucket differs from the checkpoint's, this holds every bucket (returning a Future for
    each) until DDP's last one; then, if the step's buckets hold exactly the checkpoint's
    parameters, it runs ``hook`` on the checkpoint's buckets in their order and scatters the
    results back, otherwise on DDP's own buckets. Returns None when the hook should proceed
    normally. Costs one step without overlap, once per restart.
    """
    saved = state._saved_layouts
    if saved is None or state._replaying:
        return None
    layout = state.bucket_layout(bucket)
    if state._replay is None:
        if saved.get(bucket.index()) == layout:
            state._saved_layouts = None
            return None
        state._replay = _Replay(saved)
    future = state._replay.add(bucket, layout)
    if bucket.is_last():
        replay, state._replay, state._saved_layouts = state._replay, None, None
        state._replaying = True
        try:
            replay.run(state, hook)
        finally:
            state._replaying = False
    return future


class _Bucket:
    """A duck-typed GradBucket over part of a flat buffer (for replaying a saved layout, and for
    compiled autograd's per-parameter calls)."""

    def __init__(self, index: int, last: bool, buffer: torch.Tensor, params: list):
        self._index, self._last, self._buffer, self._params = index, last, buffer, params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list:
        return self._params

    def gradients(self) -> list:
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


class _Replay:
    """One step's buckets held until DDP's last, then reduced in a checkpoint's bucket layout
    (see replay_saved_layout)."""

    def __init__(self, saved: dict):
        self.saved = saved
        self.pending = []  # (bucket, layout, future) in DDP's order

    def add(self, bucket, layout) -> torch.futures.Future:
        future = torch.futures.Future()
        self.pending.append((bucket, layout, future))
        return future

    def run(self, state, hook) -> None:
        """Reduce the held buckets; whatever fails completes every held Future with the error,
        so that DDP raises at the end of backward instead of waiting on them forever."""
        try:
            self._run(state, hook)
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        for _, _, future in self.pending:
            if not future.done():
                future.set_exception(exc)

    def _run(self, state, hook) -> None:
        sizes = {key: numel for _, layout, _ in self.pending for key, numel in layout}
        saved_sizes = {key: numel for layout in self.saved.values() for key, numel in layout}
        check_sizes(type(state).__name__, saved_sizes, sizes)
        if set(sizes) != set(saved_sizes):  # another bucketing of other parameters: DDP's own buckets
            for bucket, _, future in self.pending:
                hook(state, bucket).add_done_callback(lambda done, future=future: _forward(done, future))
            return
        pieces = {}  # parameter key -> its flat gradient in DDP's bucket
        for bucket, layout, _ in self.pending:
            offset = 0
            for key, numel in layout:
                pieces[key] = bucket.buffer()[offset:offset + numel]
                offset += numel
        order = sorted(self.saved)
        like = self.pending[0][0].buffer()
        buckets = []
        for index in order:
            layout = self.saved[index]
            buffer = torch.cat([pieces[key] for key, _ in layout]).to(like.dtype)
            buckets.append(_Bucket(index, index == order[-1], buffer, [state._params[key] for key, _ in layout]))
        futures = [hook(state, bucket) for bucket in buckets]
        torch.futures.collect_all(futures).then(lambda collected: self._scatter_back(collected, order))

    def _scatter_back(self, collected, order) -> None:
        try:
            results = {}
            for index, done in zip(order, collected.value()):
                offset = 0
                for key, numel in self.saved[index]:
                    results[key] = done.value()[offset:offset + numel]
                    offset += numel
            outs = []
            for bucket, layout, _ in self.pending:
                out, offset = torch.zeros_like(bucket.buffer()), 0
                for key, numel in layout:
                    out[offset:offset + numel] = results[key]
                    offset += numel
                outs.append(out)
        except Exception as exc:  # on a Gloo thread: the error must reach whoever waits
            self._fail(exc)
            return
        for (_, _, future), out in zip(self.pending, outs):
            future.set_result(out)


def check_sizes(name: str, saved: dict, live: dict) -> None:
    """Raise ValueError when a parameter key has another number of elements in the checkpoint
    (``saved``: key -> numel) than in the live model (``live``): its residual cannot carry over,
    as torch's ``load_state_dict`` refuses a resized parameter."""
    resized = [f"{key}: {saved[key]} elements in the checkpoint, {live[key]} in the model"
               for key in sorted(set(saved) & set(live)) if saved[key] != live[key]]
    if resized:
        raise ValueError(f"{name}.load_state_dict: the checkpoint was saved for parameters of other "
                         f"sizes ({'; '.join(resized)}); error-feedback residuals do not carry over to "
                         f"a resized model: start from a fresh state for it (skip load_state_dict)")
