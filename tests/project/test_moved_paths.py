"""The module paths 0.2's guides named keep working after the move into layers: the same
objects, with a warning that names the new path."""

from __future__ import annotations

import importlib

import pytest

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
    moved = rf"{old}\.{name} has moved to {new.__name__}"  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match=moved):
        value = getattr(module, name)
    assert value is getattr(new, name)


def test_a_name_the_new_module_lacks_is_an_attribute_error_naming_the_old_path() -> None:
    module = importlib.import_module("celery_driftsafe.slots")
    with pytest.raises(AttributeError, match=r"'celery_driftsafe\.slots' has no attribute 'Nope'"):
        module.Nope  # noqa: B018


def test_the_from_import_form_the_guides_used_works() -> None:
    with pytest.warns(DeprecationWarning, match="celery_driftsafe.core.schedules"):
        from celery_driftsafe.slots import Interval
    assert Interval is schedules.Interval
