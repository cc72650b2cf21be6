"""Sphinx configuration: MyST Markdown, warnings are errors (``sphinx-build -W``)."""

project = "celery_driftsafe"
author = "celery_driftsafe developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
master_doc = "index"
exclude_patterns = ["_build", "screenshots"]
myst_heading_anchors = 3
html_theme = "alabaster"
