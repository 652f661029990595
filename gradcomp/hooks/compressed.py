"""DDP hooks for every registered method under each flat scheme it offers (``gradcomp.schemes``:
allreduce for summable payloads (fp16, bf16), allgather and twophase for any method), all run by
:func:`scheme_hook`. ``allreduce_hook`` is the baseline.

Each hook follows PyTorch's contract ``hook(state, bucket) -> Future[Tensor]``: the Future holds
the average over ranks of ``bucket.buffer()`` (same size and dtype). Every rank sends its bucket
times 1/world_size, so every scheme's sum is the average and fp16 sums cannot overflow: the
compressed hooks pass 1/world_size to ``Method.compress`` as its ``scale`` (folded into the
compression's own pass for a method that ``prescales``: fp16, bf16, int8, int4, sign and
top-k, whose product is taken in fp32, so a bf16 bucket's is not rounded to bf16 first; PowerSGD
averages its reduced factors itself), and ``allreduce_hook``
multiplies the bucket in place as DDP's own reducer does. Collectives are issued from the hook's
thread; callbacks only decode, straight into the bucket buffer (one decode-and-sum of all ranks'
payloads).
"""
from __future__ import annotations


import torch.distributed as dist

from .. import comm
from ..feedback import LOCO_RESET_EVERY, check_loco
from ..methods import get_method, on_rank
from ..schemes import FLAT_SCHEMES, SCHEMES
from .base import HookState, resumable


class AllreduceState(HookState):
    """State for :func:`allreduce_hook`: statistics and the first-step check, no options."""

    def __init__(self, process_group=None):
        super().__init__(process_group)


class CompressedState(HookState):
    """State of a hook that compresses with one registered gradcomp method.

    method: a name in ``gradcomp.METHODS`` (fixed by the subclasses: ``Int8State``, ...).
    scheme: one of the method's schemes (``Method.schemes``; default its first).
    error_feedback: keep what compression dropped per bucket and send it at later steps
        (default: the method's ``error_feedback_default``).
    loco_beta, loco_reset_every: keep a moving average of the compression errors instead
        (LoCo: e <- beta e + (1 - beta) (h - Q(h)), zeroed every ``loco_reset_every`` steps;
        gradcomp.feedback.moving_average_compress); needs error feedback.
    method_options: the method's options (validated by ``gradcomp.get_method``). A ``seed``
        option is offset by the rank so that ranks draw independent random numbers.
    """

    method_name: str = ""

    def __init__(self, process_group=None, *, method: str | None = None, scheme: str | None = None,
                 error_feedback: bool | None = None, loco_beta: float | None = None,
                 loco_reset_every: int | None = LOCO_RESET_EVERY, **method_options):
        name = method if method is not None else self.method_name
        if self.method_name and name != self.method_name:
            raise ValueError(f"{type(self).__name__} compresses with {self.method_name!r}, got method={method!r}")
        spec = get_method(name, **method_options)  # raises a ValueError naming a bad option
        served = tuple(s for s in spec.schemes if s in FLAT_SCHEMES)  # lowrank: powersgd_hook's
        if not served:
            raise ValueError(f"{name}: its schemes {spec.schemes} have no CompressedState hook "
                             f"(use its own state, e.g. PowerSGDState)")
        scheme = served[0] if scheme is None else scheme
        if scheme not in served:
            raise ValueError(f"{type(self).__name__}: scheme must be one of {served}, got {scheme!r}")
        if error_feedback is None:
            error_feedback = spec.error_feedback_default
        if not isinstance(error_feedback, bool):
            raise ValueError(f"{type(self).__name__}: error_feedback must be True or False, got {error_feedback!r}")
        loco = {}
        if loco_beta is not None:
            if not error_feedback:
                raise ValueError(f"{type(self).__name__}: loco_beta is a kind of error feedback; "
                                 "it needs error_feedback=True")
            check_loco(loco_beta, loco_reset_every)
            loco = {"loco_beta": float(loco_beta), "loco_reset_every": loco_reset_every}
        super().__init__(process_group, method=name, scheme=scheme, error_feedback=error_feedback,
                         **loco, **method_options)
        self.method_name = name
        self._method = None

    @property
    def error_feedback(self) -> bool:
        return self.options["error_feedback"]

    @property
    def scheme(self) -> str:
        return self.options["scheme"]

    def _method_options(self) -> dict:
        return {k: v for k, v in self.options.items()
                if k not in ("method", "error_feedback", "scheme", "loco_beta", "loco_reset_every")}

    def method(self):
        """The Method this rank compresses with (its seed offset by the rank)."""
        if self._method is None:
            self._method = on_rank(self.method_name, self.rank, **self._method_options())
        return self._method

    def config(self, hook_name: str) -> dict:
        """The method's options as it resolves them: an option written at its default on one
        rank and left out on another is the same configuration."""
        resolved = get_method(self.method_name, **self._method_options()).options()
        return {**super().config(hook_name), **resolved}

    def __getstate__(self):
        out = super().__getstate__()
        out["_method"] = None
        return out


class FP16State(CompressedState):
    """fp16_hook state; error feedback off by default (torch's fp16_compress_hook has none)."""

    method_name = "fp16"


class BF16State(CompressedState):
    """bf16_hook state; error feedback off by default."""

    method_name = "bf16"


class Int8State(CompressedState):
    """int8_hook state: scheme "allgather" | "twophase", error_feedback, block, stochastic, seed."""

    method_name = "int8"


class Int4State(CompressedState):
    """int4_hook state: scheme "allgather" | "twophase", error_feedback, block, stochastic, seed."""

    method_name = "int4"


class SignState(CompressedState):
    """sign_hook state: scheme "allgather" | "twophase", error_feedback, chunk."""

    method_name = "sign"


class TopKState(CompressedState):
    """topk_hook state: ratio (fraction of elements sent), error_feedback, selector, sample, seed."""

    method_name = "topk"

    def __init__(self, process_group=None, ratio: float = 0.01, **options):
        super().__init__(process_group, ratio=ratio, **options)


def state_class(method: str) -> type[CompressedState]:
    """The CompressedState subclass of a registered method: the named one (Int8State, ...) or,
    for a method registered from outside, a CompressedState fixed to it."""
    get_method(method)  # a clear error for an unknown name
    found = [cls for cls in _subclasses(CompressedState) if cls.method_name == method]
    if found:
        return found[0]
    return type(f"{method.title()}State", (CompressedState,), {"method_name": method,
                                                                "__module__": __name__})


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


# ---- the shared frame of every hook -----------------------------------------------------------

def _begin(state, bucket, hook_name: str):
    """Run the state's per-bucket bookkeeping (None: stateless); returns (group, bucket buffer)."""
    group = None
    if state is not None:
        state.begin_bucket(bucket, hook_name)
        group = state.group
    return group, bucket.buffer()


def _end(state, bucket, future, decode, wire_bytes: int, launched):
    """Chain ``decode`` (timed) onto ``future``, record statistics, close the bucket.
    ``launched``: the :meth:`HookStats.mark` taken when the collective was issued."""
    if state is None:
        return future.then(decode)
    state.stats.add(wire_bytes=wire_bytes)
    device = bucket.buffer().device

    def timed_decode(fut):
        arrived = state.stats.mark(device)
        state.stats.add_interval("comm_s", launched, arrived)
        try:
            return decode(fut)
        finally:
            state.stats.add_interval("decompress_s", arrived)

    state.end_bucket(bucket)
    return future.then(timed_decode)


def _launched(state, buffer):
    """The mark of a collective's launch (None without a state)."""
    return None if state is None else state.stats.mark(buffer.device)


# ---- the scheme hook ---------------------------------------------------------------------------

def scheme_hook(state, bucket, method, hook_name: str, scheme: str):
    """Run ``bucket`` through ``scheme`` (a name in ``gradcomp.schemes.FLAT_SCHEMES``) with
    ``method``: compress 1/world_size times the bucket (with the state's error feedback, timed),
    launch the scheme's collectives, decode the sum over ranks into the bucket. A two-phase
    chunk's sum is already the average: its re-compression is not scaled."""
    exchange = SCHEMES[scheme]
    group, buffer = _begin(state, bucket, hook_name)
    world = dist.get_world_size(group)
    if state is None:
        compress, recompress, deferred = (lambda x: method.compress(x, scale=1.0 / world)), None, None
    else:
        name, error_feedback = f"bucket{bucket.index()}", getattr(state, "error_feedback", False)

        def compress(x):
            with state.stats.timed("compress_s", buffer.device):
                return state.compress(name, x, method, error_feedback, state.bucket_layout(bucket),
                                      scale=1.0 / world)

        def recompress(chunk_sum):
            with state.stats.timed("compress_s", buffer.device):
                return state.compress(name + "/server", chunk_sum, method, error_feedback)

        deferred = state.deferred
    sent = exchange.send(buffer, method, compress, world)
    launched = _launched(state, buffer)
    future = exchange.launch(sent, method, recompress, group, deferred)
    stats = None if state is None else state.stats
    return _end(state, bucket, future, lambda fut: exchange.decode(method, fut.value(), buffer, stats),
                exchange.sent_bytes(sent), launched)


# ---- hooks -------------------------------------------------------------------------------------

@resumable
def allreduce_hook(state, bucket):
    """Plain all-reduce average (no compression) through the same machinery: the baseline.
    Gives exactly DDP's default gradients. ``state``: None or a HookState (statistics)."""
    if state is not None and not isinstance(state, HookState):
        raise TypeError(f"allreduce_hook: state must be a HookState or None, got {type(state).__name__}")
    group, buffer = _begin(state, bucket, "allreduce_hook")
    buffer.mul_(1.0 / dist.get_world_size(group))  # in place, as DDP's reducer
    launched = _launched(state, buffer)
    future = comm.allreduce_sum(buffer, group)
    return _end(state, bucket, future, lambda fut: fut.value(), buffer.numel() * buffer.element_size(), launched)


def _refuse_hierarchical(state, hook_name: str) -> None:
    if getattr(state, "node_size", None) is not None:
        raise TypeError(f"{hook_name}: a HierarchicalState runs with "
                        "gradcomp.hooks.hierarchical_hook (this hook would ignore node_size)")


@resumable
def compressed_hook(state: CompressedState, bucket):
    """The hook of any registered method: ``state`` (a CompressedState) names the method, its
    options and the scheme."""
    if not isinstance(state, CompressedState):
        raise TypeError(f"compressed_hook: state must be a CompressedState, got {type(state).__name__}")
    _refuse_hierarchical(state, "compressed_hook")
    return scheme_hook(state, bucket, state.method(), f"{state.method_name}_hook", state.scheme)


def method_hook(method: str):
    """The named hook of one method (``int8_hook``, ...): as :func:`compressed_hook` with a state
    of that method; a method whose first scheme sums on the wire (``Scheme.summing``: allreduce)
    also runs with ``state`` None or a plain HookState (no error feedback, as torch's
    fp16_compress_hook)."""
    hook_name = f"{method}_hook"

    def hook(state, bucket):
        _refuse_hierarchical(state, hook_name)
        if isinstance(state, CompressedState) and state.method_name == method:
            return scheme_hook(state, bucket, state.method(), hook_name, state.scheme)
        spec = get_method(method)
        stateless = state is None or type(state) in (HookState, AllreduceState)
        summing = SCHEMES[spec.schemes[0]].summing
        if stateless and summing:
            return scheme_hook(state, bucket, spec, hook_name, spec.schemes[0])
        expected = state_class(method).__name__ + (", a HookState or None" if summing else "")
        raise TypeError(f"{hook_name}: state must be a {expected}, got {type(state).__name__}")

    hook.__name__ = hook.__qualname__ = hook_name
    hook.__doc__ = f"DDP comm hook: the bucket averaged over ranks, compressed with {method!r}."
    return resumable(hook)


fp16_hook = method_hook("fp16")
bf16_hook = method_hook("bf16")
int8_hook = method_hook("int8")
int4_hook = method_hook("int4")
sign_hook = method_hook("sign")
topk_hook = method_hook("topk")
