"""The kubelet as the agent sees it: which GPUs each pod holds, and which pod a process runs in."""
