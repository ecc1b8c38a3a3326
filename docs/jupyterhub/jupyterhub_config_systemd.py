"""JupyterHub on one shared GPU node, with SystemdSpawner (`pip install jupyterhub-systemdspawner`).

Each user's server runs in a systemd unit of its own (`jupyter-<user>-singleuser`), as that
user, with host memory and CPU limits: systemd enforces the host side, the gpufrac agent
the GPU side. Everything the LocalProcessSpawner example says holds here too; this file loads
it and changes only the spawner. Walk-through: docs/jupyterhub.md.

    sudo jupyterhub -f /etc/jupyterhub/jupyterhub_config_systemd.py
"""

import os

c = get_config()  # noqa: F821  (traitlets provides get_config and load_subconfig in config files)

# Authenticator, single-user command, agent socket, provisioner and shares: as there.
load_subconfig(os.path.join(os.path.dirname(__file__), "jupyterhub_config.py"))  # noqa: F821

c.JupyterHub.spawner_class = "systemd"
# Real Unix users, not DynamicUser=: the agent knows a lease's owner by uid and a member of
# --admin-group by supplementary groups, and checkpoints must stay the same user's across
# restarts. A transient uid would lose all three.
c.SystemdSpawner.dynamic_users = False
# Never PrivateDevices=: it hides /dev/nvidia*, and the kernels would see no GPU at all.
c.SystemdSpawner.isolate_devices = False
# A /tmp of their own per user; the agent's socket is in /run, untouched by it.
c.SystemdSpawner.isolate_tmp = True
# No sudo from a notebook: a kernel that became root could release or kill anyone's lease.
c.SystemdSpawner.disable_user_sudo = True
# Host memory and CPU per user (the GPU share is the agent's business, not systemd's).
c.SystemdSpawner.mem_limit = "32G"
c.SystemdSpawner.cpu_limit = 4.0
# All users' servers together in one slice, to cap Jupyter as a whole on a node that also
# runs jobs: create jupyter.slice first (e.g. MemoryMax= in /etc/systemd/system/jupyter.slice).
c.SystemdSpawner.slice = "jupyter.slice"
# Stopping a unit: SIGTERM to the server alone (KillMode=mixed), so that it shuts its kernels
# down itself and gives their leases back; whatever still runs a minute later is killed, and
# the agent releases such leases after its --orphan-grace.
c.SystemdSpawner.unit_extra_properties = {"KillMode": "mixed", "TimeoutStopSec": "60"}
