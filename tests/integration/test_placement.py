"""Colocation of the RL roles, checked from Ray's own records: `plan_slots` + `WorkerGroup` start
tiny workers (no model) in a private Ray, and Ray's actor table, its placement-group table and each
actor's runtime context say where every worker landed.

- `pairs`: actor worker i and reference worker i share bundle i of one placement group; critic i and
  reward i share bundle i of another; the rollout engines have their own.
- `all`: worker i of every role, rollout included, is in bundle i of the one placement group.
- `none`: every role has its own placement group; no two workers share a bundle.
In every case the workers of a bundle split its CPUs and run on the node Ray put the bundle on, at the priority
of the process that started them.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

import pytest

from alignflow.stages.common.workers import Worker

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]

ROLES = {"actor": 2, "critic": 2, "reference": 2, "reward": 2, "rollout": 1}  # one rollout engine, as the tiny configs run
CPUS_PER_BUNDLE = 0.2  # `none` needs 9 bundles: 1.8 of the 2 CPUs


class Probe(Worker):
    def where(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {"actor_id": ctx.get_actor_id(), "placement_group": ctx.get_placement_group_id(), "node": ctx.get_node_id(),
                "cpus": ctx.get_assigned_resources().get("CPU", 0.0), "nice": os.nice(0)}


def ray_actor_table() -> dict[str, dict]:
    """Ray's actor table as the GCS holds it: {actor id: placement group, bundle, node, CPUs}. The
    public `ray.util.state.list_actors` reads the same table through the dashboard, which the private
    test instance does not start; the bundle is in the names of the resources Ray reserved for the
    actor (`CPU_group_<bundle>_<placement group>`)."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    table = {}
    for raw in state._connect_and_get_accessor().get_actor_table(None, None):
        actor = gcs_pb2.ActorTableData.FromString(raw)
        if actor.state != gcs_pb2.ActorTableData.ALIVE:
            continue
        bundles = {(int(m[1]), m[2]): amount for name, amount in actor.required_resources.items()
                   if (m := re.fullmatch(r"CPU_group_(\d+)_([0-9a-f]+)", name))}
        ((bundle, group), cpus), = bundles.items()  # exactly one bundle of one placement group
        assert group == actor.placement_group_id.hex()
        table[actor.actor_id.hex()] = {"placement_group": group, "bundle": bundle, "node": actor.node_id.hex(), "cpus": cpus}
    return table


def placements(colocate: str) -> dict[str, list[dict]]:
    """{role: [where worker i is, per Ray]} for the RL roles planned with `colocate`."""
    import ray

    from alignflow.stages.common.workers import WorkerGroup, plan_slots, release

    slots = plan_slots(ROLES, CPUS_PER_BUNDLE, 0, colocate)
    groups = []
    try:
        groups = [WorkerGroup(role, Probe, slots[role]) for role in ROLES]
        seen = {g.role: g.call("where") for g in groups}
        actors, bundles = ray_actor_table(), ray.util.placement_group_table()
        out = {}
        for role, workers in seen.items():
            out[role] = []
            for w in workers:
                ray_view = actors[w["actor_id"]]
                # The actor's own runtime context agrees with Ray's tables.
                assert (w["placement_group"], w["node"]) == (ray_view["placement_group"], ray_view["node"])
                assert w["cpus"] == pytest.approx(ray_view["cpus"])
                # At the driver's priority, not at the nice 15 Ray gives actors: a busy machine would starve them.
                assert w["nice"] == os.nice(0), (role, w["nice"])
                table = bundles[ray_view["placement_group"]]
                assert table["bundles_to_node_id"][ray_view["bundle"]] == ray_view["node"]
                out[role].append({**ray_view, "bundle_cpus": table["bundles"][ray_view["bundle"]]["CPU"]})
        return out
    finally:
        for group in groups:
            group.kill()
        release(slots)


def bundle_of(where: dict) -> tuple[str, int]:
    return where["placement_group"], where["bundle"]


@pytest.mark.parametrize("colocate", ["pairs", "all", "none"])
def test_colocation_places_roles_in_shared_bundles(colocate):
    where = placements(colocate)
    assert {role: len(w) for role, w in where.items()} == ROLES
    for role, workers in where.items():  # a role's workers are in bundles 0..n-1 of one placement group
        assert [w["bundle"] for w in workers] == list(range(len(workers)))
        assert len({w["placement_group"] for w in workers}) == 1

    if colocate == "pairs":
        expected = [{"actor", "reference"}, {"critic", "reward"}, {"rollout"}]
    elif colocate == "all":
        expected = [set(ROLES)]
    else:
        expected = [{role} for role in ROLES]
    groups = defaultdict(set)
    for role, workers in where.items():
        groups[workers[0]["placement_group"]].add(role)
    assert sorted(map(sorted, groups.values())) == sorted(map(sorted, expected))

    # Worker i of roles sharing a placement group shares its bundle i; nothing else shares a bundle.
    sharing = defaultdict(list)
    for role, workers in where.items():
        for i, w in enumerate(workers):
            sharing[bundle_of(w)].append((role, i))
    for members in sharing.values():
        assert len({i for _, i in members}) == 1, members
    if colocate == "none":
        assert all(len(m) == 1 for m in sharing.values())
    for pg_roles in expected:  # e.g. with `all`, bundle 0 holds worker 0 of all five roles
        assert sorted(sharing[bundle_of(where[min(pg_roles)][0])]) == sorted((r, 0) for r in pg_roles)

    # The workers of a bundle split its CPUs between them, all of them.
    for key, members in sharing.items():
        cpus = [next(w for w in where[r] if bundle_of(w) == key)["cpus"] for r, _ in members]
        capacity = next(w for w in where[members[0][0]] if bundle_of(w) == key)["bundle_cpus"]
        assert capacity == pytest.approx(CPUS_PER_BUNDLE)
        assert sum(cpus) == pytest.approx(capacity, abs=1e-3) and len(set(cpus)) == 1
