"""`ray`'s own command line with the fork's patient wait for a new node: `python -m openrlhf_tis.cli.patient_ray start
--head ...` takes exactly what `.venv/bin/ray` takes.

Ray 2.55 gives a node it starts 30 s to register in the GCS (ray/_private/node.py, no setting); on a loaded 2-core
machine the raylet takes longer and `ray start` dies with "The current node timed out during startup" (seen in a
fresh-clone run of the suite beside other work: a test's head failed 5 tries of 160 s each, `Deadline Exceeded`).
The fork's own local clusters wait `REGISTRATION_WAIT_S` (cli/ray_cluster.py `init_local_ray`); a cluster started by
hand for `ray job submit`, and the tests' heads, get the same wait through this command.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from openrlhf_tis.cli.ray_cluster import REGISTRATION_WAIT_S, patient_get_node
from openrlhf_tis.upstream_guards import require_version, swapped

_THIS_FILE = "openrlhf_tis/cli/patient_ray.py"


def main(argv: Sequence[str] | None = None) -> None:
    """Run Ray's command line on `argv` (default: this process's arguments) while `services.get_node` is patient;
    `ray start --block` stays in here for the cluster's life, so the wait covers the node it starts."""
    from ray._private import services
    from ray.scripts.scripts import main as ray_main

    require_version("ray", "==2.55.0", patch=_THIS_FILE)
    sys.argv = ["ray", *(sys.argv[1:] if argv is None else argv)]
    with swapped(services, "get_node", patient_get_node(services.get_node, REGISTRATION_WAIT_S), patch=_THIS_FILE):
        ray_main()


if __name__ == "__main__":
    main()
