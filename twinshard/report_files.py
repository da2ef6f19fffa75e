"""How a report command ends: its table printed, then written where the user asked."""

from __future__ import annotations

import json


def publish(text: str, markdown: str | None, json_path: str | None, data) -> None:
    """Print ``text``; write it to ``markdown`` and ``data`` as JSON to ``json_path``, each
    only when a path is given."""
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1)
