"""docs/architecture.md's layout names every module and C file under conveyor/, under its own package, and every
bench/ module in the bench/ entry."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def layout_entries() -> dict[str, str]:
    """The layout block as {first word of an entry: its text}; an entry runs until the next unindented line."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## Layout\n\n```\n(.*?)```", text, re.S).group(1)
    entries: dict[str, str] = {}
    key = ""
    for line in block.splitlines():
        if line and not line.startswith(" "):
            key = line.split()[0].rstrip(",")
            entries[key] = ""
        entries[key] += " " + line
    return entries


def test_the_layout_names_every_file_of_the_package_under_its_package() -> None:
    entries = layout_entries()
    top_level = " ".join(text for key, text in entries.items() if not key.endswith("/"))
    missing = []
    for path in sorted((ROOT / "conveyor").rglob("*")):
        if path.suffix not in (".py", ".c", ".h") or path.name == "__init__.py" and path.parent.name != "cli":
            continue
        parts = path.relative_to(ROOT).parts
        if len(parts) == 2:
            found = path.name in top_level
        else:
            text = entries.get(f"conveyor/{parts[1]}/", "")
            found = path.name in text or (len(parts) > 3 and f"{parts[2]}/" in text)
        if not found:
            missing.append("/".join(parts))
    assert not missing, f"docs/architecture.md's layout does not name: {missing}"


def test_the_layout_names_every_benchmark_module_and_its_group() -> None:
    text = layout_entries()["bench/"]
    missing = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "bench").rglob("*.py"))
               if path.name != "__init__.py" and (path.name not in text
                                                  or path.parent.name != "bench" and f"{path.parent.name}/" not in text)]
    assert not missing, f"docs/architecture.md's bench/ entry does not name: {missing}"
