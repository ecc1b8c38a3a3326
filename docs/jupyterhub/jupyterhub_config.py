"""JupyterHub on one shared GPU node, with LocalProcessSpawner (JupyterHub's default spawner).

Every user's single-user server runs as that user's Unix account, with jupyter-gpufrac
installed beside JupyterHub, and leases GPU shares from the node's one system agent
(`sudo gpufrac-agent install-service --admin-group gpu-admins`). Walk-through:
docs/jupyterhub.md. tests/hub/ runs this very file (with loopback ports, test users and a
temporary agent socket put over it), so what is written here is what is tested.

    sudo jupyterhub -f /etc/jupyterhub/jupyterhub_config.py
"""

import os
import sys

c = get_config()  # noqa: F821  (traitlets provides get_config in config files)

# The system agent's socket (install-service's default) and its --admin-group: members see and
# manage every lease on the node, and are this Hub's admins too, so one group means both.
AGENT_SOCKET = "/run/gpufrac/agent.sock"
GPU_ADMINS = "gpu-admins"
GPU_USERS = "gpu-users"

# Real Unix users, logged in with their passwords (PAM). The Hub runs as root to start each
# user's server as that user.
c.JupyterHub.authenticator_class = "pam"
c.PAMAuthenticator.allowed_groups = {GPU_USERS, GPU_ADMINS}
c.PAMAuthenticator.admin_groups = {GPU_ADMINS}

c.JupyterHub.spawner_class = "localprocess"
# The single-user server of the environment that has jupyter-gpufrac (this one, when the Hub
# and the users' servers share one environment). Every user must be able to run its Python:
# an interpreter under a 0700 home (pyenv in /root) cannot start as anyone else.
c.Spawner.cmd = [os.path.join(sys.prefix, "bin", "jupyterhub-singleuser")]
c.Spawner.environment = {
    # Said explicitly: a server that started before the agent would otherwise fall back to a
    # per-user socket and an agent of its own.
    "GPUFRAC_AGENT_SOCKET": AGENT_SOCKET,
    # Every kernelspec leases its GPU share through the agent, not only those that name it.
    "JUPYTER_DEFAULT_PROVISIONER_NAME": "gpufrac-provisioner",
}
c.Spawner.args = [
    # The system agent owns the GPUs. A user's server that finds it down must not start an
    # agent of its own: it would hand out the same GPUs a second time.
    "--GpuFrac.embedded_agent=False",
]
# A user's share when neither the kernelspec nor their last `%gpu request` says: a quarter of a
# GPU guaranteed, bursting to a whole one while the GPU is idle.
c.Spawner.args += ["--GpuFrac.default_request=0.25", "--GpuFrac.default_limit=1"]

# Stopping a server takes its kernels with it; their leases are given back as they stop, and the
# agent releases whatever a killed server left behind (after its --orphan-grace).
c.JupyterHub.cleanup_servers = True
# A server told to stop (the Hub's stop, its idle culler) first makes every kernel's checkpoint
# durable, within its --GpuFrac.stop_grace_period (20 s): the next kernel of each notebook
# resumes it. LocalProcessSpawner sends SIGINT, then SIGTERM after interrupt_timeout (10 s by
# default) and SIGKILL after term_timeout: leave the grace room before the SIGKILL.
c.LocalProcessSpawner.interrupt_timeout = 30
