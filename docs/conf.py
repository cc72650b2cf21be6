"""Sphinx configuration: MyST Markdown, warnings are errors (``sphinx-build -W``)."""

import re
from pathlib import Path

project = "celery_driftsafe"
#: The package's one version source (hatch reads the same line), read without importing it.
release = version = re.search(
    r'^__version__ = "([^"]+)"',
    (Path(__file__).resolve().parent.parent / "celery_driftsafe" / "__init__.py").read_text(),
    re.MULTILINE,
)[1]
author = "celery_driftsafe developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
master_doc = "index"
exclude_patterns = ["_build", "screenshots"]
myst_heading_anchors = 3
html_theme = "alabaster"
