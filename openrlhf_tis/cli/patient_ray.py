"""`ray`'s own command line with the fork's patient wait for a new node: `python -m openrlhf_tis.cli.patient_ray start
--head ...` takes exactly what `.venv/bin/ray` takes, and `--no-ray-client` before it.

Ray 2.55 gives a node it starts 30 s to register in the GCS (ray/_private/node.py, no setting); on a loaded 2-core
machine the raylet takes longer and `ray start` dies with "The current node timed out during startup" (seen in a
fresh-clone run of the suite beside other work: a test's head failed 5 tries of 160 s each, `Deadline Exceeded`).
The fork's own local clusters wait `REGISTRATION_WAIT_S` (cli/ray_cluster.py `init_local_ray`); a cluster started by
hand for `ray job submit`, and the tests' heads, get the same wait through this command, and their agents' ports
chosen before the raylet starts (cli/agent_ports.py).

`--no-ray-client`: start no Ray Client server (`ray://`; `ray job submit` talks to the dashboard instead). A head's
client server starts beside its raylet and waits for the node for Ray's fixed 30 s (`services.get_node_with_retry`,
in its own process, out of this command's reach); when the node registers later it exits, and `ray start --block`
then stops the whole head. Seen in a fresh-clone run of the suite: the dashboard's 9 module processes took 69 s to
start at a load of 4–8, the raylet registered 78 s after the start, and the client server had given up at 30 s.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence

from openrlhf_tis.cli.agent_ports import agent_ports_given
from openrlhf_tis.cli.ray_cluster import REGISTRATION_WAIT_S, patient_get_node
from openrlhf_tis.upstream_guards import require_version, swapped

_THIS_FILE = "openrlhf_tis/cli/patient_ray.py"
NO_RAY_CLIENT = "--no-ray-client"


def _ray_client_left_out() -> ImportError:
    """What `ray start` reads as "the Ray Client's dependencies are missing": it then starts no client server."""
    return ImportError(f"left out by {NO_RAY_CLIENT}")


def main(argv: Sequence[str] | None = None) -> None:
    """Run Ray's command line on `argv` (default: this process's arguments) while `services.get_node` is patient;
    `ray start --block` stays in here for the cluster's life, so the wait covers the node it starts."""
    import ray.scripts.scripts as ray_scripts
    from ray._private import services

    require_version("ray", "==2.55.0", patch=_THIS_FILE)
    args = list(sys.argv[1:] if argv is None else argv)
    no_client = bool(args) and args[0] == NO_RAY_CLIENT
    if no_client and any(arg.startswith("--ray-client-server-port") for arg in args):
        raise SystemExit(f"patient_ray: {NO_RAY_CLIENT} and --ray-client-server-port contradict each other (`ray "
                         "start` starts a client server wherever its port is given)")
    sys.argv = ["ray", *args[no_client:]]
    with contextlib.ExitStack() as swaps:
        swaps.enter_context(swapped(services, "get_node", patient_get_node(services.get_node, REGISTRATION_WAIT_S),
                                    patch=_THIS_FILE))
        swaps.enter_context(agent_ports_given())
        if no_client:
            swaps.enter_context(swapped(ray_scripts, "get_ray_client_dependency_error", _ray_client_left_out,
                                        patch=_THIS_FILE))
        ray_scripts.main()


if __name__ == "__main__":
    main()
