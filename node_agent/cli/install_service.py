"""gpufrac-agent install-service: the systemd unit that runs the system agent."""

from __future__ import annotations

import grp
import os
import shlex
import sys
from importlib import resources

from traitlets import Unicode

from node_agent.cli.command import CONFIG_NAME, SYSTEM_CONFIG_DIR, GpuFracAgent, UsageError
from node_agent.client import SYSTEM_SOCKET

UNIT_NAME = "gpufrac-agent.service"


class InstallServiceApp(GpuFracAgent):
    name = "gpufrac-agent install-service"
    description = f"""Write the systemd unit that runs the system agent (as root, on
    {SYSTEM_SOCKET} with its state in /var/lib/gpufrac), and say how to start it.

    gpufrac-agent install-service [--admin-group G] [--unit-dir DIR]"""
    examples = "gpufrac-agent install-service --admin-group gpu-admins"

    unit_dir = Unicode("/etc/systemd/system", help="Where the unit file goes.").tag(config=True)
    admin_group = Unicode("", help="Members of this group see and manage every lease "
                          "(serve's --admin-group).").tag(config=True)

    aliases = {**GpuFracAgent.aliases, "unit-dir": "InstallServiceApp.unit_dir",
               "admin-group": "InstallServiceApp.admin_group"}

    def execute(self) -> int:
        self.no_arguments()
        if os.geteuid() != 0 and self.unit_dir == "/etc/systemd/system":
            raise UsageError("the system unit is root's to install: run it with sudo (or give "
                             "--unit-dir to write the unit elsewhere)")
        if self.admin_group:
            try:
                grp.getgrnam(self.admin_group)
            except KeyError:
                raise UsageError(f"--admin-group: no group {self.admin_group!r}") from None
        command = [sys.executable, "-m", "node_agent", "serve", "--socket", SYSTEM_SOCKET,
                   "--state-dir", "/var/lib/gpufrac"]
        if self.admin_group:
            command += ["--admin-group", self.admin_group]
        template = resources.files("node_agent").joinpath("systemd", UNIT_NAME).read_text()
        unit = template.replace("@EXEC_START@", shlex.join(command))
        os.makedirs(self.unit_dir, exist_ok=True)
        path = os.path.join(self.unit_dir, UNIT_NAME)
        with open(path, "w") as out:
            out.write(unit)
        os.chmod(path, 0o644)
        print(f"gpufrac-agent: wrote {path}\n"
              "Start it now and at every boot:\n"
              "  systemctl daemon-reload && systemctl enable --now gpufrac-agent\n"
              f"Node settings go in {SYSTEM_CONFIG_DIR}/{CONFIG_NAME}.py; every user's Jupyter "
              f"server, kernels and CLI find the agent at {SYSTEM_SOCKET}.")
        return 0
