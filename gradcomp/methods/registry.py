"""The one list of compression methods. Everything else in gradcomp iterates over it.

A method is a frozen dataclass subclassing :class:`~gradcomp.methods.base.Method`; registering it
gives it ``gradcomp.compress``/``decompress``, error feedback, a DDP hook (the scheme hook of its
first scheme), rows in ``gradcomp breakeven`` and statistics, with no other edit to gradcomp.
"""
from __future__ import annotations

from collections.abc import Sequence

from .base import SEED_RANK_STRIDE, Method

REGISTRY: dict[str, type[Method]] = {}

SCHEME_NAMES: list[str] = []
"""The scheme names a method may declare (``Method.schemes``): the names of
``gradcomp.schemes.SCHEMES``, the one list of schemes, which hands them over when it loads
(:func:`declare_schemes`; ``import gradcomp`` loads it, after the built-in methods)."""

UNCOMPRESSED = "none"
"""The one name of the uncompressed choice (a plain fp32 all-reduce) wherever a method is named:
``gradcomp.hooks.register`` and ``HOOKS`` (``allreduce_hook``), ``gradcomp calibrate --methods``,
auto's policy, the analyser's ``Choice``, ``gradcomp.emulate``. No method may take it.
(``"allreduce"`` names a scheme, ``gradcomp.schemes.AllReduce``, never this choice.)"""


class _MethodNames(Sequence):
    """The registered method names, in registration order (a live view of REGISTRY)."""

    def __getitem__(self, index):
        return tuple(REGISTRY)[index]

    def __len__(self) -> int:
        return len(REGISTRY)

    def __repr__(self) -> str:
        return repr(tuple(REGISTRY))


METHODS: Sequence[str] = _MethodNames()


def register_method(cls: type[Method]) -> type[Method]:
    """Add a Method subclass to the registry under ``cls.name`` (usable as a class decorator).

    Checks what every front relies on: a new name, default options that validate, and schemes
    that gradcomp knows (:data:`SCHEME_NAMES`).
    """
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise TypeError(f"register_method expects a subclass of gradcomp.Method, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier() or name == UNCOMPRESSED:
        raise ValueError(f"{cls.__name__}.name must be an identifier other than {UNCOMPRESSED!r}, "
                         f"got {name!r}")
    if name in REGISTRY:
        raise ValueError(f"a method named {name!r} is already registered ({REGISTRY[name].__name__})")
    _check_schemes(cls)
    cls()  # the defaults must be valid options: the hooks and the analyser build it with none
    REGISTRY[name] = cls
    return cls


def declare_schemes(names) -> None:
    """Set :data:`SCHEME_NAMES` (``gradcomp.schemes`` calls this with its schemes' names: it
    sits above the methods, which cannot import it) and check the methods registered so far."""
    SCHEME_NAMES[:] = names
    for cls in REGISTRY.values():
        _check_schemes(cls)


def _check_schemes(cls: type[Method]) -> None:
    """A ValueError unless ``cls.schemes`` is a non-empty tuple of :data:`SCHEME_NAMES` (any
    names while no scheme has been declared: the built-in methods register first)."""
    if not cls.schemes or (SCHEME_NAMES and set(cls.schemes) - set(SCHEME_NAMES)):
        raise ValueError(f"{cls.__name__}.schemes must be a non-empty tuple of "
                         f"{tuple(SCHEME_NAMES)}, got {cls.schemes!r}")


def unregister_method(name: str) -> None:
    """Remove a method added with :func:`register_method` (KeyError if there is none)."""
    if name not in REGISTRY:
        raise KeyError(f"no method named {name!r} is registered")
    del REGISTRY[name]


def get_method(method: str | Method, **options) -> Method:
    """The Method for a name and options (validated), or ``method`` itself if already one."""
    if isinstance(method, Method):
        if options:
            raise ValueError(f"options {sorted(options)} given with a {method.name} Method instance; "
                             "pass them when creating it")
        return method
    if not isinstance(method, str) or method not in REGISTRY:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    cls = REGISTRY[method]
    try:
        return cls(**options)
    except TypeError:
        allowed = sorted(cls().options())
        unknown = sorted(set(options) - set(allowed))
        raise ValueError(f"{method}: unknown option(s) {unknown}; it takes {allowed}") from None


def on_rank(method: str, rank: int, **options) -> Method:
    """``get_method(method, **options)`` for rank ``rank`` of a group: a method with a ``seed``
    option gets seed + SEED_RANK_STRIDE * rank (seed default 0), so that ranks draw independent
    random numbers; other methods as given."""
    if "seed" in get_method(method).options():
        options["seed"] = options.get("seed", 0) + SEED_RANK_STRIDE * rank
    return get_method(method, **options)
