"""The house is layered: each room of backend/ imports only rooms below it.

The table is the layout of docs/design.md as a rule. A new module must be placed in
it (the test names the one that is not); a room that imports one at its own level
or above is a cycle in the making, or a door through a wall (the admin verbs
speaking to Redis behind the client's back, the client reaching into the node).
Inside a room the modules import each other in one direction too: no module of
backend/, nccl_channel/ or bench/ is part of an import circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from pathlib import Path

from backend.protocol import CODECS
from tests.test_class_sizes import REPO

# room -> level; a room imports only rooms of a lower level (its own modules excepted)
LEVELS = {
    "backend.errors": 0,
    "backend.version": 0,
    "backend.counters": 0,  # the names of what the node, the client and the LMCache layer count
    "backend.protocol": 1,
    "backend.handshake": 1,
    "backend.redis_topology": 1,
    "backend.threads": 1,
    "backend.embedded": 1,
    "backend.tenants": 1,  # a tenant's keys: the prefix the client adds and the node reads (pure)
    "backend.latency": 1,
    "backend.iov": 1,
    "backend.transport": 2,
    "backend.shm": 2,
    "backend.config": 2,
    "backend.metrics": 2,
    "backend.launch": 2,  # kvpool's processes as children, for the tests and the benchmarks (nothing of backend imports it)
    "backend.metadata": 3,
    "backend.placement": 4,
    "backend.node": 5,
    "backend.client": 5,
    "backend.admin": 6,  # a package: one module per verb family
    "backend.doctor": 6,
    "backend.events": 6,  # kvpool events: the pool's KV events for routers (beside admin, over the client)  # kvpool doctor and selftest: what is wrong and why (beside admin, not above it)
    "backend.lmcache": 7,  # the LMCache layer (backend/lmcache/)
    "backend": 1,  # the package's own __init__: the version, nothing more
    "backend.cli": 9,  # a package: one module per verb family, main.py on top
}
# Where MetadataStore, or one of its parts, may be named: the metadata layer itself and its two users.
# Everyone else goes through PoolClient.index (backend/client/index.py).
METADATA_STORE_USERS = ("backend.metadata", "backend.client", "backend.node")
METADATA_STORE_NAMES = {"MetadataStore", "NodeRegistry", "KeyIndex", "LiveLookup", "Rendezvous", "NodeMetadata"}
# Where frames are encoded and decoded: both ends of the wire. The admin verbs and the
# LMCache layer ask the client (backend/client/node_admin.py) in typed calls instead.
FRAME_CODEC_USERS = ("backend.protocol", "backend.transport", "backend.shm", "backend.client", "backend.node")
OP_CODECS = {codec.__name__ for codec in CODECS.values()}  # each op's codec: GetBatch, Stat, ...
# A room whose parts are wired by one owner: no part imports the owner (not even for a type
# hint), so none can hold it and read its attributes; each gets a context and the parts it uses.
OWNERS = {"backend.node": "backend.node.server"}


# What nccl_channel may import of backend: the errors, the counter names and the channel's part of the wire codec
# (CHANNEL_GET, and the item meta and checksum it carries), from the package or from those parts.
# Never the node, nor anything that needs redis-py (the GPU machine has none, and nodes load the
# channel lazily).
NCCL_CHANNEL_PROTOCOL_PARTS = ("backend.protocol.channel", "backend.protocol.meta", "backend.protocol.frame")
NCCL_CHANNEL_MAY_IMPORT = ("backend.errors", "backend.counters", "backend.protocol", *NCCL_CHANNEL_PROTOCOL_PARTS)
NCCL_CHANNEL_NEVER_IMPORTS = ("redis", "hiredis", "lmcache")

# The parts of backend/protocol/ and their order: a part imports only parts before it, so the
# op families (level 3) never need each other, and the package has no circle. The token record
# (level 2) is a building block two op families share (a put carries it, EVENTS hands it back).
PROTOCOL_PARTS = {
    "backend.protocol.frame": 0,
    "backend.protocol.meta": 1,
    "backend.protocol.json_codec": 1,
    "backend.protocol.tokens": 2,
    "backend.protocol.puts": 3,
    "backend.protocol.reads": 3,
    "backend.protocol.channel": 3,
    "backend.protocol.inventory": 3,
    "backend.protocol.pins": 3,
    "backend.protocol.events": 3,
    "backend.protocol.reports": 3,
}
# A pure codec: no I/O, no clock, nothing of backend but the errors.
PROTOCOL_MAY_IMPORT = (
    "__future__",
    "array",
    "base64",
    "collections.abc",
    "dataclasses",
    "enum",
    "json",
    "struct",
    "typing",
    "xxhash",
)


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    """``backend.client.tcp`` -> ``backend.client``; ``backend`` stays ``backend``."""
    return ".".join(module.split(".")[:2])


def _imports(path: Path, package: str = "") -> Iterator[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import in ``path``.

    Relative imports are resolved against ``package`` (the package ``path`` is in), and skipped without it.
    """
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.ImportFrom) and package:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            yield ".".join(base + ([node.module] if node.module else [])), [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno


def _backend_files() -> list[Path]:
    return sorted((REPO / "backend").rglob("*.py"))


# Where import circles are refused: every package of the project, sub-packages included.
CIRCLE_FREE = ("backend", "nccl_channel", "bench")


def import_graph(root: Path, packages: Sequence[str]) -> dict[str, set[str]]:
    """module -> the project modules it imports, for every module under ``packages`` of ``root``.

    Every import counts wherever it is written (module level, a function body, under
    ``if TYPE_CHECKING``): a circle of type-only imports still means no module of it
    can be read without the others. ``from package import name`` is an edge to the
    module ``package.name`` when there is one, else to the package's ``__init__``.
    Importing ``package.module`` is no edge to ``package``'s ``__init__`` (Python runs it
    first, but counting that would make every ``__init__`` that re-exports a circle).
    """
    files = {".".join(_parts(path.relative_to(root))): path for p in packages for path in (root / p).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph.setdefault(module, set())
        for imported, names, _ in _imports(path, package):
            targets = [f"{imported}.{n}" for n in names if f"{imported}.{n}" in files]
            if len(targets) < len(names) or not names:
                targets.append(imported)
            edges.update(t for t in targets if t in files and t != module)
    return graph


def _parts(relative: Path) -> tuple[str, ...]:
    parts = relative.with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted, in order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def _circle_files(circle: list[str]) -> str:
    """``a.b <-> a.c`` as the files a reader opens: ``a/b.py <-> a/c.py``."""
    paths = []
    for module in circle:
        path = REPO.joinpath(*module.split("."))
        paths.append(str((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(REPO)))
    return " <-> ".join(paths)


def test_every_room_of_backend_is_placed_in_the_layer_table() -> None:
    rooms = {_room(_module(path)) for path in _backend_files()}
    assert rooms, "no module found: the scan is looking in the wrong place"
    assert sorted(rooms - LEVELS.keys()) == [], "place the new room in LEVELS (and in docs/design.md)"


def test_each_room_imports_only_rooms_below_it() -> None:
    upward = []
    for path in _backend_files():
        room = _room(_module(path))
        for imported, _, line in _imports(path):
            target = _room(imported)
            if imported.split(".")[0] != "backend" or target == room or room not in LEVELS or target not in LEVELS:
                continue
            if LEVELS[target] >= LEVELS[room]:
                upward.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    assert upward == []


def test_only_the_metadata_layer_the_client_and_the_node_name_the_metadata_store() -> None:
    reach = []
    for path in _backend_files():
        module = _module(path)
        if _room(module) in METADATA_STORE_USERS:
            continue
        for imported, names, line in _imports(path):
            if imported.startswith("backend.metadata") and METADATA_STORE_NAMES & set(names):
                reach.append(f"{path.relative_to(REPO)}:{line}")
    assert reach == [], "reach the metadata through PoolClient.index"


def test_only_the_two_ends_of_the_wire_encode_or_decode_frames() -> None:
    reach = []
    for path in _backend_files():
        if _room(_module(path)) in FRAME_CODEC_USERS:
            continue
        for imported, names, line in _imports(path):
            codec = [n for n in names if n == "Op" or n in OP_CODECS or n.startswith(("encode_", "decode_"))]
            if (imported == "backend.protocol" or imported.startswith("backend.protocol.")) and codec:
                reach.append(f"{path.relative_to(REPO)}:{line} imports {', '.join(codec)}")
    assert reach == [], "ask the client's typed calls (PoolClient.node_admin) instead"


def test_nccl_channel_imports_only_the_errors_and_codec_of_backend_and_never_redis() -> None:
    files = sorted((REPO / "nccl_channel").rglob("*.py"))
    assert len(files) > 5, "the scan is looking in the wrong place"
    channel_codec = {name for part in NCCL_CHANNEL_PROTOCOL_PARTS for name in _public_names(_path_of(part))}
    reach = []
    for path in files:
        for imported, names, line in _imports(path):
            top = imported.split(".")[0]
            if (top == "backend" and imported not in NCCL_CHANNEL_MAY_IMPORT) or top in NCCL_CHANNEL_NEVER_IMPORTS:
                reach.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
            elif imported == "backend.protocol" and set(names) - channel_codec:
                reach.append(f"{path.relative_to(REPO)}:{line} imports {sorted(set(names) - channel_codec)}")
    assert reach == []


# What the public package kvpool/ may import: the public names' homes and the LMCache layer's
# two modules configs name. Nothing in backend/ imports kvpool (it is the face, not a room).
KVPOOL_MAY_IMPORT = (
    "backend.errors",
    "backend.version",
    "backend.client",
    "backend.config",
    "backend.lmcache",
    "backend.events.auth",  # the events keys a subscriber derives
)


def test_the_public_package_reexports_and_nothing_in_backend_imports_it() -> None:
    files = sorted((REPO / "kvpool").rglob("*.py"))
    assert len(files) >= 3, "the scan is looking in the wrong place"
    reach = []
    for path in files:
        for imported, _, line in _imports(path, "kvpool"):
            if imported.split(".")[0] in ("backend", "kvpool") and not imported.startswith(KVPOOL_MAY_IMPORT):
                reach.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    for path in _backend_files():
        for imported, _, line in _imports(path):
            if imported.split(".")[0] == "kvpool":
                reach.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    assert reach == []


def _path_of(module: str) -> Path:
    return REPO.joinpath(*module.split(".")).with_suffix(".py")


def _public_names(path: Path) -> list[str]:
    """The names a module exports: its ``__all__``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            assert isinstance(node.value, ast.List), f"{path.relative_to(REPO)}: __all__ is not a literal list"
            return [ast.literal_eval(e) for e in node.value.elts]
    raise AssertionError(f"{path.relative_to(REPO)} has no __all__")


def test_each_part_of_the_protocol_imports_only_parts_before_it_and_no_io() -> None:
    parts = sorted((REPO / "backend" / "protocol").glob("*.py"))
    assert sorted(_module(p) for p in parts if p.name != "__init__.py") == sorted(PROTOCOL_PARTS), (
        "place the new part in PROTOCOL_PARTS (and in docs/design.md)"
    )
    reach = []
    for path in parts:
        module = _module(path)
        for imported, _, line in _imports(path, "backend.protocol"):
            if imported == "backend.protocol" and module == "backend.protocol":
                continue  # the package's __init__ imports the op families' parts, which register their codecs
            if imported.startswith("backend.protocol."):
                # the package's __init__ gathers every part; a part takes only those before it
                if module != "backend.protocol" and PROTOCOL_PARTS[imported] >= PROTOCOL_PARTS[module]:
                    reach.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
            elif imported not in (*PROTOCOL_MAY_IMPORT, "backend.errors"):
                reach.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    assert reach == []


# The verb rooms: each module of backend/admin/ and backend/cli/ is placed here. Level 0: what the
# verb families share; 1: one family each (a verb is read without the other families); above: what
# gathers them. A module imports only modules of its room at a lower level.
VERB_ROOMS = {
    "backend.admin": {
        "shared": 0,
        "listing": 1,
        "removal": 1,
        "draining": 1,
        "fsck": 1,
        "pinning": 1,
        "quotas": 1,
        "__init__": 2,
    },
    "backend.cli": {
        **dict.fromkeys(("exits", "options", "output"), 0),
        **dict.fromkeys(("serve", "listing", "maintenance", "diagnose", "lmcache", "pinning", "events", "quotas"), 1),
        "main": 2,
        "__init__": 3,
        "__main__": 4,
    },
}


def _verb_room_breaches(room: str, levels: dict[str, int]) -> list[str]:
    """Imports inside ``room`` that do not go to a lower level (``from room import x`` is to module x)."""
    breaches = []
    for path in sorted(REPO.joinpath(*room.split(".")).glob("*.py")):
        level = levels[path.stem]
        for imported, names, line in _imports(path, room):
            if imported == room:
                targets = [name if name in levels else "__init__" for name in names]
            elif imported.startswith(room + "."):
                targets = [imported.removeprefix(room + ".")]
            else:
                continue
            breaches += [f"{path.relative_to(REPO)}:{line} imports {t}" for t in targets if levels[t] >= level]
    return breaches


def test_no_verb_family_imports_another_and_every_module_of_the_verb_rooms_is_placed() -> None:
    for room, levels in VERB_ROOMS.items():
        modules = sorted(p.stem for p in REPO.joinpath(*room.split(".")).glob("*.py"))
        assert modules == sorted(levels), f"place the new module of {room} in VERB_ROOMS (and in docs/design.md)"
        assert _verb_room_breaches(room, levels) == [], "move what two families share beneath them"


def test_no_part_of_the_node_imports_the_node_process() -> None:
    reach = []
    for path in _backend_files():
        module = _module(path)
        owner = OWNERS.get(_room(module))
        if owner is None or module == owner:
            continue
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for imported, names, line in _imports(path, package):
            if imported == owner or (imported == _room(module) and owner.rsplit(".", 1)[1] in names):
                reach.append(f"{path.relative_to(REPO)}:{line} imports {owner}")
    assert reach == [], "give the part a NodeContext (backend/node/context.py) and the parts it uses"


# The parts of backend/node/ and their order: a part imports only parts below it (its own modules
# excepted). The subpackages hold a role each (their docstrings say what they own); the modules on
# top are the node's wiring. The store never sees a connection or Redis; index (Redis in step) never
# serves a request; serve may hand what it committed to index's publisher.
NODE_PARTS = {
    "memory": 0,  # the arena, its pages and cells, chunk buffers, per-slot columns
    "store": 1,  # tiers behind TierManager, the chunk table, eviction, quotas, pins, leases
    "events": 1,  # the ring of recent stores and removals
    "context": 2,  # what every part of one node shares
    "stats": 3,  # what a node counts about itself
    "index": 4,  # Redis in step: claim, heartbeat, publisher, republish, reaper, recovery
    "serve": 5,  # sessions and the op table
    "startup": 5,  # the start order
    "server": 6,  # the owner that wires every part
}
NODE_TOP_MODULES_MAX = 12  # the node's top level stays a short list: a new module joins a subpackage


def _node_part(module: str) -> str:
    return module.split(".")[2] if module.count(".") >= 2 else ""


def test_each_part_of_the_node_is_placed_and_imports_only_parts_below_it() -> None:
    node = REPO / "backend" / "node"
    placed = {path.stem if path.is_file() else path.name for path in node.iterdir() if path.name != "__pycache__"}
    placed -= {"__init__"}
    assert sorted(placed) == sorted(NODE_PARTS), "place the new part in NODE_PARTS (and in docs/design.md)"
    assert len([path for path in node.glob("*.py")]) <= NODE_TOP_MODULES_MAX
    reach = []
    for path in sorted(node.rglob("*.py")):
        module = _module(path)
        part = _node_part(module)
        if not part:
            continue
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for imported, _, line in _imports(path, package):
            other = _node_part(imported) if imported.startswith("backend.node.") else ""
            if other and other != part and NODE_PARTS[other] >= NODE_PARTS[part]:
                reach.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    assert reach == [], "a part of the node imports only parts below it (NODE_PARTS)"


def test_no_package_holds_an_import_circle() -> None:
    graph = import_graph(REPO, CIRCLE_FREE)
    assert len(graph) > 100 and sum(map(len, graph.values())) > 100, "the scan is looking in the wrong place"
    circles = [_circle_files(circle) for circle in import_circles(graph)]
    assert not circles, (
        "import circles (move what the modules of each share into a module none of them imports back):\n"
        + "\n".join(circles)
    )


def test_the_circle_scan_finds_a_circle_of_lazy_and_type_only_imports(tmp_path: Path) -> None:
    """A function-level import and a TYPE_CHECKING one close a circle; a name an __init__ re-exports leads to it."""
    files = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "class A:\n    def f(self):\n        from pkg import b\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n",
        "pkg/c.py": "import pkg.a\nfrom pkg.sub import d\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from pkg import A\n",
        "other/e.py": "from pkg.a import A\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg", "other"))
    assert graph["pkg.c"] == {"pkg.a", "pkg.sub.d"}
    assert graph["pkg.sub.d"] == {"pkg"}
    assert import_circles(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.sub.d"]]
    (tmp_path / "pkg/sub/d.py").write_text("")
    assert import_circles(import_graph(tmp_path, ("pkg", "other"))) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_rules_catch_a_breach(tmp_path: Path) -> None:
    """The scan sees imports where they are written, at any depth (a function body too)."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f():\n    from backend.metadata import MetadataStore\n    import torch.cuda\n"
        "if TYPE_CHECKING:\n    from backend.node.server import PoolNode\n    from . import server\n"
    )
    assert [(m, n) for m, n, _ in _imports(sample, "backend.node")] == [
        ("backend.metadata", ["MetadataStore"]),
        ("torch.cuda", []),
        ("backend.node.server", ["PoolNode"]),
        ("backend.node", ["server"]),
    ]
