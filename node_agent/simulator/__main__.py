"""``python -m node_agent.simulator``: see node_agent.simulator.cli."""

from node_agent.simulator.cli import main

raise SystemExit(main())
