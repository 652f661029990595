"""FSDP2: every FSDPModule of a model reduce-scatters its gradients compressed.

    model = ...; fully_shard(layer) for each layer; fully_shard(model)
    handle = gradcomp.fsdp.compress(model, "int8", error_feedback=True)
    ... train as usual ...
    handle.stats()                    # raw and wire bytes, compress / comm / decompress seconds
    torch.save(handle.state_dict(), f"gradcomp_rank{rank}.pt")   # one file per rank

The reduce-scatter becomes an all-to-all of compressed rows: FSDP hands the comm a flat input of
p x S elements (row r = this rank's contribution to rank r's shard); the p - 1 rows owned by
other ranks are compressed (with an error-feedback residual each; in one pass over all rows for
the block-quantizing and sign methods), exchanged with one
``all_to_all_single`` of uint8 buffers, and every rank decodes and sums the p - 1 rows it receives
onto its own row (never compressed: it does not cross the wire) in one ``Method.decode_sum``
pass, in fp32: the own row scaled first (the decode's addend), then the received rows in rank
order.
See docs/sharded.md.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from . import Method, Payload, comm, get_method
from .feedback import ErrorFeedback
from .consistency import check_consistent
from .hooks import HookStats
from .schemes import SCHEMES

STATE_FORMAT = 2
FSDP_REMEDY = ("every rank must call gradcomp.fsdp.compress with the same method and options on the "
               "same model")


def check_method(method: str | Method, **options) -> Method:
    """The validated Method for FSDP, or a ValueError naming why it cannot reduce-scatter."""
    spec = get_method(method, **options)
    if spec.per_tensor:
        raise ValueError(f"gradcomp.fsdp: method {spec.name!r} is not supported: it compresses tensor "
                         "by tensor with their shapes (PowerSGD: a low-rank product of each gradient "
                         "matrix), but an FSDP reduce-scatter row is a flat concatenation of parameter "
                         "shards with no matrix structure; use int8, int4, fp16 or bf16 (or sign / "
                         "topk) with FSDP")
    return spec


def encodes_whole(method: Method, shard_numel: int) -> bool:
    """Whether :func:`encode_rows` compresses the p x S rows as one tensor (one pass, one kernel
    launch on CUDA): for methods whose payload of whole granules cuts into per-chunk payloads
    (those offering a ``Scheme.chunked`` scheme: two-phase) when S is a multiple of the granule."""
    return any(SCHEMES[s].chunked for s in method.schemes) and shard_numel % method.granule == 0


def encode_rows(method: Method, rows: torch.Tensor, rank: int, divisor: int,
                residuals: torch.Tensor | None, states: list[dict]) -> list[Payload]:
    """Compress every row of ``rows`` (p x S, any float dtype) except row ``rank``.

    Each row is scaled by 1 / ``divisor`` (p for an average, 1 for a sum) inside the compression
    (``Method.compress``'s ``scale``: x times fp32(1 / divisor), as the DDP hooks average);
    ``residuals`` (fp32, p x S, or None without error feedback) and ``states`` (the method's
    memory: one dict shared by the runs when :func:`encodes_whole`, else one per row) are updated
    in place; row ``rank`` is neither read nor its residual touched. When :func:`encodes_whole`,
    the rows before ``rank`` and those after it are two runs, one compression each (at most two
    kernel launches whatever p), cut into row payloads. Returns the p - 1 payloads in
    destination-rank order.
    """
    world_size, shard_numel = rows.shape
    scale = 1.0 / divisor
    if encodes_whole(method, shard_numel):
        payloads = []
        for start, stop in ((0, rank), (rank + 1, world_size)):
            if start == stop:
                continue
            residual = None if residuals is None else residuals[start:stop].view(-1)
            run = method.compress(rows[start:stop].reshape(-1), residual, states[0], scale).as_rows(stop - start)
            payloads += [run.row(i) for i in range(stop - start)]
        return payloads
    return [method.compress(rows[dest], None if residuals is None else residuals[dest], states[dest], scale)
            for dest in range(world_size) if dest != rank]


def pack_payloads(payloads: list[Payload]) -> torch.Tensor:
    """The payloads as one uint8 buffer of (p - 1) x B bytes (all payloads have B bytes), row by
    row in the wire layout (``Payload.wire_chunks``: parts 16-byte aligned, zero padding). Every
    part is copied once, by one ``torch.cat`` of all the rows' chunks (no per-payload
    ``Payload.flatten`` first); a single payload of a single part already a whole row (p = 2
    with fp16 / bf16, 2 S a multiple of 16 bytes) is sent as it lies, no copy."""
    sizes = {p.nbytes for p in payloads}
    if len(sizes) > 1:
        raise RuntimeError(f"gradcomp.fsdp: row payloads differ in size {sorted(sizes)}; the "
                           "all-to-all needs one size per row")
    pieces = [chunk for p in payloads for chunk in p.wire_chunks()]
    if len(pieces) == 1 and pieces[0].is_contiguous():
        return pieces[0]
    if not pieces:
        return torch.empty(0, dtype=torch.uint8, device=payloads[0].device if payloads else "cpu")
    return torch.cat(pieces)


def decode_and_sum(method: Method, template: Payload, received: torch.Tensor,
                   own_row: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   own_scale: float = 1.0, dropped: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [S]: ``own_scale * own_row`` plus the decoded payloads of ``received`` in rank
    order, in one ``Method.decode_sum`` pass (one kernel launch on CUDA) that starts its fp32
    accumulator from the own row (its ``addend``): no separate scaled copy of the own row, no
    second pass adding it.

    received: uint8 [k, B], payloads laid out as ``template`` (S elements each), in rank order.
    own_row: None, or a contiguous float tensor of S elements (any float dtype: a view of the
        reduce-scatter input's row of this rank), the exact contribution of this rank (never
        sent, so not in ``received``); fp32(own_row) * fp32(own_scale) (the product rounded to
        fp32) is the sum's start, the received rows are added to it in rank order.
    own_scale: 1 / divisor (the sent rows are scaled so inside their compression); a finite
        positive number.
    out: None, or a contiguous fp32 tensor of S elements to write the sum into (returned).
    dropped: None, or (top-k) an int64 [k] counter of the received rows' dropped entries
        (``Method.decode_sum``).
    """
    total = torch.empty(template.numel, dtype=torch.float32, device=received.device) if out is None else out
    method.decode_sum(template.unflatten(received), out=total, addend=own_row,
                      addend_scale=own_scale, dropped=dropped)
    return total


def divisor_for(op, world_size: int) -> int:
    """What to divide each row by to honour ``op``: p for AVG, 1 for SUM (FSDP's only two ops
    when no gradient divide factor is set); any other op is refused."""
    if op == dist.ReduceOp.AVG:
        return world_size
    if op == dist.ReduceOp.SUM:
        return 1
    raise ValueError(f"gradcomp.fsdp supports the AVG and SUM reduce-scatter ops, got {op!r} "
                     "(a custom set_gradient_divide_factor asks for PREMUL_SUM; leave it unset)")


class CompressedCollective:
    """What both FSDP collectives keep per module: method, statistics, a call count, and the
    error-feedback memory, an :class:`~gradcomp.feedback.ErrorFeedback` (``residuals``) with one
    slot per input size (named by the size: an fp32 residual, none without error feedback, and
    the method's states)."""

    def __init__(self, method: Method, error_feedback: bool, stats: HookStats, name: str):
        self.method = method
        self.error_feedback = error_feedback
        self.stats = stats
        self.name = name
        self.calls = 0
        self.residuals = ErrorFeedback()
        self._checked = False

    def count(self, marks: tuple, **amounts: float) -> None:
        """One more call, with its bytes and the four :func:`gradcomp.comm.mark` points that
        bound its compress, comm and decompress phases (device time on CUDA)."""
        self.calls += 1
        self.stats.buckets += 1
        self.stats.steps = max(self.stats.steps, self.calls)
        self.stats.add(**amounts)
        for field, start, end in zip(("compress_s", "comm_s", "decompress_s"), marks, marks[1:]):
            self.stats.add_interval(field, start, end)

    def state_dict(self) -> dict:
        return {"calls": self.calls, "residuals": self.residuals.state_dict()}

    @staticmethod
    def loaded(state: dict) -> tuple[int, ErrorFeedback]:
        """(call count, a fresh residual store) built from :meth:`state_dict`'s output."""
        residuals = ErrorFeedback()
        residuals.load_state_dict(state["residuals"])
        return int(state["calls"]), residuals

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; the residuals go into this collective's own store
        once the checkpoint has loaded into a fresh one (nothing changes when it is refused)."""
        self.restore(*self.loaded(state))

    def restore(self, calls: int, residuals: ErrorFeedback) -> None:
        """Take what :meth:`loaded` built (the residuals into this collective's own store)."""
        self.calls = calls
        self.residuals.load_state_dict(residuals.state_dict())


class CompressedReduceScatter(CompressedCollective, ReduceScatter):
    """FSDP2's reduce-scatter comm (``FSDPModule.set_custom_reduce_scatter``), compressed.

    One instance per FSDPModule: its identity carries the error-feedback residuals across steps,
    one fp32 p x S matrix per input size S (row r: what this rank still owes rank r's shard).
    When some parameters get no gradient, FSDP leaves them out of the input, S changes, and the
    residual of that other size is used (and the previous one kept until its size returns).
    """

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def config(self, world_size: int, numel: int, op) -> dict:
        """What must be equal on every rank for this comm's collectives to pair up."""
        return {"module": self.name, "method": self.method.name, "options": self.method.options(),
                "error_feedback": self.error_feedback, "world_size": world_size,
                "input_numel": numel, "op": repr(op)}

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False) -> None:
        """Write into ``output_tensor`` (S elements) this rank's reduced shard of
        ``input_tensor`` (p x S elements, not modified). Runs to completion before returning,
        so the result is ready (torch 2.13's FSDP calls it with async_op=False and ignores the
        return value); ``async_op=True`` is refused rather than silently run synchronously."""
        if async_op:
            raise NotImplementedError("gradcomp.fsdp's reduce-scatter runs synchronously; "
                                      "async_op=True is not supported")
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        shard_numel = output_tensor.numel()
        if input_tensor.numel() != world_size * shard_numel:
            raise ValueError(f"reduce-scatter input has {input_tensor.numel()} elements, expected "
                             f"{world_size} x {shard_numel}")
        divisor = divisor_for(op, world_size)
        if not self._checked:
            check_consistent(self.config(world_size, input_tensor.numel(), op), group,
                             input_tensor.device, "gradcomp.fsdp", FSDP_REMEDY)
            self._checked = True
        rows = input_tensor.view(world_size, shard_numel)
        if world_size == 1:
            output_tensor.copy_(rows[0].view_as(output_tensor))
            return None
        residuals, states = self._memory(world_size, shard_numel, input_tensor.device)

        device = input_tensor.device
        start = comm.mark(device)
        payloads = encode_rows(self.method, rows, rank, divisor, residuals, states)
        send = pack_payloads(payloads)
        compressed = comm.mark(device)
        row_bytes = payloads[0].nbytes
        splits = [0 if r == rank else row_bytes for r in range(world_size)]
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, output_split_sizes=splits,
                               input_split_sizes=splits, group=group)
        communicated = comm.mark(device)
        # an fp32 output apart from the input takes the sum itself (no copy of it)
        direct = (output_tensor.dtype == torch.float32 and output_tensor.is_contiguous()
                  and output_tensor.untyped_storage().data_ptr() != input_tensor.untyped_storage().data_ptr())
        # the own row (a view of the input, in its dtype) scaled as the sent rows are
        # (encode_rows) is the decode's addend: read once, in the same pass
        total = decode_and_sum(self.method, payloads[0], received.view(world_size - 1, row_bytes),
                               rows[rank], out=output_tensor.view(-1) if direct else None,
                               own_scale=1.0 / divisor,
                               dropped=(self.stats.dropped_counter(world_size - 1, device)
                                        if self.method.indexed else None))
        if not direct:
            output_tensor.copy_(total.view_as(output_tensor))
        self.count((start, compressed, communicated, comm.mark(device)),
                   raw_bytes=(world_size - 1) * shard_numel * input_tensor.element_size(),
                   wire_bytes=send.numel())
        return None

    def _memory(self, world_size: int, shard_numel: int, device) -> tuple:
        """(residuals p x S fp32 or None, the method states :func:`encode_rows` takes) for an
        input of p x S: the slot named S, whose state keeps them under ``"rows"``."""
        residuals, state = self.residuals.slot(str(shard_numel), (world_size, shard_numel), device,
                                               residual=self.error_feedback)
        count = 1 if encodes_whole(self.method, shard_numel) else world_size
        return residuals, state.setdefault("rows", [{} for _ in range(count)])


class CompressedReplicaAllReduce(CompressedCollective):
    """``FSDPModule.set_all_reduce_hook`` that averages the reduce-scattered shard over the
    replicas of ``group`` (HSDP done by hand: FSDP shards over a 1-D mesh, this hook replicates).

    Every replica compresses its shard (S elements, fp32 error-feedback residual per size),
    all-gathers the payloads and decodes-and-sums all of them in rank order, its own payload
    included, so that replicas stay bit-identical. Scales by 1 / the replica count inside the
    compression (``Method.compress``'s ``scale``).
    """

    def __init__(self, method: Method, error_feedback: bool, stats: HookStats, name: str, group):
        super().__init__(method, error_feedback, stats, name)
        self.group = group

    def __call__(self, shard: torch.Tensor) -> None:
        """Replace ``shard`` (S elements, FSDP's reduce-scatter output) by its replica average."""
        replicas, numel = dist.get_world_size(self.group), shard.numel()
        if not self._checked:
            check_consistent({"module": self.name, "method": self.method.name, "replicas": replicas,
                              "options": self.method.options(), "error_feedback": self.error_feedback,
                              "shard_numel": numel}, self.group, shard.device, "gradcomp.fsdp", FSDP_REMEDY)
            self._checked = True
        residual, state = self.residuals.slot(str(numel), (numel,), shard.device,
                                              residual=self.error_feedback)
        start = comm.mark(shard.device)
        payload = self.method.compress(shard.reshape(-1), residual, state, 1.0 / replicas)
        compressed = comm.mark(shard.device)
        gathered = comm.allgather_payloads(payload, self.group).wait()  # p stacked rows
        communicated = comm.mark(shard.device)
        dropped = self.stats.dropped_counter(replicas, shard.device) if self.method.indexed else None
        if shard.is_contiguous():  # the fp32 sum cast on store, straight into the shard
            self.method.decode_sum(gathered, out=shard, dropped=dropped)
        else:
            total = torch.empty(numel, dtype=torch.float32, device=shard.device)
            shard.copy_(self.method.decode_sum(gathered, out=total, dropped=dropped).view_as(shard))
        self.count((start, compressed, communicated, comm.mark(shard.device)),
                   raw_bytes=numel * shard.element_size(), wire_bytes=payload.nbytes)


class FSDPCompression:
    """What :func:`compress` installed: one :class:`CompressedReduceScatter` per FSDPModule
    (``comms``, keyed by module name), with ``replica_comms`` (one
    :class:`CompressedReplicaAllReduce` each) when a replicate group was given; statistics and
    this rank's checkpointable state."""

    def __init__(self, method: Method, error_feedback: bool,
                 comms: dict[str, CompressedReduceScatter],
                 replica_comms: dict[str, CompressedReplicaAllReduce]):
        self.method = method
        self.error_feedback = error_feedback
        self.comms = comms
        self.replica_comms = replica_comms
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def stats(self) -> dict:
        """The reduce-scatters' totals over every module and step (raw_bytes / wire_bytes: bytes
        this rank sends, uncompressed / compressed; seconds per phase) and per-step means;
        steps = backward passes that reduce-scattered. With a replicate group, ``"replica"``
        holds the same for the replica all-reduce (raw: the shard's bytes; wire: its payload)."""
        summary = next(iter(self.comms.values())).stats.summary()
        if self.replica_comms:
            summary["replica"] = next(iter(self.replica_comms.values())).stats.summary()
        return summary

    def state_dict(self) -> dict:
        """This rank's state: residuals and method states per module, statistics, and who saved it."""
        return {"format": STATE_FORMAT, "rank": self.rank, "world_size": self.world_size,
                "method": self.method.name, "options": self.method.options(),
                "error_feedback": self.error_feedback,
                **{kind: {"stats": next(iter(comms.values())).stats.state_dict() if comms else None,
                          "modules": {name: comm.state_dict() for name, comm in comms.items()}}
                   for kind, comms in self._collectives().items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` of this same rank and configuration (ValueError otherwise).
        A refused state changes nothing; residuals and statistics are loaded into the objects
        this handle already holds."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a gradcomp.fsdp state of format {STATE_FORMAT} (format "
                             f"{state.get('format')!r}; format 1, before the residuals moved into "
                             "ErrorFeedback, is not read)")
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"this gradcomp.fsdp state was saved by rank {state['rank']} of "
                             f"{state['world_size']}; this is rank {self.rank} of "
                             f"{self.world_size}: every rank must load its own state")
        mine = {"method": self.method.name, "options": self.method.options(),
                "error_feedback": self.error_feedback}
        saved = {key: state[key] for key in mine}
        if saved != mine:
            raise ValueError(f"this gradcomp.fsdp state was saved with {saved}, this handle "
                             f"has {mine}")
        for kind, comms in self._collectives().items():
            if set(state[kind]["modules"]) != set(comms):
                raise ValueError(f"saved {kind} {sorted(state[kind]['modules'])} differ from this "
                                 f"model's {sorted(comms)}")
        built = []  # everything is built before anything is set: a refused state changes nothing
        for kind, comms in self._collectives().items():
            stats = HookStats()
            if comms:
                stats.load_state_dict(state[kind]["stats"])
            built.append((comms, stats, {name: collective.loaded(state[kind]["modules"][name])
                                         for name, collective in comms.items()}))
        for comms, stats, loaded in built:
            for name, collective in comms.items():
                collective.restore(*loaded[name])
            if comms:  # the modules share one HookStats: loaded into it, the caller may hold it
                next(iter(comms.values())).stats.load_state_dict(stats.state_dict())

    def _collectives(self) -> dict:
        return {"reduce_scatter": self.comms, "replica_all_reduce": self.replica_comms}


def is_native_hsdp(module: FSDPModule) -> bool:
    """Whether fully_shard gave ``module`` a 2-D (replicate, shard) mesh: its parameters are
    DTensors on a mesh of more than one dimension."""
    return any(getattr(getattr(p, "device_mesh", None), "ndim", 1) > 1
               for p in module.parameters(recurse=False))


def compress(model: torch.nn.Module, method: str | Method, *, error_feedback: bool | None = None,
             replicate_group=None, **options) -> FSDPCompression:
    """Make every FSDPModule in ``model`` reduce-scatter its gradients compressed with
    ``method`` (a name in ``gradcomp.METHODS`` except powersgd, with its ``options``).

    error_feedback: keep what was not sent and add it next step; default on, except for the
        summable cast methods fp16 and bf16 (as the DDP hooks).
    replicate_group: for HSDP by hand, a process group of the ranks holding the same shard; the
        model must be sharded over a 1-D mesh (its shard group) and start with equal parameters
        on every replica. The average over replicas is then compressed too (an all-reduce hook
        on each module). Native HSDP (a 2-D mesh) reduce-scatters compressed, but FSDP's own
        replica all-reduce stays uncompressed (see docs/sharded.md).
    Call after ``fully_shard`` and before the first backward, on every rank with the same
    arguments (checked on the first collective of each module: ConfigMismatchError).
    """
    chosen = check_method(method, **options)
    modules = [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no FSDPModule: call "
                         "torch.distributed.fsdp.fully_shard on it (and its layers) first")
    if not dist.is_initialized():
        raise RuntimeError("gradcomp.fsdp.compress needs an initialized process group")
    if replicate_group is not None and any(is_native_hsdp(m) for _, m in modules):
        raise ValueError("replicate_group is for a model sharded over a 1-D mesh; this one uses "
                         "native HSDP (a 2-D mesh), whose replica all-reduce FSDP runs itself")
    if error_feedback is None:
        error_feedback = not chosen.summable
    error_feedback = bool(error_feedback)
    stats, replica_stats = HookStats(), HookStats()
    comms, replica_comms = {}, {}
    for name, module in modules:
        comms[name] = CompressedReduceScatter(chosen, error_feedback, stats, name)
        module.set_custom_reduce_scatter(comms[name])
        if replicate_group is not None:
            replica_comms[name] = CompressedReplicaAllReduce(chosen, error_feedback, replica_stats,
                                                             name, replicate_group)
            module.set_all_reduce_hook(replica_comms[name])
    return FSDPCompression(chosen, error_feedback, comms, replica_comms)


__all__ = ["compress", "FSDPCompression", "CompressedReduceScatter", "CompressedReplicaAllReduce",
           "check_method", "encodes_whole", "encode_rows", "pack_payloads",
           "decode_and_sum", "divisor_for", "is_native_hsdp"]
