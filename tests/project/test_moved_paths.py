"""The module paths 0.2's guides named keep working after the move into layers: the same
objects, with a warning that names the new path."""

from __future__ import annotations

import importlib

import pytest

import celery_driftsafe
from celery_driftsafe.core import headers, jitter, schedules

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("celery_driftsafe.slots", "Crontab", schedules),
        ("celery_driftsafe.slots", "Solar", schedules),
        ("celery_driftsafe.jitter", "due_instant", jitter),
        ("celery_driftsafe.headers", "HEADER_RUN_ID", headers),
        ("celery_driftsafe.headers", "HEADER_SLOT", headers),
    ],
)
def test_an_old_path_gives_the_same_object_and_names_the_new_one(
    old: str, name: str, new: object
) -> None:
    module = importlib.import_module(old)
    moved = rf"{old}\.{name} has moved to celery_driftsafe\.{name};"
    with pytest.warns(DeprecationWarning, match=moved):
        value = getattr(module, name)
    assert value is getattr(new, name) is getattr(celery_driftsafe, name)


def test_the_public_names_are_at_the_top_and_the_app_import_loads_none_of_them() -> None:
    """The names the guides use come from the package itself; importing the app (as Django's
    INSTALLED_APPS does, before set-up) imports none of their modules."""
    import subprocess
    import sys

    code = (
        "import sys, celery_driftsafe as d; "
        "print(sorted(m for m in sys.modules if m.startswith('celery_driftsafe.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "[]", loaded
    for name in celery_driftsafe.__all__:
        assert getattr(celery_driftsafe, name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        celery_driftsafe.Nope  # noqa: B018


def test_a_name_the_new_module_lacks_is_an_attribute_error_naming_the_old_path() -> None:
    module = importlib.import_module("celery_driftsafe.slots")
    with pytest.raises(AttributeError, match=r"'celery_driftsafe\.slots' has no attribute 'Nope'"):
        module.Nope  # noqa: B018


def test_the_from_import_form_the_guides_used_works() -> None:
    with pytest.warns(DeprecationWarning, match=r"moved to celery_driftsafe\.Interval;"):
        from celery_driftsafe.slots import Interval
    assert Interval is schedules.Interval
