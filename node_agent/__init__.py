"""The jupyter-gpufrac node agent: GPU leases, placement, compaction and reclaim for one node."""

__version__ = "0.1.0"
