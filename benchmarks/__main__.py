"""``python -m benchmarks <name> [options]``: run one benchmark of :data:`benchmarks.REGISTRY`
(``python -m benchmarks`` lists them; ``python -m benchmarks <name> --help`` shows its
options). A module ``benchmarks/<name>.py`` with a ``main()`` runs too when it is not listed
yet (``-`` in the name read as ``_``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence

from benchmarks import REGISTRY


def resolve(name: str) -> Callable[[], object]:
    """The function registered as ``name``, else ``main`` of ``benchmarks.<name>``."""
    target = REGISTRY[name][0] if name in REGISTRY else None
    if target is None:
        module = f"benchmarks.{name.replace('-', '_')}"
        if importlib.util.find_spec(module) is None:
            raise LookupError(name)
        target = f"{module}:main"
    module_name, _, function = target.partition(":")
    found: Callable[[], object] = getattr(importlib.import_module(module_name), function or "main")
    return found


def usage() -> str:
    width = max(len(name) for name in REGISTRY)
    lines = [
        "usage: python -m benchmarks <name> [options]   (<name> --help: its options)",
        "",
        "benchmarks:",
    ]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in REGISTRY.items()]
    lines += [
        "",
        "See benchmarks/README.md: what each measures, the published figures and the "
        "commands that reproduce them.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(usage())
        return 0
    name, options = argv[0], list(argv[1:])
    try:
        function = resolve(name)
    except LookupError:
        print(f"no benchmark called {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"python -m benchmarks {name}", *options]
    result = function()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
