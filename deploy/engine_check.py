"""Whether LMCache in this Python environment will load kvpool's plugin: exit 0 saying so, or 1 naming why.

    python3 deploy/engine_check.py

LMCache hides a plugin that does not load (a warning in its log, then every lookup
misses), so the engine image runs this at build time (deploy/engine.Containerfile): the
image's LMCache must be a version kvpool declares it works with (the ``[lmcache]``
extra), and every class an LMCache config made by ``kvpool lmcache-config`` names must
import against it. tests/test_deploy_manifests.py runs it in the test environment.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import sys

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


def problems() -> list[str]:
    from packaging.requirements import Requirement  # LMCache's own dependencies bring it

    from backend.lmcache import config

    found = []
    extra = [Requirement(text) for text in metadata.requires("kvpool") or []]
    wanted = next((r for r in extra if r.name == "lmcache"), None)
    try:
        version = metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        return ["LMCache is not installed in this environment"]
    if wanted is not None and not wanted.specifier.contains(version, prereleases=True):
        found.append(f"LMCache {version} is installed; kvpool's plugin works with lmcache{wanted.specifier}")
    classes = {
        config.ADAPTER_MODULE: (config.ADAPTER_CLASS, config.REMOTE_URL_CLASS),
        config.L2_ADAPTER_MODULE: (config.L2_ADAPTER_CLASS, config.L2_ADAPTER_CONFIG_CLASS),
    }
    for module_name, names in classes.items():
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # what LMCache would hide: name it
            found.append(f"{module_name} does not import: {type(exc).__name__}: {exc}")
            continue
        found += [f"{module_name} has no {name}" for name in names if not hasattr(module, name)]
    return found


def main() -> int:
    found = problems()
    for problem in found:
        print(f"engine check: {problem}", file=sys.stderr)
    if found:
        return 1
    print(f"engine check: LMCache {metadata.version('lmcache')} loads kvpool {metadata.version('kvpool')}'s plugin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
