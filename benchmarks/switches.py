"""The performance mechanisms the benchmarks switch off by name (``DRIFTSAFE_BENCH_OFF``, the
ablation benchmark): the settings entries each name stands for. Apart from
:mod:`benchmarks.bench_settings`, which reads the environment as it is imported, so that a test
can check the mapping without a trial's environment."""

from __future__ import annotations

from typing import Any

from celery_driftsafe.core.stored_names import Optimisation

#: Mechanisms with a value of their own, by the name the benchmark gives them, and the key
#: that switches each off (``FAST_PUBLISH`` in ``DRIFTSAFE``, the others in
#: ``DRIFTSAFE_INTERNALS``).
OWN_SETTINGS: dict[str, tuple[str, Any]] = {
    "fast_publish": ("FAST_PUBLISH", False),
    "claim_process": ("CLAIM_PROCESS", False),
    "publish_batch": ("PUBLISH_BATCH_SIZE", 1),
    "round_interval": ("MIN_ROUND_INTERVAL_SECONDS", 0),
}


#: The one of :data:`OWN_SETTINGS` a project may set (in ``DRIFTSAFE``).
PUBLIC = ("FAST_PUBLISH",)


def switched_off(names: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``DRIFTSAFE`` and the ``DRIFTSAFE_INTERNALS`` entries that switch off the mechanisms
    ``names`` (comma-separated): an :class:`~celery_driftsafe.core.stored_names.Optimisation`
    goes to ``OPTIMISATIONS_OFF``, one of :data:`OWN_SETTINGS` to its key. An unknown name
    raises, listing the known."""
    public: dict[str, Any] = {}
    entries: dict[str, Any] = {}
    off: list[str] = []
    for name in filter(None, (part.strip() for part in names.split(","))):
        if name in OWN_SETTINGS:
            key, value = OWN_SETTINGS[name]
            (public if key in PUBLIC else entries)[key] = value
        elif name in Optimisation.values:
            off.append(name)
        else:
            known = ", ".join([*OWN_SETTINGS, *Optimisation.values])
            raise ValueError(f"DRIFTSAFE_BENCH_OFF: unknown mechanism {name!r}; known: {known}")
    if off:
        entries["OPTIMISATIONS_OFF"] = off
    return public, entries
