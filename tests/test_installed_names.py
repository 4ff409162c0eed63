"""pacer installs five top-level packages under their own names (docs/architecture.md,
"Installed package names"): no other distribution in the environment may provide one."""
from __future__ import annotations

import importlib.metadata as md

OURS = {"shared", "services", "gateway", "scheduler_svc", "gpu_worker"}


def top_level_names(dist: md.Distribution) -> set[str]:
    """The importable names a distribution installs: top_level.txt, else its file list."""
    listed = dist.read_text("top_level.txt")
    if listed:
        return set(listed.split())
    names = set()
    for path in dist.files or []:
        first = str(path).replace("\\", "/").split("/")[0]
        names.add(first[:-3] if first.endswith(".py") else first)
    return names


def test_no_other_installed_distribution_provides_our_package_names():
    clashes = {dist.metadata["Name"]: sorted(top_level_names(dist) & OURS)
               for dist in md.distributions()
               if (dist.metadata["Name"] or "").lower() != "pacer"}
    assert {name: found for name, found in clashes.items() if found} == {}


def test_the_check_sees_a_clash():
    class Fake(md.Distribution):
        def read_text(self, filename):
            return "gateway\nother\n" if filename == "top_level.txt" else None

        def locate_file(self, path):
            return path

    assert top_level_names(Fake()) & OURS == {"gateway"}
