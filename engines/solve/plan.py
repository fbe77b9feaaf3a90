"""The geometry of an SSI factorisation: patches, merge order and index maps (NumPy only, no values).

The grid's cells are cut into ``nx x ny`` patches (powers of two, widths differing by at most one
cell, so any H x W works without padding). Patches are merged pairwise, always along the axis that
still has more subdomains, until one subdomain covers the grid.

A subdomain keeps only the nodes it shares with other subdomains (its *kept* set); everything else
it owns alone is eliminated as soon as possible. Nodes on the outer border of the grid are therefore
eliminated early, and the root keeps nothing: the last merge eliminates the final separator. This is
the nested-dissection variant of the SSI recursion; the authors' code
(github.com/wangyu9/Schwarz_Schur_Involution) keeps the whole outer perimeter up to the root, which
costs 2-4x more flops.

Subdomains with equal geometry (size and which sides lie on the grid border) form a *group* and are
processed as one batch; a merge step has at most a few dozen groups whatever the grid size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# (cells wide, cells high, on left border, on right border, on bottom border (y = 0), on top border)
Key = tuple[int, int, bool, bool, bool, bool]


def kept_nodes(key: Key) -> list[tuple[int, int]]:
    """Nodes (x, y), relative to the subdomain's corner, that are shared with a neighbouring subdomain.

    Only perimeter nodes can be shared, so only the perimeter is visited; the order is (y, x)-sorted.
    """
    w, h, left, right, bottom, top = key
    perimeter = {(x, 0) for x in range(w + 1)} | {(x, h) for x in range(w + 1)}
    perimeter |= {(0, y) for y in range(h + 1)} | {(w, y) for y in range(h + 1)}
    kept = [(x, y) for x, y in perimeter
            if (x == 0 and not left) or (x == w and not right) or (y == 0 and not bottom) or (y == h and not top)]
    return sorted(kept, key=lambda p: (p[1], p[0]))


def cuts(cells: int, parts: int) -> np.ndarray:
    """Cut positions 0 = c_0 < ... < c_parts = cells with widths differing by at most one."""
    return (np.arange(parts + 1) * cells) // parts


def leaf_parts(cells: int, leaf: int) -> int:
    """Largest power of two p with cells / p >= leaf (so leaf patches are leaf..2*leaf-1 cells wide)."""
    parts = 1
    while cells // (parts * 2) >= leaf:
        parts *= 2
    return parts


@dataclass
class Group:
    """Subdomains of one geometry, batched together."""

    key: Key
    members: list[tuple[int, int]]  # (i, j) patch-grid positions
    kept: list[tuple[int, int]]


@dataclass
class LeafGroup(Group):
    """A group of leaf patches with the index maps that assemble their dense matrices from the stencil."""

    order: np.ndarray = field(default=None)  # [m, 2] (x, y) relative: kept nodes first, then eliminated
    ys: np.ndarray = field(default=None)  # [n, m] global row of each ordered node of each member
    xs: np.ndarray = field(default=None)  # [n, m] global column
    rows: np.ndarray = field(default=None)  # [E] local row index of each stencil entry inside the patch
    cols: np.ndarray = field(default=None)  # [E] local column index
    offset: np.ndarray = field(default=None)  # [E] stencil offset 0..8 (3 * (dy + 1) + (dx + 1))


@dataclass
class MergeGroup:
    """Pairs (left/bottom child, right/top child) of fixed child groups merged in one batch."""

    left_group: int
    left_pos: np.ndarray  # positions of the first children inside their group
    right_group: int
    right_pos: np.ndarray
    out_group: int
    out_start: int  # the merged subdomains occupy out_start:out_start+n of the output group
    index_left: np.ndarray  # child kept node -> position in [merged kept | eliminated]
    index_right: np.ndarray
    kept: int  # size of the merged kept set
    size: int  # kept + eliminated

    @property
    def count(self) -> int:
        return len(self.left_pos)


@dataclass
class MergeStep:
    axis: str  # "x" or "y"
    merges: list[MergeGroup]
    groups: list[Group]  # output groups


@dataclass
class Plan:
    height: int
    width: int
    leaves: list[LeafGroup]
    steps: list[MergeStep]
    cuts_x: np.ndarray
    cuts_y: np.ndarray


def _leaf_group(key: Key, members: list[tuple[int, int]], cx: np.ndarray, cy: np.ndarray) -> LeafGroup:
    w, h = key[0], key[1]
    kept = kept_nodes(key)
    kept_set = set(kept)
    rest = [(x, y) for y in range(h + 1) for x in range(w + 1) if (x, y) not in kept_set]
    order = np.array(kept + rest, dtype=np.int64).reshape(-1, 2)
    position = {tuple(p): k for k, p in enumerate(order.tolist())}
    rows, cols, offs = [], [], []
    for k, (x, y) in enumerate(order.tolist()):
        for o in range(9):
            dy, dx = o // 3 - 1, o % 3 - 1
            j = position.get((x + dx, y + dy))
            if j is not None:
                rows.append(k)
                cols.append(j)
                offs.append(o)
    x0 = np.array([cx[i] for i, _ in members], dtype=np.int64)
    y0 = np.array([cy[j] for _, j in members], dtype=np.int64)
    return LeafGroup(key=key, members=members, kept=kept, order=order, ys=y0[:, None] + order[None, :, 1],
                     xs=x0[:, None] + order[None, :, 0], rows=np.array(rows), cols=np.array(cols),
                     offset=np.array(offs))


def _key(i: int, j: int, cx: np.ndarray, cy: np.ndarray) -> Key:
    return (int(cx[i + 1] - cx[i]), int(cy[j + 1] - cy[j]), i == 0, i == len(cx) - 2, j == 0, j == len(cy) - 2)


def build_plan(height: int, width: int, leaf: int = 4) -> Plan:
    """Partition an H x W grid (H, W >= 2) into leaf patches and schedule the merges."""
    nx, ny = leaf_parts(width - 1, leaf), leaf_parts(height - 1, leaf)
    cx_leaf, cy_leaf = cuts(width - 1, nx), cuts(height - 1, ny)
    by_key: dict[Key, list[tuple[int, int]]] = {}
    for j in range(ny):
        for i in range(nx):
            by_key.setdefault(_key(i, j, cx_leaf, cy_leaf), []).append((i, j))
    leaves = [_leaf_group(key, members, cx_leaf, cy_leaf) for key, members in by_key.items()]
    groups: list[Group] = list(leaves)
    cx, cy = cx_leaf, cy_leaf
    steps = []
    while nx > 1 or ny > 1:
        axis = "x" if nx >= ny and nx > 1 else "y"
        where = {m: (g, p) for g, group in enumerate(groups) for p, m in enumerate(group.members)}
        if axis == "x":
            nx //= 2
            cx = cx[::2]
        else:
            ny //= 2
            cy = cy[::2]
        pairs: dict[tuple[int, int], list[tuple[tuple[int, int], int, int]]] = {}
        for j in range(ny):
            for i in range(nx):
                first, second = ((2 * i, j), (2 * i + 1, j)) if axis == "x" else ((i, 2 * j), (i, 2 * j + 1))
                (ga, pa), (gb, pb) = where[first], where[second]
                pairs.setdefault((ga, gb), []).append(((i, j), pa, pb))
        out_keys: list[Key] = []
        out_members: dict[Key, list[tuple[int, int]]] = {}
        merges = []
        pending = []
        for (ga, gb), items in pairs.items():
            key = _key(items[0][0][0], items[0][0][1], cx, cy)
            if key not in out_members:
                out_members[key] = []
                out_keys.append(key)
            start = len(out_members[key])
            out_members[key].extend(item[0] for item in items)
            pending.append((ga, gb, items, key, start))
        out_groups = [Group(key=k, members=out_members[k], kept=kept_nodes(k)) for k in out_keys]
        for ga, gb, items, key, start in pending:
            shift = (groups[ga].key[0], 0) if axis == "x" else (0, groups[ga].key[1])
            first = groups[ga].kept
            second = [(x + shift[0], y + shift[1]) for x, y in groups[gb].kept]
            kept = kept_nodes(key)
            kept_set = set(kept)
            union = set(first) | set(second)
            assert kept_set <= union, "a merged subdomain cannot keep a node neither child kept"
            eliminated = sorted(union - kept_set, key=lambda p: (p[1], p[0]))
            position = {p: k for k, p in enumerate(kept + eliminated)}
            merges.append(MergeGroup(
                left_group=ga, left_pos=np.array([it[1] for it in items]), right_group=gb,
                right_pos=np.array([it[2] for it in items]), out_group=out_keys.index(key), out_start=start,
                index_left=np.array([position[p] for p in first], dtype=np.int64),
                index_right=np.array([position[p] for p in second], dtype=np.int64),
                kept=len(kept), size=len(kept) + len(eliminated)))
        steps.append(MergeStep(axis=axis, merges=merges, groups=out_groups))
        groups = out_groups
    return Plan(height=height, width=width, leaves=leaves, steps=steps, cuts_x=cx_leaf, cuts_y=cy_leaf)
