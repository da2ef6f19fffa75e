"""How a report command ends: its table printed, then written where the user asked."""

from __future__ import annotations

import json
import os


def write_json(path: str, payload) -> None:
    """``payload`` as indented JSON at ``path`` (its folder made; what JSON cannot hold as
    text)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def publish(text: str, markdown: str | None, json_path: str | None = None, data=None) -> None:
    """Print ``text``; write it to ``markdown`` and ``data`` as JSON to ``json_path``, each
    only when a path is given."""
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")
    if json_path:
        write_json(json_path, data)
